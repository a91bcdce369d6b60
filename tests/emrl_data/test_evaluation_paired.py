"""Paired Table 1/2 differences between two models on the same rows, from constructed scored rows."""

from __future__ import annotations

import math

import pytest

from emrl_data.text.bootstrap import paired_bootstrap
from emrl_data.text.comparison import pair_rows, paired_differences
from emrl_data.text.evaluation import evaluate


def _rows(organ: str, n_pos: int, n_neg: int, *, missed: int = 0, false_alarms: int = 0, start: int = 0) -> list[dict]:
    """Scored rows of one organ: the first `missed` positives and the first `false_alarms` negatives answered wrong."""
    rows = []
    for i in range(n_pos + n_neg):
        positive = i < n_pos
        right = i >= missed if positive else i - n_pos >= false_alarms
        row = {
            "case_id": f"BDMAP_{start + i:08d}",
            "organ": organ,
            "has_lesion": positive,
            "long_axis_mm": 30.0 if positive else None,
            "score_existence": float(right),
        }
        if positive:
            row |= {
                "score_size": float(right),
                "score_location": float(right),
                "score_enhancement": float(right),
                "score_k_hit": float(right),
            }
        rows.append(row)
    return rows


def test_a_model_that_misses_k_lesions_the_other_finds_differs_by_exactly_k_over_the_positives():
    # 40 liver positives, 40 negatives; the model misses 12 lesions the reference finds: Sen -12/40, B-Acc -6/40.
    reference = _rows("liver", 40, 40)
    model = _rows("liver", 40, 40, missed=12)
    got = paired_differences(reference, model, names=("sft", "grpo"), n_bootstrap=1000, seed=0)
    liver = got.table1["liver"]
    assert liver["sen"].value == pytest.approx(-0.3)
    assert liver["sen_gt2"].value == pytest.approx(-0.3)
    assert liver["spec"].value == 0.0 and (liver["spec"].ci_low, liver["spec"].ci_high) == (0.0, 0.0)
    assert liver["bacc"].value == pytest.approx(-0.15)
    assert math.isnan(liver["sen_le2"].value)  # no lesion <= 2 cm
    assert liver["sen"].ci_high < 0 and liver["bacc"].ci_high < 0  # the interval excludes 0
    assert got.average_bacc.value == pytest.approx(-0.15)
    assert got.table2["average"]["k_hit"].value == pytest.approx(-0.3)
    assert got.table2_overall.value == pytest.approx(-0.3)
    assert (got.n_paired, got.n_reference_only, got.n_model_only) == (80, 0, 0)
    assert (liver["sen"].n, liver["bacc"].n) == (40, 80)


def test_the_paired_interval_is_the_rows_only_paired_bootstrap_of_the_same_cell():
    # One organ: resampled_sums draws the indices paired_bootstrap draws for the seed, so Sen's interval is the one
    # paired_bootstrap gives for sensitivity computed row by row.
    reference = _rows("liver", 15, 15, missed=2)
    model = _rows("liver", 15, 15, missed=7, false_alarms=3)

    def sen(rows):
        pos = [r["score_existence"] for r in rows if r["has_lesion"]]
        return sum(pos) / len(pos) if pos else math.nan

    expected = paired_bootstrap([(model, reference)], sen, n_bootstrap=500, seed=3)
    got = paired_differences(reference, model, n_bootstrap=500, seed=3).table1["liver"]["sen"]
    assert (got.value, got.ci_low, got.ci_high) == pytest.approx(
        (expected["diff"], expected["ci_low"], expected["ci_high"])
    )


def test_two_identical_models_differ_by_zero_with_interval_zero_everywhere():
    rows = _rows("liver", 10, 10, missed=3, false_alarms=2) + _rows("pancreas", 6, 9, missed=1, start=100)
    got = paired_differences(rows, [dict(r) for r in rows], n_bootstrap=300, seed=1)
    cells = [c for o in got.organs for c in got.table1[o].values()] + [got.average_bacc, got.table2_overall]
    cells += [c for o in (*got.organs, "average") for c in got.table2[o].values()]
    defined = [c for c in cells if not math.isnan(c.value)]
    assert len(defined) == len(cells) - 2  # Sen <= 2 cm is undefined in both organs
    assert all((c.value, c.ci_low, c.ci_high) == (0.0, 0.0, 0.0) for c in defined)


def test_the_averages_are_the_differences_of_the_models_own_averages():
    reference = _rows("liver", 10, 10, missed=1) + _rows("kidney", 8, 12, false_alarms=3, start=100)
    model = _rows("liver", 10, 10, missed=4) + _rows("kidney", 8, 12, missed=2, start=100)
    got = paired_differences(reference, model, n_bootstrap=0)
    a, b = evaluate(reference, n_bootstrap=0), evaluate(model, n_bootstrap=0)
    assert got.average_bacc.value == pytest.approx(b.average_bacc.value - a.average_bacc.value)
    assert got.table2_overall.value == pytest.approx(b.table2_overall.value - a.table2_overall.value)
    assert got.table1["kidney"]["spec"].value == pytest.approx(0.25)
    assert math.isnan(got.average_bacc.ci_low)  # no replicates, no interval


def test_rows_only_one_model_answered_are_left_out_and_counted():
    reference = _rows("liver", 10, 10)
    model = _rows("liver", 10, 10, missed=2)[3:] + _rows("liver", 1, 0, start=500)
    paired_ref, paired_mod, ref_only, mod_only = pair_rows(reference, model)
    assert (len(paired_ref), ref_only, mod_only) == (17, 3, 1)
    assert [r["case_id"] for r in paired_ref] == [r["case_id"] for r in paired_mod]
    got = paired_differences(reference, model, n_bootstrap=0)
    assert (got.n_paired, got.n_reference_only, got.n_model_only) == (17, 3, 1)
    assert got.table1["liver"]["sen"].value == 0.0  # the two misses were among the rows left out
    assert "17 paired rows" in got.to_markdown()


def test_rows_that_cannot_be_paired_are_refused():
    rows = _rows("liver", 2, 2)
    with pytest.raises(ValueError, match="model predictions hold row BDMAP_00000000/liver twice"):
        paired_differences(rows, rows + rows[:1])
    with pytest.raises(ValueError, match="without case_id"):
        paired_differences([{k: v for k, v in r.items() if k != "case_id"} for r in rows], rows)
    with pytest.raises(ValueError, match="no row in common"):
        paired_differences(rows, _rows("liver", 2, 2, start=50))
