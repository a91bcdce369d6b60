"""Parquet shards in the Hub layout (`data/{split}-{i:05d}-of-{n:05d}.parquet`), written atomically and
deterministically (same rows -> byte-identical files), plus the per-table `manifest.json` and the file digests
(`FileDigest`: size, sha256 and git blob id) that the manifest and publishing compare.

This module owns the shard names: `shard_name` spells one, `parse_shard_name` reads one back, `split_shards` lists a
split's shards, `split_pattern` is the glob a card's `data_files` give the Hub and `DATA_PATTERN` the glob of every
shard of a table folder. Every shard is written by `write_split_streaming` (rows produced lazily, sized beforehand);
`write_split_shards` streams rows held in memory through it.

Codecs (measured on 10,000 rows, docs/scaling.md#what-curation-costs-measured-on-this-machine): zstd on scalar and text columns, no compression on PNG bytes (already
deflated), dictionary encoding and statistics on scalar columns only, row groups of about 100 MB.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from emrl_data.atomic_write import OutputWriteError, no_room_errno, temporary_path


MAX_SHARD_BYTES = 500 * 1024**2
ROW_GROUP_BYTES = 100 * 1024**2
HASH_CHUNK_BYTES = 8 * 1024**2

DATA_DIR = "data"
# Every Parquet file of a table folder, relative to the folder: what publishing lists.
DATA_PATTERN = f"{DATA_DIR}/*.parquet"
# Every Parquet file of a release, in `data/` or a config's folder (one config per source): on a target, one that the
# table does not hold is a stale shard, deleted when publishing (a config dropped since the last version included).
RELEASE_SHARD_PATTERN = "*.parquet"
MAX_SHARDS = 99_999  # the most five digits count
_SPLIT = re.compile(r"[A-Za-z0-9_]+")
_SHARD_NAME = re.compile(
    rf"(?:{DATA_DIR}/)?(?P<split>{_SPLIT.pattern})-(?P<index>[0-9]{{5}})-of-(?P<count>[0-9]{{5}})\.parquet"
)


def shard_name(split: str, index: int, count: int) -> str:
    """The file name of shard `index` (from 0) of `count` shards of `split`: `{split}-{i:05d}-of-{n:05d}.parquet`.

    Raises:
        ValueError: `split` is not letters, digits and `_`, or not 0 <= `index` < `count` <= 99999.
    """
    if not _SPLIT.fullmatch(split):
        raise ValueError(f"split={split!r} is not a split name (letters, digits and '_').")
    if not 0 <= index < count <= MAX_SHARDS:
        raise ValueError(f"shard {index} of {count} is not a shard: needs 0 <= index < count <= {MAX_SHARDS}.")
    return f"{split}-{index:05d}-of-{count:05d}.parquet"


def parse_shard_name(rel: str) -> tuple[str, int, int] | None:
    """The split, index and count of a shard from its file name or its path in a table folder (`data/{name}`), the
    inverse of `shard_name`; None when `rel` is not a shard name there (as `shard_name` spells it)."""
    match = _SHARD_NAME.fullmatch(rel)
    if match is None:
        return None
    split, index, count = match["split"], int(match["index"]), int(match["count"])
    return (split, index, count) if index < count else None


def split_pattern(split: str) -> str:
    """The glob, relative to a table folder, of the shards of `split`: `data/{split}-*.parquet` (a card's
    `data_files` path)."""
    return f"{DATA_DIR}/{split}-*.parquet"


def split_shards(data_dir: Path, split: str | None = None) -> list[Path]:
    """The shards of `split` (None: of every split) in a table's `data/` folder, by split and in shard order
    (only files `parse_shard_name` reads; other files are not shards)."""
    found = [(parse_shard_name(p.name), p) for p in data_dir.glob(f"{split or '*'}-*.parquet")]
    return sorted(p for parsed, p in found if parsed is not None and split in (None, parsed[0]))


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


def write_split_shards(rows: Sequence[Mapping[str, Any]], schema: pa.Schema, data_dir: Path, split: str) -> list[Path]:
    """Write `rows` of one split, held in memory, through `write_split_streaming`; return the shards.

    Each row's size estimate is an equal part of the rows' Arrow size, so the shard count is that size over 500 MB.
    """
    rows = list(rows)
    total = pa.Table.from_pylist(rows, schema=schema).nbytes if rows else 0
    share, rest = divmod(int(total), max(len(rows), 1))
    row_bytes = [share + (i < rest) for i in range(len(rows))]
    return write_split_streaming(rows, row_bytes, schema, data_dir, split)


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
            if writers[i] is None:  # an empty split (or shard) still gets a valid file: one row group of no rows
                writers[i] = pq.ParquetWriter(tmp_paths[i], schema, **options)
                writers[i].write_table(schema.empty_table())  # type: ignore[union-attr]
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
