"""Text-overlap metrics of generated reports against the gold reports, per section, per organ and overall.

The findings and the impression are compared separately (sections read as the parser reads them,
`emrl_data.text.parser`): a model that copies a negative template scores well on text while saying nothing about a
lesion, so these numbers come after the clinical tables (docs/data.md#evaluation).

* BLEU-1..4: corpus BLEU over the rows (`sacrebleu`, 13a tokenizer, lower-cased, its default exponential smoothing);
  BLEU-n uses the n-gram orders 1..n, as captioning papers report it.
* ROUGE-L: the mean over rows of the longest-common-subsequence F-measure (`rouge-score`, no stemming).
* CIDEr-D: the consensus metric of Vedantam et al. (CVPR 2015) as coco-caption computes it (n = 1..4, tf-idf n-gram
  vectors with the idf from the references of all evaluated rows, the candidate's counts clipped at the
  reference's, a Gaussian length penalty with sigma 6, times 10), written here in a few lines: the one package that
  ships it (`pycocoevalcap`) bundles Java jars for its other metrics. Tokens: lower-cased runs of letters and
  digits, a decimal number kept whole ("3.1").

Every metric is a function of per-row sums (BLEU's n-gram counts and lengths, the per-row ROUGE-L and CIDEr-D), so
the 95 % intervals resample the rows within each organ once per replicate for every cell
(`emrl_data.text.bootstrap.resampled_sums`), as the clinical tables do. Values are fractions (BLEU and ROUGE-L in
[0, 1]; CIDEr-D in [0, 10]).
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rouge_score.rouge_scorer import RougeScorer
from sacrebleu.metrics import BLEU

from emrl_data.text.bootstrap import interval, resampled_sums
from emrl_data.text.comparison import pair_rows
from emrl_data.text.evaluation import _json_float, _markdown_table
from emrl_data.text.parser import _header_sections, _tagged_sections
from emrl_data.types import Organ


__all__ = [
    "SECTIONS",
    "TEXT_METRICS",
    "TextMetrics",
    "cider_d",
    "paired_text_differences",
    "report_sections",
    "text_metrics",
]

logger = logging.getLogger(__name__)

SECTIONS = ("findings", "impression")
TEXT_METRICS = ("bleu1", "bleu2", "bleu3", "bleu4", "rouge_l", "cider_d")
TEXT_LABELS = {
    "bleu1": "BLEU-1",
    "bleu2": "BLEU-2",
    "bleu3": "BLEU-3",
    "bleu4": "BLEU-4",
    "rouge_l": "ROUGE-L",
    "cider_d": "CIDEr-D",
}
OVERALL = "all"
CIDER_SIGMA = 6.0
_BLEU_STATS = 10  # sacrebleu's per-row statistics: hypothesis and reference length, correct 1..4, total 1..4
_COLUMNS = _BLEU_STATS + 2  # + ROUGE-L F, CIDEr-D
_TOKEN_RE = re.compile(r"[a-z0-9]+(?:\.[0-9]+)?")


def report_sections(text: str | None) -> tuple[str, str]:
    """Return (findings, impression) of a report, lower-cased, "" for a section it lacks.

    Tags first (`<findings>`, `<impression>`), else the `FINDINGS:` / `IMPRESSION:` headers of real reports; the
    evidence part ("The key lesion is in image ...") is not in either.

    >>> report_sections("<findings>A 3.1 cm lesion.</findings> || <impression>Liver mass.</impression> || The key")
    ('a 3.1 cm lesion.', 'liver mass.')
    """
    lower = (text or "").lower()
    findings, impression = _tagged_sections(lower)
    if findings is None and impression is None:
        findings, impression = _header_sections(lower)
    return " ".join((findings or "").split()), " ".join((impression or "").split())


def _tokens(text: str) -> list[str]:
    return _TOKEN_RE.findall(text.lower())


def _ngram_counts(tokens: Sequence[str]) -> list[Counter[tuple[str, ...]]]:
    return [Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)) for n in range(1, 5)]


def cider_d(candidates: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """Return each row's CIDEr-D of its candidate against its one reference, the idf taken over all `references`.

    >>> cider_d(["a b", "c x"], ["a b", "c d"]).round(6).tolist()
    [5.0, 1.25]
    """
    cand = [_ngram_counts(_tokens(c)) for c in candidates]
    refs = [_ngram_counts(_tokens(r)) for r in references]
    document_frequency: Counter[tuple[str, ...]] = Counter()
    for counts in refs:
        for order in counts:
            document_frequency.update(order.keys())
    log_rows = math.log(max(1.0, len(references)))

    def vectors(counts: list[Counter[tuple[str, ...]]]) -> tuple[list[dict[tuple[str, ...], float]], list[float]]:
        vecs = [{g: c * (log_rows - math.log(max(1.0, document_frequency[g]))) for g, c in o.items()} for o in counts]
        return vecs, [math.sqrt(sum(v * v for v in vec.values())) for vec in vecs]

    scores = np.zeros(len(candidates))
    for i, (c, r) in enumerate(zip(cand, refs, strict=True)):
        (vc, nc), (vr, nr) = vectors(c), vectors(r)
        delta = sum(c[0].values()) - sum(r[0].values())
        penalty = math.exp(-(delta**2) / (2 * CIDER_SIGMA**2))
        sims = [
            sum(min(v, vr[n].get(g, 0.0)) * vr[n].get(g, 0.0) for g, v in vc[n].items()) / (nc[n] * nr[n]) * penalty
            if nc[n] and nr[n]
            else 0.0
            for n in range(4)
        ]
        scores[i] = 10.0 * sum(sims) / 4
    return scores


def _row_statistics(candidates: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """Return `(rows, _COLUMNS)` per-row statistics of one section: BLEU's counts, ROUGE-L F, CIDEr-D."""
    bleu = np.asarray(BLEU(lowercase=True)._extract_corpus_statistics(list(candidates), [list(references)]), float)
    scorer = RougeScorer(["rougeL"], use_stemmer=False)
    rouge = [scorer.score(r, c)["rougeL"].fmeasure for c, r in zip(candidates, references, strict=True)]
    return np.column_stack([bleu.reshape(len(candidates), _BLEU_STATS), rouge, cider_d(candidates, references)])


def _bleu(stats: np.ndarray, order: int) -> np.ndarray:
    """Return corpus BLEU-`order` (fractions) of `(..., _BLEU_STATS)` summed statistics, as sacrebleu's
    `BLEU.compute_bleu` computes it with exponential smoothing (an order without a match counts 1 / (2^k x total) for
    its k-th such order; an order without n-grams scores 0), for every replicate at once."""
    sys_len, ref_len = stats[..., 0], stats[..., 1]
    correct, total = stats[..., 2 : 2 + order], stats[..., 6 : 6 + order]
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = 2.0 ** np.cumsum(correct == 0, axis=-1)
        precision = np.where(correct == 0, 1.0 / (smooth * total), correct / total)
        precision = np.where(total > 0, precision, 0.0)
        brevity = np.where(sys_len >= ref_len, 1.0, np.exp(1.0 - ref_len / np.where(sys_len > 0, sys_len, 1.0)))
        score = np.where(sys_len > 0, brevity, 0.0) * np.exp(np.log(precision).mean(axis=-1))
    return np.where((correct > 0).any(axis=-1), score, 0.0)


def _metrics_of(sums: np.ndarray, n_rows: int) -> np.ndarray:
    """Return the `TEXT_METRICS` values `(..., 6)` of summed per-row statistics `(..., _COLUMNS)` over `n_rows` rows."""
    bleu = [_bleu(sums, order) for order in (1, 2, 3, 4)]
    return np.stack([*bleu, sums[..., _BLEU_STATS] / n_rows, sums[..., _BLEU_STATS + 1] / n_rows], axis=-1)


@dataclass(frozen=True, slots=True)
class TextMetrics:
    """Text metrics of one model: section -> organ (and "all") -> metric -> (value, ci_low, ci_high).

    Attributes:
        cells: the values, fractions (CIDEr-D on its 0-10 scale); NaN intervals without replicates.
        counts: organ (and "all") -> rows.
        n_bootstrap, seed: the bootstrap's replicates and seed.
        title: for paired differences, "model − reference" (the cells are then differences); "" for one model.
    """

    cells: dict[str, dict[str, dict[str, tuple[float, float, float]]]]
    counts: dict[str, int]
    n_bootstrap: int
    seed: int
    title: str = ""

    def to_json(self) -> dict[str, Any]:
        """Return the metrics as a JSON-safe dict (NaN -> None)."""
        return {
            **({"difference": self.title} if self.title else {}),
            "n_bootstrap": self.n_bootstrap,
            "seed": self.seed,
            "counts": self.counts,
            "sections": {
                section: {
                    organ: {
                        m: dict(zip(("value", "ci_low", "ci_high"), map(_json_float, v), strict=True))
                        for m, v in metrics.items()
                    }
                    for organ, metrics in organs.items()
                }
                for section, organs in self.cells.items()
            },
        }

    def to_markdown(self) -> str:
        """Return one table per section (BLEU and ROUGE-L in %, CIDEr-D as is), intervals beside the values."""

        def text(cell: tuple[float, float, float], metric: str) -> str:
            scale, digits = (1.0, 3) if metric == "cider_d" else (100.0, 1)
            value, low, high = (scale * v for v in cell)
            sign = "+" if self.title else ""
            if math.isnan(low):
                return f"{value:{sign}.{digits}f}"
            return f"{value:{sign}.{digits}f} [{low:{sign}.{digits}f}, {high:{sign}.{digits}f}]"

        lines = []
        for section, organs in self.cells.items():
            rows = [
                [o, str(self.counts[o])] + [text(cells[m], m) for m in TEXT_METRICS] for o, cells in organs.items()
            ]
            lines += [
                f"#### Text metrics, {section}" + (f": {self.title}" if self.title else ""),
                "",
                *_markdown_table(["organ", "rows", *(TEXT_LABELS[m] for m in TEXT_METRICS)], rows),
                "",
            ]
        bootstrapped = f"{self.n_bootstrap} replicates, rows resampled within organ" if self.n_bootstrap else "none"
        lines.append(f"BLEU and ROUGE-L in %, CIDEr-D on its 0-10 scale; 95 % intervals: {bootstrapped}.")
        return "\n".join(lines) + "\n"


def gold_sections(row: Mapping[str, Any]) -> tuple[str, str]:
    """Return the gold (findings, impression) of a row: its `findings` and `impression` columns (the sft table's),
    else the sections of its `report` column.

    Raises:
        ValueError: on a row with neither.
    """
    if row.get("findings") is not None and row.get("impression") is not None:
        return " ".join(str(row["findings"]).lower().split()), " ".join(str(row["impression"]).lower().split())
    if row.get("report") is not None:
        return report_sections(row["report"])
    raise ValueError(
        "text metrics need the gold report: a row has neither findings and impression nor a report column "
        f"(columns: {sorted(row)})"
    )


def text_metrics(
    rows: Sequence[Mapping[str, Any]], *, text_column: str = "prediction", n_bootstrap: int = 1000, seed: int = 0
) -> TextMetrics:
    """Compute BLEU-1..4, ROUGE-L and CIDEr-D of the findings and of the impression, per organ and over all rows.

    Args:
        rows: rows with `organ`, the model's report in `text_column` and the gold report (`gold_sections`).
        text_column: the column holding the model's report.
        n_bootstrap: replicates (0: no intervals).
        seed: the bootstrap's seed.

    Raises:
        ValueError: on no row, a row without its gold report, or an unknown organ.
    """
    cells, counts = _text_cells([rows], text_column, n_bootstrap, seed)
    return TextMetrics(cells, counts, n_bootstrap, seed)


def paired_text_differences(
    reference: Sequence[Mapping[str, Any]],
    model: Sequence[Mapping[str, Any]],
    *,
    names: tuple[str, str] = ("reference", "model"),
    text_column: str = "prediction",
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> TextMetrics:
    """Return each text metric's difference `model - reference` on the rows both answered (matched by case and
    organ), with paired intervals: every replicate draws the same rows for both models.

    Raises:
        ValueError: on rows that cannot be paired (`emrl_data.text.comparison.pair_rows`) or no row in common.
    """
    ref_rows, mod_rows, _, _ = pair_rows(reference, model)
    if not ref_rows:
        raise ValueError(f"{names[0]} and {names[1]} have no row in common (matched by case_id and organ)")
    cells, counts = _text_cells([ref_rows, mod_rows], text_column, n_bootstrap, seed)
    return TextMetrics(cells, counts, n_bootstrap, seed, title=f"{names[1]} − {names[0]}")


def _text_cells(
    row_sets: Sequence[Sequence[Mapping[str, Any]]], text_column: str, n_bootstrap: int, seed: int
) -> tuple[dict[str, dict[str, dict[str, tuple[float, float, float]]]], dict[str, int]]:
    """Return the cells of one model (one row set), or of the difference of two row sets paired row by row (the
    second minus the first), and the row counts."""
    rows = row_sets[0]
    if not rows:
        raise ValueError("text metrics: no row to evaluate")
    organs = tuple(o for o in Organ if any(Organ(r["organ"]) == o for r in rows))
    order = [i for o in organs for i, r in enumerate(rows) if Organ(r["organ"]) == o]
    sizes = [sum(1 for r in rows if Organ(r["organ"]) == o) for o in organs]
    per_set = []
    for row_set in row_sets:
        ordered = [row_set[i] for i in order]
        candidates = [report_sections(r.get(text_column)) for r in ordered]
        gold = [gold_sections(r) for r in ordered]
        per_set += [_row_statistics([c[s] for c in candidates], [g[s] for g in gold]) for s in range(len(SECTIONS))]
    stats = np.hstack(per_set)  # (rows, sets x sections x _COLUMNS)
    bounds = np.cumsum([0, *sizes])
    groups = [stats[bounds[k] : bounds[k + 1]] for k in range(len(organs))]
    reps = resampled_sums(groups, n_bootstrap=n_bootstrap, seed=seed) if n_bootstrap else None
    width = len(SECTIONS) * _COLUMNS

    def values(sums: np.ndarray, section: int, n: int) -> np.ndarray:
        starts = [i * width + section * _COLUMNS for i in range(len(row_sets))]
        of_set = [_metrics_of(sums[..., start : start + _COLUMNS], n) for start in starts]
        return of_set[0] if len(of_set) == 1 else of_set[1] - of_set[0]

    cells: dict[str, dict[str, dict[str, tuple[float, float, float]]]] = {s: {} for s in SECTIONS}
    names = [*(str(o) for o in organs), OVERALL]
    for k, name in enumerate(names):
        point_sums = stats.sum(axis=0) if name == OVERALL else groups[k].sum(axis=0)
        n = len(order) if name == OVERALL else sizes[k]
        rep_sums = None if reps is None else (np.sum(reps, axis=0) if name == OVERALL else reps[k])
        for s, section in enumerate(SECTIONS):
            point = values(point_sums, s, n)
            if rep_sums is None:
                bounds_of = [(math.nan, math.nan)] * len(TEXT_METRICS)
            else:
                replicate_values = values(rep_sums, s, n)
                bounds_of = [interval(replicate_values[:, j]) for j in range(len(TEXT_METRICS))]
            cells[section][name] = {m: (float(point[j]), *bounds_of[j]) for j, m in enumerate(TEXT_METRICS)}
    counts = {str(o): sizes[k] for k, o in enumerate(organs)} | {OVERALL: len(order)}
    logger.info("Text metrics over %d rows (%d bootstrap replicates).", len(order), n_bootstrap)
    return cells, counts
