"""AbdomenAtlas 3.0 as released on the Hub: the part names, their case ranges, and image/mask pairing.

The release holds `image_only/AbdomenAtlas3_images_BDMAP_BDMAP_{start:08d}_BDMAP_{end:08d}.tar.gz` and the
`mask_only/AbdomenAtlas3_masks_BDMAP_BDMAP_…tar.gz` part of the same range (232 cases each, the last one ending at
BDMAP_00009262), the metadata CSV and `TrainTestIDS/{IID,OOD}_{train,test}.csv`. This module only knows names and
numbers; reading the Hub is in `hub/`, reading the archives in `emrl_data.reading.archive`.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from emrl_data.reading.atlas import METADATA_FILE, SPLIT_DIR


RELEASE_REPO = "AbdomenAtlas/AbdomenAtlas3.0Mini"
RELEASE_CASES = 9262  # BDMAP_00000001 .. BDMAP_00009262
RELEASE_PART_CASES = 232
IMAGE_DIR, MASK_DIR = "image_only", "mask_only"
SPLIT_CSVS = tuple(f"{SPLIT_DIR}/{kind}_{split}.csv" for kind in ("IID", "OOD") for split in ("train", "test"))
SIDE_FILES = (METADATA_FILE, *SPLIT_CSVS)  # the small files a run reads besides the parts
_PREFIX = {IMAGE_DIR: "AbdomenAtlas3_images", MASK_DIR: "AbdomenAtlas3_masks"}
_PART_NAME = re.compile(
    r"^(image_only|mask_only)/AbdomenAtlas3_(images|masks)_BDMAP_BDMAP_(\d{8})_BDMAP_(\d{8})\.tar\.gz$"
)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True, slots=True)
class HubFile:
    """One file of a Hub revision: its path, size in bytes, sha256 (the LFS oid; None for a non-LFS file) and git blob
    id (`sha1(b"blob <size>\\0" + bytes)` of a non-LFS file; of the LFS pointer for an LFS file)."""

    path: str
    size: int
    sha256: str | None
    blob_id: str | None = None


@dataclass(frozen=True, slots=True)
class PartPair:
    """The image part and the mask part of one case range `[start, end]` (inclusive, as in the names)."""

    start: int
    end: int
    image: HubFile | None
    mask: HubFile | None

    @property
    def name(self) -> str:
        """`BDMAP_{start:08d}_BDMAP_{end:08d}`: the range as the part names spell it."""
        return f"BDMAP_{self.start:08d}_BDMAP_{self.end:08d}"

    def holds(self, case_id: str) -> bool:
        """True when `case_id` (`BDMAP_` + 8 digits) is inside this part's range."""
        return self.start <= int(case_id[6:]) <= self.end

    def case_ids(self) -> tuple[str, ...]:
        """Every id of the range, in order."""
        return tuple(f"BDMAP_{n:08d}" for n in range(self.start, self.end + 1))

    @property
    def bytes(self) -> int:
        """Bytes of both parts (0 for a missing one)."""
        return sum(f.size for f in (self.image, self.mask) if f is not None)


def part_ranges(n_cases: int = RELEASE_CASES, part_cases: int = RELEASE_PART_CASES) -> list[tuple[int, int]]:
    """The release's case ranges: `[(1, 232), (233, 464), ..., (9049, 9262)]` for the defaults.

    >>> part_ranges(8, 3)
    [(1, 3), (4, 6), (7, 8)]
    """
    if n_cases < 1 or part_cases < 1:
        raise ValueError(f"{n_cases=} and {part_cases=} must be >= 1.")
    return [(s, min(s + part_cases - 1, n_cases)) for s in range(1, n_cases + 1, part_cases)]


def part_name(kind: str, start: int, end: int) -> str:
    """The released path of a part: `kind` is `image_only` or `mask_only`.

    >>> part_name("mask_only", 1, 232)
    'mask_only/AbdomenAtlas3_masks_BDMAP_BDMAP_00000001_BDMAP_00000232.tar.gz'
    """
    if kind not in _PREFIX:
        raise ValueError(f"kind={kind!r} must be {IMAGE_DIR!r} or {MASK_DIR!r}.")
    return f"{kind}/{_PREFIX[kind]}_BDMAP_BDMAP_{start:08d}_BDMAP_{end:08d}.tar.gz"


def parse_part_name(path: str) -> tuple[str, int, int] | None:
    """`(kind, start, end)` of a released part path, None for any other path (or a range that runs backwards)."""
    match = _PART_NAME.match(path)
    if match is None or match[2] != _PREFIX[match[1]].rsplit("_", 1)[1]:
        return None
    start, end = int(match[3]), int(match[4])
    return (match[1], start, end) if 1 <= start <= end else None


def pair_parts(files: Iterable[HubFile]) -> tuple[list[PartPair], list[str]]:
    """Pair each image part with the mask part of the same range; return the pairs by range and warnings.

    A part without its partner still forms a pair (its cases then lack their CT or their masks, and are rejected
    as on disk); ranges that overlap another are warned, since a case would come from two parts.
    """
    found: dict[tuple[int, int], dict[str, HubFile]] = {}
    for f in files:
        parsed = parse_part_name(f.path)
        if parsed is not None:
            found.setdefault(parsed[1:], {})[parsed[0]] = f
    pairs = [PartPair(s, e, kinds.get(IMAGE_DIR), kinds.get(MASK_DIR)) for (s, e), kinds in sorted(found.items())]
    warnings = [
        f"{p.name}: no {'mask' if p.mask is None else 'image'} part; its cases lack their "
        f"{'masks' if p.mask is None else 'CT'}"
        for p in pairs
        if p.image is None or p.mask is None
    ]
    warnings += [f"{a.name} overlaps {b.name}" for a, b in zip(pairs, pairs[1:], strict=False) if b.start <= a.end]
    return pairs, warnings


def parse_size(text: str | int) -> int:
    """Bytes of a size such as `64G`, `500MB`, `1.5T` or `1048576` (binary units: 1G = 2**30 bytes).

    >>> parse_size("1.5K")
    1536
    """
    if isinstance(text, int):
        size = text
    else:
        match = _SIZE.match(text)
        if match is None:
            raise ValueError(f"size {text!r} is not a number of bytes with an optional K, M, G or T (e.g. 64G).")
        size = int(float(match[1]) * _UNITS[match[2].upper()])
    if size < 1:
        raise ValueError(f"size {text!r} must be at least one byte.")
    return size


def format_size(n: int) -> str:
    """`n` bytes in the largest binary unit that keeps it >= 1 (one decimal): `format_size(1536) == '1.5 KiB'`."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def side_files(files: Mapping[str, HubFile]) -> list[HubFile]:
    """The metadata CSV and split files present in a revision's listing (path -> file), in release order."""
    return [files[p] for p in SIDE_FILES if p in files]


def scratch_need(pair: PartPair) -> int:
    """Scratch bytes one part pair is planned to hold at most while it is curated, as `[image + 3 x mask + 4 cases]`.

    The mask part is downloaded and unpacked (its `.tar.gz` removed), then the image part is downloaded and its CTs
    are unpacked one at a time; unpacked `.nii.gz` members take about the bytes of their compressed share. The
    margin (3 x mask, 4 x the mean case of the image part) covers masks that unpack larger and CTs above the mean; the
    per-part allowance is enforced member by member (`emrl_data.reading.archive.ScratchMeter`) all the same.
    """
    image = pair.image.size if pair.image is not None else 0
    mask = pair.mask.size if pair.mask is not None else 0
    n_cases = pair.end - pair.start + 1
    return image + 3 * mask + 4 * -(-image // n_cases)


def plan_concurrency(pairs: Iterable[PartPair], budget_bytes: int, max_workers: int) -> tuple[int, int]:
    """`(parts at once, scratch allowance of each)` for a scratch budget: as many parts as the budget holds.

    Raises:
        ValueError: the budget cannot hold the largest part pair.
    """
    pairs = list(pairs)
    need = max((scratch_need(p) for p in pairs), default=1)
    if budget_bytes < need:
        raise ValueError(
            f"the scratch budget {format_size(budget_bytes)} is below the {format_size(need)} the largest part pair "
            "needs (image part + 3 x mask part + 4 cases); raise --scratch-budget"
        )
    concurrency = max(1, min(max_workers, len(pairs), budget_bytes // need))
    return concurrency, budget_bytes // concurrency


class ScratchSpaceError(ValueError):
    """The scratch folder's disk has less free space than the run will hold there."""


def scratch_bytes_planned(pairs: Iterable[PartPair], budget_bytes: int, concurrency: int) -> int:
    """The most scratch a run holds at once: its budget, or less when its pairs (all of them, or `concurrency` of the
    largest at once) need less."""
    needs = sorted((scratch_need(p) for p in pairs), reverse=True)
    return min(budget_bytes, sum(needs), sum(needs[:concurrency]) if needs else 0)


def check_scratch_space(folder: Path, need_bytes: int) -> None:
    """Refuse, before any part starts, a scratch folder whose disk cannot hold `need_bytes` (the bytes already in
    the folder, an interrupted run's verified parts, count as held).

    Raises:
        ScratchSpaceError: naming the folder, its free space and the bytes needed.
    """
    folder.mkdir(parents=True, exist_ok=True)
    held = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    free = shutil.disk_usage(folder).free
    if free + held < need_bytes:
        raise ScratchSpaceError(
            f"the scratch folder {folder} has {format_size(free)} free ({format_size(held)} already held there); "
            f"this run holds up to {format_size(need_bytes)} at once: free space there, point --scratch-dir at a "
            "larger disk, or lower --scratch-budget (fewer part pairs at once)"
        )
