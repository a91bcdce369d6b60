"""Tests of the synthetic atlas: files as released, quirks, defects, ground truth, metadata, determinism."""

from __future__ import annotations

import csv
import gzip
import os
import zlib
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from emrl_data.outcome import ARCHIVE_REASONS, RejectReason
from emrl_data.reading.atlas import LOCATION_NAMES, ORGAN_STRUCTURES
from emrl_data.reading.atlas_metadata import METADATA_FILE
from emrl_data.synthetic import (
    ANISOTROPIC_SPACING_MM,
    DEFECTS,
    QUIRKS,
    TRUTH_JSON_NAME,
    AtlasTruth,
    CaseSpec,
    LesionSpec,
    bench_spec,
    demo_specs,
    metadata_columns,
    write_atlas,
    write_case,
)
from emrl_data.synthetic.nifti_writer import write_nifti_gz
from emrl_data.types import Organ, Split


SMALL = (64, 56, 24)  # a small non-cubic grid keeps these tests fast
ALL_STRUCTURES = sorted(
    {s for st in ORGAN_STRUCTURES.values() for s in (*st.organ_masks, st.lesion_mask, *(p for p, _ in st.parts))}
)


def _liver_lesion(part: str = "6", radius: float = 5.0, attenuation: str = "hypo") -> LesionSpec:
    return LesionSpec(Organ.LIVER, part, (radius, radius, radius), attenuation)


def _three_organ_spec(case_id: str = "BDMAP_00000001", **kwargs: object) -> CaseSpec:
    lesions = (
        _liver_lesion(),
        LesionSpec(Organ.PANCREAS, "head", (3.0, 3.0, 3.0), "hypo"),
        LesionSpec(Organ.KIDNEY, "right", (3.0, 3.0, 3.0), "hyper"),
    )
    return CaseSpec(case_id, shape=kwargs.pop("shape", SMALL), lesions=lesions, seed=3, **kwargs)


def _load(path: Path) -> nib.Nifti1Image:
    return nib.load(str(path))


def _data(path: Path) -> np.ndarray:
    return np.asanyarray(_load(path).dataobj)


def _canonical(path: Path) -> np.ndarray:
    return np.asanyarray(nib.as_closest_canonical(_load(path)).dataobj)


# ---------------------------------------------------------------------------------------------------------------
# Files, dtypes, layouts
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "ct_rel", "mask_rel"),
    [
        ("split", "image_only/BDMAP_00000001/ct.nii.gz", "mask_only/BDMAP_00000001/segmentations"),  # as released
        ("combined", "BDMAP_00000001/ct.nii.gz", "BDMAP_00000001/segmentations"),  # RadGPT's layout
    ],
)
def test_write_case_layout_files_and_dtypes(tmp_path: Path, layout: str, ct_rel: str, mask_rel: str) -> None:
    truth = write_case(tmp_path, _three_organ_spec(), layout=layout)
    assert (truth.ct_path, truth.mask_dir) == (ct_rel, mask_rel)
    ct = _load(tmp_path / ct_rel)
    assert ct.get_data_dtype() == np.int16
    data = np.asanyarray(ct.dataobj)
    assert data.shape == SMALL
    assert (int(data.min()), int(data.max())) == (-1000, 1000)  # air and the vertebra's cortex are clipped
    files = sorted(p.name for p in (tmp_path / mask_rel).iterdir())
    assert files == [f"{s}.nii.gz" for s in ALL_STRUCTURES]
    for name in files:
        mask = _load(tmp_path / mask_rel / name)
        assert mask.get_data_dtype() == np.int8
        assert set(np.unique(np.asanyarray(mask.dataobj)).tolist()) == {0, 1}


@pytest.mark.parametrize(
    ("dtype", "order"),
    [
        (np.int16, "F"),  # the CT
        (np.int8, "F"),  # a mask
        (np.float32, "C"),  # the nan_voxels CT, C order goes through a copy
    ],
)
def test_write_nifti_gz_equals_nibabel_bytes(tmp_path: Path, dtype: type, order: str) -> None:
    data = np.asarray(np.arange(6 * 5 * 4).reshape(6, 5, 4) % 7, dtype=dtype, order=order)
    affine = np.array([[-0.8, 0, 0, 10.0], [0, -0.8, 0, 20.0], [0, 0, 2.5, -30.0], [0, 0, 0, 1]])
    write_nifti_gz(tmp_path / "x.nii.gz", data, affine)
    raw = (tmp_path / "x.nii.gz").read_bytes()
    assert raw[4:8] == b"\x00\x00\x00\x00"  # mtime 0
    assert raw[3] & 0x08 == 0  # no file name in the gzip header
    assert gzip.decompress(raw) == nib.Nifti1Image(data, affine).to_bytes()


def test_lps_storage_flips_x_and_y(tmp_path: Path) -> None:
    ras = write_case(tmp_path / "ras", _three_organ_spec())
    lps = write_case(tmp_path / "lps", _three_organ_spec(storage="LPS"))
    assert lps.storage == "LPS" and "lps_storage" in lps.quirks
    for rel in (ras.ct_path, f"{ras.mask_dir}/liver_segment_6.nii.gz"):
        a, b = _load(tmp_path / "ras" / rel), _load(tmp_path / "lps" / rel)
        assert nib.aff2axcodes(a.affine) == ("R", "A", "S")
        assert nib.aff2axcodes(b.affine) == ("L", "P", "S")
        np.testing.assert_array_equal(np.asanyarray(b.dataobj), np.asanyarray(a.dataobj)[::-1, ::-1, :])
        # The affines describe the same world: voxel (0, 0, 0) of LPS is voxel (X-1, Y-1, 0) of RAS.
        nx, ny, _ = SMALL
        np.testing.assert_allclose(b.affine @ [0, 0, 0, 1], a.affine @ [nx - 1, ny - 1, 0, 1], atol=1e-4)
        np.testing.assert_array_equal(_canonical(tmp_path / "lps" / rel), np.asanyarray(a.dataobj))
    assert lps.organs == ras.organs  # the truth is in canonical space


def test_flipped_affine_mask_has_identical_voxel_bytes(tmp_path: Path) -> None:
    plain = write_case(tmp_path / "a", _three_organ_spec())
    quirky = write_case(tmp_path / "b", _three_organ_spec(quirks=frozenset({"flipped_affine_mask"})))
    a = tmp_path / "a" / plain.mask_dir / "kidney_right.nii.gz"
    b = tmp_path / "b" / quirky.mask_dir / "kidney_right.nii.gz"
    assert gzip.decompress(a.read_bytes())[352:] == gzip.decompress(b.read_bytes())[352:]
    img_a, img_b = _load(a), _load(b)
    np.testing.assert_allclose(img_b.affine, np.diag([-1, -1, 1, 1]) @ img_a.affine, atol=1e-5)
    assert nib.aff2axcodes(img_b.affine) == ("L", "P", "S")
    assert (int(img_b.header["sform_code"]), int(img_b.header["qform_code"])) == (1, 1)
    # The siblings keep nibabel's default codes and the CT's affine.
    sibling = _load(tmp_path / "b" / quirky.mask_dir / "kidney_left.nii.gz")
    np.testing.assert_allclose(sibling.affine, _load(tmp_path / "b" / quirky.ct_path).affine)


@pytest.mark.parametrize("storage", ["RAS", "LPS"])  # the crop offset must follow the storage flips
def test_cropped_masks_are_placed_by_their_affine(tmp_path: Path, storage: str) -> None:
    full = write_case(tmp_path / "full", _three_organ_spec(storage=storage))
    crop = write_case(tmp_path / "crop", _three_organ_spec(storage=storage, quirks=frozenset({"mask_cropped_grid"})))
    ct = _load(tmp_path / "crop" / crop.ct_path)
    for name in ("liver", "kidney_left", "liver_lesion", "pancreas_head"):
        small = _load(tmp_path / "crop" / crop.mask_dir / f"{name}.nii.gz")
        assert all(s < n for s, n in zip(small.shape, ct.shape, strict=True))
        t = np.linalg.inv(ct.affine) @ small.affine
        np.testing.assert_allclose(t[:3, :3], np.eye(3), atol=1e-5)  # same axes: a pure translation
        offset = np.rint(t[:3, 3]).astype(int)
        np.testing.assert_allclose(t[:3, 3], offset, atol=1e-4)
        assert np.all(offset > 0)  # cropped on every axis
        placed = np.zeros(ct.shape, dtype=np.int8)
        sl = tuple(slice(o, o + n) for o, n in zip(offset, small.shape, strict=True))
        placed[sl] = np.asanyarray(small.dataobj)
        np.testing.assert_array_equal(placed, _data(tmp_path / "full" / full.mask_dir / f"{name}.nii.gz"))


def test_anisotropic_quirk_sets_spacing(tmp_path: Path) -> None:
    spec = _three_organ_spec(quirks=frozenset({"anisotropic"}))
    assert spec.spacing_mm == ANISOTROPIC_SPACING_MM
    truth = write_case(tmp_path, spec)
    zooms = _load(tmp_path / truth.ct_path).header.get_zooms()
    np.testing.assert_allclose(zooms, ANISOTROPIC_SPACING_MM, rtol=1e-6)
    assert truth.spacing_mm == tuple(float(np.float32(s)) for s in ANISOTROPIC_SPACING_MM)


def test_empty_lesion_files_quirk(tmp_path: Path) -> None:
    spec = CaseSpec("BDMAP_00000001", shape=SMALL, lesions=(_liver_lesion(),))
    plain = write_case(tmp_path / "a", spec)
    assert not (tmp_path / "a" / plain.mask_dir / "kidney_lesion.nii.gz").exists()  # negative: no file
    quirky = write_case(
        tmp_path / "b",
        CaseSpec("BDMAP_00000001", shape=SMALL, lesions=spec.lesions, quirks=frozenset({"empty_lesion_files"})),
    )
    for stem in ("kidney_lesion", "pancreatic_lesion"):
        data = _data(tmp_path / "b" / quirky.mask_dir / f"{stem}.nii.gz")
        assert data.shape == SMALL and not data.any()


# ---------------------------------------------------------------------------------------------------------------
# Anatomy
# ---------------------------------------------------------------------------------------------------------------


def test_anatomy_sides_and_partitions(tmp_path: Path) -> None:
    truth = write_case(tmp_path, _three_organ_spec(storage="LPS"))
    masks = {s: _canonical(tmp_path / truth.mask_dir / f"{s}.nii.gz").astype(bool) for s in ALL_STRUCTURES}
    ct = _canonical(tmp_path / truth.ct_path)

    def mean_x(name: str) -> float:
        return float(np.argwhere(masks[name])[:, 0].mean())

    centre_x = (SMALL[0] - 1) / 2
    # Canonical RAS: x grows towards the patient's right.
    assert mean_x("liver") > centre_x
    assert mean_x("kidney_right") > centre_x > mean_x("kidney_left")
    assert mean_x("pancreas_head") > mean_x("pancreas_body") > mean_x("pancreas_tail")
    # Liver segments: 8 non-empty, disjoint, covering the liver; same for the pancreas parts.
    for organ, parts in (
        ("liver", [f"liver_segment_{k}" for k in range(1, 9)]),
        ("pancreas", ["pancreas_head", "pancreas_body", "pancreas_tail"]),
    ):
        stack = np.stack([masks[p] for p in parts]).astype(int)
        assert all(m.any() for m in stack)
        assert stack.sum(axis=0).max() == 1
        np.testing.assert_array_equal(stack.sum(axis=0).astype(bool), masks[organ])
    # No two organs share a voxel.
    organs = np.stack([masks[s] for s in ("liver", "pancreas", "kidney_left", "kidney_right")]).astype(int)
    assert organs.sum(axis=0).max() == 1
    # HU of the parenchyma (noise SD 8).
    parenchyma = {"liver": 60, "pancreas": 40, "kidney_left": 150}
    for name, hu in parenchyma.items():
        lesion = masks[ORGAN_STRUCTURES[Organ.KIDNEY if name.startswith("kidney") else Organ(name)].lesion_mask]
        values = ct[masks[name] & ~lesion]
        assert abs(values.mean() - hu) < 1.0 and 6.0 < values.std() < 10.0


# ---------------------------------------------------------------------------------------------------------------
# Ground truth
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lesion", "location"),
    [
        (_liver_lesion("6", 4.0), ("6",)),  # small sphere, well inside segment 6
        (LesionSpec(Organ.PANCREAS, "tail", (3.0, 3.0, 3.0), "hypo"), ("tail",)),  # pancreas tail
        (LesionSpec(Organ.KIDNEY, "left", (3.0, 3.0, 3.0), "hypo"), ("left",)),  # left kidney
    ],
)
def test_single_sphere_truth_matches_the_written_mask(tmp_path: Path, lesion: LesionSpec, location: tuple) -> None:
    spec = CaseSpec("BDMAP_00000001", shape=(96, 80, 48), lesions=(lesion,), seed=5)
    case = write_case(tmp_path, spec)
    truth = case.organs[lesion.organ]
    stem = ORGAN_STRUCTURES[lesion.organ].lesion_mask
    mask = _canonical(tmp_path / case.mask_dir / f"{stem}.nii.gz").astype(bool)
    idx = np.argwhere(mask)
    centre = idx.mean(axis=0)
    np.testing.assert_array_equal(centre, np.rint(centre))  # snapped to a voxel centre: symmetric
    assert truth.key_slice_z_vox == int(centre[2])  # the centre slice has the largest area
    on_key = np.argwhere(mask[:, :, int(centre[2])])
    assert truth.bbox_xyxy_vox == (
        on_key[:, 0].min(),
        on_key[:, 1].min(),
        on_key[:, 0].max() + 1,
        on_key[:, 1].max() + 1,
    )
    assert truth.location == location
    assert (truth.has_lesion, truth.lesion_count, truth.attenuation) == (True, 1, "hypo")
    assert truth.long_axis_mm == 2 * lesion.radii_mm[0]
    assert truth.volume_mm3 == pytest.approx(len(idx) * float(np.prod(case.spacing_mm)))
    for other in set(Organ) - {lesion.organ}:  # negatives
        neg = case.organs[other]
        assert (neg.has_lesion, neg.lesion_count, neg.long_axis_mm, neg.location) == (False, 0, None, ())


@pytest.mark.parametrize(
    ("organ", "part", "attenuation", "delta"),
    [
        (Organ.LIVER, "8", "hypo", -40),  # liver 60 HU -> 20
        (Organ.LIVER, "8", "iso", 0),  # low-noise lesion at the organ mean: iso by RadGPT's rule
        (Organ.LIVER, "8", "hyper", 50),  # -> 110
        (Organ.PANCREAS, "head", "iso", 0),  # pancreas 40 HU
        (Organ.KIDNEY, "right", "hyper", 50),  # kidney 150 HU -> 200
    ],
)
def test_attenuation_truth(tmp_path: Path, organ: Organ, part: str, attenuation: str, delta: int) -> None:
    spec = CaseSpec("BDMAP_00000001", lesions=(LesionSpec(organ, part, (4.0, 4.0, 4.0), attenuation),), seed=9)
    truth = write_case(tmp_path, spec).organs[organ]
    assert truth.attenuation == attenuation
    assert truth.lesion_mean_hu == pytest.approx(truth.parenchyma_mean_hu + delta, abs=1.5)
    assert truth.parenchyma_sd_hu == pytest.approx(8.0, abs=1.0)


def test_several_lesions_count_and_largest(tmp_path: Path) -> None:
    lesions = (
        _liver_lesion("3", 3.0),
        LesionSpec(Organ.LIVER, "7", (8.0, 6.0, 6.0), "hyper"),  # the largest
        _liver_lesion("5", 3.0),
    )
    case = write_case(tmp_path, CaseSpec("BDMAP_00000001", shape=(160, 128, 40), lesions=lesions, seed=2))
    truth = case.organs[Organ.LIVER]
    assert (truth.lesion_count, truth.attenuation, truth.location) == (3, "hyper", ("7",))
    assert (truth.long_axis_mm, truth.short_axis_mm) == (16.0, 12.0)
    assert truth.total_lesion_volume_mm3 > truth.volume_mm3


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="BDMAP_"):
        CaseSpec("BDMAP_12x")
    with pytest.raises(ValueError, match="Unknown quirks"):
        CaseSpec("BDMAP_00000001", quirks=frozenset({"sideways"}))
    with pytest.raises(ValueError, match="cannot be combined"):
        CaseSpec("BDMAP_00000001", quirks=frozenset({"mask_cropped_grid", "flipped_affine_mask"}))
    with pytest.raises(ValueError, match="part="):
        LesionSpec(Organ.LIVER, "head", (3.0, 3.0, 3.0), "hypo")
    with pytest.raises(ValueError, match="attenuation="):
        LesionSpec(Organ.LIVER, "1", (3.0, 3.0, 3.0), "dark")
    # storage and the lps_storage quirk are one setting.
    assert "lps_storage" in CaseSpec("BDMAP_00000001", storage="LPS").quirks
    assert CaseSpec("BDMAP_00000001", quirks=frozenset({"lps_storage"})).storage == "LPS"


# ---------------------------------------------------------------------------------------------------------------
# Defects
# ---------------------------------------------------------------------------------------------------------------


def test_defects_cover_every_reject_reason() -> None:
    assert set(DEFECTS.values()) == set(RejectReason) - {
        RejectReason.UNEXPECTED_ERROR,
        RejectReason.CASE_TIMEOUT,
        RejectReason.OVERLAPS_TRAINING_CT,  # made by a run against another output folder, not by a file
        *ARCHIVE_REASONS,
    }


def _header_of(path: Path) -> nib.Nifti1Header:
    with gzip.open(path) as stream:
        return nib.Nifti1Header.from_fileobj(stream)


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_defect_writes_its_broken_file(tmp_path: Path, defect: str) -> None:
    lesions = () if defect == "lesion_outside_organ" else (_liver_lesion(),)
    spec = CaseSpec("BDMAP_00000012", shape=SMALL, lesions=lesions, defect=defect, seed=4)
    clean = write_case(tmp_path / "clean", CaseSpec("BDMAP_00000012", shape=SMALL, lesions=lesions, seed=4))
    atlas = write_atlas(tmp_path / "bad", [spec])
    case = atlas.cases[0]
    root = tmp_path / "bad"
    ct_path, mask_dir = root / case.ct_path, root / case.mask_dir
    clean_ct = (tmp_path / "clean" / clean.ct_path).read_bytes()
    assert [r.reason for r in case.expected_rejections] == [DEFECTS[defect]]
    assert not case.expects_row(Organ.LIVER) or defect in {
        "mask_values",
        "missing_organ_mask",
        "empty_organ_mask",
        "bad_metadata_row",
        "implausible_organ_hu",
    }

    if defect == "missing_ct":
        assert not ct_path.exists() and ct_path.parent.is_dir()
    elif defect == "truncated_gzip":
        assert len(ct_path.read_bytes()) < len(clean_ct)
        with pytest.raises(EOFError):
            gzip.decompress(ct_path.read_bytes())
    elif defect == "corrupt_gzip":
        assert len(ct_path.read_bytes()) == len(clean_ct) and ct_path.read_bytes() != clean_ct
        with pytest.raises((gzip.BadGzipFile, zlib.error, EOFError, OSError)):
            gzip.decompress(ct_path.read_bytes())
    elif defect == "not_nifti":
        payload = gzip.decompress(ct_path.read_bytes())
        assert payload[344:348] not in (b"n+1\x00", b"ni1\x00")
    elif defect == "ct_2d":
        assert _load(ct_path).shape == SMALL[:2]
    elif defect == "ct_4d":
        assert _load(ct_path).shape == (*SMALL, 3)
    elif defect == "absurd_header":
        assert _header_of(ct_path).get_data_shape() == (30000, 30000, 30000)
        assert len(gzip.decompress(ct_path.read_bytes())) == 352 + int(np.prod(SMALL)) * 2  # the real payload
    elif defect == "nan_voxels":
        data = np.asanyarray(_load(ct_path).dataobj)
        assert data.dtype == np.float32 and np.isnan(data).sum() == 9
    elif defect == "mask_values":
        assert set(np.unique(_data(mask_dir / "kidney_right.nii.gz")).tolist()) == {0, 1, 2}
    elif defect == "missing_organ_mask":
        assert not (mask_dir / "pancreas.nii.gz").exists() and (mask_dir / "pancreas_head.nii.gz").exists()
    elif defect == "empty_organ_mask":
        assert not _data(mask_dir / "pancreas.nii.gz").any()
    elif defect == "lesion_outside_organ":
        lesion = _data(mask_dir / "liver_lesion.nii.gz").astype(bool)
        assert lesion.any() and not (lesion & _data(mask_dir / "liver.nii.gz").astype(bool)).any()
    elif defect == "mask_grid_mismatch":
        liver, ct = _load(mask_dir / "liver.nii.gz"), _load(ct_path)
        assert liver.shape != ct.shape
        t = np.linalg.inv(ct.affine) @ liver.affine
        assert not np.allclose(np.abs(t[:3, :3]), np.round(np.abs(t[:3, :3])), atol=1e-3)  # rotated
    elif defect == "invalid_case_id":
        assert case.folder_name == "BDMAP_12x" and ct_path == root / "image_only" / "BDMAP_12x" / "ct.nii.gz"
        assert ct_path.exists()
        assert "BDMAP_00000012" not in (root / METADATA_FILE).read_text()  # a stray folder: not listed
        assert case.split is None
    elif defect == "bad_metadata_row":
        rows = list(csv.DictReader((root / METADATA_FILE).open()))
        assert rows[0]["number of liver lesion instances"] == "abc"
        assert ct_path.read_bytes() == clean_ct  # the case itself is fine
        assert case.expects_row(Organ.LIVER)
    elif defect == "split_conflict":
        for name in ("IID_train.csv", "IID_test.csv"):
            assert "BDMAP_00000012" in (root / "TrainTestIDS" / name).read_text().split()
    elif defect == "unreadable_file":
        assert ct_path.is_symlink() and os.readlink(ct_path) == ct_path.name
        with pytest.raises(OSError):
            ct_path.read_bytes()
    elif defect == "not_a_case":
        assert ct_path.parent.is_file() and case.expected_rejections[0].path == "image_only/BDMAP_00000012"
    elif defect == "implausible_spacing":
        assert np.allclose(
            _load(ct_path).header.get_zooms(),
            1000 * np.asarray(_load(tmp_path / "clean" / clean.ct_path).header.get_zooms()),
        )
    elif defect == "geometry_conflict":
        ct = _load(ct_path)
        sform_sizes = np.sqrt((ct.get_sform()[:3, :3] ** 2).sum(axis=0))
        assert np.allclose(ct.header.get_zooms(), 10 * sform_sizes)
    elif defect == "mask_orientation_conflict":
        liver, clean_liver = (
            _data(mask_dir / "liver.nii.gz"),
            _data(tmp_path / "clean" / clean.mask_dir / "liver.nii.gz"),
        )
        assert np.array_equal(liver, clean_liver[::-1]) and not np.array_equal(liver, clean_liver)
    elif defect == "implausible_organ_hu":
        pancreas = _data(mask_dir / "pancreas.nii.gz").astype(bool)
        assert (np.asanyarray(_load(ct_path).dataobj)[pancreas] == 400).mean() > 0.9
    else:  # pragma: no cover - a new defect needs its own check here
        pytest.fail(f"no check for {defect}")


def test_bad_metadata_row_without_csv_expects_nothing(tmp_path: Path) -> None:
    spec = CaseSpec("BDMAP_00000001", defect="bad_metadata_row")
    atlas = write_atlas(tmp_path, [spec], metadata_csv=False, split_files=False)
    assert atlas.cases[0].expected_rejections == () and atlas.metadata_csv is None and atlas.split_files == ()
    assert not (tmp_path / METADATA_FILE).exists()


# ---------------------------------------------------------------------------------------------------------------
# The demo atlas
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[CaseSpec], AtlasTruth]:
    root = tmp_path_factory.mktemp("demo")
    specs = demo_specs()
    return root, specs, write_atlas(root, specs)


def test_demo_specs_coverage(demo: tuple[Path, list[CaseSpec], AtlasTruth]) -> None:
    _, specs, atlas = demo
    assert len(specs) >= 30
    assert [s.case_id for s in specs] == [f"BDMAP_{i:08d}" for i in range(1, len(specs) + 1)]
    assert set().union(*(s.quirks for s in specs)) == set(QUIRKS)
    defects = [s.defect for s in specs if s.defect]
    assert len(defects) >= 2 and {"truncated_gzip", "mask_grid_mismatch"} <= set(defects)
    assert {s.split for s in specs} == {Split.TRAIN, Split.TEST}
    for organ in Organ:
        truths = [c.organs[organ] for c in atlas.cases]
        assert any(t.has_lesion for t in truths) and any(not t.has_lesion for t in truths)
        assert any(t.lesion_count >= 2 for t in truths)  # several lesions per organ
        axes = [t.long_axis_mm for t in truths if t.has_lesion]
        assert min(axes) < 20.0 and (organ is Organ.KIDNEY or max(axes) > 20.0)
    assert max(c.organs[Organ.LIVER].long_axis_mm or 0 for c in atlas.cases) > 20.0
    attenuations = {c.organs[o].attenuation for c in atlas.cases for o in Organ}
    assert attenuations == {None, "hypo", "iso", "hyper"}


def test_demo_truth_agrees_with_specs(demo: tuple[Path, list[CaseSpec], AtlasTruth]) -> None:
    _, specs, atlas = demo
    for spec, case in zip(specs, atlas.cases, strict=True):
        for organ in Organ:
            own = [le for le in spec.lesions if le.organ is organ]
            truth = case.organs[organ]
            assert truth.lesion_count == len(own), (spec.case_id, organ)  # no two lesions merged
            if own:
                largest = max(own, key=lambda le: np.prod(le.radii_mm))
                assert truth.attenuation == largest.attenuation, (spec.case_id, organ)
                assert truth.long_axis_mm == 2 * max(largest.radii_mm[:2])
                assert set(truth.location) <= set(LOCATION_NAMES[organ]) and truth.location


def test_metadata_csv_and_split_files(demo: tuple[Path, list[CaseSpec], AtlasTruth]) -> None:
    root, specs, atlas = demo
    with (root / METADATA_FILE).open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == metadata_columns() and reader.fieldnames[0] != "BDMAP ID"
        rows = {r["BDMAP ID"]: r for r in reader}
    assert list(rows) == [s.case_id for s in specs]
    case = atlas.case("BDMAP_00000001")  # one 2.4 cm hypo liver lesion, other organs negative
    row = rows["BDMAP_00000001"]
    liver = case.organs[Organ.LIVER]
    assert row["number of liver lesion instances"] == "1.0"
    assert row["largest liver lesion diameter (cm)"] == "2.4"
    assert row["largest liver lesion location (1-8)"] == ",".join(liver.location)
    assert row["largest liver lesion attenuation (hyperattenuating, isoattenuating, hypoattenuating)"] == (
        "hypoattenuating"
    )
    assert row["liver volume (cm^3)"] == f"{liver.organ_volume_mm3 / 1000:.1f}"
    assert (row["number of pancreatic lesion instances"], row["largest pancreatic lesion diameter (cm)"]) == (
        "0.0",
        "0.0",
    )
    assert row["largest kidney lesion location (left, right)"] == ""
    assert row["spacing"] == "[0.8 0.8 2.5]" and row["sex"] in {"F", "M"}
    two = rows["BDMAP_00000002"]
    assert (
        two["largest kidney lesion location (left, right)"],
        two["largest pancreatic lesion location (head, body, tail)"],
    ) == ("right", "head")
    split_ids = {}
    for split in ("train", "test"):
        with (root / "TrainTestIDS" / f"IID_{split}.csv").open(newline="") as f:
            split_ids[split] = [r["BDMAP ID"] for r in csv.DictReader(f)]
    assert sorted(split_ids["train"] + split_ids["test"]) == sorted(rows)
    assert split_ids["test"] == [c.case_id for c in atlas.cases if c.split == "test"] and split_ids["test"]


def test_truth_json_round_trip(demo: tuple[Path, list[CaseSpec], AtlasTruth]) -> None:
    root, _, atlas = demo
    text = (root / TRUTH_JSON_NAME).read_text()
    assert text == atlas.to_json()
    assert AtlasTruth.from_json(text) == atlas


# ---------------------------------------------------------------------------------------------------------------
# Determinism and the benchmark case
# ---------------------------------------------------------------------------------------------------------------


def test_same_spec_same_bytes(tmp_path: Path) -> None:
    specs = [
        _three_organ_spec("BDMAP_00000001", storage="LPS", quirks=frozenset({"mask_cropped_grid"})),
        _three_organ_spec("BDMAP_00000002", quirks=frozenset({"flipped_affine_mask"})),
    ]
    write_atlas(tmp_path / "a", specs)
    write_atlas(tmp_path / "b", specs)
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert files_a == files_b and len(files_a) == 2 * (1 + len(ALL_STRUCTURES)) + 4
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def test_bench_spec_fields() -> None:
    spec = bench_spec()
    assert (spec.case_id, spec.shape, spec.spacing_mm, spec.storage) == (
        "BDMAP_00000001",
        (512, 512, 300),
        (0.78, 0.78, 2.5),
        "LPS",
    )
    assert len(spec.lesions) == 3 and {le.organ for le in spec.lesions} == set(Organ)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("EMRL_SLOW_TESTS"), reason="writes a 512x512x300 case; set EMRL_SLOW_TESTS=1")
def test_bench_case_is_written(tmp_path: Path) -> None:
    case = write_case(tmp_path, bench_spec())
    assert _load(tmp_path / case.ct_path).shape == (512, 512, 300)
    assert all(case.organs[o].lesion_count == 1 for o in Organ)
