"""Shared value types: organs (defined with their registry in `emrl_data.organs`), case ids, splits, 3-D boxes, table
columns."""

from __future__ import annotations

import re
from dataclasses import fields
from enum import StrEnum
from typing import Any

import pyarrow as pa

from emrl_data.organs import Organ


__all__ = [
    "CASE_ID_PATTERN",
    "Attenuation",
    "Box3",
    "Organ",
    "Split",
    "column",
    "is_valid_case_id",
    "row_id",
    "row_values",
]

# A 3-D box as index slices, half-open, step None; its frame (storage order or canonical RAS) is named where it is used.
Box3 = tuple[slice, slice, slice]


class Split(StrEnum):
    """Dataset split of a case (IID split files, or the case-id hash split)."""

    TRAIN = "train"
    TEST = "test"


class Attenuation(StrEnum):
    """Lesion attenuation relative to the organ parenchyma (RadGPT's rule, docs/contract.md#labels)."""

    HYPO = "hypo"
    ISO = "iso"
    HYPER = "hyper"


CASE_ID_PATTERN = re.compile(r"^BDMAP_[0-9]{8}$")


def is_valid_case_id(case_id: str) -> bool:
    """Return True for `BDMAP_` + 8 digits (the id is also a path component, so nothing else is accepted)."""
    return bool(CASE_ID_PATTERN.fullmatch(case_id))


def row_id(case_id: str, organ: str) -> str:
    """Return the id of one organ row (or of one file of a case): `"{case_id}/{organ}"`.

    The one spelling of the key that joins predictions, hard rows and inference requests to their rows.

    >>> row_id("BDMAP_00000001", "liver")
    'BDMAP_00000001/liver'
    """
    return f"{case_id}/{organ}"


def column(arrow_type: pa.DataType, doc: str) -> dict[str, Any]:
    """Return the field metadata that declares a dataclass field a table column (`emrl_data.tables.records`).

    Use it as `field(metadata=column(pa.float64(), "lesion volume"))`. Nullability comes from the field's type
    (`X | None` is nullable).

    >>> from dataclasses import dataclass, field, fields
    >>> @dataclass
    ... class Row:
    ...     volume_mm3: float = field(metadata=column(pa.float64(), "lesion volume"))
    >>> fields(Row)[0].metadata["doc"]
    'lesion volume'
    """
    return {"arrow": arrow_type, "doc": doc}


def row_values(record: Any) -> dict[str, Any]:
    """Return the column fields of a dataclass instance as a table row: name -> Parquet-ready value.

    Only fields declared with `column` are returned; tuples become lists and organ names plain strings.
    """
    return {f.name: _plain(getattr(record, f.name)) for f in fields(record) if "arrow" in f.metadata}


def _plain(value: Any) -> Any:
    """Return a value as Parquet and JSON take it (tuples -> lists, str subclasses -> str)."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str(value)
    return value
