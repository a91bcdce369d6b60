"""The atlas' IID split files (`TrainTestIDS/`) and the case-id hash split used where they say nothing."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from emrl_data.reading.atlas_cases import AtlasError, os_reason
from emrl_data.reading.atlas_csv import plan_file, read_csv_table
from emrl_data.types import Split, is_valid_case_id


SPLIT_DIR = "TrainTestIDS"
SPLIT_FILES = {Split.TRAIN: "IID_train.csv", Split.TEST: "IID_test.csv"}


@dataclass(frozen=True, slots=True)
class SplitListing:
    """What the IID split files say.

    Attributes:
        splits: case id -> split, for ids listed in exactly one split file.
        conflicts: case id -> the split files (relative to the root) listing it, for ids in more than one.
        problems: (file, problem) for lines that could not be read.
        warnings: notes about accepted quirks (cp1252 lines).
    """

    splits: dict[str, Split]
    conflicts: dict[str, tuple[str, ...]]
    problems: tuple[tuple[str, str], ...] = ()
    warnings: tuple[str, ...] = ()


def read_split_files(root: Path) -> SplitListing | None:
    """Read `TrainTestIDS/IID_{train,test}.csv` (column `BDMAP ID`, else the first column); None when absent.

    An id listed in both files is a conflict (never resolved by file order: that would leak test cases into train).

    Raises:
        AtlasError: a split file exists but cannot be read.
    """
    files = {
        split: root / SPLIT_DIR / name for split, name in SPLIT_FILES.items() if plan_file(root / SPLIT_DIR / name)
    }
    if not files:
        return None
    listed: dict[str, list[tuple[Split, str]]] = {}
    problems: list[tuple[str, str]] = []
    warnings: list[str] = []
    for split, path in files.items():
        rel = f"{SPLIT_DIR}/{path.name}"
        try:
            table = read_csv_table(path)
        except OSError as err:
            raise AtlasError(f"cannot read the split file {rel}: {os_reason(err)}") from None
        except ValueError as err:
            raise AtlasError(f"cannot use the split file {rel}: {err}") from None
        col = table.header.index("BDMAP ID") if "BDMAP ID" in table.header else 0
        lines = list(table.records)
        if table.header and len(table.header) > col and is_valid_case_id(table.header[col]):  # a header-less file
            lines.insert(0, (1, table.header))
        for n, problem, cells in table.bad_lines:
            if len(cells) > col and is_valid_case_id(cells[col]):  # the id itself is clean ASCII: still listed
                lines.append((n, cells))
                warnings.append(f"{rel} line {n}: {problem}; its case id {cells[col]} is still listed")
            else:
                problems.append((rel, f"{rel} line {n}: {problem}; no case id readable in it"))
        for _, cells in lines:
            if len(cells) > col and cells[col] and (split, rel) not in listed.get(cells[col], []):
                listed.setdefault(cells[col], []).append((split, rel))
        if not any(len(cells) > col and is_valid_case_id(cells[col]) for _, cells in lines):
            warnings.append(f"{rel} lists no valid case id (column {table.header[col] if table.header else 0!r})")
        warnings += [table.encoding_note] if table.encoding_note else []
    splits = {cid: entries[0][0] for cid, entries in listed.items() if len(entries) == 1}
    conflicts = {cid: tuple(rel for _, rel in entries) for cid, entries in listed.items() if len(entries) > 1}
    return SplitListing(splits, conflicts, tuple(problems), tuple(warnings))


def hash_split(case_id: str, *, test_fraction: float = 0.10) -> Split:
    """Deterministic split from the case id: sha256 -> [0, 1) -> test when below `test_fraction`."""
    value = int.from_bytes(hashlib.sha256(case_id.encode()).digest()[:8], "big") / 2**64
    return Split.TEST if value < test_fraction else Split.TRAIN
