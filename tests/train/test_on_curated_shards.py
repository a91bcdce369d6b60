"""One SFT step and one GRPO step on shards produced by the real `build-sft-set` flow from a synthetic atlas."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
from emrl_data.types import Organ
from flows.build_sft_set import build_sft_set_flow
from train.grpo import main as grpo_main
from train.sft import main as sft_main


@pytest.fixture(scope="module")
def curated(prefect_harness, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("atlas")
    lesions = (
        LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 10.0), "hypo"),
        LesionSpec(Organ.KIDNEY, "left", (8.0, 8.0, 8.0), "hyper"),
    )
    write_atlas(root, [CaseSpec(f"BDMAP_0000000{i}", shape=(96, 80, 32), lesions=lesions, seed=i) for i in (1, 2)])
    out = tmp_path_factory.mktemp("out")
    # Small frames keep the CPU step short; the layout and columns are the real ones.
    build_sft_set_flow(
        atlas_root=str(root), output_dir=str(out), config={"frames": {"frame_size_px": 64, "max_frames": 8}}
    )
    return out


@pytest.mark.slow
def test_sft_step_on_curated_shards(curated: Path, tiny_dir: Path, tmp_path: Path) -> None:
    (shard,) = (curated / "sft/data").glob("train-*.parquet")
    assert pq.read_table(shard).num_rows >= 2
    out = tmp_path / "sft"
    sft_main(
        [
            "--config",
            "train/configs/sft_tiny.yaml",
            "--dataset_dir",
            str(curated / "sft"),
            "--output_dir",
            str(out),
            "--model_name_or_path",
            str(tiny_dir),
            "--max_steps",
            "1",
        ]
    )
    assert (out / "config.json").is_file()


@pytest.mark.slow
def test_grpo_step_on_curated_shards(curated: Path, tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "grpo"
    grpo_main(
        [
            "--config",
            "train/configs/grpo_tiny.yaml",
            "--dataset_dir",
            str(curated / "sft"),
            "--model_name_or_path",
            str(tiny_dir),
            "--output_dir",
            str(out),
            "--max_steps",
            "1",
            "--max_completion_length",
            "8",
        ]
    )
    assert (out / "reward_curve.png").exists()
