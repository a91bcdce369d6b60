"""The results card of an evaluation: what was evaluated, on which rows, by which parser, and every number.

`metrics.json` of `emrl eval` is a card: the models' names, the split, the parser version, the dataset version (the
sha256 of the `sft` table's `manifest.json`, which lists the digest of every shard, when the predictions' own manifest
names a readable `sft_dir`), a digest of the evaluated rows (their ids and truth), the tables, the paired differences
and the text metrics. Two cards are comparable only when they were made on the same rows of the same dataset with
the same parser and split: `check_comparable` refuses anything else in one error.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from emrl_data.types import row_id


__all__ = [
    "CARD_VERSION",
    "PARSER_VERSION",
    "CardMismatch",
    "check_comparable",
    "dataset_source",
    "dataset_version",
    "headline",
    "make_card",
    "read_card",
    "rows_digest",
]

# The version of the report parser and scorer (`emrl_data.text.parser`, `emrl_data.text.scoring`) whose scores a card
# holds: raise it whenever a change there can change a score, so that older cards are not compared with newer ones.
PARSER_VERSION = 1
CARD_VERSION = 1


class CardMismatch(ValueError):
    """Two results cards that were not made on the same rows, dataset, split or parser."""


def rows_digest(rows: Iterable[Mapping[str, Any]]) -> str:
    """Return the sha256 of the evaluated rows' ids and truth (`case_id/organ`, split, has_lesion, long_axis_mm),
    independent of their order.

    >>> a = [{"case_id": "BDMAP_00000001", "organ": "liver", "has_lesion": True, "long_axis_mm": 12.0}]
    >>> rows_digest(a) == rows_digest([dict(a[0], prediction="other text")])
    True
    """
    lines = sorted(
        "\t".join(
            [
                row_id(str(r.get("case_id")), str(r["organ"])),
                str(r.get("split")),
                str(bool(r["has_lesion"])),
                repr(None if r.get("long_axis_mm") is None else float(r["long_axis_mm"])),
            ]
        )
        for r in rows
    )
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _file_sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def dataset_source(predictions: Path) -> dict[str, Any]:
    """Return where a model's predictions come from: their path, their table's manifest digest, the `sft` table it
    names (`sft_dir` in that manifest, as `build-rl-hardset` writes it) and that table's manifest digest.

    A predictions file or folder without a manifest (a constructed file) gives None for what it cannot know.
    """
    folder = predictions if predictions.is_dir() else predictions.parent
    manifest = next((p for p in (folder / "manifest.json", folder.parent / "manifest.json") if p.is_file()), None)
    source: dict[str, Any] = {
        "path": str(predictions),
        "manifest_sha256": None,
        "sft_dir": None,
        "sft_manifest_sha256": None,
    }
    if manifest is None:
        return source
    source["manifest_sha256"] = _file_sha256(manifest)
    try:
        sft_dir = json.loads(manifest.read_text()).get("sft_dir")
    except (ValueError, AttributeError):
        sft_dir = None
    if isinstance(sft_dir, str):
        source["sft_dir"] = sft_dir
        source["sft_manifest_sha256"] = _file_sha256(Path(sft_dir) / "manifest.json")
    return source


def dataset_version(sources: Iterable[Mapping[str, Any]]) -> str | None:
    """Return the dataset version of a card: the `sft` manifest digest its sources name (None when none is known).

    Raises:
        CardMismatch: when the sources name different `sft` tables (models predicted on different datasets).
    """
    versions = {s["sft_manifest_sha256"] for s in sources if s.get("sft_manifest_sha256")}
    if len(versions) > 1:
        raise CardMismatch(
            "the predictions come from different sft tables (manifest sha256 "
            + ", ".join(sorted(v[:12] for v in versions))
            + "): evaluate each model's predictions on the same dataset"
        )
    return versions.pop() if versions else None


def check_comparable(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """Refuse, in one error, to compare two results cards not made on the same rows.

    Args:
        a, b: two `metrics.json` cards of `emrl eval`.

    Raises:
        CardMismatch: naming every difference: dataset version, rows, split, parser version.
    """
    problems = []
    version_a, version_b = a.get("dataset", {}).get("version"), b.get("dataset", {}).get("version")
    if version_a and version_b and version_a != version_b:
        problems.append(f"dataset version {version_a[:12]} vs {version_b[:12]} (the sft shards differ)")
    rows_a, rows_b = a.get("dataset", {}).get("rows_digest"), b.get("dataset", {}).get("rows_digest")
    if rows_a != rows_b:
        count_a, count_b = a.get("dataset", {}).get("rows"), b.get("dataset", {}).get("rows")
        problems.append(f"rows {str(rows_a)[:12]} ({count_a} rows) vs {str(rows_b)[:12]} ({count_b} rows)")
    if a.get("split") != b.get("split"):
        problems.append(f"split {a.get('split')} vs {b.get('split')}")
    if a.get("parser_version") != b.get("parser_version"):
        problems.append(f"parser version {a.get('parser_version')} vs {b.get('parser_version')}")
    if problems:
        names = [", ".join(card.get("models") or ["?"]) for card in (a, b)]
        raise CardMismatch(
            f"cannot compare the evaluation of {names[0]} with that of {names[1]}: they were not made on the same "
            f"rows ({'; '.join(problems)})"
        )


def make_card(
    *,
    models: Sequence[str],
    split: str,
    sources: Sequence[Mapping[str, Any]],
    rows: Sequence[Mapping[str, Any]],
    evaluations: Mapping[str, Any],
    paired: Sequence[Mapping[str, Any]] | None = None,
    text: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return the card (JSON-safe) of one evaluation.

    Args:
        models: the models' names, the reference first.
        split: the split evaluated ("all", "train", "test").
        sources: `dataset_source` of each model's predictions.
        rows: the reference model's evaluated rows (their ids and truth make `rows_digest`).
        evaluations: model -> its Table 1/2 (`EvaluationResult.to_json`).
        paired: each model's paired differences against the reference (`PairedComparison.to_json`).
        text: model -> its text metrics (`TextMetrics.to_json`), when computed.

    Raises:
        CardMismatch: when the sources name different sft tables.
    """
    return {
        "card_version": CARD_VERSION,
        "models": list(models),
        "split": split,
        "parser_version": PARSER_VERSION,
        "dataset": {
            "version": dataset_version(sources),
            "rows": len(rows),
            "rows_digest": rows_digest(rows),
            "sources": list(sources),
        },
        "evaluations": dict(evaluations),
        "paired_differences": list(paired or []),
        "text_metrics": dict(text or {}),
    }


def read_card(path: Path) -> dict[str, Any]:
    """Return the card in `path` (a `metrics.json`, or the folder holding it).

    Raises:
        ValueError: naming the file, when it is missing, not JSON, or not a card (no `card_version`).
    """
    path = path / "metrics.json" if path.is_dir() else path
    try:
        card = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable metrics.json ({exc})") from None
    if not isinstance(card, dict) or "card_version" not in card:
        raise ValueError(f"{path}: not a results card of emrl eval (no card_version); evaluate again to write one")
    return card


def headline(card: Mapping[str, Any]) -> dict[str, dict[str, float | None]]:
    """Return model -> {"average_bacc", "table2_overall"} (fractions, None when undefined) of a card, whether it holds
    one model's tables at its top level or several models' under `evaluations`.

    >>> headline({"models": ["m"], "average_bacc": {"value": 0.5}, "table2_overall": {"value": None}})
    {'m': {'average_bacc': 0.5, 'table2_overall': None}}
    """
    evaluations = card.get("evaluations") or {}
    if not evaluations and "average_bacc" in card:
        evaluations = {(card.get("models") or ["?"])[0]: card}
    return {
        model: {key: (tables.get(key) or {}).get("value") for key in ("average_bacc", "table2_overall")}
        for model, tables in evaluations.items()
    }
