"""Paired differences of Table 1/2 between two models scored on the same rows, with paired bootstrap 95 % intervals.

Two models are paired on the rows both answered, matched by `row_id(case_id, organ)`; a row only one of them has is
left out of the comparison (the counts are stated). Every cell of Table 1 and Table 2, the average B-Acc and Table 2's
overall figure is computed for both models on the paired rows, and the difference is `model - reference` (the first
model given is the reference). The interval resamples the paired rows within each organ, as `evaluate` does, with
the same row indices for both models (`emrl_data.text.bootstrap.resampled_sums`): every cell is a function of
per-organ sums of 0/1 numerators and denominators, so one draw per resample serves every cell of both models.
Resamples where a cell is undefined for either model are left out of its interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from emrl_data.text.bootstrap import interval, resampled_sums
from emrl_data.text.evaluation import (
    _RATIO_METRICS,
    AVERAGE,
    TABLE1_METRICS,
    TABLE2_METRICS,
    _json_float,
    _markdown_table,
    _mean_over_organs,
    _organ_arrays,
    _ratio,
    _with_bacc,
)
from emrl_data.types import Organ, row_id


__all__ = ["Difference", "PairedComparison", "pair_rows", "paired_differences"]

_METRICS = (*_RATIO_METRICS, "bacc")
_INDEX = {name: j for j, name in enumerate(_METRICS)}


@dataclass(frozen=True, slots=True)
class Difference:
    """One cell's paired difference `model - reference` (fractions) with its 95 % interval.

    Attributes:
        value: the difference on the paired rows; NaN when the cell is undefined for either model.
        ci_low: lower end of the paired bootstrap interval (NaN without replicates).
        ci_high: upper end.
        n: the rows the cell is computed over (its denominator on the paired rows).
    """

    value: float
    ci_low: float
    ci_high: float
    n: int

    def to_json(self) -> dict[str, float | int | None]:
        """Return the cell as JSON-safe values (NaN -> None)."""
        return {
            "diff": _json_float(self.value),
            "ci_low": _json_float(self.ci_low),
            "ci_high": _json_float(self.ci_high),
            "n": self.n,
        }

    def to_markdown(self) -> str:
        """Return "+2.00 [+0.5, +3.5]" (percentage points), or "n/a"."""
        if math.isnan(self.value):
            return "n/a"
        if math.isnan(self.ci_low):
            return f"{100 * self.value:+.2f}"
        return f"{100 * self.value:+.2f} [{100 * self.ci_low:+.1f}, {100 * self.ci_high:+.1f}]"


@dataclass(frozen=True, slots=True)
class PairedComparison:
    """Table 1/2 differences of one model against the reference model on their paired rows.

    Attributes:
        reference: the reference model's name; model: the compared model's name.
        n_paired: rows both models answered (the rows compared); n_reference_only, n_model_only: rows left out.
        organs: organs of the paired rows, in `Organ` order.
        table1: organ -> metric -> difference; average_bacc: the average B-Acc's.
        table2: organ, and "average", -> metric -> difference; table2_overall: Table 2's overall figure's.
        n_bootstrap, seed: the bootstrap's replicates and seed.
    """

    reference: str
    model: str
    n_paired: int
    n_reference_only: int
    n_model_only: int
    organs: tuple[str, ...]
    table1: dict[str, dict[str, Difference]]
    average_bacc: Difference
    table2: dict[str, dict[str, Difference]]
    table2_overall: Difference
    n_bootstrap: int
    seed: int

    def to_json(self) -> dict[str, Any]:
        """Return the differences as a JSON-safe dict (fractions; NaN -> None)."""
        return {
            "reference": self.reference,
            "model": self.model,
            "rows": {
                "paired": self.n_paired,
                "reference_only": self.n_reference_only,
                "model_only": self.n_model_only,
            },
            "n_bootstrap": self.n_bootstrap,
            "seed": self.seed,
            "confidence": 0.95,
            "table1": {o: {m: c.to_json() for m, c in cells.items()} for o, cells in self.table1.items()},
            "average_bacc": self.average_bacc.to_json(),
            "table2": {o: {m: c.to_json() for m, c in cells.items()} for o, cells in self.table2.items()},
            "table2_overall": self.table2_overall.to_json(),
        }

    def to_markdown(self) -> str:
        """Return both difference tables (percentage points, paired 95 % intervals) with the row counts."""
        t1 = [[o] + [self.table1[o][m].to_markdown() for m in TABLE1_METRICS] for o in self.organs]
        t1.append([AVERAGE, *["" for _ in TABLE1_METRICS[:-1]], self.average_bacc.to_markdown()])
        t2 = [[o] + [self.table2[o][m].to_markdown() for m in TABLE2_METRICS] for o in (*self.organs, AVERAGE)]
        left_out = self.n_reference_only + self.n_model_only
        lines = [
            f"### {self.model} − {self.reference} (percentage points, paired 95 % intervals)",
            "",
            f"{self.n_paired} paired rows (matched by case and organ); {left_out} row(s) only one model answered "
            f"left out ({self.n_reference_only} only {self.reference}, {self.n_model_only} only {self.model}).",
            "",
            *_markdown_table(["organ", "Sen", "Sen ≤2", "Sen >2", "Spec", "B-Acc"], t1),
            "",
            *_markdown_table(["organ", "Size", "Location", "Enhancement", "K-Hit"], t2),
            "",
            f"Table 2 overall: **{self.table2_overall.to_markdown()}**",
            "",
        ]
        return "\n".join(lines)


def pair_rows(
    reference: Sequence[Mapping[str, Any]], model: Sequence[Mapping[str, Any]]
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]], int, int]:
    """Return the rows both sets hold, in the reference's order (matched by `row_id(case_id, organ)`), and the counts
    of rows only the reference, only the model holds.

    Raises:
        ValueError: on a row without `case_id` or `organ`, or a row id present twice in one set.
    """
    by_id = [_by_row_id(rows, name) for rows, name in ((reference, "reference"), (model, "model"))]
    ref, mod = by_id
    common = [key for key in ref if key in mod]
    return [ref[k] for k in common], [mod[k] for k in common], len(ref) - len(common), len(mod) - len(common)


def _by_row_id(rows: Sequence[Mapping[str, Any]], name: str) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}
    for row in rows:
        if row.get("case_id") is None or row.get("organ") is None:
            raise ValueError(f"the {name} predictions: a row without case_id or organ cannot be paired: {sorted(row)}")
        key = row_id(row["case_id"], row["organ"])
        if key in out:
            raise ValueError(f"the {name} predictions hold row {key} twice; each model answers a row once")
        out[key] = row
    return out


def _cells(points: np.ndarray, reps: np.ndarray) -> dict[tuple[str, ...], tuple[float, np.ndarray]]:
    """Return every table cell of one model: key -> (point, replicates), from per-organ metric values.

    `points` is `(organs, len(_METRICS))`, `reps` `(organs, n_bootstrap, len(_METRICS))`; keys are ("t1", k, metric)
    and ("t2", k, metric) for organ index k, ("t2", "average", metric), ("average_bacc",) and ("table2_overall",).
    Averages run over the organs where the point is defined, as `evaluate`'s do.
    """
    out: dict[tuple[str, ...], tuple[float, np.ndarray]] = {}
    for k in range(points.shape[0]):
        for m in _METRICS:
            out[("organ", str(k), m)] = (float(points[k, _INDEX[m]]), reps[k, :, _INDEX[m]])
    averages = {}
    for m in ("bacc", *TABLE2_METRICS):
        j = _INDEX[m]
        defined = ~np.isnan(points[:, j])
        if defined.any():
            averages[m] = (float(_mean_over_organs(points[:, j], defined)), _mean_over_organs(reps[:, :, j], defined))
        else:
            averages[m] = (math.nan, np.full(reps.shape[1], np.nan))
        out[("average", m)] = averages[m]
    attribute_points = np.array([averages[m][0] for m in TABLE2_METRICS])
    defined = ~np.isnan(attribute_points)
    if defined.any():
        stacked = np.stack([averages[m][1] for m in TABLE2_METRICS])
        out[("overall",)] = (float(attribute_points[defined].mean()), _mean_over_organs(stacked, defined))
    else:
        out[("overall",)] = (math.nan, np.full(reps.shape[1], np.nan))
    return out


def paired_differences(
    reference: Sequence[Mapping[str, Any]],
    model: Sequence[Mapping[str, Any]],
    *,
    names: tuple[str, str] = ("reference", "model"),
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> PairedComparison:
    """Return every Table 1/2 cell's difference `model - reference` on the paired rows, with paired intervals.

    Args:
        reference, model: scored rows (`score_predictions` output, or `predictions` table rows) with `case_id`.
        names: the two models' names, as printed.
        n_bootstrap: resamples (0: no intervals).
        seed: the bootstrap's seed.

    Raises:
        ValueError: on rows that cannot be paired (see `pair_rows`), no row in common, or a negative `n_bootstrap`.
    """
    if n_bootstrap < 0:
        raise ValueError(f"n_bootstrap={n_bootstrap} must be >= 0.")
    ref_rows, mod_rows, ref_only, mod_only = pair_rows(reference, model)
    if not ref_rows:
        raise ValueError(f"{names[0]} and {names[1]} have no row in common (matched by case_id and organ)")
    organs = tuple(o for o in Organ if any(r["organ"] == o for r in ref_rows))
    stacked, points, den = [], [], []
    for organ in organs:
        arrays = [_organ_arrays([r for r in rows if r["organ"] == organ]) for rows in (ref_rows, mod_rows)]
        stacked.append(np.hstack([arrays[0].num, arrays[0].den, arrays[1].num, arrays[1].den]))
        points.append([_with_bacc(_ratio(a.num.sum(axis=0), a.den.sum(axis=0))) for a in arrays])
        den.append(arrays[0].den.sum(axis=0))
    k = len(_RATIO_METRICS)
    if n_bootstrap:
        sums = resampled_sums(stacked, n_bootstrap=n_bootstrap, seed=seed)
        reps = [
            np.stack(
                [
                    _with_bacc(_ratio(s[:, i * 2 * k : i * 2 * k + k], s[:, i * 2 * k + k : (i + 1) * 2 * k]))
                    for s in sums
                ]
            )
            for i in (0, 1)
        ]
    else:
        reps = [np.full((len(organs), 0, k + 1), np.nan)] * 2
    cells = [_cells(np.array([p[i] for p in points]), reps[i]) for i in (0, 1)]

    def diff(key: tuple[str, ...], n: int) -> Difference:
        (point_a, reps_a), (point_b, reps_b) = cells[0][key], cells[1][key]
        low, high = interval(reps_b - reps_a) if n_bootstrap and not math.isnan(point_b - point_a) else (math.nan,) * 2
        return Difference(point_b - point_a, low, high, n)

    n_of = [{m: int(d[_INDEX[m]]) for m in _RATIO_METRICS} for d in den]
    for n in n_of:
        n["bacc"] = n["sen"] + n["spec"]
    table1 = {
        str(o): {m: diff(("organ", str(i), m), n_of[i][m]) for m in TABLE1_METRICS} for i, o in enumerate(organs)
    }
    table2 = {
        str(o): {m: diff(("organ", str(i), m), n_of[i][m]) for m in TABLE2_METRICS} for i, o in enumerate(organs)
    }
    table2[AVERAGE] = {m: diff(("average", m), sum(n[m] for n in n_of)) for m in TABLE2_METRICS}
    return PairedComparison(
        reference=names[0],
        model=names[1],
        n_paired=len(ref_rows),
        n_reference_only=ref_only,
        n_model_only=mod_only,
        organs=tuple(str(o) for o in organs),
        table1=table1,
        average_bacc=diff(("average", "bacc"), sum(n["bacc"] for n in n_of)),
        table2=table2,
        table2_overall=diff(("overall",), sum(n["sen"] for n in n_of)),
        n_bootstrap=n_bootstrap,
        seed=seed,
    )
