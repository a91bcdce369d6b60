"""The labels of one organ row (docs/contract.md#labels): lesion count, size, volume, location, attenuation, key slice and boxes.

Called by the per-case driver once per (case, organ) with a `MaskSource` that holds the CT and serves the
structure masks on the CT grid in canonical RAS voxel order `(x, y, z)`. Everything is measured on that native
grid with the CT's spacing (no resampling). Defective data raises `CaseDataError`; a missing lesion file is a
negative row, not an error.

Speed and memory (docs/scaling.md#what-curation-costs-measured-on-this-machine): full volumes are only ever reduced (bounding boxes by `any()`
projections), never copied; everything else runs on crops to the organ box, the lesion box or the largest
lesion's box. HU gathers use crops copied into one shared memory layout and `ravel('K')`, so they never take the
slow boolean-gather path on Fortran-ordered or flipped views.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import cc3d
import cv2
import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from emrl_data.config import LabelConfig
from emrl_data.labeling.crops import (
    Boxed,
    MaskCache,
    MaskGetter,
    MaskSource,
    as_bool,
    box_finder,
    box_xyzxyz,
    copy_like,
    crop_getter,
    dilate_cube,
    union_box,
    union_crop,
)
from emrl_data.organs import LOCATION_NAMES, ORGAN_STRUCTURES, organ_spec
from emrl_data.outcome import CaseDataError, RejectReason
from emrl_data.reading.placement import organ_hu_window
from emrl_data.types import Attenuation, Box3, Organ, column


logger = logging.getLogger(__name__)


_INT_LIST = pa.list_(pa.int32())


@dataclass(frozen=True, slots=True)
class OrganLabels:
    """The labels of one organ row (docs/contract.md#labels). Positions are canonical voxel indices; boxes are half-open.

    The lesion fields are about the largest lesion (by volume) and are None on a negative row. Each field but `organ`
    is a column of the organ row (`emrl_data.types.column`: Arrow type and description); the synthetic atlas's ground
    truth (`emrl_data.synthetic`) is an `OrganLabels` too, computed independently.

    Attributes:
        organ: the organ of the row.
        has_lesion: at least one lesion component survives the noise filter.
        lesion_count: surviving 26-connected components.
        long_axis_mm: largest lesion's longest in-plane (axial) outer Feret diameter over its slices, mm.
        short_axis_mm: extent of the largest lesion perpendicular to the long-axis chord on that slice, mm.
        volume_mm3: largest lesion volume (voxel count x voxel volume), mm^3.
        total_lesion_volume_mm3: volume of all surviving components, mm^3 (0.0 for negatives).
        organ_volume_mm3: organ mask volume (union of the organ's masks), mm^3.
        location: sub-structure names holding > `location_min_fraction` of the largest lesion's labelled voxels,
            in the order of `LOCATION_NAMES[organ]`; () for negatives or when no part file labels the lesion.
        attenuation: `Attenuation` value ("hypo" | "iso" | "hyper") of the largest lesion vs the parenchyma.
        lesion_mean_hu: mean HU of the largest lesion.
        parenchyma_mean_hu: mean HU of the organ minus all lesion voxels.
        parenchyma_sd_hu: population SD (ddof=0) of HU of the organ minus all lesion voxels.
        key_slice_z_vox: axial slice of maximum cross-sectional area of the largest lesion; ties -> lowest z.
        max_diameter_z_vox: axial slice of the longest in-plane diameter (RadGPT's "image"); ties -> lowest z.
        bbox_xyxy_vox: largest lesion's 2-D box on the key slice, `(x0, y0, x1, y1)`, half-open.
        lesion_box_xyzxyz_vox: largest lesion's 3-D box `(x0, y0, z0, x1, y1, z1)`, half-open.
        organ_box_xyzxyz_vox: organ 3-D box `(x0, y0, z0, x1, y1, z1)`, half-open.
    """

    organ: Organ  # a key column of the row, declared in `emrl_data.tables.records`
    has_lesion: bool = field(metadata=column(pa.bool_(), ">= 1 lesion component survives the noise filter"))
    lesion_count: int = field(metadata=column(pa.int32(), "26-connected components >= min_lesion_volume_mm3"))
    long_axis_mm: float | None = field(
        metadata=column(pa.float64(), "largest lesion: longest axial Feret diameter over its slices")
    )
    short_axis_mm: float | None = field(
        metadata=column(pa.float64(), "largest lesion: extent perpendicular to the long axis on that slice")
    )
    volume_mm3: float | None = field(metadata=column(pa.float64(), "largest lesion volume"))
    total_lesion_volume_mm3: float = field(metadata=column(pa.float64(), "all surviving lesion components"))
    organ_volume_mm3: float = field(metadata=column(pa.float64(), "organ mask volume"))
    location: tuple[str, ...] = field(
        metadata=column(pa.list_(pa.string()), "sub-structures with > 10 % of the lesion's labelled voxels, sorted")
    )
    attenuation: str | None = field(
        metadata=column(pa.string(), "hypo | iso | hyper vs parenchyma mean +- SD/10 (RadGPT)")
    )
    lesion_mean_hu: float | None = field(metadata=column(pa.float64(), "largest lesion mean HU"))
    parenchyma_mean_hu: float = field(metadata=column(pa.float64(), "organ minus all lesions, mean HU"))
    parenchyma_sd_hu: float = field(metadata=column(pa.float64(), "organ minus all lesions, SD of HU"))
    key_slice_z_vox: int | None = field(
        metadata=column(pa.int32(), "canonical z of the max cross-sectional area slice (ties: lowest z)")
    )
    max_diameter_z_vox: int | None = field(
        metadata=column(pa.int32(), "canonical z of the longest-diameter slice (RadGPT's 'image')")
    )
    bbox_xyxy_vox: tuple[int, int, int, int] | None = field(
        metadata=column(_INT_LIST, "largest lesion box on the key slice, canonical voxels, half-open")
    )
    lesion_box_xyzxyz_vox: tuple[int, int, int, int, int, int] | None = field(
        metadata=column(_INT_LIST, "largest lesion 3-D box, canonical voxels, half-open")
    )
    organ_box_xyzxyz_vox: tuple[int, int, int, int, int, int] = field(
        metadata=column(_INT_LIST, "organ 3-D box, canonical voxels, half-open")
    )

    @classmethod
    def negative(
        cls,
        organ: Organ,
        *,
        organ_volume_mm3: float,
        parenchyma_mean_hu: float,
        parenchyma_sd_hu: float,
        organ_box_xyzxyz_vox: tuple[int, int, int, int, int, int],
    ) -> OrganLabels:
        """Return the labels of a row without a lesion: the organ's facts, every lesion attribute empty."""
        return cls(
            organ=organ,
            has_lesion=False,
            lesion_count=0,
            long_axis_mm=None,
            short_axis_mm=None,
            volume_mm3=None,
            total_lesion_volume_mm3=0.0,
            organ_volume_mm3=organ_volume_mm3,
            location=(),
            attenuation=None,
            lesion_mean_hu=None,
            parenchyma_mean_hu=parenchyma_mean_hu,
            parenchyma_sd_hu=parenchyma_sd_hu,
            key_slice_z_vox=None,
            max_diameter_z_vox=None,
            bbox_xyxy_vox=None,
            lesion_box_xyzxyz_vox=None,
            organ_box_xyzxyz_vox=organ_box_xyzxyz_vox,
        )


@dataclass(frozen=True, slots=True)
class _Largest:
    """Measurements of the largest lesion component (internal)."""

    box_vox: Box3  # its 3-D box in the volume frame
    comp: NDArray[np.bool_]  # (x, y, z) mask of the component inside `box_vox`
    voxel_count: int


def label_organ(
    source: MaskSource,
    organ: Organ,
    *,
    cfg: LabelConfig = LabelConfig(),  # noqa: B008 - frozen dataclass, safe as a shared default
) -> OrganLabels:
    """Compute the labels of one organ row from the masks on the CT's native grid (docs/contract.md#labels).

    Steps: organ = union of the organ's masks (both kidneys for `kidney`); lesion components are 26-connected
    and those below `cfg.min_lesion_volume_mm3` are dropped; every lesion attribute is about the largest
    surviving component. Ties for the largest go to the component whose first voxel in C order of `(x, y, z)`
    (lowest x, then y, then z) comes first.

    The long axis is the outer (corner) Feret diameter: per axial slice, the convex hull of the corner points of
    the component's voxels (voxel `(x, y)` covers `[x, x+1) x [y, y+1)`), max pairwise distance in mm. RadGPT
    measures between contour points through pixel centres on a 1 mm grid, so the two differ by at most one voxel
    diagonal (the corner version is never smaller). The short axis is the extent of the same corner points
    perpendicular to the long-axis chord on the long-axis slice.

    Args:
        source: CT and masks of the case, canonical RAS `(X, Y, Z)`, masks on the CT grid.
        organ: which organ row to label.
        cfg: thresholds (noise filter, location share, iso band, inside-organ fraction).

    Returns:
        The row's labels; a negative row when the lesion file is absent, empty, or all its components are noise.

    Raises:
        CaseDataError: `MISSING_ORGAN_MASK` when no organ mask file exists, `EMPTY_ORGAN_MASK` when the organ
            mask has no voxel (or no voxel outside the lesions), `LESION_OUTSIDE_ORGAN` when less than
            `cfg.min_lesion_inside_fraction` of the lesion voxels lie inside the organ dilated by one voxel,
            `IMPLAUSIBLE_ORGAN_HU` (organ-level, naming the organ's files) when the mean HU of the parenchyma is
            outside the organ's window (`OrganSpec.mean_hu_window`).
        ValueError: the CT is not 3-D, a spacing is not positive, or a mask is not on the CT grid.
    """
    ct, spacing = _checked_ct(source)
    voxel_mm3 = spacing[0] * spacing[1] * spacing[2]
    structures = ORGAN_STRUCTURES[organ]
    get = MaskCache(source, ct.shape)
    box = box_finder(source)
    region = _organ_region(get, box, organ, structures.organ_masks, ct, voxel_mm3)

    # The lesion mask gets its own box on the full mask first, so voxels outside the organ box are seen.
    lesion_mask = get(structures.lesion_mask, keep=False)
    lesion_box = box(structures.lesion_mask, lesion_mask) if lesion_mask is not None else None
    largest: _Largest | None = None
    counts: list[int] = []
    if lesion_mask is not None and lesion_box is not None:
        largest, counts = _find_lesions(lesion_mask, lesion_box, region, organ, cfg, voxel_mm3)
        parenchyma_mean_hu, parenchyma_sd_hu = _parenchyma_hu(region, lesion_mask, organ)
    else:
        parenchyma_mean_hu, parenchyma_sd_hu = _parenchyma_hu(region, None, organ)
    organ_facts = _OrganFacts(
        organ=organ,
        organ_volume_mm3=region.volume_mm3,
        parenchyma_mean_hu=parenchyma_mean_hu,
        parenchyma_sd_hu=parenchyma_sd_hu,
        organ_box_xyzxyz_vox=box_xyzxyz(region.box),
    )
    lesion_file, organ_masks = lesion_mask is not None, region.masks
    del region, lesion_mask  # the organ crops and the full lesion mask are not needed for the lesion attributes
    _check_organ_hu(source, organ, structures.organ_masks, parenchyma_mean_hu)

    if largest is None:
        logger.debug("%s: negative row (lesion file present: %s)", organ, lesion_file)
        return _negative_labels(organ_facts)
    labels = _lesion_labels(organ_facts, largest, counts, ct, spacing, crop_getter(source, get), organ_masks, cfg)
    logger.debug("%s: %d lesion(s), largest %d voxels", organ, labels.lesion_count, largest.voxel_count)
    return labels


def _checked_ct(source: MaskSource) -> tuple[np.ndarray, tuple[float, float, float]]:
    """Return the source's CT `(X, Y, Z)` and its spacing in mm as three floats.

    Raises:
        ValueError: the CT is not 3-D or a spacing is not a positive number.
    """
    ct = source.ct_hu
    if ct.ndim != 3:
        raise ValueError(f"ct_hu must be 3-D (X, Y, Z); got {ct.shape=}.")
    spacing = tuple(float(s) for s in source.spacing_mm)
    if len(spacing) != 3 or not all(s > 0 for s in spacing):
        raise ValueError(f"spacing_mm must be three positive numbers; got {source.spacing_mm=}.")
    return ct, (spacing[0], spacing[1], spacing[2])


@dataclass(frozen=True, slots=True)
class _OrganRegion:
    """The organ's masks and their joint box, with the CT and the organ mask cropped to that box (internal).

    The two crops share one memory layout, so `ravel('K')` gathers of one by the other line up.
    """

    masks: dict[str, Boxed]  # the organ's files that exist, each kept inside its own box
    box: Box3  # the union of the per-file boxes, volume frame
    ct_crop: np.ndarray  # CT HU inside `box`
    mask_crop: NDArray[np.bool_]  # union of `masks` inside `box`
    volume_mm3: float


def _organ_region(
    get: MaskGetter,
    box: Callable[[str, np.ndarray], Box3 | None],
    organ: Organ,
    files: tuple[str, ...],
    ct: np.ndarray,
    voxel_mm3: float,
) -> _OrganRegion:
    """Return the organ as the union of its mask files, its box from the union of the per-file boxes.

    The files are read one at a time and each is kept as its box and crop only (one full mask alive at a time); no
    full-volume union is ever copied.

    Raises:
        CaseDataError: `MISSING_ORGAN_MASK` when none of `files` exists, `EMPTY_ORGAN_MASK` when they have no voxel.
    """
    masks: dict[str, Boxed] = {}
    for structure in files:
        full = get(structure, keep=False)
        if full is not None:
            masks[structure] = Boxed.of(full, box(structure, full))
        del full
    if not masks:
        raise CaseDataError(
            RejectReason.MISSING_ORGAN_MASK, f"no organ mask file among {list(files)}", organ=str(organ)
        )
    joint = union_box([b.box for b in masks.values()])
    if joint is None:
        raise CaseDataError(
            RejectReason.EMPTY_ORGAN_MASK, f"organ mask(s) {list(files)} have no voxel", organ=str(organ)
        )
    ct_crop = copy_like(ct[joint], ct[joint])
    mask_crop = union_crop(list(masks.values()), joint, like=ct_crop)
    return _OrganRegion(masks, joint, ct_crop, mask_crop, int(np.count_nonzero(mask_crop)) * voxel_mm3)


def _find_lesions(
    lesion_mask: np.ndarray, lesion_box: Box3, region: _OrganRegion, organ: Organ, cfg: LabelConfig, voxel_mm3: float
) -> tuple[_Largest | None, list[int]]:
    """Check the lesion lies in the organ, then split it into components; return the largest and the kept sizes.

    Args:
        lesion_mask: the full `(X, Y, Z)` lesion mask; lesion_box: its (non-empty) box.
        region: the organ; organ: its name (for rejections); cfg: noise filter and inside-organ fraction.
        voxel_mm3: the volume of one voxel.

    Returns:
        The largest surviving component (None when every component is noise) and the voxel counts of the survivors.

    Raises:
        CaseDataError: `LESION_OUTSIDE_ORGAN` (`_check_inside_organ`).
    """
    lesion_crop = as_bool(lesion_mask[lesion_box], like=lesion_mask[lesion_box])
    _check_inside_organ(lesion_crop, lesion_box, list(region.masks.values()), lesion_mask.shape, organ, cfg)
    return _components(lesion_crop, lesion_box, voxel_mm3, cfg)


def _parenchyma_hu(region: _OrganRegion, lesion_mask: np.ndarray | None, organ: Organ) -> tuple[float, float]:
    """Return the mean and SD of the HU of the parenchyma: the organ minus every lesion voxel.

    Noise components are excluded too (RadGPT: organ minus all lesions). `lesion_mask` is the full lesion mask, or
    None when there is no lesion voxel.

    Raises:
        CaseDataError: `EMPTY_ORGAN_MASK` when no organ voxel lies outside the lesion mask.
    """
    if lesion_mask is not None:
        parenchyma = region.mask_crop & ~as_bool(lesion_mask[region.box], like=region.ct_crop)
    else:
        parenchyma = region.mask_crop
    if int(np.count_nonzero(parenchyma)) == 0:
        raise CaseDataError(
            RejectReason.EMPTY_ORGAN_MASK,
            "no organ voxel outside the lesion mask: the parenchyma is empty",
            organ=str(organ),
        )
    return _hu_stats(region.ct_crop.ravel("K")[parenchyma.ravel("K")])


@dataclass(frozen=True, slots=True)
class _OrganFacts:
    """The organ-level labels every row has, lesion or not (internal)."""

    organ: Organ
    organ_volume_mm3: float
    parenchyma_mean_hu: float
    parenchyma_sd_hu: float
    organ_box_xyzxyz_vox: tuple[int, int, int, int, int, int]


def _negative_labels(facts: _OrganFacts) -> OrganLabels:
    """Return the labels of a row without a lesion: the organ facts, every lesion attribute empty."""
    return OrganLabels.negative(
        facts.organ,
        organ_volume_mm3=facts.organ_volume_mm3,
        parenchyma_mean_hu=facts.parenchyma_mean_hu,
        parenchyma_sd_hu=facts.parenchyma_sd_hu,
        organ_box_xyzxyz_vox=facts.organ_box_xyzxyz_vox,
    )


def _lesion_labels(
    facts: _OrganFacts,
    largest: _Largest,
    counts: list[int],
    ct: np.ndarray,
    spacing: tuple[float, float, float],
    crop_of: Callable[[str, Box3], np.ndarray | None],
    organ_masks: dict[str, Boxed],
    cfg: LabelConfig,
) -> OrganLabels:
    """Return the labels of a positive row: key slice, diameters, HU, attenuation and location of the largest lesion.

    Args:
        facts: the organ-level labels; largest: the largest lesion component; counts: voxel counts of every kept one.
        ct: the full CT `(X, Y, Z)`; spacing: its voxel size in mm.
        crop_of: a mask cropped to a box (the location reads the organ's sub-structures inside the lesion's box);
        organ_masks: the organ's masks in their boxes; cfg: iso band and location share.
    """
    voxel_mm3 = spacing[0] * spacing[1] * spacing[2]
    x0, y0, z0 = (s.start for s in largest.box_vox)
    key_z, (bx0, by0, bx1, by1) = _key_slice(largest.comp)
    long_axis_mm, short_axis_mm, diameter_z = _axial_diameters(largest.comp, spacing[0], spacing[1])

    ct_lesion = copy_like(ct[largest.box_vox], ct[largest.box_vox])
    comp_k = as_bool(largest.comp, like=ct_lesion)
    lesion_mean_hu, _ = _hu_stats(ct_lesion.ravel("K")[comp_k.ravel("K")])
    attenuation = _attenuation(lesion_mean_hu, facts.parenchyma_mean_hu, facts.parenchyma_sd_hu, cfg.iso_sd_fraction)

    return OrganLabels(
        organ=facts.organ,
        has_lesion=True,
        lesion_count=len(counts),
        long_axis_mm=long_axis_mm,
        short_axis_mm=short_axis_mm,
        volume_mm3=largest.voxel_count * voxel_mm3,
        total_lesion_volume_mm3=sum(counts) * voxel_mm3,
        organ_volume_mm3=facts.organ_volume_mm3,
        location=_location(facts.organ, largest, crop_of, organ_masks, cfg.location_min_fraction),
        attenuation=attenuation,
        lesion_mean_hu=lesion_mean_hu,
        parenchyma_mean_hu=facts.parenchyma_mean_hu,
        parenchyma_sd_hu=facts.parenchyma_sd_hu,
        key_slice_z_vox=z0 + key_z,
        max_diameter_z_vox=z0 + diameter_z,
        bbox_xyxy_vox=(x0 + bx0, y0 + by0, x0 + bx1, y0 + by1),
        lesion_box_xyzxyz_vox=box_xyzxyz(largest.box_vox),
        organ_box_xyzxyz_vox=facts.organ_box_xyzxyz_vox,
    )


def _check_organ_hu(source: MaskSource, organ: Organ, files: tuple[str, ...], parenchyma_mean_hu: float) -> None:
    """Refuse this organ (only) when its parenchyma's mean HU is outside the organ's window.

    A misplaced mask shows in the HU inside the organ (docs/contract.md#input), so it is always checked. The window table is
    `OrganSpec.mean_hu_window`, the one the placement evidence uses too.

    Raises:
        CaseDataError: `IMPLAUSIBLE_ORGAN_HU` with `organ` set and `path` naming the organ's mask file(s).
    """
    low_hu, high_hu = organ_hu_window(str(organ))
    if low_hu <= parenchyma_mean_hu <= high_hu:
        return
    path_of = getattr(source, "relative_path", None)
    paths = [p for p in (path_of(f) for f in files) if p] if path_of else []
    raise CaseDataError(
        RejectReason.IMPLAUSIBLE_ORGAN_HU,
        f"{', '.join(paths) or organ}: mean HU of the {organ} parenchyma is {parenchyma_mean_hu:.0f}, outside the "
        f"{organ} window [{low_hu:.0f}, {high_hu:.0f}]: the mask does not lie on the organ",
        path=", ".join(paths) or None,
        organ=str(organ),
    )


def _check_inside_organ(
    lesion: NDArray[np.bool_],
    lesion_box: Box3,
    organ_masks: list[Boxed],
    shape: tuple[int, ...],
    organ: Organ,
    cfg: LabelConfig,
) -> None:
    """Raise `LESION_OUTSIDE_ORGAN` when too few lesion voxels lie inside the organ dilated by one voxel.

    All lesion voxels count (before the noise filter). The organ is cropped to the lesion box grown by one voxel
    (clipped to the volume), so the dilation sees organ voxels just outside the lesion box.

    Args:
        lesion: bool lesion mask inside `lesion_box`, shape of the box.
        lesion_box: the lesion mask's tight box (non-empty), volume frame.
        organ_masks: the organ's masks (each kept inside its own box).
        shape: the volume's shape `(X, Y, Z)`.
        organ: for the error.
        cfg: holds `min_lesion_inside_fraction`.

    Raises:
        CaseDataError: `LESION_OUTSIDE_ORGAN`, the detail gives the inside fraction.
    """
    grown = tuple(slice(max(s.start - 1, 0), min(s.stop + 1, n)) for s, n in zip(lesion_box, shape, strict=True))
    organ_grown = np.zeros(tuple(s.stop - s.start for s in grown), dtype=np.bool_)
    for m in organ_masks:
        organ_grown |= m.window(grown)
    inner = tuple(slice(b.start - g.start, b.stop - g.start) for b, g in zip(lesion_box, grown, strict=True))
    near_organ = dilate_cube(organ_grown)[inner]
    n_lesion = int(np.count_nonzero(lesion))
    fraction = int(np.count_nonzero(lesion & near_organ)) / n_lesion
    if fraction < cfg.min_lesion_inside_fraction:
        raise CaseDataError(
            RejectReason.LESION_OUTSIDE_ORGAN,
            f"only {fraction:.3f} of {n_lesion} lesion voxels lie inside the {organ} mask dilated by one voxel "
            f"(min_lesion_inside_fraction={cfg.min_lesion_inside_fraction})",
            organ=str(organ),
        )


def _components(
    lesion: NDArray[np.bool_], lesion_box: Box3, voxel_mm3: float, cfg: LabelConfig
) -> tuple[_Largest | None, list[int]]:
    """Label 26-connected components inside the lesion box, drop noise, and pick the largest.

    Args:
        lesion: bool lesion mask inside `lesion_box` (writable), shape of the box.
        lesion_box: the lesion mask's tight box (non-empty), volume frame.
        voxel_mm3: voxel volume in mm^3.
        cfg: holds `min_lesion_volume_mm3` (components strictly below it are dropped).

    Returns:
        The largest surviving component (None when none survives) and the voxel counts of all survivors.
        Ties in size go to the component whose first voxel in C order of `(x, y, z)` comes first.
    """
    # cc3d 4.1.1 mislabels some bool inputs with a side of length 1 ("maximum length exception"); its uint8
    # path agrees with scipy's 26-connected labelling on 10,000 random volumes, so label a zero-copy uint8 view.
    labels, n = cc3d.connected_components(lesion.view(np.uint8), connectivity=26, return_N=True)
    if n == 0:
        return None, []
    stats = cc3d.statistics(labels)
    voxel_counts = np.asarray(stats["voxel_counts"][1:], dtype=np.int64)
    keep = np.flatnonzero(voxel_counts * voxel_mm3 >= cfg.min_lesion_volume_mm3) + 1
    if keep.size == 0:
        return None, []
    counts = [int(voxel_counts[k - 1]) for k in keep]
    best = max(counts)
    tied = [int(k) for k, c in zip(keep, counts, strict=True) if c == best]

    def first_voxel(label: int) -> tuple[int, ...]:
        box = stats["bounding_boxes"][label]
        first = np.argwhere(labels[box] == label)[0]  # argwhere lists indices in C order of (x, y, z)
        return tuple(int(s.start) + int(i) for s, i in zip(box, first, strict=True))

    label = min(tied, key=first_voxel) if len(tied) > 1 else tied[0]
    box = stats["bounding_boxes"][label]
    comp = np.ascontiguousarray(labels[box] == label)
    box_vox = tuple(slice(b.start + s.start, b.start + s.stop) for b, s in zip(lesion_box, box, strict=True))
    return _Largest(box_vox=box_vox, comp=comp, voxel_count=best), counts  # type: ignore[arg-type]


def _key_slice(comp: NDArray[np.bool_]) -> tuple[int, tuple[int, int, int, int]]:
    """Return the slice of maximum cross-sectional area (ties -> lowest z) and the 2-D box on it.

    Args:
        comp: bool, shape `(x, y, z)`, a component inside its tight box.

    Returns:
        `(z, (x0, y0, x1, y1))` in the frame of `comp`; the box is half-open.
    """
    areas = np.count_nonzero(comp, axis=(0, 1))
    z = int(np.argmax(areas))  # first maximum -> lowest z
    sl = comp[:, :, z]
    xs = np.flatnonzero(sl.any(axis=1))
    ys = np.flatnonzero(sl.any(axis=0))
    return z, (int(xs[0]), int(ys[0]), int(xs[-1]) + 1, int(ys[-1]) + 1)


def _axial_diameters(comp: NDArray[np.bool_], sx: float, sy: float) -> tuple[float, float, int]:
    """Return the longest in-plane outer Feret diameter over the axial slices, the perpendicular extent, its slice.

    Per slice, the hull of the voxel corner points equals the hull of the four corners of each row's leftmost
    and rightmost voxel, so only those points go to `cv2.convexHull`. Distances are computed from integer corner
    differences scaled by the spacing, so equal shapes on different slices give bit-identical lengths and the
    tie rule (lowest z) is exact.

    Args:
        comp: bool, shape `(x, y, z)`, a component inside its tight box.
        sx: spacing along x in mm.
        sy: spacing along y in mm.

    Returns:
        `(long_axis_mm, short_axis_mm, z)` with z in the frame of `comp` (ties -> lowest z). For a tie between
        chords of one slice, the first pair in hull order is used.
    """
    n_x = comp.shape[0]
    rows = np.logical_or.reduce(comp, axis=0)  # (y, z): rows holding a voxel
    x_first = comp.argmax(axis=0)
    x_stop = n_x - comp[::-1].argmax(axis=0)  # one past the last voxel of each row
    scale = np.array([sx, sy])
    best_d2 = -1.0
    best: tuple[np.ndarray, np.ndarray, int] | None = None
    for z in range(comp.shape[2]):
        ys = np.flatnonzero(rows[:, z])
        if ys.size == 0:
            continue
        xa, xb = x_first[ys, z], x_stop[ys, z]
        pts = np.concatenate(
            [np.stack([xa, ys], 1), np.stack([xa, ys + 1], 1), np.stack([xb, ys], 1), np.stack([xb, ys + 1], 1)]
        ).astype(np.int32)
        hull = cv2.convexHull(pts).reshape(-1, 2).astype(np.int64)
        diff = (hull[:, None, :] - hull[None, :, :]) * scale  # (h, h, 2) mm
        d2 = np.einsum("ijk,ijk->ij", diff, diff)
        i = int(np.argmax(d2))
        if d2.flat[i] > best_d2:  # strict: a later (higher) slice must be longer to win
            best_d2 = float(d2.flat[i])
            best = (hull, diff.reshape(-1, 2)[i], z)
    assert best is not None, "comp has no voxel"
    hull, chord, z = best
    long_axis = float(np.sqrt(best_d2))
    normal = np.array([-chord[1], chord[0]]) / long_axis
    proj = (hull * scale) @ normal
    return long_axis, float(proj.max() - proj.min()), z


def _hu_stats(values: np.ndarray) -> tuple[float, float]:
    """Return the mean and population SD (ddof=0, as RadGPT's `np.std`) of gathered HU values.

    Integer HU (the int16 CT) are summed exactly in int64 and combined with Python integers, so the result is
    correctly rounded and independent of the gather order (memory layout); float HU fall back to float64.

    Args:
        values: 1-D, HU, int16 (or any integer or float dtype), at least one value.

    Returns:
        `(mean_hu, sd_hu)`.
    """
    n = int(values.size)
    if np.issubdtype(values.dtype, np.integer):
        s1 = int(values.sum(dtype=np.int64))
        s2 = int(np.einsum("i,i->", values, values, dtype=np.int64))  # int16^2 * n fits int64 for n < 8e9
        return s1 / n, math.sqrt((n * s2 - s1 * s1) / (n * n))
    as_float = values.astype(np.float64)
    return float(as_float.mean()), float(as_float.std())


def _attenuation(lesion_mean_hu: float, parenchyma_mean_hu: float, parenchyma_sd_hu: float, sd_fraction: float) -> str:
    """Classify a lesion by RadGPT's rule: iso inside the open band mean +- SD x fraction, else hypo or hyper.

    Args:
        lesion_mean_hu: mean HU of the lesion.
        parenchyma_mean_hu: mean HU of the organ minus all lesions.
        parenchyma_sd_hu: SD of HU of the organ minus all lesions.
        sd_fraction: half-width of the iso band in SDs (RadGPT: 0.1).

    Returns:
        An `Attenuation` value: "iso" when |difference| < band (strict), "hypo" when below, else "hyper" (so a
        zero-width band and equal means give "hyper", as in RadGPT).
    """
    diff = lesion_mean_hu - parenchyma_mean_hu
    if abs(diff) < sd_fraction * parenchyma_sd_hu:
        return Attenuation.ISO.value
    return Attenuation.HYPO.value if diff < 0 else Attenuation.HYPER.value


def _location(
    organ: Organ,
    largest: _Largest,
    crop_of: Callable[[str, Box3], np.ndarray | None],
    boxed: dict[str, Boxed],
    min_fraction: float,
) -> tuple[str, ...]:
    """Return the sub-structures holding more than `min_fraction` of the largest lesion's labelled voxels.

    Each part file present is cropped to the lesion's box right away and the full mask dropped (one full part
    mask in memory at a time; kidney sides reuse the organ masks already read). The denominator is the lesion voxels inside
    ANY part (RadGPT: voxels outside all parts do not count); a voxel in two overlapping parts counts for both.
    An organ with `single_location` (kidney) keeps only the majority part (ties -> the first name in `LOCATION_NAMES`:
    "left").

    Args:
        organ: the organ row.
        largest: the largest lesion (its mask and box).
        crop_of: returns a part mask cropped to a box (`crop_getter`), or None when the file is absent.
        boxed: masks already read, kept inside their boxes (kidney sides: the organ masks), by structure name.
        min_fraction: a part is kept when its share is strictly above this.

    Returns:
        Names in the order of `LOCATION_NAMES[organ]`; () when no part file exists or no lesion voxel is in a part.
    """
    comp = largest.comp
    labelled = np.zeros_like(comp)
    counts: dict[str, int] = {}
    for structure, name in ORGAN_STRUCTURES[organ].parts:
        crop = boxed[structure].window(largest.box_vox) if structure in boxed else crop_of(structure, largest.box_vox)
        if crop is None:
            continue
        inside = comp & (crop if crop.dtype == np.bool_ else crop != 0)
        del crop
        counts[name] = int(np.count_nonzero(inside))
        labelled |= inside
    total = int(np.count_nonzero(labelled))
    if total == 0:
        return ()
    kept = [n for n in LOCATION_NAMES[organ] if n in counts and counts[n] / total > min_fraction]
    if organ_spec(organ).single_location and kept:
        kept = [max(kept, key=lambda n: counts[n])]  # max keeps the first of equals: "left" on a tie
    return tuple(kept)
