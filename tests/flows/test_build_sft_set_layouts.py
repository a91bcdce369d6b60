"""`build-sft-set` on the public datasets as released (synthetic kits in their real layouts): exact rows from the
constructed masks, one organ per dataset, and no row for an organ the dataset does not annotate."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from emrl_data.reading.layout import layout_named
from emrl_data.synthetic import CaseSpec, LesionSpec
from emrl_data.synthetic.label_map_kits import KitCase, write_kit
from emrl_data.types import Organ
from flows.build_sft_set import build_sft_set_flow


SHAPE = (96, 80, 32)
LESIONS = (
    LesionSpec(Organ.LIVER, "8", (10.0, 9.0, 8.0), "hypo"),
    LesionSpec(Organ.PANCREAS, "body", (6.0, 6.0, 6.0), "hypo"),
    LesionSpec(Organ.KIDNEY, "right", (8.0, 7.0, 6.0), "hyper"),
    LesionSpec(Organ.KIDNEY, "left", (5.0, 5.0, 5.0), "hypo"),
)


def _table(folder: Path) -> list[dict]:
    """Every row of a table's shards (an empty split's shard included)."""
    return [row for path in sorted((folder / "data").glob("*.parquet")) for row in pq.read_table(path).to_pylist()]


def _cases(storage: str) -> list[KitCase]:
    return [
        KitCase(CaseSpec("BDMAP_00000001", shape=SHAPE, lesions=LESIONS, seed=1), storage=storage, cysts=(3,)),
        KitCase(CaseSpec("BDMAP_00000002", shape=SHAPE, lesions=LESIONS[3:], seed=2), storage=storage, cysts=(0,)),
        KitCase(CaseSpec("BDMAP_00000003", shape=SHAPE, seed=3), storage=storage),
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "storage"), [("msd-task03", "LPS"), ("kits23", "z_first"), ("lits", "RAS"), ("panorama", "oblique")]
)
def test_flow_reads_the_dataset_as_released(prefect_harness, tmp_path: Path, layout: str, storage: str) -> None:
    root, out = tmp_path / "dataset", tmp_path / "out"
    truths = write_kit(root, layout, _cases(storage))

    summary = build_sft_set_flow(atlas_root=str(root), output_dir=str(out), cases_per_task=2, max_workers=1)

    rows = {(r["case_id"], r["organ"]): r for r in _table(out / "findings")}
    expected = {(t.case_id, str(o)): labels for t in truths for o, labels in t.organs.items()}
    assert set(rows) == set(expected)  # one organ per dataset: the others are unknown, not negative
    assert len({organ for _, organ in rows}) == 1
    for key, truth in expected.items():
        row = rows[key]
        assert (row["has_lesion"], row["lesion_count"], row["key_slice_z_vox"]) == (
            truth.has_lesion,
            truth.lesion_count,
            truth.key_slice_z_vox,
        ), key
        assert (row["location"], row["attenuation"]) == (list(truth.location), truth.attenuation), key
        assert row["bbox_xyxy_vox"] == (list(truth.bbox_xyxy_vox) if truth.has_lesion else None), key
        assert row["organ_volume_mm3"] == pytest.approx(truth.organ_volume_mm3), key
        if truth.has_lesion:
            assert row["volume_mm3"] == pytest.approx(truth.volume_mm3), key
            assert f"<key_slice>{row['key_slice_frame']}</key_slice>" in row["report"], key
    assert _table(out / "rejections") == []
    assert summary["cases"] == len(truths)
    licence = layout_named(layout).licence
    assert {(r["source_dataset"], r["source_case_id"], r["source_license"]) for r in _table(out / "findings")} == {
        (layout, t.case_id, licence) for t in truths
    }
    sft = _table(out / "sft")
    assert sft and all(
        (r["source_dataset"], r["source_case_id"], r["source_license"]) == (layout, r["case_id"], licence) for r in sft
    )
    assert json.loads((out / "sft" / "manifest.json").read_text())["sources"] == [
        layout_named(layout).source.to_dict()
    ]


@pytest.mark.slow
def test_flow_reads_panorama_images_with_labels_named_apart(prefect_harness, tmp_path: Path) -> None:
    images, labels, out = tmp_path / "PANORAMA", tmp_path / "panorama_labels" / "manual_labels", tmp_path / "out"
    truths = write_kit(images, "panorama", _cases("RAS"))
    labels.parent.mkdir()
    (images / "panorama_labels" / "manual_labels").rename(labels)
    (labels / f"{truths[1].case_id}.nii.gz").unlink()

    build_sft_set_flow(
        atlas_root=str(images), output_dir=str(out), layout="panorama", labels_dir=str(labels), max_workers=1
    )

    assert sorted((r["case_id"], r["organ"], r["has_lesion"]) for r in _table(out / "findings")) == [
        ("100000_00001", "pancreas", True),
        ("100002_00003", "pancreas", False),
    ]
    (rejection,) = _table(out / "rejections")
    assert {k: rejection[k] for k in ("case_id", "organ", "step", "reason", "path")} == {
        "case_id": "100001_00002",
        "organ": None,
        "step": "discover",
        "reason": "missing_organ_mask",
        "path": str(labels / "100001_00002.nii.gz"),
    }
    assert (rejection["source_dataset"], rejection["source_case_id"], rejection["source_license"]) == (
        "panorama",
        "100001_00002",
        "CC-BY-NC-4.0",
    )
