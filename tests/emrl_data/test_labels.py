"""Tests of `emrl_data.labeling.labels.label_organ` on hand-made arrays (non-cubic grid, anisotropic spacing)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import SimpleITK as sitk
from hypothesis import given, settings
from hypothesis.extra import numpy as hnp
from scipy import ndimage

from emrl_data.config import LabelConfig
from emrl_data.labeling.labels import OrganLabels, label_organ
from emrl_data.outcome import CaseDataError, RejectReason
from emrl_data.types import Organ


SHAPE = (24, 20, 12)  # (X, Y, Z), non-cubic
SPACING = (0.8, 0.8, 2.5)  # mm, anisotropic
VOXEL_MM3 = SPACING[0] * SPACING[1] * SPACING[2]  # same expression as the code: exact float equality
LIVER_BOX = (slice(2, 22), slice(2, 18), slice(1, 11))  # 20 x 16 x 10 = 3200 voxels
NO_NOISE = LabelConfig(min_lesion_volume_mm3=0.0)


@dataclass
class FakeSource:
    """In-memory `MaskSource`: the CT, the spacing and masks by structure name; records every request."""

    ct_hu: np.ndarray
    spacing_mm: tuple[float, float, float]
    masks: dict[str, np.ndarray]
    requested: list[str] = field(default_factory=list)

    def mask(self, structure: str) -> np.ndarray | None:
        self.requested.append(structure)
        return self.masks.get(structure)


def box_mask(*box: slice, shape: tuple[int, int, int] = SHAPE) -> np.ndarray:
    """Return a bool volume that is True inside the `(x, y, z)` slices."""
    out = np.zeros(shape, dtype=bool)
    out[box] = True
    return out


def voxels_mask(voxels: list[tuple[int, int, int]], shape: tuple[int, int, int] = SHAPE) -> np.ndarray:
    """Return a bool volume that is True at the listed `(x, y, z)` voxels."""
    out = np.zeros(shape, dtype=bool)
    for v in voxels:
        out[v] = True
    return out


def make_source(
    masks: dict[str, np.ndarray], *, ct: np.ndarray | None = None, spacing: tuple[float, float, float] = SPACING
) -> FakeSource:
    """Build a source; the CT defaults to a constant 60 HU on the shape of the first mask."""
    shape = next(iter(masks.values())).shape if masks else SHAPE
    return FakeSource(ct if ct is not None else np.full(shape, 60, np.int16), spacing, masks)


def liver_source(lesion: np.ndarray | None, **parts: np.ndarray) -> FakeSource:
    """A liver filling `LIVER_BOX`, the given lesion mask (None: file absent) and part files."""
    masks = {"liver": box_mask(*LIVER_BOX), **parts}
    if lesion is not None:
        masks["liver_lesion"] = lesion
    return make_source(masks)


# ---------------------------------------------------------------------------------------------------- key slice


def test_label_organ_key_slice_is_max_area_slice_and_bbox_is_on_it() -> None:
    lesion = np.zeros(SHAPE, bool)
    lesion[6:8, 6:8, 4] = True  # area 4
    lesion[6:9, 5:9, 5] = True  # area 12 + 1 below: an L on the key slice
    lesion[9, 8, 5] = True
    lesion[7:9, 6:9, 6] = True  # area 6
    labels = label_organ(liver_source(lesion), Organ.LIVER)
    assert labels.key_slice_z_vox == 5
    assert labels.bbox_xyxy_vox == (6, 5, 10, 9)
    assert labels.lesion_box_xyzxyz_vox == (6, 5, 4, 10, 9, 7)
    assert labels.lesion_count == 1
    assert labels.volume_mm3 == 23 * VOXEL_MM3


def test_label_organ_key_slice_and_diameter_ties_pick_lowest_z() -> None:
    lesion = np.zeros(SHAPE, bool)
    lesion[6:9, 6:9, 4] = True  # 3x3 square, area 9
    lesion[7, 7, 5] = True  # area 1, joins the two squares
    lesion[7:10, 7:10, 6] = True  # the same square moved by (1, 1): same area, same diameter
    labels = label_organ(liver_source(lesion), Organ.LIVER)
    assert labels.key_slice_z_vox == 4
    assert labels.max_diameter_z_vox == 4
    assert labels.bbox_xyxy_vox == (6, 6, 9, 9)
    assert labels.long_axis_mm == math.hypot(3 * 0.8, 3 * 0.8)


def test_label_organ_key_slice_differs_from_longest_diameter_slice() -> None:
    lesion = np.zeros(SHAPE, bool)
    lesion[6:10, 6:10, 4] = True  # 4x4 square: area 16, diagonal 4*sqrt(2) voxels
    lesion[7, 4:11, 5] = True  # 1x7 bar: area 7, diagonal sqrt(50) voxels
    labels = label_organ(liver_source(lesion), Organ.LIVER)
    assert labels.key_slice_z_vox == 4
    assert labels.max_diameter_z_vox == 5
    assert labels.bbox_xyxy_vox == (6, 6, 10, 10)
    assert labels.long_axis_mm == pytest.approx(0.8 * math.sqrt(50), rel=1e-12)


def test_label_organ_lesion_touching_volume_border() -> None:
    organ = box_mask(slice(0, 10), slice(2, 18), slice(4, 12))  # touches x = 0 and the last slice
    lesion = box_mask(slice(0, 3), slice(5, 8), slice(9, 12))  # x = 0 and z = 11 (last slice)
    labels = label_organ(make_source({"liver": organ, "liver_lesion": lesion}), Organ.LIVER)
    assert labels.lesion_box_xyzxyz_vox == (0, 5, 9, 3, 8, 12)
    assert labels.organ_box_xyzxyz_vox == (0, 2, 4, 10, 18, 12)
    assert labels.key_slice_z_vox == 9  # all three slices have area 9: lowest z
    assert labels.bbox_xyxy_vox == (0, 5, 3, 8)


# ---------------------------------------------------------------------------------------------------- components


@pytest.mark.parametrize(
    ("min_volume_mm3", "count", "total_voxels"),
    [
        (3.0, 2, 20),  # the lone voxel (1.6 mm3) drops; the diagonal pair survives only because 26-connected
        (10.0, 1, 18),  # only the 18-voxel block survives
        (0.0, 3, 21),  # nothing dropped
        (28.8, 1, 18),  # a component exactly at the threshold survives (drop strictly below)
    ],
)
def test_label_organ_count_drops_noise_and_merges_diagonal_voxels(
    min_volume_mm3: float, count: int, total_voxels: int
) -> None:
    lesion = box_mask(slice(4, 7), slice(4, 7), slice(2, 4))  # 18 voxels = 28.8 mm3
    lesion[15, 10, 3] = lesion[16, 11, 4] = True  # touch at a corner only
    lesion[18, 15, 8] = True  # a lone voxel
    labels = label_organ(liver_source(lesion), Organ.LIVER, cfg=LabelConfig(min_lesion_volume_mm3=min_volume_mm3))
    assert labels.has_lesion
    assert labels.lesion_count == count
    assert labels.volume_mm3 == 18 * VOXEL_MM3
    assert labels.total_lesion_volume_mm3 == total_voxels * VOXEL_MM3


def test_label_organ_equal_volumes_pick_first_voxel_in_c_order() -> None:
    # A's first voxel (4, 10, 6) precedes B's (10, 2, 2) in C order of (x, y, z); B comes first in F order.
    lesion = box_mask(slice(4, 6), slice(10, 12), slice(6, 8)) | box_mask(slice(10, 12), slice(2, 4), slice(2, 4))
    labels = label_organ(liver_source(lesion), Organ.LIVER)
    assert labels.lesion_count == 2
    assert labels.lesion_box_xyzxyz_vox == (4, 10, 6, 6, 12, 8)


# ---------------------------------------------------------------------------------------------------- diameters


def disc(radius_vox: float, centre: tuple[float, float], shape: tuple[int, int]) -> np.ndarray:
    """Pixels whose centres lie within `radius_vox` of `centre` (pixel (x, y) has its centre at (x+.5, y+.5))."""
    x, y = np.mgrid[0 : shape[0], 0 : shape[1]]
    return (x + 0.5 - centre[0]) ** 2 + (y + 0.5 - centre[1]) ** 2 <= radius_vox**2


def sitk_feret_mm(slice_xy: np.ndarray, sx: float, sy: float) -> float:
    """SimpleITK's Feret diameter (between pixel centres) of a 2-D `(x, y)` mask, in mm."""
    image = sitk.GetImageFromArray(slice_xy.T.astype(np.uint8))  # numpy (row=y, col=x) -> ITK index (x, y)
    image.SetSpacing((sx, sy))
    stats = sitk.LabelShapeStatisticsImageFilter()
    stats.ComputeFeretDiameterOn()
    stats.Execute(image)
    return stats.GetFeretDiameter(1)


@pytest.mark.parametrize("radius_vox", [3, 5, 8, 11.5])
def test_label_organ_long_axis_of_disc_matches_analytic_and_simpleitk(radius_vox: float) -> None:
    shape = (40, 36, 8)
    organ = box_mask(slice(0, 40), slice(0, 36), slice(0, 8), shape=shape)
    lesion = np.zeros(shape, bool)
    lesion[:, :, 3] = lesion[:, :, 4] = disc(radius_vox, (18.0, 17.5), shape[:2])
    labels = label_organ(make_source({"liver": organ, "liver_lesion": lesion}), Organ.LIVER, cfg=NO_NOISE)
    diagonal_mm = math.hypot(SPACING[0], SPACING[1])
    assert labels.long_axis_mm is not None
    # The outer (corner) Feret of a sampled disc lies within one voxel diagonal of the analytic diameter ...
    assert abs(labels.long_axis_mm - 2 * radius_vox * SPACING[0]) <= diagonal_mm
    # ... and an independent implementation (pixel-centre Feret) is at most one voxel diagonal shorter.
    ref = sitk_feret_mm(lesion[:, :, 3], SPACING[0], SPACING[1])
    assert ref <= labels.long_axis_mm <= ref + diagonal_mm + 1e-9
    assert labels.max_diameter_z_vox == 3
    assert labels.short_axis_mm == pytest.approx(labels.long_axis_mm, abs=diagonal_mm)


@pytest.mark.parametrize("spacing", [(0.8, 0.8, 2.5), (0.6, 0.9, 2.5), (1.3, 0.7, 1.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_label_organ_long_axis_of_blob_brackets_simpleitk(spacing: tuple[float, float, float], seed: int) -> None:
    rng = np.random.default_rng(seed)
    shape = (30, 26, 3)
    blob = ndimage.binary_opening(rng.random(shape[:2]) < 0.55, iterations=1)
    labelled, _ = ndimage.label(blob)
    blob = labelled == np.argmax(np.bincount(labelled.ravel())[1:]) + 1  # its largest 4-connected piece
    lesion = np.zeros(shape, bool)
    lesion[:, :, 1] = blob
    organ = np.ones(shape, bool)
    labels = label_organ(
        make_source({"liver": organ, "liver_lesion": lesion}, spacing=spacing), Organ.LIVER, cfg=NO_NOISE
    )
    ref = sitk_feret_mm(blob, spacing[0], spacing[1])
    assert labels.long_axis_mm is not None
    assert ref <= labels.long_axis_mm <= ref + math.hypot(spacing[0], spacing[1]) + 1e-9


@pytest.mark.parametrize(
    ("width_vox", "height_vox", "spacing"),
    [
        (8, 3, (0.8, 0.8, 2.5)),  # isotropic in-plane
        (8, 3, (0.6, 0.9, 2.5)),  # anisotropic in-plane: x and y scaled differently
        (1, 1, (0.8, 0.8, 2.5)),  # one voxel: long = its diagonal
        (12, 1, (0.7, 0.7, 3.0)),  # a bar one voxel thick
    ],
)
def test_label_organ_short_axis_of_rectangle(
    width_vox: int, height_vox: int, spacing: tuple[float, float, float]
) -> None:
    lesion = box_mask(slice(4, 4 + width_vox), slice(5, 5 + height_vox), slice(3, 5))
    source = make_source({"liver": box_mask(*LIVER_BOX), "liver_lesion": lesion}, spacing=spacing)
    labels = label_organ(source, Organ.LIVER, cfg=NO_NOISE)
    w_mm, h_mm = width_vox * spacing[0], height_vox * spacing[1]
    diagonal = math.hypot(w_mm, h_mm)
    assert labels.long_axis_mm == pytest.approx(diagonal, rel=1e-12)
    # The long-axis chord is the rectangle's diagonal; the other two corners lie w*h/diagonal on either side.
    assert labels.short_axis_mm == pytest.approx(2 * w_mm * h_mm / diagonal, rel=1e-12)
    assert labels.max_diameter_z_vox == 3


# ---------------------------------------------------------------------------------------------------- location


@pytest.mark.parametrize(
    ("n_seg2", "n_unlabelled", "location"),
    [
        (4, 0, ("5",)),  # 4/40 = 0.100 exactly: not above the threshold
        (5, 0, ("2", "5")),  # 5/40 = 0.125
        (3, 0, ("5",)),  # 3/40 = 0.075
        (4, 1, ("2", "5")),  # 4/39 = 0.1026: just above (unlabelled voxels leave the denominator)
        (3, 10, ("5",)),  # 3/30 = 0.100 exactly
        (3, 11, ("2", "5")),  # 3/29 = 0.1034: just above
        (0, 40, ()),  # no lesion voxel in any part
    ],
)
def test_label_organ_location_shares_around_threshold(n_seg2: int, n_unlabelled: int, location: tuple) -> None:
    lesion = box_mask(slice(4, 14), slice(6, 10), slice(5, 6))  # 40 voxels on one slice
    voxels = [tuple(v) for v in np.argwhere(lesion)]
    seg2 = voxels_mask(voxels[:n_seg2])
    seg5 = voxels_mask(voxels[n_seg2 + n_unlabelled :])
    labels = label_organ(liver_source(lesion, liver_segment_2=seg2, liver_segment_5=seg5), Organ.LIVER, cfg=NO_NOISE)
    assert labels.location == location


def test_label_organ_location_sorted_in_segment_order() -> None:
    lesion = box_mask(slice(4, 14), slice(6, 10), slice(5, 6))
    seg8 = box_mask(slice(4, 9), slice(0, 20), slice(0, 12))
    seg1 = box_mask(slice(9, 14), slice(0, 20), slice(0, 12))
    labels = label_organ(liver_source(lesion, liver_segment_8=seg8, liver_segment_1=seg1), Organ.LIVER, cfg=NO_NOISE)
    assert labels.location == ("1", "8")


def test_label_organ_location_counts_only_the_largest_lesion() -> None:
    big = box_mask(slice(4, 8), slice(4, 8), slice(2, 4))  # 32 voxels, all in segment 3
    small = box_mask(slice(14, 16), slice(12, 14), slice(6, 8))  # 8 voxels, in segment 6
    lesion = big | small
    labels = label_organ(liver_source(lesion, liver_segment_3=big, liver_segment_6=small), Organ.LIVER, cfg=NO_NOISE)
    assert labels.lesion_count == 2
    assert labels.location == ("3",)


def test_label_organ_location_empty_without_part_files() -> None:
    labels = label_organ(liver_source(box_mask(slice(4, 8), slice(4, 8), slice(2, 4))), Organ.LIVER)
    assert labels.location == ()


@pytest.mark.parametrize(
    ("left_columns", "right_columns", "location"),
    [
        (2, 4, ("right",)),  # right holds the majority
        (4, 2, ("left",)),  # left holds the majority; right (1/3) would also pass 10 % but only one side is kept
        (3, 3, ("left",)),  # tie -> left
    ],
)
def test_label_organ_kidney_keeps_majority_side(left_columns: int, right_columns: int, location: tuple) -> None:
    left = box_mask(slice(2, 12), slice(4, 16), slice(2, 10))  # the two kidneys touch at x = 12
    right = box_mask(slice(12, 22), slice(4, 16), slice(2, 10))
    lesion = box_mask(slice(12 - left_columns, 12 + right_columns), slice(8, 11), slice(5, 7))
    source = make_source({"kidney_left": left, "kidney_right": right, "kidney_lesion": lesion})
    labels = label_organ(source, Organ.KIDNEY)
    assert labels.location == location
    assert labels.organ_volume_mm3 == 2 * 960 * VOXEL_MM3
    assert labels.organ_box_xyzxyz_vox == (2, 4, 2, 22, 16, 10)


@pytest.mark.parametrize(
    ("organ", "masks", "requested"),
    [
        (  # liver: the organ, the lesion, then every segment file once
            Organ.LIVER,
            {"liver": box_mask(*LIVER_BOX), "liver_lesion": box_mask(slice(4, 8), slice(4, 8), slice(2, 4))},
            ["liver", "liver_lesion"] + [f"liver_segment_{i}" for i in range(1, 9)],
        ),
        (  # kidney: the sides are the organ masks and the parts: read once, reused for the location
            Organ.KIDNEY,
            {
                "kidney_left": box_mask(slice(2, 12), slice(4, 16), slice(2, 10)),
                "kidney_right": box_mask(slice(12, 22), slice(4, 16), slice(2, 10)),
                "kidney_lesion": box_mask(slice(4, 8), slice(8, 11), slice(5, 7)),
            },
            ["kidney_left", "kidney_right", "kidney_lesion"],
        ),
    ],
)
def test_label_organ_reads_each_file_once(organ: Organ, masks: dict[str, np.ndarray], requested: list[str]) -> None:
    source = make_source(masks)
    labels = label_organ(source, organ)
    assert labels.has_lesion
    assert source.requested == requested


def test_label_organ_kidney_with_one_side_file_only() -> None:
    right = box_mask(slice(12, 22), slice(4, 16), slice(2, 10))
    lesion = box_mask(slice(14, 17), slice(8, 11), slice(5, 7))
    labels = label_organ(make_source({"kidney_right": right, "kidney_lesion": lesion}), Organ.KIDNEY)
    assert labels.location == ("right",)
    assert labels.organ_volume_mm3 == 960 * VOXEL_MM3


def test_label_organ_pancreas_parts() -> None:
    organ = box_mask(slice(2, 22), slice(6, 12), slice(3, 8))
    head = box_mask(slice(2, 9), slice(6, 12), slice(3, 8))
    body = box_mask(slice(9, 15), slice(6, 12), slice(3, 8))
    tail = box_mask(slice(15, 22), slice(6, 12), slice(3, 8))
    lesion = box_mask(slice(10, 16), slice(8, 10), slice(5, 6))  # 5 columns in body, 1 in tail (1/6 > 10 %)
    source = make_source(
        {
            "pancreas": organ,
            "pancreatic_lesion": lesion,
            "pancreas_head": head,
            "pancreas_body": body,
            "pancreas_tail": tail,
        }
    )
    assert label_organ(source, Organ.PANCREAS, cfg=NO_NOISE).location == ("body", "tail")


# ---------------------------------------------------------------------------------------------------- attenuation


def attenuation_source(lesion_hu: list[int]) -> FakeSource:
    """Liver in `LIVER_BOX` with parenchyma alternating 90/110 HU (mean 100, SD 10) and an 8-voxel lesion."""
    organ = box_mask(*LIVER_BOX)
    lesion = box_mask(slice(8, 10), slice(8, 10), slice(4, 6))
    ct = np.full(SHAPE, -1000, np.int16)
    parenchyma = organ & ~lesion  # 3192 voxels: an even count, so mean and SD are exact
    ct[parenchyma] = np.where(np.arange(int(parenchyma.sum())) % 2 == 0, 90, 110)
    ct[lesion] = lesion_hu
    return make_source({"liver": organ, "liver_lesion": lesion}, ct=ct)


@pytest.mark.parametrize(
    ("lesion_hu", "attenuation"),
    [
        ([100] * 8, "iso"),  # equal means
        ([100] * 4 + [101] * 4, "iso"),  # +0.5 HU, inside the band of SD/10 = 1 HU
        ([100] * 1 + [101] * 7, "iso"),  # +0.875 HU
        ([101] * 8, "hyper"),  # +1.0 HU: on the band edge, the band is open
        ([99] * 8, "hypo"),  # -1.0 HU: on the band edge
        ([60] * 8, "hypo"),  # a classic hypoattenuating lesion
        ([180] * 8, "hyper"),
    ],
)
def test_label_organ_attenuation(lesion_hu: list[int], attenuation: str) -> None:
    labels = label_organ(attenuation_source(lesion_hu), Organ.LIVER)
    assert labels.parenchyma_mean_hu == 100.0
    assert labels.parenchyma_sd_hu == 10.0
    assert labels.lesion_mean_hu == sum(lesion_hu) / 8
    assert labels.attenuation == attenuation


def test_label_organ_iso_band_scales_with_config() -> None:
    labels = label_organ(attenuation_source([101] * 8), Organ.LIVER, cfg=LabelConfig(iso_sd_fraction=0.2))
    assert labels.attenuation == "iso"


# ---------------------------------------------------------------------------------------------------- negatives


def expected_negative(organ_voxels: int, box: tuple[int, ...], mean: float, sd: float) -> OrganLabels:
    return OrganLabels(
        organ=Organ.LIVER,
        has_lesion=False,
        lesion_count=0,
        long_axis_mm=None,
        short_axis_mm=None,
        volume_mm3=None,
        total_lesion_volume_mm3=0.0,
        organ_volume_mm3=organ_voxels * VOXEL_MM3,
        location=(),
        attenuation=None,
        lesion_mean_hu=None,
        parenchyma_mean_hu=mean,
        parenchyma_sd_hu=sd,
        key_slice_z_vox=None,
        max_diameter_z_vox=None,
        bbox_xyxy_vox=None,
        lesion_box_xyzxyz_vox=None,
        organ_box_xyzxyz_vox=box,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    "lesion",
    [
        None,  # lesion file absent
        np.zeros(SHAPE, bool),  # lesion file present, empty
    ],
)
def test_label_organ_negative_row(lesion: np.ndarray | None) -> None:
    seg = box_mask(*LIVER_BOX)
    source = liver_source(lesion, liver_segment_4=seg)
    labels = label_organ(source, Organ.LIVER)
    assert labels == expected_negative(3200, (2, 2, 1, 22, 18, 11), 60.0, 0.0)
    assert not any(s.startswith("liver_segment") for s in source.requested)  # parts are loaded only for lesions


def test_label_organ_noise_only_is_negative_and_still_leaves_parenchyma() -> None:
    source = attenuation_source([100] * 8)
    lesion = np.zeros(SHAPE, bool)
    lesion[5, 5, 5] = True  # one voxel = 1.6 mm3 < 10 mm3: noise, but still lesion-labelled
    source.ct_hu[5, 5, 5] = 1000
    source.ct_hu[8:10, 8:10, 4:6] = [[[90, 110], [90, 110]], [[90, 110], [90, 110]]]  # balanced, mean 100
    source.masks["liver_lesion"] = lesion
    labels = label_organ(source, Organ.LIVER)
    # The parenchyma excludes the noise voxel: 3192 + 8 - 1 voxels; without the exclusion the mean would move.
    parenchyma = source.ct_hu[source.masks["liver"] & ~lesion].astype(np.float64)
    assert labels == expected_negative(3200, (2, 2, 1, 22, 18, 11), float(parenchyma.mean()), float(parenchyma.std()))
    assert labels.parenchyma_mean_hu != pytest.approx(float(source.ct_hu[source.masks["liver"]].mean()), abs=1e-6)


# ---------------------------------------------------------------------------------------------------- defects


@pytest.mark.parametrize(
    ("organ", "masks"),
    [
        (Organ.LIVER, {"liver_lesion": box_mask(slice(4, 8), slice(4, 8), slice(2, 4))}),  # liver file absent
        (Organ.PANCREAS, {}),  # nothing at all
        (Organ.KIDNEY, {"kidney_lesion": box_mask(slice(4, 8), slice(4, 8), slice(2, 4))}),  # both kidneys absent
    ],
)
def test_label_organ_missing_organ_file_raises(organ: Organ, masks: dict[str, np.ndarray]) -> None:
    with pytest.raises(CaseDataError) as err:
        label_organ(make_source(masks), organ)
    assert err.value.reason == RejectReason.MISSING_ORGAN_MASK
    assert err.value.organ == str(organ)


@pytest.mark.parametrize(
    ("organ", "masks"),
    [
        (Organ.LIVER, {"liver": np.zeros(SHAPE, bool)}),  # empty file
        (Organ.KIDNEY, {"kidney_left": np.zeros(SHAPE, bool), "kidney_right": np.zeros(SHAPE, bool)}),  # both empty
    ],
)
def test_label_organ_empty_organ_raises(organ: Organ, masks: dict[str, np.ndarray]) -> None:
    with pytest.raises(CaseDataError) as err:
        label_organ(make_source(masks), organ)
    assert err.value.reason == RejectReason.EMPTY_ORGAN_MASK
    assert err.value.organ == str(organ)


def test_label_organ_lesion_covering_whole_organ_raises_empty_parenchyma() -> None:
    organ = box_mask(slice(4, 8), slice(4, 8), slice(2, 4))
    with pytest.raises(CaseDataError, match="parenchyma is empty") as err:
        label_organ(make_source({"liver": organ, "liver_lesion": organ.copy()}), Organ.LIVER)
    assert err.value.reason == RejectReason.EMPTY_ORGAN_MASK


@pytest.mark.parametrize(
    ("organ_x_start", "raises", "fraction"),
    [
        (6, False, "0.500"),  # lesion x 0..9; dilated organ from x = 5: 5 of 10 voxels inside, at the minimum
        (7, True, "0.400"),  # dilated organ from x = 6: 4 of 10 inside
        (10, True, "0.100"),  # organ starts right after the lesion: the touching voxel counts (dilation)
        (11, True, "0.000"),  # a gap of one voxel
    ],
)
def test_label_organ_lesion_outside_organ(organ_x_start: int, raises: bool, fraction: str) -> None:
    organ = box_mask(slice(organ_x_start, 20), slice(2, 18), slice(1, 11))
    lesion = box_mask(slice(0, 10), slice(8, 9), slice(5, 6))
    source = make_source({"liver": organ, "liver_lesion": lesion})
    if not raises:
        assert label_organ(source, Organ.LIVER).has_lesion
        return
    with pytest.raises(CaseDataError, match=f"only {fraction} of 10 lesion voxels") as err:
        label_organ(source, Organ.LIVER)
    assert err.value.reason == RejectReason.LESION_OUTSIDE_ORGAN


def test_label_organ_lesion_touching_organ_counts_as_inside() -> None:
    organ = box_mask(slice(10, 20), slice(2, 18), slice(1, 11))
    lesion = box_mask(slice(9, 10), slice(8, 10), slice(5, 7))  # directly beside the organ, outside its box
    labels = label_organ(make_source({"liver": organ, "liver_lesion": lesion}), Organ.LIVER, cfg=NO_NOISE)
    assert labels.lesion_box_xyzxyz_vox == (9, 8, 5, 10, 10, 7)


def test_label_organ_lesion_far_outside_organ_box_is_seen() -> None:
    organ = box_mask(slice(0, 6), slice(0, 6), slice(0, 4))
    lesion = box_mask(slice(4, 6), slice(4, 6), slice(2, 4)) | box_mask(slice(16, 22), slice(12, 18), slice(6, 12))
    with pytest.raises(CaseDataError) as err:
        label_organ(make_source({"liver": organ, "liver_lesion": lesion}), Organ.LIVER)
    assert err.value.reason == RejectReason.LESION_OUTSIDE_ORGAN
    assert "only 0.036 of 224 lesion voxels" in err.value.detail


def test_label_organ_mask_off_grid_raises_value_error() -> None:
    source = liver_source(np.zeros((24, 20, 11), bool))
    with pytest.raises(ValueError, match="not on the CT grid"):
        label_organ(source, Organ.LIVER)


# ---------------------------------------------------------------------------------------------------- layouts


def multi_lesion_source() -> FakeSource:
    rng = np.random.default_rng(7)
    organ = box_mask(*LIVER_BOX)
    lesion = box_mask(slice(4, 9), slice(4, 8), slice(2, 6)) | box_mask(slice(14, 17), slice(12, 16), slice(7, 9))
    lesion[6:9, 8, 4] = True  # an irregular tail
    ct = rng.integers(-50, 150, SHAPE).astype(np.int16)
    seg = {
        f"liver_segment_{i}": box_mask(slice(2 + 3 * (i - 1), 5 + 3 * (i - 1)), slice(2, 18), slice(1, 11))
        for i in (1, 2, 3)
    }
    return make_source({"liver": organ, "liver_lesion": lesion, **seg}, ct=ct)


def as_fortran(a: np.ndarray) -> np.ndarray:
    return np.asfortranarray(a)


def as_flipped_fortran(a: np.ndarray) -> np.ndarray:
    """Same logical content, stored Fortran-ordered with x and z reversed (negative strides), as a loader's view."""
    return np.asfortranarray(a[::-1, :, ::-1])[::-1, :, ::-1]


def as_read_only(a: np.ndarray) -> np.ndarray:
    """A read-only copy, as `np.frombuffer` over decompressed bytes returns."""
    out = a.copy()
    out.flags.writeable = False
    return out


@pytest.mark.parametrize(
    "layout",
    [
        as_fortran,  # nibabel's storage order
        as_flipped_fortran,  # a reoriented nibabel view: negative strides on x and z
        as_read_only,  # a zero-copy loader's read-only buffers
    ],
)
def test_label_organ_same_result_for_any_memory_layout(layout: Callable[[np.ndarray], np.ndarray]) -> None:
    source = multi_lesion_source()
    expected = label_organ(source, Organ.LIVER, cfg=NO_NOISE)
    other = replace(source, ct_hu=layout(source.ct_hu), masks={k: layout(v) for k, v in source.masks.items()})
    assert label_organ(other, Organ.LIVER, cfg=NO_NOISE) == expected
    assert expected.lesion_count == 2
    assert expected.lesion_box_xyzxyz_vox == (4, 4, 2, 9, 9, 6)
    assert expected.location == ("1", "2", "3")  # 16, 50 and 17 of 83 voxels in segments 1, 2, 3


# ---------------------------------------------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None)
@given(lesion=hnp.arrays(np.bool_, hnp.array_shapes(min_dims=3, max_dims=3, min_side=1, max_side=7)))
def test_label_organ_bbox_tight_on_key_slice_of_largest_component(lesion: np.ndarray) -> None:
    if not lesion.any():
        return
    shape = tuple(n + 2 for n in lesion.shape)  # a rim of organ-only voxels keeps the parenchyma non-empty
    full = np.zeros(shape, bool)
    full[1:-1, 1:-1, 1:-1] = lesion
    source = make_source({"liver": np.ones(shape, bool), "liver_lesion": full})
    labels = label_organ(source, Organ.LIVER, cfg=NO_NOISE)

    # Independent reference: scipy labels in C scan order, so among equal sizes the lowest label has the first voxel.
    ref, n = ndimage.label(full, structure=np.ones((3, 3, 3)))
    sizes = np.bincount(ref.ravel())[1:]
    assert labels.lesion_count == n
    comp = ref == int(np.argmax(sizes)) + 1
    areas = comp.sum(axis=(0, 1))
    assert labels.key_slice_z_vox == int(np.flatnonzero(areas == areas.max())[0])  # maximal area, lowest z
    assert labels.bbox_xyxy_vox is not None and labels.key_slice_z_vox is not None
    x0, y0, x1, y1 = labels.bbox_xyxy_vox
    key = comp[:, :, labels.key_slice_z_vox]
    inside = np.zeros_like(key)
    inside[x0:x1, y0:y1] = True
    assert not (key & ~inside).any()  # contains every key-slice voxel
    assert key[x0, :].any() and key[x1 - 1, :].any() and key[:, y0].any() and key[:, y1 - 1].any()  # tight
    xs, ys, zs = np.nonzero(comp)
    assert labels.lesion_box_xyzxyz_vox == (xs.min(), ys.min(), zs.min(), xs.max() + 1, ys.max() + 1, zs.max() + 1)


def test_label_organ_accepts_int8_masks() -> None:
    source = multi_lesion_source()
    expected = label_organ(source, Organ.LIVER, cfg=NO_NOISE)
    other = replace(source, masks={k: v.astype(np.int8) for k, v in source.masks.items()})  # the atlas's dtype
    assert label_organ(other, Organ.LIVER, cfg=NO_NOISE) == expected


# ---------------------------------------------------------------------------------------------------- HU sanity


@pytest.mark.parametrize(
    ("organ_hu", "rejected"),
    [
        (-1000, True),  # the mask lies on air: misplaced
        (-61, True),  # just below the liver window (OrganSpec.mean_hu_window)
        (-60, False),  # severe steatosis is still plausible
        (60, False),  # an ordinary liver
        (250, False),  # upper edge of the liver window
        (251, True),  # just above it
        (700, True),  # the mask lies on bone
    ],
)
def test_label_organ_rejects_a_mask_that_does_not_lie_on_the_organ(organ_hu: int, rejected: bool) -> None:
    source = make_source({"liver": box_mask(*LIVER_BOX)}, ct=np.full(SHAPE, organ_hu, np.int16))
    if not rejected:
        assert label_organ(source, Organ.LIVER).parenchyma_mean_hu == organ_hu
        return
    with pytest.raises(CaseDataError) as err:
        label_organ(source, Organ.LIVER)
    assert err.value.reason == RejectReason.IMPLAUSIBLE_ORGAN_HU
    assert err.value.organ == "liver"
    assert f"mean HU of the liver parenchyma is {organ_hu}, outside the liver window [-60, 250]" in err.value.detail
