"""A table's sources at release: the licence check and the release as one config per source.

A table whose rows name their source (`source_dataset`, `source_license`, `emrl_data.sources`) is published either as
one config (`default`: every row; its sources' licences must combine, `licence_conflict`) or as one config per source
(`config_per_source`: each config is one source's rows, a separate work; only the commercial-use declaration is
checked, per source). The per-source release writes one shard per config and split, `{dataset}/{split}-00000-of-00001
.parquet`, in place of `data/`, and the card's YAML lists one config per source with its own `dataset_info`. It
holds the released shards in memory and writes one shard per config and split whatever its size: it is for mixtures
of small tables; a single-source table (a `build-sft-set` run) is published as `default`, shards as built.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from dataclasses import replace

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from emrl_data.sources import SOURCE_COLUMNS, licence_conflict
from emrl_data.tables.shards import DATA_DIR, digest_bytes, split_shards
from emrl_data.tables.table_folder import CARD, MANIFEST, PublishError, TableFolder


def table_sources(table: TableFolder) -> dict[str, str]:
    """Source dataset -> licence of the table's rows, from its shards ({} for a table without source columns).

    Raises:
        PublishError: a dataset whose rows name two licences.
    """
    found: dict[str, set[str]] = {}
    for rel in sorted(r for r in table.files if r.startswith(f"{DATA_DIR}/")):
        names = pq.read_schema(table.root / rel).names
        if not set(SOURCE_COLUMNS) <= set(names):
            return {}
        pairs = pq.read_table(table.root / rel, columns=["source_dataset", "source_license"]).to_pylist()
        for row in pairs:
            found.setdefault(row["source_dataset"], set()).add(row["source_license"])
    mixed = {dataset: sorted(lics) for dataset, lics in found.items() if len(lics) > 1}
    if mixed:
        dataset, lics = next(iter(sorted(mixed.items())))
        raise PublishError(f"{table.root}: the rows of {dataset} name two licences, {lics[0]} and {lics[1]}; rebuild.")
    return {dataset: lics.pop() for dataset, lics in sorted(found.items())}


def check_licences(table: TableFolder, *, commercial: bool, config_per_source: bool) -> dict[str, str]:
    """Check that the table's sources may be published as asked; return its sources (`table_sources`).

    Raises:
        PublishError: one line naming the two licences that cannot be one config (or the non-commercial licence of a
            set declared for commercial use), and the fix; `commercial` or `config_per_source` for a table whose
            rows name no source (a `predictions` table, or one built before the source columns).
    """
    sources = table_sources(table)
    if not sources and (commercial or config_per_source):
        option = "--commercial" if commercial else "--config-per-source"
        raise PublishError(f"{table.root}: its rows name no source dataset or licence, so {option} cannot be checked")
    groups = [[lic] for lic in sources.values()] if config_per_source else [list(sources.values())]
    for licences in groups:
        conflict = licence_conflict(licences, commercial=commercial)
        if conflict is not None:
            raise PublishError(f"{table.root}: {conflict}")
    return sources


def _shard_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def _source_rows(table: TableFolder, splits: list[str]) -> dict[str, dict[str, pa.Table]]:
    """Dataset -> split -> its rows (every split present, empty ones too), read from the table's shards."""
    out: dict[str, dict[str, pa.Table]] = {}
    for split in splits:
        rows = pa.concat_tables([pq.read_table(p) for p in split_shards(table.root / DATA_DIR, split)])
        for dataset in sorted(set(rows.column("source_dataset").to_pylist()) | set(out)):
            part = rows.filter(pc.equal(rows.column("source_dataset"), dataset))
            out.setdefault(dataset, {})[split] = part
    for by_split in out.values():
        for split in splits:  # a split a source has no row in: an empty shard with the schema
            if split not in by_split:
                by_split[split] = next(iter(by_split.values())).slice(0, 0)
    return out


def per_source_card(card: str, rows: Mapping[str, Mapping[str, int]]) -> str:
    """The card with one config per source (`rows`: dataset -> split -> rows) in place of `default`."""
    _, front, body = card.split("---\n", 2)
    data = yaml.safe_load(front)
    info = data.pop("dataset_info")
    data.pop("configs")
    data["configs"] = [
        {"config_name": dataset, "data_files": [{"split": s, "path": f"{dataset}/{s}-*.parquet"} for s in splits]}
        for dataset, splits in rows.items()
    ]
    data["dataset_info"] = [
        {
            "config_name": dataset,
            "features": info["features"],
            "splits": [{"name": s, "num_examples": n} for s, n in splits.items()],
        }
        for dataset, splits in rows.items()
    ]
    dumped = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000)
    return f"---\n{dumped}---\n{body}"


def release_per_source(table: TableFolder) -> TableFolder:
    """The released table with one config per source: per-source shards and card in place of `data/` and `default`.

    `TableFolder.configs` holds rows per config and split (what the read-back expects); the manifest lists the
    released files.
    """
    by_source = _source_rows(table, sorted(table.rows))
    overrides = {
        f"{dataset}/{split}-00000-of-00001.parquet": _shard_bytes(part)
        for dataset, by_split in by_source.items()
        for split, part in by_split.items()
    }
    configs = {dataset: {s: part.num_rows for s, part in by_split.items()} for dataset, by_split in by_source.items()}
    card = per_source_card(table.overrides[CARD].decode("utf-8"), configs)
    overrides[CARD] = card.encode("utf-8")
    kept = {rel: d for rel, d in table.files.items() if not rel.startswith(f"{DATA_DIR}/") and rel != MANIFEST}
    digests = {rel: digest_bytes(data) for rel, data in overrides.items()}
    listed = {rel: {"sha256": d.sha256, "bytes": d.size} for rel, d in {**kept, **digests}.items()}
    manifest = {**table.manifest, "files": listed, "configs": configs}
    manifest_bytes = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")
    overrides[MANIFEST] = manifest_bytes
    files = {**kept, **digests, MANIFEST: digest_bytes(manifest_bytes)}
    return replace(table, files=files, manifest=manifest, overrides=overrides, configs=configs)
