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

A statistic that is a function of column sums of 0/1 values over its rows (an organ's sensitivity, K-Hit) may say so
with a `counts(rows)` method (`CountedStatistic`): the bootstrap then sums the drawn rows' columns (one `bincount` and
one product a resample) instead of building each resample's rows, and gives the same draws bit for bit.

`resampled_sums` is the rows-only draw for many statistics at once: when every statistic is a function of column
sums over the rows (a ratio of counts, a mean, corpus BLEU's n-gram counts), it returns those sums for every
resample, drawn exactly as `paired_bootstrap` draws them (the same row indices for a seed). Put both models' columns
side by side in one array and each resample's sums serve both: the difference of any statistic is paired. Evaluating
every Table 1/2 cell of two models this way costs one draw per resample, not one per cell.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


__all__ = [
    "CountedStatistic",
    "Groups",
    "hierarchical_paired_bootstrap",
    "interval",
    "paired_bootstrap",
    "resampled_sums",
]

Groups = Sequence[tuple[Sequence[Any], Sequence[Any]]]


@runtime_checkable
class CountedStatistic(Protocol):
    """A statistic of rows that is a function of column sums over them.

    `counts(rows)` returns `(columns, of_sums)`: an `(n_rows, k)` array whose column sums are exact (0/1 values), and
    the function that gives the statistic from a length-k list of those sums, equal, bit for bit, to the statistic of
    the rows the sums were taken over; or None where the rows do not allow it (the bootstrap then calls the statistic
    on the drawn rows).
    """

    def __call__(self, rows: Sequence[Any]) -> float: ...

    def counts(self, rows: Sequence[Any]) -> tuple[np.ndarray, Callable[[list[float]], float]] | None: ...


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


def interval(draws: Sequence[float] | np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Return the percentile interval of the draws (the inverted-CDF quantiles), nan draws left out; (nan, nan)
    when none is left.

    >>> interval([0.0, 1.0, 2.0, 3.0], level=0.5)
    (0.0, 2.0)
    """
    tail = (1 - level) / 2
    values = np.asarray(draws, dtype=np.float64)
    kept = values[~np.isnan(values)]
    if not kept.size:
        return float("nan"), float("nan")
    low, high = np.quantile(kept, [tail, 1 - tail], method="inverted_cdf")
    return float(low), float(high)


def _summary(diff: float, draws: Sequence[float], tail: float, groups: Groups) -> dict[str, float | int]:
    low, high = interval(draws, 1 - 2 * tail)
    return {
        "diff": diff,
        "ci_low": low,
        "ci_high": high,
        "n_rows": sum(len(a) for a, _ in groups),
        "n_groups": len(groups),
    }


def _draw_rows(rng: np.random.Generator, sizes: Sequence[int]) -> list[np.ndarray]:
    """Return one resample's row indices of each group (`sizes[g]` rows drawn with replacement from `sizes[g]`): the
    one draw both bootstraps and `resampled_sums` make."""
    return [rng.integers(n, size=n) for n in sizes]


def _group_diff(
    a: Sequence[Any], b: Sequence[Any], statistic: Callable[[Sequence[Any]], float]
) -> Callable[[np.ndarray], float]:
    """Return `idx -> statistic(a[idx]) - statistic(b[idx])` for one group: through column sums where the statistic
    is a `CountedStatistic` whose `counts` accepts both sides, else on the drawn rows."""
    form_a = form_b = None
    if isinstance(statistic, CountedStatistic):
        form_a, form_b = statistic.counts(a), statistic.counts(b)
    if form_a is None or form_b is None:
        return lambda idx: statistic([a[i] for i in idx]) - statistic([b[i] for i in idx])
    (cols_a, of_a), (cols_b, of_b) = form_a, form_b
    both, k, n = np.hstack([cols_a, cols_b]), cols_a.shape[1], len(a)

    def diff(idx: np.ndarray) -> float:
        sums = (np.bincount(idx, minlength=n) @ both).tolist()
        return of_a(sums[:k]) - of_b(sums[k:])

    return diff


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
    sizes = [len(a) for a, _ in groups]
    diffs = [_group_diff(a, b, statistic) for a, b in groups]
    for _ in range(n_bootstrap):
        drawn = _draw_rows(rng, sizes)
        draws.append(statistics.fmean(of(idx) for of, idx in zip(diffs, drawn, strict=True)))
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
    diffs = [_group_diff(a, b, statistic) for a, b in groups]
    sizes = [len(a) for a, _ in groups]
    for _ in range(n_bootstrap):
        chosen = rng.integers(len(groups), size=len(groups)).tolist()
        drawn = _draw_rows(rng, [sizes[g] for g in chosen])
        draws.append(statistics.fmean(diffs[g](idx) for g, idx in zip(chosen, drawn, strict=True)))
    return _summary(diff, draws, tail, groups)


_CHUNK_ENTRIES = 4_000_000  # resample-weight entries held at once (float64: 32 MB)


def resampled_sums(groups: Sequence[np.ndarray], *, n_bootstrap: int, seed: int) -> list[np.ndarray]:
    """Return, per group, the column sums of its rows over each rows-only resample: `(n_bootstrap, k_g)` arrays.

    Args:
        groups: one `(n_g, k_g)` array per group (an organ), a row per evaluated row; every group is kept in every
            resample and its rows redrawn with replacement, the indices `paired_bootstrap` draws for the same seed.
        n_bootstrap: resamples.
        seed: the generator's seed.

    Raises:
        ValueError: on a group without rows or a non-2-D group.

    >>> resampled_sums([np.array([[1.0, 0.0], [1.0, 1.0]])], n_bootstrap=3, seed=0)[0].tolist()  # rows 1 1, 1 0, 0 0
    [[2.0, 2.0], [2.0, 1.0], [2.0, 0.0]]
    """
    values = [np.asarray(g, dtype=np.float64) for g in groups]
    for g in values:
        if g.ndim != 2 or not g.shape[0]:
            raise ValueError(f"resampled_sums: every group needs rows and columns (got shape {g.shape})")
    sizes = [g.shape[0] for g in values]
    rng = np.random.default_rng(seed)
    out = [np.empty((n_bootstrap, g.shape[1])) for g in values]
    chunk = max(1, _CHUNK_ENTRIES // max(sizes, default=1))
    for start in range(0, n_bootstrap, chunk):
        stop = min(n_bootstrap, start + chunk)
        weights = [np.empty((stop - start, n)) for n in sizes]
        for b in range(stop - start):
            for k, idx in enumerate(_draw_rows(rng, sizes)):
                weights[k][b] = np.bincount(idx, minlength=sizes[k])
        for k, w in enumerate(weights):
            out[k][start:stop] = w @ values[k]
    return out
