"""Tests of emrl_data.text.evaluation: Table 1/2 on hand-made predictions with known values, bootstrap, outputs."""

from __future__ import annotations

import doctest
import json
import math
from pathlib import Path
from typing import Any

import pytest

from emrl_data.text import evaluation
from emrl_data.text.evaluation import TABLE1_METRICS, TABLE2_METRICS, evaluate, score_predictions, write_evaluation


def pos(organ: str, long_mm: float, detected: bool, size=1.0, location=1.0, enhancement=1.0, k=1.0) -> dict[str, Any]:
    """A true-positive row; a missed lesion scores 0 on every attribute (as `score_report` does)."""
    if not detected:
        size = location = enhancement = k = 0.0
    return {
        "organ": organ,
        "has_lesion": True,
        "long_axis_mm": long_mm,
        "score_existence": float(detected),
        "score_size": size,
        "score_location": location,
        "score_enhancement": enhancement,
        "score_k_hit": k,
        "pred_has_lesion": detected,
    }


def neg(organ: str, correct: bool) -> dict[str, Any]:
    """A true-negative row."""
    return {
        "organ": organ,
        "has_lesion": False,
        "long_axis_mm": None,
        "score_existence": float(correct),
        "score_size": None,
        "score_location": None,
        "score_enhancement": None,
        "score_k_hit": None,
        "pred_has_lesion": not correct,
    }


# liver: 4 positives (2 small: 1 detected; 2 large: both detected), 4 negatives (3 correct)
#   Sen 3/4, Sen<=2 1/2, Sen>2 2/2, Spec 3/4, B-Acc 3/4
#   size 2/4 (one detected lesion wrong, the missed one wrong), location 3/4, enhancement 2/4, K-Hit 1/4
# pancreas: 2 positives (1 detected, 25 mm), 1 negative (wrong)
#   Sen 1/2, Sen<=2 n/a (no small lesion), Sen>2 1/2, Spec 0/1, B-Acc 1/4; size 1/2, location 1/2, enh 0/2, K 1/2
LIVER = [
    pos("liver", 15.0, True, size=0.0, k=0.0),
    pos("liver", 20.4, False),  # 20.4 mm -> 2.0 cm: the small bin (reported precision)
    pos("liver", 35.0, True, k=0.0),
    pos("liver", 80.0, True, enhancement=0.0),
    neg("liver", True),
    neg("liver", True),
    neg("liver", True),
    neg("liver", False),
]
PANCREAS = [pos("pancreas", 25.0, True, enhancement=0.0), pos("pancreas", 30.0, False), neg("pancreas", False)]
ROWS = LIVER + PANCREAS


@pytest.mark.parametrize(
    ("organ", "metric", "expected"),
    [
        ("liver", "sen", 3 / 4),  # 3 of 4 positives detected
        ("liver", "sen_le2", 1 / 2),  # 15 mm detected, 20.4 mm missed
        ("liver", "sen_gt2", 2 / 2),  # 35 and 80 mm detected
        ("liver", "spec", 3 / 4),  # 3 of 4 negatives right
        ("liver", "bacc", 3 / 4),  # (3/4 + 3/4) / 2
        ("pancreas", "sen", 1 / 2),  # 1 of 2
        ("pancreas", "sen_le2", math.nan),  # no lesion <= 2 cm: n/a, never 0
        ("pancreas", "sen_gt2", 1 / 2),  # 25 and 30 mm
        ("pancreas", "spec", 0.0),  # the one negative is wrong
        ("pancreas", "bacc", 1 / 4),  # (1/2 + 0) / 2
    ],
)
def test_table1_values(organ: str, metric: str, expected: float) -> None:
    value = evaluate(ROWS, n_bootstrap=0).table1[organ][metric].value
    assert value == pytest.approx(expected, nan_ok=True)


@pytest.mark.parametrize(
    ("organ", "metric", "expected"),
    [
        ("liver", "size", 2 / 4),  # one detected lesion's size wrong + the missed lesion
        ("liver", "location", 3 / 4),  # only the missed lesion
        ("liver", "enhancement", 2 / 4),  # the 80 mm lesion wrong + the missed lesion
        ("liver", "k_hit", 1 / 4),  # two K-Hit misses + the missed lesion
        ("pancreas", "size", 1 / 2),  # missed lesion counts as wrong
        ("pancreas", "enhancement", 0.0),  # detected lesion wrong + missed lesion
        ("average", "size", (2 / 4 + 1 / 2) / 2),  # mean over organs
        ("average", "k_hit", (1 / 4 + 1 / 2) / 2),  # mean over organs
    ],
)
def test_table2_values(organ: str, metric: str, expected: float) -> None:
    value = evaluate(ROWS, n_bootstrap=0).table2[organ][metric].value
    assert value == pytest.approx(expected)


def test_averages_and_counts() -> None:
    result = evaluate(ROWS, n_bootstrap=0)
    assert result.organs == ("liver", "pancreas")
    assert result.average_bacc.value == pytest.approx((3 / 4 + 1 / 4) / 2)
    averages = [result.table2["average"][m].value for m in TABLE2_METRICS]
    assert result.table2_overall.value == pytest.approx(sum(averages) / 4)
    assert result.counts["liver"] == {
        "rows": 8,
        "positives": 4,
        "negatives": 4,
        "positives_le2": 2,
        "positives_gt2": 2,
    }
    assert result.counts["all"]["rows"] == 11
    assert result.table1["liver"]["bacc"].n == 8 and result.table2["pancreas"]["size"].n == 2


def test_organ_without_negatives_has_nan_spec_and_bacc() -> None:
    result = evaluate([pos("kidney", 10.0, True)], n_bootstrap=50)
    kidney = result.table1["kidney"]
    assert kidney["sen"].value == 1.0
    assert math.isnan(kidney["spec"].value) and math.isnan(kidney["bacc"].value)
    assert math.isnan(result.average_bacc.value)
    assert "n/a" in result.to_markdown()
    assert result.to_json()["table1"]["kidney"]["spec"] == {"value": None, "ci_low": None, "ci_high": None, "n": 0}


def test_average_skips_organs_where_undefined() -> None:
    rows = LIVER + [pos("kidney", 10.0, True)]  # kidney B-Acc undefined
    assert evaluate(rows, n_bootstrap=0).average_bacc.value == pytest.approx(3 / 4)


def test_missing_existence_falls_back_to_pred_has_lesion() -> None:
    rows = [
        {"organ": "liver", "has_lesion": True, "long_axis_mm": 30.0, "pred_has_lesion": True},
        {"organ": "liver", "has_lesion": False, "long_axis_mm": None, "pred_has_lesion": True},
    ]
    table = evaluate(rows, n_bootstrap=0).table1["liver"]
    assert (table["sen"].value, table["spec"].value) == (1.0, 0.0)


def _big_rows() -> list[dict[str, Any]]:
    rows = []
    for i in range(60):
        rows.append(pos("liver", 10.0 + i, i % 3 != 0, size=float(i % 2 == 0)))
        rows.append(neg("liver", i % 4 != 0))
        rows.append(pos("kidney", 50.0 - i, i % 5 != 0))
        rows.append(neg("kidney", i % 2 == 0))
    return rows


def test_bootstrap_interval_contains_point_and_is_deterministic() -> None:
    rows = _big_rows()
    a = evaluate(rows, n_bootstrap=300, seed=7)
    b = evaluate(rows, n_bootstrap=300, seed=7)
    c = evaluate(rows, n_bootstrap=300, seed=8)
    assert a.to_json() == b.to_json()
    assert a.to_json() != c.to_json()
    cells = [a.table1[o][m] for o in a.organs for m in TABLE1_METRICS]
    cells += [a.table2[o][m] for o in (*a.organs, "average") for m in TABLE2_METRICS]
    cells += [a.average_bacc, a.table2_overall]
    for cell in cells:
        assert cell.ci_low <= cell.value <= cell.ci_high
        assert cell.ci_low < cell.ci_high  # the data vary, so the interval has width


def test_no_bootstrap_gives_nan_intervals() -> None:
    cell = evaluate(ROWS, n_bootstrap=0).table1["liver"]["sen"]
    assert math.isnan(cell.ci_low) and math.isnan(cell.ci_high)
    assert cell.to_markdown() == "75.00"


def test_unknown_organ_and_bad_bootstrap_raise() -> None:
    with pytest.raises(ValueError):
        evaluate([{"organ": "spleen", "has_lesion": False, "score_existence": 1.0}])
    with pytest.raises(ValueError):
        evaluate(ROWS, n_bootstrap=-1)


def test_markdown_layout() -> None:
    md = evaluate(ROWS, n_bootstrap=0).to_markdown()
    assert "| liver | 4 / 4 | 75.00 | 50.00 | 100.00 | 75.00 | 75.00 |" in md
    assert "| pancreas | 2 / 1 | 50.00 | n/a | 50.00 | 0.00 | 25.00 |" in md
    assert "| **average** |  |  |  |  |  | 50.00 |" in md


def test_write_evaluation(tmp_path: Path) -> None:
    result = evaluate(_big_rows(), n_bootstrap=100)
    paths = write_evaluation(result, tmp_path / "eval")
    assert {p.name for p in paths.values()} == {"metrics.md", "metrics.json", "metrics.png"}
    assert paths["markdown"].read_text() == result.to_markdown()
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(result.to_json()))
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["metrics.json", "metrics.md", "metrics.png"]


def test_docstring_examples() -> None:
    assert doctest.testmod(evaluation).failed == 0


def test_score_predictions_reads_scores_and_leaves_out_failed_inferences() -> None:
    truth = {
        "case_id": "BDMAP_00000001",
        "organ": "liver",
        "split": "test",
        "has_lesion": False,
        "long_axis_mm": None,
        "location": [],
        "attenuation": None,
        "key_slice_frame": None,
        "n_frames": 8,
    }
    negative = "<findings>No focal liver lesion is identified.</findings> || <impression>No liver tumor.</impression>"
    raw = {**truth, "prediction": negative, "inference_error": None}
    failed = {**truth, "prediction": None, "inference_error": "timeout"}
    (scored,) = score_predictions([raw, failed])
    assert (scored["score_existence"], scored["parse_failure"], scored["reward"]) == (1.0, None, 1.0)
    # A `predictions` row carries the scorer's own columns: read as it is, not scored again.
    stored = {**raw, "prediction": "unparseable", "score_existence": 1.0, "parse_failure": None}
    assert score_predictions([stored]) == [stored]
    table = evaluate(score_predictions([raw, failed, stored]), n_bootstrap=0).table1["liver"]
    assert (table["spec"].value, table["spec"].n) == (1.0, 2)
