"""The AbdomenAtlas 3.0 layout on disk: the only module that knows file names and folder layouts (SPEC §2).

Two layouts are supported:

* split (as released): `image_only/<id>/ct.nii.gz` + `mask_only/<id>/segmentations/<structure>.nii.gz`
* combined (RadGPT's): `<id>/ct.nii.gz` + `<id>/segmentations/<structure>.nii.gz`

Files may also be uncompressed `.nii`. Structure names are spelled as released (notes/atlas.md §1.3).
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from emrl_data.organs import LOCATION_NAMES, METADATA_COLUMNS, ORGAN_STRUCTURES, OrganSpec  # noqa: F401 - re-exported
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.types import Organ, Split, is_valid_case_id


# Organ knowledge lives in the registry; these names stay as lookups into it (organ -> structures / location names /
# metadata-CSV columns).
OrganStructures = OrganSpec

CT_FILE_STEM = "ct"
NIFTI_SUFFIXES = (".nii.gz", ".nii")


@dataclass(frozen=True, slots=True)
class CaseRef:
    """Where one case's files are. Paths are absolute; `root` is the atlas root they are relative to."""

    case_id: str
    root: Path
    ct_path: Path  # may not exist (-> missing_ct rejection)
    mask_dir: Path  # the `segmentations/` folder (may not exist)

    def structure_path(self, structure: str) -> Path | None:
        """Return the file of `structure` (`.nii.gz` preferred, then `.nii`), or None when neither exists."""
        for suffix in NIFTI_SUFFIXES:
            path = self.mask_dir / f"{structure}{suffix}"
            if path.is_file():
                return path
        return None

    def relative(self, path: Path) -> str:
        """Return `path` relative to the atlas root (for messages and tables), or as given when outside it."""
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)


# --------------------------------------------------------------------------------------------------------------------
# Discovery


@dataclass(frozen=True, slots=True)
class Discovery:
    """What `discover_cases` found: valid case references and the folders rejected on the way."""

    layout: str  # "split" or "combined"
    refs: tuple[CaseRef, ...]
    rejections: tuple[Rejection, ...]


def discover_cases(root: Path) -> Discovery:
    """List the cases under an atlas root, in case-id order.

    Candidate folders are those whose name starts with `BDMAP` (RadGPT's rule); a candidate whose name is not
    `BDMAP_` + 8 digits becomes an `invalid_case_id` rejection (the id is also a path component).

    Raises:
        FileNotFoundError: when `root` is not a folder.
    """
    root = Path(root).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"Atlas root {root} is not a folder.")
    image_dir, mask_dir = root / "image_only", root / "mask_only"
    layout = "split" if image_dir.is_dir() or mask_dir.is_dir() else "combined"
    parents = (image_dir, mask_dir) if layout == "split" else (root,)
    names = sorted({p.name for parent in parents if parent.is_dir() for p in parent.iterdir() if p.is_dir()})
    refs: list[CaseRef] = []
    rejections: list[Rejection] = []
    for name in names:
        if not name.startswith("BDMAP"):
            continue
        if not is_valid_case_id(name):
            where = f"image_only/{name}" if layout == "split" else name
            rejections.append(
                Rejection(
                    name,
                    None,
                    "discover",
                    RejectReason.INVALID_CASE_ID,
                    f"folder {where!r} is not BDMAP_ followed by 8 digits",
                    where,
                )
            )
            continue
        if layout == "split":
            refs.append(
                CaseRef(name, root, _nifti(image_dir / name / CT_FILE_STEM), mask_dir / name / "segmentations")
            )
        else:
            refs.append(CaseRef(name, root, _nifti(root / name / CT_FILE_STEM), root / name / "segmentations"))
    return Discovery(layout, tuple(refs), tuple(rejections))


def _nifti(stem: Path) -> Path:
    """Return `stem.nii.gz`, or `stem.nii` when only that exists (the `.nii.gz` path when neither does)."""
    gz, plain = stem.with_name(stem.name + ".nii.gz"), stem.with_name(stem.name + ".nii")
    return plain if not gz.exists() and plain.exists() else gz


# --------------------------------------------------------------------------------------------------------------------
# Splits


SPLIT_DIR = "TrainTestIDS"


def read_split_files(root: Path) -> dict[str, Split] | None:
    """Read `TrainTestIDS/IID_{train,test}.csv` (column `BDMAP ID`, else the first column); None when absent."""
    files = {Split.TRAIN: root / SPLIT_DIR / "IID_train.csv", Split.TEST: root / SPLIT_DIR / "IID_test.csv"}
    if not any(p.is_file() for p in files.values()):
        return None
    splits: dict[str, Split] = {}
    for split, path in files.items():
        if not path.is_file():
            continue
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            header = next(reader, [])
            col = header.index("BDMAP ID") if "BDMAP ID" in header else 0
            if header and is_valid_case_id(header[col].strip()):  # a header-less file
                splits[header[col].strip()] = split
            for line in reader:
                if len(line) > col and line[col].strip():
                    splits[line[col].strip()] = split
    return splits


def hash_split(case_id: str, *, test_fraction: float = 0.10) -> Split:
    """Deterministic split from the case id: sha256 -> [0, 1) -> test when below `test_fraction`."""
    value = int.from_bytes(hashlib.sha256(case_id.encode()).digest()[:8], "big") / 2**64
    return Split.TEST if value < test_fraction else Split.TRAIN


# --------------------------------------------------------------------------------------------------------------------
# Metadata CSV (weak labels kept beside ours as `atlas_*` columns)


METADATA_FILE = "AbdomenAtlas3.0MiniWithMeta.csv"


@dataclass(frozen=True, slots=True)
class AtlasOrganMeta:
    """The metadata CSV's weak labels for one organ of one case (None = column absent or empty)."""

    lesion_count: int | None
    long_axis_cm: float | None
    location: tuple[str, ...] | None
    attenuation: str | None
    organ_volume_cm3: float | None


def read_metadata(path: Path) -> tuple[dict[str, dict[Organ, AtlasOrganMeta]], dict[str, str]]:
    """Parse the metadata CSV by column NAME (never by position); tolerate missing columns.

    Returns:
        (metadata per case id, problems per case id): a row that cannot be parsed is left out of the first dict and
        its problem (naming the file, the column and the value) is returned in the second.
    """
    rows: dict[str, dict[Organ, AtlasOrganMeta]] = {}
    problems: dict[str, str] = {}
    with path.open(newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None or "BDMAP ID" not in reader.fieldnames:
            raise ValueError(f"{path.name}: no 'BDMAP ID' column; found {reader.fieldnames}.")
        for line_no, record in enumerate(reader, start=2):
            case_id = (record.get("BDMAP ID") or "").strip()
            try:
                rows[case_id] = {organ: _organ_meta(organ, record) for organ in Organ}
            except ValueError as err:
                problems[case_id or f"line {line_no}"] = f"{path.name} line {line_no}: {err}"
    return rows, problems


def _organ_meta(organ: Organ, record: dict[str, str | None]) -> AtlasOrganMeta:
    cols = METADATA_COLUMNS[organ]

    def cell(key: str) -> str | None:
        value = record.get(cols[key])
        value = value.strip() if isinstance(value, str) else None
        return value if value and value.lower() != "nan" else None

    def number(key: str) -> float | None:
        value = cell(key)
        if value is None:
            return None
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"column {cols[key]!r} holds {value!r}, not a number") from None

    count = number("count")
    if count is not None and (count < 0 or count != int(count)):
        raise ValueError(f"column {cols['count']!r} holds {count!r}, not a lesion count")
    location = cell("location")
    attenuation = cell("attenuation")
    attenuation_code = None
    if attenuation is not None:
        attenuation_code = {"hypoattenuating": "hypo", "isoattenuating": "iso", "hyperattenuating": "hyper"}.get(
            attenuation.lower()
        )
        if attenuation_code is None:
            raise ValueError(f"column {cols['attenuation']!r} holds {attenuation!r}")
    return AtlasOrganMeta(
        lesion_count=None if count is None else int(count),
        long_axis_cm=number("diameter_cm"),
        location=None if location is None else sort_locations(organ, (p.strip() for p in location.split(","))),
        attenuation=attenuation_code,
        organ_volume_cm3=number("organ_volume_cm3"),
    )


def sort_locations(organ: Organ, names: Iterable[str]) -> tuple[str, ...]:
    """Return location names de-duplicated and in vocabulary order (`LOCATION_NAMES`); unknown names raise."""
    vocab = LOCATION_NAMES[organ]
    chosen = {n for n in names if n}
    unknown = chosen - set(vocab)
    if unknown:
        raise ValueError(f"unknown {organ} location(s) {sorted(unknown)}; valid: {list(vocab)}")
    return tuple(n for n in vocab if n in chosen)


# --------------------------------------------------------------------------------------------------------------------
# The plan of a run: cases, their splits and metadata, and what was rejected before any image was read


@dataclass(frozen=True, slots=True)
class AtlasPlan:
    """Everything known about an atlas before its images are read."""

    layout: str
    refs: tuple[CaseRef, ...]
    splits: dict[str, str]
    split_source: str  # "IID split files" or "case-id hash"
    metadata: dict[str, dict[Organ, AtlasOrganMeta]]
    rejections: tuple[Rejection, ...]  # invalid case ids, unreadable metadata rows


def plan_atlas(root: Path, *, limit: int | None = None, test_fraction: float = 0.10) -> AtlasPlan:
    """Discover the cases, assign splits (IID files, else the hash split) and read the metadata CSV if present.

    A case missing from existing split files gets the hash split. A metadata row that cannot be parsed becomes a
    `bad_metadata_row` rejection (step "metadata"); the case itself still runs, without `atlas_*` values.
    """
    root = Path(root).resolve()
    discovery = discover_cases(root)
    refs = discovery.refs[:limit] if limit is not None else discovery.refs
    split_files = read_split_files(root)
    splits = {
        r.case_id: str(
            split_files[r.case_id]
            if split_files and r.case_id in split_files
            else hash_split(r.case_id, test_fraction=test_fraction)
        )
        for r in refs
    }
    rejections = list(discovery.rejections)
    metadata: dict[str, dict[Organ, AtlasOrganMeta]] = {}
    if (root / METADATA_FILE).is_file():
        metadata, problems = read_metadata(root / METADATA_FILE)
        wanted = {r.case_id for r in refs}
        for case_id, problem in sorted(problems.items()):
            if case_id in wanted or not is_valid_case_id(case_id):
                rejections.append(
                    Rejection(case_id, None, "metadata", RejectReason.BAD_METADATA_ROW, problem, METADATA_FILE)
                )
    return AtlasPlan(
        discovery.layout,
        tuple(refs),
        splits,
        "IID split files" if split_files else "case-id hash",
        metadata,
        tuple(rejections),
    )
