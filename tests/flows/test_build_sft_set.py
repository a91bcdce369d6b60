"""The `build-sft-set` flow end to end under a real (temporary) Prefect API server."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest

from emrl_data.synthetic import demo_specs, write_atlas
from emrl_data.tables.records import SCHEMAS
from flows import build_sft_set as flow_module
from flows.build_sft_set import build_sft_set_flow


@pytest.fixture(scope="module")
def atlas(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("atlas")
    truth = write_atlas(root, demo_specs(16))
    return root, truth


def _artifact_keys() -> set[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {a.key for a in client.read_artifacts() if a.key}


def _shards(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for table in ("findings", "sft", "rejections")
        for p in sorted((out / table / "data").glob("*.parquet"))
    }


@pytest.mark.slow
def test_flow_end_to_end(prefect_harness, atlas, tmp_path: Path) -> None:
    root, truth = atlas
    out = tmp_path / "out"

    summary = build_sft_set_flow(atlas_root=str(root), output_dir=str(out), cases_per_task=4, max_workers=2)

    # Hub layout, schemas equal the committed ones.
    for table in ("findings", "sft", "rejections"):
        assert (out / table / "README.md").is_file()
        manifest = json.loads((out / table / "manifest.json").read_text())
        assert set(manifest["files"]) == {"README.md"} | {
            f"data/{p.name}" for p in (out / table / "data").glob("*.parquet")
        }
        for path in (out / table / "data").glob("*.parquet"):
            assert pq.read_schema(path) == SCHEMAS[table], path
    assert sorted(p.name for p in (out / "sft/data").iterdir()) == [
        "test-00000-of-00001.parquet",
        "train-00000-of-00001.parquet",
    ]

    # Every case is accounted for: an organ row or a rejection.
    findings = datasets.load_dataset("parquet", data_dir=str(out / "findings/data"))
    rejections = datasets.load_dataset("parquet", data_dir=str(out / "rejections/data"), split="train")
    seen = {r["case_id"] for split in findings.values() for r in split} | set(rejections["case_id"])
    assert seen == {c.case_id if c.case_id == c.folder_name else c.folder_name for c in truth.cases}
    expected_rows = sum(c.expects_row(o) for c in truth.cases for o in c.organs)
    assert sum(len(s) for s in findings.values()) == expected_rows
    assert sorted(rejections["reason"]) == sorted(str(e.reason) for c in truth.cases for e in c.expected_rejections)

    # SFT rows decode with images; positives + 1:1 negatives per organ in train, the whole test split.
    sft = datasets.load_dataset("parquet", data_dir=str(out / "sft/data"))
    row = next(r for r in sft["train"] if r["has_lesion"])
    assert len(row["frames"]) == row["n_frames"] and row["frames"][0].size == (448, 448)
    assert f"<key_slice>{row['key_slice_frame']}</key_slice>" in row["report"]
    assert len(sft["test"]) == len(findings["test"])
    for organ in ("liver", "pancreas", "kidney"):
        positives = sum(r["organ"] == organ and r["has_lesion"] for r in findings["train"])
        negatives = sum(r["organ"] == organ and not r["has_lesion"] for r in findings["train"])
        sft_neg = sum(r["organ"] == organ and not r["has_lesion"] for r in sft["train"])
        assert sft_neg == min(positives, negatives)

    assert summary["cases"] == len([c for c in truth.cases if c.case_id == c.folder_name])
    assert (out / "contact_sheet.png").read_bytes()[:4] == b"\x89PNG"
    keys = _artifact_keys()
    assert {"build-sft-set-counts", "build-sft-set-rejections", "build-sft-set-summary"} <= keys
    assert "build-sft-set-contact-sheet" in keys
    assert "build-sft-set" in (out / "summary.md").read_text()
    # The QA report beside the summary and as an artifact: every rejection reason counted, CSV agreement rates.
    assert "build-sft-set-qa" in keys
    qa = (out / "qa.md").read_text()
    assert "## Agreement with the atlas CSV" in qa and "| lesion_count |" in qa
    for reason in {str(e.reason) for c in truth.cases for e in c.expected_rejections}:
        assert f"| rejection | {reason} |" in qa


@pytest.mark.slow
def test_flow_is_deterministic_and_resumable(
    prefect_harness, atlas, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = atlas
    clean = tmp_path / "clean"
    build_sft_set_flow(atlas_root=str(root), output_dir=str(clean), cases_per_task=4, max_workers=2)

    # A second run elsewhere gives byte-identical shards.
    again = tmp_path / "again"
    build_sft_set_flow(atlas_root=str(root), output_dir=str(again), cases_per_task=3, max_workers=1)
    assert _shards(again) == _shards(clean)

    # Interrupt a run after 5 cases (the 6th raises), rerun: the 5 are resumed, the output equals the clean run.
    calls = {"n": 0}
    real = flow_module.curate_case

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt("simulated interruption")
        return real(*args, **kwargs)

    resumed = tmp_path / "resumed"
    monkeypatch.setattr(flow_module, "curate_case", interrupted)
    with pytest.raises(BaseException):  # noqa: B017 - the flow dies with the interruption, however Prefect wraps it
        build_sft_set_flow(atlas_root=str(root), output_dir=str(resumed), cases_per_task=1, max_workers=1)
    monkeypatch.setattr(flow_module, "curate_case", real)
    summary = build_sft_set_flow(atlas_root=str(root), output_dir=str(resumed), cases_per_task=4, max_workers=2)
    assert summary["cases_resumed_from_store"] == 5
    assert _shards(resumed) == _shards(clean)


@pytest.mark.slow
def test_unexpected_errors_fail_the_flow_after_writing_outputs(
    prefect_harness, atlas, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = atlas

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("emrl_data.labeling.curate.build_frames", broken)
    out = tmp_path / "out"
    state = build_sft_set_flow(
        atlas_root=str(root), output_dir=str(out), limit=2, max_unexpected_errors=0, return_state=True
    )
    assert state.is_failed()
    assert "unexpected errors" in str(state.message) or "unexpected" in repr(state)
    rejections = pq.read_table(next((out / "rejections/data").glob("*.parquet"))).to_pylist()
    assert {r["reason"] for r in rejections} == {"unexpected_error"}
    assert len(rejections) == 6
