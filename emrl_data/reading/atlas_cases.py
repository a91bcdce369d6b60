"""Case discovery in the AbdomenAtlas 3.0 layout on disk (docs/contract.md#input); entry points: `emrl_data/reading/atlas.py`.

Two layouts are supported:

* split (as released): `image_only/<id>/ct.nii.gz` + `mask_only/<id>/segmentations/<structure>.nii.gz`
* combined (RadGPT's): `<id>/ct.nii.gz` + `<id>/segmentations/<structure>.nii.gz`

Files may also be uncompressed `.nii`. Structure names are spelled as released (docs/contract.md#input).

Every entry that looks like a case ends as a `CaseRef` or a `Rejection`; every other entry inside a layout folder is
named in a discovery warning (docs/decisions.md#reading-the-atlas).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from emrl_data.organs import ORGAN_STRUCTURES
from emrl_data.outcome import CaseDataError, Rejection, RejectReason
from emrl_data.reading.fileio import describe_special
from emrl_data.reading.label_maps import LabelMap
from emrl_data.sources import Source
from emrl_data.types import Organ, is_valid_case_id


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
            RejectReason.UNREADABLE_FILE, f"{rel}: cannot be read ({os_reason(err)})", path=rel
        ) from None
    if not stat.S_ISREG(st.st_mode):
        kind = describe_special(path, st.st_mode)
        raise CaseDataError(RejectReason.UNREADABLE_FILE, f"{rel}: {kind} where {what} belongs", path=rel)
    return True


def printable(text: str) -> str:
    """Return `text` safe for tables and markdown: undecodable file-name bytes (surrogates) as `\\udcXX` escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def os_reason(err: OSError) -> str:
    """One-line reason of an OSError (strerror with the errno name)."""
    name = errno.errorcode.get(err.errno or 0, "")
    return f"{err.strerror or err}" + (f", {name}" if name else "")


@dataclass(frozen=True, slots=True)
class CaseRef:
    """Where one case's files are. Paths are absolute; `root` is the dataset root they are relative to.

    A case of a per-structure layout (AbdomenAtlas) has a mask folder; a case of a label-map layout (MSD, KiTS, LiTS)
    has `labels`: its label-map file and table, from which every structure is read (`emrl_data.reading.label_maps`),
    and `organs`: the organs its dataset annotates (None: every registered organ).
    """

    case_id: str
    root: Path
    ct_path: Path  # may not exist (-> missing_ct rejection)
    mask_dir: Path  # the `segmentations/` folder (may not exist); a label map's folder
    labels: LabelMap | None = None
    organs: tuple[str, ...] | None = None

    def annotates(self, organ: str) -> bool:
        """Whether the case's dataset annotates `organ`: an organ it does not is unknown (no row), never negative."""
        return self.organs is None or str(organ) in self.organs

    def label_selection(self, structure: str) -> tuple[tuple[int, ...], str | None] | None:
        """(label values, side) of `structure` in the case's label map; None for a per-structure file."""
        return None if self.labels is None else self.labels.selection(structure)

    def structure_path(self, structure: str) -> Path | None:
        """Return the file of `structure` (`.nii.gz` preferred, then `.nii`), or None when neither exists.

        In a label-map case: the label map when its table provides `structure` and the file exists, else None.

        Raises:
            CaseDataError: UNREADABLE_FILE when a candidate exists but cannot be read (see `probe_file`).
        """
        if self.labels is not None:
            path = self.labels.path
            found = self.labels.selection(structure) is not None and probe_file(path, self.relative(path))
            return path if found else None
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
        """Return the structure names (file stems) in the mask folder, sorted; () when it is absent (a label map: its table's).

        Raises:
            CaseDataError: UNREADABLE_FILE when the mask folder exists but cannot be listed.
        """
        if self.labels is not None:
            return self.labels.structure_names()
        try:
            names = os.listdir(self.mask_dir)
        except (FileNotFoundError, NotADirectoryError):
            return ()
        except OSError as err:
            rel = self.relative(self.mask_dir)
            raise CaseDataError(
                RejectReason.UNREADABLE_FILE, f"{rel}: cannot be listed ({os_reason(err)})", path=rel
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
    source: Source | None = None  # the dataset the cases come from (`emrl_data.reading.layout.discover` names it)


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
        raise AtlasError(f"cannot list the atlas folder {folder}: {os_reason(err)}") from None
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
            return f"{rel!r} is a symlink that does not resolve ({os_reason(err)})"
        return f"{rel!r} cannot be read ({os_reason(err)})"
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
