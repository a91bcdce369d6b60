"""The decomposition study of r_c in the miniature: settings x gold noise x seeds, with paired intervals.

One YAML (`train/configs/miniature_study.yaml`): the miniature's keys plus a `study:` section:

    study:
      seeds: [0, 1, 2, 3, 4]
      noise: {0.0: [sft, grpo_a, grpo_b, grpo_f, grpo_g, more_sft_llm], 0.15: [sft, grpo_a, grpo_b, grpo_f, more_sft_llm]}

For each gold-noise level and seed a miniature run goes to `OUTPUT_DIR/noise-<level>/seed-<seed>` with those models
(`train.miniature.study.Miniature`; each stage writes its `done.json` and is skipped on a rerun). The runs go seed by
seed, each seed over every level, so a study stopped part-way has whole seeds. A noisy run copies the warm-up of the
clean run of its seed (the warm-up reads the clean rows; its SFT and GRPO read the noisy ones); the clean level
therefore runs first within a seed. After every run, `OUTPUT_DIR/study.json`, `study.md` (per level: its finished
seeds, the seeds table, the paired bootstrap differences a-e, a-f, a-b, a-g per seed and pooled over the seeds, the
verdict: in how many seeds each difference's interval lies above 0, and the verifier's accuracy after SFT and after
each GRPO run) and `study.png` (the pooled differences with
their intervals) are rewritten over the runs finished so far.

Each finished run also leaves a record, `OUTPUT_DIR/records/noise-<level>-seed-<seed>.json.gz` (its `results.json`
and the per-row scores of every model, about 30 kB): the summary reads the records only, and a run whose record is
there is not run again, even when its folder is gone. Records copied in from another machine's study of the same
configuration are pooled with this one's, so the seeds can run on several machines (the summary refuses records whose
configurations differ outside seed, gold noise and models).

A seed whose warm-up reaches its step cap before its targets (the verifier's gates among them) is excluded, not
trained: its clean run leaves `OUTPUT_DIR/records/seed-<seed>-excluded.json` with the reason, its noisy runs do not
start, the study goes on with the other seeds, and study.md names it. The exclusion is decided before any GRPO or
eval, from the warm-up alone, so it cannot favour one model over another.

    python -m train.miniature.suite --config train/configs/miniature_study.yaml --output_dir miniature-study
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from train.checks import TrainConfigError, run_cli
from train.miniature.config import MiniatureConfig, config_from_dict
from train.miniature.study import Miniature


COMPARISONS = {"more_sft_llm": "(a) - (e)", "grpo_f": "(a) - (f)", "grpo_b": "(a) - (b)", "grpo_g": "(a) - (g)"}
MIN_SEEDS = 5


def load_study(path: str | Path, overrides: dict[str, Any] | None = None) -> tuple[MiniatureConfig, list[int], dict]:
    """Return (the miniature config, the seeds, {noise level: models}) of a study YAML; one-line errors."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    study = data.pop("study", None)
    if not isinstance(study, dict) or set(study) != {"seeds", "noise"}:
        raise TrainConfigError(f"{path}: needs a `study:` section with exactly the keys seeds and noise")
    cfg = config_from_dict(data | (overrides or {}), path)
    seeds = [int(s) for s in study["seeds"]]
    levels = {float(k): list(v) for k, v in study["noise"].items()}
    if 0.0 not in levels:
        raise TrainConfigError(f"{path}: study.noise needs the clean level 0.0 (the noisy runs reuse its warm-up)")
    for level, models in levels.items():
        config_from_dict(data | {"gold_noise": level, "models": models}, path)  # each level's config is valid
    return cfg, seeds, levels


def run_dir(output_dir: str | Path, level: float, seed: int) -> Path:
    """Return one run's folder."""
    return Path(output_dir) / f"noise-{level:.2f}" / f"seed-{seed}"


def run_study(cfg: MiniatureConfig, seeds: list[int], levels: dict[float, list[str]], output_dir: str | Path,
              log: Any = None, jobs: int = 1, threads: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Run (or resume) every run of the study, rewriting the summary after each; return the last summary.

    With `jobs` > 1 that many runs go at once, each in its own process with `threads` torch threads (default: the
    cores shared out); the runs start in the sequential order, a noisy one once its seed's clean warm-up is there.
    With one job, `threads` (when given) sets this process's torch threads.
    """
    log = log or (lambda line: print(line, flush=True))
    if jobs == 1 and threads is not None:
        import torch  # noqa: PLC0415

        torch.set_num_threads(threads)
    tasks = []
    excluded = read_exclusions(output_dir, seeds)
    for seed in seeds:  # seed by seed, every level (the clean one first: the noisy runs copy its warm-up)
        for level in sorted(levels):
            if seed in excluded and not finished_seeds(output_dir, level, [seed], levels[level]):
                log(f"=== gold noise {level:.2f}, seed {seed}: excluded ({exclusion_path(output_dir, seed)}), skipped")
            elif finished_seeds(output_dir, level, [seed], levels[level]):
                log(f"=== gold noise {level:.2f}, seed {seed}: recorded in {record_path(output_dir, level, seed)}, "
                    "skipped")  # fmt: skip
            else:
                tasks.append((level, seed))
    summary = None
    if jobs == 1:
        for level, seed in tasks:
            if exclusion_path(output_dir, seed).exists():  # its clean run's warm-up missed its targets just now
                log(f"=== gold noise {level:.2f}, seed {seed}: excluded, skipped")
                continue
            threads_used = _run_one(cfg, levels, output_dir, level, seed, log)
            summary = None if threads_used is None else _record_and_summarize(
                cfg, seeds, levels, output_dir, level, seed, threads_used)  # fmt: skip
    else:
        for level, seed, threads_used in _run_in_processes(cfg, levels, output_dir, tasks, jobs, threads, log):
            summary = None if threads_used is None else _record_and_summarize(
                cfg, seeds, levels, output_dir, level, seed, threads_used)  # fmt: skip
    if summary is None:  # every run was recorded before, or the last one was excluded
        summary = write_summary(output_dir, seeds, levels, cfg.n_bootstrap)
    log((Path(output_dir) / "study.md").read_text())
    return summary


def _run_one(cfg: MiniatureConfig, levels: dict[float, list[str]], output_dir: str | Path, level: float, seed: int,
             log: Any, warmup_only: bool = False) -> int | None:  # fmt: skip
    """Run (or resume) one run of the study, or with `warmup_only` the data and warm-up of its seed's clean run;
    return the torch threads it ran with, or None when the seed's warm-up missed its targets by its step cap: the seed
    is then excluded (`write_exclusion`)."""
    import torch  # noqa: PLC0415

    from train.tooling.warmup import WarmupMissed  # noqa: PLC0415

    clean, clean_cfg = run_dir(output_dir, 0.0, seed), replace(cfg, seed=seed, gold_noise=0.0, models=levels[0.0])
    try:
        if warmup_only:
            Miniature(clean_cfg, clean, log=log).run(stages=("data", "warmup"))
            return torch.get_num_threads()
        folder = run_dir(output_dir, level, seed)
        log(f"=== gold noise {level:.2f}, seed {seed}: {folder}")
        miniature = Miniature(replace(cfg, seed=seed, gold_noise=level, models=levels[level]), folder, log=log)
        if level > 0:
            if not (clean / "warmup" / "done.json").exists():  # only the clean run's record is left: warm up again
                log(f"   the clean run's warm-up is not in {clean}: running it there first")
                Miniature(clean_cfg, clean, log=log).run(stages=("data", "warmup"))
            miniature.reuse(clean, stages=("warmup",))
        miniature.run()
    except WarmupMissed as exc:
        path = write_exclusion(output_dir, seed, str(exc), clean_cfg)
        log(f"=== seed {seed} excluded ({path}): {exc}")
        return None
    return torch.get_num_threads()


def _record_and_summarize(cfg: MiniatureConfig, seeds: list[int], levels: dict[float, list[str]],
                          output_dir: str | Path, level: float, seed: int, threads: int) -> dict[str, Any]:  # fmt: skip
    write_record(output_dir, level, seed, levels[level], torch_threads=threads)
    return write_summary(output_dir, seeds, levels, cfg.n_bootstrap)  # the finished runs so far


def _worker(threads: int, cfg: MiniatureConfig, levels: dict[float, list[str]], output_dir: str, level: float,
            seed: int, warmup_only: bool) -> int | None:  # fmt: skip
    import torch  # noqa: PLC0415

    torch.set_num_threads(threads)
    prefix = f"[noise {level:.2f} seed {seed}] "
    log = lambda line: print(prefix + line, flush=True)  # noqa: E731
    return _run_one(cfg, levels, output_dir, level, seed, log, warmup_only=warmup_only)


def _run_in_processes(cfg: MiniatureConfig, levels: dict[float, list[str]], output_dir: str | Path,
                      tasks: list[tuple[float, int]], jobs: int, threads: int | None, log: Any
                      ) -> Iterator[tuple[float, int, int | None]]:  # fmt: skip
    """Run `tasks` (level, seed) in `jobs` spawned processes; yield each (level, seed, threads) as it finishes, with
    threads None where the seed's warm-up missed its targets (its other runs then do not start).

    A noisy run starts once its seed's clean warm-up is there: made by the clean run, or, where only the clean run's
    record is left, by a warm-up of its own that runs first. The first failure stops new starts; the runs in flight
    finish, and the failure is raised. A worker exits when the study's process is gone (stopped by a signal to it
    alone, or killed), so no run outlives its study.
    """
    import multiprocessing  # noqa: PLC0415
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait  # noqa: PLC0415

    def warmed_up(seed: int) -> bool:
        return (run_dir(output_dir, 0.0, seed) / "warmup" / "done.json").exists()

    threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    pending = []  # (level, seed, warmup_only), in the sequential order
    for level, seed in tasks:
        clean_runs = (0.0, seed) in tasks
        if level > 0 and not clean_runs and not warmed_up(seed) and (0.0, seed, True) not in pending:
            pending.append((0.0, seed, True))
        pending.append((level, seed, False))
    log(f"=== {len(tasks)} runs, {jobs} at a time, {threads} torch thread(s) each")
    running: dict[Any, tuple[float, int, bool]] = {}
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
    if failure is not None:
        raise failure


def exit_with_parent(parent_pid: int, interval_s: float = 2.0) -> None:
    """Start a daemon thread that ends this process once its parent `parent_pid` is gone (its parent changes)."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(143)  # the study is gone: stop its run now, as a SIGTERM would

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def write_summary(output_dir: str | Path, seeds: list[int], levels: dict[float, list[str]], n_bootstrap: int
                  ) -> dict[str, Any]:  # fmt: skip
    """Write `study.json`, `study.md` and `study.png` of the runs finished so far; return the summary."""
    summary = summarize_study(output_dir, seeds, levels, n_bootstrap)
    out = Path(output_dir)
    (out / "study.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    (out / "study.md").write_text(study_markdown(summary))
    save_study_png(summary, out / "study.png")
    return summary


def record_path(output_dir: str | Path, level: float, seed: int) -> Path:
    """Return one run's record: what the summary reads of it."""
    return Path(output_dir) / "records" / f"noise-{level:.2f}-seed-{seed}.json.gz"


def write_record(output_dir: str | Path, level: float, seed: int, models: list[str], torch_threads: int) -> Path:
    """Keep a finished run's `results.json` and each model's per-row scores in its record; return the record's path.

    `torch_threads`: the threads the run trained with (the numbers depend on it). The bytes depend on the run only
    (gzip without a timestamp), so a rerun that changes nothing rewrites them equal.
    """
    from emrl_data.text.evaluation import score_predictions  # noqa: PLC0415

    folder = run_dir(output_dir, level, seed)
    scores = {}
    for name in models:
        lines = (folder / "eval" / name / "predictions.jsonl").read_text().splitlines()
        scores[name] = score_predictions([json.loads(line) for line in lines])
    record = {"gold_noise": level, "seed": seed, "models": models, "torch_threads": torch_threads,
              "results": json.loads((folder / "results.json").read_text()), "scores": scores}  # fmt: skip
    path = record_path(output_dir, level, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(gzip.compress(json.dumps(record).encode(), mtime=0))
    tmp.replace(path)
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
    from dataclasses import asdict  # noqa: PLC0415

    path = exclusion_path(output_dir, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"seed": seed, "reason": reason, "config": asdict(cfg)}, indent=2) + "\n")
    tmp.replace(path)
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


def finished_seeds(output_dir: str | Path, level: float, seeds: list[int], models: list[str]) -> list[int]:
    """Return the seeds whose run at `level` has a record holding every one of `models`."""
    done = []
    for seed in seeds:
        path = record_path(output_dir, level, seed)
        if path.exists() and set(models) <= set(read_record(path)["models"]):
            done.append(seed)
    return done


POOLABLE_KEYS = {"seed", "gold_noise", "models"}  # what may differ between the runs a study pools


def _check_poolable(records: dict[Path, dict[str, Any]]) -> None:
    """Refuse, in one line naming both files, records of runs whose configurations differ outside POOLABLE_KEYS."""
    first, *rest = records
    ours = {k: v for k, v in records[first]["results"]["config"].items() if k not in POOLABLE_KEYS}
    for path in rest:
        theirs = {k: v for k, v in records[path]["results"]["config"].items() if k not in POOLABLE_KEYS}
        differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if differ:
            raise TrainConfigError(f"{path} and {first}: runs of different configurations ({differ}) cannot be pooled")


def _clean(value: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in value.items()}


def summarize_study(output_dir: str | Path, seeds: list[int], levels: dict[float, list[str]], n_bootstrap: int
                    ) -> dict[str, Any]:  # fmt: skip
    """Return per level: each seed's results, and each comparison's paired differences per seed and pooled."""
    from train.miniature.power import METRICS, paired_bootstrap  # noqa: PLC0415
    from train.miniature.seeds import summarize_seeds  # noqa: PLC0415

    summary: dict[str, Any] = {"seeds": seeds, "excluded": read_exclusions(output_dir, seeds), "levels": {}}
    finished = {level: finished_seeds(output_dir, level, seeds, models) for level, models in levels.items()}
    kept = [record_path(output_dir, level, s) for level, done in sorted(finished.items()) for s in done]
    if kept:
        _check_poolable({path: read_record(path) for path in kept})
    for level, models in sorted(levels.items()):
        done = finished[level]
        if not done:
            continue
        runs = {s: read_record(record_path(output_dir, level, s)) for s in done}
        results = {s: runs[s]["results"] for s in done}
        records = {s: runs[s]["scores"] for s in done}
        comparisons: dict[str, Any] = {}
        for name, key in COMPARISONS.items():
            if name not in models:
                continue
            for metric, statistic in METRICS.items():
                per_seed = {str(s): _clean(paired_bootstrap([(records[s]["grpo_a"], records[s][name])], statistic,
                                                            n_bootstrap=n_bootstrap, seed=s)) for s in done}  # fmt: skip
                pooled = paired_bootstrap([(records[s]["grpo_a"], records[s][name]) for s in done], statistic,
                                          n_bootstrap=n_bootstrap, seed=0)  # fmt: skip
                above = sum(1 for v in per_seed.values() if v["ci_low"] is not None and v["ci_low"] > 0)
                comparisons[f"{metric}: {key}"] = {"per_seed": per_seed, "pooled": _clean(pooled), "n_above": above}
        summary["levels"][f"{level:.2f}"] = {
            "models": models,
            "finished": done,
            "seeds_table": summarize_seeds(results),
            "comparisons": comparisons,
            "verifier": verifier_over_seeds(results, models),
        }
    return summary


def verifier_over_seeds(results: dict[int, dict[str, Any]], models: list[str]) -> dict[str, Any]:
    """Return, per model of `models` that has a verifier (SFT and the GRPO runs), in that order, its accuracy on the
    test split's frames, seen and blind, each rate the mean over the seeds that measured it (None where none did)."""
    from train.tooling.warmup import VERIFIER_GATES  # noqa: PLC0415

    out: dict[str, Any] = {}
    for name in models:
        runs = [r["models"][name]["verifier"] for r in results.values() if r["models"].get(name, {}).get("verifier")]
        if not runs:
            continue
        out[name] = {"label": next(r["models"][name]["label"] for r in results.values() if name in r["models"]),
                     "n_seeds": len(runs)}  # fmt: skip
        for view in ("seen", "blind"):
            rates = {k: [v[view][k] for v in runs if v[view].get(k) is not None] for k in VERIFIER_GATES}
            out[name][view] = {k: (sum(v) / len(v) if v else None) for k, v in rates.items()}
    return out


def _interval(v: dict[str, Any]) -> str:
    if v["diff"] is None:
        return "n/a"
    if v["ci_low"] is None:
        return f"{100 * v['diff']:+.1f}"
    return f"{100 * v['diff']:+.1f} [{100 * v['ci_low']:+.1f}, {100 * v['ci_high']:+.1f}]"


def study_markdown(summary: dict[str, Any]) -> str:
    """Return the study's tables (points): per level the seeds table and the paired differences, and the verdict."""
    from train.miniature.seeds import seeds_markdown  # noqa: PLC0415

    lines = []
    for seed, reason in summary.get("excluded", {}).items():
        lines += [f"Seed {seed} is excluded: its warm-up missed its targets by its step cap, so it trained nothing "
                  f"further ({reason}).", ""]  # fmt: skip
    if not summary["levels"]:
        lines += ["No run of the study has finished yet.", ""]
    for level, entry in summary["levels"].items():
        seeds = entry["finished"]
        finished = f"Finished: {len(seeds)} of {len(summary['seeds'])} seeds ({', '.join(map(str, seeds))})."
        table = seeds_markdown(entry["seeds_table"], claims=False).rstrip()
        lines += [f"## gold noise {level}", "", finished, "", table, ""]
        head = " | ".join(f"seed {s}" for s in seeds)
        lines += [f"| paired difference | {head} | pooled | interval above 0 |",
                  "| --- |" + " --- |" * (len(seeds) + 2)]  # fmt: skip
        for key, comp in entry["comparisons"].items():
            cells = " | ".join(_interval(comp["per_seed"][str(s)]) for s in seeds)
            lines.append(
                f"| {key} | {cells} | {_interval(comp['pooled'])} | {comp['n_above']} of {len(seeds)} seeds |"
            )
        lines += ["", *verifier_markdown(entry.get("verifier", {}))]
    return "\n".join(lines)


def verifier_markdown(verifier: dict[str, Any]) -> list[str]:
    """Return the lines of the verifier table of one level (none when no model has a verifier)."""
    from train.tooling.warmup import VERIFIER_GATES  # noqa: PLC0415

    if not verifier:
        return []

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.0f}"

    head = " | ".join(VERIFIER_GATES)
    lines = ["Verifier on the test split's frames (%, mean over the finished seeds; blind: shown another row's frame):",
             "", f"| model | {head} | blind: {head} |", "| --- |" + " --- |" * (2 * len(VERIFIER_GATES))]  # fmt: skip
    for entry in verifier.values():
        seen = " | ".join(pct(entry["seen"][k]) for k in VERIFIER_GATES)
        blind = " | ".join(pct(entry["blind"][k]) for k in VERIFIER_GATES)
        lines.append(f"| {entry['label']} | {seen} | {blind} |")
    return [*lines, ""]


def save_study_png(summary: dict[str, Any], path: Path) -> Path:
    """Plot each pooled paired difference with its 95 % interval, one marker colour per gold-noise level."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    keys = list(dict.fromkeys(k for e in summary["levels"].values() for k in e["comparisons"]))
    fig, ax = plt.subplots(figsize=(10, 4))
    for j, (level, entry) in enumerate(summary["levels"].items()):
        for i, key in enumerate(keys):
            pooled = entry["comparisons"].get(key, {}).get("pooled")
            if not pooled or pooled["diff"] is None or pooled["ci_low"] is None:
                continue
            y = 100 * pooled["diff"]
            err = [[y - 100 * pooled["ci_low"]], [100 * pooled["ci_high"] - y]]
            ax.errorbar([i + 0.15 * j], [y], yerr=err, fmt="o", capsize=3, color=f"C{j}",
                        label=f"gold noise {level}" if i == 0 else None)  # fmt: skip
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(keys, fontsize=7, rotation=20)
    ax.set_ylabel("points (pooled over seeds, 95 % paired interval)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
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
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each its own process (default 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: the cores "
                        "shared out among the jobs)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.jobs < 1 or (args.threads is not None and args.threads < 1):
        raise TrainConfigError(f"--jobs {args.jobs} --threads {args.threads}: both must be at least 1")
    overrides = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.set)}
    cfg, seeds, levels = load_study(args.config, overrides)
    if len(seeds) < args.min_seeds:
        raise TrainConfigError(
            f"{args.config}: study.seeds has {len(seeds)} seeds, fewer than --min_seeds={args.min_seeds}"
        )
    run_study(cfg, seeds, levels, args.output_dir, jobs=args.jobs, threads=args.threads)


if __name__ == "__main__":
    run_cli(main)
