"""Validated NIfTI reading, canonical RAS orientation and mask placement on the CT grid (docs/contract.md#input, docs/contract.md#conventions).

The only module that opens image files. `read_nifti` turns one `.nii.gz`/`.nii` file into a validated 3-D array
over its inflated bytes; `open_case` reads a case's CT, reorients it to canonical RAS `(X, Y, Z)` as views, and
places every mask on the CT grid on demand (`CaseImages.mask`). Deep code raises `CaseDataError`; the per-case
driver turns it into a rejection row.

Why the gzip stream is validated here and not by a library: SimpleITK 2.5.7 reads a truncated `.nii.gz` without
error and zero-fills the missing part (docs/contract.md#input). `emrl_data.reading.inflate` parses the header from the first inflated
bytes and refuses it *before* the image buffer is allocated, then inflates every gzip member with libdeflate (CRC32
and ISIZE checked) into a reused per-thread buffer of exactly the size the header implies.

Geometry (docs/contract.md#input): the affine is nibabel's (sform if sform_code > 0, else qform if qform_code > 0, else pixdim);
sform/qform/pixdim that disagree beyond `LoadConfig.geometry_rtol` are refused (`geometry_conflict`), voxel sizes
outside `LoadConfig.spacing_range_mm` too (`implausible_spacing`). Mask placement is decided and verified by
evidence (`emrl_data.reading.placement`).

Arrays returned by this module are read-only: the zero-copy ones are views over a pooled decode buffer (never
reused while the view is alive), and the converted ones are marked read-only for consistency. Copy the (small)
crop you need to modify.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import nibabel as nib
import numpy as np
from nibabel.orientations import inv_ornt_aff, io_orientation
from nibabel.spatialimages import HeaderDataError

from emrl_data.config import LoadConfig
from emrl_data.organs import ORGAN_STRUCTURES
from emrl_data.outcome import CaseDataError, RejectReason
from emrl_data.reading.atlas import CaseRef
from emrl_data.reading.inflate import read_payload
from emrl_data.reading.placement import BodyEvidence, mini_body_box, verify_organ_mask


logger = logging.getLogger(__name__)

Role = Literal["ct", "mask"]
# A 3-D box as index slices, half-open, step None (storage order in `NiftiVolume.box`, canonical in `mask_box`).
Box3 = tuple[slice, slice, slice]

_NIFTI1_SIZEOF_HDR = 348
_NIFTI2_SIZEOF_HDR = 540
_NIFTI1_MAGIC = b"n+1\x00"  # single-file NIfTI-1 (`ni1` is the .hdr/.img pair, not a .nii)
_NIFTI2_MAGIC = b"n+2\x00\r\n\x1a\n"
_AFFINE_ATOL = 1e-3  # affines "agree" (docs/contract.md#input, the placement rule)
_PERMUTATION_ATOL = 1e-3  # entries of inv(A_ct) @ A_mask within this of 0 / +-1
_OFFSET_ATOL_VOX = 0.01  # translation within this of an integer voxel offset
_CHUNK_VOXELS = 1 << 24  # conversions run over slabs of at most ~16 M voxels to bound temporaries
_MAX_LISTED_VALUES = 10
# NIfTI xyzt_units spatial codes -> factor to millimetres (0 = unknown, taken as mm like ITK does).
_SPATIAL_UNIT_TO_MM = {0: 1.0, 1: 1000.0, 2: 1.0, 3: 0.001}
_INT16_MIN, _INT16_MAX = -32768, 32767


# Sub-structure files that are no organ mask: `labels` only reads them inside a lesion's box (`CaseImages.mask_crop`,
# values checked in that crop); their box is not needed, so a full `mask()` read checks them by the cheaper max() pass.
_PART_ONLY_MASKS = frozenset(s for spec in ORGAN_STRUCTURES.values() for s, _ in spec.parts) - frozenset(
    s for spec in ORGAN_STRUCTURES.values() for s in spec.organ_masks
)


# Organ mask file -> the organ row it belongs to: these masks are verified against the CT's evidence when placed.
def _organ_of_mask(structure: str) -> str | None:
    """The registered organ whose mask files include `structure` (None for lesions and sub-structures)."""
    return next((str(o) for o, spec in ORGAN_STRUCTURES.items() if structure in spec.organ_masks), None)


@dataclass(frozen=True, slots=True)
class NiftiVolume:
    """One validated NIfTI image, in the storage order of its file.

    Attributes:
        data: 3-D array, shape `(I, J, K)` as stored (Fortran-ordered view over the inflated buffer where no
            conversion was needed), read-only. role="ct": int16 HU; role="mask": bool.
        affine: (4, 4) float64 voxel -> world (mm) affine: the sform if sform_code > 0, else the qform if
            qform_code > 0, else `diag(zooms_mm)` (NIfTI "method 1"), as nibabel's `get_best_affine`.
        zooms_mm: voxel size along the stored axes `(I, J, K)`, in mm (pixdim; agrees with the affine's within
            `LoadConfig.geometry_rtol`).
        path: the file that was read.
        digest: sha256 hex of the file's bytes.
        box: role="mask" read zero-copy only: `(tight half-open box of the nonzero voxels in storage order,)`, or
            `(None,)` when the mask is empty; found by the pass that checks the values (None = not computed).
    """

    data: np.ndarray
    affine: np.ndarray
    zooms_mm: tuple[float, float, float]
    path: Path
    digest: str = ""
    box: tuple[Box3 | None] | None = None


@dataclass(frozen=True, slots=True)
class _Header:
    """The header fields this module uses (free text deliberately absent)."""

    shape: tuple[int, int, int]
    dtype: np.dtype
    vox_offset: int
    slope: float
    inter: float
    affine: np.ndarray
    zooms_mm: tuple[float, float, float]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_nifti(path: Path, *, role: Role, cfg: LoadConfig = LoadConfig()) -> NiftiVolume:  # noqa: B008 (frozen)
    """Read and validate one NIfTI-1/2 file (`.nii.gz` or `.nii`).

    Args:
        path: the file. Gzip is detected from the bytes; a `.gz` name whose bytes are not gzip is refused.
        role: "ct" returns int16 HU (float or wider integer data rounded half-to-even and clipped to the int16
            range; int16 data is a zero-copy view); "mask" returns bool and requires every value to be 0 or 1.
        cfg: size limits checked from the header before anything is allocated.

    Returns:
        The volume in storage order, with its affine and voxel size.

    Raises:
        CaseDataError: NOT_NIFTI, CORRUPT_GZIP, BAD_NDIM, ABSURD_SIZE, IMPLAUSIBLE_SPACING, GEOMETRY_CONFLICT,
            NON_FINITE_VOXELS or BAD_MASK_VALUES; the detail names the file and `path` is set.
        OSError: `path` cannot be opened or read (FileNotFoundError when it does not exist).
        ValueError: `role` is not "ct" or "mask".
    """
    path = Path(path)
    return _decode(path, str(path), role=role, cfg=cfg)


class CaseImages:
    """One case: the CT in canonical RAS `(X, Y, Z)` plus lazily loaded masks placed on the CT grid.

    Canonical RAS is nibabel's closest canonical orientation (`as_closest_canonical`): voxel index x grows towards
    the patient's right (world +R, NIfTI RAS+), y towards anterior, z from inferior to superior. An axial slice is
    `ct_hu[:, :, z]`.

    Attributes:
        case_id: `BDMAP_` + 8 digits.
        ct_hu: int16 (X, Y, Z) HU in canonical RAS, read-only; flips/transposes of the stored array only, so a view
            over the inflated file when it stores native int16 (the released CTs), never a full-volume copy.
        spacing_mm: voxel size along (X, Y, Z) in mm.
        affine_ras: (4, 4) float64 affine of the canonical grid (canonical voxel index -> world mm).
        warnings: human-readable notes about accepted quirks, one per event, each starting with the file name.
            Grows as masks are read.
        file_digests: path relative to the atlas root -> sha256 hex of the raw file bytes, for every file read so
            far (the CT at open, each mask when `mask` reads it).
    """

    __slots__ = (
        "case_id",
        "ct_hu",
        "spacing_mm",
        "affine_ras",
        "warnings",
        "file_digests",
        "_ref",
        "_cfg",
        "_ct",
        "_orientation",
        "_evidence",
        "_mini_box",
        "_boxes",
    )

    def __init__(self, *, ref: CaseRef, ct: NiftiVolume, cfg: LoadConfig, digest: str = "") -> None:
        """Build from an already validated CT (use `open_case`)."""
        self.case_id = ref.case_id
        self._ref = ref
        self._cfg = cfg
        self._ct = ct
        shape: tuple[int, int, int] = tuple(ct.data.shape)  # type: ignore[assignment]
        self._orientation = _Orientation.from_affine(ct.affine, shape)
        self.ct_hu = self._orientation.apply(ct.data)
        self.spacing_mm = self._orientation.permute(ct.zooms_mm)
        self.affine_ras = self._orientation.affine_ras(ct.affine)
        self.warnings: list[str] = []
        self.file_digests: dict[str, str] = {ref.relative(ct.path): digest or ct.digest}
        self._evidence: BodyEvidence | None = None
        self._mini_box: tuple[tuple[slice, slice, slice] | None] | None = None  # computed once, when needed
        self._boxes: dict[str, tuple[Box3 | None]] = {}  # structure -> canonical box from its last read

    def relative_path(self, structure: str) -> str | None:
        """Return the file of `structure` relative to the atlas root, or None when the case has none."""
        path = self._ref.structure_path(structure)
        return None if path is None else self._ref.relative(path)

    def has(self, structure: str) -> bool:
        """Return True when the case has a file for `structure` (e.g. "liver_lesion"); reads nothing."""
        return self._ref.structure_path(structure) is not None

    def mask(self, structure: str) -> np.ndarray | None:
        """Read one structure's mask, place it on the CT grid by evidence, and verify organ masks.

        Placement (docs/contract.md#input): the same shape as the CT -> voxel for voxel; another grid whose
        affine maps onto the CT's by a signed axis permutation and an integer offset -> by the headers; the CT's
        affine and a smaller shape -> at the CT's reproduced Mini body crop, only if that box has exactly the
        mask's shape. Organ masks (liver, pancreas, kidney_left/right, ...) are then checked against the CT
        (`emrl_data.reading.placement.verify_organ_mask`: on the body, mean HU in the organ's window, expected side).

        Not cached (a 512x512x300 case must stay under ~1 GB peak RSS): every call reads the file again, so keep
        the result while you need it. A zero-copy result is a view over a pooled decode buffer that is reused
        only after every view of it is gone.

        Args:
            structure: the released structure name, e.g. "liver", "kidney_lesion".

        Returns:
            bool (X, Y, Z) read-only array in canonical RAS on the CT grid (same shape as `ct_hu`), or None when
            the case has no file for `structure`.

        Raises:
            CaseDataError: any `read_nifti` reason for the mask file; MASK_GRID_MISMATCH when it cannot be placed
                or lies off the body (whole case; only its organ when the file has the CT's own shape); MASK_ORIENTATION_CONFLICT or IMPLAUSIBLE_ORGAN_HU (with
                `organ` set) when an organ mask fails the CT's evidence. The detail and `path` name the file.
        """
        read = self._read_placed(structure, defer_values=False)
        return None if read is None else self._orientation.apply(read[0])

    def mask_crop(self, structure: str, box: Box3) -> np.ndarray | None:
        """Read one structure's mask like `mask`, return only its crop to `box`, its values checked only there.

        For the sub-structure masks (liver segments, pancreas head/body/tail) that labelling only reads inside the
        largest lesion's box (`labels._location`): the file is still read whole, CRC32 and size checked, and placed
        by the same rules as `mask`, but the 0/1 value check runs over the crop alone, since a value outside the box
        cannot change the row (docs/decisions.md, "Sub-structure masks: values checked where they are used").
        Organ masks are read and checked whole (`mask`), then cropped.

        Args:
            structure: the released structure name, e.g. "liver_segment_5".
            box: half-open `(x, y, z)` slices in canonical RAS on the CT grid.

        Returns:
            bool read-only array of `box`'s shape (a view where the file was read zero-copy), or None when the case
            has no file for `structure`.

        Raises:
            CaseDataError: as `mask`; BAD_MASK_VALUES when a value other than 0 or 1 lies inside `box`.
        """
        if _organ_of_mask(structure) is not None:
            full = self.mask(structure)
            return None if full is None else full[box]
        read = self._read_placed(structure, defer_values=True)
        if read is None:
            return None
        crop = self._orientation.apply(read[0])[box]
        if crop.dtype != np.bool_:  # raw 1-byte voxels, not yet checked
            if crop.size and int(crop.view(np.uint8).max()) > 1:
                raise _bad_mask_values(crop, read[1], where=f" inside the box {_fmt_box(box)} that labelling reads")
            crop = crop.view(np.bool_)
        return crop

    def _read_placed(self, structure: str, *, defer_values: bool) -> tuple[np.ndarray, str] | None:
        """Read, place and verify one mask; return it in the CT's storage order with its relative path.

        With `defer_values` a 1-byte unscaled mask of the CT's shape comes back as its raw (unchecked) bytes for
        the caller to check where it reads them; every other mask comes back as a checked bool array.
        """
        path = self._ref.structure_path(structure)
        if path is None:
            return None
        rel = self._ref.relative(path)
        find_box = not defer_values and structure not in _PART_ONLY_MASKS
        vol = _decode(path, rel, role="mask", cfg=self._cfg, find_box=find_box, defer_values=defer_values)
        self.file_digests[rel] = vol.digest
        ct_shape: tuple[int, int, int] = tuple(self._ct.data.shape)  # type: ignore[assignment]
        same_affine = np.allclose(vol.affine, self._ct.affine, atol=_AFFINE_ATOL)
        self._boxes.pop(structure, None)
        data, box = vol.data, None
        if data.dtype != np.bool_ and data.shape != ct_shape:
            data = _to_mask(data, 1.0, 0.0, rel)  # placement copies the whole mask: check it whole
        if data.shape == ct_shape:
            if not same_affine:
                self._warn(f"{path.name}: affine disagrees with the CT's over the same shape; taken voxel for voxel")
            stored, how = data, "voxel for voxel"
            if vol.box is not None:
                box = vol.box[0]
                self._boxes[structure] = (None if box is None else self._orientation.box(box),)
        elif same_affine:
            stored, how = self._place_at_mini_crop(data, rel), "at the CT's Mini body crop"
        else:
            stored, how = _place_on_grid(data, vol.affine, ct_shape, self._ct.affine, rel), "by the headers"
        del vol, data
        organ = _organ_of_mask(structure)
        if organ is not None:
            if self._evidence is None:
                self._evidence = BodyEvidence(self._ct.data, self._ct.affine)
            verify_organ_mask(
                stored,
                self._evidence,
                organ=organ,
                structure=structure,
                name=rel,
                how=how,
                min_body_fraction=self._cfg.min_body_fraction,
                same_grid=how == "voxel for voxel",
                box=box,
            )
        return stored, rel

    def mask_box(self, structure: str) -> tuple[Box3 | None] | None:
        """Return the tight box of `structure`'s mask as last read by `mask`, if the read found it.

        Returns:
            `(box,)` with `box` the half-open `(x, y, z)` slices of the nonzero voxels in canonical RAS (None inside
            when the mask is empty), found by the same pass that checked the mask's values; None when unknown (the
            mask was not read yet, was placed on the CT grid by a copy, or needed a value conversion).
        """
        return self._boxes.get(structure)

    def _place_at_mini_crop(self, mask: np.ndarray, name: str) -> np.ndarray:
        """Place a mask that shares the CT's affine but is smaller at the CT's reproduced Mini body crop."""
        ct_shape = self._ct.data.shape
        where = f"mask shape {mask.shape} vs CT shape {ct_shape} with identical affines"
        if any(m > c for m, c in zip(mask.shape, ct_shape, strict=True)):
            raise CaseDataError(
                RejectReason.MASK_GRID_MISMATCH,
                f"{name}: {where}; the mask is larger than the CT along an axis, so the CT's crop origin is unknown",
                path=name,
            )
        if self._mini_box is None:
            self._mini_box = (mini_body_box(self._ct.data),)
        box = self._mini_box[0]
        box_shape = None if box is None else tuple(s.stop - s.start for s in box)
        if box is None or box_shape != mask.shape:
            raise CaseDataError(
                RejectReason.MASK_GRID_MISMATCH,
                f"{name}: {where}; the CT's reproduced Mini body crop has shape {box_shape}, not the mask's, so the "
                "mask's origin on the CT grid is unknown",
                path=name,
            )
        placed = np.zeros(ct_shape, dtype=np.bool_, order="F")
        placed[box] = mask
        placed.flags.writeable = False
        self._warn(
            f"{name.rsplit('/', 1)[-1]}: {where}; placed at the CT's Mini body crop origin "
            f"{tuple(s.start for s in box)}"
        )
        return placed

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        logger.warning("%s: %s", self.case_id, message)


def open_case(ref: CaseRef, *, cfg: LoadConfig = LoadConfig()) -> CaseImages:  # noqa: B008 (frozen)
    """Read and validate a case's CT and return its images in canonical RAS; masks are read on demand.

    Args:
        ref: where the case's files are (`emrl_data.reading.atlas`).
        cfg: size limits and geometry checks for every file of the case.

    Returns:
        The case's images; `ct_hu` is a view over the CT file's inflated bytes (no full-volume copy).

    Raises:
        CaseDataError: MISSING_CT when `ref.ct_path` does not exist, or any `read_nifti` reason for the CT.
        OSError: a file exists but cannot be read.
    """
    rel = ref.relative(ref.ct_path)
    if not ref.ct_path.is_file():
        raise CaseDataError(RejectReason.MISSING_CT, f"{rel}: no CT file at the expected path", path=rel)
    ct = _decode(ref.ct_path, rel, role="ct", cfg=cfg)
    return CaseImages(ref=ref, ct=ct, cfg=cfg)


# --- orientation -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Orientation:
    """Storage order -> canonical RAS as axis flips followed by a transpose (views only).

    `ornt` is nibabel's (3, 2) orientation: row i = (canonical axis of stored axis i, +1 or -1 for a flip).
    """

    ornt: np.ndarray
    shape: tuple[int, int, int]

    @classmethod
    def from_affine(cls, affine: np.ndarray, shape: tuple[int, int, int]) -> _Orientation:
        ornt = io_orientation(affine)
        if np.isnan(ornt).any():  # a degenerate affine; `_parse_header` already refuses singular ones
            raise ValueError(f"affine has no closest orientation: {affine.tolist()}")
        return cls(ornt=ornt, shape=shape)

    def apply(self, stored: np.ndarray) -> np.ndarray:
        """Return a view of a stored-order `(I, J, K)` array in canonical `(X, Y, Z)` order."""
        flips = tuple(slice(None, None, -1) if f < 0 else slice(None) for f in self.ornt[:, 1])
        order = np.argsort(self.ornt[:, 0])  # canonical axis j <- stored axis order[j]
        return stored[flips].transpose(order)

    def box(self, stored: Box3) -> Box3:
        """Map a half-open box in storage order to canonical order (the same flips and transpose as `apply`)."""
        bounds = []
        for axis, (sl, flip) in enumerate(zip(stored, self.ornt[:, 1], strict=True)):
            n = self.shape[axis]
            bounds.append((n - sl.stop, n - sl.start) if flip < 0 else (sl.start, sl.stop))
        order = np.argsort(self.ornt[:, 0])
        return slice(*bounds[order[0]]), slice(*bounds[order[1]]), slice(*bounds[order[2]])

    def permute(self, per_stored_axis: tuple[float, float, float]) -> tuple[float, float, float]:
        """Reorder a per-stored-axis triple (e.g. zooms) into canonical axis order."""
        order = np.argsort(self.ornt[:, 0])
        return (float(per_stored_axis[order[0]]), float(per_stored_axis[order[1]]), float(per_stored_axis[order[2]]))

    def affine_ras(self, affine: np.ndarray) -> np.ndarray:
        """Return the affine of the canonical grid: canonical index -> stored index -> world."""
        return affine @ inv_ornt_aff(self.ornt, self.shape)


# --- mask placement --------------------------------------------------------------------------------------------


def _place_on_grid(
    mask: np.ndarray,
    mask_affine: np.ndarray,
    ct_shape: tuple[int, int, int],
    ct_affine: np.ndarray,
    name: str,
) -> np.ndarray:
    """Write a mask stored on another grid into a zero CT-shaped array, in the CT's storage order.

    The map from mask voxel indices to CT voxel indices, `T = inv(A_ct) @ A_mask`, must be a signed axis permutation
    with an integer translation: crops (Mini releases) and axis flips/reorders are placeable, rotations, scalings and
    sub-voxel shifts are not.

    Args:
        mask: bool (I', J', K') mask in its own storage order.
        mask_affine: (4, 4) mask voxel -> world mm.
        ct_shape: the CT's stored shape (I, J, K).
        ct_affine: (4, 4) CT voxel -> world mm.
        name: the mask file, for messages.

    Returns:
        bool (I, J, K) array in the CT's storage order (Fortran order), read-only.

    Raises:
        CaseDataError: MASK_GRID_MISMATCH when T is not placeable or a nonzero mask voxel falls outside the CT grid.
    """
    t = np.linalg.inv(ct_affine) @ mask_affine
    rot, offset = t[:3, :3], t[:3, 3]
    signs = np.rint(rot)
    is_signed_permutation = (
        np.allclose(rot, signs, atol=_PERMUTATION_ATOL)
        and (np.abs(signs).sum(axis=0) == 1).all()
        and (np.abs(signs).sum(axis=1) == 1).all()
    )
    where = f"mask shape {mask.shape} vs CT shape {ct_shape}, voxel offset {_fmt(offset)}"
    if not is_signed_permutation:
        raise CaseDataError(
            RejectReason.MASK_GRID_MISMATCH,
            f"{name}: mask grid is rotated or scaled relative to the CT's ({where}; "
            f"index map {_fmt(rot.ravel())}), cannot be placed",
            path=name,
        )
    offset_vox = np.rint(offset)
    if not np.allclose(offset, offset_vox, atol=_OFFSET_ATOL_VOX):
        raise CaseDataError(
            RejectReason.MASK_GRID_MISMATCH,
            f"{name}: mask grid is shifted by a non-integer number of CT voxels ({where}), cannot be placed",
            path=name,
        )
    # CT axis j <- mask axis src[j] with sign s[j]: c_j = s_j * m_src[j] + offset_j.
    src = [int(np.flatnonzero(signs[j])[0]) for j in range(3)]
    view = mask.transpose(src)
    flips = []
    starts = []
    for j in range(3):
        n = view.shape[j]
        if signs[j, src[j]] < 0:  # after flipping, view index v maps to c = v + offset - (n - 1)
            flips.append(slice(None, None, -1))
            starts.append(int(offset_vox[j]) - (n - 1))
        else:
            flips.append(slice(None))
            starts.append(int(offset_vox[j]))
    view = view[tuple(flips)]
    dst = [slice(max(0, s), min(c, s + n)) for s, c, n in zip(starts, ct_shape, view.shape, strict=True)]
    inside = [
        slice(d.start - s, d.stop - s) if d.stop > d.start else slice(0, 0) for d, s in zip(dst, starts, strict=True)
    ]
    outside = _count_outside(view, inside)
    if outside:
        raise CaseDataError(
            RejectReason.MASK_GRID_MISMATCH,
            f"{name}: {outside} nonzero mask voxels fall outside the CT grid ({where})",
            path=name,
        )
    placed = np.zeros(ct_shape, dtype=np.bool_, order="F")
    if all(d.stop > d.start for d in dst):
        placed[tuple(dst)] = view[tuple(inside)]
    placed.flags.writeable = False
    return placed


def _count_outside(view: np.ndarray, inside: list[slice]) -> int:
    """Count nonzero voxels of `view` outside the box `inside` (slabs beyond each face, each voxel once)."""
    if all(s.stop > s.start for s in inside) and all(
        s.start == 0 and s.stop == n for s, n in zip(inside, view.shape, strict=True)
    ):
        return 0
    if any(s.stop <= s.start for s in inside):
        return int(np.count_nonzero(view))
    total = 0
    rest = view
    for axis, s in enumerate(inside):
        # Slabs before and after the box along this axis, then restrict to the box along it for later axes.
        lo = (slice(None),) * axis + (slice(0, s.start),)
        hi = (slice(None),) * axis + (slice(s.stop, None),)
        total += int(np.count_nonzero(rest[lo])) + int(np.count_nonzero(rest[hi]))
        rest = rest[(slice(None),) * axis + (s,)]
    return total


# --- decoding --------------------------------------------------------------------------------------------------


def _decode(
    path: Path, name: str, *, role: Role, cfg: LoadConfig, find_box: bool = False, defer_values: bool = False
) -> NiftiVolume:
    """Read, validate and decode one file; `name` is how messages and `CaseDataError.path` call the file.

    With `find_box` a 1-byte unscaled mask is checked by `_check_mask_bytes`, which also finds its box. With
    `defer_values` a 1-byte unscaled mask is returned as its raw int8/uint8 voxels, NOT checked for {0, 1}: the
    caller checks them where it reads them (`CaseImages.mask_crop`); other masks are converted and checked as usual.
    """
    if role not in ("ct", "mask"):
        raise ValueError(f"role={role!r} must be 'ct' or 'mask'.")
    parsed: list[_Header] = []

    def payload_size(prefix: bytes) -> int:
        parsed.append(_parse_header(prefix, name, cfg))
        return parsed[0].vox_offset + parsed[0].nbytes

    buf, digest = read_payload(path, name, payload_size, force_gzip=path.name.endswith(".gz"))
    hdr = parsed[0]
    data = buf[hdr.vox_offset :].view(hdr.dtype).reshape(hdr.shape, order="F")
    del buf
    data.flags.writeable = False
    scaled = math.isfinite(hdr.slope) and hdr.slope != 0 and (hdr.slope, hdr.inter) != (1.0, 0.0)
    slope, inter = (hdr.slope, hdr.inter) if scaled else (1.0, 0.0)
    box: tuple[Box3 | None] | None = None
    if role == "ct":
        data = _to_ct(data, slope, inter, name)
    elif (find_box or defer_values) and (slope, inter) == (1.0, 0.0) and data.dtype.itemsize == 1:
        if find_box:
            box = (_check_mask_bytes(data, name),)
            data = data.view(np.bool_)
    else:
        data = _to_mask(data, slope, inter, name)
    return NiftiVolume(data=data, affine=hdr.affine, zooms_mm=hdr.zooms_mm, path=path, digest=digest, box=box)


def _parse_header(prefix: bytes, name: str, cfg: LoadConfig) -> _Header:
    """Parse and check a NIfTI-1/2 header from the file's first bytes; refuse before anything is allocated."""

    def fail(reason: RejectReason, what: str) -> CaseDataError:
        return CaseDataError(reason, f"{name}: {what}", path=name)

    if len(prefix) < 4:
        raise fail(RejectReason.NOT_NIFTI, f"{len(prefix)} bytes is too short for a NIfTI header")
    endian = None
    for candidate in ("<", ">"):
        sizeof_hdr = int(np.frombuffer(prefix, dtype=f"{candidate}i4", count=1)[0])
        if sizeof_hdr in (_NIFTI1_SIZEOF_HDR, _NIFTI2_SIZEOF_HDR):
            endian = candidate
            break
    if endian is None:
        raise fail(RejectReason.NOT_NIFTI, "sizeof_hdr is neither 348 (NIfTI-1) nor 540 (NIfTI-2)")
    if len(prefix) < sizeof_hdr:
        raise fail(RejectReason.NOT_NIFTI, f"{len(prefix)} bytes is too short for a {sizeof_hdr}-byte header")
    if sizeof_hdr == _NIFTI1_SIZEOF_HDR:
        if prefix[344:348] != _NIFTI1_MAGIC:
            raise fail(RejectReason.NOT_NIFTI, "bad NIfTI-1 magic (expected 'n+1', a single-file image)")
        hdr = nib.Nifti1Header(prefix[:348], endianness=endian, check=False)
    else:
        if prefix[4:12] != _NIFTI2_MAGIC:
            raise fail(RejectReason.NOT_NIFTI, "bad NIfTI-2 magic (expected 'n+2', a single-file image)")
        hdr = nib.Nifti2Header(prefix[:540], endianness=endian, check=False)

    dim = [int(d) for d in hdr["dim"]]
    ndim = dim[0]
    if not 1 <= ndim <= 7:
        raise fail(RejectReason.BAD_NDIM, f"dim[0]={ndim} is not a number of dimensions in 1..7")
    extra = dim[4 : ndim + 1]
    if ndim < 3 or any(d != 1 for d in extra):
        raise fail(RejectReason.BAD_NDIM, f"image is {ndim}-D with shape {tuple(dim[1 : ndim + 1])}, expected 3-D")
    shape = (dim[1], dim[2], dim[3])
    if not all(1 <= d <= cfg.max_dim for d in shape):
        raise fail(RejectReason.ABSURD_SIZE, f"shape {shape} has a dimension outside 1..{cfg.max_dim}")
    if math.prod(shape) > cfg.max_voxels:
        raise fail(RejectReason.ABSURD_SIZE, f"shape {shape} has {math.prod(shape)} voxels > {cfg.max_voxels}")

    try:
        dtype = hdr.get_data_dtype()
    except (HeaderDataError, KeyError) as err:
        raise fail(RejectReason.NOT_NIFTI, f"unknown datatype code {int(hdr['datatype'])}") from err
    if not (
        (dtype.kind in "iu" and dtype.itemsize in (1, 2, 4, 8)) or (dtype.kind == "f" and dtype.itemsize in (4, 8))
    ):
        raise fail(RejectReason.NOT_NIFTI, f"unsupported voxel datatype {dtype} (need integer or float32/64)")

    vox_offset_f = float(hdr["vox_offset"])
    if not (math.isfinite(vox_offset_f) and vox_offset_f == int(vox_offset_f) and vox_offset_f >= sizeof_hdr + 4):
        raise fail(RejectReason.NOT_NIFTI, f"vox_offset {vox_offset_f} is not an integer >= {sizeof_hdr + 4}")

    pixdim = np.asarray(hdr["pixdim"], dtype=np.float64)
    zooms = pixdim[1:4]
    if not (np.isfinite(zooms).all() and (zooms > 0).all()):
        raise fail(RejectReason.NOT_NIFTI, f"voxel sizes {_fmt(zooms)} must be positive and finite")
    if pixdim[0] not in (-1.0, 1.0):  # the NIfTI standard reads qfac 0 (or junk) as 1
        pixdim[0] = 1.0
        hdr["pixdim"] = pixdim
    unit_code = int(hdr["xyzt_units"]) & 0x07
    if unit_code not in _SPATIAL_UNIT_TO_MM:
        raise fail(RejectReason.NOT_NIFTI, f"spatial unit code {unit_code} is not a NIfTI length unit")
    to_mm = _SPATIAL_UNIT_TO_MM[unit_code]

    affine = _best_affine(hdr, zooms, to_mm, shape, cfg, fail)
    return _Header(
        shape=shape,
        dtype=dtype,
        vox_offset=int(vox_offset_f),
        slope=float(hdr["scl_slope"]),
        inter=float(hdr["scl_inter"]) if math.isfinite(float(hdr["scl_inter"])) else 0.0,
        affine=affine,
        zooms_mm=(float(zooms[0] * to_mm), float(zooms[1] * to_mm), float(zooms[2] * to_mm)),
    )


def _best_affine(
    hdr: nib.Nifti1Header,
    zooms: np.ndarray,
    to_mm: float,
    shape: tuple[int, int, int],
    cfg: LoadConfig,
    fail: Callable[[RejectReason, str], CaseDataError],
) -> np.ndarray:
    """Return nibabel's best affine in mm (sform if coded, else qform if coded, else pixdim) after the geometry
    checks of `_check_geometry`."""
    try:
        sform, sform_code = hdr.get_sform(coded=True)
        qform, qform_code = hdr.get_qform(coded=True)
    except (HeaderDataError, ValueError) as err:
        raise fail(RejectReason.NOT_NIFTI, f"invalid orientation fields: {err}") from err
    if sform_code > 0:
        affine = np.array(sform, dtype=np.float64)
    elif qform_code > 0:
        affine = np.array(qform, dtype=np.float64)
    else:
        affine = np.diag([*zooms, 1.0])
    affine[:3, :] *= to_mm
    if not (np.isfinite(affine).all() and abs(np.linalg.det(affine[:3, :3])) > 1e-12):
        raise fail(RejectReason.NOT_NIFTI, "affine is singular or not finite")
    other = None
    if sform_code > 0 and qform_code > 0:
        other = np.array(qform, dtype=np.float64)
        other[:3, :] *= to_mm
    _check_geometry(affine, other, zooms * to_mm, shape, cfg, fail)
    return affine


def _check_geometry(
    affine: np.ndarray,
    qform: np.ndarray | None,
    zooms_mm: np.ndarray,
    shape: tuple[int, int, int],
    cfg: LoadConfig,
    fail: Callable[[RejectReason, str], CaseDataError],
) -> None:
    """Refuse a header whose geometry fields disagree, or whose voxel size is implausible.

    Args:
        affine: the chosen affine in mm (sform, else qform, else pixdim).
        qform: the qform in mm when both sform and qform are coded (they must then describe the same grid), else
            None.
        zooms_mm: pixdim[1:4] in mm.
        shape: the image shape, for the grid corners.
        cfg: `geometry_rtol` and `spacing_range_mm`.
        fail: builds the error naming the file.

    Raises:
        CaseDataError: GEOMETRY_CONFLICT when the affine's voxel sizes differ from pixdim by more than
            `geometry_rtol` (relative), or the qform puts a grid corner more than `geometry_rtol * 100` voxels
            (1 voxel at the default 0.01) away from where the sform puts it; IMPLAUSIBLE_SPACING when a voxel size
            is outside `spacing_range_mm`.
    """
    sizes = np.sqrt((affine[:3, :3] ** 2).sum(axis=0))
    if not np.allclose(sizes, zooms_mm, rtol=cfg.geometry_rtol, atol=0.0):
        raise fail(
            RejectReason.GEOMETRY_CONFLICT,
            f"voxel sizes in pixdim {_fmt(zooms_mm)} mm disagree with the affine's {_fmt(sizes)} mm "
            f"(tolerance {100 * cfg.geometry_rtol:g} %); refusing to pick one",
        )
    if qform is not None:
        corners = np.array(
            [[i, j, k, 1.0] for i in (0, shape[0] - 1) for j in (0, shape[1] - 1) for k in (0, shape[2] - 1)]
        )
        gap_mm = float(np.abs((affine - qform) @ corners.T)[:3].max())
        tol_mm = 100 * cfg.geometry_rtol * float(sizes.max())
        if gap_mm > tol_mm:
            raise fail(
                RejectReason.GEOMETRY_CONFLICT,
                f"sform and qform place the grid up to {gap_mm:.3g} mm apart (tolerance {tol_mm:.3g} mm); "
                "refusing to pick one",
            )
    low, high = cfg.spacing_range_mm
    if not ((sizes >= low) & (sizes <= high)).all():
        raise fail(
            RejectReason.IMPLAUSIBLE_SPACING,
            f"voxel size {_fmt(sizes)} mm is outside the plausible range [{low:g}, {high:g}] mm",
        )


def _slab_step(shape: tuple[int, ...]) -> int:
    """Number of slices along the last (slowest, Fortran order) axis in a slab of at most ~_CHUNK_VOXELS voxels."""
    return max(1, _CHUNK_VOXELS // (shape[0] * shape[1]))


def _to_ct(data: np.ndarray, slope: float, inter: float, name: str) -> np.ndarray:
    """Return int16 HU: a zero-copy view for unscaled native int16, else a converted read-only copy.

    Args:
        data: (I, J, K) stored voxels, Fortran-ordered, any supported dtype.
        slope: scl_slope to apply (1.0 when unscaled).
        inter: scl_inter to apply (0.0 when unscaled).
        name: the file, for messages.

    Returns:
        int16 (I, J, K) array; floats are rounded half-to-even, everything clipped to [-32768, 32767].
    """
    unscaled = (slope, inter) == (1.0, 0.0)
    if unscaled and data.dtype == np.dtype(np.int16):  # native byte order only: '>i2' on x86 is converted
        return data
    out = np.empty(data.shape, dtype=np.int16, order="F")
    step = _slab_step(data.shape)
    for z0 in range(0, data.shape[2], step):
        chunk = data[:, :, z0 : z0 + step]
        if unscaled and data.dtype.kind == "u":
            out[:, :, z0 : z0 + step] = np.minimum(chunk, _INT16_MAX)
            continue
        if unscaled and data.dtype.kind == "i":
            out[:, :, z0 : z0 + step] = np.clip(chunk, _INT16_MIN, _INT16_MAX)
            continue
        values = chunk.astype(np.float64) * slope + inter
        if not np.isfinite(values).all():
            raise CaseDataError(
                RejectReason.NON_FINITE_VOXELS,
                f"{name}: {int(np.count_nonzero(~np.isfinite(values)))} NaN/inf voxels in slices {z0}.."
                f"{z0 + values.shape[2] - 1} (stored order)",
                path=name,
            )
        out[:, :, z0 : z0 + step] = np.clip(np.rint(values), _INT16_MIN, _INT16_MAX)
    out.flags.writeable = False
    return out


def _to_mask(data: np.ndarray, slope: float, inter: float, name: str) -> np.ndarray:
    """Return a bool mask: a zero-copy view for unscaled int8/uint8 0/1 data, else a converted read-only copy.

    Args:
        data: (I, J, K) stored voxels, Fortran-ordered, any supported dtype.
        slope: scl_slope to apply (1.0 when unscaled).
        inter: scl_inter to apply (0.0 when unscaled).
        name: the file, for messages.

    Returns:
        bool (I, J, K) array.

    Raises:
        CaseDataError: NON_FINITE_VOXELS for NaN/inf, BAD_MASK_VALUES for any value other than 0 or 1.
    """
    unscaled = (slope, inter) == (1.0, 0.0)
    if unscaled and data.dtype.itemsize == 1:
        # One max() over the bytes checks {0, 1} for int8 and uint8 alike (int8 negatives read as >= 128).
        if int(data.view(np.uint8).max()) > 1:
            raise _bad_mask_values(data, name)
        return data.view(np.bool_)
    out = np.empty(data.shape, dtype=np.bool_, order="F")
    step = _slab_step(data.shape)
    for z0 in range(0, data.shape[2], step):
        chunk = data[:, :, z0 : z0 + step]
        values = chunk if unscaled else chunk.astype(np.float64) * slope + inter
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            raise CaseDataError(
                RejectReason.NON_FINITE_VOXELS,
                f"{name}: {int(np.count_nonzero(~np.isfinite(values)))} NaN/inf voxels in the mask",
                path=name,
            )
        if not ((values == 0) | (values == 1)).all():
            raise _bad_mask_values(data if unscaled else data.astype(np.float64) * slope + inter, name)
        out[:, :, z0 : z0 + step] = values != 0
    out.flags.writeable = False
    return out


def _check_mask_bytes(data: np.ndarray, name: str) -> Box3 | None:
    """Check that every byte of a 1-byte mask is 0 or 1 and return the box of its nonzero voxels, in one pass.

    One bitwise OR over the slowest axis (slab of slices after slab, memory order) projects the volume to `(I, J)`:
    a byte with any bit above bit 0 (a value > 1, or an int8 negative) shows in the projection, and the
    projection's nonzero rows and columns are the box's I and J extents. The same pass notes which slabs hold a
    nonzero byte, so the K extent only needs the first and last of them re-read (inside the I-J box).

    Args:
        data: (I, J, K) int8/uint8 voxels, Fortran-ordered (the inflated buffer).
        name: the file, for messages.

    Returns:
        The half-open `(i, j, k)` box of the nonzero voxels in storage order, or None when the mask is empty.

    Raises:
        CaseDataError: BAD_MASK_VALUES for any value other than 0 or 1.
    """
    u8 = data.view(np.uint8)
    proj, slabs = _or_projection(u8)
    if int(proj.max(initial=0)) > 1:
        raise _bad_mask_values(data, name)
    rows = np.flatnonzero(proj.any(axis=1))
    if rows.size == 0 or not slabs:
        return None
    cols = np.flatnonzero(proj.any(axis=0))
    i0, i1, j0, j1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
    (a, b), (c, d) = slabs[0], slabs[-1]
    first = np.flatnonzero(u8[i0:i1, j0:j1, a:b].any(axis=(0, 1)))
    last = np.flatnonzero(u8[i0:i1, j0:j1, c:d].any(axis=(0, 1)))
    return slice(i0, i1), slice(j0, j1), slice(a + int(first[0]), c + int(last[-1]) + 1)


_SLAB_BYTES = 1 << 22  # the OR projection reduces ~4 MiB of slices at a time


def _or_projection(u8: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Bitwise OR of a Fortran-ordered (I, J, K) uint8 volume over K, and the `(k0, k1)` slabs that hold a nonzero
    byte (in order; one slab `(0, K)` when the layout allows no slabs).

    8 voxels per uint64 word where the layout allows (the same bytes as the uint8 reduction, ~12 % less CPU); each
    slab's OR is tested while it is in cache, which gives the slabs for the K extent at no extra read.
    """
    i, j, k = u8.shape
    if (i * j) % 8 or not u8.flags.f_contiguous:
        return np.bitwise_or.reduce(u8, axis=2), [(0, k)]
    words = u8.reshape(-1, order="F").view(np.uint64).reshape(i * j // 8, k, order="F")
    proj = np.zeros(i * j // 8, dtype=np.uint64)
    part = np.empty_like(proj)
    step = max(1, _SLAB_BYTES // (i * j))
    slabs = []
    for k0 in range(0, k, step):
        np.bitwise_or.reduce(words[:, k0 : k0 + step], axis=1, out=part)
        if part.any():
            proj |= part
            slabs.append((k0, min(k, k0 + step)))
    return proj.view(np.uint8).reshape(i, j, order="F"), slabs


def _bad_mask_values(values: np.ndarray, name: str, *, where: str = "") -> CaseDataError:
    """Build the BAD_MASK_VALUES error listing the distinct values found (slow path, only on failure)."""
    distinct = np.unique(values[np.isfinite(values)] if values.dtype.kind == "f" else values)
    listed = [v.item() for v in distinct[:_MAX_LISTED_VALUES]]
    more = f" ... ({distinct.size} distinct)" if distinct.size > _MAX_LISTED_VALUES else ""
    return CaseDataError(
        RejectReason.BAD_MASK_VALUES,
        f"{name}: mask must hold only 0 and 1, found values {listed}{more}{where}",
        path=name,
    )


def _fmt_box(box: Box3) -> str:
    """Format a half-open box as `x0:x1, y0:y1, z0:z1` for messages."""
    return ", ".join(f"{s.start}:{s.stop}" for s in box)


def _fmt(values: tuple[float, ...] | np.ndarray) -> str:
    """Format numbers compactly for messages, e.g. (2, 1.5, 0)."""
    return "(" + ", ".join(f"{float(v):.6g}" for v in values) + ")"
