"""Saved checkpoints reload and generate; the SFT CLI runs end to end on a parquet table; GRPO CLI with scoring."""

import json

import numpy as np
import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from model_io.processor import CTQwen3VLProcessor, user_messages
from train.sft import main as sft_main


@pytest.mark.slow
def test_sft_cli_then_checkpoint_reloads_and_generates(sft_table, tiny_dir, tmp_path):
    out = tmp_path / "sft"
    sft_main(
        [
            "--config",
            "train/configs/sft_tiny.yaml",
            "--dataset_dir",
            str(sft_table),
            "--output_dir",
            str(out),
            "--model_name_or_path",
            str(tiny_dir),
            "--max_steps",
            "2",
        ]
    )
    model = Qwen3VLForConditionalGeneration.from_pretrained(out)
    proc = CTQwen3VLProcessor.from_pretrained(out)
    frames = np.random.default_rng(0).integers(0, 256, (8, 64, 64), dtype=np.uint8)
    inputs = proc.apply_chat_template(
        [user_messages("Report.", frames)],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        gen = model.generate(**inputs, max_new_tokens=5, do_sample=False, suppress_tokens=proc.vision_token_ids)
    assert gen.shape == (1, inputs["input_ids"].shape[1] + 5)
    assert not set(gen[0, inputs["input_ids"].shape[1] :].tolist()) & set(proc.vision_token_ids)


@pytest.mark.parametrize("step_logs", ["true", "false"])
@pytest.mark.slow
def test_step_logs_false_keeps_the_metrics_but_not_the_console_dicts(sft_table, tiny_dir, tmp_path, capsys, step_logs):
    """`step_logs: false` (the demo's configs): no per-step metric dict on the console, the same log history on disk."""
    out = tmp_path / "sft"
    sft_main(
        [
            "--config",
            "train/configs/sft_tiny.yaml",
            "--dataset_dir",
            str(sft_table),
            "--output_dir",
            str(out),
            "--model_name_or_path",
            str(tiny_dir),
            "--max_steps",
            "2",
            "--logging_steps",
            "1",
            "--step_logs",
            step_logs,
        ]
    )
    printed = capsys.readouterr().out
    assert printed.count("{'loss': ") == (2 if step_logs == "true" else 0)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in history if "loss" in h] == [1, 2]
    assert "SFT done: 2 steps" in printed


@pytest.mark.slow
def test_grpo_cli_all_rewards(sft_table, tiny_dir, tmp_path, capsys):
    pytest.importorskip("emrl_data.text.scoring")
    from train.grpo import main as grpo_main

    out = tmp_path / "grpo"
    grpo_main(
        [
            "--config",
            "train/configs/grpo_tiny.yaml",
            "--dataset_dir",
            str(sft_table),
            "--model_name_or_path",
            str(tiny_dir),
            "--output_dir",
            str(out),
            "--max_steps",
            "1",
            "--max_completion_length",
            "8",
            "--step_logs",
            "false",
        ]
    )
    assert "{'loss': " not in capsys.readouterr().out  # logging_steps 1, but step_logs false: no console dict
    assert (out / "reward_curve.png").exists()
    Qwen3VLForConditionalGeneration.from_pretrained(out)
    # A GRPO checkpoint is a standard Qwen3-VL one too (the full check is in test_standard_checkpoint.py).
    for name in (
        "processor_config.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
    ):
        assert json.loads((out / name).read_text())["processor_class"] == "Qwen3VLProcessor", name
    video = json.loads((out / "processor_config.json").read_text())["video_processor"]
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor" and video["do_sample_frames"] is False


@pytest.mark.slow
def test_device_check_tiny(tmp_path):
    from train.tools.device_check import main as dc_main

    out = tmp_path / "dc.json"
    dc_main(["--tiny", "--output", str(out)])  # asserts inside: finite loss, gradients, parameter groups
    (line,) = out.read_text().splitlines()  # one JSON line
    data = json.loads(line)
    assert data["shape"] == "tiny"
    assert data["sft"]["grad_norm"] > 0 and all(g > 0 for g in data["grpo"]["grad_norm"])
    assert set(data["sft"]["changed"]) == {"vit", "projector"}
    assert {"projector", "llm"} <= set(data["grpo"]["changed"]) and "vit" in data["grpo"]["unchanged"]
    assert len(data["grpo"]["step_s"]) == 1 and data["grpo"]["gradient_accumulation_steps"] == 2
    assert data["grpo"]["verifier_queries"] >= 1 and data["grpo"]["r_c"][0] is not None  # r_c in the loop
    assert data["grpo"]["kl"] == [0.0]  # the reference (adapters disabled) ran; one step: policy == reference
    assert data["plan_8b"]["trainable_m"] == {"lora": 174.6, "projector": 160.5} and data["plan_8b"]["planned_gib"] > 0
    assert data["auto_processor"]["skipped"].startswith("--tiny (CPU): torchvision cannot be imported")


def test_run_minus_control_is_the_mean_gap_with_its_welch_standard_error():
    from train.grpo_report import run_minus_control

    run = [(1, 0.1), (2, 0.3), (3, 0.2)]  # mean 0.2, sample variance 0.01
    control = [(1, 0.0), (2, 0.2)]  # mean 0.1, sample variance 0.02
    gap, error = run_minus_control(run, control)
    assert gap == pytest.approx(0.1)
    assert error == pytest.approx((0.01 / 3 + 0.02 / 2) ** 0.5)
    assert run_minus_control(run, control[:1]) is None  # one step has no spread: no error to state
