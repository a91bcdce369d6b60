"""The miniature's reward-signal diagnosis (`train.miniature.diagnose`): exact values on constructed inputs."""

from __future__ import annotations

import math

import pytest

from emrl_data.organs import Organ
from emrl_data.text.scoring import Truth
from train.checks import TrainConfigError
from train.miniature.config import MiniatureConfig, load_config
from train.miniature.diagnose import (
    completion_record,
    group_summary,
    summary_markdown,
    verifier_record,
    verifier_summary,
)
from train.miniature.run_report import claim_check
from train.miniature.study import DIAGNOSE, Miniature


TRUTH = Truth(Organ.LIVER, True, 3.1, ("2",), "hyper", 5)
NEGATIVE = Truth(Organ.LIVER, False, None, (), None, None)
RIGHT = (
    "<findings>A hyperattenuating lesion in hepatic segment 2 measures 3.1 x 2.2 cm (volume 8.9 cc).</findings> "
    "|| <impression>Hyperattenuating liver mass in hepatic segment 2, measuring 3.1 cm.</impression> || The key "
    "lesion is in image <key_slice>5</key_slice>, <bbox>[625, 516, 844, 734]</bbox>"
)
WRONG_SIZE_FAR_KEY = (
    RIGHT.replace("3.1 x 2.2", "9.0 x 6.3")
    .replace("measuring 3.1", "measuring 9.0")
    .replace("<key_slice>5", "<key_slice>7")
)
NO_LESION = "<findings>No focal liver lesion is identified.</findings> || <impression>No liver tumor.</impression>"
VERIFIER_RIGHT = "A 3.1 cm hyperattenuating lesion in hepatic segment 2."


def test_completion_record_scores_as_grpo_does():
    right = completion_record(RIGHT, TRUTH, VERIFIER_RIGHT)
    assert right == {
        "r_e": 1.0,
        "r_f": 1.0,
        "r_c": 1.0,
        "reward_a": pytest.approx(1.0),
        "reward_b": 0.8,
        "existence": 1.0,
        "attributes": 1.0,
        "k_hit": 1.0,
        "parse_ok": 1.0,
    }
    # size wrong (9.0 vs 3.1 cm), key frame 2 away (window IoU 1/5); the verifier sees no lesion there
    far = completion_record(WRONG_SIZE_FAR_KEY, TRUTH, "No focal liver lesion.")
    assert far["r_f"] == pytest.approx(2 / 3) and far["attributes"] == pytest.approx(2 / 3)
    assert far["r_c"] == pytest.approx(-0.3 * (1 - 1 / 5))
    assert far["reward_a"] == pytest.approx(0.3 + 0.5 * 2 / 3 - 0.2 * 0.24)
    assert (far["existence"], far["k_hit"]) == (1.0, 0.0)
    # "no lesion" on a positive row, and a parse failure: no verifier query, r_c = -lambda
    missed = completion_record(NO_LESION, TRUTH, None)
    assert (missed["r_e"], missed["r_c"], missed["k_hit"], missed["parse_ok"]) == (0.0, -0.3, 0.0, 1.0)
    assert missed["reward_a"] == pytest.approx(-0.06)
    garbage = completion_record("blah blah", TRUTH, None)
    assert (garbage["parse_ok"], garbage["attributes"], garbage["r_c"], garbage["reward_b"]) == (0.0, 0.0, -0.3, 0.0)
    # a true negative: r_c, attributes and K-Hit do not apply
    negative = completion_record(NO_LESION, NEGATIVE, None)
    assert (negative["r_c"], negative["attributes"], negative["k_hit"], negative["reward_a"]) == (
        None,
        None,
        None,
        0.8,
    )


def _c(r_e, r_f, r_c, existence, attributes, k_hit, parse_ok=1.0):
    return {
        "r_e": r_e,
        "r_f": r_f,
        "r_c": r_c,
        "reward_a": 0.3 * r_e + 0.5 * r_f + 0.2 * (r_c or 0.0),
        "reward_b": 0.3 * r_e + 0.5 * r_f,
        "existence": existence,
        "attributes": attributes,
        "k_hit": k_hit,
        "parse_ok": parse_ok,
    }


def test_group_summary_spread_and_within_group_correlations():
    groups = [
        [_c(1, 1, 0.5, 1, 1, 1), _c(0, 0, -0.3, 0, 0, 0)],  # positive: R_a 0.9 / -0.06
        [_c(1, 1, None, 1, None, None), _c(1, 1, None, 1, None, None)],  # negative, no spread
        [_c(1, 1, -0.3, 1, 1, 0), _c(1, 1 / 3, -0.3, 1, 1 / 3, 1)],  # positive: R_a 0.74 / 0.40667; K-Hit on the lower
    ]
    s = group_summary(groups)
    assert (s["n_groups"], s["group_size"]) == (3, 2)
    assert s["spread"] == {
        "r_e": pytest.approx(1 / 3),
        "r_f": pytest.approx(2 / 3),
        "r_c": 0.5,
        "reward_a": pytest.approx(2 / 3),
        "reward_b": pytest.approx(2 / 3),
    }
    assert s["spread_groups"] == {"r_e": 3, "r_f": 3, "r_c": 2, "reward_a": 3, "reward_b": 3}
    # centred per group: R_a deviations +-0.48 (group 1), 0 (group 2), +-1/6 (group 3)
    sxx = 2 * 0.48**2 + 2 * (1 / 6) ** 2
    assert s["corr"]["reward_a"]["existence"] == pytest.approx(2 * 0.48 * 0.5 / math.sqrt(sxx * 0.5))
    assert s["corr"]["reward_a"]["k_hit"] == pytest.approx((2 * 0.48 * 0.5 - 2 * (1 / 6) * 0.5) / math.sqrt(sxx))
    assert s["corr_groups"]["reward_a"]["k_hit"] == 2
    assert s["corr"]["reward_a"]["parse_ok"] is None  # no variance
    assert s["sampled_rate"] == {
        "existence": pytest.approx(5 / 6),
        "attributes": pytest.approx(7 / 12),
        "k_hit": 0.5,
        "parse_ok": 1.0,
    }


def test_verifier_record_and_summary():
    same = verifier_record(RIGHT, VERIFIER_RIGHT, TRUTH, frame_shows_lesion=True)
    assert same == {
        "unreadable": False,
        "says_no_lesion": False,
        "differs_from_report": False,
        "frame_shows_lesion": True,
        "attributes_vs_truth": 1.0,
    }
    differs = verifier_record(WRONG_SIZE_FAR_KEY, VERIFIER_RIGHT, TRUTH, frame_shows_lesion=True)
    assert differs["differs_from_report"] is True  # 3.1 vs the report's 9.0 cm
    blind = verifier_record(RIGHT, "No focal liver lesion.", TRUTH, frame_shows_lesion=False)
    assert (blind["says_no_lesion"], blind["differs_from_report"], blind["attributes_vs_truth"]) == (True, None, 0.0)
    empty = verifier_record(RIGHT, "", TRUTH, frame_shows_lesion=True)
    assert (empty["unreadable"], empty["says_no_lesion"]) == (True, False)
    v = verifier_summary([same, differs, blind, empty], n_positive_completions=8)
    assert v == {
        "n_queries": 4,
        "n_positive_completions": 8,
        "no_query_rate": 0.5,
        "unreadable": 0.25,
        "says_no_lesion": 0.25,
        "differs_from_report": 0.5,
        "frame_shows_lesion": 0.75,
    }


def test_summary_markdown_row():
    s = group_summary([[_c(1, 1, 0.5, 1, 1, 1), _c(0, 0, -0.3, 0, 0, 0)]])
    s |= {
        "temperature": 0.7,
        "greedy_rate": {"existence": 1.0, "attributes": 1.0, "k_hit": 0.0, "parse_ok": 1.0},
        "verifier": verifier_summary([], 0),
    }
    row = summary_markdown([s]).splitlines()[2]
    assert row == (
        "| 0.7 | 1 x 2 | 100 % / 100 % / 100 % / 100 % | +1.00 / +1.00 / +1.00 / n/a | +1.00 / +1.00 / "
        "+1.00 / n/a | 50 % / 50 % | 100 % / 0 % | n/a / n/a / n/a / n/a / n/a |"
    )


def test_miniature_grpo_temperature_is_a_grpo_only_key_and_diagnose_needs_sft(tmp_path):
    cfg = load_config("train/configs/miniature.yaml", {"grpo_temperature": "0.7"})
    assert cfg.grpo_temperature == 0.7 and cfg.diagnose_temperatures == [1.0, 0.7]
    with pytest.raises(TrainConfigError, match="stage diagnose needs the sft stage"):
        Miniature(MiniatureConfig(), tmp_path / "run", log=lambda _: None).run((DIAGNOSE,))


def test_diagnose_cli_refuses_a_folder_without_a_run_or_an_unfinished_model(tmp_path):
    from train.miniature.diagnose import main

    with pytest.raises(TrainConfigError, match="no config.json there"):
        main(["--run_dir", str(tmp_path)])
    Miniature(MiniatureConfig(), tmp_path, log=lambda _: None)._claim_folder()
    with pytest.raises(TrainConfigError, match="--model grpo_a: that stage has not finished"):
        main(["--run_dir", str(tmp_path), "--model", "grpo_a"])


def test_eval_needs_sft_and_the_claim_check_works_without_a_b_or_c(tmp_path):
    mini = Miniature(MiniatureConfig(), tmp_path, log=lambda _: None)
    (tmp_path / "grpo_c").mkdir(parents=True)
    (tmp_path / "grpo_c" / "done.json").write_text("{}")
    assert mini.finished_models() == ["grpo_c"]
    with pytest.raises(TrainConfigError, match=r"eval needs the stages \['sft'\]"):
        mini.run(("eval",))

    def model(bacc, khit):
        return {
            "average_bacc": {"value": bacc, "ci_low": bacc - 0.05, "ci_high": bacc + 0.05},
            "k_hit": {"value": khit, "ci_low": khit - 0.1, "ci_high": khit + 0.1},
        }

    claim = claim_check({"sft": model(0.6, 0.3), "grpo_a": model(0.6, 0.45), "grpo_c": model(0.6, 0.3)})
    assert not any("grpo_b" in key for key in claim)
    assert claim["k_hit: (a) - grpo_c"]["gap"] == pytest.approx(0.15) and claim["claim_holds"] is True
    no_control = claim_check({"sft": model(0.6, 0.3), "grpo_a": model(0.6, 0.35)})  # (c) = SFT's tables: vs SFT only
    assert set(no_control) == {f"{m}: (a) - sft" for m in ("average_bacc", "k_hit")} | {
        "claim_holds",
        "beats_more_sft",
    }
    assert no_control["beats_more_sft"] is None  # neither (d) nor (e) ran
    assert no_control["claim_holds"] is False  # +0.05 < 0.10
    assert claim_check({"sft": model(0.6, 0.3), "grpo_b": model(0.6, 0.4)}) == {
        "claim_holds": None,
        "beats_more_sft": None,
    }  # (a) did not run (the pilot): no claim to check


def test_reward_spread_counts_equal_rewards_as_no_signal_where_trl_counts_float32_noise():
    import torch

    from train.miniature.diagnose import SPREAD_TOL, group_spread, spread_per_step, weighted_rewards

    flat = [0.8] * 8
    assert torch.tensor(flat).std().item() > 0  # 6.4e-8: TRL's frac_reward_zero_std counts this group as spread
    assert group_spread(flat + [0.8] * 7 + [0.8 + 10 * SPREAD_TOL], 8) == {"groups": 2, "without_signal": 1}
    assert group_spread([0.1, float("nan"), 0.1, 0.3], 2) == {"groups": 2, "without_signal": 1}  # one reward left
    with pytest.raises(ValueError, match="3 rewards do not make groups of 2"):
        group_spread([0.1, 0.2, 0.3], 2)
    # R as TRL sums it: a None (r_c on a true negative) is left out
    assert weighted_rewards([[1.0, 0.0], [0.5, 0.5], [None, -0.3]], [0.3, 0.5, 0.2]) == [0.55, 0.25 - 0.06]
    calls = [[[1.0, 1.0, 0.0, 1.0]], [[1.0, 1.0, 1.0, 1.0]]]  # one step, two reward functions, 2 groups of 2
    assert spread_per_step(calls, [0.5, 0.5], 2) == {
        "tol": SPREAD_TOL,
        "groups": [2],
        "without_signal": [1],
        "total_groups": 2,
        "total_without_signal": 1,
    }


def test_the_verifier_by_distance_reads_size_at_the_key_frame_against_the_slice_and_the_key():
    from emrl_data.text.report import NEGATIVE_FINDINGS, render_findings
    from emrl_data.types import Organ
    from train.miniature.diagnose import distance_frames, score_by_distance
    from train.tiny.synthetic import make_visible_rows

    rows = make_visible_rows(12, n_frames=20, size_px=64, organs=("kidney",), sizes_mm=(56.0,), span=3, seed=1)
    row = next(r for r in rows if r["has_lesion"] and r["key_slice_frame"] <= 16)
    key = row["key_slice_frame"]
    # radius 12 px at the key frame, 9 / 6 / 3 px at d = 1 / 2 / 3, none at d = 4: frames key .. key + 4
    assert distance_frames(row, 3) == [
        (0, key - 1, 56.0),
        (1, key, 42.0),
        (2, key + 1, 28.0),
        (3, key + 2, 14.0),
        (4, key + 3, None),
    ]

    def says(mm):
        return render_findings(
            Organ.KIDNEY,
            has_lesion=True,
            lesion_count=1,
            long_axis_mm=mm,
            short_axis_mm=round(mm * 0.7, 1),
            volume_mm3=round(mm**3 * 0.3),
            location=tuple(row["location"]),
            attenuation=row["attenuation"],
        )

    asked = [(row, d, mm) for d, _, mm in distance_frames(row, 3)]
    # a verifier that reads each slice right, then one that names the key frame's size everywhere the lesion shows
    right = [says(mm) if mm else NEGATIVE_FINDINGS[Organ.KIDNEY] for _, _, mm in asked]
    key_size = [says(56.0) if mm else says(56.0) for _, _, mm in asked]
    got = score_by_distance(asked + asked, right + key_size)
    assert got["0"] == {
        "presence": 1.0,
        "location": 1.0,
        "attenuation": 1.0,
        "size_slice": 1.0,
        "size_key": 1.0,
        "n": 2,
    }
    assert got["1"] == {
        "presence": 1.0,
        "location": 1.0,
        "attenuation": 1.0,
        "size_slice": 0.5,
        "size_key": 0.5,
        "n": 2,
    }
    assert got["4"] == {
        "presence": 0.5,
        "location": None,
        "attenuation": None,
        "size_slice": None,
        "size_key": None,
        "n": 2,
    }  # a lesion claimed where the frame shows none is wrong
