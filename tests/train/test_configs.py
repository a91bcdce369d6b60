"""Every shipped config parses (no unknown key), keeps fp32 master weights, and launch files agree with it."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trl import GRPOConfig, SFTConfig, TrlParser

from train.checks import TrainConfigError, check_precision, validate_launch
from train.grpo import GrpoScriptArguments
from train.miniature.config import load_config
from train.miniature.suite import load_study
from train.sft import SftScriptArguments
from train.tiny.demo_sft import DemoSftArguments


CONFIGS = sorted(Path("train/configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_keeps_fp32_masters(path, tmp_path):
    if path.name.startswith("miniature"):  # not a TRL config: the miniature's own keys (MiniatureConfig, + `study:`)
        is_study = "study" in yaml.safe_load(path.read_text())
        cfg = load_study(path)[0] if is_study else load_config(path)
        assert cfg.n_test >= cfg.min_test_rows_per_class * 2 * len(cfg.organs)
        return
    kinds = {"sft_demo.yaml": (DemoSftArguments, SFTConfig)}
    kind = (SftScriptArguments, SFTConfig) if path.name.startswith("sft") else (GrpoScriptArguments, GRPOConfig)
    kind = kinds.get(path.name, kind)
    raw = yaml.safe_load(path.read_text())
    overrides = ["--output_dir", str(tmp_path)] + (["--use_cpu", "true", "--bf16", "false"] if raw.get("bf16") else [])
    script, training = TrlParser(kind).parse_args_and_config(["--config", str(path), *overrides])
    check_precision(script.dtype, lora=getattr(script, "lora_r", 0) > 0)
    assert script.dtype == "float32" or getattr(script, "lora_r", 0) > 0
    assert "reward_weights" not in raw  # weights come from emrl_data.text.scoring.ScoringConfig


@pytest.mark.parametrize("accel", ["zero2.yaml", "zero3.yaml"])
@pytest.mark.parametrize("config", ["sft.yaml", "grpo.yaml"])
def test_deepspeed_launch_configs_are_consistent(accel, config):
    acc = validate_launch(f"train/launch/{accel}", f"train/configs/{config}")
    assert acc["deepspeed_config"]["zero_stage"] == {"zero2.yaml": 2, "zero3.yaml": 3}[accel]  # the file it names


def test_single_gpu_lora_config_is_consistent(tmp_path):
    single = tmp_path / "one.yaml"
    single.write_text(yaml.safe_dump({"num_processes": 1, "mixed_precision": "bf16"}))
    assert validate_launch(single, "train/configs/grpo_lora.yaml") == {"num_processes": 1, "mixed_precision": "bf16"}
    # The same file with two processes is 128 completions per step: refused, naming the count.
    double = tmp_path / "two.yaml"
    double.write_text(yaml.safe_dump({"num_processes": 2, "mixed_precision": "bf16"}))
    with pytest.raises(TrainConfigError, match=r"= 128, not completions_per_step=64"):
        validate_launch(double, "train/configs/grpo_lora.yaml")


def test_inconsistent_launch_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "distributed_type": "DEEPSPEED",
                "deepspeed_config": {"zero_stage": 1},
                "mixed_precision": "bf16",
                "num_processes": 4,
            }
        )
    )
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(yaml.safe_dump({"dtype": "bfloat16", "bf16": True, "per_device_train_batch_size": 1}))
    with pytest.raises(
        TrainConfigError,
        match=r"zero_stage=1.*no fp32 master copy.*= 4, not completions_per_step=64 \(set gradient_accum",
    ):
        validate_launch(bad, cfg)


def _cli(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_unknown_config_key_is_one_line_error_from_the_real_cli(sft_table, tmp_path):
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("use_cpu: true\nbf16: false\nlearning_rat: 1.0e-3\n")
    proc = _cli("train.sft", "--config", str(unknown), "--dataset_dir", str(sft_table), "--output_dir", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "unknown config key" in err[0] and "learning_rat" in err[0]


def test_bad_inputs_end_in_one_line_errors(sft_table, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from train.checks import run_cli
    from train.grpo import main as grpo_main
    from train.sft import main as sft_main

    not_qwen = tmp_path / "bert"
    not_qwen.mkdir()
    (not_qwen / "config.json").write_text('{"model_type": "bert"}')
    no_columns = tmp_path / "nocols"
    (no_columns / "data").mkdir(parents=True)
    pq.write_table(pa.table({"case_id": ["a"], "n": [1]}), no_columns / "data" / "train-00000-of-00001.parquet")
    base = ["--config", "train/configs/sft_tiny.yaml", "--output_dir", str(tmp_path / "o")]
    cases = [
        (sft_main, [*base, "--dataset_dir", str(no_columns)], "lacks the columns"),
        (sft_main, [*base, "--dataset_dir", str(sft_table), "--max_frames", "4"], "more than max_frames=4"),
        (sft_main, [*base, "--dataset_dir", str(sft_table), "--model_name_or_path", str(not_qwen)], "not Qwen3-VL"),
        (sft_main, [*base, "--dataset_dir", str(sft_table), "--dtype", "bfloat16"], "no fp32 master copy"),
        (sft_main, [*base, "--dataset_dir", str(sft_table)], "--model_name_or_path is required"),
        (
            grpo_main,
            [
                "--config",
                "train/configs/grpo_tiny.yaml",
                "--output_dir",
                str(tmp_path / "g"),
                "--dataset_dir",
                str(sft_table),
                "--model_name_or_path",
                str(not_qwen),
            ],
            "not Qwen3-VL",
        ),
        (
            grpo_main,
            [
                "--config",
                "train/configs/grpo_tiny.yaml",
                "--output_dir",
                str(tmp_path / "g"),
                "--dataset_dir",
                str(no_columns),
                "--model_name_or_path",
                str(not_qwen),
            ],
            "not Qwen3-VL",
        ),
    ]
    for main, args, needle in cases:
        with pytest.raises(SystemExit) as exc:
            run_cli(main, args)
        assert exc.value.code == 2
        stderr = capsys.readouterr().err
        err = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert "Traceback" not in stderr
        assert len(err) == 1 and needle in err[0], (args, err)


def test_memory_table_in_docs_is_the_scripts_output():
    from train.tools.memory_plan import markdown, plan

    assert markdown() in Path("docs/training.md").read_text()
    full_one_gpu, zero2, zero3, lora, lora_vllm = plan()
    assert full_one_gpu["path"].startswith("1 GPU, full") and not full_one_gpu["fits_141"]  # the paper needs GPUs
    assert zero2["fits_141"] and zero3["fits_80"]
    assert lora["path"].startswith("1 GPU, LoRA") and lora["fits_80"]
    assert "rollouts on vLLM" in lora_vllm["path"] and lora_vllm["fits_141"]


def test_memory_plan_counts_what_runs():
    from train.tools.memory_plan import GIB, parameter_counts, plan

    c = parameter_counts()
    total, trainable = (c["vit"] + c["projector"] + c["llm"]) / GIB, (c["projector"] + c["llm"]) / GIB
    full_one_gpu, zero2, zero3, lora, lora_vllm = plan(8)
    # DeepSpeed keeps the bf16 gradient partition and its fp32 copy: 6 bytes per trainable parameter / 8.
    assert zero2["gradients"] == pytest.approx(6 * trainable / 8) == zero3["gradients"]
    assert zero2["reference"] == pytest.approx(2 * total) == full_one_gpu["reference"]  # bf16 reference
    assert zero3["reference"] == pytest.approx(2 * total / 8)
    assert zero3["gather"] == pytest.approx(2 * total * 7 / 8) and zero2["gather"] == 0  # ds3_gather_for_generation
    assert zero2["host_gib_per_node"] == pytest.approx(8 * 2 * total) and zero3["host_gib_per_node"] == 0
    assert zero2["host_gib_per_node_before"] == pytest.approx(8 * 8 * total)  # fp32 policy + fp32 reference per rank


def test_memory_plan_counts_generation_as_it_runs():
    from train.tools.memory_plan import GIB, Shape, parameter_counts, plan, rows_per_generate_call, vllm_fraction

    c = parameter_counts()
    # grpo.yaml: 1 x accumulation 8 per GPU; grpo_lora.yaml: 1 x accumulation 64 (one generate call holds them all)
    assert rows_per_generate_call("grpo.yaml") == 8 and rows_per_generate_call("grpo_lora.yaml") == 64
    prompt_tokens = 16 * 196 + 16 * 6 + 400  # 16 frame pairs of 14x14 merged tokens, their stamps, the text
    kv_row = 2 * c["layers"] * c["kv_dim"] * 2 * (prompt_tokens + 512)  # bf16 K and V of every layer
    full_one_gpu, zero2, zero3, lora, lora_vllm = plan(8)
    assert [r["rows_per_call"] for r in plan(8)] == [8, 8, 8, 64, 64]
    assert zero2["kv_cache"] == pytest.approx(8 * kv_row / GIB) and lora["kv_cache"] == pytest.approx(
        64 * kv_row / GIB
    )
    assert 36 < lora["kv_cache"] < 37  # ≈36 GiB for the LoRA path's 64 rows
    total = c["vit"] + c["projector"] + c["llm"]
    fraction = vllm_fraction(c, 64, 139.0, Shape())
    assert fraction == pytest.approx(-(-(2 * total + 64 * kv_row) / GIB * 100 // 139) / 100)
    assert lora_vllm["vllm"] == pytest.approx(fraction * 139) and lora_vllm["kv_cache"] == 0  # vLLM holds the KV
    assert lora_vllm["gather"] == 0 and zero3["gather"] > 0
    assert lora_vllm["total"] == pytest.approx(lora["total"] - lora["kv_cache"] + lora_vllm["vllm"])


def test_reference_model_is_bf16_when_compute_is_bf16(processor, tmp_path):
    from train.grpo import make_grpo_config

    args = make_grpo_config(processor, ["r_e"], output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert not (args.model_init_kwargs or {}).get("dtype")  # CPU fp32 runs keep TRL's default (the policy's dtype)
    args.bf16 = True
    from train.grpo import finalize_grpo_config

    assert finalize_grpo_config(args, processor, ["r_e"]).model_init_kwargs == {"dtype": "bfloat16"}
