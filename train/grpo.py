"""E-MRL stage 2: GRPO of Qwen3-VL with the rewards r_e, r_f, r_c (docs/contract.md#scoring, docs/contract.md#training-recipe, docs/training.md).

The recipe and the entry point: the paper's hyperparameters (`GRPO_RECIPE`), the configuration the video trainer
needs (`finalize_grpo_config`), the policy loaded and frozen for GRPO (projector and LLM train, the ViT is frozen; LoRA
optional), the reward terms the config names (`train.rewards` registry), and the run with its optional
learning-rate-0 control. The trainer itself, TRL's `GRPOTrainer` with the CT video, is
`train.grpo_trainer.VideoGRPOTrainer`; what a run reports, `train.grpo_report`.

    python -m train.grpo --config train/configs/grpo_tiny.yaml --dataset_dir <out>/rl_hardset \
        --model_name_or_path <sft dir> --output_dir <dir>
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3VLForConditionalGeneration
from trl import GRPOConfig

from emrl_data.text.scoring import ScoringConfig
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
from train.data import load_split, to_grpo_dataset
from train.distributed import add_rank_report, policy_load_kwargs
from train.entry import train_main
from train.freeze import set_stage_trainable
from train.grpo_report import reward_curve, save_reward_curve_png, summary_lines
from train.grpo_trainer import VideoGRPOTrainer
from train.rewards import (
    REWARD_NAMES,
    Verifier,
    check_reward_entries,
    make_reward_funcs,
    reward_weights_for,
    weighable,
)


@dataclass
class GrpoScriptArguments:
    """Our knobs beside TRL's `GRPOConfig` (one YAML holds both)."""

    dataset_dir: str | None = field(default=None, metadata={"help": "Table folder, e.g. <out>/rl_hardset."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "SFT checkpoint (local path or Hub id)."})
    dataset_split: str = field(default="train", metadata={"help": "Shard split to train on."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N rows."})
    rewards: list[str] = field(
        default_factory=lambda: ["r_e", "r_f", "r_c"],
        metadata={
            "help": "GRPO's reward terms by name (train.rewards.REWARD_TERMS), each name or name=weight; the "
            "terms of R (r_e, r_f, r_c) weigh as ScoringConfig says; a training-only term needs its weight; "
            "package.module.name imports the module registering it. Ablations: [r_e] | [r_e, r_f]."
        },
    )
    verifier_max_new_tokens: int = field(default=128, metadata={"help": "Greedy tokens of the verifier answer."})
    box_weight: float = field(default=0.0, metadata={"help": "r_c box term weight (ablation; 0 = paper's r_c)."})
    negative_rows: str = field(
        default="skip",
        metadata={
            "help": "r_c on true negatives: skip (None, the paper) | query_named_slice (the verifier is shown the "
            "frame a false positive names; docs/contract.md#scoring)."
        },
    )
    cross_view: str = field(
        default="full",
        metadata={
            "help": "r_c's view: full (the paper) | distance_only (the window term alone, no verifier) | "
            "random_frame (the verifier sees another row's frame: a blind control)."
        },
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "Weight dtype: float32 (fp32 masters); bfloat16 only for the frozen base of the LoRA path."},
    )
    lora_r: int = field(default=0, metadata={"help": "0 = full parameters (paper); > 0 = LoRA rank on the LLM."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (LoRA path only)."})
    max_frames: int = field(default=64, metadata={"help": "Refuse rows with more frames (the context budget)."})
    lr0_control: bool = field(
        default=False, metadata={"help": "Also run a learning-rate-0 control on the same prompts and plot both."}
    )
    reward_curve_png: str | None = field(default=None, metadata={"help": "Default: <output_dir>/reward_curve.png."})
    completions_per_step: int | None = field(
        default=None,
        metadata={"help": "Processes x per-device batch x accumulation must equal this (checked at launch)."},
    )
    rollout_seed: str = field(
        default="global",
        metadata={
            "help": "global: the process's generator; prompt: seeded by (seed, step, prompts), so rollouts "
            "do not depend on the number of processes (train.distributed.prompt_seeded_rng)."
        },
    )
    step_logs: bool = field(
        default=True,
        metadata={
            "help": "Print each logged step's metrics (always kept in trainer_state.json); the demo sets false."
        },
    )

    def __post_init__(self) -> None:
        self.scoring_config()  # a bad r_c option is a one-line error at parse time
        try:
            check_reward_entries(self.rewards)  # so is an unknown reward term, or one without a weight
        except ValueError as exc:
            raise TrainConfigError(f"GRPO rewards: {exc}") from None

    def scoring_config(self) -> ScoringConfig:
        """Return the `ScoringConfig` of these options (weights and λ stay its defaults: the one table).

        Raises:
            TrainConfigError: naming the option and its allowed values.
        """
        try:
            return ScoringConfig(
                box_weight=self.box_weight, negative_rows=self.negative_rows, cross_view=self.cross_view
            )
        except ValueError as exc:
            raise TrainConfigError(f"GRPO option {exc}") from None


# The paper's GRPO hyperparameters (docs/contract.md#training-recipe), stated once: the defaults of `make_grpo_config`,
# and what train/configs/grpo.yaml ships (grpo_lora.yaml too, but for its accumulation); tests/train/test_grpo_recipe.py
# checks the shipped configs against it.
GRPO_RECIPE: Mapping[str, Any] = MappingProxyType(
    {
        "num_generations": 8,  # group size
        "beta": 0.01,  # KL to the SFT reference
        "learning_rate": 5e-6,
        "optim": "adamw_torch",
        "gradient_accumulation_steps": 8,  # x 1 row x 8 GPUs = 64 completions = 8 prompts x 8 per step
        "num_train_epochs": 5,
        "loss_type": "grpo",
        "report_to": "none",
    }
)


def make_grpo_config(processor: CTQwen3VLProcessor, rewards: list[str], **overrides: Any) -> GRPOConfig:
    """Return a `GRPOConfig` with the paper defaults (docs/contract.md#training-recipe), our required settings and `overrides`.

    The reward weights are the entries' own (`name=weight`), else `ScoringConfig`'s (`reward_weights_for`), unless
    `overrides` gives one per reward.
    """
    base: dict[str, Any] = {**GRPO_RECIPE, **overrides}
    base["reward_weights"] = reward_weights_for(rewards, base.get("reward_weights"))
    return finalize_grpo_config(GRPOConfig(**base), processor, rewards)


def finalize_grpo_config(args: GRPOConfig, processor: CTQwen3VLProcessor, rewards: list[str]) -> GRPOConfig:
    """Set what the video trainer needs: keep every column, suppress the vision tokens, weights per reward, and a bf16
    reference model when `bf16` compute is on (half the memory of TRL's default, the policy's fp32; bf16 autocast
    rounds the matmul weights to bf16 anyway).

    `rewards` are reward entries (`train.rewards.make_reward_funcs`) or the names of explicit callables; when every
    one has a known weight (its own, or ScoringConfig's for a term of R) the weights are `reward_weights_for`'s, else
    `reward_weights` stays as given (None: TRL weighs each 1).

    Raises:
        ValueError: when `reward_weights` is given with a length other than the number of rewards.
    """
    args.remove_unused_columns = False
    if args.bf16 and args.beta > 0:  # TRL builds the frozen reference in the policy's dtype (fp32) unless told
        args.model_init_kwargs = {**config_dict(args.model_init_kwargs, "model_init_kwargs"), "dtype": "bfloat16"}
    gen = config_dict(args.generation_kwargs, "generation_kwargs")
    gen["suppress_tokens"] = sorted(set(gen.get("suppress_tokens", [])) | set(processor.vision_token_ids))
    args.generation_kwargs = gen
    if all(weighable(r) for r in rewards):
        args.reward_weights = reward_weights_for(rewards, args.reward_weights)
    elif args.reward_weights is not None and len(args.reward_weights) != len(rewards):
        raise ValueError(
            f"reward_weights={args.reward_weights} needs one weight per reward function ({len(rewards)})."
        )
    return args


def _apply_lora(model: Any, r: int, alpha: int) -> Any:
    """Wrap the LLM's linear layers with LoRA (rank r); the projector trains in full (peft `modules_to_save`)."""
    deepstack = model.model.visual.deepstack_merger_list  # a ModuleList: wrap its members, not the list
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
        modules_to_save=["merger", *(f"deepstack_merger_list.{i}" for i in range(len(deepstack)))],
    )
    peft_model = get_peft_model(model, config)
    for param in peft_model.parameters():  # adapters and projector copies: fp32 masters over a bf16 frozen base
        if param.requires_grad:
            param.data = param.data.float()
    return peft_model


def build_grpo_trainer(
    model_path: str,
    train_dataset: Any,
    args: GRPOConfig,
    *,
    rewards: list[str] | None = None,
    reward_funcs: list[Any] | None = None,
    verifier_max_new_tokens: int = 128,
    dtype: str = "float32",
    scoring_config: ScoringConfig | None = None,
    lora_r: int = 0,
    lora_alpha: int = 32,
) -> VideoGRPOTrainer:
    """Load the policy from `model_path`, freeze for GRPO and return the trainer.

    The model is loaded from a path (not passed as a built object) because TRL builds the β > 0 reference model from
    the policy's `config._name_or_path`.

    Args:
        model_path: SFT checkpoint directory (or Hub id) with model and processor files.
        train_dataset: a `datasets.Dataset` with the sft columns (the `prompt` column as a string or conversational).
        args: the GRPO configuration.
        rewards: reward entries, `name` or `name=weight` of registered terms (`train.rewards.make_reward_funcs`);
            ignored when `reward_funcs` is given.
        reward_funcs: explicit reward callables (tests).
        verifier_max_new_tokens: verifier answer budget.
        dtype: weight dtype (float32; bfloat16 only for the frozen base of the LoRA path).
        scoring_config: the reward table and the r_c options `negative_rows`, `cross_view` (`ScoringConfig()` when
            None).
        lora_r: 0 = full parameters; > 0 = LoRA of that rank on the LLM, projector in full.
        lora_alpha: LoRA alpha.

    Raises:
        TrainConfigError: on weights without an fp32 master copy, or a non-Qwen3-VL checkpoint.
    """
    check_precision(dtype, lora=lora_r > 0)
    check_qwen3_vl_checkpoint(model_path)
    rewards = list(rewards or REWARD_NAMES)
    processor = CTQwen3VLProcessor.from_pretrained(model_path)
    model = Qwen3VLForConditionalGeneration.from_pretrained(
        model_path, dtype=getattr(torch, dtype), **policy_load_kwargs()
    )
    set_stage_trainable(model, "grpo")
    if lora_r > 0:
        model = _apply_lora(model, lora_r, lora_alpha)
    require_fp32_trainable(model)
    if reward_funcs is None:
        reward_funcs = _reward_funcs(rewards, args, scoring_config, verifier_max_new_tokens)
        args = finalize_grpo_config(args, processor, rewards)
    else:
        args = finalize_grpo_config(args, processor, [getattr(f, "__name__", "f") for f in reward_funcs])
    if train_dataset is not None and not isinstance(train_dataset[0]["prompt"], list):
        train_dataset = to_grpo_dataset(train_dataset)
    return VideoGRPOTrainer(
        model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, processing_class=processor
    )


def _reward_funcs(
    rewards: list[str], args: GRPOConfig, scoring_config: ScoringConfig | None, verifier_max_new_tokens: int
) -> list[Any]:
    """Return the reward callables of `rewards` under `scoring_config`: a verifier only where r_c queries one.

    Raises:
        TrainConfigError: an unknown or repeated term, a training-only term without a weight, or
            `cross_view="random_frame"` with generation batches of a single prompt (no other row).
    """
    cfg = scoring_config or ScoringConfig()
    try:
        names = [name for name, _ in check_reward_entries(rewards)]
    except ValueError as exc:
        raise TrainConfigError(f"GRPO rewards: {exc}") from None
    queries = "r_c" in names and cfg.cross_view != "distance_only"
    if "r_c" in names and cfg.cross_view == "random_frame":
        per_call = args.per_device_train_batch_size * (args.steps_per_generation or args.gradient_accumulation_steps)
        group = args.num_generations or 1  # GRPOConfig's default is 8; None never reaches here
        if per_call < 2 * group:
            raise TrainConfigError(
                f"cross_view=random_frame shows the verifier another row's frame, but a generation batch holds "
                f"{per_call} completions = {per_call / group:g} prompt(s) of num_generations={group}; make "
                f"per_device_train_batch_size x steps_per_generation >= {2 * group}."
            )
    verifier = Verifier(max_new_tokens=verifier_max_new_tokens) if queries else None
    return make_reward_funcs(rewards, verifier=verifier, scoring_config=scoring_config, seed=args.seed)


def _load_checked(script_args: GrpoScriptArguments) -> Any:
    """Load the training split and check its columns and frame counts."""
    if script_args.dataset_dir is None or script_args.model_name_or_path is None:
        raise TrainConfigError("--dataset_dir and --model_name_or_path (the SFT checkpoint) are required.")
    check_precision(script_args.dtype, lora=script_args.lora_r > 0)
    check_qwen3_vl_checkpoint(script_args.model_name_or_path)
    dataset = load_split(script_args.dataset_dir, script_args.dataset_split, limit=script_args.max_train_samples)
    check_columns(script_args.dataset_dir, dataset.column_names, "grpo")
    check_frames(max_frames_in(dataset), script_args.max_frames)
    return dataset


def _train_one(script_args: GrpoScriptArguments, training_args: GRPOConfig, dataset: Any) -> VideoGRPOTrainer:
    """Build and train one GRPO run."""
    trainer = build_grpo_trainer(
        script_args.model_name_or_path,  # type: ignore[arg-type]
        dataset,
        training_args,
        rewards=list(script_args.rewards),
        verifier_max_new_tokens=script_args.verifier_max_new_tokens,
        dtype=script_args.dtype,
        scoring_config=script_args.scoring_config(),
        lora_r=script_args.lora_r,
        lora_alpha=script_args.lora_alpha,
    )
    trainer.rollout_seed = script_args.rollout_seed
    if not script_args.step_logs:
        bar_only(trainer)
    add_rank_report(trainer)
    try:
        trainer.train()
    finally:
        trainer.close_vllm()  # vLLM's groups go before the trainer's (and before an lr-0 control builds its own)
    return trainer


def run_grpo(script_args: GrpoScriptArguments, training_args: GRPOConfig) -> Path:
    """Train; save model, processor, `trainer_state.json` and the reward curve to `output_dir`; return the dir.

    With `lr0_control`, a second run with learning rate 0 (same seed, so the same prompts per step) goes to
    `<output_dir>/lr0_control/trainer_state.json` and beside the run in the PNG.
    """
    dataset = _load_checked(script_args)
    start = time.perf_counter()
    trainer = _train_one(script_args, training_args, dataset)
    out = Path(str(training_args.output_dir))  # TrainingArguments always sets it
    trainer.save_model(str(out))  # the main process alone writes the weights and `processing_class.save_pretrained`
    trainer.save_state()
    curve, steps = reward_curve(trainer.state.log_history), trainer.state.global_step
    logs = [h for h in trainer.state.log_history if "frac_reward_zero_std" in h]
    del trainer
    gc.collect()
    control = None
    if script_args.lr0_control:
        control_args = copy.deepcopy(training_args)
        control_args.learning_rate, control_args.output_dir = 0.0, str(out / "lr0_control")
        control_trainer = _train_one(script_args, control_args, dataset)
        control_trainer.save_state()
        control = reward_curve(control_trainer.state.log_history)
        del control_trainer
        gc.collect()
    if not training_args.should_save:  # one writer: ranks that write the same file at once can leave it truncated
        return out
    png = save_reward_curve_png(curve, script_args.reward_curve_png or out / "reward_curve.png", control)
    print(f"GRPO done: {steps} steps in {time.perf_counter() - start:.1f} s; saved to {out}")
    for line in summary_lines(curve, control, logs):
        print(line)
    print(f"  reward curve: {png}")
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry: `python -m train.grpo --config YAML --dataset_dir D --model_name_or_path M --output_dir O`."""
    train_main("grpo", GrpoScriptArguments, GRPOConfig, run_grpo, argv)


if __name__ == "__main__":
    run_cli(main)
