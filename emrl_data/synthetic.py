"""The embedded synthetic AbdomenAtlas: HU-realistic phantoms in the released on-disk layout, with their ground truth.

Who calls it: tests, benchmarks and demo flows that need an atlas without downloading one. Nothing in the
pipeline reads ground truth from here; the truth is a second, independent computation to check it against.

What a case is:

* Anatomy in canonical RAS voxel space `(X, Y, Z)` (nibabel RAS+: x grows towards the patient's Right, y Anterior,
  z superior). It is laid out in fractions of the field of view, so any grid holds a complete abdomen: a body ellipse
  (subcutaneous fat -100 HU, a muscle ring 40 HU, intra-abdominal fat -100 HU, air outside), a vertebra (250 HU with
  a 1100 HU cortical rim that the ±1000 clip cuts), the liver (60 HU) on the patient's right, the pancreas (40 HU)
  across the midline with its head on the patient's right, and both kidneys (150 HU). Seeded Gaussian noise
  (SD 8 HU) covers everything; CT values are rounded, clipped to [-1000, 1000] and stored as int16.
* Sub-structures: `liver_segment_1..8` partition the liver by a fixed rule on the liver ellipsoid's normalised
  coordinates (u towards the patient's right, v anterior, w superior): u < -0.35 is segment 2 (w >= 0) or 3;
  -0.35 <= u < 0.05 is segment 1 (v < -0.3, caudate) or 4; u >= 0.05 is 8 / 5 (anterior, superior / inferior) and
  7 / 6 (posterior, superior / inferior). The pancreas is cut in thirds along x: head (patient's right), body,
  tail. Sub-structure masks lie inside their organ and overlap it, as released.
* Lesions (`LesionSpec`): ellipsoids with radii in mm, centred on the centroid of a part (a liver segment, a
  pancreas part, a kidney side) plus an offset in mm, snapped to the nearest voxel centre so that a lesion is
  symmetric about its centre slice. The organ mask is the organ's ellipsoid united with its lesions (an exophytic
  lesion is part of its organ, as in the released masks). HU: hypo = organ - 40, iso = organ HU with SD 1 noise
  (so the RadGPT rule sees iso), hyper = organ + 50.

Files are written as the release does: `.nii.gz` NIfTI-1 whose uncompressed bytes equal nibabel's
`Nifti1Image.to_bytes()` (header from nibabel, voxels in Fortran order; tested), int16 CT,
int8 0/1 masks, one file per structure, in the `split` (`image_only/<id>/ct.nii.gz` +
`mask_only/<id>/segmentations/<s>.nii.gz`) or `combined` (`<id>/ct.nii.gz` + `<id>/segmentations/<s>.nii.gz`)
layout. The gzip stream is produced by ISA-L (level 1) with mtime 0 and no file name, so the same spec always gives
the same bytes, and a 512 x 512 x 300 case is written in seconds.

Quirks (`QUIRKS`), each emitting one real-data trap (notes/atlas.md §1.4):

* `mask_cropped_grid`: every mask sits on a smaller grid: the body's x/y box and the z range of all written
  structures (+-1 slice). The masks' affines carry the crop offset, so the affines place them (SPEC §2).
* `flipped_affine_mask`: `kidney_right` is written with a sign-flipped affine (`diag(-1, -1, 1, 1) @ A`, LPS-signed
  over RAS storage, q/sform code 1) over voxel bytes identical to a plain write; readers must take it voxel for
  voxel. Cannot be combined with `mask_cropped_grid` (a cropped mask is placed by its affine).
* `lps_storage`: CT and masks are stored LPS: arrays flipped on x and y, affines accordingly. Same as
  `storage="LPS"` (either one sets both).
* `anisotropic`: spacing (0.7, 0.9, 3.0) mm instead of the spec's.
* `empty_lesion_files`: an organ without lesions gets an all-zero `<organ>_lesion` file instead of no file
  (the release may do either; notes/atlas.md §1.3).

Defects (`DEFECTS`) break one file (or the metadata row) of a case so that a reader must reject it with the mapped
`RejectReason`; `CaseTruth.expected_rejections` records the reason, the organ (None for the whole case) and the file.

Ground truth (an `emrl_data.labeling.labels.OrganLabels` per organ: one definition of an organ row's labels) is computed by
plain numpy/scipy code on the canonical arrays before they are written, independent of `emrl_data.labeling.labels.label_organ`:
26-connected components (`scipy.ndimage.label`), components under 10 mm^3 dropped, key slice = maximum area of the
largest component (`np.argmax`, ties lowest z), its 2-D box on that slice, the longest-diameter slice (scipy convex
hull of the voxel corners per slice, ties lowest z), the organ's and the lesion's 3-D boxes, location = parts holding
> 10 % of its voxels that lie in any part (`single_location` organs such as the kidney: the majority part, ties to
the first), attenuation by RadGPT's rule, long/short axis analytic from the lesion ellipsoid's in-plane radii
(2 max(rx, ry), 2 min(rx, ry)).

Organs: every registered organ (`emrl_data.organs`) is drawn from its entry in `ANATOMY` (HU, ellipsoids in body
units, optional sub-structure drawing); a new organ adds its `OrganAnatomy` there.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

import isal.igzip
import nibabel as nib
import numpy as np
from scipy import ndimage
from scipy.spatial import ConvexHull

from emrl_data.config import LabelConfig
from emrl_data.labeling.labels import OrganLabels
from emrl_data.organs import LOCATION_NAMES, ORGAN_STRUCTURES, organ_spec
from emrl_data.outcome import RejectReason
from emrl_data.types import Attenuation, Organ, Split, is_valid_case_id, row_values


logger = logging.getLogger(__name__)

Storage = Literal["RAS", "LPS"]

QUIRKS: tuple[str, ...] = (
    "mask_cropped_grid",  # masks on the body box grid; affine translation updated so the affines place them
    "flipped_affine_mask",  # kidney_right: sign-flipped affine over voxel bytes identical to its siblings'
    "lps_storage",  # CT and masks stored LPS (x and y flipped), affines accordingly
    "anisotropic",  # spacing (0.7, 0.9, 3.0) mm
    "empty_lesion_files",  # organs without lesions get an all-zero lesion file instead of none
)

DEFECTS: dict[str, RejectReason] = {
    "missing_ct": RejectReason.MISSING_CT,  # ct.nii.gz not written (the case folder exists)
    "truncated_gzip": RejectReason.CORRUPT_GZIP,  # ct.nii.gz cut to 60 % of its bytes
    "corrupt_gzip": RejectReason.CORRUPT_GZIP,  # 16 bytes in the middle of the CT's gzip stream inverted
    "not_nifti": RejectReason.NOT_NIFTI,  # ct.nii.gz is a valid gzip stream of text
    "ct_2d": RejectReason.BAD_NDIM,  # the CT's middle slice written as a 2-D image
    "ct_4d": RejectReason.BAD_NDIM,  # the CT repeated 3 times along a 4th axis
    "absurd_header": RejectReason.ABSURD_SIZE,  # CT header claims 30000^3 voxels over the real payload
    "nan_voxels": RejectReason.NON_FINITE_VOXELS,  # float32 CT with a NaN block inside the body
    "mask_values": RejectReason.BAD_MASK_VALUES,  # kidney_right holds 2 in a small block
    "missing_organ_mask": RejectReason.MISSING_ORGAN_MASK,  # pancreas.nii.gz not written
    "empty_organ_mask": RejectReason.EMPTY_ORGAN_MASK,  # pancreas.nii.gz written all zeros
    "lesion_outside_organ": RejectReason.LESION_OUTSIDE_ORGAN,  # the liver lesion lies in fat on the patient's left
    "mask_grid_mismatch": RejectReason.MASK_GRID_MISMATCH,  # liver.nii.gz on a cropped grid with a rotated affine
    "invalid_case_id": RejectReason.INVALID_CASE_ID,  # the case folder is named e.g. "BDMAP_12x"
    "bad_metadata_row": RejectReason.BAD_METADATA_ROW,  # "abc" in the row's liver lesion count; the case is fine
    "split_conflict": RejectReason.SPLIT_CONFLICT,  # the case is listed in both IID_train.csv and IID_test.csv
    "unreadable_file": RejectReason.UNREADABLE_FILE,  # ct.nii.gz is a symlink to itself (unreadable even as root)
    "not_a_case": RejectReason.NOT_A_CASE,  # the case's image folder (combined: case folder) is a regular file
    "implausible_spacing": RejectReason.IMPLAUSIBLE_SPACING,  # the CT's affine and pixdim scaled 1000x (metres)
    "geometry_conflict": RejectReason.GEOMETRY_CONFLICT,  # the CT's pixdim 10x its sform's voxel size
    "mask_orientation_conflict": RejectReason.MASK_ORIENTATION_CONFLICT,  # liver.nii.gz voxels mirrored along x
    "implausible_organ_hu": RejectReason.IMPLAUSIBLE_ORGAN_HU,  # the CT reads 400 HU over the pancreas mask
}

ANISOTROPIC_SPACING_MM: tuple[float, float, float] = (0.7, 0.9, 3.0)
METADATA_CSV_NAME = "AbdomenAtlas3.0MiniWithMeta.csv"
SPLIT_DIR_NAME = "TrainTestIDS"
TRUTH_JSON_NAME = "synthetic_truth.json"
TRUTH_FORMAT_VERSION = 2  # 2: organ truth is an `OrganLabels` (adds max_diameter_z_vox and the 3-D boxes)

_CASE_CSV_COLUMNS = ("BDMAP ID", "sex", "age", "shape", "spacing")
_CSV_ATTENUATION_WORD = {"hypo": "hypoattenuating", "iso": "isoattenuating", "hyper": "hyperattenuating"}

# --- HU values (notes/atlas.md; typical portal-venous values) -------------------------------------------------
_AIR_HU = -1024  # clipped to -1000 like the release
_FAT_HU = -100
_MUSCLE_HU = 40
_BONE_HU = 250
_CORTEX_HU = 1100  # above the clip: exercises the ±1000 clip
_LESION_DELTA_HU: dict[str, int] = {"hypo": -40, "iso": 0, "hyper": 50}
_NOISE_SD_HU = 8.0
_ISO_NOISE_SD_HU = 1.0
_CT_CLIP_HU = 1000

# --- Anatomy in body units: u = x_mm / A, v = y_mm / B (A, B = body semi-axes), w = z_mm / half z field of view ----
_BODY_SEMI_FRACTION = (0.88, 0.72)  # body semi-axes as fractions of the half field of view (x, y)
_MUSCLE_RING = (0.80, 0.90)  # normalised body radius range of the muscle wall
_SPINE_CENTRE_UV = (0.0, -0.62)
_SPINE_RADIUS_B = 0.12  # in units of B
# An organ mask's ellipsoid in body units: (centre (u, v, w), semi-axes (u, v, w)). The organs are in `ANATOMY`.
Ellipsoid = tuple[tuple[float, float, float], tuple[float, float, float]]
# Where the `lesion_outside_organ` defect puts its liver lesion: fat on the patient's left, anterior.
_OUTSIDE_LESION_UVW = (-0.45, 0.45, 0.35)
_OUTSIDE_LESION_RADII_MM = (5.0, 5.0, 5.0)

_NOISE_SLAB_Z = 16  # z slices per noise chunk (bounds float32 temporaries; fixed so output is deterministic)
_GZIP_LEVEL = 1  # ISA-L level 1: nibabel's default level is 1 too
_LPS_FLIP = np.diag([-1.0, -1.0, 1.0, 1.0])
_VOX_OFFSET = 352  # NIfTI-1 single file: 348-byte header + 4-byte empty extension flag


# ==================================================================================================================
# Specs
# ==================================================================================================================


@dataclass(frozen=True, slots=True)
class LesionSpec:
    """One lesion to draw: an ellipsoid in a named part of an organ.

    Attributes:
        organ: the organ row the lesion belongs to.
        part: where it is centred: a location name of the organ (liver "1".."8", pancreas "head"/"body"/"tail",
            kidney "left"/"right": `OrganSpec.location_names`), or "" for the centre of the whole organ (the only
            choice for an organ without sub-structures).
        radii_mm: ellipsoid semi-axes (x, y, z) in mm, canonical axes.
        attenuation: "hypo" | "iso" | "hyper" (`emrl_data.types.Attenuation` values).
        offset: shift of the centre from the part's centroid, (x, y, z) in mm, canonical RAS axes
            (+x towards the patient's right, +y anterior, +z superior).
    """

    organ: Organ
    part: str
    radii_mm: tuple[float, float, float]
    attenuation: str
    offset: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "organ", Organ(self.organ))
        if self.part and self.part not in LOCATION_NAMES[self.organ]:
            raise ValueError(
                f"part={self.part!r} is not a part of {self.organ}; valid: {LOCATION_NAMES[self.organ]} or ''."
            )
        if len(self.radii_mm) != 3 or min(self.radii_mm) <= 0:
            raise ValueError(f"radii_mm={self.radii_mm} must be three positive lengths in mm.")
        if self.attenuation not in {a.value for a in Attenuation}:
            raise ValueError(f"attenuation={self.attenuation!r} must be one of {[a.value for a in Attenuation]}.")
        if len(self.offset) != 3:
            raise ValueError(f"offset={self.offset} must be (x, y, z) in mm.")
        object.__setattr__(self, "radii_mm", tuple(float(r) for r in self.radii_mm))
        object.__setattr__(self, "offset", tuple(float(o) for o in self.offset))


@dataclass(frozen=True, slots=True)
class CaseSpec:
    """One synthetic case.

    Attributes:
        case_id: `BDMAP_` + 8 digits (also with the `invalid_case_id` defect, which only renames the folder).
        shape: canonical grid (X, Y, Z) in voxels.
        spacing_mm: voxel size (x, y, z) in mm; the `anisotropic` quirk replaces it by `ANISOTROPIC_SPACING_MM`.
        lesions: the lesions to draw; organs without one are negatives.
        storage: on-disk orientation; "LPS" flips x and y (same as the `lps_storage` quirk; either sets both).
        quirks: a subset of `QUIRKS`.
        defect: None or a key of `DEFECTS`.
        seed: seeds the CT noise and the metadata (sex, age).
        split: the split file the case is listed in (an addition to the brief; `write_atlas` writes it).
    """

    case_id: str
    shape: tuple[int, int, int] = (96, 80, 48)
    spacing_mm: tuple[float, float, float] = (0.8, 0.8, 2.5)
    lesions: tuple[LesionSpec, ...] = ()
    storage: Storage = "RAS"
    quirks: frozenset[str] = frozenset()
    defect: str | None = None
    seed: int = 0
    split: Split = Split.TRAIN

    def __post_init__(self) -> None:
        if not is_valid_case_id(self.case_id):
            raise ValueError(f"case_id={self.case_id!r} must be BDMAP_ + 8 digits (use defect='invalid_case_id').")
        if len(self.shape) != 3 or min(self.shape) < 16:
            raise ValueError(f"shape={self.shape} must be three sizes >= 16 voxels.")
        if len(self.spacing_mm) != 3 or min(self.spacing_mm) <= 0:
            raise ValueError(f"spacing_mm={self.spacing_mm} must be three positive sizes in mm.")
        if self.storage not in ("RAS", "LPS"):
            raise ValueError(f"storage={self.storage!r} must be 'RAS' or 'LPS'.")
        quirks = frozenset(self.quirks)
        unknown = quirks - set(QUIRKS)
        if unknown:
            raise ValueError(f"Unknown quirks {sorted(unknown)}; valid: {QUIRKS}.")
        if self.defect is not None and self.defect not in DEFECTS:
            raise ValueError(f"defect={self.defect!r} is unknown; valid: {sorted(DEFECTS)}.")
        if {"mask_cropped_grid", "flipped_affine_mask"} <= quirks:
            raise ValueError("quirks mask_cropped_grid and flipped_affine_mask cannot be combined.")
        if self.defect == "lesion_outside_organ" and any(le.organ is Organ.LIVER for le in self.lesions):
            raise ValueError("defect lesion_outside_organ draws the only liver lesion; remove the liver LesionSpecs.")
        storage = "LPS" if (self.storage == "LPS" or "lps_storage" in quirks) else "RAS"
        if storage == "LPS":
            quirks = quirks | {"lps_storage"}
        spacing = ANISOTROPIC_SPACING_MM if "anisotropic" in quirks else tuple(float(s) for s in self.spacing_mm)
        object.__setattr__(self, "storage", storage)
        object.__setattr__(self, "quirks", quirks)
        object.__setattr__(self, "spacing_mm", spacing)
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "lesions", tuple(self.lesions))
        object.__setattr__(self, "split", Split(self.split))

    @property
    def folder_name(self) -> str:
        """Return the case folder name: the id, or a malformed one (`BDMAP_<n>x`) for the `invalid_case_id` defect."""
        if self.defect == "invalid_case_id":
            return f"BDMAP_{int(self.case_id[6:])}x"
        return self.case_id


# ==================================================================================================================
# Ground truth
# ==================================================================================================================


def _truth_to_dict(truth: OrganLabels) -> dict[str, Any]:
    """Return an organ's truth as a JSON-ready dict (its columns and its organ)."""
    return {"organ": str(truth.organ), **row_values(truth)}


def _truth_from_dict(data: dict[str, Any]) -> OrganLabels:
    """Inverse of `_truth_to_dict`."""
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    values["organ"] = Organ(data["organ"])
    return OrganLabels(**values)


@dataclass(frozen=True, slots=True)
class ExpectedRejection:
    """A rejection a correct pipeline must record for a defective case.

    Attributes:
        reason: the reason code.
        organ: the organ whose file carries the defect, or None when the whole case is affected (CT defects,
            invalid id, metadata row). A driver may reject the whole case for `mask_grid_mismatch` (SPEC §2):
            match on (case, reason) first.
        path: the offending file or folder, relative to the atlas root (posix).
    """

    reason: RejectReason
    organ: Organ | None
    path: str | None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {"reason": str(self.reason), "organ": str(self.organ) if self.organ else None, "path": self.path}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExpectedRejection:
        """Inverse of `to_dict`."""
        organ = data["organ"]
        return cls(RejectReason(data["reason"]), Organ(organ) if organ else None, data["path"])


@dataclass(frozen=True, slots=True)
class CaseTruth:
    """What was written for one case and what a correct pipeline must find.

    Attributes:
        case_id: the spec's id (the folder may differ, see `folder_name`).
        folder_name: the case folder's name on disk.
        layout: "split" or "combined".
        split: "train"/"test" as listed in the split files, or None when no split files were written.
        shape: canonical grid (X, Y, Z) of the CT.
        spacing_mm: canonical voxel size (x, y, z) in mm as stored in the headers (float32 values).
        storage: "RAS" or "LPS".
        quirks: sorted quirk names.
        defect: the defect name or None.
        ct_path: the CT file, relative to the atlas root (may be absent on disk: `missing_ct`).
        mask_dir: the `segmentations/` folder, relative to the atlas root.
        organs: organ -> truth (an `OrganLabels`, computed here independently of `emrl_data.labeling.labels`), for every
            registered organ (also for organs a defect makes unusable).
        expected_rejections: what the defect must produce (empty for clean cases).
    """

    case_id: str
    folder_name: str
    layout: str
    split: str | None
    shape: tuple[int, int, int]
    spacing_mm: tuple[float, float, float]
    storage: str
    quirks: tuple[str, ...]
    defect: str | None
    ct_path: str
    mask_dir: str
    organs: dict[Organ, OrganLabels]
    expected_rejections: tuple[ExpectedRejection, ...] = ()

    def expects_row(self, organ: Organ) -> bool:
        """Return True when a correct pipeline produces the organ row of this case.

        A rejection of the whole case (organ None) removes every row, except `bad_metadata_row`, which only
        flags the CSV values; an organ-level rejection removes that organ's row.
        """
        for rejection in self.expected_rejections:
            if rejection.reason is RejectReason.BAD_METADATA_ROW:
                continue
            if rejection.organ is None or rejection.organ is Organ(organ):
                return False
        return True

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "case_id": self.case_id,
            "folder_name": self.folder_name,
            "layout": self.layout,
            "split": self.split,
            "shape": list(self.shape),
            "spacing_mm": list(self.spacing_mm),
            "storage": self.storage,
            "quirks": list(self.quirks),
            "defect": self.defect,
            "ct_path": self.ct_path,
            "mask_dir": self.mask_dir,
            "organs": {str(organ): _truth_to_dict(truth) for organ, truth in self.organs.items()},
            "expected_rejections": [r.to_dict() for r in self.expected_rejections],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CaseTruth:
        """Inverse of `to_dict`."""
        return cls(
            case_id=data["case_id"],
            folder_name=data["folder_name"],
            layout=data["layout"],
            split=data["split"],
            shape=cast("tuple[int, int, int]", tuple(int(n) for n in data["shape"])),
            spacing_mm=cast("tuple[float, float, float]", tuple(float(s) for s in data["spacing_mm"])),
            storage=data["storage"],
            quirks=tuple(data["quirks"]),
            defect=data["defect"],
            ct_path=data["ct_path"],
            mask_dir=data["mask_dir"],
            organs={Organ(k): _truth_from_dict(v) for k, v in data["organs"].items()},
            expected_rejections=tuple(ExpectedRejection.from_dict(r) for r in data["expected_rejections"]),
        )


@dataclass(frozen=True, slots=True)
class AtlasTruth:
    """Ground truth of a whole synthetic atlas, in the order the cases were given.

    Attributes:
        layout: "split" or "combined".
        cases: one `CaseTruth` per spec.
        metadata_csv: the metadata CSV file relative to the root, or None when not written.
        split_files: the split files relative to the root (empty when not written).
    """

    layout: str
    cases: tuple[CaseTruth, ...]
    metadata_csv: str | None = None
    split_files: tuple[str, ...] = ()

    def case(self, case_id: str) -> CaseTruth:
        """Return the truth of `case_id` (KeyError when absent)."""
        for truth in self.cases:
            if truth.case_id == case_id:
                return truth
        raise KeyError(case_id)

    def to_json(self) -> str:
        """Return the truth as JSON text (sorted keys; floats round-trip exactly)."""
        data = {
            "format_version": TRUTH_FORMAT_VERSION,
            "layout": self.layout,
            "metadata_csv": self.metadata_csv,
            "split_files": list(self.split_files),
            "cases": [c.to_dict() for c in self.cases],
        }
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> AtlasTruth:
        """Parse `to_json` output.

        Raises:
            ValueError: on another format version.
        """
        data = json.loads(text)
        if data.get("format_version") != TRUTH_FORMAT_VERSION:
            raise ValueError(f"format_version={data.get('format_version')} is not {TRUTH_FORMAT_VERSION}.")
        return cls(
            layout=data["layout"],
            cases=tuple(CaseTruth.from_dict(c) for c in data["cases"]),
            metadata_csv=data["metadata_csv"],
            split_files=tuple(data["split_files"]),
        )


# ==================================================================================================================
# Phantom construction (canonical RAS voxel space)
# ==================================================================================================================


@dataclass(frozen=True, slots=True)
class _BoxMask:
    """A bool mask stored as its box: `data` covers canonical voxels `[start, start + data.shape)`."""

    start: tuple[int, ...]  # 3 canonical voxel indices
    data: np.ndarray  # bool (x, y, z) crop

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(s + n for s, n in zip(self.start, self.data.shape, strict=True))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop, strict=True))

    def embed(self, start: Sequence[int], shape: Sequence[int]) -> np.ndarray:
        """Return the mask on the box `[start, start + shape)` (bool, C order); parts outside it are dropped."""
        out = np.zeros(tuple(shape), dtype=bool)
        src, dst = [], []
        for a, b, s, n in zip(self.start, self.stop, start, shape, strict=True):
            lo, hi = max(a, s), min(b, s + n)
            if hi <= lo:
                return out
            src.append(slice(lo - a, hi - a))
            dst.append(slice(lo - s, hi - s))
        out[tuple(dst)] = self.data[tuple(src)]
        return out

    def count(self) -> int:
        return int(np.count_nonzero(self.data))


def _union_box(masks: Sequence[_BoxMask]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return (start, shape) of the box covering every mask."""
    start = tuple(min(m.start[i] for m in masks) for i in range(3))
    stop = tuple(max(m.stop[i] for m in masks) for i in range(3))
    return start, tuple(b - a for a, b in zip(start, stop, strict=True))


def _union(masks: Sequence[_BoxMask]) -> _BoxMask:
    start, shape = _union_box(masks)
    data = np.zeros(shape, dtype=bool)
    for m in masks:
        data |= m.embed(start, shape)
    return _BoxMask(start, data)


@dataclass(frozen=True, slots=True)
class _Grid:
    """Maps body units and mm (relative to the grid centre) to canonical voxel indices."""

    shape: tuple[int, int, int]
    spacing_mm: tuple[float, float, float]

    @property
    def centre_vox(self) -> np.ndarray:
        return (np.asarray(self.shape, dtype=np.float64) - 1.0) / 2.0

    @property
    def body_units_mm(self) -> np.ndarray:
        """(A, B, Hz): body semi-axes x and y, and half the z field of view, in mm."""
        half = np.asarray(self.shape, dtype=np.float64) * np.asarray(self.spacing_mm) / 2.0
        return np.array([half[0] * _BODY_SEMI_FRACTION[0], half[1] * _BODY_SEMI_FRACTION[1], half[2]])

    def uvw_to_vox(self, uvw: Sequence[float]) -> np.ndarray:
        return self.centre_vox + np.asarray(uvw) * self.body_units_mm / np.asarray(self.spacing_mm)

    def ellipsoid(self, centre_vox: Sequence[float] | np.ndarray, semi_mm: Sequence[float] | np.ndarray) -> _BoxMask:
        """Voxels whose centres lie in the ellipsoid (centre in voxel indices, semi-axes in mm), clipped to the grid."""
        centre = np.asarray(centre_vox, dtype=np.float64)
        semi_vox = np.asarray(semi_mm, dtype=np.float64) / np.asarray(self.spacing_mm)
        lo = np.maximum(np.ceil(centre - semi_vox - 1e-9).astype(int), 0)
        hi = np.minimum(np.floor(centre + semi_vox + 1e-9).astype(int) + 1, self.shape)
        if np.any(hi <= lo):
            raise ValueError(
                f"Ellipsoid at voxel {centre.tolist()} with semi-axes {list(semi_mm)} mm is off the grid."
            )
        axes = np.ogrid[lo[0] : hi[0], lo[1] : hi[1], lo[2] : hi[2]]
        r2 = sum(((a - c) / s) ** 2 for a, c, s in zip(axes, centre, semi_vox, strict=True))
        return _BoxMask(tuple(int(v) for v in lo), r2 <= 1.0 + 1e-9)

    def organ_uvw(self, shape: Ellipsoid, box: _BoxMask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Normalised coordinates (u, v, w) of the box's voxels relative to an organ mask's base ellipsoid."""
        centre_uvw, semi_uvw = shape
        centre = self.uvw_to_vox(centre_uvw)
        semi_vox = np.asarray(semi_uvw) * self.body_units_mm / np.asarray(self.spacing_mm)
        axes = np.ogrid[tuple(slice(a, b) for a, b in zip(box.start, box.stop, strict=True))]
        return tuple((a - c) / s for a, c, s in zip(axes, centre, semi_vox, strict=True))


_LIVER_SHAPE: Ellipsoid = ((0.38, 0.05, 0.35), (0.34, 0.48, 0.30))
_PANCREAS_SHAPE: Ellipsoid = ((0.0, 0.05, -0.12), (0.42, 0.14, 0.14))


def _liver_segments(grid: _Grid, organ_masks: dict[str, _BoxMask]) -> dict[str, _BoxMask]:
    """`liver_segment_1..8` inside the liver: a Couinaud-like number for every voxel (the module doc's rule)."""
    liver = organ_masks["liver"]
    u, v, w = (np.broadcast_to(c, liver.data.shape) for c in grid.organ_uvw(_LIVER_SHAPE, liver))
    labels = np.zeros(liver.data.shape, dtype=np.int8)
    lateral_left = u < -0.35
    medial = (u >= -0.35) & (u < 0.05)
    right = u >= 0.05
    labels[lateral_left & (w >= 0)] = 2
    labels[lateral_left & (w < 0)] = 3
    labels[medial & (v < -0.3)] = 1
    labels[medial & (v >= -0.3)] = 4
    labels[right & (v >= 0) & (w < 0)] = 5
    labels[right & (v >= 0) & (w >= 0)] = 8
    labels[right & (v < 0) & (w < 0)] = 6
    labels[right & (v < 0) & (w >= 0)] = 7
    return {f"liver_segment_{k}": _BoxMask(liver.start, liver.data & (labels == k)) for k in range(1, 9)}


def _pancreas_thirds(grid: _Grid, organ_masks: dict[str, _BoxMask]) -> dict[str, _BoxMask]:
    """`pancreas_head|body|tail`: thirds along x, head on the patient's right (u >= 1/3), tail u < -1/3."""
    pancreas = organ_masks["pancreas"]
    u = np.broadcast_to(grid.organ_uvw(_PANCREAS_SHAPE, pancreas)[0], pancreas.data.shape)
    labels = np.full(pancreas.data.shape, 2, dtype=np.int8)
    labels[u >= 1.0 / 3.0] = 1
    labels[u < -1.0 / 3.0] = 3
    names = {1: "pancreas_head", 2: "pancreas_body", 3: "pancreas_tail"}
    return {name: _BoxMask(pancreas.start, pancreas.data & (labels == k)) for k, name in names.items()}


@dataclass(frozen=True, slots=True)
class OrganAnatomy:
    """How the synthetic atlas draws one registered organ (its files and vocabulary are in its `OrganSpec`).

    Attributes:
        hu: parenchyma HU.
        shapes: organ mask file -> its ellipsoid in body units (every file of `OrganSpec.organ_masks`). Organs must
            not overlap each other (they are painted in registration order).
        parts: draws the sub-structure files inside the organ: (grid, organ mask file -> mask) -> part file -> mask.
            None when the organ has no sub-structures or its mask files are its parts (the kidney sides).
    """

    hu: int
    shapes: dict[str, Ellipsoid]
    parts: Callable[[_Grid, dict[str, _BoxMask]], dict[str, _BoxMask]] | None = None


# The synthetic anatomy of every registered organ (a new organ adds its entry here).
ANATOMY: dict[str, OrganAnatomy] = {
    "liver": OrganAnatomy(60, {"liver": _LIVER_SHAPE}, _liver_segments),
    "pancreas": OrganAnatomy(40, {"pancreas": _PANCREAS_SHAPE}, _pancreas_thirds),
    "kidney": OrganAnatomy(
        150,
        {
            "kidney_right": ((0.42, -0.38, -0.30), (0.14, 0.16, 0.22)),
            "kidney_left": ((-0.42, -0.38, -0.30), (0.14, 0.16, 0.22)),
        },
    ),
}


def _anatomy(organ: Organ) -> OrganAnatomy:
    """Return the synthetic anatomy of a registered organ."""
    try:
        return ANATOMY[organ]
    except KeyError:
        raise KeyError(f"organ {organ!r} has no synthetic anatomy; add it to emrl_data.synthetic.ANATOMY.") from None


def _part_masks(grid: _Grid, organ: Organ, organ_masks: dict[str, _BoxMask]) -> dict[str, _BoxMask]:
    """Return part file -> mask for the organ's `OrganSpec.parts` (a part that is an organ mask file is that mask)."""
    make = _anatomy(organ).parts
    drawn = make(grid, organ_masks) if make is not None else {}
    return {stem: drawn[stem] if stem in drawn else organ_masks[stem] for stem, _ in organ_spec(organ).parts}


@dataclass(slots=True)
class _PlacedLesion:
    organ: Organ
    radii_mm: tuple[float, float, float]
    attenuation: str
    mask: _BoxMask
    mask_file: str | None  # the organ mask file the lesion joins (kidney: its side); None: outside every organ
    inside_organ: bool = True  # False only for the `lesion_outside_organ` defect's lesion


@dataclass(slots=True)
class _Phantom:
    ct: np.ndarray  # int16 (X, Y, Z) canonical RAS, Fortran order, HU clipped to ±1000
    masks: dict[str, _BoxMask]  # structure file stem -> mask (lesion files only for organs with a lesion)
    lesions: list[_PlacedLesion]
    body_box: tuple[tuple[int, int], tuple[int, int]]  # half-open (x0, x1), (y0, y1) of the body ellipse
    truth: dict[Organ, OrganLabels] = field(default_factory=dict)


def _body_slice(grid: _Grid) -> tuple[np.ndarray, tuple[tuple[int, int], tuple[int, int]]]:
    """Return the axial body profile (int16 HU, (X, Y)) and the body's half-open x/y box."""
    nx, ny, _ = grid.shape
    a_mm, b_mm, _ = grid.body_units_mm
    cx, cy, _ = grid.centre_vox
    x = (np.arange(nx) - cx)[:, None] * grid.spacing_mm[0] / a_mm
    y = (np.arange(ny) - cy)[None, :] * grid.spacing_mm[1] / b_mm
    r = np.sqrt(x**2 + y**2)
    hu = np.full((nx, ny), _AIR_HU, dtype=np.int16)
    hu[r <= 1.0] = _FAT_HU
    hu[(r > _MUSCLE_RING[0]) & (r <= _MUSCLE_RING[1])] = _MUSCLE_HU
    # Vertebra: a disc of bone with a cortical rim (radius in units of B, drawn in mm so it stays round).
    sx_mm = (np.arange(nx) - cx)[:, None] * grid.spacing_mm[0] - _SPINE_CENTRE_UV[0] * a_mm
    sy_mm = (np.arange(ny) - cy)[None, :] * grid.spacing_mm[1] - _SPINE_CENTRE_UV[1] * b_mm
    rs = np.sqrt(sx_mm**2 + sy_mm**2) / (_SPINE_RADIUS_B * b_mm)
    hu[rs <= 1.0] = _CORTEX_HU
    hu[rs <= 0.75] = _BONE_HU
    inside = np.nonzero(r <= 1.0)
    box = ((int(inside[0].min()), int(inside[0].max()) + 1), (int(inside[1].min()), int(inside[1].max()) + 1))
    return hu, box


def _part_centroid(grid: _Grid, lesion: LesionSpec, base: dict[str, _BoxMask]) -> np.ndarray:
    """Centroid (voxel indices) of the lesion's part (or of the whole organ for part "") on the base organ."""
    spec = organ_spec(lesion.organ)
    if lesion.part:
        inverse = {name: stem for stem, name in spec.parts}
        part = _part_masks(grid, lesion.organ, base)[inverse[lesion.part]]
    else:
        part = _union([base[stem] for stem in spec.organ_masks])
    idx = np.argwhere(part.data)
    if idx.size == 0:
        raise ValueError(f"Part {lesion.part!r} of {lesion.organ} is empty on grid {grid.shape}.")
    return idx.mean(axis=0) + np.asarray(part.start)


def _place_lesion(grid: _Grid, lesion: LesionSpec, base: dict[str, _BoxMask]) -> _PlacedLesion:
    centre = _part_centroid(grid, lesion, base) + np.asarray(lesion.offset) / np.asarray(grid.spacing_mm)
    centre = np.rint(centre)  # snap to a voxel centre: the lesion is symmetric about its centre slice
    if np.any(centre < 0) or np.any(centre >= np.asarray(grid.shape)):
        raise ValueError(f"{lesion} is centred off the grid (voxel {centre.tolist()}).")
    # The lesion joins its part's file when that is an organ mask (a kidney side), else the organ's first mask file.
    spec = organ_spec(lesion.organ)
    part_file = dict((name, stem) for stem, name in spec.parts).get(lesion.part)
    mask_file = part_file if part_file in spec.organ_masks else spec.organ_masks[0]
    mask = grid.ellipsoid(centre, lesion.radii_mm)
    return _PlacedLesion(lesion.organ, lesion.radii_mm, lesion.attenuation, mask, mask_file)


def header_spacing_mm(spec: CaseSpec) -> tuple[float, float, float]:
    """Return the spacing a reader gets from the written header (float32 pixdim), in canonical (x, y, z) mm.

    Truth volumes use it, so they equal a reader's voxel count x voxel volume exactly.
    """
    return cast("tuple[float, float, float]", tuple(float(np.float32(s)) for s in spec.spacing_mm))


def _build_phantom(spec: CaseSpec) -> _Phantom:
    """Draw the canonical phantom of `spec` (CT + masks) and compute its truth."""
    grid = _Grid(spec.shape, spec.spacing_mm)
    base = {
        name: grid.ellipsoid(grid.uvw_to_vox(c), np.asarray(s) * grid.body_units_mm)
        for organ in Organ
        for name, (c, s) in _anatomy(organ).shapes.items()
    }
    lesions = [_place_lesion(grid, lesion, base) for lesion in spec.lesions]
    if spec.defect == "lesion_outside_organ":
        centre = np.rint(grid.uvw_to_vox(_OUTSIDE_LESION_UVW))
        mask = grid.ellipsoid(centre, _OUTSIDE_LESION_RADII_MM)
        lesions.append(_PlacedLesion(Organ.LIVER, _OUTSIDE_LESION_RADII_MM, "hypo", mask, None, inside_organ=False))

    # Organ masks = base ellipsoid united with the organ's lesions (the outside-organ defect lesion excluded).
    masks: dict[str, _BoxMask] = {}
    for name, shape in base.items():
        own = [le.mask for le in lesions if le.inside_organ and le.mask_file == name]
        masks[name] = _union([shape, *own]) if own else shape
    for organ in Organ:
        organ_lesions = [le.mask for le in lesions if le.organ is organ]
        if organ_lesions:
            masks[ORGAN_STRUCTURES[organ].lesion_mask] = _union(organ_lesions)
        organ_masks = {s: masks[s] for s in ORGAN_STRUCTURES[organ].organ_masks}
        masks.update(_part_masks(grid, organ, organ_masks))

    ct, body_box = _draw_ct(spec, grid, masks, lesions)
    phantom = _Phantom(ct=ct, masks=masks, lesions=lesions, body_box=body_box)
    phantom.truth = {organ: _organ_truth(organ, phantom, header_spacing_mm(spec)) for organ in Organ}
    return phantom


def _draw_ct(
    spec: CaseSpec, grid: _Grid, masks: dict[str, _BoxMask], lesions: list[_PlacedLesion]
) -> tuple[np.ndarray, tuple[tuple[int, int], tuple[int, int]]]:
    """Paint HU: body, organs, lesions, noise (SD 8), then iso lesions with SD 1 noise; round and clip to ±1000."""
    body, body_box = _body_slice(grid)
    ct = np.empty(spec.shape, dtype=np.int16, order="F")
    ct[...] = body[:, :, None]
    for organ in Organ:
        anatomy = _anatomy(organ)
        for name in anatomy.shapes:
            m = masks[name]
            ct[m.slices()][m.data] = anatomy.hu
    for le in lesions:
        ct[le.mask.slices()][le.mask.data] = _anatomy(le.organ).hu + _LESION_DELTA_HU[le.attenuation]

    rng = np.random.default_rng([spec.seed, 0])
    for z0 in range(0, spec.shape[2], _NOISE_SLAB_Z):
        z1 = min(z0 + _NOISE_SLAB_Z, spec.shape[2])
        slab = ct[:, :, z0:z1].astype(np.float32)
        slab += np.float32(_NOISE_SD_HU) * rng.standard_normal(slab.shape, dtype=np.float32)
        np.rint(slab, out=slab)
        np.clip(slab, -_CT_CLIP_HU, _CT_CLIP_HU, out=slab)
        ct[:, :, z0:z1] = slab.astype(np.int16)

    iso_rng = np.random.default_rng([spec.seed, 2])
    for le in lesions:
        if le.attenuation != "iso":
            continue
        n = le.mask.count()
        values = _anatomy(le.organ).hu + _ISO_NOISE_SD_HU * iso_rng.standard_normal(n)
        ct[le.mask.slices()][le.mask.data] = np.clip(np.rint(values), -_CT_CLIP_HU, _CT_CLIP_HU).astype(np.int16)
    return ct, body_box


# ==================================================================================================================
# Naive ground truth (independent of emrl_data.labeling.labels)
# ==================================================================================================================


def _organ_truth(organ: Organ, phantom: _Phantom, spacing_mm: tuple[float, float, float]) -> OrganLabels:
    """Compute an organ's truth with plain scipy/numpy on a box covering the organ and its lesions."""
    voxel_mm3 = float(np.prod(spacing_mm))
    structures = organ_spec(organ)
    organ_parts = [phantom.masks[s] for s in structures.organ_masks]
    lesion = phantom.masks.get(structures.lesion_mask)
    start, shape = _union_box(organ_parts + ([lesion] if lesion is not None else []))
    organ_mask = np.zeros(shape, dtype=bool)
    for m in organ_parts:
        organ_mask |= m.embed(start, shape)
    lesion_mask = lesion.embed(start, shape) if lesion is not None else np.zeros(shape, dtype=bool)
    box = tuple(slice(a, a + n) for a, n in zip(start, shape, strict=True))
    ct = np.ascontiguousarray(phantom.ct[box]).astype(np.float64)

    parenchyma = organ_mask & ~lesion_mask
    negative = OrganLabels.negative(
        organ,
        organ_volume_mm3=float(np.count_nonzero(organ_mask)) * voxel_mm3,
        parenchyma_mean_hu=float(ct[parenchyma].mean()),
        parenchyma_sd_hu=float(ct[parenchyma].std()),
        organ_box_xyzxyz_vox=_tight_box(organ_mask, start),
    )
    labels, n = ndimage.label(lesion_mask, structure=np.ones((3, 3, 3), dtype=bool))
    sizes = np.bincount(labels.ravel(), minlength=n + 1)[1:]
    min_voxels = LabelConfig().min_lesion_volume_mm3 / voxel_mm3
    surviving = [i + 1 for i, size in enumerate(sizes) if size >= min_voxels]
    if not surviving:
        return negative
    # Largest by volume; ties -> lowest label = first voxel in C order of (x, y, z).
    largest = max(surviving, key=lambda lab: (sizes[lab - 1], -lab))
    comp = labels == largest
    return replace(
        negative,
        has_lesion=True,
        lesion_count=len(surviving),
        volume_mm3=float(sizes[largest - 1]) * voxel_mm3,
        total_lesion_volume_mm3=float(sum(sizes[lab - 1] for lab in surviving)) * voxel_mm3,
        location=_truth_location(organ, comp, start, shape, phantom),
        **_lesion_truth(organ, comp, ct, start, phantom, spacing_mm, negative),
    )


def _lesion_truth(
    organ: Organ,
    comp: np.ndarray,
    ct: np.ndarray,
    start: tuple[int, ...],
    phantom: _Phantom,
    spacing_mm: tuple[float, float, float],
    organ_truth: OrganLabels,
) -> dict[str, Any]:
    """The largest lesion's key slice, boxes, HU, attenuation and (analytic) axes; `comp` is its mask in the box."""
    per_slice = comp.sum(axis=(0, 1))
    key_local = int(np.argmax(per_slice))  # first maximum = lowest z
    xs, ys = np.nonzero(comp[:, :, key_local])
    lesion_mean = float(ct[comp].mean())
    par_mean, par_sd = organ_truth.parenchyma_mean_hu, organ_truth.parenchyma_sd_hu
    if abs(lesion_mean - par_mean) < LabelConfig().iso_sd_fraction * par_sd:
        attenuation = Attenuation.ISO.value
    elif lesion_mean < par_mean:
        attenuation = Attenuation.HYPO.value
    else:
        attenuation = Attenuation.HYPER.value
    # Analytic axes from the placed ellipsoid that overlaps the component most.
    best = max(
        (le for le in phantom.lesions if le.organ is organ),
        key=lambda le: int(np.count_nonzero(le.mask.embed(start, comp.shape) & comp)),
    )
    return {
        "long_axis_mm": 2.0 * max(best.radii_mm[0], best.radii_mm[1]),
        "short_axis_mm": 2.0 * min(best.radii_mm[0], best.radii_mm[1]),
        "attenuation": attenuation,
        "lesion_mean_hu": lesion_mean,
        "key_slice_z_vox": key_local + start[2],
        "max_diameter_z_vox": _longest_diameter_slice(comp, spacing_mm) + start[2],
        "bbox_xyxy_vox": (
            int(xs.min()) + start[0],
            int(ys.min()) + start[1],
            int(xs.max()) + 1 + start[0],
            int(ys.max()) + 1 + start[1],
        ),
        "lesion_box_xyzxyz_vox": _tight_box(comp, start),
    }


def _tight_box(mask: np.ndarray, start: Sequence[int]) -> tuple[int, int, int, int, int, int]:
    """Return the half-open box `(x0, y0, z0, x1, y1, z1)` of a non-empty mask whose voxel 0 is canonical `start`."""
    idx = np.argwhere(mask)
    lo, hi = idx.min(axis=0) + np.asarray(start), idx.max(axis=0) + 1 + np.asarray(start)
    return cast("tuple[int, int, int, int, int, int]", tuple(int(v) for v in (*lo, *hi)))


def _longest_diameter_slice(comp: np.ndarray, spacing_mm: Sequence[float]) -> int:
    """Return the z (in `comp`'s frame) of the longest in-plane outer Feret diameter; ties -> lowest z.

    Brute force with scipy's convex hull over the corners of every voxel of each slice (voxel `(x, y)` covers
    `[x, x+1) x [y, y+1)`), distances from integer corner differences times the spacing.
    """
    scale = np.asarray(spacing_mm[:2], dtype=np.float64)
    best_d2, best_z = -1.0, 0
    for z in range(comp.shape[2]):
        xs, ys = np.nonzero(comp[:, :, z])
        if xs.size == 0:
            continue
        corners = np.unique(
            np.concatenate([np.stack([xs + dx, ys + dy], 1) for dx in (0, 1) for dy in (0, 1)]), axis=0
        ).astype(np.int64)
        hull = corners[ConvexHull(corners).vertices]
        diff = (hull[:, None, :] - hull[None, :, :]) * scale
        d2 = float(np.einsum("ijk,ijk->ij", diff, diff).max())
        if d2 > best_d2:
            best_d2, best_z = d2, z
    return best_z


def _truth_location(
    organ: Organ, comp: np.ndarray, start: tuple[int, ...], shape: tuple[int, ...], phantom: _Phantom
) -> tuple[str, ...]:
    """Parts holding > 10 % of the component's part-labelled voxels (`single_location`: the majority part)."""
    counts: dict[str, int] = {}
    any_part = np.zeros(shape, dtype=bool)
    for stem, name in ORGAN_STRUCTURES[organ].parts:
        part = phantom.masks[stem].embed(start, shape)
        counts[name] = int(np.count_nonzero(comp & part))
        any_part |= part
    denominator = int(np.count_nonzero(comp & any_part))
    if denominator == 0:
        return ()
    if organ_spec(organ).single_location:  # the majority part; max keeps the first of equals (kidney: left)
        return (max(LOCATION_NAMES[organ], key=lambda name: counts[name]),)
    threshold = LabelConfig().location_min_fraction
    return tuple(name for name in LOCATION_NAMES[organ] if counts[name] / denominator > threshold)


# ==================================================================================================================
# Writing
# ==================================================================================================================


def _canonical_affine(shape: Sequence[int], spacing_mm: Sequence[float]) -> np.ndarray:
    """RAS affine of the canonical CT grid: diagonal spacing, x/y centred on 0, z ending at 0 (like a CT table)."""
    affine = np.diag([*map(float, spacing_mm), 1.0])
    affine[0, 3] = -(shape[0] - 1) / 2.0 * spacing_mm[0]
    affine[1, 3] = -(shape[1] - 1) / 2.0 * spacing_mm[1]
    affine[2, 3] = -(shape[2] - 1) * spacing_mm[2]
    return affine


def _translate(affine: np.ndarray, start_vox: Sequence[int]) -> np.ndarray:
    """Affine of a sub-grid whose voxel 0 is voxel `start_vox` of `affine`'s grid."""
    shift = np.eye(4)
    shift[:3, 3] = np.asarray(start_vox, dtype=np.float64)
    return affine @ shift


def _storage_affine(affine: np.ndarray, shape: Sequence[int], storage: str) -> np.ndarray:
    """Return the affine of a grid of `shape` stored in `storage` orientation, given its canonical RAS affine."""
    if storage == "RAS":
        return affine
    flip = np.array([[-1.0, 0, 0, shape[0] - 1], [0, -1.0, 0, shape[1] - 1], [0, 0, 1.0, 0], [0, 0, 0, 1.0]])
    return affine @ flip


def _to_storage(array: np.ndarray, affine: np.ndarray, storage: str) -> tuple[np.ndarray, np.ndarray]:
    """Return (stored array view, stored affine) for a canonical array and its RAS affine (LPS flips x and y)."""
    stored = array[::-1, ::-1] if storage == "LPS" else array
    return stored, _storage_affine(affine, array.shape, storage)


def _nifti_header_block(
    data: np.ndarray, affine: np.ndarray, *, code: int | None = None, claimed_shape: Sequence[int] | None = None
) -> bytes:
    """Return the 352 bytes nibabel's `Nifti1Image(data, affine).to_bytes()` puts before the voxels.

    Args:
        data: the array to be written (any dtype nibabel supports; 2-D to 4-D).
        affine: (4, 4) float voxel -> world (mm) of the stored array.
        code: when given, both q/sform codes (nibabel's default is sform 2, qform 0).
        claimed_shape: a shape to claim in the header instead of `data.shape` (the `absurd_header` defect).
    """
    image = nib.Nifti1Image(data, affine)
    if code is not None:
        image.set_qform(affine, code=code)
        image.set_sform(affine, code=code)
    header = image.header
    if claimed_shape is not None:
        header.set_data_shape(tuple(claimed_shape))
    header.set_data_offset(_VOX_OFFSET)
    header.set_slope_inter(1.0, 0.0)  # what nibabel writes for unscaled data
    block = header.binaryblock
    return block + b"\x00" * (_VOX_OFFSET - len(block))


def _write_gzip(path: Path, chunks: Sequence[bytes | memoryview]) -> None:
    """Write `chunks` as one deterministic gzip stream (ISA-L, mtime 0, no file name in the header)."""
    with (
        path.open("wb") as raw,
        isal.igzip.IGzipFile(filename="", mode="wb", compresslevel=_GZIP_LEVEL, fileobj=raw, mtime=0) as stream,
    ):
        for chunk in chunks:
            stream.write(chunk)


def _write_nifti_gz(
    path: Path,
    data: np.ndarray,
    affine: np.ndarray,
    *,
    code: int | None = None,
    claimed_shape: Sequence[int] | None = None,
) -> None:
    """Write `data` as `.nii.gz`; the uncompressed bytes equal nibabel's `to_bytes()` (tested).

    Args:
        path: the file to write.
        data: the stored array (any memory order; Fortran-ordered arrays are written without a copy).
        affine: (4, 4) float voxel -> world (mm) of the stored array.
        code: optional q/sform code for both forms.
        claimed_shape: optional shape to claim in the header instead of `data.shape`.
    """
    data = np.asfortranarray(data)  # a no-op for the Fortran-ordered arrays built here
    payload = data.T.data.cast("B")  # data.T is C-contiguous: its bytes are `data` in Fortran order
    _write_gzip(path, [_nifti_header_block(data, affine, code=code, claimed_shape=claimed_shape), payload])


def _case_paths(root: Path, folder: str, layout: str) -> tuple[Path, Path]:
    """Return (ct file, segmentations folder) of a case folder in `layout`."""
    if layout == "split":
        return root / "image_only" / folder / "ct.nii.gz", root / "mask_only" / folder / "segmentations"
    if layout == "combined":
        return root / folder / "ct.nii.gz", root / folder / "segmentations"
    raise ValueError(f"layout={layout!r} must be 'split' or 'combined'.")


def _write_ct(path: Path, spec: CaseSpec, ct: np.ndarray, affine: np.ndarray) -> None:
    """Write the CT file as `spec.defect` wants it (no file for `missing_ct`).

    Args:
        path: the CT file.
        spec: the case.
        ct: int16 (X, Y, Z) canonical RAS HU.
        affine: (4, 4) RAS affine of the canonical grid.
    """
    if spec.defect == "implausible_organ_hu":
        ct = _painted_pancreas(spec, ct, hu=400)
    stored, stored_affine = _to_storage(ct, affine, spec.storage)
    defect = spec.defect
    if defect == "missing_ct":
        return
    if defect in ("implausible_spacing", "geometry_conflict"):
        _write_ct_geometry_defect(path, defect, stored, stored_affine)
        return
    if defect == "not_nifti":
        _write_gzip(path, [b"This is not a NIfTI image; it is a text file named ct.nii.gz.\n" * 64])
    elif defect == "ct_2d":
        _write_nifti_gz(path, stored[:, :, stored.shape[2] // 2], stored_affine)
    elif defect == "ct_4d":
        _write_nifti_gz(path, np.stack([stored] * 3, axis=-1), stored_affine)
    elif defect == "nan_voxels":
        data = np.asfortranarray(stored, dtype=np.float32)
        cx, cy, cz = (n // 2 for n in data.shape)
        data[cx - 1 : cx + 2, cy - 1 : cy + 2, cz] = np.nan
        _write_nifti_gz(path, data, stored_affine)
    elif defect == "absurd_header":
        _write_nifti_gz(path, stored, stored_affine, claimed_shape=(30000, 30000, 30000))
    else:
        _write_nifti_gz(path, stored, stored_affine)
    if defect == "truncated_gzip":
        compressed = path.read_bytes()
        path.write_bytes(compressed[: len(compressed) * 6 // 10])
    elif defect == "corrupt_gzip":
        corrupted = bytearray(path.read_bytes())
        middle = len(corrupted) // 2
        if middle < 4096:
            raise ValueError(f"CT of {spec.case_id} compresses to {len(corrupted)} bytes: too small to corrupt.")
        for i in range(middle, middle + 16):
            corrupted[i] ^= 0xFF
        path.write_bytes(bytes(corrupted))
    elif defect == "unreadable_file":
        path.unlink()
        path.symlink_to(path.name)  # ELOOP on open: an OSError that chmod 000 cannot give a root user


def _painted_pancreas(spec: CaseSpec, ct: np.ndarray, *, hu: int) -> np.ndarray:
    """A copy of the canonical CT with the pancreas' base ellipsoid painted at `hu` (`implausible_organ_hu`)."""
    grid = _Grid(spec.shape, spec.spacing_mm)
    centre, semi = _PANCREAS_SHAPE
    pancreas = grid.ellipsoid(grid.uvw_to_vox(centre), np.asarray(semi) * grid.body_units_mm)
    painted = ct.copy(order="F")
    painted[pancreas.slices()][pancreas.data] = hu
    return painted


def _write_ct_geometry_defect(path: Path, defect: str, stored: np.ndarray, affine: np.ndarray) -> None:
    """Write the CT with a 1000x voxel size (`implausible_spacing`) or pixdim 10x its sform (`geometry_conflict`)."""
    if defect == "implausible_spacing":
        scaled = affine.copy()
        scaled[:3, :3] *= 1000.0
        _write_nifti_gz(path, stored, scaled)
        return
    block = bytearray(_nifti_header_block(stored, affine))
    header = nib.Nifti1Header(bytes(block[:348]))
    pixdim = header["pixdim"].copy()
    pixdim[1:4] *= 10.0
    header["pixdim"] = pixdim
    block[:348] = header.binaryblock
    data = np.asfortranarray(stored)
    _write_gzip(path, [bytes(block), data.T.data.cast("B")])


def _mask_grid(spec: CaseSpec, phantom: _Phantom) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Return (start, shape) of the masks' canonical grid: the CT grid, or the cropped grid of `mask_cropped_grid`."""
    if "mask_cropped_grid" not in spec.quirks:
        return (0, 0, 0), spec.shape
    start, shape = _union_box(list(phantom.masks.values()))
    stop = [a + n for a, n in zip(start, shape, strict=True)]
    (bx0, bx1), (by0, by1) = phantom.body_box
    x0, x1 = min(start[0], bx0), max(stop[0], bx1)
    y0, y1 = min(start[1], by0), max(stop[1], by1)
    z0, z1 = max(start[2] - 1, 0), min(stop[2] + 1, spec.shape[2])
    return (x0, y0, z0), (x1 - x0, y1 - y0, z1 - z0)


def _paste(volume: np.ndarray, mask: _BoxMask, volume_start: Sequence[int]) -> None:
    """Set `volume` to 1 where `mask` is set; `volume` covers canonical voxels from `volume_start` (crop only)."""
    src, dst = [], []
    for a, b, s, n in zip(mask.start, mask.stop, volume_start, volume.shape, strict=True):
        lo, hi = max(a, s), min(b, s + n)
        if hi <= lo:
            return
        src.append(slice(lo - a, hi - a))
        dst.append(slice(lo - s, hi - s))
    volume[tuple(dst)][mask.data[tuple(src)]] = 1


def _write_mask(
    path: Path,
    spec: CaseSpec,
    structure: str,
    mask: _BoxMask,
    grid_start: tuple[int, int, int],
    grid_shape: tuple[int, int, int],
    ct_affine: np.ndarray,
) -> None:
    """Write one mask file (int8 0/1), honouring the quirks and the mask defects.

    Args:
        path: the mask file.
        spec: the case.
        structure: the file stem (e.g. "kidney_right").
        mask: the structure in canonical voxels.
        grid_start: canonical voxel of the mask grid's voxel 0 (non-zero for `mask_cropped_grid`).
        grid_shape: canonical (X, Y, Z) size of the mask grid.
        ct_affine: (4, 4) RAS affine of the canonical CT grid.
    """
    if spec.defect == "mask_grid_mismatch" and structure == "liver":
        # Its own bounding-box grid and an affine rotated 10 degrees about z: not placeable on the CT grid.
        angle = math.radians(10.0)
        rotation = np.eye(4)
        rotation[:2, :2] = [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]]
        stored, stored_affine = _to_storage(
            mask.data.astype(np.int8), rotation @ _translate(ct_affine, mask.start), spec.storage
        )
        _write_nifti_gz(path, stored, stored_affine)
        return

    stored_affine = _storage_affine(_translate(ct_affine, grid_start), grid_shape, spec.storage)
    data = np.zeros(grid_shape, dtype=np.int8, order="F")  # storage order; `canonical` is a view of it
    canonical = data[::-1, ::-1] if spec.storage == "LPS" else data
    if not (spec.defect == "empty_organ_mask" and structure == "pancreas"):
        _paste(canonical, mask, grid_start)
    if spec.defect == "mask_values" and structure == "kidney_right":
        idx = np.argwhere(canonical)
        x, y, z = idx[len(idx) // 2]
        canonical[x : x + 2, y : y + 2, z] = 2
    if spec.defect == "mask_orientation_conflict" and structure == "liver":
        canonical[...] = canonical[::-1].copy()  # mirrored voxels under the correct affine
    if "flipped_affine_mask" in spec.quirks and structure == "kidney_right":
        _write_nifti_gz(path, data, _LPS_FLIP @ stored_affine, code=1)
    else:
        _write_nifti_gz(path, data, stored_affine)


def _expected_rejections(spec: CaseSpec, ct_rel: str, mask_rel: str, folder_rel: str) -> tuple[ExpectedRejection, ...]:
    if spec.defect is None:
        return ()
    reason = DEFECTS[spec.defect]
    where: dict[str, tuple[Organ | None, str]] = {
        "mask_values": (Organ.KIDNEY, f"{mask_rel}/kidney_right.nii.gz"),
        "missing_organ_mask": (Organ.PANCREAS, f"{mask_rel}/pancreas.nii.gz"),
        "empty_organ_mask": (Organ.PANCREAS, f"{mask_rel}/pancreas.nii.gz"),
        "lesion_outside_organ": (Organ.LIVER, f"{mask_rel}/liver_lesion.nii.gz"),
        "mask_grid_mismatch": (None, f"{mask_rel}/liver.nii.gz"),  # SPEC §2: rejects the whole case
        "mask_orientation_conflict": (Organ.LIVER, f"{mask_rel}/liver.nii.gz"),
        "implausible_organ_hu": (Organ.PANCREAS, f"{mask_rel}/pancreas.nii.gz"),
        "invalid_case_id": (None, folder_rel),
        "bad_metadata_row": (None, METADATA_CSV_NAME),
        "split_conflict": (None, f"{SPLIT_DIR_NAME}/IID_train.csv"),
        "not_a_case": (None, folder_rel),
    }
    organ, path = where.get(spec.defect, (None, ct_rel))
    return (ExpectedRejection(reason, organ, path),)


def write_case(root: Path, spec: CaseSpec, *, layout: str = "split") -> CaseTruth:
    """Draw the phantom of `spec` and write its files under `root` in `layout`.

    Args:
        root: the atlas root (created when missing).
        spec: the case.
        layout: "split" (`image_only/` + `mask_only/`, as released) or "combined" (`<id>/ct.nii.gz` +
            `<id>/segmentations/`).

    Returns:
        The case's truth; `split` is None (only `write_atlas` writes split files).

    Raises:
        ValueError: on an unknown layout or a lesion that does not fit the grid.
    """
    root = Path(root)
    folder = spec.folder_name
    ct_path, mask_dir = _case_paths(root, folder, layout)
    phantom = _build_phantom(spec)
    ct_affine = _canonical_affine(spec.shape, spec.spacing_mm)

    ct_path.parent.mkdir(parents=True, exist_ok=True)
    _write_ct(ct_path, spec, phantom.ct, ct_affine)

    mask_dir.mkdir(parents=True, exist_ok=True)
    grid_start, grid_shape = _mask_grid(spec, phantom)
    structures = dict(phantom.masks)
    if "empty_lesion_files" in spec.quirks:
        for organ in Organ:
            stem = ORGAN_STRUCTURES[organ].lesion_mask
            if stem not in structures:
                structures[stem] = _BoxMask((0, 0, 0), np.zeros((1, 1, 1), dtype=bool))
    for structure in sorted(structures):
        if spec.defect == "missing_organ_mask" and structure == "pancreas":
            continue
        path = mask_dir / f"{structure}.nii.gz"
        _write_mask(path, spec, structure, structures[structure], grid_start, grid_shape, ct_affine)

    def rel(path: Path) -> str:
        return path.relative_to(root).as_posix()

    if spec.defect == "not_a_case":  # a regular file where the case's (image) folder belongs
        shutil.rmtree(ct_path.parent)
        ct_path.parent.write_bytes(b"not a case folder\n")
    folder_rel = rel(ct_path.parent)
    truth = CaseTruth(
        case_id=spec.case_id,
        folder_name=folder,
        layout=layout,
        split=None,
        shape=spec.shape,
        spacing_mm=header_spacing_mm(spec),
        storage=spec.storage,
        quirks=tuple(sorted(spec.quirks)),
        defect=spec.defect,
        ct_path=rel(ct_path),
        mask_dir=rel(mask_dir),
        organs=phantom.truth,
        expected_rejections=_expected_rejections(spec, rel(ct_path), rel(mask_dir), folder_rel),
    )
    logger.debug("Wrote synthetic case %s (%s layout) under %s.", spec.case_id, layout, root)
    return truth


def _fmt1(value: float) -> str:
    return f"{value:.1f}"


def metadata_columns() -> tuple[str, ...]:
    """Return the metadata CSV's columns: the case columns and every registered organ's, in a deliberately
    NON-canonical order (sorted by a hash of the name), as readers must parse by name (notes/atlas.md §2.1)."""
    names = [*_CASE_CSV_COLUMNS, *(c for spec in ORGAN_STRUCTURES.values() for c in spec.csv.as_dict().values())]
    return tuple(sorted(names, key=lambda name: hashlib.sha256(name.encode()).hexdigest()))


def _metadata_row(spec: CaseSpec, truth: CaseTruth) -> dict[str, str]:
    """The case's metadata CSV row in the release's conventions (1 decimal, NaN -> 0 for lesion numbers)."""
    rng = np.random.default_rng([spec.seed, 1])
    row = {
        "BDMAP ID": spec.case_id,
        "spacing": str(np.asarray(spec.spacing_mm, dtype=np.float32)),
        "shape": str(np.asarray(spec.shape, dtype=np.int64)),
        "sex": "F" if rng.integers(2) == 0 else "M",
        "age": str(int(rng.integers(25, 86))),
    }
    for organ, ot in truth.organs.items():
        columns = organ_spec(organ).csv
        row[columns.organ_volume_cm3] = _fmt1(ot.organ_volume_mm3 / 1000.0)
        # pandas writes a NaN-filled float column: counts appear as "2.0".
        row[columns.count] = _fmt1(float(ot.lesion_count))
        row[columns.diameter_cm] = _fmt1(ot.long_axis_mm / 10.0) if ot.long_axis_mm else "0.0"
        row[columns.location] = ",".join(ot.location)
        row[columns.attenuation] = _CSV_ATTENUATION_WORD.get(ot.attenuation or "", "")
    if spec.defect == "bad_metadata_row":
        row[organ_spec(Organ.LIVER).csv.count] = "abc"
    return row


def write_atlas(
    root: Path,
    specs: Sequence[CaseSpec],
    *,
    layout: str = "split",
    metadata_csv: bool = True,
    split_files: bool = True,
) -> AtlasTruth:
    """Write every case, the metadata CSV, the IID split files and `synthetic_truth.json` under `root`.

    Cases with the `invalid_case_id` defect are left out of the CSV and the split files (their folder is a stray).
    Without `metadata_csv`, a `bad_metadata_row` defect has nothing to break and expects no rejection.

    Args:
        root: the atlas root (created when missing).
        specs: the cases; ids must be unique.
        layout: "split" or "combined".
        metadata_csv: write `AbdomenAtlas3.0MiniWithMeta.csv` (columns by name, non-canonical order).
        split_files: write `TrainTestIDS/IID_train.csv` and `IID_test.csv` (column `BDMAP ID`) from `spec.split`.

    Returns:
        The atlas truth (also written to `root/synthetic_truth.json`).

    Raises:
        ValueError: on duplicate case ids or an unknown layout.
    """
    root = Path(root)
    ids = [s.case_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"Duplicate case ids in specs: {sorted({i for i in ids if ids.count(i) > 1})}.")
    root.mkdir(parents=True, exist_ok=True)
    truths: list[CaseTruth] = []
    for spec in specs:
        truth = write_case(root, spec, layout=layout)
        listed = spec.defect != "invalid_case_id"
        rejections = truth.expected_rejections
        if not metadata_csv:
            rejections = tuple(r for r in rejections if r.reason is not RejectReason.BAD_METADATA_ROW)
        if not split_files:
            rejections = tuple(r for r in rejections if r.reason is not RejectReason.SPLIT_CONFLICT)
        split = spec.split.value if (split_files and listed) else None
        truths.append(replace(truth, split=split, expected_rejections=rejections))

    listed_pairs = [(s, t) for s, t in zip(specs, truths, strict=True) if s.defect != "invalid_case_id"]
    csv_rel: str | None = None
    if metadata_csv:
        csv_rel = METADATA_CSV_NAME
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(metadata_columns()), lineterminator="\n")
        writer.writeheader()
        for spec, truth in listed_pairs:
            writer.writerow(_metadata_row(spec, truth))
        (root / csv_rel).write_text(buffer.getvalue(), encoding="utf-8")
    split_rels: tuple[str, ...] = ()
    if split_files:
        (root / SPLIT_DIR_NAME).mkdir(exist_ok=True)
        for split in (Split.TRAIN, Split.TEST):
            rel_path = f"{SPLIT_DIR_NAME}/IID_{split.value}.csv"
            lines = ["BDMAP ID"] + [
                s.case_id for s, _ in listed_pairs if s.split is split or s.defect == "split_conflict"
            ]
            (root / rel_path).write_text("\n".join(lines) + "\n", encoding="utf-8")
            split_rels += (rel_path,)
    atlas = AtlasTruth(layout=layout, cases=tuple(truths), metadata_csv=csv_rel, split_files=split_rels)
    (root / TRUTH_JSON_NAME).write_text(atlas.to_json(), encoding="utf-8")
    logger.info("Wrote a synthetic atlas of %d cases (%s layout) under %s.", len(truths), layout, root)
    return atlas


# ==================================================================================================================
# Ready-made specs
# ==================================================================================================================

DEMO_SHAPE: tuple[int, int, int] = (160, 128, 40)


def _lesion(organ: Organ, part: str, radius: float | tuple[float, float, float], att: str = "hypo") -> LesionSpec:
    radii = (radius, radius, radius) if isinstance(radius, int | float) else radius
    return LesionSpec(organ, part, radii, att)


def _demo_catalogue() -> list[dict[str, Any]]:
    """Hand-designed demo cases (keyword arguments of CaseSpec without case_id/seed/split)."""
    liver, pancreas, kidney = Organ.LIVER, Organ.PANCREAS, Organ.KIDNEY
    return [
        # 1: one large hypo liver lesion (> 2 cm) in segment 8; other organs negative.
        {"lesions": (_lesion(liver, "8", (12.0, 10.0, 10.0)),)},
        # 2: all three organs positive, small lesions (< 2 cm).
        {"lesions": (_lesion(liver, "6", 4.0), _lesion(pancreas, "head", 4.0), _lesion(kidney, "right", 4.0))},
        # 3: negative case (no lesion anywhere).
        {},
        # 4: several liver lesions (3), hyper largest in segment 7, two small hypo.
        {"lesions": (_lesion(liver, "7", 8.0, "hyper"), _lesion(liver, "3", 3.0), _lesion(liver, "5", 3.0))},
        # 5: pancreas: large hypo tail lesion (2.2 cm) + small head lesion.
        {"lesions": (_lesion(pancreas, "tail", (11.0, 6.0, 6.0)), _lesion(pancreas, "head", 3.0))},
        # 6: kidneys: two left lesions (iso largest) + one right.
        {"lesions": (_lesion(kidney, "left", 6.0, "iso"), _lesion(kidney, "right", 3.5, "hyper"))},
        # 7: iso liver lesion, large.
        {"lesions": (_lesion(liver, "4", (11.0, 11.0, 7.5), "iso"),)},
        # 8: hyper pancreatic lesion, kidney negative, liver small hypo.
        {"lesions": (_lesion(pancreas, "body", 4.5, "hyper"), _lesion(liver, "2", 5.0))},
        # 9: quirk mask_cropped_grid, liver + kidney lesions.
        {"lesions": (_lesion(liver, "5", 6.0), _lesion(kidney, "left", 5.0)), "quirks": {"mask_cropped_grid"}},
        # 10: quirk flipped_affine_mask with a right kidney lesion (the flipped file matters).
        {"lesions": (_lesion(kidney, "right", 5.0),), "quirks": {"flipped_affine_mask"}},
        # 11: quirk lps_storage, liver + pancreas lesions.
        {"lesions": (_lesion(liver, "8", 7.0), _lesion(pancreas, "head", 4.0)), "storage": "LPS"},
        # 12: quirk anisotropic spacing (0.7, 0.9, 3.0), liver hyper lesion.
        {"lesions": (_lesion(liver, "6", 6.0, "hyper"),), "quirks": {"anisotropic"}},
        # 13: LPS + cropped masks + empty lesion files for negatives.
        {
            "lesions": (_lesion(pancreas, "tail", 5.0),),
            "quirks": {"lps_storage", "mask_cropped_grid", "empty_lesion_files"},
        },
        # 14: defect truncated_gzip (the CT file is cut).
        {"lesions": (_lesion(liver, "7", 6.0),), "defect": "truncated_gzip"},
        # 15: defect mask_grid_mismatch (liver.nii.gz has a rotated affine on its own grid).
        {"lesions": (_lesion(liver, "5", 5.0),), "defect": "mask_grid_mismatch"},
    ]


def _random_demo_case(rng: np.random.Generator) -> dict[str, Any]:
    """A seeded filler case: each organ negative or with 1-2 lesions in distinct, well separated parts."""
    lesions: list[LesionSpec] = []
    choices = {
        Organ.LIVER: (("8", "6", "3"), (4.0, 5.0, 7.0, 10.0)),
        Organ.PANCREAS: (("head", "tail"), (3.5, 4.5)),
        Organ.KIDNEY: (("left", "right"), (3.5, 5.0)),
    }
    attenuations = ("hypo", "hypo", "hypo", "hyper", "iso")
    for organ, (parts, radii) in choices.items():
        n = int(rng.choice([0, 0, 1, 2]))
        picked = rng.permutation(len(parts))[:n]
        for rank, p in enumerate(picked):
            radius = float(rng.choice(radii)) if rank == 0 else 3.0
            lesions.append(
                _lesion(organ, parts[int(p)], radius, str(rng.choice(attenuations)) if rank == 0 else "hypo")
            )
    return {"lesions": tuple(lesions)}


def demo_specs(n_cases: int = 32, seed: int = 0) -> list[CaseSpec]:
    """Return the demo atlas: hand-designed cases, then seeded random fillers, ids BDMAP_00000001..

    With the default 32 cases it covers all three organs, positives and negatives, several lesions per organ,
    lesions under and over 2 cm, every quirk, two defective cases (truncated_gzip, mask_grid_mismatch) and both
    splits (every 4th case is a test case). Fewer cases truncate the catalogue (coverage is then not guaranteed).

    Args:
        n_cases: number of cases (>= 1).
        seed: seeds the fillers and the per-case noise.

    Returns:
        The specs, grid `DEMO_SHAPE` at 0.8 x 0.8 x 2.5 mm unless a quirk says otherwise.
    """
    if n_cases < 1:
        raise ValueError(f"n_cases={n_cases} must be >= 1.")
    rng = np.random.default_rng([seed, 7])
    kwargs = _demo_catalogue()[:n_cases]
    while len(kwargs) < n_cases:
        kwargs.append(_random_demo_case(rng))
    specs = []
    for i, kw in enumerate(kwargs, start=1):
        kw = dict(kw)
        kw["quirks"] = frozenset(kw.get("quirks", ()))
        split = Split.TEST if i % 4 == 0 else Split.TRAIN
        specs.append(CaseSpec(case_id=f"BDMAP_{i:08d}", shape=DEMO_SHAPE, seed=seed * 100_000 + i, split=split, **kw))
    return specs


def bench_spec(case_id: str = "BDMAP_00000001") -> CaseSpec:
    """Return the benchmark case: 512 x 512 x 300 at 0.78 x 0.78 x 2.5 mm, LPS storage, three lesions.

    Lesions: a 3.6 cm hypo liver lesion (segment 7), a 2.0 cm hypo pancreatic head lesion, a 2.4 cm hyper
    left kidney lesion.
    """
    return CaseSpec(
        case_id=case_id,
        shape=(512, 512, 300),
        spacing_mm=(0.78, 0.78, 2.5),
        lesions=(
            LesionSpec(Organ.LIVER, "7", (18.0, 14.0, 15.0), "hypo"),
            LesionSpec(Organ.PANCREAS, "head", (10.0, 8.0, 8.0), "hypo"),
            LesionSpec(Organ.KIDNEY, "left", (12.0, 12.0, 12.0), "hyper"),
        ),
        storage="LPS",
        seed=1,
    )
