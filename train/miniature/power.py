"""Paired bootstrap intervals of the differences between two models scored on the same held-out rows.

Two models evaluated on the same test rows are paired: resampling the rows (the same draw for both) and recomputing the
metric of each gives the distribution of the difference, much narrower than two independent intervals. Over several
seeds (each its own rows) the pooled difference is the mean of the per-seed differences, resampled within each seed.

The metrics are computed from per-row scored records (`emrl_data.text.evaluation.score_predictions` rows):

* `average_bacc`: per organ (sensitivity + specificity) / 2 of `score_existence`, averaged over the organs that have
  both positive and negative rows;
* `k_hit`: per organ the mean `score_k_hit` of positive rows, averaged over the organs that have one.

Everything here is pure (tested in tests/train/test_miniature_power.py on constructed scores).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


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


METRICS: dict[str, Callable[[Records], float]] = {"average_bacc": average_bacc, "k_hit": k_hit}


def paired_bootstrap(
    groups: Sequence[tuple[Sequence[Any], Sequence[Any]]],
    statistic: Callable[[Sequence[Any]], float],
    *,
    n_bootstrap: int,
    seed: int,
    level: float = 0.95,
) -> dict[str, float | int]:
    """Return the difference `statistic(a) - statistic(b)`, averaged over the groups, and its paired percentile interval.

    Args:
        groups: one `(a_rows, b_rows)` per seed; a_rows[i] and b_rows[i] are the two models on the same row.
        statistic: rows -> a number (a mean, `average_bacc`, `k_hit`).
        n_bootstrap: resamples; each draws every group's rows with replacement (the same indices for a and b).
        seed: the resampling generator's seed.
        level: the interval's coverage.

    Returns:
        `diff`, `ci_low`, `ci_high`, `n_rows` (all groups), `n_groups`. Resamples where the statistic is undefined (nan:
        a class missing from the draw) are left out of the interval.

    Raises:
        ValueError: on unpaired groups (lengths differ), no group, or too few resamples for the interval's tails.
    """
    if not groups:
        raise ValueError("paired_bootstrap: no group")
    for a, b in groups:
        if len(a) != len(b) or not a:
            raise ValueError(f"paired_bootstrap: groups must pair rows one to one (got {len(a)} and {len(b)} rows)")
    tail = (1 - level) / 2
    if n_bootstrap * tail < 1:
        raise ValueError(f"paired_bootstrap: n_bootstrap={n_bootstrap} is too few for a {level:.0%} interval")
    diff = statistics.fmean(statistic(a) - statistic(b) for a, b in groups)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n_bootstrap):
        per_group = []
        for a, b in groups:
            idx = rng.integers(len(a), size=len(a))
            per_group.append(statistic([a[i] for i in idx]) - statistic([b[i] for i in idx]))
        draws.append(statistics.fmean(per_group))
    kept = np.asarray([d for d in draws if not np.isnan(d)])
    if kept.size == 0:
        return {"diff": diff, "ci_low": float("nan"), "ci_high": float("nan"),
                "n_rows": sum(len(a) for a, _ in groups), "n_groups": len(groups)}  # fmt: skip
    low, high = np.quantile(kept, [tail, 1 - tail], method="inverted_cdf")
    return {"diff": diff, "ci_low": float(low), "ci_high": float(high), "n_rows": sum(len(a) for a, _ in groups),
            "n_groups": len(groups)}  # fmt: skip


def check_power(n_test: int, n_organs: int, min_rows_per_class: int, n_bootstrap: int, level: float = 0.95) -> None:
    """Refuse, in one line, a test split or resample count too small for the intervals the study prints.

    Each organ needs `min_rows_per_class` positive and negative rows on average (n_test >= 2 x organs x that), and the
    percentile interval needs at least one resample in each tail.
    """
    from train.checks import TrainConfigError  # noqa: PLC0415

    need = 2 * n_organs * min_rows_per_class
    if n_test < need:
        raise TrainConfigError(
            f"miniature: n_test={n_test} is too small for the per-organ intervals it prints: {n_organs} organs x 2 "
            f"classes x min_test_rows_per_class={min_rows_per_class} needs n_test >= {need}"
        )
    if n_bootstrap * (1 - level) / 2 < 1:
        raise TrainConfigError(f"miniature: n_bootstrap={n_bootstrap} is too few for {level:.0%} intervals")
