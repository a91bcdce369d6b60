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

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

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


Cell = Callable[[Mapping[str, Any]], "tuple[int, Any] | None"]


class OrganRate:
    """An organ-averaged rate of 0/1 scores, callable on rows, with the column sums the bootstrap draws
    (`emrl_data.text.bootstrap.CountedStatistic`).

    `cell(row)` gives the row's `(slot, score)` or None (the row does not count); `combine(per_slot)` one organ's value
    from its slots' `(count, sum)` (None: the organ has no value). The statistic is the mean over the organs (sorted)
    with a value, nan without one.
    """

    def __init__(self, name: str, cell: Cell, n_slots: int,
                 combine: Callable[[list[tuple[float, float]]], float | None], doc: str) -> None:  # fmt: skip
        self.__name__, self.__doc__ = name, doc
        self._cell, self._slots, self._combine = cell, n_slots, combine

    def __repr__(self) -> str:
        return f"<metric {self.__name__}>"

    def __call__(self, rows: Records) -> float:
        by_organ: dict[str, list[list[float]]] = {}
        for row in rows:
            cell = self._cell(row)
            slots = by_organ.setdefault(row["organ"], [[] for _ in range(self._slots)])
            if cell is not None:
                slots[cell[0]].append(cell[1])
        values = [self._combine([(len(v), math.fsum(v)) for v in by_organ[o]]) for o in sorted(by_organ)]
        kept = [v for v in values if v is not None]
        return statistics.fmean(kept) if kept else float("nan")

    def counts(self, rows: Records) -> tuple[np.ndarray, Callable[[list[float]], float]] | None:
        """Return `(columns, of_sums)`: per organ and slot a count column and a score column; None where a score is
        not 0 or 1 (its sums would not be exact)."""
        organs = sorted({r["organ"] for r in rows})
        where = {organ: i for i, organ in enumerate(organs)}
        width = 2 * self._slots
        columns = np.zeros((len(rows), width * len(organs)))
        for i, row in enumerate(rows):
            cell = self._cell(row)
            if cell is None:
                continue
            if cell[1] not in (0, 1):
                return None
            j = where[row["organ"]] * width + 2 * cell[0]
            columns[i, j], columns[i, j + 1] = 1.0, float(cell[1])

        def of_sums(sums: list[float]) -> float:
            values = []
            for o in range(len(organs)):
                part = sums[o * width : (o + 1) * width]
                value = self._combine([(part[2 * k], part[2 * k + 1]) for k in range(self._slots)])
                if value is not None:
                    values.append(value)
            return statistics.fmean(values) if values else float("nan")

        return columns, of_sums


def _balanced(slots: list[tuple[float, float]]) -> float | None:
    (n_pos, pos), (n_neg, neg) = slots
    return (pos / n_pos + neg / n_neg) / 2 if n_pos and n_neg else None


def _rate(slots: list[tuple[float, float]]) -> float | None:
    ((n, hits),) = slots
    return hits / n if n else None


average_bacc = OrganRate(
    "average_bacc",
    lambda r: (0 if r["has_lesion"] else 1, r["score_existence"]),
    2,
    _balanced,
    "Return the organ-averaged balanced accuracy of `score_existence` (nan when no organ has both classes).",
)
k_hit = OrganRate(
    "k_hit",
    lambda r: (0, r["score_k_hit"]) if r["has_lesion"] and r["score_k_hit"] is not None else None,
    1,
    _rate,
    "Return the organ-averaged mean `score_k_hit` over positive rows (nan without one).",
)
exact_key = OrganRate(
    "exact_key",
    lambda r: (
        (0, float(r["pred_key_slice"] == r["key_slice_frame"]))
        if r["has_lesion"] and r["score_k_hit"] is not None
        else None
    ),
    1,
    _rate,
    "Return the organ-averaged share of positive rows (those K-Hit scores) whose report names the true key frame "
    "itself (d = 0); the rows need the truth's `key_slice_frame` (nan without one).",
)


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
