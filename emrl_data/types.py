"""Shared value types: organs (defined with their registry in `emrl_data.organs`), case ids, splits, table columns."""

from __future__ import annotations

import re
from dataclasses import field
from enum import StrEnum
from typing import Any

import pyarrow as pa

from emrl_data.organs import Organ


__all__ = ["CASE_ID_PATTERN", "Attenuation", "Organ", "Split", "column", "is_valid_case_id"]


class Split(StrEnum):
    """Dataset split of a case (IID split files, or the case-id hash split)."""

    TRAIN = "train"
    TEST = "test"


class Attenuation(StrEnum):
    """Lesion attenuation relative to the organ parenchyma (RadGPT's rule, SPEC §4)."""

    HYPO = "hypo"
    ISO = "iso"
    HYPER = "hyper"


CASE_ID_PATTERN = re.compile(r"^BDMAP_[0-9]{8}$")


def is_valid_case_id(case_id: str) -> bool:
    """Return True for `BDMAP_` + 8 digits (the id is also a path component, so nothing else is accepted)."""
    return bool(CASE_ID_PATTERN.fullmatch(case_id))


def column(arrow_type: pa.DataType, doc: str, **kwargs: Any) -> Any:
    """Declare a dataclass field as a table column: its Arrow type and its description (`emrl_data.records`).

    Nullability comes from the field's type (`X | None` is nullable). Extra keyword arguments go to
    `dataclasses.field` (a default, `init=False`, ...).

    >>> from dataclasses import dataclass, fields
    >>> @dataclass
    ... class Row:
    ...     volume_mm3: float = column(pa.float64(), "lesion volume")
    >>> fields(Row)[0].metadata["doc"]
    'lesion volume'
    """
    return field(metadata={"arrow": arrow_type, "doc": doc}, **kwargs)
