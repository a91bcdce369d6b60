"""Curating synthetic cases: exact labels against the generator's ground truth, every quirk, every rejection."""

from __future__ import annotations

from pathlib import Path

import pytest

from emrl_data.config import CurateConfig
from emrl_data.labeling.curate import curate_case
from emrl_data.outcome import ARCHIVE_REASONS, RejectReason
from emrl_data.reading.atlas import plan_atlas
from emrl_data.synthetic import DEFECTS, QUIRKS, AtlasTruth, CaseSpec, LesionSpec, demo_specs, write_atlas
from emrl_data.types import Organ


CFG = CurateConfig()


def _curate_all(root: Path) -> tuple[list[dict], list]:
    plan = plan_atlas(root)
    rows, rejections = [], list(plan.rejections)
    for ref in plan.refs:
        result = curate_case(ref, split=plan.splits[ref.case_id], cfg=CFG, metadata=plan.metadata.get(ref.case_id))
        rows += result.rows
        rejections += result.rejections
    return rows, rejections


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[AtlasTruth, list[dict], list]:
    root = tmp_path_factory.mktemp("demo") / "atlas"
    truth = write_atlas(root, demo_specs(32))
    rows, rejections = _curate_all(root)
    return truth, rows, rejections


@pytest.mark.slow
def test_demo_atlas_covers_every_quirk(demo) -> None:
    truth, _, _ = demo
    assert set(QUIRKS) <= {q for case in truth.cases for q in case.quirks}


def test_labels_equal_the_ground_truth_on_every_demo_case(demo) -> None:
    truth, rows, _ = demo
    by_key = {(r["case_id"], r["organ"]): r for r in rows}
    checked = 0
    for case in truth.cases:
        for organ, expected in case.organs.items():
            if not case.expects_row(organ):
                assert (case.case_id, str(organ)) not in by_key
                continue
            row = by_key[(case.case_id, str(organ))]
            where = f"{case.case_id}/{organ} quirks={sorted(case.quirks)}"
            assert row["has_lesion"] == expected.has_lesion, where
            assert row["lesion_count"] == expected.lesion_count, where
            assert row["key_slice_z_vox"] == expected.key_slice_z_vox, where
            assert row["location"] == list(expected.location), where
            assert row["attenuation"] == expected.attenuation, where
            if expected.has_lesion:
                assert tuple(row["bbox_xyxy_vox"]) == tuple(expected.bbox_xyxy_vox), where
                sx, sy, _ = row["spacing_mm"]
                diagonal = (sx**2 + sy**2) ** 0.5
                assert abs(row["long_axis_mm"] - expected.long_axis_mm) <= diagonal + 1e-6, where
                assert row["volume_mm3"] == pytest.approx(expected.volume_mm3, rel=1e-6), where
                k = row["key_slice_frame"]
                assert row["frame_z_vox"][k - 1] == row["key_slice_z_vox"], where
                assert f"<key_slice>{k}</key_slice>" in row["report"], where
            else:
                assert row["bbox_xyxy_vox"] is None and "<key_slice>" not in row["report"], where
            checked += 1
    assert checked >= 80


def test_demo_rejections_are_exactly_the_expected_ones(demo) -> None:
    truth, _, rejections = demo
    expected = {
        (case.case_id if e.reason != RejectReason.INVALID_CASE_ID else case.folder_name, e.reason)
        for case in truth.cases
        for e in case.expected_rejections
    }
    assert {(r.case_id, r.reason) for r in rejections} == expected
    assert len(expected) >= 2


def test_every_reason_code_but_unexpected_error_is_produced_by_some_defect() -> None:
    assert set(DEFECTS.values()) == set(RejectReason) - {
        RejectReason.UNEXPECTED_ERROR,
        RejectReason.CASE_TIMEOUT,
        RejectReason.OVERLAPS_TRAINING_CT,  # made by a run against another output folder, not by a file
        *ARCHIVE_REASONS,
    }


LESIONS = (
    LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 10.0), "hypo"),
    LesionSpec(Organ.PANCREAS, "head", (6.0, 6.0, 6.0), "hypo"),
    LesionSpec(Organ.KIDNEY, "left", (8.0, 8.0, 8.0), "hyper"),
)


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_each_defect_ends_as_its_rejection_naming_the_file(tmp_path: Path, defect: str) -> None:
    good = CaseSpec("BDMAP_00000001", shape=(96, 80, 32), lesions=LESIONS)
    lesions = LESIONS[1:] if defect == "lesion_outside_organ" else LESIONS  # that defect draws its own liver lesion
    bad = CaseSpec("BDMAP_00000002", shape=(96, 80, 32), lesions=lesions, defect=defect)
    truth = write_atlas(tmp_path, [good, bad])

    rows, rejections = _curate_all(tmp_path)

    (expected,) = truth.case("BDMAP_00000002").expected_rejections
    matching = [r for r in rejections if r.reason == DEFECTS[defect]]
    assert len(matching) == 1, rejections
    (rejection,) = matching
    if expected.path is not None:
        assert Path(expected.path).name in rejection.detail + (rejection.path or "")
    assert {r["case_id"] for r in rows} >= {"BDMAP_00000001"}  # the run goes on
    assert len([r for r in rows if r["case_id"] == "BDMAP_00000001"]) == 3


def test_an_unexpected_error_is_recorded_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_atlas(tmp_path, [CaseSpec("BDMAP_00000001", shape=(96, 80, 32), lesions=LESIONS)])
    (ref,) = plan_atlas(tmp_path).refs

    def boom(*args, **kwargs):
        raise ZeroDivisionError("bug")

    monkeypatch.setattr("emrl_data.labeling.curate.build_frames", boom)
    result = curate_case(ref, split="train", cfg=CFG)
    assert result.rows == []
    assert [(r.organ, r.reason) for r in result.rejections] == [
        ("liver", RejectReason.UNEXPECTED_ERROR),
        ("pancreas", RejectReason.UNEXPECTED_ERROR),
        ("kidney", RejectReason.UNEXPECTED_ERROR),
    ]
    assert "ZeroDivisionError: bug" in result.rejections[0].detail


@pytest.mark.parametrize(
    ("organ_in_error", "reason", "expected"),
    [
        # organ set: only that organ, whatever the reason (the HU check, nifti's implausible_organ_hu, ...)
        ("pancreas", RejectReason.MASK_GRID_MISMATCH, [("pancreas", "mask_grid_mismatch")]),
        # no organ, a grid reason: the whole case (docs/contract.md#input: the grid itself is wrong)
        (None, RejectReason.MASK_GRID_MISMATCH, [(None, "mask_grid_mismatch")]),
        # no organ, another reason while labelling the pancreas: the pancreas
        (None, RejectReason.BAD_MASK_VALUES, [("pancreas", "bad_mask_values")]),
    ],
)
def test_case_data_errors_cost_their_organ_or_the_case(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, organ_in_error, reason, expected
) -> None:
    from emrl_data.labeling import curate as curate_module
    from emrl_data.outcome import CaseDataError

    write_atlas(tmp_path, [CaseSpec("BDMAP_00000001", shape=(96, 80, 32), lesions=LESIONS)])
    (ref,) = plan_atlas(tmp_path).refs
    real = curate_module.label_organ

    def label(source, organ, *, cfg):
        if organ == Organ.PANCREAS:
            raise CaseDataError(reason, "planted", path="mask_only/x/pancreas.nii.gz", organ=organ_in_error)
        return real(source, organ, cfg=cfg)

    monkeypatch.setattr(curate_module, "label_organ", label)
    result = curate_case(ref, split="train", cfg=CFG)

    assert [(r.organ, str(r.reason)) for r in result.rejections] == expected
    assert all(r.path == "mask_only/x/pancreas.nii.gz" for r in result.rejections)
    organs = [r["organ"] for r in result.rows]
    assert organs == ([] if expected[0][0] is None else ["liver", "kidney"])
