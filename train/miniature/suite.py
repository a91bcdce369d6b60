"""The miniature's studies of r_c: settings x noise levels x seeds, with paired intervals and a seed-level verdict.

One YAML (`train/configs/miniature_study.yaml`): the miniature's keys plus a `study:` section:

    study:
      seeds: [0, 1, 2, 3, 4, 5, 6, 7]
      noise: {0.0: [sft, grpo_a, grpo_b, grpo_f, grpo_g, grpo_h]}        # gold noise: the fraction of rows corrupted
      key_noise: {0.25: [sft, grpo_a, grpo_f, grpo_g]}                   # key frame moved on a fraction of positives

For each level and seed a miniature run goes to `OUTPUT_DIR/<level>/seed-<seed>` (`noise-0.15`, `key-noise-0.25`)
with those models (`train.miniature.study.Miniature`; each stage writes its `done.json` and is skipped on a rerun).
The runs go seed by seed, each seed over every level, so a study stopped part-way has whole seeds; `--seeds` runs a
stage of them. A noisy run copies the warm-up of the clean run of its seed, which reads a pool of rows of its own
(`warmup_pool_rows`, required for a noisy level): no noisy run sees the clean labels of its rows. After every run,
`OUTPUT_DIR/study.json`, `study.md` and `study.png` are rewritten over the runs finished so far: per level the seeds
table, every paired difference per seed and pooled with a rows-only and a seeds-and-rows interval, the verdict
(`seed_level_verdict`: an effect only where the seeds-and-rows interval excludes 0), exact-key accuracy, reward spread
and the verifier; across key-noise rates each difference minus its clean value; and the conclusions, written by the
rule.

Each finished run also leaves a record, `OUTPUT_DIR/records/<level>-seed-<seed>.json.gz` (its `results.json` and the
per-row scores of every model): the summary reads the records only, and a run whose record is there is not run again,
even when its folder is gone. Records copied in from another machine's study of the same configuration are pooled
with this one's (the summary refuses records whose configurations differ outside seed, noise and models).

A seed whose warm-up reaches its step cap before its targets, or whose clean SFT misses `sft_policy_gate`, is excluded,
not trained further: its clean run leaves `OUTPUT_DIR/records/seed-<seed>-excluded.json` with the reason, its other runs
do not start, and study.md names it. The exclusion is decided from the warm-up and the clean SFT, before any arm
trains, so it cannot favour one model over another.

    python -m train.miniature.suite --config train/configs/miniature_study.yaml --output_dir miniature-study
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from emrl_data.atomic_write import write_bytes_atomic, write_text_atomic
from emrl_data.text.evaluation import score_predictions
from train.checks import SeedMissed, TrainConfigError, run_cli
from train.miniature.config import MiniatureConfig, config_from_dict
from train.miniature.diagnose import BY_DISTANCE
from train.miniature.power import (
    KEY_METRICS,
    METRICS,
    benjamini_hochberg,
    contrast_bootstrap,
    exact_key,
    hierarchical_paired_bootstrap,
    holm,
    k_hit,
    lesion_metrics,
    paired_bootstrap,
    random_lesion_frame,
)
from train.miniature.seeds import seeds_markdown, summarize_seeds
from train.miniature.study import POLICY_MISSED, Miniature
from train.tiny.synthetic import make_visible_rows


# The paired differences a study may report: (first run, second run) -> its name; each where a level has both runs.
COMPARISONS = {
    ("grpo_a", "more_sft_llm"): "(a) - (e)",
    ("grpo_a", "grpo_f"): "(a) - (f)",
    ("grpo_a", "grpo_b"): "(a) - (b)",
    ("grpo_f", "grpo_b"): "(f) - (b)",
    ("grpo_a", "grpo_g"): "(a) - (g)",
    ("grpo_g", "grpo_f"): "(g) - (f)",
    ("grpo_h", "grpo_f"): "(h) - (f)",
    ("grpo_h", "grpo_b"): "(h) - (b)",
}
# Those a study reports when its config's `study.report` does not name them.
DEFAULT_COMPARISONS = ("(a) - (e)", "(a) - (f)", "(a) - (b)", "(a) - (g)", "(g) - (f)", "(h) - (f)", "(h) - (b)")
FAMILY_ALPHA = 0.05
# A seeds-and-rows bound within EDGE_MC_ERRORS Monte Carlo standard errors of 0 is drawn again with EDGE_DRAWS times the
# draws; still within, its verdict is "edge": the draws cannot tell its side of 0, so no effect is claimed.
EDGE_MC_ERRORS, EDGE_DRAWS = 3.0, 10
# Across key-frame-noise rates: how a difference at rate r moved from its value on clean gold (same seeds, same rows).
TRENDS = {("grpo_a", "grpo_f"): "(a) - (f)", ("grpo_g", "grpo_f"): "(g) - (f)"}
MIN_SEEDS = 5
MIN_FINISHED_SEEDS = 8  # the rule decides a difference only over at least this many finished seeds
# The rates of K-Hit taken apart that a comparison may draw (`power.lesion_metrics`).
IN_LESION = ("lesion_frame", "k_hit_in_lesion", "exact_in_lesion", "exact_of_hits")
KEY_NOISE = "key-noise-"  # a key-frame-noise level's name: key-noise-<rate> (a float level is gold noise)
Level = float | str


@dataclass(frozen=True)
class Report:
    """How a study's report is drawn (`study.report` in its YAML; every key optional).

    n_bootstrap: draws per interval and p-value, through `power.contrast_bootstrap`; None: the runs' own
        `n_bootstrap`, through `emrl_data.text.bootstrap`, without p-values (and without what needs them below).
    comparisons: the names of the `COMPARISONS` reported.
    family: the metrics whose pooled differences (every level, every key-noise trend) form the family whose
        p-values are adjusted by Holm and by Benjamini-Hochberg.
    lesion_frames: K-Hit taken apart per model against SFT (`power.lesion_metrics`).
    gain_gap: the comparisons whose exact-key difference minus their K-Hit difference is reported.
    in_lesion: rates of `power.lesion_metrics` (e.g. `exact_in_lesion`) compared beside K-Hit in every comparison.
    finished_seeds: the study's results are the first this many seeds, in list order, to finish every setting.
    decision: a pilot's rule, `{comparison, metric, margin}`: passed where that pooled difference exceeds `margin`
        points with its seeds-and-rows interval above 0 (`pilot_decision`), over `finished_seeds` seeds; with
        `min_effect` (points), the finished seeds a study needs to detect that effect with 80 % power at the pilot's
        spread.
    """

    n_bootstrap: int | None = None
    comparisons: tuple[str, ...] = DEFAULT_COMPARISONS
    family: tuple[str, ...] = ()
    lesion_frames: bool = False
    gain_gap: tuple[str, ...] = ()
    in_lesion: tuple[str, ...] = ()
    finished_seeds: int = MIN_FINISHED_SEEDS
    decision: dict[str, Any] | None = None


def load_report(path: str | Path) -> Report:
    """Return the `study.report` options of a study YAML (the defaults where it has none); one-line errors."""
    study = (yaml.safe_load(Path(path).read_text()) or {}).get("study") or {}
    data = study.get("report") or {}
    if not isinstance(data, dict) or not set(data) <= set(Report.__dataclass_fields__):
        raise TrainConfigError(f"{path}: study.report takes the keys {sorted(Report.__dataclass_fields__)}")
    report = Report(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})  # type: ignore[arg-type]
    names = set(COMPARISONS.values())
    unknown = sorted((set(report.comparisons) | set(report.gain_gap)) - names)
    if unknown:
        raise TrainConfigError(f"{path}: study.report names unknown comparisons {unknown}; known: {sorted(names)}")
    if not set(report.family) <= {"average_bacc", "k_hit", "exact_key"}:
        raise TrainConfigError(f"{path}: study.report.family takes metrics of average_bacc, k_hit, exact_key")
    needs_draws = report.family or report.lesion_frames or report.gain_gap or report.in_lesion or report.decision
    if needs_draws and (report.n_bootstrap is None or report.n_bootstrap < 1000):
        raise TrainConfigError(
            f"{path}: study.report's family, lesion_frames, gain_gap, in_lesion and decision need n_bootstrap >= 1000"
        )
    if not set(report.in_lesion) <= set(IN_LESION):
        raise TrainConfigError(f"{path}: study.report.in_lesion takes rates of {list(IN_LESION)}")
    if report.finished_seeds < 1:
        raise TrainConfigError(f"{path}: study.report.finished_seeds={report.finished_seeds} must be at least 1")
    if report.decision is not None:
        check_decision(report, path)
    return report


def check_decision(report: Report, path: str | Path) -> None:
    """Refuse, in one line, a `decision` whose comparison or metric the report does not draw, without a margin, or with
    a `min_effect` that is not a positive number of points."""
    decision = report.decision or {}
    drawn = {"average_bacc", "k_hit", "exact_key", *report.in_lesion}
    if not {"comparison", "metric", "margin"} <= set(decision) <= {"comparison", "metric", "margin", "min_effect"}:
        raise TrainConfigError(
            f"{path}: study.report.decision takes the keys comparison, metric and margin (points), and min_effect"
        )
    if "min_effect" in decision and not (
        isinstance(decision["min_effect"], int | float) and decision["min_effect"] > 0
    ):
        raise TrainConfigError(f"{path}: study.report.decision.min_effect={decision['min_effect']!r}: points above 0")
    if decision["comparison"] not in report.comparisons or decision["metric"] not in drawn:
        raise TrainConfigError(
            f"{path}: study.report.decision: {decision['metric']}: {decision['comparison']} is not drawn (comparisons "
            f"{list(report.comparisons)}, metrics {sorted(drawn)})"
        )


def load_study(path: str | Path, overrides: dict[str, Any] | None = None) -> tuple[MiniatureConfig, list[int], dict]:
    """Return (the miniature config, the seeds, {noise level: models}) of a study YAML; one-line errors. Its report
    options: `load_report`."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    study = data.pop("study", None)
    keys = {"seeds", "noise", "key_noise", "report"}
    if not isinstance(study, dict) or not {"seeds", "noise"} <= set(study) <= keys:
        raise TrainConfigError(
            f"{path}: needs a `study:` section with the keys seeds and noise (and key_noise, report)"
        )
    load_report(path)
    cfg = config_from_dict(data | (overrides or {}), path)
    seeds = [int(s) for s in study["seeds"]]
    levels: dict[Level, list[str]] = {float(k): list(v) for k, v in study["noise"].items()}
    if 0.0 not in levels:
        raise TrainConfigError(f"{path}: study.noise needs the clean level 0.0 (the noisy runs reuse its warm-up)")
    for rate, models in (study.get("key_noise") or {}).items():
        if not 0 < float(rate) < 1:
            raise TrainConfigError(f"{path}: study.key_noise rate {rate} must be in (0, 1); rate 0 is the clean level")
        levels[f"{KEY_NOISE}{float(rate):.2f}"] = list(models)
    for level, models in levels.items():
        config_from_dict(data | overrides_of(level) | {"models": models}, path)  # each level's config is valid
    return cfg, seeds, levels


def overrides_of(level: Level) -> dict[str, Any]:
    """Return the config keys a level sets: `gold_noise` (a float level) or `key_frame_noise` (`key-noise-<rate>`)."""
    if isinstance(level, str):
        return {"gold_noise": 0.0, "key_frame_noise": float(level.removeprefix(KEY_NOISE))}
    return {"gold_noise": level, "key_frame_noise": 0.0}


def level_name(level: Level) -> str:
    """Return a level's folder and record name: noise-<level> for gold noise, key-noise-<rate> for key-frame noise."""
    return level if isinstance(level, str) else f"noise-{level:.2f}"


def level_key(level: Level) -> str:
    """Return a level's key in the summary: "0.15" for gold noise, "key-noise-0.25" for key-frame noise."""
    return level if isinstance(level, str) else f"{level:.2f}"


def describe(level: Level) -> str:
    """Return a level as the progress lines name it."""
    return level if isinstance(level, str) else f"gold noise {level:.2f}"


def level_order(level: Level) -> tuple[int, float]:
    """Sort key: the gold-noise levels (clean first), then the key-frame-noise levels by rate."""
    return (1, overrides_of(level)["key_frame_noise"]) if isinstance(level, str) else (0, level)


def run_dir(output_dir: str | Path, level: Level, seed: int) -> Path:
    """Return one run's folder."""
    return Path(output_dir) / level_name(level) / f"seed-{seed}"


def run_study(
    cfg: MiniatureConfig,
    seeds: list[int],
    levels: dict[Level, list[str]],
    output_dir: str | Path,
    log: Any = None,
    jobs: int = 1,
    threads: int | None = None,
    only: list[int] | None = None,
    report: Report | None = None,
) -> dict[str, Any]:
    """Run (or resume) every run of the study, rewriting the summary after each (drawn as `report` says); return the
    last summary.

    With `jobs` > 1 that many runs go at once, each in its own process with `threads` torch threads (default: the
    cores shared out); the runs start in the sequential order, a noisy one once its seed's clean warm-up is there.
    With one job, `threads` (when given) sets this process's torch threads. `only`: run these of `seeds` now.
    """
    log = log or (lambda line: print(line, flush=True))
    noisy = sorted(level_name(level) for level in levels if level != 0.0)
    if noisy and cfg.warmup_pool_rows == 0:
        raise TrainConfigError(
            f"miniature study: the noisy levels {noisy} need warmup_pool_rows > 0: a warm-up on the clean training rows "
            "would show each noisy run the clean labels of its own rows"
        )
    if jobs == 1 and threads is not None:
        # lazy: torch adds 2-3 s to every process that imports this module (measured); only the model stages need it
        import torch

        torch.set_num_threads(threads)
    tasks = []
    excluded = read_exclusions(output_dir, seeds)
    for seed in seeds if only is None else [s for s in seeds if s in only]:  # seed by seed, every level (the clean
        # one first: the noisy runs copy its warm-up); `only`: a stage of the study, the summary still over `seeds`
        for level in sorted(levels, key=level_order):
            if seed in excluded and not finished_seeds(output_dir, level, [seed], levels[level]):
                log(f"=== {describe(level)}, seed {seed}: excluded ({exclusion_path(output_dir, seed)}), skipped")
            elif finished_seeds(output_dir, level, [seed], levels[level]):
                log(f"=== {describe(level)}, seed {seed}: recorded in {record_path(output_dir, level, seed)}, skipped")
            else:
                tasks.append((level, seed))
    summary = None

    needed = (report or Report()).finished_seeds

    def in_study(seed: int) -> bool:  # False once the study has its seeds and `seed` comes after them
        return seed in study_seeds(output_dir, seeds, levels, needed)

    if jobs == 1:
        for level, seed in tasks:
            if exclusion_path(output_dir, seed).exists():  # its clean run's warm-up missed its targets just now
                log(f"=== {describe(level)}, seed {seed}: excluded, skipped")
                continue
            if not in_study(seed):
                log(f"=== {describe(level)}, seed {seed}: after the study's seeds, skipped")
                continue
            threads_used = _run_one(cfg, levels, output_dir, level, seed, log)
            summary = (
                None
                if threads_used is None
                else _record_and_summarize(cfg, seeds, levels, output_dir, level, seed, threads_used, report)
            )
    else:
        for level, seed, threads_used in _run_in_processes(
            cfg, levels, output_dir, tasks, jobs, threads, log, in_study
        ):
            summary = (
                None
                if threads_used is None
                else _record_and_summarize(cfg, seeds, levels, output_dir, level, seed, threads_used, report)
            )
    if summary is None:  # every run was recorded before, or the last one was excluded
        summary = write_summary(output_dir, seeds, levels, cfg.n_bootstrap, report)
    log((Path(output_dir) / "study.md").read_text())
    return summary


def _run_one(
    cfg: MiniatureConfig,
    levels: dict[Level, list[str]],
    output_dir: str | Path,
    level: Level,
    seed: int,
    log: Any,
    warmup_only: bool = False,
) -> int | None:
    """Run (or resume) one run of the study, or with `warmup_only` the data and warm-up of its seed's clean run;
    return the torch threads it ran with, or None when the seed missed a gate (`SeedMissed`: the warm-up's targets by
    its step cap, or the clean SFT's policy check): the seed is then excluded (`write_exclusion`)."""
    import torch  # lazy: torch (see run_study)

    clean = run_dir(output_dir, 0.0, seed)
    clean_cfg = replace(cfg, seed=seed, models=levels[0.0], **overrides_of(0.0))
    try:
        if warmup_only:
            Miniature(clean_cfg, clean, log=log).run(stages=("data", "warmup"))
            return torch.get_num_threads()
        folder = run_dir(output_dir, level, seed)
        log(f"=== {describe(level)}, seed {seed}: {folder}")
        miniature = Miniature(replace(cfg, seed=seed, models=levels[level], **overrides_of(level)), folder, log=log)
        if level != 0.0:
            if not (clean / "warmup" / "done.json").exists():  # only the clean run's record is left: warm up again
                log(f"   the clean run's warm-up is not in {clean}: running it there first")
                Miniature(clean_cfg, clean, log=log).run(stages=("data", "warmup"))
            miniature.reuse(clean, stages=("warmup",))
        miniature.run()
    except SeedMissed as exc:
        path = write_exclusion(output_dir, seed, str(exc), clean_cfg)
        log(f"=== seed {seed} excluded ({path}): {exc}")
        return None
    return torch.get_num_threads()


def _record_and_summarize(
    cfg: MiniatureConfig,
    seeds: list[int],
    levels: dict[Level, list[str]],
    output_dir: str | Path,
    level: Level,
    seed: int,
    threads: int,
    report: Report | None = None,
) -> dict[str, Any]:
    write_record(output_dir, level, seed, levels[level], torch_threads=threads)
    return write_summary(output_dir, seeds, levels, cfg.n_bootstrap, report)  # the finished runs so far


def _worker(
    threads: int,
    cfg: MiniatureConfig,
    levels: dict[Level, list[str]],
    output_dir: str,
    level: Level,
    seed: int,
    warmup_only: bool,
) -> int | None:
    import torch  # lazy: torch (see run_study)

    torch.set_num_threads(threads)
    prefix = f"[{describe(level)}, seed {seed}] "
    log = lambda line: print(prefix + line, flush=True)  # noqa: E731
    return _run_one(cfg, levels, output_dir, level, seed, log, warmup_only=warmup_only)


def _run_in_processes(
    cfg: MiniatureConfig,
    levels: dict[Level, list[str]],
    output_dir: str | Path,
    tasks: list[tuple[Level, int]],
    jobs: int,
    threads: int | None,
    log: Any,
    in_study: Any = None,
) -> Iterator[tuple[Level, int, int | None]]:
    """Run `tasks` (level, seed) in `jobs` spawned processes; yield each (level, seed, threads) as it finishes, with
    threads None where the seed's warm-up missed its targets (its other runs then do not start). `in_study(seed)`,
    asked after each finished run: False drops the seed's runs not yet started (the study has its seeds).

    A noisy run starts once its seed's clean warm-up is there (with `sft_policy_gate`, its clean SFT too, which decides
    the gate): made by the clean run, or, where only the clean run's record is left, by a warm-up of its own that runs
    first. The first failure stops new starts; the runs in flight
    finish, and the failure is raised. A worker exits when the study's process is gone (stopped by a signal to it
    alone, or killed), so no run outlives its study.
    """

    def warmed_up(seed: int) -> bool:
        return clean_run_ready(cfg, output_dir, seed)

    threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    pending: list[tuple[Level, int, bool]] = []  # (level, seed, warmup_only), in the sequential order
    for level, seed in tasks:
        clean_runs = (0.0, seed) in tasks
        if level != 0.0 and not clean_runs and not warmed_up(seed) and (0.0, seed, True) not in pending:
            pending.append((0.0, seed, True))
        pending.append((level, seed, False))
    log(f"=== {len(tasks)} runs, {jobs} at a time, {threads} torch thread(s) each")
    running: dict[Any, tuple[Level, int, bool]] = {}
    failure: BaseException | None = None
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=spawn, initializer=exit_with_parent, initargs=(os.getpid(),)) as pool:
        while running or (pending and failure is None):
            startable = [t for t in pending if t[0] == 0.0 or warmed_up(t[1])] if failure is None else []
            for task in startable[: jobs - len(running)]:
                pending.remove(task)
                running[pool.submit(_worker, threads, cfg, levels, str(output_dir), *task)] = task
            if not running:
                raise RuntimeError(f"miniature study: {pending} wait for a warm-up that no run makes")
            finished, _ = wait(running, timeout=5, return_when=FIRST_COMPLETED)
            for future in finished:
                level, seed, warmup_only = running.pop(future)
                if future.exception() is not None:
                    failure = failure or future.exception()
                elif future.result() is None:  # the seed is excluded
                    pending = [t for t in pending if t[1] != seed]
                    yield level, seed, None
                elif not warmup_only:
                    yield level, seed, future.result()
            if finished and in_study is not None and pending:  # the caller has recorded what finished
                dropped = sorted({t[1] for t in pending if not in_study(t[1])})
                if dropped:
                    log(f"=== the study has its finished seeds: seeds {dropped} do not start")
                    pending = [t for t in pending if t[1] not in dropped]
    if failure is not None:
        raise failure


def clean_run_ready(cfg: MiniatureConfig, output_dir: str | Path, seed: int) -> bool:
    """Whether a seed's noisy runs may start: its clean warm-up is done and, with `sft_policy_gate`, its clean SFT has
    met the gate (a clean run already recorded has met it). A clean SFT below the gate never lets them start, even in
    the moment before its run records the exclusion."""
    clean = run_dir(output_dir, 0.0, seed)
    if not (clean / "warmup" / "done.json").exists():
        return False
    if cfg.sft_policy_gate <= 0 or record_path(output_dir, 0.0, seed).exists():
        return True
    sft = clean / "sft" / "done.json"
    check = json.loads(sft.read_text()).get("policy_check") if sft.exists() else None
    return check is not None and check["lesion_frame"] >= cfg.sft_policy_gate


def exit_with_parent(parent_pid: int, interval_s: float = 2.0) -> None:
    """Start a daemon thread that ends this process once its parent `parent_pid` is gone (its parent changes)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(143)  # the study is gone: stop its run now, as a SIGTERM would

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def write_summary(
    output_dir: str | Path,
    seeds: list[int],
    levels: dict[Level, list[str]],
    n_bootstrap: int,
    report: Report | None = None,
) -> dict[str, Any]:
    """Write `study.json`, `study.md` and `study.png` of the runs finished so far; return the summary."""
    summary = summarize_study(output_dir, seeds, levels, n_bootstrap, report)
    out = Path(output_dir)
    (out / "study.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    (out / "study.md").write_text(study_markdown(summary))
    save_study_png(summary, out / "study.png")
    return summary


def record_path(output_dir: str | Path, level: Level, seed: int) -> Path:
    """Return one run's record: what the summary reads of it."""
    return Path(output_dir) / "records" / f"{level_name(level)}-seed-{seed}.json.gz"


def write_record(output_dir: str | Path, level: Level, seed: int, models: list[str], torch_threads: int) -> Path:
    """Keep a finished run's `results.json` and each model's per-row scores in its record; return the record's path.

    `torch_threads`: the threads the run trained with (the numbers depend on it). The bytes depend on the run only
    (gzip without a timestamp), so a rerun that changes nothing rewrites them equal.
    """
    folder = run_dir(output_dir, level, seed)
    scores = {}
    for name in models:
        lines = (folder / "eval" / name / "predictions.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        scores[name] = [  # the truth's key frame beside each score: exact-key accuracy (d = 0) reads it
            s | {"key_slice_frame": r.get("key_slice_frame")}
            for s, r in zip(score_predictions(rows), rows, strict=True)
        ]
    record = {
        "gold_noise": level,
        "seed": seed,
        "models": models,
        "torch_threads": torch_threads,
        "results": json.loads((folder / "results.json").read_text()),
        "scores": scores,
    }
    path = record_path(output_dir, level, seed)
    write_bytes_atomic(gzip.compress(json.dumps(record).encode(), mtime=0), path)
    return path


def read_record(path: Path) -> dict[str, Any]:
    """Return a run's record; a file that is not one is a one-line error naming it."""
    try:
        record = json.loads(gzip.decompress(path.read_bytes()))
    except (OSError, EOFError, ValueError) as exc:
        raise TrainConfigError(f"{path}: not a study record (a gzipped JSON file): {exc}") from exc
    missing = {"gold_noise", "seed", "models", "results", "scores"} - set(record)
    if missing:
        raise TrainConfigError(f"{path}: a study record without {sorted(missing)}")
    return record


def exclusion_path(output_dir: str | Path, seed: int) -> Path:
    """Return the file that excludes a seed from the study: its warm-up missed its targets by its step cap."""
    return Path(output_dir) / "records" / f"seed-{seed}-excluded.json"


def write_exclusion(output_dir: str | Path, seed: int, reason: str, cfg: MiniatureConfig) -> Path:
    """Exclude `seed` from the study, for `reason`, with the configuration of the warm-up that missed; return the
    file's path."""
    path = exclusion_path(output_dir, seed)
    write_text_atomic(json.dumps({"seed": seed, "reason": reason, "config": asdict(cfg)}, indent=2) + "\n", path)
    return path


def read_exclusions(output_dir: str | Path, seeds: list[int]) -> dict[int, str]:
    """Return {seed: reason} of the seeds of `seeds` the study excluded; a file that is not one is a one-line
    error naming it."""
    out = {}
    for seed in seeds:
        path = exclusion_path(output_dir, seed)
        if not path.exists():
            continue
        try:
            out[seed] = str(json.loads(path.read_text())["reason"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TrainConfigError(f"{path}: not a study exclusion (JSON with a reason): {exc}") from exc
    return out


def finished_seeds(output_dir: str | Path, level: Level, seeds: list[int], models: list[str]) -> list[int]:
    """Return the seeds whose run at `level` has a record holding every one of `models`."""
    done = []
    for seed in seeds:
        path = record_path(output_dir, level, seed)
        if path.exists() and set(models) <= set(read_record(path)["models"]):
            done.append(seed)
    return done


def study_seeds(
    output_dir: str | Path, seeds: list[int], levels: dict[Level, list[str]], needed: int = MIN_FINISHED_SEEDS
) -> list[int]:
    """Return the seeds the study pools: `seeds` up to the one with which `needed` of them have finished every setting,
    each seed before it finished or excluded; all of `seeds` until then.

    The study's results are the first `needed` seeds, in list order, to finish every setting: a seed finished later
    does not enter them (nor starts, in `run_study`), so adding seeds after reading the report changes nothing.
    """
    excluded, finished = read_exclusions(output_dir, seeds), 0
    for i, seed in enumerate(seeds):
        if all(finished_seeds(output_dir, level, [seed], models) for level, models in levels.items()):
            finished += 1
            if finished == needed:
                return seeds[: i + 1]
        elif seed not in excluded:
            return seeds  # a seed before the deciding one is still to run
    return seeds


POOLABLE_KEYS = {"seed", "gold_noise", "key_frame_noise", "models"}  # what may differ between the runs a study pools


def _check_poolable(records: dict[Path, dict[str, Any]]) -> None:
    """Refuse, in one line naming both files, records of runs whose configurations differ outside POOLABLE_KEYS. A
    record written before a setting existed ran with that setting's default."""
    defaults = asdict(MiniatureConfig())

    def settings(path: Path) -> dict[str, Any]:
        config = defaults | records[path]["results"]["config"]
        return {k: v for k, v in config.items() if k not in POOLABLE_KEYS}

    first, *rest = records
    ours = settings(first)
    for path in rest:
        theirs = settings(path)
        differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if differ:
            raise TrainConfigError(f"{path} and {first}: runs of different configurations ({differ}) cannot be pooled")


def _clean(value: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in value.items()}


def _intervals(groups: dict[int, Any], n_bootstrap: int, report: Report) -> tuple[dict, dict, dict]:
    """Return (per seed, pooled rows only, pooled seeds and rows) of a contrast: `groups` {seed: its terms}
    (`power.contrast_bootstrap`, `report.n_bootstrap` draws) or, without `report.n_bootstrap`, {seed: (a rows, b rows,
    statistic)} through `emrl_data.text.bootstrap` (`n_bootstrap` draws)."""
    if report.n_bootstrap is None:
        statistic = next(iter(groups.values()))[2]
        pairs = {s: (a, b) for s, (a, b, _) in groups.items()}
        per_seed = {
            str(s): _clean(paired_bootstrap([g], statistic, n_bootstrap=n_bootstrap, seed=s)) for s, g in pairs.items()
        }
        rows = _clean(paired_bootstrap(list(pairs.values()), statistic, n_bootstrap=n_bootstrap, seed=0))
        seeds_rows = _clean(
            hierarchical_paired_bootstrap(list(pairs.values()), statistic, n_bootstrap=n_bootstrap, seed=0)
        )
        return per_seed, rows, seeds_rows
    n = report.n_bootstrap
    per_seed = {str(s): contrast_bootstrap([g], n_bootstrap=n, seed=s, hierarchical=False) for s, g in groups.items()}
    rows = contrast_bootstrap(list(groups.values()), n_bootstrap=n, seed=0, hierarchical=False)
    seeds_rows = contrast_bootstrap(list(groups.values()), n_bootstrap=n, seed=0, hierarchical=True) | {
        "n_bootstrap": n
    }
    if _near_zero(seeds_rows):  # a bound within its Monte Carlo error of 0: ten times the draws
        seeds_rows = contrast_bootstrap(list(groups.values()), n_bootstrap=EDGE_DRAWS * n, seed=0, hierarchical=True)
        seeds_rows |= {"n_bootstrap": EDGE_DRAWS * n, "edge": _near_zero(seeds_rows)}
    return per_seed, rows, seeds_rows


def _near_zero(interval: dict[str, Any]) -> bool:
    """Return True where a bound of `interval` lies off 0 by at most `EDGE_MC_ERRORS` Monte Carlo standard errors (a
    bound at 0 itself, drawn many times over, excludes nothing)."""
    error = interval.get("mc_error")
    bounds = (interval.get("ci_low"), interval.get("ci_high"))
    return error is not None and any(b is not None and 0 < abs(b) <= EDGE_MC_ERRORS * error for b in bounds)


def _signed(metric: str, drawn: dict[str, Any] | None = None) -> list[tuple[float, Any]]:
    """Return a metric as signed organ-averaged rates (of `drawn`, beside K-Hit's and exact key's):
    `exact_minus_k_hit` is exact key minus K-Hit."""
    rates = dict(METRICS) | dict(KEY_METRICS) | dict(drawn or {})
    return (
        [(1.0, rates["exact_key"]), (-1.0, rates["k_hit"])]
        if metric == "exact_minus_k_hit"
        else [(1.0, rates[metric])]
    )


def summarize_study(
    output_dir: str | Path,
    seeds: list[int],
    levels: dict[Level, list[str]],
    n_bootstrap: int,
    report: Report | None = None,
) -> dict[str, Any]:
    """Return per level: each seed's results, and each comparison's paired differences per seed and pooled; with the
    `report` options, the family's adjusted p-values and K-Hit taken apart."""
    report = report or Report()

    listed, seeds = seeds, study_seeds(output_dir, seeds, levels, report.finished_seeds)
    summary: dict[str, Any] = {"seeds": seeds, "excluded": read_exclusions(output_dir, seeds), "levels": {}}
    beyond = [
        s
        for s in listed[len(seeds) :]
        if exclusion_path(output_dir, s).exists()
        or any(finished_seeds(output_dir, level, [s], levels[level]) for level in levels)
    ]
    if beyond:  # recorded after the study had its seeds: kept on disk, never pooled
        summary["beyond"] = beyond
    finished = {level: finished_seeds(output_dir, level, seeds, models) for level, models in levels.items()}
    kept = [record_path(output_dir, level, s) for level in sorted(finished, key=level_order) for s in finished[level]]
    if kept:
        _check_poolable({path: read_record(path) for path in kept})
    for level in sorted(levels, key=level_order):
        models, done = levels[level], finished[level]
        if not done:
            continue
        runs = {s: with_key_truth(read_record(record_path(output_dir, level, s))) for s in done}
        results = {s: runs[s]["results"] for s in done}
        records = {s: runs[s]["scores"] for s in done}
        comparisons: dict[str, Any] = {}
        metrics = dict(METRICS) | (dict(KEY_METRICS) if _has_key_truth(records) else {})
        if report.in_lesion and _has_key_truth(records):
            span = int(next(iter(runs.values()))["results"]["config"]["lesion_span"])
            metrics |= {m: rate for m, rate in lesion_metrics(span).items() if m in report.in_lesion}
        for (first, name), key in COMPARISONS.items():
            if first not in models or name not in models or key not in report.comparisons:
                continue
            gap = ["exact_minus_k_hit"] if key in report.gain_gap and "exact_key" in metrics else []
            for metric in [*metrics, *gap]:
                groups: dict[int, Any]
                if report.n_bootstrap is None:
                    groups = {s: (records[s][first], records[s][name], metrics[metric]) for s in done}
                else:
                    groups = {
                        s: [(sign, rate, records[s][first]) for sign, rate in _signed(metric, metrics)]
                        + [(-sign, rate, records[s][name]) for sign, rate in _signed(metric, metrics)]
                        for s in done
                    }
                per_seed, pooled, seeds_rows = _intervals(groups, n_bootstrap, report)
                above = sum(1 for v in per_seed.values() if v["ci_low"] is not None and v["ci_low"] > 0)
                entry = {"per_seed": per_seed, "pooled": pooled, "pooled_seeds": seeds_rows, "n_above": above}
                comparisons[f"{metric}: {key}"] = {**entry, "verdict": seed_level_verdict(seeds_rows, len(done))}
        at_level = {"models": models, "finished": done, "seeds_table": summarize_seeds(results)}
        summary["levels"][level_key(level)] = {**at_level, "comparisons": comparisons}
        summary["levels"][level_key(level)]["verifier"] = verifier_over_seeds(results, models)
        if _has_key_truth(records):  # exact key (d = 0) beside K-Hit, per model and seed
            summary["levels"][level_key(level)]["exact_key"] = {
                name: {str(s): _nan_none(exact_key(records[s][name])) for s in done} for name in models
            }
        if report.lesion_frames and _has_key_truth(records) and "sft" in models:
            summary["levels"][level_key(level)]["lesion_frames"] = lesion_frames(runs, models, report)
        spread = spread_over_seeds(results, models)
        if spread:
            summary["levels"][level_key(level)]["spread"] = spread
    trends = key_noise_trends(output_dir, levels, finished, n_bootstrap, report)
    if trends:
        summary["trends"] = trends
    if report.family:
        summary["family"] = family(summary, report)
    if report.decision is not None:
        summary["decision"] = pilot_decision(summary, report)
    summary["conclusions"] = conclusions(summary)
    return summary


def pilot_decision(summary: dict[str, Any], report: Report) -> dict[str, Any]:
    """Return the pilot's rule on clean gold: `report.decision`'s pooled difference, its seeds-and-rows interval, and
    `passed` (the difference exceeds the margin, in points, and the interval lies above 0), or `passed` None until
    `report.finished_seeds` seeds have finished."""
    decision = dict(report.decision or {})
    out: dict[str, Any] = decision | {"passed": None, "n_seeds": 0}
    entry = summary["levels"].get(level_key(0.0))
    comp = None if entry is None else entry["comparisons"].get(f"{decision['metric']}: {decision['comparison']}")
    if comp is None:
        return out
    seeds_rows = comp["pooled_seeds"]
    out |= {"n_seeds": len(entry["finished"]), "diff": seeds_rows["diff"]}
    out |= {"ci_low": seeds_rows["ci_low"], "ci_high": seeds_rows["ci_high"]}
    if out["n_seeds"] >= report.finished_seeds:
        diff, low = seeds_rows["diff"], seeds_rows["ci_low"]
        out["passed"] = diff is not None and low is not None and 100.0 * diff > float(decision["margin"]) and low > 0
        if decision.get("min_effect") and seeds_rows.get("mdd"):
            out["mdd"] = seeds_rows["mdd"]
            out["seeds_needed"] = seeds_for_effect(out["n_seeds"], seeds_rows["mdd"], float(decision["min_effect"]))
    return out


def seeds_for_effect(n_seeds: int, mdd: float, min_effect_points: float) -> int:
    """Return the finished seeds that detect `min_effect_points` with 80 % power, from a difference detectable from
    `mdd` (a fraction) over `n_seeds`: the seeds-and-rows standard error falls as 1 / sqrt(seeds) at a fixed test set
    per seed, so seeds = n_seeds x (mdd / effect)^2, rounded up."""
    return max(1, math.ceil(n_seeds * (100.0 * mdd / min_effect_points) ** 2 - 1e-9))


def lesion_frames(runs: dict[int, dict[str, Any]], models: list[str], report: Report) -> dict[str, Any]:
    """Return K-Hit taken apart per model (`power.lesion_metrics`), each rate the mean over the seeds, with each model
    minus SFT pooled over seeds and rows (`report.n_bootstrap` draws), and what a random lesion frame scores."""
    first = next(iter(runs.values()))["results"]["config"]
    span, n_frames = int(first["lesion_span"]), int(first["n_frames"])
    rates = {"k_hit": k_hit, "exact_key": exact_key} | lesion_metrics(span)
    scores = {s: run["scores"] for s, run in runs.items()}
    chance = [random_lesion_frame(sc["sft"], span, n_frames) for sc in scores.values()]
    out: dict[str, Any] = {
        "span": span,
        "n_bootstrap": report.n_bootstrap,
        "random_lesion_frame": {k: _nan_none(statistics.fmean(c[k] for c in chance)) for k in chance[0]},
        "models": {},
    }
    for name in models:
        label = next(run["results"]["models"][name]["label"] for run in runs.values())
        values = {
            m: _mean([v for sc in scores.values() if not math.isnan(v := rate(sc[name]))]) for m, rate in rates.items()
        }
        entry: dict[str, Any] = {"label": label, "values": values}
        if name != "sft":
            assert report.n_bootstrap is not None  # load_report refuses lesion_frames without it
            entry["minus_sft"] = {
                m: contrast_bootstrap(
                    [[(1.0, rate, sc[name]), (-1.0, rate, sc["sft"])] for sc in scores.values()],
                    n_bootstrap=report.n_bootstrap,
                    seed=0,
                    hierarchical=True,
                )
                for m, rate in rates.items()
            }
        out["models"][name] = entry
    return out


def family(summary: dict[str, Any], report: Report) -> dict[str, Any]:
    """Return the family: every pooled difference of `report.family`'s metrics (each level's comparisons, then the
    key-noise trends) with its seeds-and-rows p-value, Holm's and Benjamini-Hochberg's adjusted ones, and how many
    fall below `FAMILY_ALPHA` under each."""
    members = []
    entries = [
        (level, key, comp) for level, entry in summary["levels"].items() for key, comp in entry["comparisons"].items()
    ]
    entries += [(comp["level"], key, comp) for key, comp in summary.get("trends", {}).items()]
    for level, key, comp in entries:
        metric, name = key.split(": ", 1)
        seeds_rows = comp["pooled_seeds"]
        if metric in report.family and seeds_rows.get("p") is not None:
            members.append(
                {
                    "level": level,
                    "comparison": name.split(", ")[0],
                    "trend": key in summary.get("trends", {}),
                    "metric": metric,
                    "diff": seeds_rows["diff"],
                    "seeds_rows": [seeds_rows["ci_low"], seeds_rows["ci_high"]],
                    "p": seeds_rows["p"],
                    "mdd": seeds_rows["mdd"],
                }
            )
    p_values = [m["p"] for m in members]
    for m, by_holm, by_bh in zip(members, holm(p_values), benjamini_hochberg(p_values), strict=True):
        m["p_holm"], m["p_bh"] = by_holm, by_bh
    return {
        "metrics": list(report.family),
        "n_bootstrap": report.n_bootstrap,
        "alpha": FAMILY_ALPHA,
        "members": members,
        "below_alpha": {k: sum(1 for m in members if m[k] < FAMILY_ALPHA) for k in ("p", "p_holm", "p_bh")},
    }


def with_key_truth(record: dict[str, Any]) -> dict[str, Any]:
    """Return `record` with the truth's key frame beside every score row.

    Records written before the scores carried it get it from their test split, drawn again from the record's
    configuration exactly as the data stage drew it (`make_visible_rows`, seed + 1000); a split whose rows do not match
    the scores (organ, presence) is left without it.
    """
    scores = record["scores"]
    if all("key_slice_frame" in row for rows in scores.values() for row in rows):
        return record

    cfg = record["results"]["config"]
    test = make_visible_rows(
        cfg["n_test"],
        split="test",
        seed=cfg["seed"] + 1000,
        n_frames=cfg["n_frames"],
        size_px=cfg["size_px"],
        organs=tuple(cfg["organs"]),
        sizes_mm=tuple(float(v) for v in cfg["sizes_mm"]),
        span=cfg["lesion_span"],
    )
    truth = [(r["organ"], bool(r["has_lesion"]), r["key_slice_frame"]) for r in test]
    for rows in scores.values():
        if len(rows) != len(truth) or any(
            (r["organ"], bool(r["has_lesion"])) != t[:2] for r, t in zip(rows, truth, strict=True)
        ):
            return record
    return record | {
        "scores": {
            name: [r | {"key_slice_frame": t[2]} for r, t in zip(rows, truth, strict=True)]
            for name, rows in scores.items()
        }
    }


def _nan_none(value: float) -> float | None:
    return None if math.isnan(value) else value


def _has_key_truth(records: dict[int, dict[str, list[dict[str, Any]]]]) -> bool:
    """Return True when every score row of `records` carries the truth's key frame (records written since it does)."""
    return all("key_slice_frame" in row for runs in records.values() for rows in runs.values() for row in rows)


def spread_over_seeds(results: dict[int, dict[str, Any]], models: list[str]) -> dict[str, Any]:
    """Return, per GRPO run of `models` whose records measured it, the groups summed over the seeds and those without
    reward spread (`train.miniature.spread`), and TRL's mean `frac_reward_zero_std` beside them."""
    out: dict[str, Any] = {}
    for name in models:
        stages = [r["stages"].get(name, {}) for r in results.values()]
        measured = [st["spread"] for st in stages if st.get("spread")]
        if not measured:
            continue
        trl = [v for st in stages for v in st.get("frac_reward_zero_std", [])]
        out[name] = {
            "groups": sum(m["total_groups"] for m in measured),
            "without_signal": sum(m["total_without_signal"] for m in measured),
            "n_seeds": len(measured),
            "tol": measured[0]["tol"],
            "trl_frac_zero_std": statistics.fmean(trl) if trl else None,
        }
    return out


def key_noise_trends(
    output_dir: str | Path,
    levels: dict[Level, list[str]],
    finished: dict[Level, list[int]],
    n_bootstrap: int,
    report: Report | None = None,
) -> dict[str, Any]:
    """Return, per key-frame-noise level and `TRENDS` pair, the paired difference at that rate minus the same
    difference on clean gold, over the seeds finished at both (the same test rows: the test split depends on the seed
    alone), with both intervals and the verdict."""
    report = report or Report()
    out: dict[str, Any] = {}
    for level in sorted((lv for lv in levels if isinstance(lv, str)), key=level_order):
        done = [s for s in finished[level] if s in finished.get(0.0, [])]
        if not done:
            continue
        noisy = {s: with_key_truth(read_record(record_path(output_dir, level, s)))["scores"] for s in done}
        clean = {s: with_key_truth(read_record(record_path(output_dir, 0.0, s)))["scores"] for s in done}
        metrics = dict(METRICS) | (dict(KEY_METRICS) if _has_key_truth(noisy) and _has_key_truth(clean) else {})
        for (first, second), name in TRENDS.items():
            if not all(m in levels[level] and m in levels[0.0] for m in (first, second)):
                continue
            groups = [
                (
                    list(zip(noisy[s][first], noisy[s][second], strict=True)),
                    list(zip(clean[s][first], clean[s][second], strict=True)),
                )
                for s in done
            ]
            for metric, statistic in metrics.items():
                if report.n_bootstrap is not None:  # the difference at the rate minus the same on clean gold
                    terms = {
                        s: [
                            (1.0, statistic, noisy[s][first]),
                            (-1.0, statistic, noisy[s][second]),
                            (-1.0, statistic, clean[s][first]),
                            (1.0, statistic, clean[s][second]),
                        ]
                        for s in done
                    }
                    per_seed, rows_only, seeds_rows = _intervals(terms, n_bootstrap, report)
                    out[f"{metric}: {name}, {level} minus clean"] = {
                        "level": level,
                        "per_seed": per_seed,
                        "pooled": rows_only,
                        "pooled_seeds": seeds_rows,
                        "verdict": seed_level_verdict(seeds_rows, len(done)),
                    }
                    continue

                def gap(rows: Any, statistic: Any = statistic) -> float:
                    return statistic([a for a, _ in rows]) - statistic([b for _, b in rows])

                rows_only = _clean(paired_bootstrap(groups, gap, n_bootstrap=n_bootstrap, seed=0))
                seeds_rows = _clean(hierarchical_paired_bootstrap(groups, gap, n_bootstrap=n_bootstrap, seed=0))
                per_seed = {
                    str(s): _clean(paired_bootstrap([g], gap, n_bootstrap=n_bootstrap, seed=s))
                    for s, g in zip(done, groups, strict=True)
                }
                out[f"{metric}: {name}, {level} minus clean"] = {
                    "level": level,
                    "per_seed": per_seed,
                    "pooled": rows_only,
                    "pooled_seeds": seeds_rows,
                    "verdict": seed_level_verdict(seeds_rows, len(done)),
                }
    return out


VERDICTS = {
    "above": "above 0: claimed",
    "below": "below 0: claimed",
    "none": "no effect claimed",
    "few": f"not decided: fewer than {MIN_FINISHED_SEEDS} seeds",
    "edge": "a bound at 0 within the draws' Monte Carlo error: no effect claimed",
}
METRIC_LABELS = {
    "average_bacc": "average B-Acc",
    "k_hit": "K-Hit",
    "exact_key": "exact key (d = 0)",
    "exact_minus_k_hit": "exact-key gain minus K-Hit gain",
}
LESION_LABELS = {
    "k_hit": "K-Hit",
    "exact_key": "exact key",
    "lesion_frame": "names a lesion frame",
    "k_hit_in_lesion": "K-Hit given a lesion frame",
    "exact_in_lesion": "exact given a lesion frame",
    "exact_of_hits": "exact share of K-Hits",
}


def seed_level_verdict(interval: dict[str, Any], n_seeds: int | None = None) -> str:
    """Return the study's rule on one pooled difference: "few" over fewer than `MIN_FINISHED_SEEDS` finished seeds
    (`n_seeds`; None: not counted, for a rows-only interval), else "above" or "below" where its seeds-and-rows
    interval (`hierarchical_paired_bootstrap`) excludes 0 on that side, else "none" (no effect is claimed)."""
    if n_seeds is not None and n_seeds < MIN_FINISHED_SEEDS:
        return "few"
    if interval.get("edge"):
        return "edge"
    low, high = interval.get("ci_low"), interval.get("ci_high")
    if low is not None and low > 0:
        return "above"
    if high is not None and high < 0:
        return "below"
    return "none"


def level_label(level: str | float) -> str:
    """Return "clean gold" for 0, "<percent> % noisy gold" for gold noise, "key frame moved on <percent> % of
    positives" for key-frame noise."""
    if isinstance(level, str) and level.startswith(KEY_NOISE):
        return f"key frame moved on {100 * float(level.removeprefix(KEY_NOISE)):g} % of positives"
    value = float(level)
    return "clean gold" if value == 0 else f"{100 * value:g} % noisy gold"


def conclusions(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Return one conclusion per level and pooled difference, each decided by `seed_level_verdict` alone.

    Each has the level, the comparison, the metric, the pooled difference with both intervals, the verdict and a
    sentence: a claimed effect with its seeds-and-rows interval; otherwise no effect, with the effects that interval
    rules out (its power), and a note where the rows-only interval alone would have claimed one.
    """
    out = []
    entries = [
        (level, key, comp) for level, entry in summary["levels"].items() for key, comp in entry["comparisons"].items()
    ]
    entries += [(comp["level"], key, comp) for key, comp in summary.get("trends", {}).items()]
    for level, key, comp in entries:
        metric, comparison = key.split(": ", 1)
        if "trends" in summary and key in summary["trends"]:
            comparison = comparison.split(", ")[0] + " at this rate minus on clean gold"
        seeds_rows, rows = comp.get("pooled_seeds"), comp["pooled"]
        if not seeds_rows or seeds_rows["diff"] is None or seeds_rows["ci_low"] is None:
            continue
        n = len(comp["per_seed"])
        verdict = seed_level_verdict(seeds_rows, n)
        where = f"{comparison}, {METRIC_LABELS.get(metric, metric)}, {level_label(level)}"
        p = f", p {_p(seeds_rows['p'])}" if seeds_rows.get("p") is not None else ""
        text = f"{where}: {_interval(seeds_rows)} points{p} over {n} seeds and their rows: "
        if verdict == "few":
            alone = seed_level_verdict(seeds_rows) != "none"
            text += (
                f"not decided, {n} finished seeds where the rule needs {MIN_FINISHED_SEEDS}"
                f"{' (the interval alone excludes 0)' if alone else ''}."
            )
        elif verdict == "edge":
            text += (
                f"no effect claimed: a bound lies within {EDGE_MC_ERRORS:g} Monte Carlo standard errors "
                f"({100 * seeds_rows['mc_error']:.2f} points) of 0 at {seeds_rows['n_bootstrap']} draws."
            )
        elif verdict != "none":
            text += f"{VERDICTS[verdict]}."
        else:
            text += (
                f"no effect claimed; the interval rules out effects above {100 * seeds_rows['ci_high']:+.1f} "
                f"and below {100 * seeds_rows['ci_low']:+.1f} points."
            )
            if seeds_rows.get("mdd") is not None:
                text += f" Detectable with 80 % power: {100 * seeds_rows['mdd']:.1f} points."
            if seed_level_verdict(rows) != "none":
                gaps = ", ".join(f"{100 * comp['per_seed'][s]['diff']:+.1f}" for s in comp["per_seed"])
                text += (
                    f" The rows-only interval {_interval(rows)} excludes 0; the seeds-and-rows one does not "
                    f"(per seed: {gaps})."
                )
        out.append(
            {
                "level": level,
                "comparison": comparison,
                "metric": metric,
                "diff": seeds_rows["diff"],
                "seeds_rows": [seeds_rows["ci_low"], seeds_rows["ci_high"]],
                "rows_only": [rows["ci_low"], rows["ci_high"]],
                "verdict": verdict,
                "text": text,
            }
        )
    return out


def verifier_over_seeds(results: dict[int, dict[str, Any]], models: list[str]) -> dict[str, Any]:
    """Return, per model of `models` that has a verifier (SFT and the GRPO runs), in that order, its accuracy on the
    test split's frames, seen and blind, each rate the mean over the seeds that measured it (None where none did)."""
    from train.tiny.warmup_checks import VERIFIER_GATES  # lazy: train.tiny.warmup_checks loads torch: +5 s (measured)

    out: dict[str, Any] = {}
    for name in models:
        runs = [r["models"][name]["verifier"] for r in results.values() if r["models"].get(name, {}).get("verifier")]
        if not runs:
            continue
        out[name] = {
            "label": next(r["models"][name]["label"] for r in results.values() if name in r["models"]),
            "n_seeds": len(runs),
        }
        for view in ("seen", "blind"):
            rates = {k: [v[view][k] for v in runs if v[view].get(k) is not None] for k in VERIFIER_GATES}
            out[name][view] = {k: (sum(v) / len(v) if v else None) for k, v in rates.items()}
        by_distance = [v["by_distance"] for v in runs if v.get("by_distance")]
        if by_distance:  # per distance from the key frame, each rate the mean over the seeds that measured it
            out[name]["by_distance"] = {
                d: {k: _mean([b[d][k] for b in by_distance if d in b and b[d][k] is not None]) for k in BY_DISTANCE}
                for d in sorted({d for b in by_distance for d in b}, key=int)
            }
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _pv(p: float) -> str:
    return f"{p:.2g}" if p >= 0.001 else "< 0.001"


def _p(p: float) -> str:
    return f"= {p:.2g}" if p >= 0.001 else "< 0.001"


def _interval(v: dict[str, Any]) -> str:
    if v["diff"] is None:
        return "n/a"
    if v["ci_low"] is None:
        return f"{100 * v['diff']:+.1f}"
    return f"{100 * v['diff']:+.1f} [{100 * v['ci_low']:+.1f}, {100 * v['ci_high']:+.1f}]"


CONCLUSION_RULE = (
    "Each pooled difference (points, (a) minus the other run, on the test rows) has two 95 % paired bootstrap "
    "intervals: rows only (every seed kept, its rows redrawn) and seeds and rows (the seeds drawn with replacement, "
    "then each drawn seed's rows). An effect is claimed only where the seeds-and-rows interval excludes 0, over at "
    f"least {MIN_FINISHED_SEEDS} finished seeds."
)


def study_markdown(summary: dict[str, Any]) -> str:
    """Return the study's tables (points): per level the seeds table and the paired differences, and the verdict."""
    lines = []
    for seed, reason in summary.get("excluded", {}).items():
        missed = (
            "its SFT policy missed its check, so no GRPO arm trained"
            if reason.startswith(POLICY_MISSED)
            else "its warm-up missed its targets by its step cap, so it trained nothing further"
        )
        lines += [f"Seed {seed} is excluded: {missed} ({reason}).", ""]
    if not summary["levels"]:
        lines += ["No run of the study has finished yet.", ""]
    if summary.get("beyond"):
        lines += [
            f"Recorded after the study's {len(summary['seeds'])} seeds (up to seed {summary['seeds'][-1]}, "
            f"{MIN_FINISHED_SEEDS} of them finished), not pooled: seed {', '.join(map(str, summary['beyond']))}.",
            "",
        ]
    lines += decision_markdown(summary.get("decision"))
    if summary.get("conclusions"):
        lines += ["## Conclusions", "", CONCLUSION_RULE, ""]
        lines += [f"- {c['text']}" for c in summary["conclusions"]] + [""]
    if summary.get("family"):
        lines += family_markdown(summary["family"])
    for level, entry in summary["levels"].items():
        seeds = entry["finished"]
        finished = f"Finished: {len(seeds)} of {len(summary['seeds'])} seeds ({', '.join(map(str, seeds))})."
        table = seeds_markdown(entry["seeds_table"], claims=False).rstrip()
        lines += [f"## gold noise {level}", "", finished, "", table, ""]
        head = " | ".join(f"seed {s}" for s in seeds)
        lines += [
            f"| paired difference | {head} | pooled, rows only | pooled, seeds and rows | verdict | "
            "seed interval above 0 |",
            "| --- |" + " --- |" * (len(seeds) + 4),
        ]
        for key, comp in entry["comparisons"].items():
            cells = " | ".join(_interval(comp["per_seed"][str(s)]) for s in seeds)
            seeds_rows = comp.get("pooled_seeds")
            verdict = VERDICTS[comp["verdict"]] if "verdict" in comp else "n/a"
            lines.append(
                f"| {key} | {cells} | {_interval(comp['pooled'])} | "
                f"{'n/a' if seeds_rows is None else _interval(seeds_rows)} | {verdict} | "
                f"{comp['n_above']} of {len(seeds)} seeds |"
            )
        lines += ["", *exact_key_markdown(entry), *lesion_frames_markdown(entry.get("lesion_frames"))]
        lines += spread_markdown(entry.get("spread", {}))
        lines += verifier_markdown(entry.get("verifier", {}))
    if summary.get("trends"):
        lines += [
            "## Key-frame noise: each difference at a rate minus on clean gold",
            "",
            "| difference | pooled, rows only | pooled, seeds and rows | verdict |",
            "| --- | --- | --- | --- |",
        ]
        for key, comp in summary["trends"].items():
            lines.append(
                f"| {key} | {_interval(comp['pooled'])} | {_interval(comp['pooled_seeds'])} | "
                f"{VERDICTS[comp['verdict']]} |"
            )
        lines.append("")
    return "\n".join(lines)


def decision_markdown(decision: dict[str, Any] | None) -> list[str]:
    """Return the pilot's decision lines (none without a `decision`)."""
    if decision is None:
        return []
    rule = (
        f"{decision['metric']}: {decision['comparison']} on clean gold, pooled over the seeds, above "
        f"{float(decision['margin']):+.1f} points with its seeds-and-rows interval above 0"
    )
    if decision["passed"] is None:
        verdict = f"not decided yet: {decision['n_seeds']} seeds finished"
    else:
        verdict = "**passed**" if decision["passed"] else "**not passed**"
        verdict += f": {_interval(decision)} over {decision['n_seeds']} seeds"
    lines = ["## Decision", "", f"Rule: {rule}. Outcome: {verdict}.", ""]
    if decision.get("seeds_needed") is not None:
        lines += [
            f"At the pilot's spread (detectable from {100 * decision['mdd']:.1f} points over {decision['n_seeds']} "
            f"seeds), a {float(decision['min_effect']):+.1f}-point effect needs {decision['seeds_needed']} finished "
            "seeds at 80 % power.",
            "",
        ]
    return lines


def exact_key_markdown(entry: dict[str, Any]) -> list[str]:
    """Return the lines of exact-key accuracy (d = 0) beside K-Hit per model, means over the seeds (none without it)."""
    if "exact_key" not in entry:
        return []
    values = entry["seeds_table"]["values"]
    lines = ["| model | exact key (d = 0) | K-Hit (d <= 1) |", "| --- | --- | --- |"]
    for name, per_seed in entry["exact_key"].items():
        exact = [v for v in per_seed.values() if v is not None]
        hits = [v for v in values.get(name, {}).get("k_hit", {}).values() if v is not None]
        cells = [f"{100 * statistics.fmean(v):.1f}" if v else "n/a" for v in (exact, hits)]
        lines.append(f"| {entry['seeds_table']['labels'].get(name, name)} | {cells[0]} | {cells[1]} |")
    return [*lines, ""]


def family_markdown(fam: dict[str, Any]) -> list[str]:
    """Return the family's section: the method, the count below alpha under each adjustment, and every member by p."""
    metrics = " and ".join(METRIC_LABELS[m] for m in fam["metrics"])
    alpha, below, n = fam["alpha"], fam["below_alpha"], len(fam["members"])
    lines = [
        "## The family of differences",
        "",
        f"Every pooled {metrics} difference above (each level's, and each key-noise difference minus its "
        f"clean-gold value): {n}. Each p is two-sided, from its seeds-and-rows draws ({fam['n_bootstrap']}; "
        f"{EDGE_DRAWS} times as many where a bound lies within {EDGE_MC_ERRORS:g} Monte Carlo standard errors of "
        "0): twice the smaller share of draws at or below 0 and at or above 0. Adjusted by Holm (family-wise error) "
        f"and by Benjamini-Hochberg (false discovery rate). Below {alpha:g}: {below['p']} unadjusted, "
        f"{below['p_holm']} after Holm, {below['p_bh']} after Benjamini-Hochberg; {alpha * n:.1f} would be "
        f"expected below {alpha:g} unadjusted were none real.",
        "",
        "| difference | metric | level | seeds and rows | p | Holm | BH | detectable (80 % power) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in sorted(fam["members"], key=lambda m: m["p"]):
        what = m["comparison"] + (" at the rate minus on clean gold" if m["trend"] else "")
        ci = _interval({"diff": m["diff"], "ci_low": m["seeds_rows"][0], "ci_high": m["seeds_rows"][1]})
        lines.append(
            f"| {what} | {METRIC_LABELS[m['metric']]} | {level_label(m['level'])} | {ci} | {_pv(m['p'])} | "
            f"{_pv(m['p_holm'])} | {_pv(m['p_bh'])} | {100 * m['mdd']:.1f} |"
        )
    return [*lines, ""]


def lesion_frames_markdown(lesion: dict[str, Any] | None) -> list[str]:
    """Return the table of K-Hit taken apart: per model each rate (mean over the seeds) and its difference from SFT
    pooled over seeds and rows, and a random lesion frame's rates."""
    if not lesion:
        return []
    keys = list(LESION_LABELS)
    lines = [
        f"K-Hit taken apart (%, mean over the seeds; a lesion frame: the report claims a lesion and names a frame "
        f"within {lesion['span']} of the key frame; each model's difference from SFT over seeds and rows, "
        f"{lesion['n_bootstrap']} draws, p two-sided):",
        "",
        f"| model | {' | '.join(LESION_LABELS[k] for k in keys)} |",
        "| --- |" + " --- |" * len(keys),
    ]
    for entry in lesion["models"].values():
        cells = []
        for k in keys:
            value = entry["values"][k]
            cell = "n/a" if value is None else f"{100 * value:.1f}"
            got = entry.get("minus_sft", {}).get(k)
            if got and got["diff"] is not None and got["ci_low"] is not None:
                cell += f"; {_interval(got)}, p {_p(got['p'])}"
            cells.append(cell)
        lines.append(f"| {entry['label']} | {' | '.join(cells)} |")
    chance = lesion["random_lesion_frame"]
    cells = ["n/a" if chance.get(k) is None else f"{100 * chance[k]:.1f}" for k in keys]
    lines.append(f"| a random lesion frame | {' | '.join(cells)} |")
    return [*lines, ""]


def spread_markdown(spread: dict[str, Any]) -> list[str]:
    """Return the lines of the reward-spread table: groups without signal (ours) and TRL's frac_reward_zero_std."""
    if not spread:
        return []
    tol = next(iter(spread.values()))["tol"]
    lines = [
        f"| GRPO run | groups | without reward spread (std <= {tol:g}) | TRL frac_reward_zero_std, mean |",
        "| --- | --- | --- | --- |",
    ]
    for name, entry in spread.items():
        trl = "n/a" if entry["trl_frac_zero_std"] is None else f"{entry['trl_frac_zero_std']:.3f}"
        share = entry["without_signal"] / entry["groups"] if entry["groups"] else 0.0
        lines.append(f"| {name} | {entry['groups']} | {entry['without_signal']} ({share:.0%}) | {trl} |")
    return [*lines, ""]


def verifier_markdown(verifier: dict[str, Any]) -> list[str]:
    """Return the lines of the verifier table of one level (none when no model has a verifier)."""
    from train.tiny.warmup_checks import VERIFIER_GATES  # lazy: torch (see verifier_over_seeds)

    if not verifier:
        return []

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.0f}"

    head = " | ".join(VERIFIER_GATES)
    lines = [
        "Verifier on the test split's frames (%, mean over the finished seeds; blind: shown another row's frame):",
        "",
        f"| model | {head} | blind: {head} |",
        "| --- |" + " --- |" * (2 * len(VERIFIER_GATES)),
    ]
    for entry in verifier.values():
        seen = " | ".join(pct(entry["seen"][k]) for k in VERIFIER_GATES)
        blind = " | ".join(pct(entry["blind"][k]) for k in VERIFIER_GATES)
        lines.append(f"| {entry['label']} | {seen} | {blind} |")
    lines.append("")
    distance = {name: e["by_distance"] for name, e in verifier.items() if e.get("by_distance")}
    if distance:
        lines += [
            "Verifier by distance d from the key frame (%, mean over the seeds; d = span + 1 shows no lesion; "
            "size_key: the answer's size matches the key frame's, what r_c credits):",
            "",
            "| model | d | presence | location | attenuation | size_slice | size_key |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, per_d in distance.items():
            for d, rates in per_d.items():
                cells = " | ".join(
                    pct(rates[k]) for k in ("presence", "location", "attenuation", "size_slice", "size_key")
                )
                lines.append(f"| {verifier[name]['label']} | {d} | {cells} |")
        lines.append("")
    return lines


def save_study_png(summary: dict[str, Any], path: Path) -> Path:
    """Plot each pooled paired difference with its two 95 % intervals, one colour per gold-noise level: a filled
    marker and thick bar for seeds and rows (what the verdict reads), an open marker and thin bar for rows only."""
    import matplotlib  # lazy: matplotlib.use("Agg") below sets the process's backend: only where a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use("Agg")

    keys = list(dict.fromkeys(k for e in summary["levels"].values() for k in e["comparisons"]))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    n_levels = max(1, len(summary["levels"]))
    for j, (level, entry) in enumerate(summary["levels"].items()):
        for i, key in enumerate(keys):
            comp = entry["comparisons"].get(key, {})
            x = i + 0.3 * (j - (n_levels - 1) / 2) / n_levels * 2
            styles: tuple[tuple[str, float, dict[str, Any]], ...] = (
                ("pooled_seeds", -0.04, {"fmt": "o", "lw": 2.2}),
                ("pooled", 0.04, {"fmt": "o", "lw": 0.9, "mfc": "white"}),
            )
            for name, dx, style in styles:
                got = comp.get(name)
                if not got or got["diff"] is None or got["ci_low"] is None:
                    continue
                y = 100 * got["diff"]
                err = [[y - 100 * got["ci_low"]], [100 * got["ci_high"] - y]]
                label = None
                if i == 0:
                    label = f"{level_label(level)}, " + ("seeds and rows" if name == "pooled_seeds" else "rows only")
                ax.errorbar([x + dx], [y], yerr=err, capsize=3, color=f"C{j}", label=label, **style)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(keys, fontsize=7, rotation=20)
    ax.set_ylabel("points, pooled over seeds (95 % paired intervals)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    """CLI: `python -m train.miniature.suite --config YAML --output_dir DIR [--set key=value ...]`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--min_seeds", type=int, default=MIN_SEEDS, help="refuse a study with fewer seeds")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        metavar="SEED",
        help="run only these of the config's seeds now (a stage); the report covers every seed of "
        "the config finished so far",
    )
    parser.add_argument(
        "--report_only",
        action="store_true",
        help="train nothing: write study.json, study.md and study.png of the runs recorded under --output_dir",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each its own process (default 1)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per run (default: the cores shared out among the jobs)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1 or (args.threads is not None and args.threads < 1):
        raise TrainConfigError(f"--jobs {args.jobs} --threads {args.threads}: both must be at least 1")
    overrides = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.set)}
    cfg, seeds, levels = load_study(args.config, overrides)
    report = load_report(args.config)
    if args.report_only:
        write_summary(args.output_dir, seeds, levels, cfg.n_bootstrap, report)
        print(f"wrote {Path(args.output_dir) / 'study.md'} (.json, .png)", flush=True)
        return
    if len(seeds) < args.min_seeds:
        raise TrainConfigError(
            f"{args.config}: study.seeds has {len(seeds)} seeds, fewer than --min_seeds={args.min_seeds}"
        )
    stage = seeds if args.seeds is None else args.seeds
    if not set(stage) <= set(seeds):
        raise TrainConfigError(f"--seeds {stage}: each must be one of the config's study.seeds {seeds}")
    run_study(cfg, seeds, levels, args.output_dir, jobs=args.jobs, threads=args.threads, only=stage, report=report)


if __name__ == "__main__":
    run_cli(main)
