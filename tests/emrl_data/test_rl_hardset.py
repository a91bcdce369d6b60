"""Hard-case selection: the paper's rule, the cap, organ stratification, the reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from emrl_data.tables.records import PREDICTION_TRUTH_COLUMNS, SCHEMAS
from emrl_data.tables.rl_hardset import (
    HardRow,
    build_summary,
    chosen_light_rows,
    collect_predictions,
    hard_set_rows,
    organ_quotas,
    prediction_row,
    reason_counts,
    select_hard_rows,
    summary_markdown,
    write_split_metrics,
)
from emrl_data.text.report import render_evidence, render_findings, render_impression, render_report
from emrl_data.text.scoring import Truth, score_report
from emrl_data.types import Organ


LIVER = Truth(Organ.LIVER, True, 3.1, ("5",), "hypo", 12)


def _report(long_axis_mm: float = 31.0, location=("5",), attenuation="hypo", k: int = 12) -> str:
    kw = dict(has_lesion=True, lesion_count=1, long_axis_mm=long_axis_mm, location=location, attenuation=attenuation)
    findings = render_findings(Organ.LIVER, short_axis_mm=20.0, volume_mm3=5000.0, **kw)
    return render_report(findings, render_impression(Organ.LIVER, **kw), render_evidence(k, [1, 2, 3, 4]))


NEGATIVE = "<findings>No focal liver lesion is identified.</findings> || <impression>No liver tumor.</impression>"


@pytest.mark.parametrize(
    ("report", "reasons"),
    [
        (_report(), ()),  # all right: not hard
        (_report(k=13), ()),  # K-Hit within +-1 frame: not hard
        (_report(k=14), ("k_hit",)),  # key slice two frames off
        (_report(long_axis_mm=45.0), ("size",)),  # 4.5 vs 3.1 cm: outside max(0.5, 20 %)
        (_report(location=("5", "6")), ("location",)),  # set must match exactly
        (_report(attenuation="hyper"), ("enhancement",)),
        (NEGATIVE, ("existence", "size", "location", "enhancement", "k_hit")),  # missed lesion: everything wrong
        ("garbage", ("parse_failure", "existence", "size", "location", "enhancement", "k_hit")),
    ],
)
def test_select_records_why_a_row_is_hard(report: str, reasons: tuple[str, ...]) -> None:
    chosen = select_hard_rows([({"case_id": "BDMAP_00000001", "organ": "liver"}, score_report(report, LIVER))])
    assert [h.reasons for h in chosen] == ([reasons] if reasons else [])


def test_select_ranks_by_reward_and_caps_per_organ_proportionally() -> None:
    candidates = []
    # 6 hard liver rows with decreasing badness, 2 hard pancreas rows, 1 easy kidney row.
    for i, k in enumerate([14, 15, 16, 20, 30, 40]):
        candidates.append(({"case_id": f"BDMAP_0000001{i}", "organ": "liver"}, score_report(_report(k=k), LIVER)))
    candidates.append(({"case_id": "BDMAP_00000020", "organ": "liver"}, score_report("garbage", LIVER)))
    pancreas = Truth(Organ.PANCREAS, False, None, (), None, None)
    for i in range(2):
        row = {"case_id": f"BDMAP_0000003{i}", "organ": "pancreas"}
        candidates.append((row, score_report(_report(), pancreas)))  # a false positive
    kidney = Truth(Organ.KIDNEY, False, None, (), None, None)
    kidney_negative = NEGATIVE.replace("liver lesion", "kidney lesion").replace("liver tumor", "kidney tumor")
    candidates.append(({"case_id": "BDMAP_00000040", "organ": "kidney"}, score_report(kidney_negative, kidney)))

    chosen = select_hard_rows(candidates, target_size=6)

    # 7 hard liver + 2 hard pancreas = 9 hard; quotas 6 * 7/9 = 4.67 -> 5 (largest remainder), 6 * 2/9 = 1.33 -> 1.
    assert [(h.organ, h.rank) for h in chosen] == [("liver", r) for r in range(1, 6)] + [("pancreas", 1)]
    liver = [h for h in chosen if h.organ == "liver"]
    assert liver[0].case_id == "BDMAP_00000020"  # the unparseable report has the lowest reward (0)
    assert [h.reward for h in liver] == sorted(h.reward for h in liver)
    assert all(h.organ != "kidney" for h in chosen)  # the kidney row was right


def test_organ_quotas_keep_everything_under_the_cap_and_sum_to_it_above() -> None:
    assert organ_quotas({"liver": 3, "pancreas": 1}, 10) == {"liver": 3, "pancreas": 1}
    assert organ_quotas({"liver": 1, "pancreas": 1, "kidney": 1}, 2) == {"liver": 1, "pancreas": 1, "kidney": 0}
    assert sum(organ_quotas({"liver": 997, "pancreas": 2, "kidney": 1}, 100).values()) == 100
    with pytest.raises(ValueError, match="target_size"):
        organ_quotas({"liver": 1}, -1)


def test_prediction_row_uses_the_scorers_names_and_leaves_failed_inferences_unscored() -> None:
    truth = {
        "case_id": "BDMAP_00000001",
        "organ": "liver",
        "split": "train",
        "has_lesion": False,
        "long_axis_mm": None,
        "location": [],
        "attenuation": None,
        "key_slice_frame": None,
        "n_frames": 8,
    }
    negative = "<findings>No focal liver lesion is identified.</findings> || <impression>No liver tumor.</impression>"
    row, score = prediction_row(truth, {"text": negative, "error": None}, "m")
    assert score is not None and set(row) <= set(SCHEMAS["predictions"].names)
    assert row == {
        **truth,
        "prediction": negative,
        "inference_error": None,
        "model": "m",
        **score.to_row(),
        "hard": False,
        "hard_reasons": [],
    }
    assert (row["score_existence"], row["parse_failure"]) == (1.0, None)
    failed, no_score = prediction_row(truth, {"text": None, "error": "timeout"}, "m")
    assert no_score is None and "parse_failure" not in failed and "score_existence" not in failed
    assert failed == {
        **{c: truth[c] for c in PREDICTION_TRUTH_COLUMNS},
        "prediction": None,
        "inference_error": "timeout",
        "model": "m",
    }


def _truth(case_id: str, split: str = "train") -> dict:
    return {
        "case_id": case_id,
        "organ": "liver",
        "split": split,
        "has_lesion": False,
        "long_axis_mm": None,
        "location": [],
        "attenuation": None,
        "key_slice_frame": None,
        "n_frames": 8,
    }


def _collected():
    rows = {
        "train": [
            _truth("BDMAP_00000002") | {"frames": [{"bytes": b"abc"}, {"bytes": b"de"}]},
            _truth("BDMAP_00000001") | {"frames": [{"bytes": b"f"}]},
            _truth("BDMAP_00000003") | {"frames": [{"bytes": b"gh"}]},
        ],
        "test": [_truth("BDMAP_00000004", "test") | {"frames": [{"bytes": b"ijkl"}]}],
    }
    results = {
        "BDMAP_00000001/liver": {"text": _report(), "error": None},  # a lesion where there is none: hard
        "BDMAP_00000002/liver": {"text": None, "error": "timeout"},  # failed: in the table, not scored
        "BDMAP_00000004/liver": {"text": NEGATIVE, "error": None},  # right
    }  # BDMAP_00000003 has no result (beyond a limit): left out
    return collect_predictions(rows, results, "m")


def test_collect_predictions_scores_each_predicted_row_once_and_sizes_its_frames() -> None:
    collected = _collected()
    assert [(p["case_id"], p["inference_error"]) for p in collected.predictions] == [
        ("BDMAP_00000002", "timeout"),
        ("BDMAP_00000001", None),
        ("BDMAP_00000004", None),
    ]
    assert [p["case_id"] for p in collected.failed] == ["BDMAP_00000002"]
    assert {s: [(r["case_id"], r["hard"]) for r, _ in v] for s, v in collected.scored.items()} == {
        "train": [("BDMAP_00000001", True)],
        "test": [("BDMAP_00000004", False)],
    }
    assert collected.frame_bytes == {"BDMAP_00000002/liver": 5, "BDMAP_00000001/liver": 1, "BDMAP_00000004/liver": 4}


def test_hard_set_rows_join_the_chosen_rows_to_their_frames_and_prediction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "emrl_data.tables.rl_hardset.check_required", lambda table, row: None
    )  # toy rows lack the label columns
    chosen = [HardRow("BDMAP_00000001", "liver", ("existence",), 1, 0.25)]
    predictions = [
        {"case_id": "BDMAP_00000001", "organ": "liver", "prediction": "text 1"},
        {"case_id": "BDMAP_00000002", "organ": "liver", "prediction": "text 2"},
    ]
    sft = [
        {"case_id": "BDMAP_00000001", "organ": "liver", "frames": [b"a"]},
        {"case_id": "BDMAP_00000002", "organ": "liver", "frames": [b"b"]},
    ]
    assert list(hard_set_rows(sft, chosen, predictions)) == [
        {
            "case_id": "BDMAP_00000001",
            "organ": "liver",
            "frames": [b"a"],
            "hard_reasons": ["existence"],
            "hard_rank": 1,
            "sft_prediction": "text 1",
            "sft_reward": 0.25,
        }
    ]
    light = [({"split": "train", "organ": "liver", "case_id": c}, None) for c in ("BDMAP_00000002", "BDMAP_00000001")]
    assert [r["case_id"] for r in chosen_light_rows(light, chosen)] == ["BDMAP_00000001"]


def test_write_split_metrics_writes_each_split_and_merges_them_in_memory(tmp_path: Path) -> None:
    collected = _collected()
    text = write_split_metrics(collected.scored, tmp_path, n_bootstrap=0)
    assert text.startswith("## SFT model on the train split\n\n") and "## SFT model on the test split" in text
    assert (tmp_path / "metrics.md").read_text() == text + "\n"
    merged = json.loads((tmp_path / "metrics.json").read_text())
    assert set(merged) == {"train", "test"}
    for split in ("train", "test"):
        assert merged[split] == json.loads((tmp_path / f"metrics_{split}" / "metrics.json").read_text())
    assert write_split_metrics({"train": [], "test": []}, tmp_path / "none", n_bootstrap=0) == ""
    assert json.loads((tmp_path / "none" / "metrics.json").read_text()) == {}


def test_build_summary_and_markdown_describe_the_hard_set() -> None:
    chosen = [
        HardRow("BDMAP_00000001", "liver", ("existence", "size"), 1, 0.25),
        HardRow("BDMAP_00000003", "liver", ("size",), 2, 0.5),
    ]
    assert reason_counts(chosen) == {"existence": 1, "size": 2}
    provenance = {"model": "m", "target_size": 2}
    summary = build_summary(
        provenance=provenance, collected=_collected(), chosen=chosen, out=Path("/o"), elapsed_s=2.5
    )
    assert summary == {
        "model": "m",
        "target_size": 2,
        "predictions": 3,
        "failed_predictions": 1,
        "retried_errors": 0,
        "kept_errors": False,
        "other_model_answers": {},
        "hard_in_train": 1,
        "train_rows_scored": 1,
        "rl_hardset_rows": 2,
        "rl_hardset_by_organ": {"liver": 2, "pancreas": 0, "kidney": 0},
        "reasons": {"existence": 1, "size": 2},
        "seconds": 2.5,
        "tables": {"predictions": "/o/predictions", "rl_hardset": "/o/rl_hardset"},
    }
    assert summary_markdown(summary, "METRICS") == (
        "# build-rl-hardset\n\n- model: `m`\n- predictions: **3** (1 failed)\n"
        "- hard train rows: 1 of 1; chosen: **2** (cap 2) liver 2, pancreas 0, kidney 0\n"
        "- reasons: existence 1, size 2\n- took 2.5 s\n\nOutputs:\n\n"
        "- `predictions`: /o/predictions\n- `rl_hardset`: /o/rl_hardset\n\nMETRICS\n"
    )


def test_summary_counts_errors_sent_again_and_answers_naming_another_model() -> None:
    inference = {"retried_errors": 4, "kept_errors": False, "other_model_answers": {"gpt-4o-mini-2024-07-18": 3}}
    summary = build_summary(
        provenance={"model": "gpt-4o-mini", "target_size": 2},
        collected=_collected(),
        chosen=[],
        out=Path("/o"),
        elapsed_s=1.0,
        inference=inference,
    )
    assert {k: summary[k] for k in inference} == inference
    lines = summary_markdown(summary, "").splitlines()
    assert lines[3] == "- predictions: **3** (1 failed; 4 stored as errors by an earlier run, sent again)"
    assert lines[4] == "- note: 3 answer(s) named another model than asked (gpt-4o-mini): `gpt-4o-mini-2024-07-18` (3)"
    kept = summary_markdown({**summary, "retried_errors": 0, "kept_errors": True}, "").splitlines()
    assert kept[3] == "- predictions: **3** (1 failed; errors of earlier runs kept as they are (keep-errors))"
