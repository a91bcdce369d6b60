"""The RL hard set: which SFT train rows the SFT model gets wrong (docs/contract.md#what-the-pipeline-does), and the `build-rl-hardset` run.

The selection follows the paper's rule: a row is hard when the SFT model's report has the wrong existence, any wrong
attribute (size, location, enhancement) or misses the key slice (K-Hit) — `emrl_data.text.scoring.is_hard`, so "hard" is by construction "low reward
under the GRPO reward". Hard rows are ranked by R ascending (hardest first; ties by case id) and the set is
stratified by organ: each organ gets a share of `target_size` proportional to its number of hard rows (largest
remainder), so the hard set keeps the organ mix of the mistakes instead of being filled by the worst organ alone.

Also the `build-rl-hardset` run without its orchestration (`flows.build_rl_hardset` keeps inference, progress,
artifacts and the failure threshold): `collect_predictions` scores every predicted row once into the `predictions`
table, `hard_set_rows` joins the chosen rows to their frames, `write_split_metrics` writes Table 1/2 of the SFT model
per split (computed once, in memory) and `build_summary` / `summary_markdown` describe the run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emrl_data.atomic_write import write_json_atomic, write_text_atomic
from emrl_data.config import HARD_SET_SIZE
from emrl_data.tables.records import PREDICTION_TRUTH_COLUMNS, check_required
from emrl_data.tables.table_folder import count_rows, finish_table, row_order, write_split, write_table
from emrl_data.text.evaluation import EvaluationResult, evaluate, write_evaluation
from emrl_data.text.scoring import ReportScore, is_hard, score_report, truth_from_row
from emrl_data.types import Organ, row_id


SPLITS = ("train", "test")
"""The SFT splits the SFT model is run on; hard rows come from `train` only."""


@dataclass(frozen=True, slots=True)
class HardRow:
    """A selected row: its key, why it was chosen, its rank within its organ (1 = hardest) and its reward."""

    case_id: str
    organ: str
    reasons: tuple[str, ...]
    rank: int
    reward: float


def organ_quotas(hard_counts: Mapping[str, int], target_size: int) -> dict[str, int]:
    """Split `target_size` across organs in proportion to their hard rows (largest remainder, ties by organ order).

    >>> organ_quotas({"liver": 30, "pancreas": 10, "kidney": 0}, 8)
    {'liver': 6, 'pancreas': 2, 'kidney': 0}
    """
    if target_size < 0:
        raise ValueError(f"target_size={target_size} must be >= 0.")
    total = sum(hard_counts.values())
    if total <= target_size:
        return dict(hard_counts)
    exact = {organ: target_size * n / total for organ, n in hard_counts.items()}
    quotas = {organ: int(v) for organ, v in exact.items()}
    order = [str(o) for o in Organ]
    leftovers = sorted(hard_counts, key=lambda o: (-(exact[o] - quotas[o]), order.index(o) if o in order else 99))
    for organ in leftovers[: target_size - sum(quotas.values())]:
        quotas[organ] += 1
    return quotas


def select_hard_rows(
    candidates: Sequence[tuple[Mapping[str, Any], ReportScore]], *, target_size: int = HARD_SET_SIZE
) -> list[HardRow]:
    """Select at most `target_size` hard rows, stratified by organ, hardest (lowest R) first within each organ.

    Args:
        candidates: (row, score) pairs; a row needs `case_id` and `organ`.
        target_size: the cap (the paper's hard set has about 2K rows).

    Returns:
        The chosen rows in (organ, rank) order.
    """
    by_organ: dict[str, list[tuple[float, str, tuple[str, ...]]]] = {}
    for row, score in candidates:
        hard, reasons = is_hard(score)
        if hard:
            by_organ.setdefault(str(row["organ"]), []).append((score.reward, str(row["case_id"]), reasons))
    quotas = organ_quotas({o: len(v) for o, v in by_organ.items()}, target_size)
    chosen: list[HardRow] = []
    for organ in sorted(by_organ, key=lambda o: [str(x) for x in Organ].index(o)):
        ranked = sorted(by_organ[organ])
        for rank, (reward, case_id, reasons) in enumerate(ranked[: quotas[organ]], start=1):
            chosen.append(HardRow(case_id, organ, reasons, rank, reward))
    return chosen


def prediction_row(
    truth_row: Mapping[str, Any], result: Mapping[str, Any], model: str
) -> tuple[dict[str, Any], ReportScore | None]:
    """Return a `predictions` row and its score.

    The row holds the truth columns, the model's text, the scorer's columns under their own names and whether the row
    is hard (with why); a failed inference has no report, so it is not scored (its score columns stay null, score None).

    Args:
        truth_row: an `sft` row (at least `PREDICTION_TRUTH_COLUMNS`).
        result: the inference result, `{"text": str | None, "error": str | None}`.
        model: the checkpoint path or endpoint model name.
    """
    row = {c: truth_row[c] for c in PREDICTION_TRUTH_COLUMNS}
    row |= {"prediction": result["text"], "inference_error": result["error"], "model": model}
    if result["error"] is not None:
        return row, None
    score = score_report(result["text"] or "", truth_from_row(truth_row))
    hard, reasons = is_hard(score)
    return row | score.to_row() | {"hard": hard, "hard_reasons": list(reasons)}, score


@dataclass(slots=True)
class CollectedPredictions:
    """Every predicted row of a run, scored once.

    Attributes:
        predictions: the `predictions` rows, in the order the SFT rows were read.
        scored: per split, the (prediction row, score) pairs of the rows whose inference succeeded.
        frame_bytes: the total frame bytes of each predicted row, by `row_id` (shard sizing of the hard set).
    """

    predictions: list[dict[str, Any]] = field(default_factory=list)
    scored: dict[str, list[tuple[dict[str, Any], ReportScore]]] = field(default_factory=dict)
    frame_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def failed(self) -> list[dict[str, Any]]:
        """The prediction rows whose inference failed (not scored)."""
        return [p for p in self.predictions if p["inference_error"] is not None]


def collect_predictions(
    rows_by_split: Mapping[str, Iterable[Mapping[str, Any]]], results: Mapping[str, Mapping[str, Any]], model: str
) -> CollectedPredictions:
    """Score every SFT row that has an inference result; rows without one (beyond a `limit`) are left out.

    Args:
        rows_by_split: per split, the `sft` rows (`PREDICTION_TRUTH_COLUMNS` and `frames`), streamed.
        results: inference results by `row_id` (`{"text", "error"}`).
        model: the checkpoint path or endpoint model name written into each row.
    """
    collected = CollectedPredictions()
    for split, rows in rows_by_split.items():
        collected.scored[split] = []
        for row in rows:
            rid = row_id(row["case_id"], row["organ"])
            if rid not in results:
                continue
            collected.frame_bytes[rid] = sum(len(f["bytes"]) for f in row["frames"])
            prediction, score = prediction_row(row, results[rid], model)
            collected.predictions.append(prediction)
            if score is not None:
                collected.scored[split].append((prediction, score))
    return collected


def chosen_light_rows(
    scored_train: Iterable[tuple[Mapping[str, Any], ReportScore]], chosen: Iterable[HardRow]
) -> list[Mapping[str, Any]]:
    """Return the prediction rows of the chosen hard rows, in row order (the order of the `rl_hardset` shard)."""
    chosen_ids = {row_id(h.case_id, h.organ) for h in chosen}
    rows = [r for r, _ in scored_train if row_id(r["case_id"], r["organ"]) in chosen_ids]
    return sorted(rows, key=row_order)


def hard_set_rows(
    sft_train_rows: Iterable[Mapping[str, Any]],
    chosen: Iterable[HardRow],
    predictions: Iterable[Mapping[str, Any]],
) -> Iterator[dict[str, Any]]:
    """Yield the `rl_hardset` rows: each chosen SFT train row (frames included) with why, rank, prediction and reward.

    Args:
        sft_train_rows: the full `sft` train rows, streamed in shard order (= row order).
        chosen: the selected hard rows (`select_hard_rows`).
        predictions: the `predictions` rows (for the SFT model's text).

    Raises:
        ValueError: a row misses a required `rl_hardset` column.
    """
    chosen_by_id = {row_id(h.case_id, h.organ): h for h in chosen}
    prediction_by_id = {row_id(p["case_id"], p["organ"]): p for p in predictions}
    for row in sft_train_rows:
        rid = row_id(row["case_id"], row["organ"])
        if rid in chosen_by_id:
            h = chosen_by_id[rid]
            full = dict(row) | {
                "hard_reasons": list(h.reasons),
                "hard_rank": h.rank,
                "sft_prediction": prediction_by_id[rid]["prediction"],
                "sft_reward": h.reward,
            }
            check_required("rl_hardset", full)
            yield full


def write_split_metrics(
    scored: Mapping[str, Sequence[tuple[Mapping[str, Any], ReportScore]]], out_dir: Path, *, n_bootstrap: int
) -> str:
    """Evaluate the SFT model on each split that has scored rows and write the metrics under `out_dir`.

    Writes `metrics_<split>/` (`write_evaluation`), `metrics.md` (the splits' tables) and `metrics.json` (the
    splits' `to_json()` by split), each computed once, in memory.

    Returns:
        The markdown of the splits' tables ("" when no split has a scored row).
    """
    results: dict[str, EvaluationResult] = {
        split: evaluate([r for r, _ in scored[split]], n_bootstrap=n_bootstrap) for split in SPLITS if scored[split]
    }
    for split, result in results.items():
        write_evaluation(result, out_dir / f"metrics_{split}")
    text = "\n\n".join(f"## SFT model on the {s} split\n\n{r.to_markdown()}" for s, r in results.items())
    write_text_atomic(text + "\n", out_dir / "metrics.md")
    # The same values as `metrics_<split>/metrics.json` (that file is `to_json()` through a strict JSON round trip).
    write_json_atomic(
        {s: json.loads(json.dumps(r.to_json(), allow_nan=False)) for s, r in results.items()}, out_dir / "metrics.json"
    )
    return text


def write_hardset_tables(
    out: Path,
    sft_train_rows: Iterable[Mapping[str, Any]],
    collected: CollectedPredictions,
    chosen: Sequence[HardRow],
    *,
    provenance: Mapping[str, Any],
    n_bootstrap: int,
) -> str:
    """Write the `predictions` table, the `rl_hardset` table (frames streamed) and the SFT model's metrics under `out`.

    Args:
        out: the output root (`predictions/`, `rl_hardset/`).
        sft_train_rows: the full `sft` train rows (frames included), streamed in shard order.
        collected: the scored predictions; chosen: the selected hard rows.
        provenance: written into each table's manifest and card.
        n_bootstrap: bootstrap replicates of the metric intervals.

    Returns:
        The metrics markdown (`write_split_metrics`), also in the `rl_hardset` card.
    """
    predictions = sorted(collected.predictions, key=row_order)
    by_split = {s: [p for p in predictions if p["split"] == s] for s in SPLITS}
    write_table("predictions", by_split, out, provenance=provenance)
    hard_rows_light = chosen_light_rows(collected.scored["train"], chosen)
    write_split(
        "rl_hardset",
        "train",
        hard_set_rows(sft_train_rows, chosen, predictions),
        [collected.frame_bytes[row_id(r["case_id"], r["organ"])] for r in hard_rows_light],
        out,
    )
    metrics_text = write_split_metrics(collected.scored, out / "rl_hardset", n_bootstrap=n_bootstrap)
    counts = {"train": count_rows(hard_rows_light).get("train", {"total": 0})}
    finish_table("rl_hardset", out, provenance=provenance, counts=counts, metrics_markdown=metrics_text or None)
    return metrics_text


def reason_counts(chosen: Iterable[HardRow]) -> dict[str, int]:
    """Return how many chosen rows carry each hard reason, sorted by reason."""
    counts: dict[str, int] = {}
    for h in chosen:
        for reason in h.reasons:
            counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items()))


def build_summary(
    *,
    provenance: Mapping[str, Any],
    collected: CollectedPredictions,
    chosen: Sequence[HardRow],
    out: Path,
    elapsed_s: float,
    inference: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return the run summary (`rl_hardset/summary.json`): provenance, prediction and hard-set counts, timing.

    Args:
        provenance: the run's provenance (model, SFT folder, cap, versions).
        collected: the scored predictions.
        chosen: the selected hard rows.
        out: the output root.
        elapsed_s: seconds since the start of the run.
        inference: what the prediction step reports: `retried_errors` (rows an earlier run stored as errors, sent
            again), `kept_errors` (True when such rows were kept as they are) and `other_model_answers` (answers that
            named another model than the one asked for, by name: a note, not an error).
    """
    train = collected.scored.get("train", [])
    return {
        **provenance,
        "predictions": len(collected.predictions),
        "failed_predictions": len(collected.failed),
        "retried_errors": 0,
        "kept_errors": False,
        "other_model_answers": {},
        **(inference or {}),
        "hard_in_train": sum(is_hard(s)[0] for _, s in train),
        "train_rows_scored": len(train),
        "rl_hardset_rows": len(chosen),
        "rl_hardset_by_organ": {str(o): sum(h.organ == o for h in chosen) for o in Organ},
        "reasons": reason_counts(chosen),
        "seconds": round(elapsed_s, 2),
        "tables": {"predictions": str(out / "predictions"), "rl_hardset": str(out / "rl_hardset")},
    }


def _other_model_note(counts: Mapping[str, int], model: str) -> list[str]:
    """The summary line on answers that named another model (hosted APIs answer with dated names), or none."""
    if not counts:
        return []
    names = ", ".join(f"`{name}` ({n})" for name, n in list(counts.items())[:5])
    more = f" and {len(counts) - 5} more" if len(counts) > 5 else ""
    return [f"- note: {sum(counts.values())} answer(s) named another model than asked ({model}): {names}{more}"]


def summary_markdown(summary: Mapping[str, Any], metrics: str) -> str:
    """Return `rl_hardset/summary.md`: model, prediction counts, the hard set by organ and reason, outputs, metrics."""
    lines = [
        "# build-rl-hardset",
        "",
        f"- model: `{summary['model']}`",
        f"- predictions: **{summary['predictions']}** ({summary['failed_predictions']} failed"
        + (f"; {n} stored as errors by an earlier run, sent again" if (n := summary.get("retried_errors")) else "")
        + ("; errors of earlier runs kept as they are (keep-errors)" if summary.get("kept_errors") else "")
        + ")",
        *_other_model_note(summary.get("other_model_answers") or {}, summary["model"]),
        f"- hard train rows: {summary['hard_in_train']} of {summary['train_rows_scored']}; "
        f"chosen: **{summary['rl_hardset_rows']}** (cap {summary['target_size']}) "
        + ", ".join(f"{o} {n}" for o, n in summary["rl_hardset_by_organ"].items()),
        "- reasons: " + (", ".join(f"{k} {v}" for k, v in summary["reasons"].items()) or "none"),
        f"- took {summary['seconds']} s",
        "",
        "Outputs:",
        "",
        *(f"- `{name}`: {path}" for name, path in summary["tables"].items()),
        "",
        metrics,
    ]
    return "\n".join(lines) + "\n"
