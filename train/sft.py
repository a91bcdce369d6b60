"""E-MRL stage 1: SFT of Qwen3-VL on the `sft` shards, vision encoder + projector only (SPEC §9).

The CT frames are one video per row (`train.data`); the loss is on the assistant report (and `<|im_end|>`) only; the
LLM is frozen but gradients flow through it to the ViT, so activation checkpointing is on (non-reentrant).

    python -m train.sft --config train/configs/sft_tiny.yaml --dataset_dir <out>/sft --output_dir <dir>
    accelerate launch --config_file train/launch/zero2.yaml -m train.sft --config train/configs/sft.yaml \
        --dataset_dir <out>/sft --model_name_or_path Qwen/Qwen3-VL-8B-Instruct --output_dir <dir>

The saved directory reloads with `Qwen3VLForConditionalGeneration.from_pretrained(dir)` and
`train.data.CTQwen3VLProcessor.from_pretrained(dir)` (`train.data.load_model_and_processor`).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3VLForConditionalGeneration
from trl import SFTConfig, SFTTrainer

from train.checks import (
    TrainConfigError,
    bar_only,
    check_columns,
    check_frames,
    check_precision,
    check_qwen3_vl_checkpoint,
    max_frames_in,
    require_fp32_trainable,
    run_cli,
)
from train.data import CTQwen3VLProcessor, SFTCollator, load_split
from train.distributed import add_rank_report, policy_load_kwargs
from train.entry import train_main
from train.freeze import set_stage_trainable
from train.tiny import build_model, build_processor


logger = logging.getLogger(__name__)


@dataclass
class SftScriptArguments:
    """Our knobs beside TRL's `SFTConfig` (one YAML holds both)."""

    dataset_dir: str | None = field(default=None, metadata={"help": "Table folder in the Hub layout, e.g. <out>/sft."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Local path or Hub id of a Qwen3-VL checkpoint; None builds a tiny model."}
    )
    dataset_split: str = field(default="train", metadata={"help": "Shard split to train on."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N rows."})
    tiny_seed: int = field(default=0, metadata={"help": "Seed of the tiny model built when no model is given."})
    dtype: str = field(
        default="float32",
        metadata={"help": "Weight dtype: float32 only (fp32 master weights); bf16 compute is `bf16: true`."},
    )
    lm_warmup_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the LM warm-up (default: learning_rate)."}
    )
    lm_warmup_frame_px: int = field(
        default=0, metadata={"help": "Frame side during the LM warm-up (smaller = cheaper); 0 keeps the frames."}
    )
    max_frames: int = field(default=64, metadata={"help": "Refuse rows with more frames (the context budget)."})
    lm_warmup_steps: int = field(
        default=0,
        metadata={"help": "Demo only (not the paper): full-model steps on the reports before the SFT freezing."},
    )
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
    lm_warmup_target_parse_rate: float = field(
        default=0.0,
        metadata={
            "help": "> 0: the warm-up stops once this held-out parse rate is reached (train.warmup; lm_warmup_steps is "
            "then the cap, an error when reached first); 0: a fixed lm_warmup_steps."
        },
    )
    lm_warmup_target_sampled_parse_rate: float = field(
        default=0.0,
        metadata={"help": "With the criterion: also this parse rate of reports sampled at temperature 1 (0 = off)."},
    )
    lm_warmup_eval_every: int = field(default=50, metadata={"help": "Warm-up steps between criterion checks."})
    lm_warmup_val_rows: int = field(
        default=8, metadata={"help": "Train rows held out of the warm-up for its criterion (evenly spaced)."}
    )
    lm_warmup_verifier_task: bool = field(
        default=True, metadata={"help": "The criterion warm-up also teaches the verifier task (r_c needs it)."}
    )
    parse_rate_split: str | None = field(
        default=None, metadata={"help": "After SFT, print the greedy parse rate of this split (e.g. test)."}
    )


def load_policy(
    model_name_or_path: str | None, *, dtype: str = "float32", tiny_seed: int = 0
) -> tuple[Qwen3VLForConditionalGeneration, CTQwen3VLProcessor]:
    """Return (model, processor): loaded from a path/Hub id, or a freshly built tiny pair when None."""
    check_precision(dtype)
    if model_name_or_path is None:
        processor = build_processor()
        return build_model(processor.tokenizer, seed=tiny_seed), processor
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
    args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        processing_class=processor,
        data_collator=SFTCollator(processor, frame_px=frame_px),
    )


def _lm_warmup(
    model: Any,
    processor: CTQwen3VLProcessor,
    dataset: Any,
    args: SFTConfig,
    steps: int,
    frame_px: int,
    lr: float | None = None,
    step_logs: bool = True,
) -> float:
    """Demo stage: train every part of the model `steps` steps on the reports (frames at frame_px²); last loss."""
    warm = copy.deepcopy(args)
    warm.max_steps, warm.output_dir, warm.save_strategy = steps, str(Path(args.output_dir) / "lm_warmup"), "no"
    warm.learning_rate = lr if lr is not None else args.learning_rate
    trainer = build_sft_trainer(model, processor, dataset, warm, stage="lm_warmup", frame_px=frame_px or None)
    if not step_logs:
        bar_only(trainer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    del trainer
    return losses[-1] if losses else float("nan")


def run_sft(script_args: SftScriptArguments, training_args: SFTConfig) -> Path:
    """Train and save model + processor (+ `trainer_state.json`) to `training_args.output_dir`; return it."""
    if script_args.dataset_dir is None:
        raise ValueError("--dataset_dir is required (a table folder such as <out>/sft).")
    check_precision(script_args.dtype)
    dataset = load_split(script_args.dataset_dir, script_args.dataset_split, limit=script_args.max_train_samples)
    check_columns(script_args.dataset_dir, dataset.column_names, "sft")
    check_frames(max_frames_in(dataset), script_args.max_frames)
    model, processor = load_policy(
        script_args.model_name_or_path, dtype=script_args.dtype, tiny_seed=script_args.tiny_seed
    )
    start = time.perf_counter()
    if script_args.lm_warmup_steps > 0 and script_args.lm_warmup_target_parse_rate > 0:
        _criterion_warmup(model, processor, dataset, script_args, training_args)
    elif script_args.lm_warmup_steps > 0:
        warm_loss = _lm_warmup(model, processor, dataset, training_args, script_args.lm_warmup_steps,
                               script_args.lm_warmup_frame_px, script_args.lm_warmup_learning_rate,
                               script_args.step_logs)  # fmt: skip
        print(f"LM warm-up (demo only): {script_args.lm_warmup_steps} full-model steps, last loss {warm_loss:.4f}")
    trainer = build_sft_trainer(model, processor, dataset, training_args)
    if not script_args.step_logs:
        bar_only(trainer)
    add_rank_report(trainer)
    result = trainer.train()
    out = Path(training_args.output_dir)
    trainer.save_model(str(out))
    trainer.save_state()
    processor.save_pretrained(str(out))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(  # console summary of a CLI script (house style allows print here)
        f"SFT done: {trainer.state.global_step} steps in {time.perf_counter() - start:.1f} s, "
        f"train_loss={result.training_loss:.4f}, first/last logged loss="
        f"{losses[0] if losses else float('nan'):.4f}/{losses[-1] if losses else float('nan'):.4f}; saved to {out}"
    )
    if script_args.parse_rate_split:
        _print_parse_rate(model, processor, script_args.dataset_dir, script_args.parse_rate_split)
    return out


def _criterion_warmup(
    model: Any, processor: Any, dataset: Any, script_args: SftScriptArguments, args: SFTConfig
) -> None:
    """Run `train.warmup.lm_warmup` on the train rows minus `lm_warmup_val_rows` evenly spaced ones (its criterion's
    rows: shards are often sorted by organ, so the last rows would all be one organ)."""
    from train.warmup import held_out_indices, lm_warmup  # noqa: PLC0415

    n_val = script_args.lm_warmup_val_rows
    if len(dataset) <= n_val:
        raise TrainConfigError(
            f"{script_args.dataset_dir}: {len(dataset)} train rows leave none for the warm-up beside "
            f"lm_warmup_val_rows={n_val}; lower lm_warmup_val_rows or add rows"
        )
    rows = [dict(r) for r in dataset]
    val = set(held_out_indices(len(rows), n_val))
    train_rows, val_rows = [r for i, r in enumerate(rows) if i not in val], [rows[i] for i in sorted(val)]
    result = lm_warmup(
        model, processor, train_rows, val_rows, max_steps=script_args.lm_warmup_steps,
        learning_rate=script_args.lm_warmup_learning_rate or args.learning_rate,
        batch_size=args.per_device_train_batch_size, eval_every=script_args.lm_warmup_eval_every,
        target_parse_rate=script_args.lm_warmup_target_parse_rate,
        target_sampled_parse_rate=script_args.lm_warmup_target_sampled_parse_rate, seed=args.seed,
        verifier_task=script_args.lm_warmup_verifier_task,
    )  # fmt: skip
    sampled = f", sampled {result.sampled_parse_rate:.0%}" if result.sampled_parse_rates else ""
    print(
        f"LM warm-up (demo only): {result.steps} full-model steps in {result.seconds:.0f} s, held-out parse rate "
        f"{result.parse_rate:.0%}{sampled} (target {script_args.lm_warmup_target_parse_rate:.0%})",
        flush=True,
    )


def _print_parse_rate(model: Any, processor: Any, dataset_dir: str, split: str) -> None:
    """Print the greedy parse rate of the saved model on `split` (one line)."""
    from train.warmup import report_parse_rate  # noqa: PLC0415

    rows = [dict(r) for r in load_split(dataset_dir, split)]
    rate, _ = report_parse_rate(model, processor, rows)
    print(f"SFT parse rate on the {split} split: {round(rate * len(rows))}/{len(rows)} reports parse ({rate:.0%})")


def main(argv: list[str] | None = None) -> None:
    """CLI entry: `python -m train.sft --config YAML [--dataset_dir D] [--output_dir O] [overrides]`."""
    train_main("sft", SftScriptArguments, SFTConfig, run_sft, argv)


if __name__ == "__main__":
    run_cli(main)
