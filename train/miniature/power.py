"""Paired bootstrap intervals of the differences between two models scored on the same held-out rows.

Two models evaluated on the same test rows are paired: resampling the rows (the same draw for both) and recomputing the
metric of each gives the distribution of the difference, much narrower than two independent intervals. Over several
seeds (each its own rows) the pooled difference is the mean of the per-seed differences, resampled within each seed.

The metrics are computed from per-row scored records (`emrl_data.text.evaluation.score_predictions` rows):

* `average_bacc`: per organ (sensitivity + specificity) / 2 of `score_existence`, averaged over the organs that have
  both positive and negative rows;
* `k_hit`: per organ the mean `score_k_hit` of positive rows, averaged over the organs that have one;
* `exact_key`: as `k_hit`, but a hit only where the report names the true key frame itself (d = 0).

The bootstrap itself is `emrl_data.text.bootstrap` (re-exported here). Everything here is pure (tested in tests/train/test_miniature_power.py on constructed scores).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from emrl_data.text.bootstrap import hierarchical_paired_bootstrap, paired_bootstrap


__all__ = [
    "METRICS",
    "average_bacc",
    "check_power",
    "exact_key",
    "hierarchical_paired_bootstrap",
    "k_hit",
    "paired_bootstrap",
]

Records = Sequence[Mapping[str, Any]]


def average_bacc(rows: Records) -> float:
    """Return the organ-averaged balanced accuracy of `score_existence` (nan when no organ has both classes)."""
    values = []
    for organ in sorted({r["organ"] for r in rows}):
        pos = [r["score_existence"] for r in rows if r["organ"] == organ and r["has_lesion"]]
        neg = [r["score_existence"] for r in rows if r["organ"] == organ and not r["has_lesion"]]
        if pos and neg:
            values.append((statistics.fmean(pos) + statistics.fmean(neg)) / 2)
    return statistics.fmean(values) if values else float("nan")


def k_hit(rows: Records) -> float:
    """Return the organ-averaged mean `score_k_hit` over positive rows (nan without one)."""
    values = []
    for organ in sorted({r["organ"] for r in rows}):
        hits = [
            r["score_k_hit"] for r in rows if r["organ"] == organ and r["has_lesion"] and r["score_k_hit"] is not None
        ]
        if hits:
            values.append(statistics.fmean(hits))
    return statistics.fmean(values) if values else float("nan")


def exact_key(rows: Records) -> float:
    """Return the organ-averaged share of positive rows (those K-Hit scores) whose report names the true key frame
    itself (d = 0); the rows need the truth's `key_slice_frame` (nan without one)."""
    values = []
    for organ in sorted({r["organ"] for r in rows}):
        hits = [float(r["pred_key_slice"] == r["key_slice_frame"]) for r in rows
                if r["organ"] == organ and r["has_lesion"] and r["score_k_hit"] is not None]  # fmt: skip
        if hits:
            values.append(statistics.fmean(hits))
    return statistics.fmean(values) if values else float("nan")


METRICS: dict[str, Callable[[Records], float]] = {"average_bacc": average_bacc, "k_hit": k_hit}
KEY_METRICS: dict[str, Callable[[Records], float]] = {"exact_key": exact_key}  # records with the truth's key frame


def check_power(n_test: int, n_organs: int, min_rows_per_class: int, n_bootstrap: int, level: float = 0.95) -> None:
    """Refuse, in one line, a test split or resample count too small for the intervals the study prints.

    Each organ needs `min_rows_per_class` positive and negative rows on average (n_test >= 2 x organs x that), and the
    percentile interval needs at least one resample in each tail.
    """
    from train.checks import TrainConfigError

    need = 2 * n_organs * min_rows_per_class
    if n_test < need:
        raise TrainConfigError(
            f"miniature: n_test={n_test} is too small for the per-organ intervals it prints: {n_organs} organs x 2 "
            f"classes x min_test_rows_per_class={min_rows_per_class} needs n_test >= {need}"
        )
    if n_bootstrap * (1 - level) / 2 < 1:
        raise TrainConfigError(f"miniature: n_bootstrap={n_bootstrap} is too few for {level:.0%} intervals")
