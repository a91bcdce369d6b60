"""The decomposition study at micro size (train/configs/miniature_micro.yaml): every run, the summary, the resume."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from train.checks import TrainConfigError
from train.miniature.config import load_config
from train.miniature.study import Miniature, reward_options
from train.miniature.suite import (
    describe,
    exclusion_path,
    finished_seeds,
    level_order,
    load_report,
    load_study,
    main,
    read_exclusions,
    read_record,
    record_path,
    run_dir,
    run_study,
    study_markdown,
    summarize_study,
    verifier_markdown,
    verifier_over_seeds,
    write_record,
)


MICRO = "train/configs/miniature_micro.yaml"
CLEAN = ["sft", "grpo_a", "grpo_b", "grpo_f", "grpo_g", "grpo_h", "more_sft_llm"]
NOISY = ["sft", "grpo_a", "grpo_b", "grpo_f", "more_sft_llm"]
KEY = "key-noise-0.50"
METRICS3 = ("average_bacc", "k_hit", "exact_key")


@pytest.fixture(scope="module")
def micro_study(tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("study")
    cfg, seeds, levels = load_study(MICRO)
    lines: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the parallel study's runs below: the numbers may depend on it
    try:
        summary = run_study(cfg, seeds, levels, out, log=lines.append)
    finally:
        torch.set_num_threads(threads)
    return out, summary, lines


@pytest.mark.slow  # the micro study: about 35 s
def test_every_run_finishes_and_noisy_runs_reuse_the_clean_warmup(micro_study):
    out, summary, _ = micro_study
    for level in (0.0, 0.3):
        for seed in (0, 1):
            folder = run_dir(out, level, seed)
            assert all(
                (folder / s / "done.json").exists()
                for s in Miniature.stages_of(["sft", "grpo_a", "grpo_b", "more_sft_llm"])
            )
            results = json.loads((folder / "results.json").read_text())
            assert results["config"]["gold_noise"] == level and results["config"]["seed"] == seed
            assert set(results["models"]["grpo_a"]["verifier"]) == {"seen", "blind", "by_distance"}
            assert set(results["paired"]) >= {"average_bacc: (a) - (e)", "k_hit: (a) - (b)"}
        noisy = run_dir(out, 0.3, 0)
        assert (noisy / "warmup" / "model.safetensors").read_bytes() == (
            run_dir(out, 0.0, 0) / "warmup" / "model.safetensors"
        ).read_bytes()
    noise_log = json.loads((run_dir(out, 0.3, 0) / "data" / "noise.json").read_text())
    assert len(noise_log) == round(0.3 * 8)
    assert json.loads((run_dir(out, 0.0, 0) / "data" / "noise.json").read_text()) == []
    level = summary["levels"]["0.30"]
    assert set(level["comparisons"]) == {f"{m}: (a) - ({x})" for m in METRICS3 for x in "efb"}
    clean = summary["levels"]["0.00"]["comparisons"]
    pairs = ["(a) - (e)", "(a) - (f)", "(a) - (b)", "(a) - (g)", "(g) - (f)", "(h) - (f)", "(h) - (b)"]
    assert set(clean) == {f"{m}: {x}" for m in METRICS3 for x in pairs}
    assert set(summary["levels"][KEY]["comparisons"]) == {
        f"{m}: {x}" for m in METRICS3 for x in (pairs[1], pairs[3], pairs[4])
    }
    assert set(summary["trends"]) == {
        f"{m}: {x}, {KEY} minus clean" for m in METRICS3 for x in ("(a) - (f)", "(g) - (f)")
    }
    for entry in [*level["comparisons"].values(), *summary["trends"].values()]:
        assert entry["verdict"] == "few" and entry["pooled_seeds"]["n_groups"] == 2  # 2 seeds: not decided
    assert set(summary["levels"]["0.00"]["exact_key"]) == set(CLEAN)
    spread = summary["levels"]["0.00"]["spread"]
    assert list(spread) == ["grpo_a", "grpo_b", "grpo_f", "grpo_g", "grpo_h"]
    assert spread["grpo_a"]["groups"] == 2 * 2 and spread["grpo_a"]["n_seeds"] == 2  # 1 step x 2 prompts, 2 seeds
    key_log = json.loads((run_dir(out, KEY, 0) / "data" / "noise.json").read_text())
    assert key_log and {e["field"] for e in key_log} == {"key_slice_frame"}
    assert (run_dir(out, KEY, 0) / "warmup" / "model.safetensors").read_bytes() == (
        run_dir(out, 0.0, 0) / "warmup" / "model.safetensors"
    ).read_bytes()
    for seed in (0, 1):  # (f) scores no verifier answer, (g) asks about another row's frame: their own r_c
        assert (
            json.loads((run_dir(out, 0.0, seed) / "grpo_f" / "done.json").read_text())["cross_view"] == "distance_only"
        )
        assert (
            json.loads((run_dir(out, 0.0, seed) / "grpo_g" / "done.json").read_text())["cross_view"] == "random_frame"
        )
    comp = level["comparisons"]["average_bacc: (a) - (e)"]
    assert set(comp["per_seed"]) == {"0", "1"} and comp["pooled"]["n_groups"] == 2 and comp["pooled"]["n_rows"] == 8
    verifier = summary["levels"]["0.00"]["verifier"]
    assert list(verifier) == ["sft", "grpo_a", "grpo_b", "grpo_f", "grpo_g", "grpo_h"]  # (e) has no verifier query
    assert list(verifier["grpo_a"]["by_distance"]) == ["0", "1", "2"]  # span 1: d = 2 shows no lesion
    from train.data import load_split
    from train.tiny.warmup import held_out_indices

    pool = list(load_split(run_dir(out, 0.0, 0) / "data" / "warmup_pool", "train"))
    held_out = [pool[i] for i in held_out_indices(len(pool), 2)]
    warmup = json.loads((run_dir(out, 0.0, 0) / "warmup" / "done.json").read_text())
    positives = sum(r["has_lesion"] for r in held_out)
    assert list(warmup["verifier_by_distance"]) == (["0", "1", "2"] if positives else [])
    assert [v["n"] for v in warmup["verifier_by_distance"].values()] == [positives] * (3 if positives else 0)
    assert verifier["grpo_a"]["by_distance"]["2"]["size_key"] is None
    runs = [
        json.loads((run_dir(out, 0.0, s) / "results.json").read_text())["models"]["sft"]["verifier"] for s in (0, 1)
    ]
    assert verifier["sft"]["n_seeds"] == 2 and verifier["sft"]["label"] == "SFT"
    assert (
        verifier["sft"]["seen"]["sensitivity"] == (runs[0]["seen"]["sensitivity"] + runs[1]["seen"]["sensitivity"]) / 2
    )
    md = (out / "study.md").read_text()
    assert "## gold noise 0.30" in md and "## gold noise key-noise-0.50" in md and "## Conclusions" in md
    assert "| paired difference | seed 0 | seed 1 | pooled, rows only | pooled, seeds and rows | verdict |" in md
    assert (
        "| model | exact key (d = 0) | K-Hit (d <= 1) |" in md
        and "| model | d | presence | location |" in md
        and "without reward spread (std <= 1e-06)" in md
    )
    assert "| model | sensitivity | specificity | location | attenuation | blind: sensitivity |" in md
    assert "claim (" not in md  # the miniature's claim check is not a question the study asks
    assert (out / "study.png").stat().st_size > 0


@pytest.mark.slow  # the micro study: about 35 s
def test_runs_go_seed_by_seed_and_the_summary_covers_the_finished_ones(micro_study, tmp_path):
    import shutil

    out, _, lines = micro_study
    order = [line.split(": ")[0] for line in lines if line.startswith("=== ")]
    assert order == [
        "=== gold noise 0.00, seed 0",
        "=== gold noise 0.30, seed 0",
        f"=== {KEY}, seed 0",
        "=== gold noise 0.00, seed 1",
        "=== gold noise 0.30, seed 1",
        f"=== {KEY}, seed 1",
    ]
    partial = tmp_path / "partial"
    shutil.copytree(out, partial)
    record_path(partial, 0.3, 1).unlink()  # seed 1's noisy run stopped before its record
    cfg, seeds, levels = load_study(MICRO)
    assert finished_seeds(partial, 0.3, seeds, levels[0.3]) == [0]
    assert finished_seeds(partial, 0.0, seeds, levels[0.0] + ["grpo_c"]) == []  # (c) was never asked for
    summary = summarize_study(partial, seeds, levels, cfg.n_bootstrap)
    assert summary["levels"]["0.00"]["finished"] == [0, 1] and summary["levels"]["0.30"]["finished"] == [0]
    assert set(summary["levels"]["0.30"]["comparisons"]["k_hit: (a) - (b)"]["per_seed"]) == {"0"}
    md = study_markdown(summary)
    assert "Finished: 2 of 2 seeds (0, 1)." in md and "Finished: 1 of 2 seeds (0)." in md
    assert study_markdown(summarize_study(tmp_path / "none", seeds, levels, cfg.n_bootstrap)).startswith(
        "No run of the study has finished yet."
    )


@pytest.mark.slow  # the micro study: about 35 s
def test_a_rerun_skips_every_recorded_run(micro_study):
    out, summary, _ = micro_study
    cfg, seeds, levels = load_study(MICRO)
    lines: list[str] = []
    again = run_study(cfg, seeds, levels, out, log=lines.append)
    runs = [line for line in lines if line.startswith("=== ")]
    assert runs == [
        f"=== {describe(level)}, seed {seed}: recorded in {record_path(out, level, seed)}, skipped"
        for seed in (0, 1)
        for level in (0.0, 0.3, KEY)
    ]
    assert not [line for line in lines if line.startswith("== ")]  # no stage was even looked at
    assert again == summary


@pytest.mark.slow  # the micro study: about 35 s
def test_the_records_alone_give_the_summary_and_resume_a_study_whose_folders_are_gone(micro_study, tmp_path):
    import shutil

    out, summary, _ = micro_study
    cfg, seeds, levels = load_study(MICRO)
    record = read_record(record_path(out, 0.3, 1))
    assert record["gold_noise"] == 0.3 and record["seed"] == 1 and record["models"] == NOISY
    assert [len(record["scores"][m]) for m in NOISY] == [4] * 5 and record["results"]["config"]["seed"] == 1
    before = record_path(out, 0.3, 1).read_bytes()
    assert (
        write_record(out, 0.3, 1, NOISY, record["torch_threads"]).read_bytes() == before
    )  # the same run, the same bytes
    # two machines' records, pooled in a third folder: the same summary as the study that ran them all
    pooled = tmp_path / "pooled" / "records"
    pooled.mkdir(parents=True)
    for path in sorted((out / "records").iterdir()):
        shutil.copy(path, pooled / path.name)
    assert summarize_study(pooled.parent, seeds, levels, cfg.n_bootstrap) == summary
    main(["--config", str(MICRO), "--output_dir", str(pooled.parent), "--report_only"])  # trains nothing, any seeds
    assert sorted(p.name for p in pooled.parent.iterdir()) == ["records", "study.json", "study.md", "study.png"]
    assert (pooled.parent / "study.md").read_text() == study_markdown(summary)
    # seed 1's noisy record lost, and every run folder: the clean warm-up runs again and the run comes out equal
    (pooled / record_path(out, 0.3, 1).name).unlink()
    lines: list[str] = []
    again = run_study(cfg, seeds, levels, pooled.parent, log=lines.append)
    assert [line for line in lines if line.startswith("=== ")][-1] == (
        f"=== gold noise 0.30, seed 1: {run_dir(pooled.parent, 0.3, 1)}"
    )
    assert f"   the clean run's warm-up is not in {run_dir(pooled.parent, 0.0, 1)}: running it there first" in lines
    assert not run_dir(pooled.parent, 0.0, 0).exists()  # recorded runs leave no folder
    assert read_record(record_path(pooled.parent, 0.3, 1))["scores"] == record["scores"]
    assert again == summary


@pytest.mark.slow  # the micro study, two runs at a time: about 40 s
def test_runs_in_two_processes_give_the_records_of_the_sequential_study(micro_study, tmp_path):
    import shutil

    out, summary, _ = micro_study
    cfg, seeds, levels = load_study(MICRO)
    (tmp_path / "records").mkdir()
    shutil.copy(record_path(out, 0.0, 1), record_path(tmp_path, 0.0, 1))  # seed 1's clean run: its record only
    lines: list[str] = []
    again = run_study(cfg, seeds, levels, tmp_path, log=lines.append, jobs=2, threads=1)
    assert "=== 5 runs, 2 at a time, 1 torch thread(s) each" in lines
    assert (run_dir(tmp_path, 0.0, 1) / "warmup" / "done.json").exists()  # warmed up again for the noisy run
    assert not (run_dir(tmp_path, 0.0, 1) / "sft").exists()
    for level, seed in ((0.0, 0), (0.3, 0), (0.3, 1), (KEY, 1)):
        ours, theirs = read_record(record_path(tmp_path, level, seed)), read_record(record_path(out, level, seed))
        assert ours["scores"] == theirs["scores"] and ours["torch_threads"] == 1
    assert again == summary


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_seed_whose_warmup_misses_its_gates_is_excluded_and_the_study_goes_on(tmp_path, jobs):
    cfg, seeds, levels = load_study(MICRO)
    missing = replace(cfg, warmup_target_verifier_accuracy=1.0)  # 2 warm-up steps cannot read every frame right
    lines: list[str] = []
    summary = run_study(missing, seeds, levels, tmp_path, log=lines.append, jobs=jobs, threads=1)
    reasons = read_exclusions(tmp_path, seeds)
    assert sorted(reasons) == [0, 1]
    assert all(r.startswith("LM warm-up: held-out verifier accuracy below its gates (") for r in reasons.values())
    assert json.loads(exclusion_path(tmp_path, 0).read_text())["config"]["warmup_target_verifier_accuracy"] == 1.0
    assert not list((tmp_path / "records").glob("*.json.gz"))  # no run was recorded
    assert not run_dir(tmp_path, 0.3, 0).exists() and not (run_dir(tmp_path, 0.0, 0) / "sft").exists()
    assert summary["excluded"] == reasons and summary["levels"] == {}
    md = (tmp_path / "study.md").read_text()
    assert md.startswith("Seed 0 is excluded: its warm-up missed its targets by its step cap") and "Seed 1 is" in md
    again: list[str] = []
    run_study(missing, seeds, levels, tmp_path, log=again.append, jobs=jobs, threads=1)
    skipped = [line for line in again if line.startswith("=== ") and "excluded" in line]
    assert skipped == [
        f"=== {describe(level)}, seed {s}: excluded ({exclusion_path(tmp_path, s)}), skipped"
        for s in seeds
        for level in sorted(levels, key=level_order)
    ]


@pytest.mark.slow  # the micro study: about 35 s
def test_the_summary_pools_the_other_seeds_and_names_an_excluded_one(micro_study, tmp_path):
    import shutil

    from train.miniature.suite import write_exclusion

    out, _, _ = micro_study
    shutil.copytree(out / "records", tmp_path / "records")
    for path in (tmp_path / "records").glob("*-seed-1.json.gz"):
        path.unlink()
    cfg, seeds, levels = load_study(MICRO)
    write_exclusion(tmp_path, 1, "LM warm-up: below its gates", cfg)
    lines: list[str] = []
    summary = run_study(cfg, seeds, levels, tmp_path, log=lines.append)
    assert [line for line in lines if line.startswith("=== ") and "seed 1" in line] == [
        f"=== {describe(level)}, seed 1: excluded ({exclusion_path(tmp_path, 1)}), skipped" for level in levels
    ]
    assert summary["excluded"] == {1: "LM warm-up: below its gates"}
    assert [entry["finished"] for entry in summary["levels"].values()] == [[0], [0], [0]]
    md = (tmp_path / "study.md").read_text()
    assert (
        "Seed 1 is excluded: its warm-up missed its targets by its step cap, so it trained nothing further (LM " in md
    )
    assert "Finished: 1 of 2 seeds (0)." in md


def test_a_failing_run_in_a_process_stops_the_study_with_its_error(tmp_path):
    cfg, seeds, levels = load_study(MICRO)
    bad = {0.0: ["sft", "grpo_g"], 0.3: ["sft", "grpo_a"]}  # (g) with one row a step has no other row's frame
    with pytest.raises(TrainConfigError, match="grpo_prompts_per_step=1 leaves no other row"):
        run_study(replace(cfg, grpo_prompts_per_step=1), seeds[:1], bad, tmp_path, log=lambda _: None, jobs=2)
    assert not (tmp_path / "records").exists()


WATCHED_POOL = """
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor

from train.miniature.suite import exit_with_parent

if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=exit_with_parent, initargs=(os.getpid(), 0.1)) as pool:
        print(pool.submit(os.getpid).result(), flush=True)
        pool.submit(time.sleep, 300)
        time.sleep(300)
"""


def _alive(pid: int) -> bool:
    from pathlib import Path

    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def test_a_worker_exits_when_the_study_process_is_stopped_alone(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "pool.py"
    script.write_text(WATCHED_POOL)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    worker = None
    try:
        worker = int(parent.stdout.readline())
        assert _alive(worker)
        parent.send_signal(signal.SIGTERM)  # to the study's process only, as `kill PID` does
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        parent.kill()
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.slow  # the micro study: about 35 s
def test_a_broken_record_or_records_of_two_configurations_are_one_line(micro_study, tmp_path):
    import gzip
    import shutil

    out, _, _ = micro_study
    cfg, seeds, levels = load_study(MICRO)
    (tmp_path / "records").mkdir()
    broken = record_path(tmp_path, 0.0, 0)
    broken.write_text("not gzip")
    with pytest.raises(TrainConfigError, match=f"^{broken}: not a study record"):
        summarize_study(tmp_path, seeds, levels, cfg.n_bootstrap)
    shutil.copy(record_path(out, 0.0, 0), broken)
    other = read_record(record_path(out, 0.0, 1))
    other["results"]["config"]["sft_steps"] += 1
    record_path(tmp_path, 0.0, 1).write_bytes(gzip.compress(json.dumps(other).encode()))
    with pytest.raises(TrainConfigError, match=r"seed-1.json.gz and .*seed-0.json.gz: .*\['sft_steps'\]"):
        summarize_study(tmp_path, seeds, levels, cfg.n_bootstrap)


def test_the_verifier_table_averages_each_rate_over_the_seeds_that_measured_it():
    def run(sens, loc):
        rates = {"sensitivity": sens, "specificity": 1.0, "location": loc, "attenuation": 0.5}
        blind = {"sensitivity": 0.25, "specificity": 0.75, "location": None, "attenuation": None}
        return {
            "models": {
                "sft": {"label": "SFT", "verifier": {"seen": rates, "blind": blind}},
                "more_sft_llm": {"label": "(e)", "verifier": None},
            }
        }

    out = verifier_over_seeds({0: run(0.5, None), 1: run(1.0, 0.75)}, ["sft", "more_sft_llm"])
    assert out == {
        "sft": {
            "label": "SFT",
            "n_seeds": 2,
            "seen": {"sensitivity": 0.75, "specificity": 1.0, "location": 0.75, "attenuation": 0.5},
            "blind": {"sensitivity": 0.25, "specificity": 0.75, "location": None, "attenuation": None},
        }
    }
    lines = verifier_markdown(out)
    assert "| SFT | 75 | 100 | 75 | 50 | 25 | 75 | n/a | n/a |" in lines


def test_a_study_with_too_few_seeds_or_a_bad_section_is_one_line(tmp_path):
    with pytest.raises(TrainConfigError, match=r"study.seeds has 2 seeds, fewer than --min_seeds=5"):
        main(["--config", MICRO, "--output_dir", str(tmp_path / "o")])
    path = tmp_path / "s.yaml"
    path.write_text("n_train: 8\nstudy: {seeds: [0]}\n")
    with pytest.raises(TrainConfigError, match="the keys seeds and noise"):
        load_study(path)
    path.write_text("n_train: 8\nstudy: {seeds: [0], noise: {0.15: [sft, grpo_a]}}\n")
    with pytest.raises(TrainConfigError, match="needs the clean level 0.0"):
        load_study(path)


def test_each_run_gets_its_r_c_options():
    got = {
        stage: reward_options(stage, "skip")["scoring_config"]
        for stage in ("grpo_a", "grpo_b", "grpo_f", "grpo_g", "grpo_h")
    }
    assert {k: v.cross_view for k, v in got.items()} == {
        "grpo_a": "full",
        "grpo_b": "full",
        "grpo_f": "distance_only",
        "grpo_g": "random_frame",
        "grpo_h": "full",
    }
    assert {k: v.iou_penalty for k, v in got.items()} == {
        "grpo_a": 0.3,
        "grpo_b": 0.3,
        "grpo_f": 0.3,
        "grpo_g": 0.3,
        "grpo_h": 0.0,
    }
    assert reward_options("grpo_a", "query_named_slice")["scoring_config"].negative_rows == "query_named_slice"
    with pytest.raises(TrainConfigError, match=r"negative_rows='sometimes' must be one of skip \| query_named_slice"):
        load_config(None, {"negative_rows": "sometimes"})


def test_a_random_frame_run_without_another_row_fails_before_training(tmp_path):
    cfg = load_config(None, {"models": ["sft", "grpo_a", "grpo_g"], "grpo_prompts_per_step": 1})
    with pytest.raises(TrainConfigError) as err:
        Miniature(cfg, tmp_path / "g").run()
    assert "\n" not in str(err.value) and "grpo_prompts_per_step=1 leaves no other row" in str(err.value)
    assert not (tmp_path / "g").exists()  # refused before anything ran


def test_the_config_knows_every_run_the_study_labels():
    from train.miniature.config import MODEL_NAMES
    from train.miniature.runs import MODELS

    assert tuple(MODELS) == MODEL_NAMES
    with pytest.raises(TrainConfigError, match=r"models=\['sft', 'grpo_z'\]"):
        load_config(None, {"models": ["sft", "grpo_z"]})


@pytest.mark.slow  # the paired bootstrap over every shipped record: about 2 min
@pytest.mark.parametrize(
    ("records", "config", "overrides"),
    [
        ("miniature_study", "miniature_study_8_frames.yaml", {}),
        ("miniature_key_study", "miniature_study.yaml", {}),
        ("miniature_pilot_gold_warmup", "miniature_pilot.yaml", {}),
        ("miniature_pilot", "miniature_pilot.yaml", {}),
        ("miniature_pilot_128px", "miniature_pilot.yaml", {"size_px": 128}),
    ],
)
def test_the_shipped_records_give_the_shipped_study_summary(tmp_path, records, config, overrides):
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    shutil.copytree(root / "docs/records" / records, tmp_path / "records")
    cfg, seeds, levels = load_study(root / "train/configs" / config, overrides)
    summary = summarize_study(tmp_path, seeds, levels, cfg.n_bootstrap, load_report(root / "train/configs" / config))
    shipped = json.loads((root / "docs/img" / f"{records}.json").read_text())
    assert json.loads(json.dumps(summary)) == shipped
    assert study_markdown(summary) == (root / "docs/img" / f"{records}.md").read_text()
    if records == "miniature_key_study":  # seeds 0-20 hold its 8 finished ones; seed 21 was excluded after them
        assert (summary["seeds"], summary["beyond"]) == (list(range(21)), [21])
    if records == "miniature_pilot":  # seeds 0-5 hold its 3 finished ones (0, 3, 5); its rule is not passed
        assert (summary["seeds"], summary["decision"]["passed"]) == (list(range(6)), False)
    if records == "miniature_pilot_128px":  # seeds 0-6 hold its 3 finished ones (3, 5, 6); its rule is not passed
        assert (summary["seeds"], summary["decision"]["passed"]) == (list(range(7)), False)


def test_an_effect_is_claimed_only_where_the_seeds_and_rows_interval_excludes_zero():
    from train.miniature.suite import conclusions, seed_level_verdict

    assert seed_level_verdict({"diff": 0.02, "ci_low": 0.001, "ci_high": 0.04}) == "above"
    assert seed_level_verdict({"diff": -0.02, "ci_low": -0.04, "ci_high": -0.001}) == "below"
    assert seed_level_verdict({"diff": 0.02, "ci_low": 0.0, "ci_high": 0.04}) == "none"  # touching 0 is no claim
    assert seed_level_verdict({"diff": None, "ci_low": None, "ci_high": None}) == "none"

    def comp(rows, seeds_rows, per_seed):
        return {
            "per_seed": {s: {"diff": d} for s, d in per_seed.items()},
            "n_above": 1,
            "pooled": {"diff": rows[0], "ci_low": rows[1], "ci_high": rows[2]},
            "pooled_seeds": {"diff": seeds_rows[0], "ci_low": seeds_rows[1], "ci_high": seeds_rows[2]},
        }

    eight = {str(s): 0.01 for s in range(8)}
    summary = {
        "levels": {
            "0.15": {
                "comparisons": {
                    "k_hit: (a) - (e)": comp(
                        (0.04, 0.013, 0.067), (0.04, -0.041, 0.141), eight | {"0": -0.02, "2": 0.221}
                    )
                }
            },
            "0.00": {
                "comparisons": {
                    "average_bacc: (a) - (b)": comp((0.021, 0.015, 0.028), (0.021, 0.002, 0.053), eight),
                    "average_bacc: (a) - (f)": comp(
                        (0.021, 0.015, 0.028), (0.021, 0.002, 0.053), {"0": 0.01, "2": 0.03}
                    ),
                }
            },
        }
    }
    got = conclusions(summary)
    assert [(c["level"], c["comparison"], c["metric"], c["verdict"]) for c in got] == [
        ("0.15", "(a) - (e)", "k_hit", "none"),
        ("0.00", "(a) - (b)", "average_bacc", "above"),
        ("0.00", "(a) - (f)", "average_bacc", "few"),
    ]
    assert got[0]["text"] == (
        "(a) - (e), K-Hit, 15 % noisy gold: +4.0 [-4.1, +14.1] points over 8 seeds and their rows: no effect claimed; "
        "the interval rules out effects above +14.1 and below -4.1 points. The rows-only interval +4.0 [+1.3, +6.7] "
        "excludes 0; the seeds-and-rows one does not (per seed: -2.0, +1.0, +22.1, +1.0, +1.0, +1.0, +1.0, +1.0)."
    )
    assert got[1]["text"] == (
        "(a) - (b), average B-Acc, clean gold: +2.1 [+0.2, +5.3] points over 8 seeds and their rows: above 0: claimed."
    )
    assert got[2]["text"] == (
        "(a) - (f), average B-Acc, clean gold: +2.1 [+0.2, +5.3] points over 2 seeds and their rows: not decided, 2 "
        "finished seeds where the rule needs 8 (the interval alone excludes 0)."
    )
    assert seed_level_verdict({"diff": 0.02, "ci_low": 0.001, "ci_high": 0.04}, n_seeds=7) == "few"
    assert seed_level_verdict({"diff": 0.02, "ci_low": 0.001, "ci_high": 0.04}, n_seeds=8) == "above"
    assert got[1]["rows_only"] == [0.015, 0.028] and got[1]["seeds_rows"] == [0.002, 0.053]


def test_a_stage_runs_only_its_seeds_and_a_seed_outside_the_config_is_one_line(tmp_path):
    cfg, seeds, levels = load_study(MICRO)
    missing = replace(cfg, warmup_target_verifier_accuracy=1.0)  # each run ends at its warm-up: quick
    lines: list[str] = []
    run_study(missing, seeds, levels, tmp_path, log=lines.append, only=[1])
    assert sorted(read_exclusions(tmp_path, seeds)) == [1] and not run_dir(tmp_path, 0.0, 0).exists()
    with pytest.raises(
        TrainConfigError, match=r"--seeds \[7\]: each must be one of the config's study.seeds \[0, 1\]"
    ):
        main(["--config", MICRO, "--output_dir", str(tmp_path / "o"), "--min_seeds", "2", "--seeds", "7"])


def test_a_record_without_the_truths_key_frame_gets_it_from_its_redrawn_test_split():
    from train.miniature.suite import with_key_truth
    from train.tiny.synthetic import make_visible_rows

    cfg = {
        "n_test": 6,
        "seed": 3,
        "n_frames": 8,
        "size_px": 32,
        "organs": ["kidney"],
        "sizes_mm": [31.0, 90.0],
        "lesion_span": 2,
    }
    test = make_visible_rows(
        6, split="test", seed=1003, n_frames=8, size_px=32, organs=("kidney",), sizes_mm=(31.0, 90.0), span=2
    )
    scores = [{"organ": r["organ"], "has_lesion": r["has_lesion"], "pred_key_slice": 4} for r in test]
    record = {"results": {"config": cfg}, "scores": {"sft": scores, "grpo_a": scores}}
    got = with_key_truth(record)
    assert [r["key_slice_frame"] for r in got["scores"]["grpo_a"]] == [r["key_slice_frame"] for r in test]
    assert "key_slice_frame" not in record["scores"]["sft"][0]  # the record read is left as it was
    assert with_key_truth(got) is got  # a record that carries it is returned as it is
    flipped = [dict(scores[0], has_lesion=not scores[0]["has_lesion"]), *scores[1:]]
    assert with_key_truth({"results": {"config": cfg}, "scores": {"sft": flipped}})["scores"]["sft"] == flipped


def test_a_key_noise_trend_is_the_difference_at_the_rate_minus_the_same_difference_on_clean_gold(tmp_path):
    import gzip

    from train.miniature.suite import key_noise_trends

    def rows(hits):
        return [
            {
                "organ": "kidney",
                "has_lesion": True,
                "score_existence": 1.0,
                "score_k_hit": h,
                "pred_key_slice": 5 if h else 9,
                "key_slice_frame": 5,
            }
            for h in hits
        ]

    levels = {0.0: ["sft", "grpo_a", "grpo_f"], "key-noise-0.50": ["sft", "grpo_a", "grpo_f"]}
    scores = {
        0.0: {"grpo_a": [1, 1, 0, 0], "grpo_f": [1, 0, 0, 0]},
        "key-noise-0.50": {"grpo_a": [1, 1, 1, 0], "grpo_f": [1, 0, 0, 0]},
    }
    for level, models in scores.items():
        for seed in (0, 1):
            record = {
                "gold_noise": level,
                "seed": seed,
                "models": levels[level],
                "results": {"config": {}},
                "scores": {name: rows(hits) for name, hits in models.items()},
            }
            path = record_path(tmp_path, level, seed)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(gzip.compress(json.dumps(record).encode()))
    got = key_noise_trends(tmp_path, levels, {0.0: [0, 1], "key-noise-0.50": [0, 1]}, n_bootstrap=200)
    assert set(got) == {f"{m}: (a) - (f), key-noise-0.50 minus clean" for m in ("average_bacc", "k_hit", "exact_key")}
    trend = got["k_hit: (a) - (f), key-noise-0.50 minus clean"]  # (0.75 - 0.25) - (0.5 - 0.25) in both seeds
    assert trend["pooled"]["diff"] == trend["pooled_seeds"]["diff"] == 0.25
    assert [v["diff"] for v in trend["per_seed"].values()] == [0.25, 0.25] and trend["pooled_seeds"]["n_groups"] == 2
    assert got["exact_key: (a) - (f), key-noise-0.50 minus clean"]["pooled"]["diff"] == 0.25  # hits named frame 5


def test_the_study_pools_the_first_seeds_in_list_order_to_finish_every_setting(tmp_path):
    import gzip

    from train.miniature.suite import study_seeds

    levels = {0.0: ["sft", "grpo_a"], KEY: ["sft", "grpo_a"]}
    rows = [
        {
            "organ": "kidney",
            "has_lesion": True,
            "score_existence": 1.0,
            "score_k_hit": 1,
            "pred_key_slice": 5,
            "key_slice_frame": 5,
        }
    ]

    def finish(seed: int, level) -> None:
        record = {
            "gold_noise": level,
            "seed": seed,
            "models": levels[level],
            "results": {"config": {}},
            "scores": {name: rows for name in levels[level]},
        }
        path = record_path(tmp_path, level, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(json.dumps(record).encode()))

    def exclude(seed: int) -> None:
        exclusion_path(tmp_path, seed).write_text(json.dumps({"seed": seed, "reason": "gates missed"}))

    seeds = [3, 1, 4, 0, 5, 9]
    for seed, level in ((3, 0.0), (3, KEY), (4, 0.0), (5, 0.0), (5, KEY)):  # seed 5 finished; 4, before it, has not
        finish(seed, level)
    exclude(1)
    assert study_seeds(tmp_path, seeds, levels, needed=2) == seeds  # undecided: every finished run is pooled
    finish(4, KEY)
    assert study_seeds(tmp_path, seeds, levels, needed=2) == [3, 1, 4]  # 3 and 4 decide; 0, 5 and 9 are after
    assert study_seeds(tmp_path, seeds, levels, needed=4) == seeds  # seed 0 is still to run
    exclude(0)
    assert study_seeds(tmp_path, seeds, levels, needed=3) == [3, 1, 4, 0, 5]
    assert study_seeds(tmp_path, seeds, levels) == seeds  # the rule's 8 are not there: all of them


def test_a_study_report_section_is_checked_in_one_line(tmp_path):
    from train.miniature.suite import DEFAULT_COMPARISONS, Report

    path = tmp_path / "s.yaml"
    base = "n_train: 8\nstudy: {seeds: [0], noise: {0.0: [sft, grpo_a]}"
    path.write_text(base + "}\n")
    assert load_report(path) == Report() and Report().comparisons == DEFAULT_COMPARISONS
    path.write_text(base + ", report: {n_bootstrap: 2000, family: [k_hit], comparisons: ['(f) - (b)']}}\n")
    assert load_report(path) == Report(n_bootstrap=2000, family=("k_hit",), comparisons=("(f) - (b)",))
    for report, message in [
        ("{draws: 10}", "study.report takes the keys"),
        ("{comparisons: ['(z) - (b)']}", r"unknown comparisons \['\(z\) - \(b\)'\]"),
        ("{family: [bleu], n_bootstrap: 2000}", "family takes metrics"),
        ("{family: [k_hit]}", "need n_bootstrap >= 1000"),
    ]:
        path.write_text(f"{base}, report: {report}}}\n")
        with pytest.raises(TrainConfigError, match=message) as err:
            load_study(path)
        assert "\n" not in str(err.value)


def test_the_family_counts_what_survives_holm_and_benjamini_hochberg():
    from train.miniature.suite import Report, family, family_markdown

    def comp(p, diff=0.02):
        return {"pooled_seeds": {"diff": diff, "ci_low": diff - 0.01, "ci_high": diff + 0.01, "p": p, "mdd": 0.05}}

    summary = {
        "levels": {
            "0.00": {
                "comparisons": {
                    "k_hit: (a) - (b)": comp(0.001),
                    "exact_key: (a) - (b)": comp(0.02),
                    "average_bacc: (a) - (b)": comp(0.0001),
                }
            }
        },  # not in the family
        "trends": {
            "k_hit: (a) - (f), key-noise-0.25 minus clean": {"level": "key-noise-0.25", **comp(0.03)},
            "exact_key: (a) - (f), key-noise-0.25 minus clean": {"level": "key-noise-0.25", **comp(0.5)},
        },
    }
    got = family(summary, Report(n_bootstrap=1000, family=("k_hit", "exact_key")))
    assert [(m["comparison"], m["metric"], m["trend"]) for m in got["members"]] == [
        ("(a) - (b)", "k_hit", False),
        ("(a) - (b)", "exact_key", False),
        ("(a) - (f)", "k_hit", True),
        ("(a) - (f)", "exact_key", True),
    ]
    # Holm: 0.001 x 4 = 0.004, 0.02 x 3 = 0.06, 0.03 x 2 = 0.06, 0.5; BH: 0.004, 0.03 x 4/3 = 0.04, 0.04, 0.5
    assert [m["p_holm"] for m in got["members"]] == pytest.approx([0.004, 0.06, 0.06, 0.5])
    assert [m["p_bh"] for m in got["members"]] == pytest.approx([0.004, 0.04, 0.04, 0.5])
    assert got["below_alpha"] == {"p": 3, "p_holm": 1, "p_bh": 3}
    text = "\n".join(family_markdown(got))
    assert "Below 0.05: 3 unadjusted, 1 after Holm, 3 after Benjamini-Hochberg; 0.2 would be expected" in text
    assert "| (a) - (f) at the rate minus on clean gold | K-Hit | key frame moved on 25 % of positives | " in text


def test_a_bound_within_its_monte_carlo_error_of_zero_is_drawn_again_and_then_not_claimed(monkeypatch):
    import train.miniature.suite as suite
    from train.miniature.power import k_hit
    from train.miniature.suite import Report, _intervals, _near_zero, seed_level_verdict

    assert _near_zero({"ci_low": 0.0002, "ci_high": 0.05, "mc_error": 0.0001})
    assert _near_zero({"ci_low": -0.05, "ci_high": -0.0003, "mc_error": 0.0001})
    assert not _near_zero({"ci_low": 0.0004, "ci_high": 0.05, "mc_error": 0.0001})
    assert not _near_zero({"ci_low": 0.0, "ci_high": 0.05, "mc_error": 0.0001})  # at 0 itself: excludes nothing
    assert seed_level_verdict({"diff": 0.02, "ci_low": 0.0002, "ci_high": 0.05, "edge": True}, 8) == "edge"
    assert seed_level_verdict({"diff": 0.02, "ci_low": 0.0002, "ci_high": 0.05, "edge": False}, 8) == "above"

    def row(hit):
        return {"organ": "liver", "has_lesion": True, "score_k_hit": hit}

    # the seeds' gains 1/8, 2/8, ..., 8/8 on every row: each draw is a mean of 8 drawn seeds' gains, its lower bound
    # about 0.37; with the bound counted near 0 up to 10^4 Monte Carlo errors, it is drawn again and then at the edge
    groups = {
        s: [(1.0, k_hit, [row(1.0)] * (s + 1) + [row(0.0)] * (7 - s)), (-1.0, k_hit, [row(0.0)] * 8)] for s in range(8)
    }
    _, _, seeds_rows = _intervals(groups, 1000, Report(n_bootstrap=1000))
    assert (seeds_rows["n_bootstrap"], seeds_rows.get("edge")) == (1000, None)
    monkeypatch.setattr(suite, "EDGE_MC_ERRORS", 1e4)
    _, _, seeds_rows = _intervals(groups, 1000, Report(n_bootstrap=1000))
    assert (seeds_rows["n_bootstrap"], seeds_rows["edge"]) == (10000, True)
    assert seed_level_verdict(seeds_rows, 8) == "edge"
