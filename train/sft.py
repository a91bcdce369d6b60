"""E-MRL stage 1: SFT of Qwen3-VL on the `sft` shards, vision encoder + projector only (docs/contract.md#training-recipe).

The CT frames are one video per row (`model_io.video`, batched by `train.data`); the loss is on the assistant report
(and `<|im_end|>`) only; the LLM is frozen but gradients flow through it to the ViT, so activation checkpointing is on
(non-reentrant).

    python -m train.sft --config train/configs/sft_tiny.yaml --dataset_dir <out>/sft --model_name_or_path <ckpt> \
        --output_dir <dir>
    accelerate launch --config_file train/launch/zero2.yaml -m train.sft --config train/configs/sft.yaml \
        --dataset_dir <out>/sft --model_name_or_path Qwen/Qwen3-VL-8B-Instruct --output_dir <dir>

The saved directory reloads with `Qwen3VLForConditionalGeneration.from_pretrained(dir)` and
`model_io.processor.CTQwen3VLProcessor.from_pretrained(dir)` (`model_io.processor.load_model_and_processor`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3VLForConditionalGeneration
from trl import SFTConfig, SFTTrainer

from model_io.processor import CTQwen3VLProcessor
from train.checks import (
    TrainConfigError,
    bar_only,
    check_columns,
    check_frames,
    check_precision,
    check_qwen3_vl_checkpoint,
    config_dict,
    max_frames_in,
    require_fp32_trainable,
    run_cli,
)
from train.data import SFTCollator, load_split
from train.distributed import add_rank_report, policy_load_kwargs
from train.entry import train_main
from train.freeze import set_stage_trainable


logger = logging.getLogger(__name__)


@dataclass
class SftScriptArguments:
    """Our knobs beside TRL's `SFTConfig` (one YAML holds both)."""

    dataset_dir: str | None = field(default=None, metadata={"help": "Table folder in the Hub layout, e.g. <out>/sft."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Local path or Hub id of a Qwen3-VL checkpoint (required)."}
    )
    dataset_split: str = field(default="train", metadata={"help": "Shard split to train on."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N rows."})
    dtype: str = field(
        default="float32",
        metadata={"help": "Weight dtype: float32 only (fp32 master weights); bf16 compute is `bf16: true`."},
    )
    max_frames: int = field(default=64, metadata={"help": "Refuse rows with more frames (the context budget)."})
    samples_per_step: int | None = field(
        default=None,
        metadata={"help": "Processes x per-device batch x accumulation must equal this (checked at launch)."},
    )
    step_logs: bool = field(
        default=True,
        metadata={
            "help": "Print each logged step's metrics (always kept in trainer_state.json); the demo sets false."
        },
    )


def load_policy(
    model_name_or_path: str, *, dtype: str = "float32"
) -> tuple[Qwen3VLForConditionalGeneration, CTQwen3VLProcessor]:
    """Return (model, processor) loaded from a local path or Hub id, checked to be a Qwen3-VL checkpoint."""
    check_precision(dtype)
    check_qwen3_vl_checkpoint(model_name_or_path)
    torch_dtype = getattr(torch, dtype)
    model = Qwen3VLForConditionalGeneration.from_pretrained(
        model_name_or_path, dtype=torch_dtype, **policy_load_kwargs()
    )
    return model, CTQwen3VLProcessor.from_pretrained(model_name_or_path)


def make_sft_config(**overrides: Any) -> SFTConfig:
    """Return an `SFTConfig` with the settings our collator needs, plus `overrides`."""
    base: dict[str, Any] = {
        "remove_unused_columns": False,
        "dataset_kwargs": {"skip_prepare_dataset": True},
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "report_to": "none",
    }
    base.update(overrides)
    return SFTConfig(**base)


def build_sft_trainer(
    model: Qwen3VLForConditionalGeneration,
    processor: CTQwen3VLProcessor,
    train_dataset: Any,
    args: SFTConfig,
    stage: str = "sft",
    frame_px: int | None = None,
) -> SFTTrainer:
    """Freeze for SFT (or `stage`) and return an `SFTTrainer` with the CT video collator.

    Raises:
        TrainConfigError: when a trainable parameter is not fp32 (no master copy).
    """
    set_stage_trainable(model, stage)
    require_fp32_trainable(model)
    args.remove_unused_columns = False
    args.dataset_kwargs = {**config_dict(args.dataset_kwargs, "dataset_kwargs"), "skip_prepare_dataset": True}
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        processing_class=processor,
        data_collator=SFTCollator(processor, frame_px=frame_px),  # type: ignore[arg-type]  # returns a BatchFeature
    )


def load_sft_rows(script_args: SftScriptArguments) -> Any:
    """Load the training split and check its columns and frame counts.

    Raises:
        ValueError: without `dataset_dir`.
        TrainConfigError: on a missing column, too many frames or a dtype other than float32.
    """
    if script_args.dataset_dir is None:
        raise ValueError("--dataset_dir is required (a table folder such as <out>/sft).")
    check_precision(script_args.dtype)
    dataset = load_split(script_args.dataset_dir, script_args.dataset_split, limit=script_args.max_train_samples)
    check_columns(script_args.dataset_dir, dataset.column_names, "sft")
    check_frames(max_frames_in(dataset), script_args.max_frames)
    return dataset


def train_sft(
    model: Qwen3VLForConditionalGeneration,
    processor: CTQwen3VLProcessor,
    dataset: Any,
    training_args: SFTConfig,
    *,
    step_logs: bool = True,
) -> Path:
    """Train and save model + processor (+ `trainer_state.json`) to `training_args.output_dir`; return it."""
    start = time.perf_counter()
    trainer = build_sft_trainer(model, processor, dataset, training_args)
    if not step_logs:
        bar_only(trainer)
    add_rank_report(trainer)
    result = trainer.train()
    out = Path(str(training_args.output_dir))  # TrainingArguments always sets it
    trainer.save_model(str(out))  # the main process alone writes the weights and `processor.save_pretrained`
    trainer.save_state()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(  # console summary of a CLI script (house style allows print here)
        f"SFT done: {trainer.state.global_step} steps in {time.perf_counter() - start:.1f} s, "
        f"train_loss={result.training_loss:.4f}, first/last logged loss="
        f"{losses[0] if losses else float('nan'):.4f}/{losses[-1] if losses else float('nan'):.4f}; saved to {out}"
    )
    return out


def run_sft(script_args: SftScriptArguments, training_args: SFTConfig) -> Path:
    """Load the rows and the checkpoint, train, save; return the output folder.

    Raises:
        TrainConfigError: without `model_name_or_path`.
    """
    dataset = load_sft_rows(script_args)
    if script_args.model_name_or_path is None:
        raise TrainConfigError(
            "--model_name_or_path is required (a Qwen3-VL checkpoint folder or Hub id; "
            "python -m train.tiny.model --output_dir D writes a tiny one for a try on CPU)."
        )
    model, processor = load_policy(script_args.model_name_or_path, dtype=script_args.dtype)
    return train_sft(model, processor, dataset, training_args, step_logs=script_args.step_logs)


def main(argv: list[str] | None = None) -> None:
    """CLI entry: `python -m train.sft --config YAML [--dataset_dir D] [--output_dir O] [overrides]`."""
    train_main("sft", SftScriptArguments, SFTConfig, run_sft, argv)


if __name__ == "__main__":
    run_cli(main)
