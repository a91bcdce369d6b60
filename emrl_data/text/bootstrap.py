"""Paired bootstrap intervals of the difference between two models scored on the same rows, one home for both uses.

Two models evaluated on the same rows are paired: resampling the rows (the same draw for both) and recomputing the
statistic of each gives the distribution of the difference, much narrower than two independent intervals.

Rows come in groups (one group per training seed, each with its own test rows, or a single group). Two intervals:

* `paired_bootstrap`, **rows only**: every resample keeps every group and redraws the rows within each; the pooled
  difference is the mean of the per-group differences. It answers "on these seeds, how sure are we of the mean
  difference over their rows"; it ignores how much the difference varies from one seed to the next.
* `hierarchical_paired_bootstrap`, **seeds and rows**: every resample first draws the groups with replacement, then
  the rows within each drawn group (the same row indices for both models). The interval counts the seeds as a source
  of variation; an effect that one seed carries does not survive it. An effect is claimed only where this interval
  excludes zero.

Both return `diff`, `ci_low`, `ci_high`, `n_rows`, `n_groups`; resamples where the statistic is undefined (nan: a
class missing from the draw) are left out of the interval. Deterministic for a seed (`numpy.random.default_rng`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


__all__ = ["Groups", "hierarchical_paired_bootstrap", "paired_bootstrap"]

Groups = Sequence[tuple[Sequence[Any], Sequence[Any]]]


def _check(groups: Groups, n_bootstrap: int, level: float, name: str) -> float:
    if not groups:
        raise ValueError(f"{name}: no group")
    for a, b in groups:
        if len(a) != len(b) or not a:
            raise ValueError(f"{name}: groups must pair rows one to one (got {len(a)} and {len(b)} rows)")
    tail = (1 - level) / 2
    if n_bootstrap * tail < 1:
        raise ValueError(f"{name}: n_bootstrap={n_bootstrap} is too few for a {level:.0%} interval")
    return tail


def _summary(diff: float, draws: Sequence[float], tail: float, groups: Groups) -> dict[str, float | int]:
    kept = np.asarray([d for d in draws if not np.isnan(d)])
    low, high = np.quantile(kept, [tail, 1 - tail], method="inverted_cdf") if kept.size else (np.nan, np.nan)
    return {"diff": diff, "ci_low": float(low), "ci_high": float(high), "n_rows": sum(len(a) for a, _ in groups),
            "n_groups": len(groups)}  # fmt: skip


def _group_diff(
    a: Sequence[Any], b: Sequence[Any], idx: np.ndarray, statistic: Callable[[Sequence[Any]], float]
) -> float:
    return statistic([a[i] for i in idx]) - statistic([b[i] for i in idx])


def paired_bootstrap(
    groups: Groups,
    statistic: Callable[[Sequence[Any]], float],
    *,
    n_bootstrap: int,
    seed: int,
    level: float = 0.95,
) -> dict[str, float | int]:
    """Return the difference `statistic(a) - statistic(b)`, averaged over the groups, and its rows-only interval.

    Args:
        groups: one `(a_rows, b_rows)` per seed; a_rows[i] and b_rows[i] are the two models on the same row.
        statistic: rows -> a number (a mean, an organ-averaged balanced accuracy, K-Hit).
        n_bootstrap: resamples; each draws every group's rows with replacement (the same indices for a and b).
        seed: the resampling generator's seed.
        level: the interval's coverage.

    Raises:
        ValueError: on unpaired groups (lengths differ), no group, or too few resamples for the interval's tails.
    """
    tail = _check(groups, n_bootstrap, level, "paired_bootstrap")
    diff = statistics.fmean(statistic(a) - statistic(b) for a, b in groups)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n_bootstrap):
        per_group = [_group_diff(a, b, rng.integers(len(a), size=len(a)), statistic) for a, b in groups]
        draws.append(statistics.fmean(per_group))
    return _summary(diff, draws, tail, groups)


def hierarchical_paired_bootstrap(
    groups: Groups,
    statistic: Callable[[Sequence[Any]], float],
    *,
    n_bootstrap: int,
    seed: int,
    level: float = 0.95,
) -> dict[str, float | int]:
    """Return the pooled difference and its interval over seeds and rows (groups drawn, then rows within each).

    The point estimate is `paired_bootstrap`'s (the mean of the per-group differences); only the interval differs. With
    one group the interval is the rows-only one's distribution (the group is always drawn); with groups whose
    differences disagree it widens by their spread, however many rows each has. Arguments and errors as
    `paired_bootstrap`.
    """
    tail = _check(groups, n_bootstrap, level, "hierarchical_paired_bootstrap")
    diff = statistics.fmean(statistic(a) - statistic(b) for a, b in groups)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n_bootstrap):
        drawn = rng.integers(len(groups), size=len(groups))
        per_group = []
        for g in drawn:
            a, b = groups[g]
            per_group.append(_group_diff(a, b, rng.integers(len(a), size=len(a)), statistic))
        draws.append(statistics.fmean(per_group))
    return _summary(diff, draws, tail, groups)
