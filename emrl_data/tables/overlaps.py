"""The same CT in two output folders: the fingerprint table, the pairs it finds, and the test cases a split refuses.

Every `build-sft-set` run writes `OUT/fingerprints.parquet`: one row per case whose CT was read (case id, split,
fingerprint version, the slice hashes of `emrl_data.labeling.fingerprint`). Two cases are the same CT when at least
`MIN_RUN_SLICES` consecutive slices of one equal consecutive slices of the other at one offset
(docs/data.md#the-same-ct-in-two-datasets).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from emrl_data.atomic_write import write_bytes_atomic, write_text_atomic
from emrl_data.labeling.fingerprint import FINGERPRINT_VERSION, NO_HASH, CtFingerprint
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.types import Split


FINGERPRINT_FILE = "fingerprints.parquet"
MIN_RUN_SLICES = 3  # consecutive equal slices that make two cases the same CT
OVERLAP_COLUMNS = ("case_id_a", "split_a", "case_id_b", "split_b", "matched_slices", "z_start_a_vox", "z_start_b_vox")
_SCHEMA = pa.schema(
    [
        ("case_id", pa.string()),
        ("split", pa.string()),
        ("fingerprint_version", pa.int32()),
        ("slice_hashes", pa.list_(pa.uint64())),
    ]
)


@dataclass(frozen=True, slots=True)
class FingerprintRow:
    """One case of a fingerprint table: its id, its split (None when unknown) and its slice hashes (uint64)."""

    case_id: str
    split: str | None
    slice_hashes: np.ndarray


@dataclass(frozen=True, slots=True)
class Overlap:
    """Case A and case B are the same CT: `matched_slices` consecutive slices equal, from z_start_a / z_start_b on."""

    case_id_a: str
    split_a: str | None
    case_id_b: str
    split_b: str | None
    matched_slices: int
    z_start_a_vox: int
    z_start_b_vox: int


def fingerprint_rows(
    case_ids: Sequence[str],
    fingerprints: Mapping[str, CtFingerprint],
    splits: Mapping[str, str],
    rows: Sequence[Mapping[str, Any]],
) -> list[FingerprintRow]:
    """The table's rows, by case id: the planned split, else the split of the case's organ rows, else None."""
    row_splits = {row["case_id"]: row["split"] for row in rows}
    return [
        FingerprintRow(case_id, splits.get(case_id, row_splits.get(case_id)), _hashes(fingerprints[case_id]))
        for case_id in sorted(set(case_ids) & set(fingerprints))
    ]


def _hashes(fingerprint: CtFingerprint) -> np.ndarray:
    return np.asarray(fingerprint.slice_hashes, dtype=np.uint64)


def write_fingerprints(out: Path, table: Sequence[FingerprintRow]) -> Path:
    """Write `OUT/fingerprints.parquet` atomically (same rows, same bytes); return its path."""
    arrow = pa.table(
        {
            "case_id": [r.case_id for r in table],
            "split": [r.split for r in table],
            "fingerprint_version": [FINGERPRINT_VERSION] * len(table),
            "slice_hashes": [r.slice_hashes.tolist() for r in table],
        },
        schema=_SCHEMA,
    )
    sink = io.BytesIO()
    pq.write_table(arrow, sink)
    path = Path(out) / FINGERPRINT_FILE
    write_bytes_atomic(sink.getvalue(), path)
    return path


def read_fingerprints(out: Path) -> list[FingerprintRow]:
    """Read an output folder's fingerprint table.

    Raises:
        FileNotFoundError: the folder holds no fingerprint table (the message names the file and the fix).
        ValueError: the table is unreadable or was written by another fingerprint version.
    """
    path = Path(out) / FINGERPRINT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no fingerprint table; run `emrl build-sft-set` into {out} to write one")
    try:
        table = pq.read_table(path, schema=_SCHEMA).to_pydict()
    except (OSError, ValueError, pa.ArrowException) as err:
        raise ValueError(f"{path}: not a fingerprint table ({' '.join(str(err).split())[:200]})") from None
    versions = set(table["fingerprint_version"])
    if versions - {FINGERPRINT_VERSION}:
        raise ValueError(
            f"{path}: fingerprint version {sorted(versions)}, this code writes {FINGERPRINT_VERSION}: "
            "rerun `emrl build-sft-set` into that folder (finished cases are reused)"
        )
    return [
        FingerprintRow(case_id, split, np.asarray(hashes, dtype=np.uint64))
        for case_id, split, hashes in zip(table["case_id"], table["split"], table["slice_hashes"], strict=True)
    ]


def find_overlaps(
    a: Sequence[FingerprintRow], b: Sequence[FingerprintRow], *, min_run_slices: int = MIN_RUN_SLICES
) -> list[Overlap]:
    """Every (case of A, case of B) pair sharing a run of at least `min_run_slices` consecutive equal slices.

    A pair's `matched_slices` is its longest such run (at one offset z_a - z_b). Sorted by case id A, then B.
    """
    hash_a, case_a, z_a = _flatten(a)
    hash_b, case_b, z_b = _flatten(b)
    order = np.argsort(hash_b, kind="stable")
    hash_b, case_b, z_b = hash_b[order], case_b[order], z_b[order]
    lo = np.searchsorted(hash_b, hash_a, side="left")
    hi = np.searchsorted(hash_b, hash_a, side="right")
    counts = hi - lo
    if not counts.any():
        return []
    which_a = np.repeat(np.arange(hash_a.size), counts)
    which_b = np.concatenate([np.arange(s, e) for s, e in zip(lo[counts > 0], hi[counts > 0], strict=True)])
    ia, ib, za, zb = case_a[which_a], case_b[which_b], z_a[which_a], z_b[which_b]
    offset = za - zb
    order = np.lexsort((za, offset, ib, ia))
    ia, ib, za, offset = ia[order], ib[order], za[order], offset[order]
    starts = np.r_[True, (ia[1:] != ia[:-1]) | (ib[1:] != ib[:-1]) | (offset[1:] != offset[:-1]) | (np.diff(za) != 1)]
    run_id = np.cumsum(starts) - 1
    lengths = np.bincount(run_id)
    first = np.flatnonzero(starts)
    best: dict[tuple[int, int], tuple[int, int, int]] = {}
    for run in np.flatnonzero(lengths >= min_run_slices):
        i, j, start = int(ia[first[run]]), int(ib[first[run]]), int(first[run])
        found = (int(lengths[run]), int(za[start]), int(za[start] - offset[start]))
        if (i, j) not in best or found[0] > best[(i, j)][0]:
            best[(i, j)] = found
    pairs = [
        Overlap(a[i].case_id, a[i].split, b[j].case_id, b[j].split, n, start_a, start_b)
        for (i, j), (n, start_a, start_b) in best.items()
    ]
    return sorted(pairs, key=lambda o: (o.case_id_a, o.case_id_b))


def _flatten(table: Sequence[FingerprintRow]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hash, case index, z) of every hashed slice of a table."""
    hashes = [r.slice_hashes for r in table]
    flat = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
    case = np.repeat(np.arange(len(table)), [h.size for h in hashes]).astype(np.int64)
    z = np.concatenate([np.arange(h.size) for h in hashes]).astype(np.int64) if hashes else np.zeros(0, np.int64)
    keep = flat != NO_HASH
    return flat[keep], case[keep], z[keep]


def write_overlaps_csv(overlaps: Sequence[Overlap], path: Path) -> None:
    """Write the pairs as CSV (`OVERLAP_COLUMNS`, one pair a line), atomically."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(OVERLAP_COLUMNS)
    writer.writerows([[getattr(o, c) if getattr(o, c) is not None else "" for c in OVERLAP_COLUMNS] for o in overlaps])
    write_text_atomic(text.getvalue(), Path(path))


def exclude_overlapping_tests(
    rows: Sequence[dict[str, Any]],
    here: Sequence[FingerprintRow],
    other: Sequence[FingerprintRow],
    other_name: str,
) -> tuple[list[dict[str, Any]], list[Rejection]]:
    """Refuse every test case of this run that is a training CT of the other folder.

    Args:
        rows: this run's organ rows.
        here: this run's fingerprint table (its splits say which cases are test cases).
        other: the other folder's fingerprint table (its splits say which CTs it trains on).
        other_name: the other folder, for the rejection's message.

    Returns:
        The rows of every other case, and one `overlaps_training_ct` rejection (step "overlaps") per refused case.
    """
    tests = [r for r in here if r.split == str(Split.TEST)]
    trains = [r for r in other if r.split == str(Split.TRAIN)]
    found: dict[str, list[Overlap]] = {}
    for pair in find_overlaps(tests, trains):
        found.setdefault(pair.case_id_a, []).append(pair)
    rejections = []
    for case_id, pairs in found.items():
        same = ", ".join(f"{p.case_id_b} ({p.matched_slices} slices)" for p in pairs[:3])
        more = f" and {len(pairs) - 3} more" if len(pairs) > 3 else ""
        detail = (
            f"{case_id}: a test case that is the same CT as the training case(s) {same}{more} of {other_name}: "
            "a train/test leak; the case is not used"
        )
        rejections.append(Rejection(case_id, None, "overlaps", RejectReason.OVERLAPS_TRAINING_CT, detail))
    return [row for row in rows if row["case_id"] not in found], rejections
