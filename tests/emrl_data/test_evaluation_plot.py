"""Tests of the metrics picture (`evaluation._plot`) and of the metrics files' permissions."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import pytest

from emrl_data.text import evaluation
from emrl_data.text.evaluation import ZERO_BAR_PCT, evaluate, write_evaluation
from tests.emrl_data.test_evaluation import ROWS, neg, pos


# A model that gets everything wrong: every defined cell is 0; pancreas and kidney have no lesion <= 2 cm (n/a).
ALL_ZERO = [
    pos("liver", 15.0, False),
    pos("liver", 30.0, False),
    neg("liver", False),
    pos("pancreas", 25.0, False),
    neg("pancreas", False),
    pos("kidney", 40.0, False),
    neg("kidney", False),
]


def _bars_and_labels(rows: list) -> list[tuple[list[float], list[str]]]:
    """Per panel: the drawn bar heights and the texts written in the plot area."""
    figure = evaluation._figure(evaluate(rows, n_bootstrap=0))
    return [([round(p.get_height(), 6) for p in ax.patches], [t.get_text() for t in ax.texts]) for ax in figure.axes]


def test_all_zero_model_draws_a_labelled_stub_per_cell() -> None:
    (t1_bars, t1_texts), (t2_bars, t2_texts) = _bars_and_labels(ALL_ZERO)
    # Table 1: 3 organs x 5 metrics = 15 cells; Sen <= 2 cm is n/a for pancreas and kidney.
    assert t1_bars == [ZERO_BAR_PCT] * 13
    assert sorted(t1_texts) == ["0"] * 13 + ["n/a"] * 2
    # Table 2: (3 organs + average) x 4 metrics, all defined and 0.
    assert t2_bars == [ZERO_BAR_PCT] * 16
    assert t2_texts == ["0"] * 16


def test_mixed_model_bars_equal_the_table_and_na_is_written() -> None:
    result = evaluate(ROWS, n_bootstrap=0)
    (t1_bars, t1_texts), _ = _bars_and_labels(ROWS)
    expected = []
    for metric in evaluation.TABLE1_METRICS:  # bars are drawn metric by metric, organs in order
        for organ in result.organs:
            value = result.table1[organ][metric].value
            if not math.isnan(value):
                expected.append(round(ZERO_BAR_PCT if value == 0 else 100 * value, 6))
    assert t1_bars == expected
    assert sorted(t1_texts) == ["0", "n/a"]  # pancreas Spec 0/1, pancreas Sen <= 2 cm undefined


def test_plot_title_says_na_when_the_average_is_undefined() -> None:
    figure = evaluation._figure(evaluate([pos("liver", 30.0, True)], n_bootstrap=0))  # no negative: no B-Acc
    assert figure.axes[0].get_title() == "Table 1: detection (average B-Acc n/a)"


@pytest.mark.parametrize("umask", [0o077, 0o022])
def test_metrics_files_are_0644(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        paths = write_evaluation(evaluate(ROWS, n_bootstrap=0), tmp_path / "eval")
    finally:
        os.umask(old)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in paths.values()} == {
        "metrics.md": 0o644,
        "metrics.json": 0o644,
        "metrics.png": 0o644,
    }
