"""Phantom geometry: boxed masks, the grid in body units, and each organ's ellipsoids and sub-structures.

Anatomy is laid out in canonical RAS voxel space `(X, Y, Z)` (nibabel RAS+: x grows towards the patient's Right, y
Anterior, z superior), in fractions of the field of view, so any grid holds a complete abdomen. Body units: u = x / A,
v = y / B (A, B: the body ellipse's semi-axes), w = z / half the z field of view.

Each registered organ is drawn from its registry entry's `OrganSpec.anatomy` (`emrl_data.organs.OrganAnatomy`): one
ellipsoid per organ mask file, and sub-structure files cut from the organ by `PartRegion` boxes in coordinates
normalised to the organ's first mask ellipsoid (the liver's Couinaud-like segments, the pancreas' thirds along x). A
part that is itself an organ mask file (a kidney side) is that mask. Sub-structure masks lie inside their organ and
overlap it, as released.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from emrl_data.organs import Ellipsoid, OrganAnatomy, PartRegion, organ_spec
from emrl_data.types import Organ


BODY_SEMI_FRACTION = (0.88, 0.72)  # body semi-axes as fractions of the half field of view (x, y)


@dataclass(frozen=True, slots=True)
class BoxMask:
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


def union_box(masks: Sequence[BoxMask]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return (start, shape) of the box covering every mask."""
    start = tuple(min(m.start[i] for m in masks) for i in range(3))
    stop = tuple(max(m.stop[i] for m in masks) for i in range(3))
    return start, tuple(b - a for a, b in zip(start, stop, strict=True))


def union(masks: Sequence[BoxMask]) -> BoxMask:
    start, shape = union_box(masks)
    data = np.zeros(shape, dtype=bool)
    for m in masks:
        data |= m.embed(start, shape)
    return BoxMask(start, data)


@dataclass(frozen=True, slots=True)
class Grid:
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
        return np.array([half[0] * BODY_SEMI_FRACTION[0], half[1] * BODY_SEMI_FRACTION[1], half[2]])

    def uvw_to_vox(self, uvw: Sequence[float]) -> np.ndarray:
        return self.centre_vox + np.asarray(uvw) * self.body_units_mm / np.asarray(self.spacing_mm)

    def ellipsoid(self, centre_vox: Sequence[float] | np.ndarray, semi_mm: Sequence[float] | np.ndarray) -> BoxMask:
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
        return BoxMask(tuple(int(v) for v in lo), r2 <= 1.0 + 1e-9)

    def organ_uvw(self, shape: Ellipsoid, box: BoxMask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Normalised coordinates (u, v, w) of the box's voxels relative to an organ mask's base ellipsoid."""
        centre_uvw, semi_uvw = shape
        centre = self.uvw_to_vox(centre_uvw)
        semi_vox = np.asarray(semi_uvw) * self.body_units_mm / np.asarray(self.spacing_mm)
        axes = np.ogrid[tuple(slice(a, b) for a, b in zip(box.start, box.stop, strict=True))]
        return tuple((a - c) / s for a, c, s in zip(axes, centre, semi_vox, strict=True))


def anatomy_of(organ: str) -> OrganAnatomy:
    """Return the synthetic anatomy of a registered organ (`OrganSpec.anatomy`).

    Raises:
        KeyError: the organ's spec has no anatomy (naming the fix).
    """
    anatomy = organ_spec(organ).anatomy
    if anatomy is None:
        raise KeyError(
            f"organ {str(organ)!r} has no synthetic anatomy; give its OrganSpec an `anatomy=OrganAnatomy(...)` "
            "(emrl_data.organs)."
        )
    return anatomy


def shape_of(organ: str, mask_file: str) -> Ellipsoid:
    """Return the ellipsoid (body units) of one of an organ's mask files."""
    return dict(anatomy_of(organ).shapes)[mask_file]


def _region_mask(grid: Grid, shape: Ellipsoid, organ: BoxMask, region: PartRegion) -> BoxMask:
    """The organ's voxels whose normalised coordinates lie in the region's half-open box."""
    inside = np.ones(organ.data.shape, dtype=bool)
    for coord, (low, high) in zip(grid.organ_uvw(shape, organ), (region.u, region.v, region.w), strict=True):
        inside &= (coord >= low) & (coord < high)
    return BoxMask(organ.start, organ.data & inside)


def part_masks(grid: Grid, organ: Organ, organ_masks: dict[str, BoxMask]) -> dict[str, BoxMask]:
    """Return part file -> mask for the organ's `OrganSpec.parts` (a part that is an organ mask file is that mask)."""
    spec, anatomy = organ_spec(organ), anatomy_of(organ)
    first = spec.organ_masks[0]
    drawn = {
        region.file: _region_mask(grid, shape_of(organ, first), organ_masks[first], region) for region in anatomy.parts
    }
    return {stem: drawn[stem] if stem in drawn else organ_masks[stem] for stem, _ in spec.parts}
