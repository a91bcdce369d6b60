"""A case's images: the CT in canonical RAS `(X, Y, Z)` and its masks placed on the CT grid on demand (docs/contract.md#input, #conventions).

`open_case` reads a case's CT (`emrl_data.reading.nifti`), reorients it to canonical RAS as views, and places every
mask on the CT grid when asked (`CaseImages.mask`). Mask placement is decided and verified by evidence
(`emrl_data.reading.placement`). Deep code raises `CaseDataError`; the per-case driver turns it into a rejection row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from nibabel.orientations import inv_ornt_aff, io_orientation

from emrl_data.config import LoadConfig
from emrl_data.organs import ORGAN_STRUCTURES
from emrl_data.outcome import CaseDataError, RejectReason
from emrl_data.reading.atlas import CaseRef
from emrl_data.reading.label_maps import decode_labels, select, side_cut
from emrl_data.reading.nifti import (
    AFFINE_ATOL,
    NiftiVolume,
    bad_mask_values,
    decode_file,
    format_box,
    to_mask,
)
from emrl_data.reading.placement import BodyEvidence, mini_body_box, place_on_grid, verify_organ_mask
from emrl_data.types import Box3


logger = logging.getLogger(__name__)


# Sub-structure files that are no organ mask: `labels` only reads them inside a lesion's box (`CaseImages.mask_crop`,
# values checked in that crop); their box is not needed, so a full `mask()` read checks them by the cheaper max() pass.
_PART_ONLY_MASKS = frozenset(s for spec in ORGAN_STRUCTURES.values() for s, _ in spec.parts) - frozenset(
    s for spec in ORGAN_STRUCTURES.values() for s in spec.organ_masks
)


# Organ mask file -> the organ row it belongs to: these masks are verified against the CT's evidence when placed.
def _organ_of_mask(structure: str) -> str | None:
    """The registered organ whose mask files include `structure` (None for lesions and sub-structures)."""
    return next((str(o) for o, spec in ORGAN_STRUCTURES.items() if structure in spec.organ_masks), None)


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
        "_labels",
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
        self._labels: NiftiVolume | None = None  # a label-map case's decoded label map

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
        cannot change the row (docs/decisions.md#mask-values).
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
                raise bad_mask_values(crop, read[1], where=f" inside the box {format_box(box)} that labelling reads")
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
        selection = self._ref.label_selection(structure)
        if selection is not None:
            vol = self._label_mask(path, rel, selection[0])
        else:
            find_box = not defer_values and structure not in _PART_ONLY_MASKS
            vol = decode_file(path, rel, role="mask", cfg=self._cfg, find_box=find_box, defer_values=defer_values)
        self.file_digests[rel] = vol.digest
        ct_shape: tuple[int, int, int] = tuple(self._ct.data.shape)  # type: ignore[assignment]
        same_affine = np.allclose(vol.affine, self._ct.affine, atol=AFFINE_ATOL)
        self._boxes.pop(structure, None)
        data, box = vol.data, None
        if data.dtype != np.bool_ and data.shape != ct_shape:
            data = to_mask(data, 1.0, 0.0, rel)  # placement copies the whole mask: check it whole
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
            stored, how = place_on_grid(data, vol.affine, ct_shape, self._ct.affine, rel), "by the headers"
        del vol, data
        if selection is not None and selection[1] is not None:  # one label for both sides: cut in the patient frame
            stored = side_cut(stored, self._ct.affine, self._body_evidence().midline_x_mm, selection[1])
        organ = _organ_of_mask(structure)
        if organ is not None:
            verify_organ_mask(
                stored,
                self._body_evidence(),
                organ=organ,
                structure=structure,
                name=rel,
                how=how,
                min_body_fraction=self._cfg.min_body_fraction,
                same_grid=how == "voxel for voxel",
                box=box,
            )
        return stored, rel

    def _body_evidence(self) -> BodyEvidence:
        if self._evidence is None:
            self._evidence = BodyEvidence(self._ct.data, self._ct.affine)
        return self._evidence

    def _label_mask(self, path: Path, rel: str, values: tuple[int, ...]) -> NiftiVolume:
        """The voxels of a label map holding `values`, as a bool volume in the file's storage order.

        The decoded label map is kept for the case's next structure (one decode per case, not one per structure).
        """
        labels = self._labels
        if labels is None or labels.path != path:
            assert self._ref.labels is not None
            labels = decode_labels(path, rel, cfg=self._cfg, allowed=self._ref.labels.table.values)
            self._labels = labels
        return replace(labels, data=select(labels.data, values))

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
    ct = decode_file(ref.ct_path, rel, role="ct", cfg=cfg)
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
        if np.isnan(ornt).any():  # a degenerate affine; `parse_header` already refuses singular ones
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
