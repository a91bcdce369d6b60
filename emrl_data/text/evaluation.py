"""The paper's evaluation tables from scored predictions, with bootstrap 95 % intervals (docs/contract.md#scoring).

Table 1 (detection), per organ: Sen (all positives), Sen <= 2 cm and Sen > 2 cm (by the true long axis in cm as
reported, `round(long_axis_mm / 10, 1)`), Spec, B-Acc = (Sen + Spec) / 2; and the average B-Acc over organs.
Table 2 (attributes), per organ and averaged over organs: size, location, enhancement and K-Hit accuracy over
**all true positives**: a missed lesion (or a parse failure) counts as wrong on every attribute, the paper's
convention. The "overall" Table-2 figure is the mean of the four averaged columns (the paper's 67.53 %).

Conventions:

* Values are fractions in JSON and percentages (2 decimals) in markdown; the markdown's 95 % intervals (1 decimal)
  are tables of their own, so that every table fits the Prefect UI at 1024 px.
* A cell with no rows of its kind (no negatives, no lesion <= 2 cm, ...) is NaN: "n/a" in markdown, null in JSON,
  never 0. Averages run over the organs whose value is defined.
* Intervals: percentile bootstrap (2.5 %, 97.5 %) over `n_bootstrap` replicates that resample rows **within each
  organ** (counts drawn as multinomial weights, seeded with `numpy.random.default_rng(seed)`, organs in `Organ`
  order), so the result is deterministic for a seed. Averages are bootstrapped from the same replicates. Replicates
  where a cell is undefined are left out of that cell's interval.

Input rows (predictions): `organ`, `has_lesion` (truth), `long_axis_mm` (truth; None on negatives) and the
`ReportScore` fields `score_existence`, `score_size`, `score_location`, `score_enhancement`, `score_k_hit`,
`pred_has_lesion` (see `emrl_data.text.scoring`): the columns of the `predictions` table. `score_existence` decides
detection; when it is missing, `pred_has_lesion == has_lesion` does.
"""

from __future__ import annotations

import io
import json
import logging
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure  # no pyplot: no global backend state; Figure renders with Agg

from emrl_data.atomic_write import write_bytes_atomic
from emrl_data.text.scoring import DEFAULT_CONFIG, ScoringConfig, score_report, truth_from_row
from emrl_data.types import Organ


__all__ = [
    "EvaluationResult",
    "Metric",
    "TABLE1_METRICS",
    "TABLE2_METRICS",
    "evaluate",
    "write_evaluation",
    "write_report",
]

logger = logging.getLogger(__name__)

TABLE1_METRICS = ("sen", "sen_le2", "sen_gt2", "spec", "bacc")
TABLE2_METRICS = ("size", "location", "enhancement", "k_hit")
TABLE1_LABELS = {"sen": "Sen", "sen_le2": "Sen ≤2 cm", "sen_gt2": "Sen >2 cm", "spec": "Spec", "bacc": "B-Acc"}
_TABLE1_HEADERS = TABLE1_LABELS | {"sen_le2": "Sen ≤2", "sen_gt2": "Sen >2"}  # markdown: short, the legend says cm
TABLE2_LABELS = {"size": "Size", "location": "Location", "enhancement": "Enhancement", "k_hit": "K-Hit"}
AVERAGE = "average"
SMALL_LESION_MAX_CM = 2.0
_RATIO_METRICS = ("sen", "sen_le2", "sen_gt2", "spec", *TABLE2_METRICS)  # each a sum(num) / sum(den)
_COUNT_KEYS = ("rows", "positives", "negatives", "positives_le2", "positives_gt2")
_MAX_WEIGHTS = 4_000_000  # bootstrap weight-matrix entries per chunk (int64: 32 MB)


@dataclass(frozen=True, slots=True)
class Metric:
    """One cell: a fraction with its bootstrap interval.

    Attributes:
        value: the point estimate in [0, 1]; NaN when the cell has no rows.
        ci_low: lower bound of the 95 % percentile interval (NaN when undefined).
        ci_high: upper bound.
        n: rows the value is computed over (its denominator; for B-Acc positives + negatives).
    """

    value: float
    ci_low: float
    ci_high: float
    n: int

    def to_json(self) -> dict[str, float | int | None]:
        """Return the cell as JSON-safe values (NaN -> None)."""
        return {
            "value": _json_float(self.value),
            "ci_low": _json_float(self.ci_low),
            "ci_high": _json_float(self.ci_high),
            "n": self.n,
        }

    def to_markdown(self) -> str:
        """Return "87.93 [85.10, 90.20]" (percent), or "n/a"."""
        if math.isnan(self.value):
            return "n/a"
        if math.isnan(self.ci_low):
            return f"{100 * self.value:.2f}"
        return f"{100 * self.value:.2f} [{100 * self.ci_low:.2f}, {100 * self.ci_high:.2f}]"

    def value_markdown(self) -> str:
        """Return the point estimate alone: "87.93" (percent), or "n/a"."""
        return "n/a" if math.isnan(self.value) else f"{100 * self.value:.2f}"

    def interval_markdown(self) -> str:
        """Return the 95 % interval as "85.1–90.2" (percent, 1 decimal), or "n/a" when undefined."""
        if math.isnan(self.ci_low) or math.isnan(self.ci_high):
            return "n/a"
        return f"{100 * self.ci_low:.1f}–{100 * self.ci_high:.1f}"


@dataclass(frozen=True, slots=True)
class EvaluationResult:
    """Table 1 and Table 2 of one predictions set.

    Attributes:
        organs: organs present, in `Organ` order.
        table1: organ -> metric (`TABLE1_METRICS`) -> cell.
        average_bacc: B-Acc averaged over organs.
        table2: organ, and "average", -> metric (`TABLE2_METRICS`) -> cell.
        table2_overall: the mean of Table 2's averaged columns.
        counts: organ, and "all", -> {"rows", "positives", "negatives", "positives_le2", "positives_gt2"}.
        n_bootstrap: bootstrap replicates.
        seed: bootstrap seed.
    """

    organs: tuple[str, ...]
    table1: dict[str, dict[str, Metric]]
    average_bacc: Metric
    table2: dict[str, dict[str, Metric]]
    table2_overall: Metric
    counts: dict[str, dict[str, int]]
    n_bootstrap: int
    seed: int

    def to_markdown(self) -> str:
        """Return both tables as markdown that fits the Prefect UI at 1024 px (no column cut off).

        Values (percent, 2 decimals) and their 95 % intervals (1 decimal) are separate tables of at most 7 short
        columns; the definitions behind the short headers are in a legend line at the end.
        """
        t1_head = [_TABLE1_HEADERS[m] for m in TABLE1_METRICS]
        t2_head = [TABLE2_LABELS[m] for m in TABLE2_METRICS]
        t1_blanks = ["" for _ in TABLE1_METRICS[:-1]]
        t1_values = [
            [o, f"{self.counts[o]['positives']} / {self.counts[o]['negatives']}"]
            + [self.table1[o][m].value_markdown() for m in TABLE1_METRICS]
            for o in self.organs
        ] + [[AVERAGE, "", *t1_blanks, self.average_bacc.value_markdown()]]
        t1_ranges = [[o] + [self.table1[o][m].interval_markdown() for m in TABLE1_METRICS] for o in self.organs]
        t1_ranges.append([AVERAGE, *t1_blanks, self.average_bacc.interval_markdown()])
        organs = (*self.organs, AVERAGE)
        t2_values = [
            [o, "" if o == AVERAGE else str(self.counts[o]["positives"])]
            + [self.table2[o][m].value_markdown() for m in TABLE2_METRICS]
            for o in organs
        ]
        t2_ranges = [[o] + [self.table2[o][m].interval_markdown() for m in TABLE2_METRICS] for o in organs]
        bootstrapped = self.n_bootstrap > 0
        lines = [
            "### Table 1: lesion detection (%)",
            "",
            *_markdown_table(["organ", "pos / neg", *t1_head], t1_values),
        ]
        if bootstrapped:
            lines += ["", "#### Table 1: 95 % intervals", "", *_markdown_table(["organ", *t1_head], t1_ranges)]
        lines += [
            "",
            "### Table 2: attribute accuracy (%)",
            "",
            *_markdown_table(["organ", "pos", *t2_head], t2_values),
        ]
        if bootstrapped:
            lines += ["", "#### Table 2: 95 % intervals", "", *_markdown_table(["organ", *t2_head], t2_ranges)]
        overall = self.table2_overall
        interval = f" (95 % interval {overall.interval_markdown()})" if bootstrapped else ""
        lines += ["", f"Table 2 overall (mean of its four averages): **{overall.value_markdown()}**{interval}", ""]
        lines += [_LEGEND, ""]
        lines.append(
            f"Intervals: 95 % percentile bootstrap, {self.n_bootstrap} replicates, rows resampled within organ, "
            f"seed {self.seed}."
            if bootstrapped
            else "No intervals (n_bootstrap=0)."
        )
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        """Return both tables as a JSON-safe dict (fractions; NaN -> None)."""
        return {
            "n_bootstrap": self.n_bootstrap,
            "seed": self.seed,
            "confidence": 0.95,
            "organs": list(self.organs),
            "counts": self.counts,
            "table1": {o: {m: c.to_json() for m, c in cells.items()} for o, cells in self.table1.items()},
            "average_bacc": self.average_bacc.to_json(),
            "table2": {o: {m: c.to_json() for m, c in cells.items()} for o, cells in self.table2.items()},
            "table2_overall": self.table2_overall.to_json(),
        }


_LEGEND = (
    "Values in %. pos / neg: positive / negative rows. Sen ≤2, Sen >2: sensitivity on lesions whose true long axis "
    "is ≤ 2 cm, > 2 cm. B-Acc = (Sen + Spec) / 2. Table 2 is over every true positive: a missed lesion counts as "
    "wrong on every attribute. n/a: no rows of that kind."
)


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Return the lines of a markdown table; a row named `AVERAGE` is printed in bold."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, *cells in rows:
        lines.append("| " + " | ".join([f"**{name}**" if name == AVERAGE else name, *cells]) + " |")
    return lines


def _json_float(value: float) -> float | None:
    """Return None for NaN, else the float."""
    return None if math.isnan(value) else float(value)


def _optional_float(value: Any) -> float | None:
    """Return a float, or None for None/NaN."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


@dataclass(slots=True)
class _OrganArrays:
    """Numerators and denominators of the ratio metrics of one organ, one row per prediction.

    `num` and `den` are `(n_rows, len(_RATIO_METRICS))` float64 arrays of 0/1: row i counts towards metric j's
    denominator when `den[i, j]` is 1, and towards its numerator when `num[i, j]` is 1.
    """

    num: np.ndarray
    den: np.ndarray
    counts: dict[str, int]


def _organ_arrays(rows: Sequence[Mapping[str, Any]]) -> _OrganArrays:
    """Build the 0/1 numerator/denominator arrays of one organ's rows."""
    n = len(rows)
    num = np.zeros((n, len(_RATIO_METRICS)), dtype=np.float64)
    den = np.zeros_like(num)
    col = {name: j for j, name in enumerate(_RATIO_METRICS)}
    for i, row in enumerate(rows):
        positive = bool(row["has_lesion"])
        existence = _optional_float(row.get("score_existence"))
        if existence is None:
            pred = row.get("pred_has_lesion")
            existence = 0.0 if pred is None else float(bool(pred) == positive)
        correct = existence >= 1.0
        if not positive:
            den[i, col["spec"]] = 1.0
            num[i, col["spec"]] = correct
            continue
        den[i, col["sen"]] = 1.0
        num[i, col["sen"]] = correct
        long_mm = _optional_float(row.get("long_axis_mm"))
        if long_mm is not None:
            size_bin = "sen_le2" if round(long_mm / 10.0, 1) <= SMALL_LESION_MAX_CM else "sen_gt2"
            den[i, col[size_bin]] = 1.0
            num[i, col[size_bin]] = correct
        for name in TABLE2_METRICS:
            value = _optional_float(row.get(f"score_{name}"))  # a missed lesion already scores 0 (`score_report`)
            if value is not None:
                den[i, col[name]] = 1.0
                num[i, col[name]] = value >= 1.0
    counts = {
        "rows": n,
        "positives": int(den[:, col["sen"]].sum()),
        "negatives": int(den[:, col["spec"]].sum()),
        "positives_le2": int(den[:, col["sen_le2"]].sum()),
        "positives_gt2": int(den[:, col["sen_gt2"]].sum()),
    }
    return _OrganArrays(num, den, counts)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Return num / den elementwise, NaN where den is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _with_bacc(ratios: np.ndarray) -> np.ndarray:
    """Append B-Acc = (Sen + Spec) / 2 as a last column to `(..., len(_RATIO_METRICS))` ratios."""
    bacc = (ratios[..., _RATIO_METRICS.index("sen")] + ratios[..., _RATIO_METRICS.index("spec")]) / 2.0
    return np.concatenate([ratios, bacc[..., None]], axis=-1)


def _bootstrap_ratios(arrays: _OrganArrays, n_bootstrap: int, rng: np.random.Generator) -> np.ndarray:
    """Return `(n_bootstrap, len(_RATIO_METRICS) + 1)` replicate values (ratios, then B-Acc) of one organ."""
    n = arrays.num.shape[0]
    out = np.empty((n_bootstrap, len(_RATIO_METRICS)), dtype=np.float64)
    chunk = max(1, _MAX_WEIGHTS // max(n, 1))
    probabilities = np.full(n, 1.0 / n)
    for start in range(0, n_bootstrap, chunk):
        size = min(chunk, n_bootstrap - start)
        weights = rng.multinomial(n, probabilities, size=size).astype(np.float64)  # (size, n) resample counts
        out[start : start + size] = _ratio(weights @ arrays.num, weights @ arrays.den)
    return _with_bacc(out)


def _interval(replicates: np.ndarray) -> tuple[float, float]:
    """Return the 2.5 / 97.5 percentiles of the finite replicates, NaN when there are none."""
    finite = replicates[np.isfinite(replicates)]
    if finite.size == 0:
        return math.nan, math.nan
    low, high = np.percentile(finite, [2.5, 97.5])
    return float(low), float(high)


def _mean_over_organs(values: np.ndarray, defined: np.ndarray) -> np.ndarray:
    """Return the NaN-aware mean over axis 0 (organs) of `values`, over the organs where `defined` is True."""
    if not defined.any():
        return np.full(values.shape[1:], np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=RuntimeWarning)  # all-NaN slice -> NaN cell
        return np.nanmean(values[defined], axis=0)


def evaluate(rows: Sequence[Mapping[str, Any]], *, n_bootstrap: int = 1000, seed: int = 0) -> EvaluationResult:
    """Compute Table 1 and Table 2 with bootstrap 95 % intervals.

    Args:
        rows: scored predictions (see the module docstring for the keys).
        n_bootstrap: replicates per interval; 0 gives point estimates with NaN intervals.
        seed: seed of the bootstrap generator.

    Returns:
        The tables.

    Raises:
        ValueError: on an unknown organ or a negative `n_bootstrap`.

    >>> rows = [{"organ": "liver", "has_lesion": True, "long_axis_mm": 15.0, "score_existence": 1.0, "score_size": 1.0,
    ...          "score_location": 0.0, "score_enhancement": 1.0, "score_k_hit": 1.0},
    ...         {"organ": "liver", "has_lesion": False, "long_axis_mm": None, "score_existence": 0.0}]
    >>> r = evaluate(rows, n_bootstrap=0)
    >>> r.table1["liver"]["sen"].value, r.table1["liver"]["spec"].value, r.table1["liver"]["bacc"].value
    (1.0, 0.0, 0.5)
    """
    if n_bootstrap < 0:
        raise ValueError(f"n_bootstrap={n_bootstrap} must be >= 0.")
    est = _estimate(rows, n_bootstrap, seed)
    table1, table2 = _organ_tables(est)
    average_bacc = _averaged(est, table1, table2, "bacc")
    table2[AVERAGE] = {m: _averaged(est, table1, table2, m) for m in TABLE2_METRICS}
    overall = _overall(est, table2[AVERAGE])
    counts = dict(est.counts)
    counts["all"] = {key: sum(est.counts[str(o)][key] for o in est.organs) for key in _COUNT_KEYS}
    logger.info(
        "Evaluated %d rows over %s (%d bootstrap replicates).", len(rows), [str(o) for o in est.organs], n_bootstrap
    )
    return EvaluationResult(
        organs=tuple(str(o) for o in est.organs),
        table1=table1,
        average_bacc=average_bacc,
        table2=table2,
        table2_overall=overall,
        counts=counts,
        n_bootstrap=n_bootstrap,
        seed=seed,
    )


_METRIC_NAMES = (*_RATIO_METRICS, "bacc")  # the columns of `_Estimates.points` and `.replicates`
_METRIC_INDEX = {name: j for j, name in enumerate(_METRIC_NAMES)}


@dataclass(frozen=True, slots=True)
class _Estimates:
    """Per-organ point estimates and bootstrap replicates of every metric, before they become table cells (internal).

    Attributes:
        organs: the organs present, in `Organ` order (the rows of the arrays).
        points: `(organs, len(_METRIC_NAMES))` point estimates, NaN where a metric has no rows.
        replicates: `(organs, n_bootstrap, len(_METRIC_NAMES))` bootstrap values (all NaN when `n_bootstrap` is 0).
        counts: row counts per organ (`_COUNT_KEYS`).
        denominators: per organ, the `(len(_RATIO_METRICS),)` denominators (the `n` of each ratio).
        n_bootstrap: replicates per interval.
    """

    organs: tuple[Organ, ...]
    points: np.ndarray
    replicates: np.ndarray
    counts: dict[str, dict[str, int]]
    denominators: dict[str, np.ndarray]
    n_bootstrap: int


def _estimate(rows: Sequence[Mapping[str, Any]], n_bootstrap: int, seed: int) -> _Estimates:
    """Group the rows by organ and compute each organ's point estimates and bootstrap replicates.

    One generator seeded with `seed` draws every organ's replicates in `Organ` order, so results are reproducible.

    Raises:
        ValueError: on an unknown organ.
    """
    by_organ: dict[Organ, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_organ.setdefault(Organ(row["organ"]), []).append(row)
    organs = tuple(o for o in Organ if o in by_organ)
    rng = np.random.default_rng(seed)
    points = np.full((len(organs), len(_METRIC_NAMES)), np.nan)
    replicates = np.full((len(organs), n_bootstrap, len(_METRIC_NAMES)), np.nan)
    counts: dict[str, dict[str, int]] = {}
    denominators: dict[str, np.ndarray] = {}
    for k, organ in enumerate(organs):
        arrays = _organ_arrays(by_organ[organ])
        counts[str(organ)] = arrays.counts
        denominators[str(organ)] = arrays.den.sum(axis=0)
        points[k] = _with_bacc(_ratio(arrays.num.sum(axis=0), arrays.den.sum(axis=0)))
        if n_bootstrap:
            replicates[k] = _bootstrap_ratios(arrays, n_bootstrap, rng)
    return _Estimates(organs, points, replicates, counts, denominators, n_bootstrap)


def _cell(point: float, reps: np.ndarray, n: int, n_bootstrap: int) -> Metric:
    """Return a table cell: the point value, its 95 % interval (NaN without replicates or value) and its `n`."""
    low, high = _interval(reps) if n_bootstrap and not math.isnan(point) else (math.nan, math.nan)
    return Metric(float(point), low, high, n)


def _organ_tables(est: _Estimates) -> tuple[dict[str, dict[str, Metric]], dict[str, dict[str, Metric]]]:
    """Return Table 1 and Table 2 per organ (no average yet); B-Acc's `n` is Sen's plus Spec's."""
    table1: dict[str, dict[str, Metric]] = {}
    table2: dict[str, dict[str, Metric]] = {}
    for k, organ in enumerate(est.organs):
        den = est.denominators[str(organ)]
        n_of = {name: int(den[_METRIC_INDEX[name]]) for name in _RATIO_METRICS}
        n_of["bacc"] = n_of["sen"] + n_of["spec"]

        def cell(metric: str, k: int = k, n_of: dict[str, int] = n_of) -> Metric:
            j = _METRIC_INDEX[metric]
            return _cell(est.points[k, j], est.replicates[k, :, j], n_of[metric], est.n_bootstrap)

        table1[str(organ)] = {m: cell(m) for m in TABLE1_METRICS}
        table2[str(organ)] = {m: cell(m) for m in TABLE2_METRICS}
    return table1, table2


def _averaged(
    est: _Estimates,
    table1: Mapping[str, Mapping[str, Metric]],
    table2: Mapping[str, Mapping[str, Metric]],
    metric: str,
) -> Metric:
    """Return the mean of `metric` over the organs where it is defined, with the interval of the averaged replicates.

    Its `n` sums the organs' `n` (B-Acc from Table 1, the attributes from Table 2).
    """
    j = _METRIC_INDEX[metric]
    defined = ~np.isnan(est.points[:, j]) if est.organs else np.zeros(0, dtype=bool)
    point = float(_mean_over_organs(est.points[:, j], defined)) if defined.any() else math.nan
    reps = _mean_over_organs(est.replicates[:, :, j], defined) if defined.any() else np.full(est.n_bootstrap, np.nan)
    n = sum(table1[str(o)]["bacc"].n if metric == "bacc" else table2[str(o)][metric].n for o in est.organs)
    return _cell(point, reps, n, est.n_bootstrap)


def _overall(est: _Estimates, average: Mapping[str, Metric]) -> Metric:
    """Return Table 2's overall cell: the mean of the defined per-attribute averages, over the true positives.

    Each replicate averages the attributes' organ means the same way, so the interval matches the point.
    """
    average_values = np.array([average[m].value for m in TABLE2_METRICS])
    if not est.organs or np.isnan(average_values).all():
        return Metric(math.nan, math.nan, math.nan, 0)
    columns = [_METRIC_INDEX[m] for m in TABLE2_METRICS]
    organ_defined = ~np.isnan(est.points[:, columns])  # (organs, 4)
    per_column = np.stack(
        [_mean_over_organs(est.replicates[:, :, j], organ_defined[:, c]) for c, j in enumerate(columns)]
    )  # (4, n_bootstrap)
    overall_reps = _mean_over_organs(per_column, ~np.isnan(average_values))
    n = sum(est.counts[str(o)]["positives"] for o in est.organs)
    return _cell(float(np.nanmean(average_values)), overall_reps, n, est.n_bootstrap)


OUTPUT_FILE_MODE = 0o644
ZERO_BAR_PCT = 1.5  # a 0 % bar is drawn this tall (and labelled "0"), so an all-zero model is not an empty chart
NA_LABEL = "n/a"


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through `emrl_data.atomic_write`, world-readable (mode 0644) like the tables."""
    write_bytes_atomic(data, path)
    path.chmod(OUTPUT_FILE_MODE)


def _draw_bars(ax: Any, x: np.ndarray, width: float, cells: Sequence[Metric], label: str, color: str) -> None:
    """Draw one metric's bars at `x`: value with its 95 % interval; 0 as a short labelled stub; NaN as "n/a"."""
    values = np.array([100 * c.value for c in cells])
    low = np.array([100 * c.ci_low for c in cells])
    high = np.array([100 * c.ci_high for c in cells])
    shown = ~np.isnan(values)
    heights = np.where(values[shown] == 0, ZERO_BAR_PCT, values[shown])
    # Whiskers from the drawn top to the interval ends (none where the interval is undefined).
    errors = np.nan_to_num(np.clip(np.vstack([heights - low[shown], high[shown] - heights]), 0, None))
    ax.bar(x[shown], heights, width, color=color, yerr=errors, capsize=2, label=label)
    for xi, value in zip(x, values, strict=True):
        if math.isnan(value):
            ax.text(xi, 1.5, NA_LABEL, rotation=90, ha="center", va="bottom", fontsize=9, color="dimgray")
        elif value == 0:
            ax.text(xi, ZERO_BAR_PCT + 0.5, "0", ha="center", va="bottom", fontsize=9, color=color)


def _figure(result: EvaluationResult) -> Any:
    """Return the matplotlib `Figure` of `_plot` (two panels: Table 1 and Table 2)."""
    figure = Figure(figsize=(12, 4.8), dpi=100, layout="constrained")
    axes = figure.subplots(1, 2)
    panels = (
        ("Table 1: detection", result.organs, result.table1, TABLE1_METRICS, TABLE1_LABELS),
        (
            "Table 2: attributes over true positives",
            (*result.organs, AVERAGE),
            result.table2,
            TABLE2_METRICS,
            TABLE2_LABELS,
        ),
    )
    for ax, (title, groups, table, metrics, labels) in zip(axes, panels, strict=True):
        width = 0.8 / len(metrics)
        x = np.arange(len(groups))
        for j, metric in enumerate(metrics):
            offsets = x + (j - (len(metrics) - 1) / 2) * width
            _draw_bars(ax, offsets, width, [table[g][metric] for g in groups], labels[metric], f"C{j}")
        ax.set_xticks(x, [str(g) for g in groups])
        ax.set_ylim(0, 105)
        ax.set_ylabel("%")
        ax.set_title(title)
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.08), ncols=len(metrics), frameon=False)
    average = result.average_bacc.value
    average_text = NA_LABEL if math.isnan(average) else f"{100 * average:.2f} %"
    axes[0].set_title(f"Table 1: detection (average B-Acc {average_text})")
    return figure


def _plot(result: EvaluationResult) -> bytes:
    """Return a PNG with Table 1 and Table 2 as grouped bars per organ, with 95 % interval whiskers.

    Every cell is visible: a value of 0 is a short stub labelled "0" (an all-zero model is not an empty chart), and an
    undefined cell (NaN: no rows of its kind) is written "n/a" in its slot, never left as a silent gap.
    """
    buffer = io.BytesIO()
    _figure(result).savefig(buffer, format="png")
    return buffer.getvalue()


def write_evaluation(
    result: EvaluationResult,
    out_dir: str | Path,
    *,
    model: str | None = None,
    card: Mapping[str, Any] | None = None,
    appendix: str = "",
) -> dict[str, Path]:
    """Write `metrics.md`, `metrics.json` and `metrics.png` into `out_dir` (created if missing), atomically.

    Args:
        result: the tables.
        out_dir: the folder.
        model: the evaluated model's name (the `model` column of the predictions): a "# Model: NAME" line above the
            tables and a "model" key in the JSON; None writes neither.
        card: the results card's keys (`emrl_data.text.results_card.make_card`), added to the JSON.
        appendix: markdown added after the tables (the text metrics).

    Returns:
        {"markdown": path, "json": path, "plot": path}.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "metrics.md", "json": out / "metrics.json", "plot": out / "metrics.png"}
    heading = f"# Model: {model}\n\n" if model is not None else ""
    as_json = {"model": model, **result.to_json()} if model is not None else result.to_json()
    as_json |= dict(card or {})
    write_report(out, heading + result.to_markdown() + (f"\n{appendix}" if appendix else ""), as_json)
    _write_atomic(paths["plot"], _plot(result))
    logger.info("Wrote %s", ", ".join(str(p) for p in paths.values()))
    return paths


def write_report(out_dir: str | Path, markdown: str, as_json: Mapping[str, Any]) -> dict[str, Path]:
    """Write `metrics.md` and `metrics.json` (no NaN: JSON null) into `out_dir` (created if missing), atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "metrics.md", "json": out / "metrics.json"}
    _write_atomic(paths["markdown"], markdown.encode())
    _write_atomic(paths["json"], (json.dumps(as_json, indent=2, allow_nan=False) + "\n").encode())
    return paths


def score_predictions(
    rows: Sequence[Mapping[str, Any]], *, text_column: str = "prediction", cfg: ScoringConfig | None = None
) -> list[dict[str, Any]]:
    """Score raw predictions: each row holds the truth columns of the `sft` table and the model's report text.

    Rows that already carry scores (a `score_existence` key: a `predictions` table written by `build-rl-hardset`) are
    read as they are, not scored again. Rows whose inference failed (a non-null `inference_error`) have no report
    to score and are left out, as the flow's own metrics leave them out: they are not parse failures.

    Returns:
        Rows ready for `evaluate`: organ, has_lesion, long_axis_mm and the `ReportScore` fields (and case_id and
        split when the input has them: `paired_differences` matches rows by case and organ).
    """
    scored = []
    failed = 0
    for row in rows:
        if row.get("inference_error") is not None:
            failed += 1
            continue
        if "score_existence" in row:
            scored.append(dict(row))
            continue
        if text_column not in row:
            raise ValueError(f"A prediction row has neither scores nor a {text_column!r} column: {sorted(row)}.")
        score = score_report(row[text_column] or "", truth_from_row(row), cfg=cfg or DEFAULT_CONFIG)
        key = {name: row[name] for name in ("case_id", "split") if name in row}  # pairs rows across models
        scored.append(
            key
            | {"organ": row["organ"], "has_lesion": row["has_lesion"], "long_axis_mm": row["long_axis_mm"]}
            | score.to_row()
        )
    if failed:
        logger.warning("%d prediction row(s) without a report (failed inference) left out of the evaluation", failed)
    return scored
