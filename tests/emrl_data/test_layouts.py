"""The reader seam: each dataset layout detected from a folder as released, its label map read as the registry's
structures (kidney sides cut in the patient frame, a cyst never a tumour), and an organ it does not annotate unknown."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from emrl_data.config import CurateConfig
from emrl_data.labeling.checksums import case_cache_key
from emrl_data.labeling.curate import curate_case
from emrl_data.outcome import RejectReason
from emrl_data.reading.atlas import AtlasError, NoCasesError, discover_cases, plan_atlas
from emrl_data.reading.case_images import open_case
from emrl_data.reading.label_maps import label_table, released_table, side_cut
from emrl_data.reading.layout import LAYOUTS, detect_layout, layout_named
from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
from emrl_data.synthetic.label_map_kits import KIT_LAYOUTS, KIT_STORAGES, KitCase, write_kit
from emrl_data.synthetic.nifti_writer import write_nifti_gz
from emrl_data.types import Organ


CFG = CurateConfig()
SHAPE = (96, 80, 32)
LESIONS = (
    LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 8.0), "hypo"),
    LesionSpec(Organ.PANCREAS, "head", (6.0, 6.0, 6.0), "hypo"),
    LesionSpec(Organ.KIDNEY, "left", (8.0, 8.0, 6.0), "hyper"),
    LesionSpec(Organ.KIDNEY, "right", (6.0, 6.0, 5.0), "hypo"),
)


def _kit(root: Path, layout: str, storage: str = "RAS", cysts: tuple[int, ...] = ()):
    cases = [
        KitCase(CaseSpec("BDMAP_00000001", shape=SHAPE, lesions=LESIONS, seed=1), storage=storage, cysts=cysts),
        KitCase(CaseSpec("BDMAP_00000002", shape=SHAPE, seed=2), storage=storage),
    ]
    return write_kit(root, layout, cases)


def _rows(root: Path, layout: str | None = None) -> tuple[list[dict], list]:
    plan = plan_atlas(root, layout=layout)
    rows, rejections = [], list(plan.rejections)
    for ref in plan.refs:
        result = curate_case(ref, split=plan.splits[ref.case_id], cfg=CFG)
        rows += result.rows
        rejections += result.rejections
    return rows, rejections


def test_every_layout_declares_what_it_annotates_its_licence_and_a_command() -> None:
    assert [layout.name for layout in LAYOUTS][-1] == "abdomenatlas"  # the fallback comes last
    for layout in LAYOUTS:
        assert layout.organs and set(layout.organs) <= {str(o) for o in Organ}, layout.name
        assert layout.licence and layout.citation and layout.labels, layout.name
        assert layout.command.startswith("emrl build-sft-set "), layout.name
    assert {name: layout_named(name).organs for name in KIT_LAYOUTS} == {
        "msd-task03": ("liver",),
        "msd-task07": ("pancreas",),
        "kits23": ("kidney",),
        "lits": ("liver",),
        "panorama": ("pancreas",),
    }
    assert {layout.name: layout.licence for layout in LAYOUTS} == {
        "msd-task03": "CC-BY-SA-4.0",
        "msd-task07": "CC-BY-SA-4.0",
        "kits23": "CC-BY-NC-SA-4.0",
        "lits": "LicenseRef-LiTS",
        "panorama": "CC-BY-NC-4.0",
        "abdomenatlas": "CC-BY-NC-SA-4.0",
    }
    with pytest.raises(ValueError, match="no layout 'nope'; the layouts are msd-task03"):
        layout_named("nope")


@pytest.mark.parametrize("layout", KIT_LAYOUTS)
def test_each_kit_is_detected_and_gives_exactly_its_truth(tmp_path: Path, layout: str) -> None:
    truths = _kit(tmp_path, layout, cysts=(3,) if layout == "kits23" else ())
    assert detect_layout(tmp_path).name == layout

    rows, rejections = _rows(tmp_path)

    assert rejections == []
    expected = {(t.case_id, str(o)): labels for t in truths for o, labels in t.organs.items()}
    assert {(r["case_id"], r["organ"]) for r in rows} == set(expected)  # annotated organs only
    for row in rows:
        truth = expected[(row["case_id"], row["organ"])]
        assert row["has_lesion"] == truth.has_lesion and row["lesion_count"] == truth.lesion_count
        assert row["key_slice_z_vox"] == truth.key_slice_z_vox and row["location"] == list(truth.location)
        assert row["attenuation"] == truth.attenuation
        assert row["volume_mm3"] == pytest.approx(truth.volume_mm3) if truth.has_lesion else row["volume_mm3"] is None
        assert row["organ_volume_mm3"] == pytest.approx(truth.organ_volume_mm3)
        assert row["bbox_xyxy_vox"] == (list(truth.bbox_xyxy_vox) if truth.has_lesion else None)


def test_a_liver_only_dataset_says_nothing_about_the_pancreas_it_did_not_label(tmp_path: Path) -> None:
    # The CT holds a pancreatic lesion and kidney lesions nobody labelled: no pancreas or kidney row, no rejection.
    _kit(tmp_path, "msd-task03")
    rows, rejections = _rows(tmp_path)
    assert sorted((r["case_id"], r["organ"], r["has_lesion"]) for r in rows) == [
        ("liver_0", "liver", True),
        ("liver_1", "liver", False),
    ]
    assert rejections == []


def test_msd_ignores_appledouble_files_and_the_unlabelled_test_images(tmp_path: Path) -> None:
    _kit(tmp_path, "msd-task03")
    assert (tmp_path / "imagesTr" / "._liver_0.nii.gz").is_file() and (
        tmp_path / "labelsTr" / "._liver_0.nii.gz"
    ).is_file()
    found = discover_cases(tmp_path)
    assert found.layout == "msd-task03"
    assert [r.case_id for r in found.refs] == ["liver_0", "liver_1"]
    assert found.warnings == (
        "imagesTr/: 2 hidden entries ignored (._liver_0.nii.gz, ...)",
        "imagesTs/: 1 unlabelled test CTs, not read",
    )
    ref = found.refs[0]
    assert ref.structure_path("liver") == tmp_path / "labelsTr" / "liver_0.nii.gz"
    assert ref.structure_path("liver_tumor") == ref.structure_path("liver")
    assert ref.structure_path("pancreas") is None and ref.mask_stems() == ("liver", "liver_tumor")
    assert not ref.annotates(Organ.PANCREAS) and ref.annotates(Organ.LIVER)


def test_msd_with_another_tasks_labels_is_not_read_as_this_task(tmp_path: Path) -> None:
    _kit(tmp_path, "msd-task03")
    dataset = json.loads((tmp_path / "dataset.json").read_text())
    dataset["labels"] = {"0": "background", "1": "vessel", "2": "tumour"}  # Task08 HepaticVessel
    (tmp_path / "dataset.json").write_text(json.dumps(dataset))
    with pytest.raises(NoCasesError, match="BDMAP_XXXXXXXX"):  # no layout claims it: AbdomenAtlas' message
        discover_cases(tmp_path)
    with pytest.raises(AtlasError, match="does not state the labels of MSD Task03"):
        discover_cases(tmp_path, layout="msd-task03")


def test_a_label_map_missing_its_case_is_a_discovery_rejection(tmp_path: Path) -> None:
    _kit(tmp_path, "kits23")
    (tmp_path / "dataset" / "case_00001" / "segmentation.nii.gz").unlink()
    found = discover_cases(tmp_path)
    assert [r.case_id for r in found.refs] == ["case_00000"]
    (rejection,) = found.rejections
    assert (rejection.case_id, rejection.reason, rejection.path) == (
        "case_00001",
        RejectReason.MISSING_ORGAN_MASK,
        "dataset/case_00001/segmentation.nii.gz",
    )


@pytest.mark.parametrize("storage", KIT_STORAGES)
def test_kits_sides_are_cut_in_the_patient_frame_and_a_cyst_is_not_a_tumour(tmp_path: Path, storage: str) -> None:
    # One label for both kidneys: kidney_left/right come back as drawn (the phantom's left kidney on the patient's
    # left) whether the files are stored RAS, LPS, under an oblique affine or slice axis first.
    (truth, _) = _kit(tmp_path, "kits23", storage=storage, cysts=(3,))
    ref = discover_cases(tmp_path).refs[0]
    images = open_case(ref, cfg=CFG.load)
    for structure in ("kidney_left", "kidney_right", "kidney_tumor", "kidney_cyst"):
        mask = images.mask(structure)
        assert mask is not None and mask.any(), structure
        assert np.array_equal(mask, truth.masks[structure]), (storage, structure)
    assert not (images.mask("kidney_tumor") & images.mask("kidney_cyst")).any()
    assert images.mask("kidney_lesion") is None  # the row's lesion is the tumour and the cyst united


def test_side_cut_uses_world_x_through_any_affine() -> None:
    mask = np.ones((4, 3, 2), dtype=bool)
    ras = np.diag([1.0, 1.0, 1.0, 1.0])
    assert side_cut(mask, ras, 1.5, "right")[:, 0, 0].tolist() == [False, False, True, True]
    lps = np.diag([-1.0, -1.0, 1.0, 1.0])  # voxel index i grows towards the patient's left
    assert side_cut(mask, lps, -1.5, "right")[:, 0, 0].tolist() == [True, True, False, False]
    swapped = np.array([[0, 0, 1.0, 0], [0, 1.0, 0, 0], [1.0, 0, 0, 0], [0, 0, 0, 1.0]])  # world x from index k
    assert side_cut(mask, swapped, 0.5, "left")[0, 0, :].tolist() == [True, False]
    right, left = side_cut(mask, ras, 1.5, "right"), side_cut(mask, ras, 1.5, "left")
    assert not (right & left).any() and (right | left).all()


def test_label_values_outside_the_table_reject_the_organ(tmp_path: Path) -> None:
    _kit(tmp_path, "lits")
    path = tmp_path / "Training Batch 1" / "segmentation-0.nii"
    raw = bytearray(path.read_bytes())
    raw[-1] = 7  # the last voxel holds label 7, which LiTS does not have
    path.write_bytes(bytes(raw))
    rows, rejections = _rows(tmp_path)
    assert [(r.case_id, r.reason) for r in rejections] == [("volume-0", RejectReason.BAD_MASK_VALUES)]
    assert "label values 7 are not in the label table" in rejections[0].detail
    assert [r["case_id"] for r in rows] == ["volume-1"]


def test_float_label_maps_are_read_when_whole(tmp_path: Path) -> None:
    (truth, _) = _kit(tmp_path, "kits23", cysts=(3,))
    path = tmp_path / truth.label_path
    ref = discover_cases(tmp_path).refs[0]
    before = open_case(ref, cfg=CFG.load).mask("kidney_cyst")
    image = nib.load(path)
    write_nifti_gz(path, np.asarray(image.dataobj).astype(np.float32), image.affine)
    assert np.array_equal(open_case(ref, cfg=CFG.load).mask("kidney_cyst"), before)


def test_the_case_key_follows_the_label_map_and_not_its_neighbours(tmp_path: Path) -> None:
    _kit(tmp_path, "msd-task03")
    ref = discover_cases(tmp_path).refs[0]
    key = case_cache_key(ref, CFG, "train")
    (tmp_path / "labelsTr" / "liver_9.nii.gz").write_bytes(b"another case's file")
    assert case_cache_key(ref, CFG, "train") == key
    (tmp_path / "labelsTr" / "liver_0.nii.gz").write_bytes((tmp_path / "labelsTr" / "liver_1.nii.gz").read_bytes())
    assert case_cache_key(ref, CFG, "train") != key


def test_label_tables_resolve_roles_through_the_registry() -> None:
    assert released_table("kits23").structures() == {
        "kidney_left": ((1, 2, 3), "left"),
        "kidney_right": ((1, 2, 3), "right"),
        "kidney_tumor": ((2,), None),
        "kidney_cyst": ((3,), None),
    }
    assert released_table("msd-task07").structures() == {"pancreas": ((1, 2), None), "pancreatic_lesion": ((2,), None)}
    assert released_table("msd-task03").describe() == "1 liver, 2 cancer (tumor)"
    with pytest.raises(ValueError, match="names no registered organ, no lesion role"):
        label_table({"0": "background", "1": "vessel"})


def test_panorama_reads_pancreas_and_pdac_only_and_says_which_labels_it_ignores(tmp_path: Path) -> None:
    truths = _kit(tmp_path, "panorama")
    assert [t.ct_path for t in truths] == ["batch_1/100000_00001_0000.nii.gz", "batch_1/100001_00002_0000.nii.gz"]
    found = discover_cases(tmp_path)
    assert (found.layout, found.source.dataset, found.source.licence) == ("panorama", "panorama", "CC-BY-NC-4.0")
    assert found.warnings == (
        "labels 2 veins, 3 arteries, 5 pancreatic duct, 6 common bile duct: not read (only 1 PDAC, 4 pancreas)",
    )
    ref = found.refs[0]
    assert ref.labels is not None and ref.labels.path == tmp_path / "panorama_labels/manual_labels/100000_00001.nii.gz"
    assert ref.mask_stems() == ("pancreas", "pancreatic_tumor") and ref.organs == ("pancreas",)
    assert released_table("panorama").structures() == {"pancreas": ((4, 1), None), "pancreatic_tumor": ((1,), None)}
    # The kit draws every ignored value (2, 3, 5, 6) in the corner: read without a rejection, in no structure.
    assert set(np.unique(np.asarray(nib.load(ref.labels.path).dataobj))) == {0, 1, 2, 3, 4, 5, 6}
    rows, rejections = _rows(tmp_path)
    assert rejections == []
    assert sorted((r["case_id"], r["organ"], r["has_lesion"], r["lesion_count"]) for r in rows) == [
        ("100000_00001", "pancreas", True, 1),
        ("100001_00002", "pancreas", False, 0),
    ]


def test_panorama_labels_named_apart_and_an_image_without_labels_rejected(tmp_path: Path) -> None:
    images, labels = tmp_path / "PANORAMA", tmp_path / "labels-checkout" / "manual_labels"
    _kit(images, "panorama")
    labels.parent.mkdir()
    (images / "panorama_labels" / "manual_labels").rename(labels)
    (labels / "100001_00002.nii.gz").unlink()

    found = discover_cases(images, labels=labels)

    assert [r.case_id for r in found.refs] == ["100000_00001"]
    (rejection,) = found.rejections
    assert (rejection.case_id, rejection.reason, rejection.path) == (
        "100001_00002",
        RejectReason.MISSING_ORGAN_MASK,
        str(labels / "100001_00002.nii.gz"),
    )
    with pytest.raises(NoCasesError, match="no panorama case under"):  # the labels are not beside the images
        discover_cases(images)
    with pytest.raises(ValueError, match="the lits layout reads its labels in place .only panorama takes a folder"):
        discover_cases(images, layout="lits", labels=labels)
    with pytest.raises(
        ValueError, match="no layout 'nope'; the layouts are msd-task03, msd-task07, kits23, lits, pan"
    ):
        discover_cases(images, layout="nope")


def test_a_layout_named_is_read_instead_of_the_one_detected(tmp_path: Path) -> None:
    _kit(tmp_path, "lits")
    assert discover_cases(tmp_path, layout="lits").source.licence == "LicenseRef-LiTS"
    with pytest.raises(NoCasesError, match="BDMAP_XXXXXXXX"):
        discover_cases(tmp_path, layout="abdomenatlas")
    with pytest.raises(AtlasError, match="dataset.json does not state the labels of MSD Task03"):
        discover_cases(tmp_path, layout="msd-task03")


def test_abdomenatlas_folders_still_read_as_before(tmp_path: Path) -> None:
    write_atlas(tmp_path, [CaseSpec("BDMAP_00000001", shape=SHAPE, lesions=LESIONS)])
    assert detect_layout(tmp_path).name == "abdomenatlas"
    rows, rejections = _rows(tmp_path)
    assert sorted(r["organ"] for r in rows) == ["kidney", "liver", "pancreas"] and rejections == []
