"""Label maps: one NIfTI per case whose voxel values name structures (MSD, KiTS, LiTS), read as the per-structure
masks of the organ registry (docs/data.md#dataset-layouts).

A dataset's label table (`LabelTable`: value -> name as released, and the role of that name) becomes the structure
files the rest of the pipeline knows (`OrganSpec.organ_masks`, `lesion_mask`, `lesion_fallbacks`), without naming an
organ here:

* a label named after a registered organ is that organ's mask; the organ mask is that label united with every lesion
  label of the table (the released labels are exclusive, the registry's organ masks hold their lesions);
* an organ whose mask files have sides (`OrganSpec.mask_sides`, both kidneys) gets each file from the one label by
  patient-frame position: a voxel whose world x (NIfTI RAS+, +x towards the patient's right) lies right of the body's
  midline (`emrl_data.reading.placement.BodyEvidence.midline_x_mm`) is in the right file, else in the left one. The cut
  runs on the CT grid with the CT's affine, so LPS, RAS and oblique headers all cut in the patient frame;
* a lesion label has a role: "tumor" and "cyst" are the organ's `<prefix>_tumor` / `<prefix>_cyst` fallback files (the
  lesion-file rule unites them into the row's lesion: a cyst stays a cyst, never a tumour), "lesion" is the organ's
  lesion file itself (a label that holds tumours and cysts together);
* a label of role "ignored" (PANORAMA's veins, arteries and ducts) is a value a label map may hold that no structure
  reads: its voxels are neither organ nor lesion.

An organ no label names is not annotated: the case gives no row for it (`CaseRef.annotates`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from emrl_data.config import LoadConfig
from emrl_data.organs import Organ, organ_spec
from emrl_data.outcome import CaseDataError, RejectReason
from emrl_data.reading.inflate import read_payload
from emrl_data.reading.nifti import NiftiVolume, parse_header


LESION_ROLES = ("tumor", "cyst", "lesion")
BACKGROUND = "background"
IGNORED = "ignored"
_RELEASED_LABELS = Path(__file__).with_name("layouts") / "released_labels.json"
_MAX_LABEL_VALUE = 255


@dataclass(frozen=True, slots=True)
class LabelTable:
    """A dataset's label table as released: `(value, name, role)` per label; role is "organ", a lesion role or
    "background". `structures` is what the pipeline reads from it: structure file -> label values and side."""

    labels: tuple[tuple[int, str, str], ...]

    @property
    def organs(self) -> tuple[Organ, ...]:
        """The registered organs the table annotates, in label order."""
        return tuple(Organ(name) for _, name, role in self.labels if role == "organ")

    @property
    def values(self) -> frozenset[int]:
        """Every value a label map of this table may hold (background included)."""
        return frozenset({0, *(value for value, _, _ in self.labels)})

    @property
    def ignored(self) -> tuple[str, ...]:
        """The labels no structure reads, as `value name` ("2 veins")."""
        return tuple(f"{value} {name}" for value, name, role in self.labels if role == IGNORED)

    def describe(self) -> str:
        """The table in words: `1 liver, 2 cancer (tumor)`; an ignored label says so (`2 veins (ignored)`)."""
        return ", ".join(
            f"{value} {name}" + (f" ({role})" if role not in ("organ", name) else "")
            for value, name, role in self.labels
            if role != BACKGROUND
        )

    def structures(self) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """Structure file -> (label values, side or None), by the rules of the module docstring.

        Raises:
            ValueError: lesion labels beside more or fewer than one organ, or an organ with several unsided masks.
        """
        organs = [(value, Organ(name)) for value, name, role in self.labels if role == "organ"]
        lesions = [(value, role) for value, _, role in self.labels if role in LESION_ROLES]
        if lesions and len(organs) != 1:
            raise ValueError(f"lesion labels need exactly one organ label to belong to: {self.describe()}")
        lesion_values = tuple(value for value, _ in lesions)
        out: dict[str, tuple[tuple[int, ...], str | None]] = {}
        for value, organ in organs:
            spec = organ_spec(organ)
            sides = dict(spec.mask_sides)
            values = (value, *lesion_values)
            if len(spec.organ_masks) == 1:
                out[spec.organ_masks[0]] = (values, None)
            elif all(mask in sides for mask in spec.organ_masks):
                out.update({mask: (values, sides[mask]) for mask in spec.organ_masks})
            else:
                raise ValueError(f"{organ}: {len(spec.organ_masks)} mask files without sides cannot share one label")
            for value, role in lesions:
                name = lesion_structure(organ, role)
                out[name] = ((*out[name][0], value) if name in out else (value,), None)
        return out


def lesion_structure(organ: Organ, role: str) -> str:
    """The structure file a lesion label of `role` stands for: the organ's lesion file, or its tumour/cyst file."""
    spec = organ_spec(organ)
    if role == "lesion":
        return spec.lesion_mask
    found = [name for name in spec.lesion_fallbacks if name.endswith(f"_{role}")]
    if role not in LESION_ROLES or not found:
        raise ValueError(f"{organ} has no {role!r} lesion file (fallbacks: {spec.lesion_fallbacks})")
    return found[0]


def label_table(labels: Mapping[str, str], roles: Mapping[str, str] | None = None) -> LabelTable:
    """Build a table from `value -> name` as released (an MSD `dataset.json`'s "labels").

    A name that is a registered organ is an organ label; "background" is the background; any other name takes its role
    from `roles` (`{"cancer": "tumor"}`, `{"veins": "ignored"}`), or is itself a lesion role ("tumor", "cyst").

    Raises:
        ValueError: a value that is not an integer in 0..255, or a name with no role.
    """
    rows = []
    for key, name in sorted(labels.items(), key=lambda kv: int(kv[0])):
        value = int(key)
        if not 0 <= value <= _MAX_LABEL_VALUE:
            raise ValueError(f"label value {key!r} is outside 0..{_MAX_LABEL_VALUE}")
        role = (roles or {}).get(name, name)
        if name in Organ:
            role = "organ"
        elif value == 0 or name == BACKGROUND:
            role = BACKGROUND
        elif role not in (*LESION_ROLES, IGNORED):
            raise ValueError(
                f"label {value} {name!r} names no registered organ, no lesion role {LESION_ROLES} and is not {IGNORED!r}"
            )
        rows.append((value, name, role))
    return LabelTable(tuple(rows))


@cache
def _released() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(_RELEASED_LABELS.read_text(encoding="utf-8"))
    return loaded


def released_table(key: str) -> LabelTable:
    """The label table a dataset documents, by layout name (`layouts/released_labels.json`: its title and folder, its
    labels as released, the roles of the names that are no organ, and where the table comes from).

    The tables are data beside the layout modules because they name organs, which code outside the organ registry
    never does (`tests/test_architecture.py`)."""
    entry = _released()[key]
    return label_table(entry["labels"], entry.get("roles"))


def released_field(key: str, field: str) -> str:
    """A text field of a dataset's entry in `released_labels.json`: "title" ("MSD Task03 Liver"), "folder" (the
    folder its release unpacks to, for the one-line command), "source" (where the table comes from), "citation" (where
    the citation names an organ)."""
    value: str = _released()[key][field]
    return value


@dataclass(frozen=True, slots=True)
class LabelMap:
    """One case's label-map file and what each structure reads from it."""

    path: Path
    table: LabelTable

    def selection(self, structure: str) -> tuple[tuple[int, ...], str | None] | None:
        """(label values, side) of `structure`, or None when the table holds no such structure."""
        return _structures(self.table).get(structure)

    def structure_names(self) -> tuple[str, ...]:
        """Every structure the table provides, sorted."""
        return tuple(sorted(_structures(self.table)))


@cache
def _structures(table: LabelTable) -> dict[str, tuple[tuple[int, ...], str | None]]:
    return table.structures()


def decode_labels(path: Path, name: str, *, cfg: LoadConfig, allowed: frozenset[int]) -> NiftiVolume:
    """Read a label map: integer voxels, each one of `allowed`; returned as uint8 in the file's storage order.

    Raises:
        CaseDataError: any reason of `emrl_data.reading.nifti.parse_header` or the inflater; NON_FINITE_VOXELS;
            BAD_MASK_VALUES for a fractional value or one the label table does not hold (the values are named).
    """
    parsed = []

    def payload_size(prefix: bytes) -> int:
        parsed.append(parse_header(prefix, name, cfg))
        return int(parsed[0].vox_offset + parsed[0].nbytes)

    buf, digest = read_payload(path, name, payload_size, force_gzip=path.name.endswith(".gz"))
    hdr = parsed[0]
    raw = buf[hdr.vox_offset :].view(hdr.dtype).reshape(hdr.shape, order="F")
    del buf
    scaled = math.isfinite(hdr.slope) and hdr.slope != 0 and (hdr.slope, hdr.inter) != (1.0, 0.0)
    if scaled or raw.dtype.kind == "f":
        values = raw.astype(np.float64) * (hdr.slope if scaled else 1.0) + (hdr.inter if scaled else 0.0)
        if not np.isfinite(values).all():
            bad = int(np.count_nonzero(~np.isfinite(values)))
            raise CaseDataError(RejectReason.NON_FINITE_VOXELS, f"{name}: {bad} NaN/inf voxels", path=name)
        if (np.rint(values) != values).any():
            raise CaseDataError(RejectReason.BAD_MASK_VALUES, f"{name}: fractional label values", path=name)
        raw = values
    low, high = int(raw.min()), int(raw.max())
    present = set(range(low, high + 1)) if high - low > _MAX_LABEL_VALUE else set()
    if not present:
        counts = np.bincount((raw.astype(np.int64, copy=False) - low).ravel("K"), minlength=high - low + 1)
        present = {low + int(i) for i in np.flatnonzero(counts)}
    unknown = sorted(present - allowed)
    if unknown:
        listed = ", ".join(str(v) for v in unknown[:10])
        raise CaseDataError(
            RejectReason.BAD_MASK_VALUES,
            f"{name}: label values {listed} are not in the label table ({sorted(allowed)})",
            path=name,
        )
    data = np.asfortranarray(raw.astype(np.uint8, copy=False))
    data.flags.writeable = False
    return NiftiVolume(data=data, affine=hdr.affine, zooms_mm=hdr.zooms_mm, path=path, digest=digest)


def select(labels: np.ndarray, values: tuple[int, ...]) -> np.ndarray:
    """The bool mask of the voxels holding one of `values` (same shape and memory order)."""
    lut = np.zeros(_MAX_LABEL_VALUE + 1, dtype=np.bool_)
    lut[list(values)] = True
    out = np.asfortranarray(lut[labels])
    out.flags.writeable = False
    return out


def side_cut(mask: np.ndarray, affine: np.ndarray, midline_x_mm: float, side: str) -> np.ndarray:
    """Keep the voxels of `mask` on the patient's `side` ("right"/"left") of the plane world x = `midline_x_mm`.

    `affine` maps `mask`'s voxel indices to world mm (NIfTI RAS+: +x towards the patient's right); a voxel exactly on
    the plane is on the left. Runs one axial slab at a time (no full-volume float temporary).
    """
    if side not in ("right", "left"):
        raise ValueError(f"side={side!r} must be 'right' or 'left'.")
    if not math.isfinite(midline_x_mm):
        raise CaseDataError(
            RejectReason.MASK_GRID_MISMATCH, "no body on the CT: the sides of a sided mask cannot be told apart"
        )
    out = np.zeros(mask.shape, dtype=np.bool_, order="F")
    row = affine[0]
    i = np.arange(mask.shape[0], dtype=np.float64)[:, None] * row[0]
    j = np.arange(mask.shape[1], dtype=np.float64)[None, :] * row[1]
    plane = i + j + row[3] - midline_x_mm
    for k in range(mask.shape[2]):
        x = plane + k * row[2]
        out[:, :, k] = mask[:, :, k] & ((x > 0) if side == "right" else (x <= 0))
    out.flags.writeable = False
    return out
