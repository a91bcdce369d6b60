"""Shared value types: organs, case ids, splits. The single owner of these names."""

from __future__ import annotations

import re
from enum import StrEnum


class Organ(StrEnum):
    """An organ row of the dataset. Kidney covers both kidneys (location says which)."""

    LIVER = "liver"
    PANCREAS = "pancreas"
    KIDNEY = "kidney"


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
