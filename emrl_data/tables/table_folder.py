"""One table folder in the Hub layout: `data/` shards per split, the card (`README.md`) and `manifest.json`.

Every table a run writes (`findings`, `sft`, `rejections`, `predictions`, `rl_hardset`) goes through `write_table`
(rows in memory) or `finish_table` (shards already streamed into place). Rows are written in `row_order` (split, organ,
case id) so shards are deterministic; `count_rows` and `count_rejections` give the counts the cards, manifests and run
summaries state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from emrl_data.atomic_write import write_json_atomic, write_text_atomic
from emrl_data.outcome import Rejection
from emrl_data.tables.card import parquet_split_bytes, render_dataset_card
from emrl_data.tables.records import SCHEMAS, check_required, column_descriptions, hub_features
from emrl_data.tables.shards import table_manifest, write_split_shards


def row_order(row: Mapping[str, Any]) -> tuple[str, str, str]:
    """The order rows are written in: split, organ, case id (deterministic shards)."""
    return (row["split"], row["organ"], row["case_id"])


def count_rows(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Counts per split -> "organ/positive|negative" (and "total")."""
    counts: dict[str, Counter[str]] = {}
    for r in rows:
        c = counts.setdefault(r["split"], Counter())
        c[f"{r['organ']}/{'positive' if r['has_lesion'] else 'negative'}"] += 1
        c["total"] += 1
    return {split: dict(sorted(c.items())) for split, c in sorted(counts.items())}


def count_rejections(rejections: Iterable[Rejection]) -> dict[str, int]:
    """Counts per "step/reason"."""
    return dict(sorted(Counter(f"{r.step}/{r.reason}" for r in rejections).items()))


def write_table(
    name: str,
    rows_by_split: Mapping[str, Sequence[Mapping[str, Any]]],
    out_dir: Path,
    *,
    provenance: Mapping[str, Any],
    counts: Mapping[str, Mapping[str, int]] | None = None,
) -> Path:
    """Write one table folder in the Hub layout: `data/` shards per split, then `README.md` and `manifest.json`."""
    schema = table_schema(name)
    columns = [f.name for f in schema]
    for split, rows in rows_by_split.items():
        for row in rows:
            check_required(name, row)
        write_split_shards([{c: r.get(c) for c in columns} for r in rows], schema, out_dir / name / "data", split)
    if counts is None:
        counts = {split: {"total": len(rows)} for split, rows in rows_by_split.items()}
    return finish_table(name, out_dir, provenance=provenance, counts=counts)


def finish_table(
    name: str,
    out_dir: Path,
    *,
    provenance: Mapping[str, Any],
    counts: Mapping[str, Mapping[str, int]],
    metrics_markdown: str | None = None,
) -> Path:
    """Write the card and the manifest of a table folder whose shards are in place; return the folder.

    `provenance` needs `pipeline_version`, `git_sha` and `config_fingerprint`; it is also copied into the manifest.
    """
    table_dir = out_dir / name
    card = render_dataset_card(
        table=name,
        features=table_features(name),
        row_counts={split: dict(c) for split, c in counts.items()},
        pipeline_version=provenance["pipeline_version"],
        git_sha=provenance["git_sha"],
        config_fingerprint=provenance["config_fingerprint"],
        metrics_markdown=metrics_markdown,
        splits=tuple(counts),
        descriptions=column_descriptions(name),
        split_bytes=parquet_split_bytes(table_dir / "data", tuple(counts)),
        atlas_source=provenance.get("atlas_source"),
    )
    write_text_atomic(card, table_dir / "README.md")
    manifest = table_manifest(table_dir, {**provenance, "row_counts": {s: dict(c) for s, c in counts.items()}})
    write_json_atomic(manifest, table_dir / "manifest.json")
    return table_dir


def table_schema(name: str) -> pa.Schema:
    """Return the schema of a table by name."""
    return SCHEMAS[name]


def table_features(name: str) -> dict[str, Any]:
    """Return the Hub features of a table by name."""
    return hub_features(table_schema(name))
