"""The phantom of one case: body, organs and lesions drawn in HU on the canonical grid, with their masks.

A body ellipse (subcutaneous fat -100 HU, a muscle ring 40 HU, intra-abdominal fat -100 HU, air outside), a vertebra
(250 HU with a 1100 HU cortical rim that the ±1000 clip cuts), then every registered organ at its `OrganAnatomy.hu`
(liver 60 HU on the patient's right, pancreas 40 HU across the midline with its head on the patient's right, both
kidneys 150 HU). Seeded Gaussian noise (SD 8 HU) covers everything; CT values are rounded, clipped to [-1000, 1000] and
stored as int16.

Lesions (`LesionSpec`): ellipsoids with radii in mm, centred on the centroid of a part (a liver segment, a pancreas
part, a kidney side) plus an offset in mm, snapped to the nearest voxel centre so that a lesion is symmetric about its
centre slice. The organ mask is the organ's ellipsoid united with its lesions (an exophytic lesion is part of its
organ, as in the released masks). HU: hypo = organ - 40, iso = organ HU with SD 1 noise (so the RadGPT rule sees iso),
hyper = organ + 50.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from emrl_data.organs import ORGAN_STRUCTURES, defect_files, organ_spec
from emrl_data.synthetic.geometry import BoxMask, Grid, anatomy_of, part_masks, union
from emrl_data.synthetic.specs import CaseSpec, LesionSpec
from emrl_data.types import Organ


# --- HU values (typical portal-venous values) -------------------------------------------------
_AIR_HU = -1024  # clipped to -1000 like the release
_FAT_HU = -100
_MUSCLE_HU = 40
_BONE_HU = 250
_CORTEX_HU = 1100  # above the clip: exercises the ±1000 clip
_LESION_DELTA_HU: dict[str, int] = {"hypo": -40, "iso": 0, "hyper": 50}
_NOISE_SD_HU = 8.0
_ISO_NOISE_SD_HU = 1.0
_CT_CLIP_HU = 1000

_MUSCLE_RING = (0.80, 0.90)  # normalised body radius range of the muscle wall
_SPINE_CENTRE_UV = (0.0, -0.62)
_SPINE_RADIUS_B = 0.12  # in units of B
# Where the `lesion_outside_organ` defect puts its liver lesion: fat on the patient's left, anterior.
_OUTSIDE_LESION_UVW = (-0.45, 0.45, 0.35)
_OUTSIDE_LESION_RADII_MM = (5.0, 5.0, 5.0)

_NOISE_SLAB_Z = 16  # z slices per noise chunk (bounds float32 temporaries; fixed so output is deterministic)


@dataclass(slots=True)
class PlacedLesion:
    """A lesion drawn on the canonical grid: its mask, size and attenuation, and the organ mask file it joins."""

    organ: Organ
    radii_mm: tuple[float, float, float]
    attenuation: str
    mask: BoxMask
    mask_file: str | None  # the organ mask file the lesion joins (kidney: its side); None: outside every organ
    inside_organ: bool = True  # False only for the `lesion_outside_organ` defect's lesion


@dataclass(slots=True)
class Phantom:
    """A drawn case on the canonical grid: CT, structure masks, placed lesions and the body's x/y box."""

    ct: np.ndarray  # int16 (X, Y, Z) canonical RAS, Fortran order, HU clipped to ±1000
    masks: dict[str, BoxMask]  # structure file stem -> mask (lesion files only for organs with a lesion)
    lesions: list[PlacedLesion]
    body_box: tuple[tuple[int, int], tuple[int, int]]  # half-open (x0, x1), (y0, y1) of the body ellipse


def _body_slice(grid: Grid) -> tuple[np.ndarray, tuple[tuple[int, int], tuple[int, int]]]:
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


def _part_centroid(grid: Grid, lesion: LesionSpec, base: dict[str, BoxMask]) -> np.ndarray:
    """Centroid (voxel indices) of the lesion's part (or of the whole organ for part "") on the base organ."""
    spec = organ_spec(lesion.organ)
    if lesion.part:
        inverse = {name: stem for stem, name in spec.parts}
        part = part_masks(grid, lesion.organ, base)[inverse[lesion.part]]
    else:
        part = union([base[stem] for stem in spec.organ_masks])
    idx = np.argwhere(part.data)
    if idx.size == 0:
        raise ValueError(f"Part {lesion.part!r} of {lesion.organ} is empty on grid {grid.shape}.")
    return idx.mean(axis=0) + np.asarray(part.start)


def _place_lesion(grid: Grid, lesion: LesionSpec, base: dict[str, BoxMask]) -> PlacedLesion:
    centre = _part_centroid(grid, lesion, base) + np.asarray(lesion.offset) / np.asarray(grid.spacing_mm)
    centre = np.rint(centre)  # snap to a voxel centre: the lesion is symmetric about its centre slice
    if np.any(centre < 0) or np.any(centre >= np.asarray(grid.shape)):
        raise ValueError(f"{lesion} is centred off the grid (voxel {centre.tolist()}).")
    # The lesion joins its part's file when that is an organ mask (a kidney side), else the organ's first mask file.
    spec = organ_spec(lesion.organ)
    part_file = dict((name, stem) for stem, name in spec.parts).get(lesion.part)
    mask_file = part_file if part_file in spec.organ_masks else spec.organ_masks[0]
    mask = grid.ellipsoid(centre, lesion.radii_mm)
    return PlacedLesion(lesion.organ, lesion.radii_mm, lesion.attenuation, mask, mask_file)


def build_phantom(spec: CaseSpec) -> Phantom:
    """Draw the canonical phantom of `spec`: CT, masks and the placed lesions (its truth: `truth.phantom_truth`)."""
    grid = Grid(spec.shape, spec.spacing_mm)
    base = {
        name: grid.ellipsoid(grid.uvw_to_vox(c), np.asarray(s) * grid.body_units_mm)
        for organ in Organ
        for name, (c, s) in anatomy_of(organ).shapes
    }
    lesions = [_place_lesion(grid, lesion, base) for lesion in spec.lesions]
    if spec.defect == "lesion_outside_organ":
        centre = np.rint(grid.uvw_to_vox(_OUTSIDE_LESION_UVW))
        mask = grid.ellipsoid(centre, _OUTSIDE_LESION_RADII_MM)
        organ, _ = defect_files()["lesion_outside_organ"]  # the organ whose lesion file holds it
        lesions.append(PlacedLesion(organ, _OUTSIDE_LESION_RADII_MM, "hypo", mask, None, inside_organ=False))

    # Organ masks = base ellipsoid united with the organ's lesions (the outside-organ defect lesion excluded).
    masks: dict[str, BoxMask] = {}
    for name, shape in base.items():
        own = [le.mask for le in lesions if le.inside_organ and le.mask_file == name]
        masks[name] = union([shape, *own]) if own else shape
    for organ in Organ:
        organ_lesions = [le.mask for le in lesions if le.organ is organ]
        if organ_lesions:
            masks[ORGAN_STRUCTURES[organ].lesion_mask] = union(organ_lesions)
        organ_masks = {s: masks[s] for s in ORGAN_STRUCTURES[organ].organ_masks}
        masks.update(part_masks(grid, organ, organ_masks))

    ct, body_box = _draw_ct(spec, grid, masks, lesions)
    return Phantom(ct=ct, masks=masks, lesions=lesions, body_box=body_box)


def _draw_ct(
    spec: CaseSpec, grid: Grid, masks: dict[str, BoxMask], lesions: list[PlacedLesion]
) -> tuple[np.ndarray, tuple[tuple[int, int], tuple[int, int]]]:
    """Paint HU: body, organs, lesions, noise (SD 8), then iso lesions with SD 1 noise; round and clip to ±1000."""
    body, body_box = _body_slice(grid)
    ct = np.empty(spec.shape, dtype=np.int16, order="F")
    ct[...] = body[:, :, None]
    for organ in Organ:
        anatomy = anatomy_of(organ)
        for name, _ in anatomy.shapes:
            m = masks[name]
            ct[m.slices()][m.data] = anatomy.hu
    for le in lesions:
        ct[le.mask.slices()][le.mask.data] = anatomy_of(le.organ).hu + _LESION_DELTA_HU[le.attenuation]

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
        values = anatomy_of(le.organ).hu + _ISO_NOISE_SD_HU * iso_rng.standard_normal(n)
        ct[le.mask.slices()][le.mask.data] = np.clip(np.rint(values), -_CT_CLIP_HU, _CT_CLIP_HU).astype(np.int16)
    return ct, body_box
