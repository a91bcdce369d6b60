"""`build-sft-set` on a hostile atlas: the run finishes, accounts for every entry, and survives a damaged case store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from emrl_data.reading.atlas import NoCasesError
from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
from emrl_data.types import Organ
from flows.build_sft_set import build_sft_set_flow
from tests.flows.helpers import rejection_rows


LESION = LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 10.0), "hypo")


def _rejections(out: Path) -> list[tuple]:
    return rejection_rows(out, "case_id", "organ", "reason", "path")


@pytest.mark.slow
def test_a_hostile_atlas_runs_to_the_end_and_a_damaged_store_is_recomputed(prefect_harness, tmp_path: Path) -> None:
    root = tmp_path / "atlas"
    ids = [f"BDMAP_0000000{i}" for i in (1, 2, 3)]
    write_atlas(root, [CaseSpec(i, shape=(96, 80, 32), lesions=(LESION,)) for i in ids])
    ct = root / "image_only/BDMAP_00000002/ct.nii.gz"
    ct.unlink()
    ct.symlink_to("ct.nii.gz")  # unreadable (ELOOP) even for root
    (root / "image_only/BDMAP_00000009").symlink_to("BDMAP_00000009")  # a case folder that is a loop
    (root / "TrainTestIDS/IID_test.csv").write_text("BDMAP ID\nBDMAP_00000003\n")
    (root / "TrainTestIDS/IID_train.csv").write_text("BDMAP ID\nBDMAP_00000001\nBDMAP_00000002\nBDMAP_00000003\n")
    out = tmp_path / "out"

    summary = build_sft_set_flow(atlas_root=str(root), output_dir=str(out), cases_per_task=2, max_workers=1)

    expected = [
        ("BDMAP_00000002", None, "unreadable_file", "image_only/BDMAP_00000002/ct.nii.gz"),
        ("BDMAP_00000003", None, "split_conflict", "TrainTestIDS/IID_train.csv"),
        ("BDMAP_00000009", None, "not_a_case", "image_only/BDMAP_00000009"),
    ]
    assert _rejections(out) == expected
    assert summary["cases"] == 2 and summary["organ_rows"]["train"]["total"] == 3
    assert summary["qa_flags"] == {"organ_volume_low": 3, "rows_with_warnings": 0}
    qa = (out / "qa.md").read_text()
    assert "| rejection | split_conflict | 1 |" in qa and "| flag | organ_volume_low | 3 |" in qa
    assert "qa.md" in (out / "summary.md").read_text()
    shards = sorted((out / "findings/data").glob("*.parquet"))
    first = {p.name: p.read_bytes() for p in shards}

    # Damage the case store the way a crash or a full disk would: a zero-byte and a truncated entry.
    entries = sorted((out / ".work/cases").glob("*.case.json"))
    assert len(entries) == 2 and not list((out / ".work/cases").glob("*.pkl"))
    entries[0].write_bytes(b"")
    entries[1].write_bytes(entries[1].read_bytes()[:100])

    again = build_sft_set_flow(atlas_root=str(root), output_dir=str(out), cases_per_task=2, max_workers=1)

    assert again["cases_resumed_from_store"] == 0  # both recomputed, with a warning, not fatal
    assert {p.name: p.read_bytes() for p in sorted((out / "findings/data").glob("*.parquet"))} == first
    third = build_sft_set_flow(atlas_root=str(root), output_dir=str(out), cases_per_task=2, max_workers=1)
    assert third["cases_resumed_from_store"] == 2
    assert json.loads((out / "manifest.json").read_text())["warnings"] == []


def test_an_atlas_without_cases_fails_with_one_line(prefect_harness, tmp_path: Path) -> None:
    (tmp_path / "atlas/image_only").mkdir(parents=True)
    with pytest.raises(NoCasesError, match="no case under"):
        build_sft_set_flow(atlas_root=str(tmp_path / "atlas"), output_dir=str(tmp_path / "out"))
