"""The pilot with a positive control: SFT's key frame drawn among the lesion's frames, the warm-up gated on the mean of
its last checks, the endpoint compared, and the decision rule (train/configs/miniature_pilot.yaml)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from train.checks import TrainConfigError
from train.miniature.config import config_from_dict
from train.miniature.noise import random_visible_keys
from train.miniature.suite import Report, load_report, load_study, pilot_decision, run_study, study_markdown
from train.tiny.synthetic import make_visible_rows, visible_lesion_radii_px
from train.tiny.warmup import WarmupResult, gate_window


PILOT = "train/configs/miniature_pilot.yaml"
MICRO = "train/configs/miniature_micro.yaml"


def _rows(boxes):
    return make_visible_rows(60, n_frames=12, size_px=64, seed=3, organs=("kidney", "liver"), span=3, boxes_out=boxes)


def test_sft_rows_name_a_frame_of_the_lesion_with_that_frames_box():
    boxes: list = []
    rows = _rows(boxes)
    assert make_visible_rows(60, n_frames=12, size_px=64, seed=3, organs=("kidney", "liver"), span=3) == rows
    masks: list = []
    make_visible_rows(60, n_frames=12, size_px=64, seed=3, organs=("kidney", "liver"), span=3, masks_out=masks)
    out, log = random_visible_keys(rows, boxes, size_px=64, span=3, seed=0)
    assert rows == _rows([])  # the input is left as it was
    moved = {e["row"]: e for e in log}
    positives = [i for i, r in enumerate(rows) if r["has_lesion"]]
    assert len(positives) == 30 and len(log) == 27  # 3 draws fell on the gold key frame
    for i, (before, after) in enumerate(zip(rows, out, strict=True)):
        if i not in moved:
            assert after == before
            continue
        key, frame = before["key_slice_frame"], after["key_slice_frame"]
        assert moved[i] == {
            "row": i,
            "case_id": before["case_id"],
            "field": "key_slice_frame",
            "from": key,
            "to": frame,
        }
        assert 1 <= abs(frame - key) <= 3 and masks[i][frame - 1].any()  # a frame that shows the lesion
        ys, xs = np.nonzero(masks[i][frame - 1])
        rad = visible_lesion_radii_px(12, 64, key, before["long_axis_mm"], 3)[frame - 1]
        # the disc of radius r around (cx, cy) covers cx - r + 1 .. cx + r - 1: the gold's box is [cx - r, cx + r)
        px = [xs.min() - 1, ys.min() - 1, xs.max() + 1, ys.max() + 1]
        if min(px) >= 0 and max(px) <= 64:  # an unclipped disc
            assert px[2] - px[0] == 2 * rad
            assert after["bbox_qwen"] == [int(round(v * 1000 / 64)) for v in px]
        x1, y1, x2, y2 = after["bbox_qwen"]
        assert after["report"].endswith(f"<key_slice>{frame}</key_slice>, <bbox>[{x1}, {y1}, {x2}, {y2}]</bbox>")
        same = ("long_axis_mm", "location", "attenuation", "has_lesion", "frames", "prompt")
        assert all(after[k] == before[k] for k in same)
    frames = [e["to"] - e["from"] for e in log]
    assert sorted(set(frames)) == [-3, -2, -1, 1, 2, 3]
    again, log_again = random_visible_keys(rows, boxes, size_px=64, span=3, seed=0)
    assert again == out and log_again == log  # seeded
    with pytest.raises(TrainConfigError, match="60 rows but 59 lesion boxes"):
        random_visible_keys(rows, boxes[:-1], size_px=64, span=3, seed=0)


def test_the_sft_key_frame_setting_is_checked_in_one_line():
    assert config_from_dict({"sft_key_frame": "random_visible"}).sft_key_frame == "random_visible"
    with pytest.raises(TrainConfigError, match="sft_key_frame='widest' must be one of gold | random_visible"):
        config_from_dict({"sft_key_frame": "widest"})
    with pytest.raises(TrainConfigError, match="sft_key_frame='random_visible' does not run with gold_noise > 0"):
        config_from_dict({"sft_key_frame": "random_visible", "gold_noise": 0.15})
    assert config_from_dict({"sft_key_frame": "random_visible", "key_frame_noise": 0.25}).key_frame_noise == 0.25
    assert config_from_dict({"warmup_key_frame": "random_visible", "gold_noise": 0.15}).gold_noise == 0.15
    with pytest.raises(TrainConfigError, match="warmup_key_frame='first' must be one of"):
        config_from_dict({"warmup_key_frame": "first"})
    with pytest.raises(TrainConfigError, match="warmup_gate_checks=0 must be at least 1"):
        config_from_dict({"warmup_gate_checks": 0})


def _result(*rates: float) -> WarmupResult:
    result = WarmupResult(steps=0)
    for i, rate in enumerate(rates):
        result.verifier_accuracy.append((100 * (i + 1), {"size": rate, "location": 1.0}))
    return result


def test_the_gates_hold_on_the_mean_of_the_last_checks_not_a_first_lucky_one():
    gates = ("size", "location")
    assert gate_window(_result(0.5, 0.95), 3, gates) is None  # two checks: not yet
    window = gate_window(_result(0.5, 0.95, 0.85, 0.92), 3, gates)
    assert window == pytest.approx({"size": (0.95 + 0.85 + 0.92) / 3, "location": 1.0})
    assert gate_window(_result(0.5, 0.95, 0.80, 0.92), 3, gates)["size"] == pytest.approx(0.89)  # one lucky 0.92
    assert gate_window(_result(0.5, 0.95, 0.80, 0.92), 1, gates) == {"size": 0.92, "location": 1.0}
    result = _result(0.95, 0.95, 0.95)
    result.verifier_accuracy[1][1]["size"] = None  # a check that could not measure it
    assert gate_window(result, 3, gates) == {"size": None, "location": 1.0}


def _summary(diff, low, high, finished):
    comp = {"pooled_seeds": {"diff": diff, "ci_low": low, "ci_high": high}}
    return {"levels": {"0.00": {"finished": finished, "comparisons": {"exact_in_lesion: (f) - (b)": comp}}}}


def test_the_pilot_decides_on_its_margin_and_its_interval_over_its_seeds():
    report = Report(
        n_bootstrap=1000,
        comparisons=("(f) - (b)",),
        in_lesion=("exact_in_lesion",),
        finished_seeds=3,
        decision={"comparison": "(f) - (b)", "metric": "exact_in_lesion", "margin": 10},
    )
    passed = pilot_decision(_summary(0.12, 0.02, 0.22, [0, 4, 7]), report)
    assert passed == {
        "comparison": "(f) - (b)",
        "metric": "exact_in_lesion",
        "margin": 10,
        "passed": True,
        "n_seeds": 3,
        "diff": 0.12,
        "ci_low": 0.02,
        "ci_high": 0.22,
    }
    assert pilot_decision(_summary(0.09, 0.02, 0.16, [0, 4, 7]), report)["passed"] is False  # under the margin
    assert pilot_decision(_summary(0.12, -0.01, 0.25, [0, 4, 7]), report)["passed"] is False  # interval holds 0
    assert pilot_decision(_summary(0.12, 0.02, 0.22, [0, 4]), report)["passed"] is None  # 2 of its 3 seeds
    assert pilot_decision({"levels": {}}, report) == report.decision | {"passed": None, "n_seeds": 0}
    text = study_markdown({"levels": {}, "seeds": [0], "decision": passed})
    assert "Outcome: **passed**: +12.0 [+2.0, +22.0] over 3 seeds." in text


def test_the_pilot_config_is_what_its_docs_say(tmp_path):
    cfg, seeds, levels = load_study(PILOT)
    assert (cfg.sft_key_frame, cfg.warmup_key_frame) == ("random_visible", "random_visible")
    assert (cfg.warmup_gate_checks, cfg.warmup_max_steps) == (3, 6000)
    assert (cfg.n_frames, cfg.lesion_span) == (20, 3)
    assert levels == {0.0: ["sft", "grpo_b", "grpo_f", "grpo_h"]} and seeds == list(range(36))
    report = load_report(PILOT)
    assert report.decision == {"comparison": "(f) - (b)", "metric": "exact_in_lesion", "margin": 10, "min_effect": 5}
    assert (report.finished_seeds, report.n_bootstrap) == (3, 10000)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "study:\n  seeds: [0]\n  noise: {0.0: [sft]}\n  report:\n    n_bootstrap: 1000\n"
        "    comparisons: ['(f) - (b)']\n    decision: {comparison: '(h) - (b)', metric: exact_key, margin: 5}\n"
    )
    with pytest.raises(TrainConfigError, match=r"exact_key: \(h\) - \(b\) is not drawn"):
        load_report(bad)


@pytest.mark.slow  # a micro pilot: about 10 s at 32 px, 15 s at 128 px (the rule's next pilot)
@pytest.mark.parametrize("size_px", [32, 128])
def test_a_micro_pilot_trains_sft_on_its_own_rows_and_reports_the_decision(tmp_path, size_px):
    import torch

    cfg, _, _ = load_study(MICRO)
    cfg = config_from_dict(
        {k: v for k, v in cfg.__dict__.items()}
        | {
            "sft_key_frame": "random_visible",
            "warmup_key_frame": "random_visible",
            "warmup_gate_checks": 2,
            "size_px": size_px,
        }
    )
    levels = {0.0: ["sft", "grpo_b", "grpo_f"]}
    report = Report(
        n_bootstrap=1000,
        comparisons=("(f) - (b)",),
        in_lesion=("lesion_frame", "exact_in_lesion"),
        finished_seeds=1,
        decision={"comparison": "(f) - (b)", "metric": "exact_in_lesion", "margin": 10},
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = run_study(cfg, [0], levels, tmp_path, log=lambda line: None, report=report)
    finally:
        torch.set_num_threads(threads)
    run = next(tmp_path.glob("runs/*/"), None) or tmp_path
    data = next(run.rglob("data/done.json"))
    keys = json.loads((data.parent / "sft_keys.json").read_text())
    assert json.loads(data.read_text())["sft_keys_moved"] == len(keys)
    assert (data.parent / "sft_rows" / "data").is_dir()
    # the warm-up's report rows name a frame of the lesion, its verifier rows (the pool) keep the gold
    from train.data import load_split

    warmup_keys = json.loads((data.parent / "warmup_keys.json").read_text())
    assert json.loads(data.read_text())["warmup_report_keys_moved"] == len(warmup_keys) > 0
    folder = "warmup_pool" if cfg.warmup_pool_rows > 0 else "clean"
    gold = [r["key_slice_frame"] for r in load_split(data.parent / folder, "train")]
    drawn = [r["key_slice_frame"] for r in load_split(data.parent / "warmup_reports", "train")]
    moved = {e["row"]: (e["from"], e["to"]) for e in warmup_keys}
    assert [(g, d) for i, (g, d) in enumerate(zip(gold, drawn, strict=True)) if g != d] == list(moved.values())
    assert all(gold[i] == was for i, (was, _) in moved.items())
    comparisons = summary["levels"]["0.00"]["comparisons"]
    assert {"lesion_frame: (f) - (b)", "exact_in_lesion: (f) - (b)"} <= set(comparisons)
    decision = summary["decision"]
    assert decision["n_seeds"] == 1 and decision["passed"] in (True, False)
    assert decision["diff"] == comparisons["exact_in_lesion: (f) - (b)"]["pooled_seeds"]["diff"]


def test_records_pool_on_their_settings_a_missing_setting_being_its_default():
    from pathlib import Path

    from train.miniature.suite import _check_poolable

    def record(**config):
        return {"results": {"config": config}}

    older = record(seed=0, sft_key_frame="random_visible")  # written before warmup_key_frame existed
    _check_poolable(
        {Path("a"): older, Path("b"): record(seed=1, sft_key_frame="random_visible", warmup_key_frame="gold")}
    )
    with pytest.raises(TrainConfigError) as err:
        _check_poolable(
            {
                Path("old.json"): older,
                Path("new.json"): record(seed=1, sft_key_frame="random_visible", warmup_key_frame="random_visible"),
            }
        )
    assert str(err.value) == (
        "new.json and old.json: runs of different configurations (['warmup_key_frame']) cannot be pooled"
    )


def test_the_policy_check_counts_positive_rows_naming_a_frame_of_the_lesion():
    from train.miniature.study import policy_check

    rows = [{"has_lesion": True, "key_slice_frame": 10}] * 4 + [{"has_lesion": False, "key_slice_frame": None}]
    scored = [
        {"has_lesion": True, "pred_has_lesion": True, "pred_key_slice": 13},  # 3 frames away: shows the lesion
        {"has_lesion": True, "pred_has_lesion": True, "pred_key_slice": 14},  # 4 away: beyond the span
        {"has_lesion": True, "pred_has_lesion": False, "pred_key_slice": None},  # no lesion claimed
        {"has_lesion": True, "pred_has_lesion": True, "pred_key_slice": 10},
        {"has_lesion": False, "pred_has_lesion": True, "pred_key_slice": 10},  # a negative row does not count
    ]
    assert policy_check(scored, rows, 3) == {"positive_rows": 4, "lesion_frame": 0.5}
    assert policy_check(scored[-1:], rows[-1:], 3) == {"positive_rows": 0, "lesion_frame": 0.0}


def test_a_policy_below_its_gate_excludes_the_seed_in_one_line(tmp_path):
    from train.miniature.study import POLICY_MISSED, Miniature, PolicyMissed
    from train.miniature.suite import study_markdown

    def gate(value, share, **noise):
        cfg = config_from_dict({"sft_policy_gate": value} | noise)
        return Miniature(cfg, tmp_path / "run", log=lambda _: None)._gate_policy(
            {"policy_check": {"positive_rows": 170, "lesion_frame": share}}
        )

    gate(0.9, 0.9)  # at the gate: passes
    gate(0.9, 0.5, key_frame_noise=0.25)  # a noisy level's SFT is not gated
    with pytest.raises(PolicyMissed) as err:
        gate(0.9, 0.894)
    assert str(err.value) == (
        f"{POLICY_MISSED} the greedy reports name a frame showing the lesion on 89.4% of 170 positive test rows, below "
        "sft_policy_gate=0.9; GRPO would start from a policy that has not found the lesion"
    )
    with pytest.raises(TrainConfigError, match="ran without sft_policy_gate; rerun its SFT stage"):
        Miniature(config_from_dict({"sft_policy_gate": 0.9}), tmp_path / "run")._gate_policy({})
    with pytest.raises(TrainConfigError, match=r"sft_policy_gate=1.5 must be in \[0, 1\]"):
        config_from_dict({"sft_policy_gate": 1.5})
    text = study_markdown({"levels": {}, "seeds": [4], "excluded": {"4": str(err.value)}})
    assert text.startswith(
        f"Seed 4 is excluded: its SFT policy missed its check, so no GRPO arm trained ({POLICY_MISSED}"
    )


@pytest.mark.slow  # a micro study: about 10 s
def test_a_seed_whose_sft_policy_misses_its_gate_is_excluded_before_grpo(tmp_path):
    import torch

    from emrl_data.text.evaluation import score_predictions
    from train.miniature.study import POLICY_MISSED, policy_check
    from train.miniature.suite import exclusion_path

    cfg, _, _ = load_study(MICRO)
    cfg = config_from_dict({k: v for k, v in cfg.__dict__.items()} | {"sft_policy_gate": 0.5})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = run_study(cfg, [0], {0.0: ["sft", "grpo_b"]}, tmp_path, log=lambda line: None)
    finally:
        torch.set_num_threads(threads)
    folder = next(tmp_path.rglob("sft/done.json")).parent.parent
    kept = [json.loads(line) for line in (folder / "eval" / "sft" / "predictions.jsonl").read_text().splitlines()]
    check = json.loads((folder / "sft" / "done.json").read_text())["policy_check"]
    # the fresh eval's reports give the recorded share; this seed's SFT names no lesion frame on its 2 positive rows
    assert (
        check
        == policy_check(score_predictions(kept), kept, cfg.lesion_span)
        == {
            "positive_rows": 2,
            "lesion_frame": 0.0,
        }
    )
    reason = json.loads(exclusion_path(tmp_path, 0).read_text())["reason"]
    assert reason.startswith(f"{POLICY_MISSED} the greedy reports name a frame showing the lesion on 0.0% of 2")
    assert not (folder / "grpo_b").exists() and not (folder / "eval" / "done.json").exists()  # no arm trained
    assert summary["excluded"] == {0: reason}


def test_the_pilot_sizes_the_study_from_its_spread_for_a_stated_effect():
    from train.miniature.suite import seeds_for_effect

    assert seeds_for_effect(3, 0.093, 5.0) == 11  # 3 x (9.3 / 5)^2 = 10.4
    assert seeds_for_effect(3, 0.093, 9.3) == 3  # the effect the pilot itself detects
    assert seeds_for_effect(3, 0.02, 5.0) == 1
    report = Report(
        n_bootstrap=1000,
        comparisons=("(f) - (b)",),
        in_lesion=("exact_in_lesion",),
        finished_seeds=3,
        decision={"comparison": "(f) - (b)", "metric": "exact_in_lesion", "margin": 10, "min_effect": 4},
    )
    summary = _summary(0.12, 0.02, 0.22, [0, 4, 7])
    summary["levels"]["0.00"]["comparisons"]["exact_in_lesion: (f) - (b)"]["pooled_seeds"]["mdd"] = 0.08
    decision = pilot_decision(summary, report)
    assert (decision["passed"], decision["mdd"], decision["seeds_needed"]) == (True, 0.08, 12)  # 3 x (8 / 4)^2
    text = study_markdown({"levels": {}, "seeds": [0], "decision": decision})
    assert (
        "At the pilot's spread (detectable from 8.0 points over 3 seeds), a +4.0-point effect needs 12 finished"
        in text
    )
    summary["levels"]["0.00"]["finished"] = [0, 4]
    assert "seeds_needed" not in pilot_decision(summary, report)  # only once the pilot has its seeds


def test_a_decision_takes_a_positive_min_effect_only(tmp_path):
    bad = tmp_path / "bad.yaml"
    head = "study:\n  seeds: [0]\n  noise: {0.0: [sft]}\n  report:\n    n_bootstrap: 1000\n    comparisons: ['(f) - (b)']\n"
    bad.write_text(head + "    decision: {comparison: '(f) - (b)', metric: exact_key, margin: 5, min_effect: 0}\n")
    with pytest.raises(TrainConfigError, match=r"decision.min_effect=0: points above 0"):
        load_report(bad)
    bad.write_text(head + "    decision: {comparison: '(f) - (b)', metric: exact_key, margin: 5, seeds: 9}\n")
    with pytest.raises(TrainConfigError, match="takes the keys comparison, metric and margin"):
        load_report(bad)


def test_under_key_frame_noise_sft_draws_in_the_true_lesion_while_grpo_reads_the_moved_gold(tmp_path):
    from train.data import load_split
    from train.miniature.study import Miniature

    cfg = config_from_dict(
        {"n_train": 40, "n_test": 60, "n_frames": 20, "lesion_span": 3, "sizes_mm": [31.0, 56.0, 90.0]}
        | {"min_test_rows_per_class": 5, "sft_key_frame": "random_visible", "key_frame_noise": 0.5}
    )
    Miniature(cfg, tmp_path, log=lambda _: None).run(stages=("data",))
    data = tmp_path / "data"
    grpo = {r["case_id"]: r["key_slice_frame"] for r in load_split(data, "train")}
    sft = {r["case_id"]: r["key_slice_frame"] for r in load_split(data / "sft_rows", "train")}
    moves = json.loads((data / "noise.json").read_text())
    clean = {e["case_id"]: e["from"] for e in moves}
    assert moves and all(grpo[c] == e["to"] != e["from"] for c, e in ((e["case_id"], e) for e in moves))
    assert all(abs(sft[c] - clean[c]) <= 3 for c in clean)  # SFT's draw is a frame of the true lesion
    drawn = {e["case_id"]: e for e in json.loads((data / "sft_keys.json").read_text())}
    assert all(e["from"] == clean.get(c, grpo[c]) for c, e in drawn.items())  # drawn from the clean key frame


def test_noisy_runs_wait_for_a_clean_sft_that_met_the_gate(tmp_path):
    from train.miniature.suite import clean_run_ready, run_dir

    cfg = config_from_dict({"sft_policy_gate": 0.9})
    clean = run_dir(tmp_path, 0.0, 3)
    assert not clean_run_ready(cfg, tmp_path, 3)  # no warm-up yet
    (clean / "warmup").mkdir(parents=True)
    (clean / "warmup" / "done.json").write_text("{}")
    assert clean_run_ready(config_from_dict({}), tmp_path, 3)  # ungated: the warm-up is enough
    assert not clean_run_ready(cfg, tmp_path, 3)  # SFT not finished
    (clean / "sft").mkdir()
    for share, ready in ((0.5, False), (0.9, True)):  # below the gate: not even before the exclusion is recorded
        (clean / "sft" / "done.json").write_text(json.dumps({"policy_check": {"lesion_frame": share}}))
        assert clean_run_ready(cfg, tmp_path, 3) is ready
