"""The AbdomenAtlas 3.0 layout on disk: the only module that knows file names and folder layouts (docs/contract.md#input).

Two layouts are supported:

* split (as released): `image_only/<id>/ct.nii.gz` + `mask_only/<id>/segmentations/<structure>.nii.gz`
* combined (RadGPT's): `<id>/ct.nii.gz` + `<id>/segmentations/<structure>.nii.gz`

Files may also be uncompressed `.nii`. Structure names are spelled as released (docs/contract.md#input).

Every entry that looks like a case ends as a `CaseRef` or a `Rejection`; every other entry inside a layout folder is
named in a discovery warning (docs/decisions.md#reading-the-atlas).
"""

from __future__ import annotations

import csv
import errno
import hashlib
import logging
import math
import os
import re
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from emrl_data.organs import LOCATION_NAMES, METADATA_COLUMNS, ORGAN_STRUCTURES, OrganSpec  # noqa: F401 - re-exported
from emrl_data.outcome import CaseDataError, Rejection, RejectReason
from emrl_data.reading.fileio import describe_special, read_regular_bytes
from emrl_data.types import Organ, Split, is_valid_case_id


# Organ knowledge lives in the registry; these names stay as lookups into it (organ -> structures / location names /
# metadata-CSV columns).
OrganStructures = OrganSpec

logger = logging.getLogger(__name__)


class AtlasError(RuntimeError):
    """The atlas root as a whole cannot be used (not a case-level defect); the message is one line."""


class NoCasesError(AtlasError):
    """The atlas root holds no usable case; the message is one line saying what was found instead."""


CT_FILE_STEM = "ct"
NIFTI_SUFFIXES = (".nii.gz", ".nii")
# Words that make a file name lesion-like (a file of the organ holding one of them and not a known name is warned).
_LESION_WORDS = re.compile(r"(tumou?r|cyst|lesion|mass|pdac|pnet|metasta|nodule|cancer|carcinoma|hcc|neoplasm)")


def probe_file(path: Path, rel: str, what: str = "a NIfTI file") -> bool:
    """Return True for a regular file, False when nothing is at `path`; raise for anything in between. Opens nothing.

    Args:
        path: the file.
        rel: how messages call it.
        what: what belongs there, for messages ("a NIfTI file", "a CSV file").

    Raises:
        CaseDataError: UNREADABLE_FILE when the path exists (or is a link) but is not a readable regular file: a
            folder, a named pipe, a socket, a device (e.g. a symlink to /dev/zero), a dangling or looping symlink, a
            permission or I/O error on the way to it; the detail names the kind.
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        if os.path.islink(path):
            raise CaseDataError(
                RejectReason.UNREADABLE_FILE, f"{rel}: a symlink to nothing ({os.readlink(path)!r})", path=rel
            ) from None
        return False
    except OSError as err:
        raise CaseDataError(
            RejectReason.UNREADABLE_FILE, f"{rel}: cannot be read ({_os_reason(err)})", path=rel
        ) from None
    if not stat.S_ISREG(st.st_mode):
        kind = describe_special(path, st.st_mode)
        raise CaseDataError(RejectReason.UNREADABLE_FILE, f"{rel}: {kind} where {what} belongs", path=rel)
    return True


def printable(text: str) -> str:
    """Return `text` safe for tables and markdown: undecodable file-name bytes (surrogates) as `\\udcXX` escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _os_reason(err: OSError) -> str:
    """One-line reason of an OSError (strerror with the errno name)."""
    name = errno.errorcode.get(err.errno or 0, "")
    return f"{err.strerror or err}" + (f", {name}" if name else "")


@dataclass(frozen=True, slots=True)
class CaseRef:
    """Where one case's files are. Paths are absolute; `root` is the atlas root they are relative to."""

    case_id: str
    root: Path
    ct_path: Path  # may not exist (-> missing_ct rejection)
    mask_dir: Path  # the `segmentations/` folder (may not exist)

    def structure_path(self, structure: str) -> Path | None:
        """Return the file of `structure` (`.nii.gz` preferred, then `.nii`), or None when neither exists.

        Raises:
            CaseDataError: UNREADABLE_FILE when a candidate exists but cannot be read (see `probe_file`).
        """
        for suffix in NIFTI_SUFFIXES:
            path = self.mask_dir / f"{structure}{suffix}"
            if probe_file(path, self.relative(path)):
                return path
        return None

    def relative(self, path: Path) -> str:
        """Return `path` relative to the atlas root (for messages and tables), or as given when outside it."""
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)

    def mask_stems(self) -> tuple[str, ...]:
        """Return the structure names (file stems) in the mask folder, sorted; () when it is absent.

        Raises:
            CaseDataError: UNREADABLE_FILE when the mask folder exists but cannot be listed.
        """
        try:
            names = os.listdir(self.mask_dir)
        except (FileNotFoundError, NotADirectoryError):
            return ()
        except OSError as err:
            rel = self.relative(self.mask_dir)
            raise CaseDataError(
                RejectReason.UNREADABLE_FILE, f"{rel}: cannot be listed ({_os_reason(err)})", path=rel
            ) from None
        stems = {n[: -len(s)] for n in names for s in NIFTI_SUFFIXES if n.endswith(s)}
        return tuple(sorted(stems))


# Every structure file a row may read (organ masks, lesion files and their aliases and fallbacks, sub-structures):
# the case key hashes these files' content; any other file of the folder enters it by name only, never opened.
USED_STRUCTURES = frozenset(
    name
    for spec in ORGAN_STRUCTURES.values()
    for name in (
        *spec.organ_masks,
        spec.lesion_mask,
        *spec.lesion_aliases,
        *spec.lesion_fallbacks,
        *(part for part, _ in spec.parts),
    )
)


def structure_of(file_name: str) -> str | None:
    """The structure a mask-folder entry holds (`liver.nii.gz` -> `liver`), None for a name without a NIfTI suffix."""
    return next((file_name[: -len(s)] for s in NIFTI_SUFFIXES if file_name.endswith(s)), None)


def special_entries(ref: CaseRef) -> tuple[tuple[str, str], ...]:
    """Return `(path relative to the root, kind)` for every named pipe, socket or device (or symlink to one) in the
    case's image folder and mask folder, sorted; opens nothing (`scandir`, plus one `stat` per symlink or special entry).

    Folders, regular files and links that do not resolve are left out: a folder or a broken link where a file a row
    needs belongs is already a rejection (`probe_file`), and anywhere else it is no input at all.
    """
    found = []
    for folder in sorted({ref.ct_path.parent, ref.mask_dir}):
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False):
                    continue
                st = os.stat(entry.path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                continue
            path = Path(entry.path)
            found.append((printable(ref.relative(path)), describe_special(path, st.st_mode)))
    return tuple(found)


def lesion_files(ref: CaseRef, organ: Organ) -> tuple[str, ...]:
    """Return the structure names whose union is the organ's lesion mask (docs/decisions.md#lesion-files).

    The lesion file (`<organ>_lesion`, else an alias) alone when it exists; else every `*_tumor`/`*_cyst` (and
    pancreatic `pdac`/`pnet`) file of the organ that exists; else () (no lesion).
    """
    structures = ORGAN_STRUCTURES[organ]
    for name in (structures.lesion_mask, *structures.lesion_aliases):
        if ref.structure_path(name) is not None:
            return (name,)
    return tuple(name for name in structures.lesion_fallbacks if ref.structure_path(name) is not None)


def unrecognised_lesion_files(ref: CaseRef, organ: Organ, stems: Sequence[str] | None = None) -> tuple[str, ...]:
    """Return the organ's lesion-like files that no rule reads (e.g. `liver_mass`): they are warned, never used.

    A file is lesion-like when its stem (an AI-unrevised leading `_` stripped) starts with one of the organ's prefixes
    and holds a lesion word (tumor, cyst, lesion, mass, pdac, ...). Known names, sub-segments and organ masks are not.
    """
    structures = ORGAN_STRUCTURES[organ]
    known = {*structures.organ_masks, structures.lesion_mask, *structures.lesion_aliases, *structures.lesion_fallbacks}
    known |= {p for p, _ in structures.parts}
    found = []
    for stem in ref.mask_stems() if stems is None else stems:
        bare = stem.lstrip("_").lower()
        if stem in known or not bare.startswith(structures.lesion_prefixes):
            continue
        if _LESION_WORDS.search(bare):
            found.append(printable(stem))
    return tuple(found)


# --------------------------------------------------------------------------------------------------------------------
# Discovery


@dataclass(frozen=True, slots=True)
class Discovery:
    """What `discover_cases` found: valid case references, the entries rejected on the way, and warnings."""

    layout: str  # "split" or "combined"
    refs: tuple[CaseRef, ...]
    rejections: tuple[Rejection, ...]
    warnings: tuple[str, ...] = ()


SPLIT_LAYOUT_DIRS = ("image_only", "mask_only")
# Entries of the atlas root that are expected and never a case (checked by name, not warned).
_ROOT_KNOWN = {"TrainTestIDS", *SPLIT_LAYOUT_DIRS}


@dataclass(slots=True)
class _Entries:
    """Case-like entries of one layout folder (name -> problem or None) and the other entries in it."""

    cases: dict[str, str | None] = field(default_factory=dict)
    others: list[str] = field(default_factory=list)


def _is_case_like(name: str) -> bool:
    return name[:5].upper() == "BDMAP"


def _scan(folder: Path, rel: str) -> _Entries:
    """Classify every entry of a layout folder: case-like names with their problem (None = a readable folder)."""
    entries = _Entries()
    try:
        names = sorted(os.listdir(folder))
    except OSError as err:
        raise AtlasError(f"cannot list the atlas folder {folder}: {_os_reason(err)}") from None
    for name in names:
        if not _is_case_like(name):
            entries.others.append(name)
            continue
        entries.cases[name] = _folder_problem(folder / name, folder, f"{rel}{name}")
    return entries


def _folder_problem(path: Path, parent: Path, rel: str) -> str | None:
    """Return why `path` cannot be a case folder (None when it is a folder): loops, files, links to an ancestor."""
    try:
        st = os.stat(path)
    except OSError as err:
        if os.path.islink(path):
            return f"{rel!r} is a symlink that does not resolve ({_os_reason(err)})"
        return f"{rel!r} cannot be read ({_os_reason(err)})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{rel!r} is a file where a case folder belongs"
    if os.path.islink(path):
        target, base = path.resolve(), parent.resolve()
        if target == base or target in base.parents:
            return f"{rel!r} is a symlink to its own parent folder {os.readlink(path)!r}"
    return None


def discover_cases(root: Path) -> Discovery:
    """List the cases under an atlas root, in case-id order; every case-like entry ends as a ref or a rejection.

    Case-like entries are those whose name starts with `BDMAP` in any letter case (RadGPT's rule). A name that is
    not `BDMAP_` + 8 digits is an `invalid_case_id` rejection (the id is also a path component); a case-like entry
    that is a file, a dangling or looping symlink, a link to its own parent, or a case folder outside the layout's
    folders (mixed layouts) is a `not_a_case` rejection. The layout is where the cases are: `image_only/` and
    `mask_only/` when they hold any case-like entry, else the root (an empty `image_only/` beside root-level cases
    is named in a warning). Other entries inside a layout folder are named in a warning.

    Raises:
        FileNotFoundError: when `root` is not a folder.
        AtlasError: when a layout folder cannot be listed.
        NoCasesError: when no valid case is found.
    """
    root = Path(root).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"Atlas root {root} is not a folder.")
    top = _scan(root, "")
    split = {d: _scan(root / d, f"{d}/") for d in SPLIT_LAYOUT_DIRS if (root / d).is_dir()}
    warnings: list[str] = []
    layout = "split" if any(e.cases for e in split.values()) or (split and not top.cases) else "combined"
    if layout == "combined" and split:
        warnings.append(f"{' and '.join(f'{d}/' for d in split)} hold no case folder: ignored (combined layout)")
    rejections: list[Rejection] = []
    refs: list[CaseRef] = []
    if layout == "split":
        for name, problem in top.cases.items():
            where = f"{name!r} is a case folder outside image_only/ and mask_only/ (mixed layouts)"
            rejections.append(_discovery_rejection(name, RejectReason.NOT_A_CASE, problem or where, name))
        for d, entries in split.items():
            warnings += _stray_warnings(f"{d}/", entries.others)
        names = sorted({n for e in split.values() for n in e.cases})
        for name in names:
            problems = [(f"{d}/{name}", e.cases[name]) for d, e in split.items() if name in e.cases]
            ref = _case_ref(root, name, problems, rejections, layout)
            if ref is not None:
                refs.append(ref)
    else:
        unexpected = [n for n in top.others if (root / n).is_dir() and n not in _ROOT_KNOWN and not n.startswith(".")]
        warnings += [f"{n}/: not a case folder (name does not start with BDMAP), ignored" for n in unexpected]
        for name, problem in top.cases.items():
            ref = _case_ref(root, name, [(name, problem)], rejections, layout)
            if ref is not None:
                refs.append(ref)
    if not refs:
        found = (
            f"; {len(rejections)} case-like entr{'y' if len(rejections) == 1 else 'ies'} rejected"
            if rejections
            else ""
        )
        raise NoCasesError(
            f"no case under {root}: expected image_only/BDMAP_XXXXXXXX/ (split layout) or BDMAP_XXXXXXXX/ folders"
            + found
            + (f" (first: {rejections[0].detail})" if rejections else "")
        )
    warnings = [printable(w) for w in warnings]
    for message in warnings:
        logger.warning("atlas %s: %s", root, message)
    return Discovery(layout, tuple(refs), tuple(sorted(rejections, key=_rejection_order)), tuple(warnings))


def _stray_warnings(prefix: str, names: list[str]) -> list[str]:
    """One warning per stray entry of a layout folder; hidden ones (`.DS_Store`, `._BDMAP…`) summed in one line."""
    hidden = [n for n in names if n.startswith(".")]
    lines = [
        f"{prefix}{n}: not a case folder (name does not start with BDMAP), ignored" for n in names if n not in hidden
    ]
    if hidden:
        lines.append(
            f"{prefix}: {len(hidden)} hidden entr{'y' if len(hidden) == 1 else 'ies'} ignored ({hidden[0]}, ...)"
        )
    return lines


def _rejection_order(r: Rejection) -> tuple[str, str]:
    return (r.case_id, r.path or "")


def _case_ref(
    root: Path, name: str, problems: list[tuple[str, str | None]], rejections: list[Rejection], layout: str
) -> CaseRef | None:
    """Return the case's ref, or None after appending its rejection (bad id, or an entry that is not a folder)."""
    where = problems[0][0]
    if not is_valid_case_id(name):
        hint = f" (did you mean {name.upper()!r}?)" if is_valid_case_id(name.upper()) else ""
        detail = f"folder {where!r} is not BDMAP_ followed by 8 digits{hint}"
        rejections.append(_discovery_rejection(name, RejectReason.INVALID_CASE_ID, detail, where))
        return None
    bad = [(rel, problem) for rel, problem in problems if problem is not None]
    if bad:
        rel, problem = bad[0]
        rejections.append(_discovery_rejection(name, RejectReason.NOT_A_CASE, problem or rel, rel))
        return None
    if layout == "split":
        image_dir, mask_dir = root / "image_only", root / "mask_only"
        return CaseRef(name, root, nifti_path(image_dir / name / CT_FILE_STEM), mask_dir / name / "segmentations")
    return CaseRef(name, root, nifti_path(root / name / CT_FILE_STEM), root / name / "segmentations")


def _discovery_rejection(name: str, reason: RejectReason, detail: str, path: str) -> Rejection:
    return Rejection(printable(name), None, "discover", reason, printable(detail), printable(path))


def nifti_path(stem: Path) -> Path:
    """Return `stem.nii.gz`, or `stem.nii` when only that exists (the `.nii.gz` path when neither does)."""
    gz, plain = stem.with_name(stem.name + ".nii.gz"), stem.with_name(stem.name + ".nii")
    return plain if not os.path.lexists(gz) and os.path.lexists(plain) else gz


# --------------------------------------------------------------------------------------------------------------------
# Robust CSV reading (metadata and split files assembled from many sources)


_FIELD_LIMIT = min(sys.maxsize, 2**31 - 1)
_DELIMITERS = (",", ";", "\t")


@dataclass(frozen=True, slots=True)
class CsvTable:
    """A CSV file read robustly: its header, its records with their line numbers, and the lines it could not use.

    Attributes:
        header: the first record (stripped cells).
        records: (first physical line number, cells) per data record; blank records are left out.
        bad_lines: (line number, problem, cells) for records that could not be decoded (neither UTF-8 nor cp1252);
            the cells hold U+FFFD where the bytes were.
        encoding_note: None for clean UTF-8, else a note naming the lines decoded as cp1252.
        delimiter: the delimiter used.
    """

    header: tuple[str, ...]
    records: tuple[tuple[int, tuple[str, ...]], ...]
    bad_lines: tuple[tuple[int, str, tuple[str, ...]], ...]
    encoding_note: str | None
    delimiter: str


def read_csv_table(path: Path, *, key_column: str = "BDMAP ID") -> CsvTable:
    """Read a CSV from any of the atlas' sources: UTF-8 (BOM or not), else cp1252 per line; `,` `;` or tab.

    Each physical line is decoded as UTF-8, else as cp1252 (noted); a line neither can decode makes its record a
    `bad_lines` entry instead of a record. The delimiter is the one that splits the header into a cell equal to
    `key_column` (the most cells wins), else `,`. The csv field size limit is raised (report cells are long).

    Raises:
        OSError: the file cannot be read.
    """
    raw = read_regular_bytes(path)
    text_lines, undecodable, cp1252 = _decode_lines(raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw)
    delimiter = _sniff_delimiter(text_lines[0] if text_lines else "", key_column)
    # Process-wide and only ever raised (threads may read CSVs at once; restoring it would race).
    csv.field_size_limit(max(csv.field_size_limit(), _FIELD_LIMIT))
    reader = csv.reader(text_lines, delimiter=delimiter)
    parsed: list[tuple[int, int, tuple[str, ...]]] = []
    first = 1
    try:
        for row in reader:
            parsed.append((first, reader.line_num, tuple(c.strip() for c in row)))
            first = reader.line_num + 1
    except csv.Error as err:
        raise ValueError(f"{path.name} line {reader.line_num}: not CSV ({err})") from None
    header = parsed[0][2] if parsed else ()
    records: list[tuple[int, tuple[str, ...]]] = []
    bad: list[tuple[int, str, tuple[str, ...]]] = []
    for first, last, cells in parsed[1:]:
        lines = [n for n in range(first, last + 1) if n in undecodable]
        swallowed = _swallowed_rows(text_lines[first:last], first + 1, header, delimiter, key_column)
        if lines:
            bad.append((first, f"line {lines[0]} holds bytes that are neither UTF-8 nor cp1252 (or NUL)", cells))
        elif swallowed:
            problem = f"a quote opened on line {first} is not closed before line {swallowed[0][0]}"
            bad += [(first, problem, cells)] + [
                (n, f"{problem}: swallowed into line {first}", c) for n, c in swallowed
            ]
        elif any(cells):
            records.append((first, cells))
    note = None
    if cp1252:
        note = f"{path.name}: {len(cp1252)} line(s) not UTF-8, decoded as cp1252 (first: line {cp1252[0]})"
    return CsvTable(header, tuple(records), tuple(bad), note, delimiter)


def _decode_lines(raw: bytes) -> tuple[list[str], set[int], list[int]]:
    """Physical lines decoded as UTF-8, else cp1252: (lines, numbers of undecodable or NUL lines, cp1252 lines)."""
    text_lines: list[str] = []
    undecodable: set[int] = set()
    cp1252: list[int] = []
    for number, line in enumerate(raw.splitlines(keepends=True), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            try:
                text = line.decode("cp1252")
                cp1252.append(number)
            except UnicodeDecodeError:
                text = line.decode("utf-8", errors="replace")
                undecodable.add(number)
        if "\x00" in text:  # the csv module refuses NUL; a NUL line is garbage for us too
            text = text.replace("\x00", "\ufffd")
            undecodable.add(number)
        text_lines.append(text)
    return text_lines, undecodable, cp1252


def _swallowed_rows(
    lines: Sequence[str], first_number: int, header: Sequence[str], delimiter: str, key_column: str
) -> list[tuple[int, tuple[str, ...]]]:
    """The continuation lines of a multi-line record that parse alone as a full row with a case id: rows an
    unterminated quote swallowed (a multi-line report cell never looks like that)."""
    if key_column not in header:
        return []
    col = list(header).index(key_column)
    found = []
    for number, line in enumerate(lines, start=first_number):
        cells = tuple(c.strip() for c in next(csv.reader([line], delimiter=delimiter), []))
        if len(cells) == len(header) and is_valid_case_id(cells[col]):
            found.append((number, cells))
    return found


def _sniff_delimiter(header_line: str, key_column: str) -> str:
    best, best_cells = ",", 0
    for delimiter in _DELIMITERS:
        cells = [c.strip() for c in next(csv.reader([header_line], delimiter=delimiter), [])]
        if key_column in cells and len(cells) > best_cells:
            best, best_cells = delimiter, len(cells)
    return best


# --------------------------------------------------------------------------------------------------------------------
# Splits


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
        split: root / SPLIT_DIR / name for split, name in SPLIT_FILES.items() if _plan_file(root / SPLIT_DIR / name)
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
            raise AtlasError(f"cannot read the split file {rel}: {_os_reason(err)}") from None
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


def _plan_file(path: Path) -> bool:
    """True when a run-level file (metadata CSV, split file) exists; AtlasError when it exists but cannot be used."""
    try:
        return probe_file(path, path.name, "a CSV file")
    except CaseDataError as err:
        raise AtlasError(f"cannot use {err.detail} (fix or remove it: it decides splits or weak labels)") from None


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
    """Parse the metadata CSV by column NAME (never by position); tolerate missing columns (see `read_csv_table`).

    A row is a problem (and left out) when it cannot be decoded, has another number of cells than the header,
    holds a value that is not a finite number where one is expected (`inf`, `abc`; an empty cell or `nan` is
    "absent", as pandas writes it), or when its id has another row with different values (never "last wins";
    identical duplicates are one row).

    Returns:
        (metadata per case id, problems per case id): the problem names the file, the line, the column and the value.

    Raises:
        ValueError: the file has no `BDMAP ID` column.
        OSError: the file cannot be read.
    """
    table = read_csv_table(path)
    if "BDMAP ID" not in table.header:
        raise ValueError(
            f"{path.name}: no 'BDMAP ID' column (delimiter tried: , ; tab); found {list(table.header)[:8]}."
        )
    if table.encoding_note:
        logger.warning("%s", table.encoding_note)
    col = table.header.index("BDMAP ID")
    rows: dict[str, dict[Organ, AtlasOrganMeta]] = {}
    first_line: dict[str, int] = {}
    problems: dict[str, str] = {}
    for line_no, problem, cells in table.bad_lines:
        key = cells[col] if len(cells) > col and is_valid_case_id(cells[col]) else f"line {line_no}"
        problems[key] = f"{path.name} line {line_no}: {problem}"
    for line_no, cells in table.records:
        case_id = cells[col] if len(cells) > col else ""
        key = case_id or f"line {line_no}"
        if key in problems:
            continue
        try:
            if len(cells) != len(table.header):
                raise ValueError(f"{len(cells)} cells where the header has {len(table.header)}")
            record = dict(zip(table.header, cells, strict=True))
            meta = {organ: _organ_meta(organ, record) for organ in Organ}
        except ValueError as err:
            problems[key] = f"{path.name} line {line_no}: {err}"
            rows.pop(key, None)
            continue
        if key in rows and rows[key] != meta:
            problems[key] = (
                f"{path.name} lines {first_line[key]} and {line_no}: two rows for {case_id} with different values "
                "(neither is used)"
            )
            del rows[key]
            continue
        rows[key] = meta
        first_line.setdefault(key, line_no)
    return rows, problems


def _organ_meta(organ: Organ, record: dict[str, str]) -> AtlasOrganMeta:
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
            number = float(value)
        except ValueError:
            raise ValueError(f"column {cols[key]!r} holds {value!r}, not a number") from None
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"column {cols[key]!r} holds {value!r}, not a finite non-negative number")
        return number

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
    rejections: tuple[Rejection, ...]  # invalid case ids, entries that are not cases, split conflicts, metadata rows
    warnings: tuple[str, ...] = ()  # discovery and CSV notes for the run summary


def plan_atlas(root: Path, *, limit: int | None = None, test_fraction: float = 0.10) -> AtlasPlan:
    """Discover the cases, assign splits (IID files, else the hash split) and read the metadata CSV if present.

    A case missing from existing split files gets the hash split; a case listed in more than one split file is
    rejected (`split_conflict`, step "discover") and not curated. A metadata row that cannot be parsed becomes a
    `bad_metadata_row` rejection (step "metadata"); the case itself still runs, without `atlas_*` values.

    Raises:
        FileNotFoundError: `root` is not a folder.
        AtlasError: a layout folder, the metadata CSV or a split file cannot be read; NoCasesError: no case.
    """
    root = Path(root).resolve()
    discovery = discover_cases(root)
    refs = list(discovery.refs[:limit] if limit is not None else discovery.refs)
    listing = read_split_files(root)
    rejections = list(discovery.rejections)
    warnings = list(discovery.warnings)
    if listing is not None:
        warnings += list(listing.warnings) + [problem for _, problem in listing.problems]
        for ref in [r for r in refs if r.case_id in listing.conflicts]:
            files = listing.conflicts[ref.case_id]
            detail = f"{ref.case_id} is listed in {' and '.join(files)}: a train/test leak; the case is not used"
            rejections.append(Rejection(ref.case_id, None, "discover", RejectReason.SPLIT_CONFLICT, detail, files[0]))
        refs = [r for r in refs if r.case_id not in listing.conflicts]
    splits = {
        r.case_id: str(
            listing.splits[r.case_id]
            if listing and r.case_id in listing.splits
            else hash_split(r.case_id, test_fraction=test_fraction)
        )
        for r in refs
    }
    metadata, meta_rejections = plan_metadata(root, {r.case_id for r in refs}, warnings)
    return AtlasPlan(
        discovery.layout,
        tuple(refs),
        splits,
        "IID split files" if listing else "case-id hash",
        metadata,
        tuple(rejections + meta_rejections),
        tuple(warnings),
    )


def plan_metadata(
    root: Path, wanted: set[str], warnings: list[str]
) -> tuple[dict[str, dict[Organ, AtlasOrganMeta]], list[Rejection]]:
    """Read the metadata CSV when present: (rows of the wanted cases, bad_metadata_row rejections).

    A CSV that cannot be used at all (unreadable, no `BDMAP ID` column) is a run warning, not a failure: it holds
    weak labels only, so the run goes on without `atlas_*` values and says so in the summary and `qa.md`.
    """
    path = root / METADATA_FILE
    try:
        if not _plan_file(path):
            return {}, []
        metadata, problems = read_metadata(path)
    except (AtlasError, ValueError, OSError) as err:
        reason = _os_reason(err) if isinstance(err, OSError) else str(err).rstrip(".")
        warnings.append(f"{METADATA_FILE} not used: {reason}; no atlas_* values in this run")
        logger.warning("%s", warnings[-1])
        return {}, []
    rejections = [
        Rejection(case_id, None, "metadata", RejectReason.BAD_METADATA_ROW, problem, METADATA_FILE)
        for case_id, problem in sorted(problems.items())
        if case_id in wanted or not is_valid_case_id(case_id)  # a row of another case is not this run's business
    ]
    return {k: v for k, v in metadata.items() if k in wanted}, rejections
