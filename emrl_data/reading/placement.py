"""Mask placement decided and verified by evidence from the CT itself (docs/contract.md#input).

Headers alone cannot tell a sign-flipped header over identical voxels from truly mirrored voxels, nor an
offset-free crop from a true origin. This module holds the evidence:

- `mini_body_box`: OncoKit Mini's `standardization` crop reproduced on the CT (inclusive box of the largest
  26-connected component of -100 < HU < 100 after clipping to +-1000), used to place masks that share the CT's
  affine but are smaller;
- `BodyEvidence`: a hole-filled body on a subsampled grid plus the CT, against which an organ mask placed on the
  CT grid is checked: >= `min_body_fraction` of its voxels on the body, its mean HU inside the organ's window
  (`OrganSpec.mean_hu_window` in the organ registry, also used by `emrl_data.labeling.labels`), and on the expected side of
  the patient (`OrganSpec.mask_sides`). When the stored mask fails and one of its mirror images passes, the file is
  refused as `mask_orientation_conflict` rather than guessed.

All arrays here are in the CT's storage order `(I, J, K)`; world coordinates are NIfTI RAS+ mm (world +x points
to the patient's right).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cc3d
import numpy as np
from nibabel.orientations import io_orientation

from emrl_data.organs import organ_spec
from emrl_data.outcome import CaseDataError, RejectReason
from emrl_data.reading.nifti import format_numbers


_MINI_CLIP_HU = 1000
_MINI_BAND_HU = (-100, 100)  # exclusive bounds, as OncoKit's `standardization`
_BODY_AIR_HU = -500  # the verification body: not air, hole-filled per axial slice
_GRID_TARGET = 64  # the verification grid has about this many samples per axis (512 x 512 x 300 -> stride 8, 8, 4)
_MIN_SAMPLES = 64  # a mask with fewer sampled voxels is sampled at full resolution
_SIDE_MARGIN_MM = 10.0  # a centroid closer than this to the body's midline has no side (no evidence either way)


def organ_hu_window(organ: str) -> tuple[float, float]:
    """Return the plausible (low, high) mean HU of a registered `organ` (e.g. "liver"): `OrganSpec.mean_hu_window`."""
    return organ_spec(organ).mean_hu_window


def expected_side(organ: str, structure: str) -> str | None:
    """Return "right"/"left" where the organ's mask file `structure` must lie (`OrganSpec.mask_sides`), else None."""
    return dict(organ_spec(organ).mask_sides).get(structure)


def mini_body_box(ct: np.ndarray) -> tuple[slice, slice, slice] | None:
    """Reproduce OncoKit Mini's body crop on a CT in storage order.

    Returns:
        The inclusive box (as slices) of the largest 26-connected component of `-100 < clip(HU, +-1000) < 100`,
        or None when no voxel is in the band.
    """
    band = (ct > _MINI_BAND_HU[0]) & (ct < _MINI_BAND_HU[1])  # clipping to +-1000 does not move these bounds
    if not band.any():
        return None
    largest = cc3d.largest_k(np.asfortranarray(band), k=1, connectivity=26)
    del band
    box = []
    for axis in range(3):
        other = tuple(a for a in range(3) if a != axis)
        hit = np.flatnonzero(largest.any(axis=other))
        box.append(slice(int(hit[0]), int(hit[-1]) + 1))
    return (box[0], box[1], box[2])


@dataclass(frozen=True, slots=True)
class MaskScore:
    """Evidence about one placement of an organ mask."""

    body_fraction: float
    mean_hu: float
    side: str  # "right" or "left" of the body's midline (world x), or "" when undetermined

    def fails(self, *, organ: str, structure: str, min_body_fraction: float) -> list[str]:
        """Return what this placement contradicts (empty when it fits the evidence)."""
        low, high = organ_hu_window(organ)
        out = []
        if self.body_fraction < min_body_fraction:
            out.append(f"{100 * self.body_fraction:.1f} % of its voxels on the body (< {100 * min_body_fraction:g} %)")
        if not low <= self.mean_hu <= high:
            out.append(f"mean HU {self.mean_hu:.0f} outside the {organ} window [{low:.0f}, {high:.0f}]")
        expected = expected_side(organ, structure)
        if expected and self.side and self.side != expected:
            out.append(f"centroid on the patient's {self.side}, expected {expected}")
        return out


class BodyEvidence:
    """The CT-side evidence of one case, computed once on a subsampled grid (storage order)."""

    def __init__(self, ct: np.ndarray, affine: np.ndarray) -> None:
        """Build from the CT (int16 HU, storage order) and its voxel -> world affine."""
        self.ct = ct
        self.affine = affine
        self.stride = tuple(max(1, n // _GRID_TARGET) for n in ct.shape)
        sub = ct[:: self.stride[0], :: self.stride[1], :: self.stride[2]]
        tissue = np.asfortranarray(sub > _BODY_AIR_HU)
        body = cc3d.largest_k(tissue, k=1, connectivity=26).astype(bool) if tissue.any() else tissue
        # Axial slices: the stored axis closest to world z goes last for the per-slice steps.
        axial = int(np.flatnonzero(io_orientation(affine)[:, 0] == 2)[0])
        body = np.moveaxis(_fill_holes_per_slice(np.moveaxis(body, axial, 2)), 2, axial)
        grown = _grow_in_plane(np.moveaxis(body, axial, 2))  # one sample of tolerance: the surface is a stride off
        self.body = np.moveaxis(grown, 2, axial)
        idx = np.nonzero(body)
        centre = [float(np.mean(i)) * s for i, s in zip(idx, self.stride, strict=True)] if idx[0].size else None
        self.midline_x_mm = float((affine[:3, :3] @ np.asarray(centre) + affine[:3, 3])[0]) if centre else math.nan

    def score(
        self, mask: np.ndarray, flip_axis: int | None = None, box: tuple[slice, slice, slice] | None = None
    ) -> MaskScore | None:
        """Score a bool mask on the CT grid (storage order), optionally mirrored along one stored axis.

        `box` (optional): a half-open box in storage order that holds every nonzero voxel of the mask (the tight box
        the value check found); only it is sampled, at the same grid positions, so the score is the same.

        Returns:
            The evidence, or None when the mask is empty.
        """
        coords = self._sample(mask, box)
        if coords is None:
            return None
        if flip_axis is not None:
            coords[flip_axis] = mask.shape[flip_axis] - 1 - coords[flip_axis]
        on_body = self.body[tuple(c // s for c, s in zip(coords, self.stride, strict=True))]
        hu = self.ct[tuple(coords)]
        centroid = np.array([float(np.mean(c)) for c in coords])
        x_mm = float((self.affine[:3, :3] @ centroid + self.affine[:3, 3])[0])
        offset_mm = x_mm - self.midline_x_mm
        side = "" if not abs(offset_mm) >= _SIDE_MARGIN_MM else ("right" if offset_mm > 0 else "left")
        return MaskScore(
            body_fraction=float(np.count_nonzero(on_body)) / on_body.size,
            mean_hu=float(np.mean(hu, dtype=np.float64)),
            side=side,
        )

    def _sample(self, mask: np.ndarray, box: tuple[slice, slice, slice] | None = None) -> list[np.ndarray] | None:
        """Voxel indices of a sample of the mask: on the verification grid, finer for small masks (down to every
        voxel), so that at least `_MIN_SAMPLES` voxels are looked at when the mask has that many.

        With `box` (holding every nonzero voxel) only the grid positions inside it are read: the same voxels, in the
        same (C) order, without a strided pass over the whole volume.
        """
        stride = self.stride
        bounds = box if box is not None else tuple(slice(0, n) for n in mask.shape)
        while True:
            lo = [b.start - b.start % s for b, s in zip(bounds, stride, strict=True)]  # on the grid of multiples
            view = mask[tuple(slice(a, b.stop, s) for a, b, s in zip(lo, bounds, stride, strict=True))]
            idx = np.nonzero(np.asfortranarray(view))  # 4x faster copied
            if idx[0].size >= _MIN_SAMPLES or stride == (1, 1, 1):
                break
            stride = tuple(max(1, s // 2) for s in stride)
        if not idx[0].size:
            return None
        return [i.astype(np.int64) * s + a for i, s, a in zip(idx, stride, lo, strict=True)]


def _fill_holes_per_slice(body: np.ndarray) -> np.ndarray:
    """Fill, in every axial slice, the background regions that do not touch the slice's border (lungs, gas).

    One 3-D labelling of the background with empty slices interleaved (so nothing connects across z) instead of a
    per-slice loop or scipy's iterative `binary_fill_holes` (~10x slower here).
    """
    nx, ny, nz = body.shape
    background = np.zeros((nx, ny, 2 * nz), dtype=bool, order="F")
    background[:, :, ::2] = ~body
    labels = cc3d.connected_components(background, connectivity=6)[:, :, ::2]
    border = np.concatenate([labels[0].ravel(), labels[-1].ravel(), labels[:, 0].ravel(), labels[:, -1].ravel()])
    outside = np.zeros(int(labels.max()) + 1, dtype=bool)
    outside[border] = True
    outside[0] = True  # label 0 is the body itself
    return body | ~outside[labels]


def _grow_in_plane(body: np.ndarray) -> np.ndarray:
    """Dilate by one sample along x and y (4-connected in-plane), without wrapping around."""
    grown = body.copy()
    grown[1:] |= body[:-1]
    grown[:-1] |= body[1:]
    grown[:, 1:] |= body[:, :-1]
    grown[:, :-1] |= body[:, 1:]
    return grown


def verify_organ_mask(
    mask: np.ndarray,
    evidence: BodyEvidence,
    *,
    organ: str,
    structure: str,
    name: str,
    how: str,
    min_body_fraction: float,
    same_grid: bool = False,
    box: tuple[slice, slice, slice] | None = None,
) -> None:
    """Check an organ mask placed on the CT grid against the CT's evidence; raise when it does not fit.

    Args:
        mask: bool mask on the CT grid, storage order.
        evidence: the case's `BodyEvidence`.
        organ: the organ row it belongs to ("liver", "kidney", ...).
        structure: the file's structure name ("kidney_left", ...).
        name: the file, relative to the atlas root (messages and `CaseDataError.path`).
        how: how it was placed ("voxel for voxel", "by the headers", "at the Mini body crop"), for messages.
        min_body_fraction: share of the mask's voxels that must lie on the body.
        same_grid: the mask file has the CT's own shape (taken voxel for voxel): an off-body mask is then a defect
            of that file, not of the grid, and costs only its organ.
        box: a box in storage order holding every nonzero voxel of `mask` (optional; sampling reads only it).

    Raises:
        CaseDataError: MASK_ORIENTATION_CONFLICT (organ-level) when the stored placement fails the geometric
            evidence (off the body, or centroid on the wrong side) and a mirror image along a stored axis fits all
            of it, or when the centroid is on the wrong side and no mirror fits; MASK_GRID_MISMATCH when the mask
            is off the body and no mirror fits (organ-level when `same_grid`, else the whole case); IMPLAUSIBLE_ORGAN_HU (organ-level) when only the
            mean HU is implausible (no mirror search: an odd HU alone says nothing about orientation).
    """
    stored = evidence.score(mask, box=box)
    if stored is None:
        return  # empty masks are the labels' business (EMPTY_ORGAN_MASK)
    problems = stored.fails(organ=organ, structure=structure, min_body_fraction=min_body_fraction)
    if not problems:
        return
    said = f"{name}: placed {how}, the mask has " + "; ".join(problems)
    geometric = stored.body_fraction < min_body_fraction or any("centroid" in p for p in problems)
    for axis in range(3) if geometric else ():
        mirrored = evidence.score(mask, flip_axis=axis, box=box)
        if mirrored and not mirrored.fails(organ=organ, structure=structure, min_body_fraction=min_body_fraction):
            raise CaseDataError(
                RejectReason.MASK_ORIENTATION_CONFLICT,
                f"{said}, while its mirror image along stored axis {axis} fits (mean HU {mirrored.mean_hu:.0f}, "
                f"{100 * mirrored.body_fraction:.1f} % on the body, {mirrored.side or 'no'} side): voxels or header "
                "mirrored, refusing to guess",
                path=name,
                organ=organ,
            )
    if stored.body_fraction < min_body_fraction:
        raise CaseDataError(
            RejectReason.MASK_GRID_MISMATCH,
            f"{said}: not on this CT" if same_grid else f"{said}: not on this CT's grid",
            path=name,
            organ=organ if same_grid else None,
        )
    if geometric:
        raise CaseDataError(RejectReason.MASK_ORIENTATION_CONFLICT, said, path=name, organ=organ)
    raise CaseDataError(RejectReason.IMPLAUSIBLE_ORGAN_HU, said, path=name, organ=organ)


# --- mask placement on another grid ---------------------------------------------------------------------------

_PERMUTATION_ATOL = 1e-3  # entries of inv(A_ct) @ A_mask within this of 0 / +-1
_OFFSET_ATOL_VOX = 0.01  # translation within this of an integer voxel offset


def place_on_grid(
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
    where = f"mask shape {mask.shape} vs CT shape {ct_shape}, voxel offset {format_numbers(offset)}"
    if not is_signed_permutation:
        raise CaseDataError(
            RejectReason.MASK_GRID_MISMATCH,
            f"{name}: mask grid is rotated or scaled relative to the CT's ({where}; "
            f"index map {format_numbers(rot.ravel())}), cannot be placed",
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
