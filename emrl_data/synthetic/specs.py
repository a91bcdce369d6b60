"""What a synthetic case is: `CaseSpec` (grid, spacing, storage, lesions, quirks, defect, split) and `LesionSpec`.

Quirks (`QUIRKS`), each emitting one real-data trap (docs/contract.md#input):

* `mask_cropped_grid`: every mask sits on a smaller grid: the body's x/y box and the z range of all written
  structures (+-1 slice). The masks' affines carry the crop offset, so the affines place them (docs/contract.md#input).
* `flipped_affine_mask`: `kidney_right` is written with a sign-flipped affine (`diag(-1, -1, 1, 1) @ A`, LPS-signed
  over RAS storage, q/sform code 1) over voxel bytes identical to a plain write; readers must take it voxel for
  voxel. Cannot be combined with `mask_cropped_grid` (a cropped mask is placed by its affine).
* `lps_storage`: CT and masks are stored LPS: arrays flipped on x and y, affines accordingly. Same as
  `storage="LPS"` (either one sets both).
* `anisotropic`: spacing (0.7, 0.9, 3.0) mm instead of the spec's.
* `empty_lesion_files`: an organ without lesions gets an all-zero `<organ>_lesion` file instead of no file
  (the release may do either; docs/contract.md#input).

Defects (`DEFECTS`) break one file (or the metadata row) of a case so that a reader must reject it with the mapped
`RejectReason`; `emrl_data.synthetic.truth.CaseTruth.expected_rejections` records the reason, the organ (None for the
whole case) and the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import numpy as np

from emrl_data.organs import LOCATION_NAMES
from emrl_data.outcome import RejectReason
from emrl_data.types import Attenuation, Organ, Split, is_valid_case_id


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
        split: the split file the case is listed in (`write_atlas` writes it).
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


def header_spacing_mm(spec: CaseSpec) -> tuple[float, float, float]:
    """Return the spacing a reader gets from the written header (float32 pixdim), in canonical (x, y, z) mm.

    Truth volumes use it, so they equal a reader's voxel count x voxel volume exactly.
    """
    return cast("tuple[float, float, float]", tuple(float(np.float32(s)) for s in spec.spacing_mm))
