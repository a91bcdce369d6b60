"""Parquet shards in the Hub layout (`data/{split}-{i:05d}-of-{n:05d}.parquet`), written atomically and
deterministically (same rows -> byte-identical files), plus the per-table `manifest.json` and the file digests
(`FileDigest`: size, sha256 and git blob id) that the manifest and publishing compare.

Codecs (measured on 10,000 rows, docs/scaling.md#what-curation-costs-measured-on-this-machine): zstd on scalar and text columns, no compression on PNG bytes (already
deflated), dictionary encoding and statistics on scalar columns only, row groups of about 100 MB.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from emrl_data.atomic_write import OutputWriteError, no_room_errno, temporary_path, writing


MAX_SHARD_BYTES = 500 * 1024**2
ROW_GROUP_BYTES = 100 * 1024**2
HASH_CHUNK_BYTES = 8 * 1024**2


def shard_name(split: str, index: int, n_shards: int) -> str:
    """The file name of shard `index` (from 0) of `n_shards` of `split`: `{split}-{i:05d}-of-{n:05d}.parquet`."""
    return f"{split}-{index:05d}-of-{n_shards:05d}.parquet"


def split_shards(data_dir: Path, split: str | None = None) -> list[Path]:
    """The shards of `split` (None: of every split) in a table's `data/` folder, by split and in shard order
    (`shard_name`; other files are not shards)."""
    return sorted(data_dir.glob(f"{split or '*'}-*-of-*.parquet"))


@dataclass(frozen=True, slots=True)
class FileDigest:
    """Size and content hashes of one file.

    Attributes:
        size: bytes.
        sha256: hex sha256 of the content (what the manifest and Hub LFS/Xet entries carry), or None when unknown.
        git_sha1: hex git blob id of the content (what the Hub reports for a regular file), or None when unknown.
    """

    size: int
    sha256: str | None
    git_sha1: str | None


def _row_bytes(table: pa.Table) -> float:
    return table.nbytes / max(table.num_rows, 1)


def _column_options(schema: pa.Schema) -> dict[str, Any]:
    """Per-column codecs: blobs (binary, lists of image structs) uncompressed and without dictionary/statistics."""
    blob_columns = [f.name for f in schema if _holds_binary(f.type)]
    scalar_columns = [f.name for f in schema if f.name not in blob_columns]
    compression: dict[str, str] = {name: "zstd" for name in scalar_columns}
    compression.update({name: "none" for name in blob_columns})
    return {
        "compression": compression,
        "use_dictionary": scalar_columns or False,
        "write_statistics": scalar_columns or False,
    }


def _holds_binary(arrow_type: pa.DataType) -> bool:
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return True
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return _holds_binary(arrow_type.value_type)
    if pa.types.is_struct(arrow_type):
        return any(_holds_binary(arrow_type.field(i).type) for i in range(arrow_type.num_fields))
    return False


def write_parquet_atomic(table: pa.Table, path: Path) -> None:
    """Write one Parquet file through a temporary name and rename it into place (readers never see half a file).

    Raises:
        OutputWriteError: the disk (or quota, or file-size limit) has no room; no temporary file is left.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    rows_per_group = max(1, int(ROW_GROUP_BYTES // max(_row_bytes(table), 1)))
    with writing(path, tmp):
        pq.write_table(table, tmp, row_group_size=rows_per_group, **_column_options(table.schema))
        os.replace(tmp, path)


def write_split_shards(rows: Sequence[Mapping[str, Any]], schema: pa.Schema, data_dir: Path, split: str) -> list[Path]:
    """Write `rows` of one split as `data_dir/{split}-{i:05d}-of-{n:05d}.parquet` shards of at most 500 MB.

    An empty split writes one empty shard, so every split in the card has a file. Shards of the same split left by
    an earlier run with another shard count are removed after the new ones are in place.
    """
    table = pa.Table.from_pylist(list(rows), schema=schema)
    n_shards = max(1, -(-int(table.nbytes) // MAX_SHARD_BYTES))
    per_shard = -(-table.num_rows // n_shards) if table.num_rows else 0
    paths = []
    for i in range(n_shards):
        part = table.slice(i * per_shard, per_shard) if table.num_rows else table
        path = data_dir / shard_name(split, i, n_shards)
        write_parquet_atomic(part, path)
        paths.append(path)
    for stale in split_shards(data_dir, split):
        if stale not in paths:
            stale.unlink()
    return paths


def digest_file(path: Path) -> FileDigest:
    """Return the size, sha256 and git blob id of a file, in one read."""
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    git_sha1 = hashlib.sha1(b"blob %d\0" % size)
    with path.open("rb") as stream:
        while chunk := stream.read(HASH_CHUNK_BYTES):
            sha256.update(chunk)
            git_sha1.update(chunk)
    return FileDigest(size, sha256.hexdigest(), git_sha1.hexdigest())


def digest_bytes(data: bytes) -> FileDigest:
    """Return the size, sha256 and git blob id of in-memory content."""
    git_sha1 = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return FileDigest(len(data), hashlib.sha256(data).hexdigest(), git_sha1)


def table_manifest(table_dir: Path, extra: Mapping[str, Any]) -> dict[str, Any]:
    """Return the manifest of a table folder: sha256 and size of every file but the manifest, plus `extra`."""
    files = {}
    for path in sorted(p for p in table_dir.rglob("*") if p.is_file() and not p.name.startswith(".")):
        rel = path.relative_to(table_dir).as_posix()
        if rel == "manifest.json":
            continue
        digest = digest_file(path)
        files[rel] = {"sha256": digest.sha256, "bytes": digest.size}
    return {**extra, "files": files}


def _shard_of_rows(row_bytes: Sequence[int]) -> tuple[int, list[int]]:
    """Return the shard count (shards <= `MAX_SHARD_BYTES`) and each row's shard: row i goes to shard
    floor(n * bytes-before-row / total), so shards are contiguous and balanced by size."""
    total = int(sum(row_bytes))
    n_shards = max(1, -(-total // MAX_SHARD_BYTES))
    shard_of: list[int] = []
    running = 0
    for size in row_bytes:
        shard_of.append(min(n_shards - 1, (n_shards * running) // max(total, 1)))
        running += size
    return n_shards, shard_of


def _discard(writers: Sequence[pq.ParquetWriter | None], tmp_paths: Sequence[Path]) -> None:
    """Close the open writers (releasing their files), then remove every temporary shard."""
    for open_writer in writers:
        if open_writer is not None:
            with contextlib.suppress(Exception):
                open_writer.close()
    for tmp in tmp_paths:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_split_streaming(
    rows: Iterable[Mapping[str, Any]],
    row_bytes: Sequence[int],
    schema: pa.Schema,
    data_dir: Path,
    split: str,
) -> list[Path]:
    """Write a split whose rows do not fit in memory at once (e.g. SFT rows with their frames).

    Args:
        rows: the rows in order, produced lazily.
        row_bytes: an estimate of each row's size (e.g. the PNG bytes of its frames); fixes the shard count
            (shards <= 500 MB) and which rows go to which shard before anything is written, so names are final.
        schema: the table schema.
        data_dir: the `data/` folder.
        split: the split name.

    Memory stays at about one row group (~100 MB) plus the row being produced.

    Raises:
        OutputWriteError: the disk (or quota, or file-size limit) has no room; every temporary shard is removed.
    """
    n_shards, shard_of = _shard_of_rows(row_bytes)
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = [data_dir / shard_name(split, i, n_shards) for i in range(n_shards)]
    tmp_paths = [temporary_path(p) for p in paths]
    options = _column_options(schema)
    writers: list[pq.ParquetWriter | None] = [None] * n_shards
    batch: list[Mapping[str, Any]] = []
    batch_bytes = 0
    current = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if batch:
            if writers[current] is None:
                writers[current] = pq.ParquetWriter(tmp_paths[current], schema, **options)
            writers[current].write_table(pa.Table.from_pylist(batch, schema=schema))  # type: ignore[union-attr]
        batch, batch_bytes = [], 0

    columns = [f.name for f in schema]
    n_rows = 0
    try:
        for index, row in enumerate(rows):
            if shard_of[index] != current:
                flush()
                current = shard_of[index]
            batch.append({c: row.get(c) for c in columns})
            batch_bytes += row_bytes[index]
            n_rows += 1
            if batch_bytes >= ROW_GROUP_BYTES:
                flush()
        flush()
        if n_rows != len(row_bytes):
            raise ValueError(f"{split}: got {n_rows} rows but {len(row_bytes)} size estimates.")
        for i in range(n_shards):
            current = i
            if writers[i] is None:  # an empty split (or shard) still gets a valid file
                writers[i] = pq.ParquetWriter(tmp_paths[i], schema, **options)
            writer, writers[i] = writers[i], None
            writer.close()  # type: ignore[union-attr]
            os.replace(tmp_paths[i], paths[i])
    except BaseException as err:
        _discard(writers, tmp_paths)
        code = no_room_errno(err)
        if code is not None:
            raise OutputWriteError(paths[current], code) from err
        raise
    for stale in split_shards(data_dir, split):
        if stale not in paths:
            stale.unlink()
    return paths
