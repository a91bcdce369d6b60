"""Atlas discovery, splits and the metadata CSV (docs/contract.md#input)."""

from __future__ import annotations

from pathlib import Path

import pytest

from emrl_data.outcome import RejectReason
from emrl_data.reading.atlas import (
    AtlasOrganMeta,
    discover_cases,
    hash_split,
    read_metadata,
    read_split_files,
    sort_locations,
)
from emrl_data.types import Organ, Split


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def test_discover_cases_split_layout_finds_cases_and_rejects_bad_ids(tmp_path: Path) -> None:
    _touch(tmp_path / "image_only/BDMAP_00000002/ct.nii.gz")
    _touch(tmp_path / "mask_only/BDMAP_00000002/segmentations/liver.nii.gz")
    _touch(tmp_path / "image_only/BDMAP_00000001/ct.nii.gz")
    _touch(tmp_path / "mask_only/BDMAP_00000003/segmentations/liver.nii.gz")  # masks only: CT missing later
    _touch(tmp_path / "image_only/BDMAP_12x/ct.nii.gz")  # invalid id
    (tmp_path / "TrainTestIDS").mkdir()  # not a case folder

    found = discover_cases(tmp_path)

    assert found.layout == "split"
    assert [r.case_id for r in found.refs] == ["BDMAP_00000001", "BDMAP_00000002", "BDMAP_00000003"]
    ref = found.refs[1]
    assert ref.ct_path == tmp_path / "image_only/BDMAP_00000002/ct.nii.gz"
    assert ref.structure_path("liver") == tmp_path / "mask_only/BDMAP_00000002/segmentations/liver.nii.gz"
    assert ref.structure_path("pancreas") is None
    assert not found.refs[2].ct_path.exists()
    assert [(r.case_id, r.reason, r.step) for r in found.rejections] == [
        ("BDMAP_12x", RejectReason.INVALID_CASE_ID, "discover")
    ]
    assert "BDMAP_12x" in found.rejections[0].detail


def test_discover_cases_combined_layout_and_plain_nii(tmp_path: Path) -> None:
    _touch(tmp_path / "BDMAP_00000007/ct.nii")
    _touch(tmp_path / "BDMAP_00000007/segmentations/liver.nii")

    found = discover_cases(tmp_path)

    assert found.layout == "combined"
    (ref,) = found.refs
    assert ref.ct_path == tmp_path / "BDMAP_00000007/ct.nii"
    assert ref.structure_path("liver") == tmp_path / "BDMAP_00000007/segmentations/liver.nii"
    assert ref.relative(ref.ct_path) == "BDMAP_00000007/ct.nii"


def test_discover_cases_missing_root_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a folder"):
        discover_cases(tmp_path / "nope")


def test_read_split_files_by_column_name(tmp_path: Path) -> None:
    assert read_split_files(tmp_path) is None
    (tmp_path / "TrainTestIDS").mkdir()
    (tmp_path / "TrainTestIDS/IID_train.csv").write_text("other,BDMAP ID\nx,BDMAP_00000001\ny,BDMAP_00000002\n")
    (tmp_path / "TrainTestIDS/IID_test.csv").write_text("BDMAP ID\nBDMAP_00000003\n")

    assert read_split_files(tmp_path).splits == {
        "BDMAP_00000001": Split.TRAIN,
        "BDMAP_00000002": Split.TRAIN,
        "BDMAP_00000003": Split.TEST,
    }


def test_hash_split_is_deterministic_and_near_the_fraction() -> None:
    ids = [f"BDMAP_{i:08d}" for i in range(1, 2001)]
    first = [hash_split(i) for i in ids]
    assert first == [hash_split(i) for i in ids]
    share = sum(s == Split.TEST for s in first) / len(ids)
    assert 0.08 < share < 0.12


def test_read_metadata_parses_by_name_in_any_column_order_and_reports_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "meta.csv"
    path.write_text(
        "largest liver lesion location (1-8),BDMAP ID,number of liver lesion instances,"
        "largest liver lesion diameter (cm),"
        '"largest liver lesion attenuation (hyperattenuating, isoattenuating, hypoattenuating)",'
        '"largest pancreatic lesion location (head, body, tail)",number of pancreatic lesion instances\n'
        '"7,8",BDMAP_00000001,2,3.1,hypoattenuating,"tail,head",1\n'
        ",BDMAP_00000002,0,0.0,,,0\n"
        ",BDMAP_00000003,abc,0.0,,,0\n"  # unreadable count
    )

    rows, problems = read_metadata(path)

    assert rows["BDMAP_00000001"][Organ.LIVER] == AtlasOrganMeta(2, 3.1, ("7", "8"), "hypo", None)
    assert rows["BDMAP_00000001"][Organ.PANCREAS].location == ("head", "tail")  # vocabulary order
    assert rows["BDMAP_00000001"][Organ.KIDNEY] == AtlasOrganMeta(None, None, None, None, None)  # columns absent
    assert rows["BDMAP_00000002"][Organ.LIVER] == AtlasOrganMeta(0, 0.0, None, None, None)
    assert "BDMAP_00000003" not in rows
    assert "meta.csv line 4" in problems["BDMAP_00000003"]
    assert "'abc'" in problems["BDMAP_00000003"]


def test_sort_locations_orders_by_vocabulary_and_rejects_unknown() -> None:
    assert sort_locations(Organ.PANCREAS, ["tail", "head", "head"]) == ("head", "tail")
    assert sort_locations(Organ.LIVER, ["8", "1"]) == ("1", "8")
    with pytest.raises(ValueError, match="unknown kidney location"):
        sort_locations(Organ.KIDNEY, ["middle"])
