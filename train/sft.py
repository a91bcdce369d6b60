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

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3VLForConditionalGeneration
from trl import SFTConfig, SFTTrainer, TrlParser

from train.data import CTQwen3VLProcessor, SFTCollator, load_split
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
    dtype: str = field(default="float32", metadata={"help": "Parameter dtype when loading: float32 | bfloat16."})


def load_policy(
    model_name_or_path: str | None, *, dtype: str = "float32", tiny_seed: int = 0
) -> tuple[Qwen3VLForConditionalGeneration, CTQwen3VLProcessor]:
    """Return (model, processor): loaded from a path/Hub id, or a freshly built tiny pair when None."""
    if model_name_or_path is None:
        processor = build_processor()
        return build_model(processor.tokenizer, seed=tiny_seed), processor
    torch_dtype = getattr(torch, dtype)
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_name_or_path, dtype=torch_dtype)
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
    model: Qwen3VLForConditionalGeneration, processor: CTQwen3VLProcessor, train_dataset: Any, args: SFTConfig
) -> SFTTrainer:
    """Freeze for SFT and return an `SFTTrainer` with the CT video collator."""
    set_stage_trainable(model, "sft")
    args.remove_unused_columns = False
    args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        processing_class=processor,
        data_collator=SFTCollator(processor),
    )


def run_sft(script_args: SftScriptArguments, training_args: SFTConfig) -> Path:
    """Train and save model + processor to `training_args.output_dir`; return that directory."""
    if script_args.dataset_dir is None:
        raise ValueError("--dataset_dir is required (a table folder such as <out>/sft).")
    model, processor = load_policy(
        script_args.model_name_or_path, dtype=script_args.dtype, tiny_seed=script_args.tiny_seed
    )
    dataset = load_split(script_args.dataset_dir, script_args.dataset_split, limit=script_args.max_train_samples)
    trainer = build_sft_trainer(model, processor, dataset, training_args)
    start = time.perf_counter()
    result = trainer.train()
    out = Path(training_args.output_dir)
    trainer.save_model(str(out))
    processor.save_pretrained(str(out))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(  # console summary of a CLI script (house style allows print here)
        f"SFT done: {trainer.state.global_step} steps in {time.perf_counter() - start:.1f} s, "
        f"train_loss={result.training_loss:.4f}, first/last logged loss="
        f"{losses[0] if losses else float('nan'):.4f}/{losses[-1] if losses else float('nan'):.4f}; saved to {out}"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry: `python -m train.sft --config YAML [--dataset_dir D] [--output_dir O] [overrides]`."""
    logging.basicConfig(level=logging.INFO)
    parser = TrlParser((SftScriptArguments, SFTConfig))
    script_args, training_args = parser.parse_args_and_config(argv)
    run_sft(script_args, training_args)


if __name__ == "__main__":
    main()
