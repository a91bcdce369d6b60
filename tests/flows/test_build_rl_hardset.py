"""The `build-rl-hardset` flow end to end: synthetic atlas -> build-sft-set -> tiny model -> hard set."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest

from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
from emrl_data.tables.records import SCHEMAS
from emrl_data.types import Organ, Split
from flows.build_rl_hardset import build_rl_hardset_flow
from flows.build_sft_set import build_sft_set_flow
from train.tiny.model import save_tiny


@pytest.fixture(scope="module")
def sft_out(prefect_harness, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("atlas")
    lesions = (
        LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 10.0), "hypo"),
        LesionSpec(Organ.KIDNEY, "left", (8.0, 8.0, 8.0), "hyper"),
    )
    specs = [
        CaseSpec(f"BDMAP_0000000{i}", shape=(96, 80, 32), lesions=lesions, seed=i, split=split)
        for i, split in ((1, Split.TRAIN), (2, Split.TRAIN), (3, Split.TEST))
    ]
    write_atlas(root, specs)
    out = tmp_path_factory.mktemp("out")
    build_sft_set_flow(
        atlas_root=str(root), output_dir=str(out), config={"frames": {"frame_size_px": 64, "max_frames": 8}}
    )
    return out


def _rows(path: Path) -> list[dict]:
    return [r for p in sorted(path.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


@pytest.mark.slow
def test_rl_hardset_end_to_end_and_resume(sft_out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = save_tiny(tmp_path / "tiny", seed=0)
    summary = build_rl_hardset_flow(
        sft_dir=str(sft_out / "sft"),
        output_dir=str(sft_out),
        model_path=str(model),
        max_new_tokens=12,
        n_bootstrap=20,
        target_size=3,
    )

    sft_rows = _rows(sft_out / "sft/data")
    predictions = _rows(sft_out / "predictions/data")
    assert sorted((p["case_id"], p["organ"]) for p in predictions) == sorted(
        (r["case_id"], r["organ"]) for r in sft_rows
    )
    for path in (sft_out / "predictions/data").glob("*.parquet"):
        assert pq.read_schema(path) == SCHEMAS["predictions"]
    # A random tiny model gets (almost) everything wrong: the hard set is capped at 3 and stratified by organ.
    hard = datasets.load_dataset("parquet", data_dir=str(sft_out / "rl_hardset/data"), split="train")
    assert len(hard) == summary["rl_hardset_rows"] == min(3, summary["hard_in_train"])
    by_id = {(p["case_id"], p["organ"]): p for p in predictions}
    for row in hard:
        assert row["split"] == "train" and row["hard_reasons"]
        assert row["sft_prediction"] == by_id[(row["case_id"], row["organ"])]["prediction"]
        assert len(row["frames"]) == row["n_frames"] and row["frames"][0].size == (64, 64)
        assert (row["source_dataset"], row["source_case_id"], row["source_license"]) == (
            "abdomenatlas",
            row["case_id"],
            "CC-BY-NC-SA-4.0",
        )
    assert [s["dataset"] for s in json.loads((sft_out / "rl_hardset/manifest.json").read_text())["sources"]] == [
        "abdomenatlas"
    ]
    assert "| `abdomenatlas` | CC-BY-NC-SA-4.0 |" in (sft_out / "rl_hardset/README.md").read_text()
    assert (sft_out / "rl_hardset/metrics.md").read_text().count("### Table 1: lesion detection") == 2  # train, test
    assert (sft_out / "rl_hardset/README.md").is_file() and (sft_out / "rl_hardset/manifest.json").is_file()

    # A rerun finds every prediction in the store and generates nothing.
    from inference import TransformersBackend

    def no_generation(self, requests, **kwargs):
        raise AssertionError(f"unexpected generation of {len(requests)} rows")

    monkeypatch.setattr(TransformersBackend, "generate", no_generation)
    again = build_rl_hardset_flow(
        sft_dir=str(sft_out / "sft"),
        output_dir=str(sft_out),
        model_path=str(model),
        max_new_tokens=12,
        n_bootstrap=20,
        target_size=3,
    )
    assert again["rl_hardset_rows"] == summary["rl_hardset_rows"]
