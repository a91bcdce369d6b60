"""Paired bootstrap intervals of the differences between two models scored on the same held-out rows.

Two models evaluated on the same test rows are paired: resampling the rows (the same draw for both) and recomputing the
metric of each gives the distribution of the difference, much narrower than two independent intervals. Over several
seeds (each its own rows) the pooled difference is the mean of the per-seed differences, resampled within each seed.

The metrics are computed from per-row scored records (`emrl_data.text.evaluation.score_predictions` rows):

* `average_bacc`: per organ (sensitivity + specificity) / 2 of `score_existence`, averaged over the organs that have
  both positive and negative rows;
* `k_hit`: per organ the mean `score_k_hit` of positive rows, averaged over the organs that have one;
* `exact_key`: as `k_hit`, but a hit only where the report names the true key frame itself (d = 0);
* `lesion_metrics(span)`: K-Hit taken apart: the share of K-Hit's rows whose report names a lesion frame (claims a
  lesion and names a frame within `span` of the key frame, where the lesion is visible), and among those the K-Hit
  and exact-key rates; and the exact share of the K-Hits.

The bootstrap itself is `emrl_data.text.bootstrap` (re-exported here). `contrast_bootstrap` draws the same two
intervals for a signed sum of organ-averaged rates (a paired difference, a difference of differences) all at once
from column sums, and gives the two-sided bootstrap p-value and the standard error beside them; `holm` and
`benjamini_hochberg` adjust a family of p-values. Everything here is pure (tested in
tests/train/test_miniature_power.py on constructed scores).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from emrl_data.text.bootstrap import hierarchical_paired_bootstrap, interval, paired_bootstrap
from train.checks import TrainConfigError


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

    def __init__(
        self,
        name: str,
        cell: Cell,
        n_slots: int,
        combine: Callable[[list[tuple[float, float]]], float | None],
        doc: str,
    ) -> None:
        self.__name__, self.__doc__ = name, doc
        self._cell, self._slots, self._combine = cell, n_slots, combine
        self._combine_arrays = _COMBINE_ARRAYS[combine]

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

    def columns(self, rows: Records) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
        """Return `(columns, of_sums)` for many draws at once: the `(n_rows, k)` count and score columns (any scores),
        and the function that gives the statistic of each row of a `(n_draws, k)` array of column sums (nan where no
        organ has a value)."""
        organs = sorted({r["organ"] for r in rows})
        width = 2 * self._slots
        columns = np.zeros((len(rows), width * len(organs)))
        for i, row in enumerate(rows):
            cell = self._cell(row)
            if cell is not None:
                j = organs.index(row["organ"]) * width + 2 * cell[0]
                columns[i, j], columns[i, j + 1] = 1.0, float(cell[1])

        def of_sums(sums: np.ndarray) -> np.ndarray:
            per_organ = [
                self._combine_arrays(
                    [(sums[:, o * width + 2 * k], sums[:, o * width + 2 * k + 1]) for k in range(self._slots)]
                )
                for o in range(len(organs))
            ]
            if not per_organ:
                return np.full(sums.shape[0], np.nan)
            values = np.stack(per_organ, axis=1)
            kept = (~np.isnan(values)).sum(axis=1)
            total = np.where(np.isnan(values), 0.0, values).sum(axis=1)
            with np.errstate(invalid="ignore", divide="ignore"):
                return np.where(kept > 0, total / np.maximum(kept, 1), np.nan)

        return columns, of_sums


def _balanced(slots: list[tuple[float, float]]) -> float | None:
    (n_pos, pos), (n_neg, neg) = slots
    return (pos / n_pos + neg / n_neg) / 2 if n_pos and n_neg else None


def _rate(slots: list[tuple[float, float]]) -> float | None:
    ((n, hits),) = slots
    return hits / n if n else None


def _balanced_arrays(slots: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    (n_pos, pos), (n_neg, neg) = slots
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((n_pos > 0) & (n_neg > 0), (pos / n_pos + neg / n_neg) / 2, np.nan)


def _rate_arrays(slots: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    ((n, hits),) = slots
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, hits / n, np.nan)


_COMBINE_ARRAYS: dict[Any, Callable[[list[tuple[np.ndarray, np.ndarray]]], np.ndarray]] = {
    _balanced: _balanced_arrays,
    _rate: _rate_arrays,
}


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


def names_lesion_frame(row: Mapping[str, Any], span: int) -> bool:
    """Return True where the report claims a lesion and names a frame within `span` frames of the true key frame (a
    frame on which the lesion is visible)."""
    pred, key = row.get("pred_key_slice"), row.get("key_slice_frame")
    return bool(row.get("pred_has_lesion")) and pred is not None and key is not None and abs(pred - key) <= span


def lesion_metrics(span: int) -> dict[str, OrganRate]:
    """Return K-Hit taken apart, for a lesion visible `span` frames each side of its key frame (organ-averaged rates
    of the positive rows K-Hit scores):

    * `lesion_frame`: the share whose report names a lesion frame (`names_lesion_frame`);
    * `k_hit_in_lesion`, `exact_in_lesion`: among those, K-Hit (d <= 1) and the exact key frame (d = 0);
    * `exact_of_hits`: the exact share of the K-Hits.
    """

    def scored(r: Mapping[str, Any]) -> bool:
        return bool(r["has_lesion"]) and r["score_k_hit"] is not None

    def exact(r: Mapping[str, Any]) -> float:
        return float(r["pred_key_slice"] == r["key_slice_frame"])

    cells: dict[str, tuple[Cell, str]] = {
        "lesion_frame": (
            lambda r: (0, float(names_lesion_frame(r, span))) if scored(r) else None,
            "the share of K-Hit's rows whose report names a lesion frame",
        ),
        "k_hit_in_lesion": (
            lambda r: (0, r["score_k_hit"]) if scored(r) and names_lesion_frame(r, span) else None,
            "K-Hit among the rows whose report names a lesion frame",
        ),
        "exact_in_lesion": (
            lambda r: (0, exact(r)) if scored(r) and names_lesion_frame(r, span) else None,
            "the exact key frame among the rows whose report names a lesion frame",
        ),
        "exact_of_hits": (
            lambda r: (0, exact(r)) if scored(r) and r["score_k_hit"] == 1 else None,
            "the exact key frame among the K-Hits",
        ),
    }
    return {
        name: OrganRate(name, cell, 1, _rate, f"Return the organ-averaged {doc}.")
        for name, (cell, doc) in cells.items()
    }


def random_lesion_frame(rows: Records, span: int, n_frames: int) -> dict[str, float]:
    """Return what reports naming a frame drawn at random among the lesion's visible frames (frames 1..`n_frames`
    within `span` of the key frame) would score in expectation, per `lesion_metrics` rate and K-Hit and exact key,
    organ-averaged over the positive rows with a key frame (nan without one)."""
    by_organ: dict[str, list[tuple[float, float, float]]] = {}
    for row in rows:
        key = row.get("key_slice_frame")
        if not row["has_lesion"] or key is None:
            continue
        visible = [f for f in range(1, n_frames + 1) if abs(f - key) <= span]
        near = sum(1 for f in visible if abs(f - key) <= 1)
        by_organ.setdefault(row["organ"], []).append((1 / len(visible), near / len(visible), 1 / near))
    organs = sorted(by_organ)

    def rate(i: int) -> float:
        if not organs:
            return float("nan")
        return statistics.fmean(statistics.fmean(v[i] for v in by_organ[o]) for o in organs)

    exact, hit = rate(0), rate(1)
    return {
        "k_hit": hit,
        "exact_key": exact,
        "lesion_frame": 1.0 if organs else float("nan"),
        "k_hit_in_lesion": hit,
        "exact_in_lesion": exact,
        "exact_of_hits": rate(2),
    }


# A contrast of one group (a seed's test rows): terms (sign, metric, rows), every rows list the same rows in order
# (the models, or one model at two levels, on the same test split). Its value is sum(sign * metric(rows)).
Term = tuple[float, OrganRate, Records]
Z_95, Z_80 = 1.959963984540054, 0.8416212335729143  # two-sided 5 % and 80 % power: the detectable difference


def _contrast_form(terms: Sequence[Term]) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
    """Return one group's side-by-side columns and the contrast of each row of a `(n_draws, k)` sums array."""
    n = {len(rows) for _, _, rows in terms}
    if len(n) != 1 or not n.pop():
        raise ValueError("contrast_bootstrap: a group's terms must pair rows one to one")
    forms = [(sign, *metric.columns(rows)) for sign, metric, rows in terms]
    bounds = np.cumsum([0] + [cols.shape[1] for _, cols, _ in forms])

    def value(sums: np.ndarray) -> np.ndarray:
        out = np.zeros(sums.shape[0])
        for (sign, _, of_sums), start, stop in zip(forms, bounds[:-1], bounds[1:], strict=True):
            out = out + sign * of_sums(sums[:, start:stop])
        return out

    return np.hstack([cols for _, cols, _ in forms]), value


def _weights(rng: np.random.Generator, n_draws: int, n_rows: int) -> np.ndarray:
    """Return `(n_draws, n_rows)` counts: each draw's rows drawn with replacement."""
    idx = rng.integers(n_rows, size=(n_draws, n_rows)) + n_rows * np.arange(n_draws)[:, None]
    return np.bincount(idx.ravel(), minlength=n_draws * n_rows).reshape(n_draws, n_rows).astype(np.float64)


def contrast_draws(
    groups: Sequence[Sequence[Term]], *, n_bootstrap: int, seed: int, hierarchical: bool
) -> tuple[float, np.ndarray]:
    """Return the contrast (the mean over the groups of each group's value) and its bootstrap draws: rows only (every
    group kept, its rows redrawn) or, `hierarchical`, seeds and rows (the groups drawn with replacement, then each
    drawn group's rows). A draw is nan where a drawn group's contrast is undefined."""
    if not groups:
        raise ValueError("contrast_bootstrap: no group")
    forms = [_contrast_form(terms) for terms in groups]
    point = statistics.fmean(float(value(cols.sum(axis=0, keepdims=True))[0]) for cols, value in forms)
    rng = np.random.default_rng(seed)
    per_slot = np.empty((n_bootstrap, len(groups)))
    chosen = rng.integers(len(groups), size=(n_bootstrap, len(groups))) if hierarchical else None
    for g, (cols, value) in enumerate(forms):
        where = (chosen == g) if chosen is not None else None
        n_draws = int(where.sum()) if where is not None else n_bootstrap
        if not n_draws:
            continue
        draws = value(_weights(rng, n_draws, cols.shape[0]) @ cols)
        if where is None:
            per_slot[:, g] = draws
        else:
            per_slot[where] = draws
    return point, per_slot.mean(axis=1)


def contrast_bootstrap(
    groups: Sequence[Sequence[Term]], *, n_bootstrap: int, seed: int, hierarchical: bool, level: float = 0.95
) -> dict[str, float | int | None]:
    """Return the contrast with its percentile interval (`emrl_data.text.bootstrap.interval`), `p` (the two-sided
    bootstrap p-value of 0: twice the smaller share of draws at or below 0 and at or above 0, at most 1), `se` (the
    draws' standard deviation), `mdd` (the smallest true contrast found with 80 % power at a two-sided 5 % level
    under a normal approximation, (1.96 + 0.84) x se) and `mc_error` (`bound_mc_error`); nan draws left out, None where
    no draw is left."""
    if n_bootstrap * (1 - level) / 2 < 1:
        raise ValueError(f"contrast_bootstrap: n_bootstrap={n_bootstrap} is too few for a {level:.0%} interval")
    point, draws = contrast_draws(groups, n_bootstrap=n_bootstrap, seed=seed, hierarchical=hierarchical)
    kept = draws[~np.isnan(draws)]
    out: dict[str, float | int | None] = {
        "diff": None if math.isnan(point) else point,
        "ci_low": None,
        "ci_high": None,
        "p": None,
        "se": None,
        "mdd": None,
        "mc_error": None,
        "n_rows": sum(len(terms[0][2]) for terms in groups),
        "n_groups": len(groups),
    }
    if kept.size:
        out["ci_low"], out["ci_high"] = interval(kept, level)
        out["p"] = min(1.0, 2 * min(float(np.mean(kept <= 0)), float(np.mean(kept >= 0))))
        se = float(np.std(kept, ddof=1)) if kept.size > 1 else 0.0
        out["se"], out["mdd"] = se, (Z_95 + Z_80) * se
        out["mc_error"] = bound_mc_error(se, kept.size, level)
    return out


def bound_mc_error(se: float, n_draws: int, level: float = 0.95) -> float:
    """Return the Monte Carlo standard error of a percentile bound of `n_draws` draws of standard deviation `se`,
    under a normal approximation: sqrt(q (1 - q) / n) / density at the bound, q the interval's tail share."""
    q = (1 - level) / 2
    z = statistics.NormalDist().inv_cdf(1 - q)
    density = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    return math.sqrt(q * (1 - q) / n_draws) * se / density if n_draws else float("nan")


def holm(p_values: Sequence[float]) -> list[float]:
    """Return Holm's step-down adjusted p-values (family-wise error), in the order given.

    >>> holm([0.01, 0.04, 0.03])
    [0.03, 0.06, 0.06]
    """
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    out, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        out[i] = running
    return out


def benjamini_hochberg(p_values: Sequence[float]) -> list[float]:
    """Return Benjamini-Hochberg adjusted p-values (false discovery rate), in the order given.

    >>> benjamini_hochberg([0.01, 0.04, 0.03])
    [0.03, 0.04, 0.04]
    """
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i], reverse=True)
    out, running = [0.0] * m, 1.0
    for rank, i in enumerate(order):
        running = min(running, m / (m - rank) * p_values[i])
        out[i] = min(1.0, running)
    return out


def check_power(n_test: int, n_organs: int, min_rows_per_class: int, n_bootstrap: int, level: float = 0.95) -> None:
    """Refuse, in one line, a test split or resample count too small for the intervals the study prints.

    Each organ needs `min_rows_per_class` positive and negative rows on average (n_test >= 2 x organs x that), and the
    percentile interval needs at least one resample in each tail.
    """
    need = 2 * n_organs * min_rows_per_class
    if n_test < need:
        raise TrainConfigError(
            f"miniature: n_test={n_test} is too small for the per-organ intervals it prints: {n_organs} organs x 2 "
            f"classes x min_test_rows_per_class={min_rows_per_class} needs n_test >= {need}"
        )
    if n_bootstrap * (1 - level) / 2 < 1:
        raise TrainConfigError(f"miniature: n_bootstrap={n_bootstrap} is too few for {level:.0%} intervals")
