"""Defective cases as data: reason codes, the error deep code raises, and the rejection row it becomes.

Deep code raises `CaseDataError(reason, detail)` where a defect is found; the per-case driver
(`emrl_data.labeling.curate`) turns it into a `Rejection`. Anything else is a bug and is recorded as
`UNEXPECTED_ERROR` by the driver, which fails the flow at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RejectReason(StrEnum):
    """Why a case (or one organ row of it) produced no output row."""

    INVALID_CASE_ID = "invalid_case_id"  # folder name is not BDMAP_ + 8 digits
    MISSING_CT = "missing_ct"  # no ct.nii.gz for the case
    CORRUPT_GZIP = "corrupt_gzip"  # truncated or corrupt gzip stream (CRC/size mismatch, bad header)
    NOT_NIFTI = "not_nifti"  # the bytes are not a NIfTI-1/2 image
    BAD_NDIM = "bad_ndim"  # 2-D, 4-D or other non-3-D data
    ABSURD_SIZE = "absurd_size"  # header claims a size we refuse to allocate, or disagrees with the payload
    NON_FINITE_VOXELS = "non_finite_voxels"  # NaN or inf in the CT or a mask
    BAD_MASK_VALUES = "bad_mask_values"  # a mask holds values other than 0/1
    MISSING_ORGAN_MASK = "missing_organ_mask"  # organ mask file absent: the organ row is not produced
    EMPTY_ORGAN_MASK = "empty_organ_mask"  # organ mask has no voxel
    LESION_OUTSIDE_ORGAN = "lesion_outside_organ"  # most of the lesion lies outside its organ
    MASK_GRID_MISMATCH = "mask_grid_mismatch"  # a mask cannot be placed on the CT grid
    BAD_METADATA_ROW = "bad_metadata_row"  # the case's metadata CSV row cannot be parsed (the case still runs)
    SPLIT_CONFLICT = "split_conflict"  # the case is listed in more than one split file (a train/test leak)
    UNREADABLE_FILE = "unreadable_file"  # a file exists but cannot be read (permission, I/O, loop, pipe, device)
    NOT_A_CASE = "not_a_case"  # a discovery entry named like a case that cannot be one (file, loop, wrong place)
    IMPLAUSIBLE_SPACING = "implausible_spacing"  # a voxel size outside LoadConfig.spacing_range_mm
    GEOMETRY_CONFLICT = "geometry_conflict"  # sform / qform / pixdim of one file disagree beyond tolerance
    MASK_ORIENTATION_CONFLICT = "mask_orientation_conflict"  # a mask's mirror image fits the CT, the stored one not
    IMPLAUSIBLE_ORGAN_HU = "implausible_organ_hu"  # an organ's mean HU is outside its window (organ-level)
    CASE_TIMEOUT = "case_timeout"  # the case ran past the per-case time bound and was abandoned (run goes on)
    PART_CHECKSUM_MISMATCH = "part_checksum_mismatch"  # a released part failed its sha256 twice: its cases are out
    UNSAFE_ARCHIVE_MEMBER = "unsafe_archive_member"  # a link, device, climbing path, twice, or too big for scratch
    CORRUPT_ARCHIVE = "corrupt_archive"  # the part's tar/gzip stream broke before the case was read
    DUPLICATE_CT = "duplicate_ct"  # a released case with two CT files (ct.nii beside ct.nii.gz): which one is unknown
    OVERLAPS_TRAINING_CT = "overlaps_training_ct"  # a test case that is a training CT of another output folder
    UNEXPECTED_ERROR = "unexpected_error"  # a bug, not a data defect: fails the flow at the end


class CaseDataError(ValueError):
    """One case's data cannot be used; carries the reason code and a message naming the file."""

    def __init__(
        self, reason: RejectReason, detail: str, *, path: str | None = None, organ: str | None = None
    ) -> None:
        super().__init__(f"{reason}: {detail}" + (f" [{path}]" if path else ""))
        self.reason = reason
        self.detail = detail
        self.path = path
        self.organ = organ


@dataclass(frozen=True, slots=True)
class Rejection:
    """A row of the `rejections` table: one case (or one organ of it) that produced no output row."""

    case_id: str
    organ: str | None  # None when the whole case is rejected
    # "discover", "metadata", "load", "labels", "frames"; "curate" for a case_timeout; "archive", "fetch"; "overlaps"
    step: str
    reason: RejectReason
    detail: str
    path: str | None = None  # the offending file, relative to the atlas root when possible

    def to_row(self) -> dict[str, str | None]:
        """Return the row as written to the `rejections` table."""
        return {
            "case_id": self.case_id,
            "organ": self.organ,
            "step": self.step,
            "reason": str(self.reason),
            "detail": self.detail,
            "path": self.path,
        }


# Reasons only a released part (read from the Hub) produces: tested on built archives, no synthetic-case defect.
ARCHIVE_REASONS = frozenset(
    {
        RejectReason.PART_CHECKSUM_MISMATCH,
        RejectReason.UNSAFE_ARCHIVE_MEMBER,
        RejectReason.CORRUPT_ARCHIVE,
        RejectReason.DUPLICATE_CT,
    }
)
