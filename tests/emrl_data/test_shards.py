"""Shards: their names (one owner), Hub layout, determinism, one streamed write path (rows in memory included),
images decoded by `datasets`, and a table folder's shards read back."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa  # noqa: I001
import pyarrow.parquet as pq
import pytest

from emrl_data.tables import shards
from emrl_data.tables.records import IMAGE_STRUCT, make_schema
from emrl_data.tables.shards import (
    DATA_PATTERN,
    parse_shard_name,
    shard_name,
    split_pattern,
    split_shards,
    table_manifest,
    write_split_shards,
    write_split_streaming,
)
from emrl_data.tables.table_folder import MANIFEST, PublishError, read_table, write_split, write_table


SCHEMA = make_schema(
    [
        ("case_id", pa.string(), False, "id"),
        ("n", pa.int32(), False, "a number"),
        ("frames", pa.list_(IMAGE_STRUCT), False, "images"),
    ]
)


def _png(value: int) -> bytes:
    ok, buf = cv2.imencode(".png", np.full((8, 6), value, np.uint8))
    assert ok
    return buf.tobytes()


def _rows(n: int) -> list[dict]:
    return [
        {"case_id": f"BDMAP_{i:08d}", "n": i, "frames": [{"bytes": _png(i), "path": f"{i}_{j}.png"} for j in range(2)]}
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("split", "index", "count", "name"),
    [
        ("train", 0, 1, "train-00000-of-00001.parquet"),
        ("test", 2, 12, "test-00002-of-00012.parquet"),
        ("train_extra", 99_998, 99_999, "train_extra-99998-of-99999.parquet"),
    ],
)
def test_shard_name_and_parse_shard_name_round_trip(split: str, index: int, count: int, name: str) -> None:
    assert shard_name(split, index, count) == name
    assert parse_shard_name(name) == (split, index, count)
    assert parse_shard_name(f"data/{name}") == (split, index, count)  # its path in a table folder


@pytest.mark.parametrize(
    ("split", "index", "count", "message"),
    [
        ("train-x", 0, 1, r"split='train-x' is not a split name \(letters, digits and '_'\)\."),
        ("", 0, 1, r"split='' is not a split name"),
        ("data/train", 0, 1, r"split='data/train' is not a split name"),
        ("train", 1, 1, r"shard 1 of 1 is not a shard: needs 0 <= index < count <= 99999\."),
        ("train", -1, 1, r"shard -1 of 1 is not a shard"),
        ("train", 0, 0, r"shard 0 of 0 is not a shard"),
        ("train", 0, 100_000, r"shard 0 of 100000 is not a shard"),
    ],
)
def test_shard_name_refuses_what_it_cannot_spell(split: str, index: int, count: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shard_name(split, index, count)


@pytest.mark.parametrize(
    "rel",
    [
        "train-00000-of-00001",  # no suffix
        "train-00000-of-00001.parquet.tmp-7",
        ".train-00000-of-00001.parquet.tmp-7",  # a temporary shard
        "train-0-of-1.parquet",  # not five digits
        "train-000000-of-00001.parquet",
        "train-00001-of-00001.parquet",  # index past the count
        "train-00000-of-00000.parquet",
        "train-x-00000-of-00001.parquet",  # '-' in the split
        "-00000-of-00001.parquet",
        "train-00000.parquet",
        "README.md",
        "other/train-00000-of-00001.parquet",  # not in data/
        "data/sub/train-00000-of-00001.parquet",
        "/data/train-00000-of-00001.parquet",
    ],
)
def test_parse_shard_name_refuses_other_names(rel: str) -> None:
    assert parse_shard_name(rel) is None


def test_table_folder_globs() -> None:
    assert DATA_PATTERN == "data/*.parquet"
    assert split_pattern("train") == "data/train-*.parquet"
    assert split_pattern("test") == "data/test-*.parquet"


def test_write_split_shards_names_and_determinism(tmp_path: Path) -> None:
    a = write_split_shards(_rows(5), SCHEMA, tmp_path / "a" / "data", "train")
    b = write_split_shards(_rows(5), SCHEMA, tmp_path / "b" / "data", "train")
    assert [p.name for p in a] == ["train-00000-of-00001.parquet"]
    assert a[0].read_bytes() == b[0].read_bytes()
    assert pq.read_table(a[0]).num_rows == 5


def test_write_split_shards_empty_split_writes_one_empty_file(tmp_path: Path) -> None:
    (path,) = write_split_shards([], SCHEMA, tmp_path, "test")
    assert path.name == "test-00000-of-00001.parquet"
    assert pq.read_table(path).num_rows == 0
    assert pq.read_schema(path).names == ["case_id", "n", "frames"]


def test_streaming_splits_into_balanced_shards_and_removes_stale(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    write_split_shards(_rows(3), SCHEMA, data, "train")  # an earlier run: one shard
    monkeypatch.setattr(shards, "MAX_SHARD_BYTES", 250)
    monkeypatch.setattr(shards, "ROW_GROUP_BYTES", 100)
    rows = _rows(6)
    paths = write_split_streaming(iter(rows), [100] * 6, SCHEMA, data, "train")

    assert [p.name for p in paths] == [f"train-0000{i}-of-00003.parquet" for i in range(3)]
    assert sorted(p.name for p in data.iterdir()) == [p.name for p in paths]  # stale shard removed, no temp files
    assert [pq.read_table(p).num_rows for p in paths] == [2, 2, 2]
    assert [pq.ParquetFile(p).num_row_groups for p in paths] == [2, 2, 2]  # 100-byte row groups
    got = [r["n"] for p in paths for r in pq.read_table(p).to_pylist()]
    assert got == list(range(6))


def test_split_shards_lists_one_splits_shards_in_order(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    names = [shard_name("train", i, 12) for i in (10, 2, 0)] + [
        shard_name("test", 0, 1),
        shard_name("train_extra", 0, 1),  # another split whose name starts with this one's
        "train-00000.parquet",  # not a shard name
        "train-extra-00000-of-00001.parquet",  # nor this ('-' in a split)
        "train-1-of-2.parquet",
        ".train-00000-of-00001.parquet.tmp-7",  # a temporary file
        "train-00001-of-00012.json",
    ]
    for name in names:
        (data / name).write_bytes(b"")
    assert shard_name("train", 2, 12) == "train-00002-of-00012.parquet"
    assert [p.name for p in split_shards(data, "train")] == [
        "train-00000-of-00012.parquet",
        "train-00002-of-00012.parquet",
        "train-00010-of-00012.parquet",
    ]
    assert [p.name for p in split_shards(data, "test")] == ["test-00000-of-00001.parquet"]
    assert [p.name for p in split_shards(data)] == [
        "test-00000-of-00001.parquet",
        "train-00000-of-00012.parquet",
        "train-00002-of-00012.parquet",
        "train-00010-of-00012.parquet",
        "train_extra-00000-of-00001.parquet",
    ]
    assert split_shards(data, "validation") == [] and split_shards(tmp_path / "absent", "train") == []


def test_streaming_rejects_wrong_row_count(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="got 2 rows but 3 size estimates"):
        write_split_streaming(iter(_rows(2)), [1, 1, 1], SCHEMA, tmp_path, "train")


def test_image_columns_are_uncompressed_and_scalars_zstd(tmp_path: Path) -> None:
    (path,) = write_split_shards(_rows(2), SCHEMA, tmp_path, "train")
    meta = pq.ParquetFile(path).metadata.row_group(0)
    codecs = {meta.column(i).path_in_schema: meta.column(i).compression for i in range(meta.num_columns)}
    assert codecs["case_id"] == "ZSTD"
    assert codecs["frames.list.element.bytes"] == "UNCOMPRESSED"


def test_datasets_decodes_frames_as_images(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    write_split_shards(_rows(3), SCHEMA, tmp_path / "data", "train")
    ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "data"), split="train")
    assert isinstance(ds.features["frames"], datasets.List)
    assert isinstance(ds.features["frames"].feature, datasets.Image)
    image = ds[2]["frames"][1]
    assert image.size == (6, 8)
    assert np.asarray(image).max() == 2


def test_table_manifest_lists_files_with_sha256(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("card")
    (tmp_path / "manifest.json").write_text("{}")
    manifest = table_manifest(tmp_path, {"pipeline_version": "x"})
    assert manifest["pipeline_version"] == "x"
    assert manifest["files"] == {
        "README.md": {"sha256": "8367cd66fdd136bba8ba23f8805bb050dd6289401c8ec3b0be44a3c233eef90d", "bytes": 4}
    }
    json.dumps(manifest)


_PROVENANCE = {"pipeline_version": "0.1.0", "git_sha": None, "config_fingerprint": "f"}


def _rejections(n: int) -> list[dict]:
    return [
        {"case_id": f"BDMAP_{i:08d}", "organ": None, "step": "load", "reason": "corrupt_gzip", "detail": str(i)}
        | {"source_dataset": "abdomenatlas", "source_case_id": f"BDMAP_{i:08d}", "source_license": "CC-BY-NC-SA-4.0"}
        for i in range(n)
    ]


def test_rows_in_memory_are_written_by_the_streamed_path_byte_for_byte(tmp_path: Path) -> None:
    rows = _rejections(3) + [{**_rejections(1)[0], "unknown_column": 1}]  # columns outside the schema are dropped
    in_memory = write_table("rejections", {"train": rows, "test": []}, tmp_path / "a", provenance=_PROVENANCE)
    streamed = write_split("rejections", "train", iter(rows), [1, 2, 3, 4], tmp_path / "b")
    (empty_streamed,) = write_split("rejections", "test", iter([]), [], tmp_path / "b")

    assert sorted(p.relative_to(in_memory).as_posix() for p in (in_memory / "data").iterdir()) == [
        "data/test-00000-of-00001.parquet",
        "data/train-00000-of-00001.parquet",
    ]
    assert [p.name for p in streamed] == ["train-00000-of-00001.parquet"]
    assert (in_memory / "data" / streamed[0].name).read_bytes() == streamed[0].read_bytes()
    assert (in_memory / "data" / empty_streamed.name).read_bytes() == empty_streamed.read_bytes()
    empty = pq.ParquetFile(empty_streamed)
    assert (empty.metadata.num_rows, empty.metadata.num_row_groups) == (0, 1)  # one row group of no rows
    assert pq.read_table(streamed[0]).column_names == [
        *("case_id", "organ", "step", "reason", "detail", "path"),
        *("source_dataset", "source_case_id", "source_license"),
    ]


def test_rows_in_memory_past_the_shard_size_split_into_balanced_shards(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    total = pa.Table.from_pylist(_rows(6), schema=SCHEMA).nbytes
    monkeypatch.setattr(shards, "MAX_SHARD_BYTES", total // 3 + 1)  # 3 shards of 2 equal-sized rows
    paths = write_split_shards(_rows(6), SCHEMA, tmp_path, "train")
    assert [p.name for p in paths] == [shard_name("train", i, 3) for i in range(3)]
    assert [[r["n"] for r in pq.read_table(p).to_pylist()] for p in paths] == [[0, 1], [2, 3], [4, 5]]


def test_read_table_counts_rows_per_split_from_the_shard_names(tmp_path: Path) -> None:
    table = write_table(
        "rejections", {"train": _rejections(3), "test": _rejections(1)}, tmp_path, provenance=_PROVENANCE
    )
    assert read_table(table).rows == {"test": 1, "train": 3}


def test_read_table_refuses_a_listed_file_in_data_that_is_not_a_shard_name(tmp_path: Path) -> None:
    table = write_table("rejections", {"train": _rejections(2)}, tmp_path, provenance=_PROVENANCE)
    good = table / "data" / shard_name("train", 0, 1)
    bad = table / "data" / "train-0-of-1.parquet"
    good.rename(bad)
    manifest = json.loads((table / MANIFEST).read_text())
    manifest["files"]["data/train-0-of-1.parquet"] = manifest["files"].pop("data/train-00000-of-00001.parquet")
    (table / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(PublishError, match=r"data/train-0-of-1\.parquet: not named data/\{split\}-\{i:05d\}-of-"):
        read_table(table)
