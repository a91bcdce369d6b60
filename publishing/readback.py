"""The read-back check both publish targets end with, and the result fields they share (flows/publish.py)."""

from __future__ import annotations

import json
from typing import Any

import datasets
import PIL.Image
import pyarrow.parquet as pq

from emrl_data.tables.table_folder import TableFolder, VerificationError


def outcome(status: str, message: str, **fields: Any) -> dict[str, Any]:
    """Return the target-specific part of a flow result with defaults for what a status does not produce."""
    return {"status": status, "message": message, "commit": None, "uploaded": False, "images_decoded": {}, **fields}


def _decoded_images(value: Any, feature: Any) -> int:
    """Return how many images `value` holds under `feature`; raise when an image did not decode to PIL."""
    if value is None:
        return 0
    if isinstance(feature, datasets.Image):
        if not isinstance(value, PIL.Image.Image):
            raise VerificationError(f"an image came back as {type(value).__name__}, not a decoded PIL image")
        value.load()
        return 1
    if isinstance(feature, (datasets.List, datasets.LargeList)):
        return sum(_decoded_images(item, feature.feature) for item in value)
    if isinstance(feature, dict):
        return sum(_decoded_images(value.get(name), sub) for name, sub in feature.items())
    return 0


def _table_features(table: TableFolder) -> datasets.Features | None:
    """Return the Hub features the table's first shard carries in its Parquet metadata, or None."""
    first = min(table.root.glob("data/*.parquet"))  # the folder's own shards (a per-source release splits them)
    metadata = pq.read_schema(first).metadata or {}
    if b"huggingface" not in metadata:
        return None
    return datasets.Features.from_dict(json.loads(metadata[b"huggingface"])["info"]["features"])


def read_back(path: str, revision: str | None, table: TableFolder) -> dict[str, dict[str, int]]:
    """Read a release with `datasets.load_dataset(path, revision=revision, streaming=True)` and check it.

    Streaming reads only what is needed: every row of one small column to count rows, and the first row of each
    split with all columns, whose images must decode. The features must equal those the shards were written with.
    A release of one config per source (`TableFolder.configs`) is read config by config.

    Args:
        path: a Hub repo id, or a local folder holding the card and `data/`.
        revision: the tag to read (Hub), or None (local folder).
        table: the published table (expected rows per split and features).

    Returns:
        `{"rows": {split: n}, "images_decoded": {split: n}}` (per config: keys `config/split`).

    Raises:
        VerificationError: on other splits, row counts or features than the table's, or an undecoded image.
    """
    if not table.configs:
        return _read_config(path, revision, None, table.rows, _table_features(table))
    rows: dict[str, int] = {}
    images: dict[str, int] = {}
    for config, expected in table.configs.items():
        found = _read_config(path, revision, config, expected, _table_features(table))
        rows |= {f"{config}/{split}": n for split, n in found["rows"].items()}
        images |= {f"{config}/{split}": n for split, n in found["images_decoded"].items()}
    return {"rows": rows, "images_decoded": images}


def _read_config(
    path: str, revision: str | None, config: str | None, expected: dict[str, int], features: datasets.Features | None
) -> dict[str, dict[str, int]]:
    """Read back one config (None: the default) and check its splits, features, first images and rows."""
    where = f"{path}@{revision}" + (f" config {config}" if config else "")
    streams = datasets.load_dataset(path, config, revision=revision, streaming=True)
    if set(streams) != set(expected):
        raise VerificationError(f"{where} reads back splits {sorted(streams)}, expected {sorted(expected)}")
    images: dict[str, int] = {}
    count_column = None
    for split, stream in streams.items():
        found = dict(stream.features or {})  # None when datasets could not infer them
        if features is not None and stream.features != features:
            raise VerificationError(f"{where} split {split} reads back features {stream.features}")
        first = next(iter(stream), None)
        images[split] = 0 if first is None else _decoded_images(first, found)
        count_column = next((n for n, f in found.items() if isinstance(f, datasets.Value)), None)
    counts = datasets.load_dataset(
        path, config, revision=revision, streaming=True, columns=[count_column] if count_column else None
    )
    rows = {split: sum(1 for _ in stream) for split, stream in counts.items()}
    if rows != expected:
        raise VerificationError(f"{where} reads back rows {rows}, expected {expected}")
    return {"rows": rows, "images_decoded": images}
