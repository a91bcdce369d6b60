"""E-MRL stage 2: GRPO of Qwen3-VL with the rewards r_e, r_f, r_c (SPEC §7, §9; `training.md` §1, §5, §6).

`VideoGRPOTrainer` is TRL 1.16's `GRPOTrainer` plus the CT video: at rollout time each row's frames become a video
block in its prompt (generation sees them through `CTQwen3VLProcessor`), and the same `pixel_values_videos`,
`video_grid_thw` and `mm_token_type_ids` are fed to every log-prob forward (policy, old policy, reference), which
stock TRL silently omits. The projector and the LLM train; the ViT is frozen. The verifier (r_c) re-queries the
current policy through `_generate_single_turn`. TRL private API: pin `trl==1.16.0`.

Rollouts and the verifier generate exactly what the policy generates on its own (greedy: token for token), and the
loss forward scores the same M-RoPE positions as a plain unpadded forward; `tests/train/test_stages.py` checks both.
Any generation during training must go through TRL's path, which turns activation checkpointing off for the call
(a checkpointed layer discards the KV cache; see `train.rewards.Verifier`).

    python -m train.grpo --config train/configs/grpo_tiny.yaml --dataset_dir <out>/rl_hardset \
        --model_name_or_path <sft dir> --output_dir <dir>
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3VLForConditionalGeneration
from trl import GRPOConfig, GRPOTrainer, TrlParser

from train.data import CTQwen3VLProcessor, frames_to_array, load_split, to_grpo_dataset
from train.freeze import set_stage_trainable
from train.rewards import REWARD_NAMES, Verifier, make_reward_funcs, reward_weights_for


logger = logging.getLogger(__name__)


class VideoGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose prompts carry the row's CT frames as a Qwen3-VL video (column `frames`).

    Rows keep their frames in the `frames` column (Arrow cannot hold arrays inside messages); this class injects
    the video block before generation and stashes the encoded video per row, in row order, for the log-prob forwards.
    Reward functions that have a `verifier` attribute get it bound to this trainer.
    """

    _ct_videos: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        for func in self.reward_funcs:
            verifier = getattr(func, "verifier", None)
            if verifier is not None:
                verifier.trainer = self

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        inputs = [dict(x) for x in inputs]
        proc: CTQwen3VLProcessor = self.processing_class
        videos = []
        for x in inputs:
            arr = frames_to_array(x["frames"])
            last = x["prompt"][-1]
            text = last["content"] if isinstance(last["content"], str) else last["content"][-1]["text"]
            x["prompt"] = x["prompt"][:-1] + [
                {"role": "user", "content": [{"type": "video", "video": arr}, {"type": "text", "text": text}]}
            ]
            _, pixels, grids = proc.expand_videos(["<|vision_start|><|video_pad|><|vision_end|>"], [arr])
            videos.append((pixels[0], grids[0]))
        self._ct_videos = videos
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._ct_videos = None
        # Lists (not tensors) survive TRL's shuffle/split of the generation buffer row by row.
        out["ct_pixel_values_videos"] = [p for p, _ in videos]
        out["ct_video_grid_thw"] = [g for _, g in videos]
        return out

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        self._ct_videos = list(zip(inputs["ct_pixel_values_videos"], inputs["ct_video_grid_thw"], strict=True))
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._ct_videos = None

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any):
        if not self._ct_videos:
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
        videos, pos = self._ct_videos, [0]
        proc: CTQwen3VLProcessor = self.processing_class
        if len(videos) != input_ids.size(0):
            raise RuntimeError(f"{len(videos)} stashed videos for {input_ids.size(0)} rows; the row order was lost.")

        def forward_with_video(**mi: Any) -> Any:  # TRL calls this once per chunk of consecutive rows
            ids = mi["input_ids"]
            n, i = ids.size(0), pos[0]
            pos[0] += n
            mi["pixel_values_videos"] = torch.cat([p for p, _ in videos[i : i + n]]).to(ids.device)
            mi["video_grid_thw"] = torch.cat([g for _, g in videos[i : i + n]]).to(ids.device)
            mm = torch.zeros_like(ids)
            mm[ids == proc.image_token_id] = 1
            mm[ids == proc.video_token_id] = 2
            mi["mm_token_type_ids"] = mm
            return model(**mi)

        return super()._get_per_token_logps_and_entropies(forward_with_video, input_ids, *args, **kwargs)


@dataclass
class GrpoScriptArguments:
    """Our knobs beside TRL's `GRPOConfig` (one YAML holds both)."""

    dataset_dir: str | None = field(default=None, metadata={"help": "Table folder, e.g. <out>/rl_hardset."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "SFT checkpoint (local path or Hub id)."})
    dataset_split: str = field(default="train", metadata={"help": "Shard split to train on."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N rows."})
    rewards: list[str] = field(
        default_factory=lambda: ["r_e", "r_f", "r_c"],
        metadata={"help": "Ablation: [r_e] | [r_e, r_f] | [r_e, r_f, r_c]."},
    )
    verifier_max_new_tokens: int = field(default=128, metadata={"help": "Greedy tokens of the verifier answer."})
    dtype: str = field(default="float32", metadata={"help": "Parameter dtype when loading: float32 | bfloat16."})
    reward_curve_png: str | None = field(default=None, metadata={"help": "Default: <output_dir>/reward_curve.png."})


def make_grpo_config(processor: CTQwen3VLProcessor, rewards: list[str], **overrides: Any) -> GRPOConfig:
    """Return a `GRPOConfig` with the paper defaults (SPEC §9), our required settings and `overrides`."""
    base: dict[str, Any] = {
        "num_generations": 8,
        "beta": 0.01,
        "learning_rate": 5e-6,
        "optim": "adamw_torch",
        "gradient_accumulation_steps": 8,
        "num_train_epochs": 5,
        "loss_type": "grpo",
        "report_to": "none",
    }
    base.update(overrides)
    base["reward_weights"] = reward_weights_for(rewards)
    return finalize_grpo_config(GRPOConfig(**base), processor, rewards)


def finalize_grpo_config(args: GRPOConfig, processor: CTQwen3VLProcessor, rewards: list[str]) -> GRPOConfig:
    """Set what the video trainer needs: keep every column, suppress the vision tokens, weights per ablation."""
    args.remove_unused_columns = False
    gen = dict(args.generation_kwargs or {})
    gen["suppress_tokens"] = sorted(set(gen.get("suppress_tokens", [])) | set(processor.vision_token_ids))
    args.generation_kwargs = gen
    if all(r in REWARD_NAMES for r in rewards) and (
        args.reward_weights is None or len(args.reward_weights) != len(rewards)
    ):
        args.reward_weights = reward_weights_for(rewards)
    return args


def build_grpo_trainer(
    model_path: str,
    train_dataset: Any,
    args: GRPOConfig,
    *,
    rewards: list[str] | None = None,
    reward_funcs: list[Any] | None = None,
    verifier_max_new_tokens: int = 128,
    dtype: str = "float32",
) -> VideoGRPOTrainer:
    """Load the policy from `model_path`, freeze for GRPO and return the trainer.

    The model is loaded from a path (not passed as a built object) because TRL builds the β > 0 reference model from
    the policy's `config._name_or_path`.

    Args:
        model_path: SFT checkpoint directory (or Hub id) with model and processor files.
        train_dataset: a `datasets.Dataset` with the sft columns (the `prompt` column as a string or conversational).
        args: the GRPO configuration.
        rewards: reward names (ablation switch); ignored when `reward_funcs` is given.
        reward_funcs: explicit reward callables (tests).
        verifier_max_new_tokens: verifier answer budget.
        dtype: parameter dtype.
    """
    rewards = list(rewards or REWARD_NAMES)
    processor = CTQwen3VLProcessor.from_pretrained(model_path)
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_path, dtype=getattr(torch, dtype))
    set_stage_trainable(model, "grpo")
    if reward_funcs is None:
        verifier = Verifier(max_new_tokens=verifier_max_new_tokens) if "r_c" in rewards else None
        reward_funcs = make_reward_funcs(rewards, verifier=verifier)
        args = finalize_grpo_config(args, processor, rewards)
    else:
        args = finalize_grpo_config(args, processor, [getattr(f, "__name__", "f") for f in reward_funcs])
    if train_dataset is not None and not isinstance(train_dataset[0]["prompt"], list):
        train_dataset = to_grpo_dataset(train_dataset)
    return VideoGRPOTrainer(
        model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, processing_class=processor
    )


def reward_curve(log_history: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Return `{metric: [(step, value), ...]}` for `reward` and every `rewards/<name>/mean` logged by TRL."""
    curve: dict[str, list[tuple[int, float]]] = {}
    for entry in log_history:
        for key, value in entry.items():
            if (key == "reward" or (key.startswith("rewards/") and key.endswith("/mean"))) and "step" in entry:
                if isinstance(value, int | float) and not math.isnan(value):
                    curve.setdefault(key, []).append((int(entry["step"]), float(value)))
    return curve


def save_reward_curve_png(curve: dict[str, list[tuple[int, float]]], path: str | Path) -> Path:
    """Plot the reward curve (one line per metric) to a PNG and return its path."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, points in sorted(curve.items()):
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o", label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("E-MRL GRPO reward")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run_grpo(script_args: GrpoScriptArguments, training_args: GRPOConfig) -> Path:
    """Train, save model + processor + reward curve to `training_args.output_dir`, print the curve; return the dir."""
    if script_args.dataset_dir is None or script_args.model_name_or_path is None:
        raise ValueError("--dataset_dir and --model_name_or_path (the SFT checkpoint) are required.")
    dataset = load_split(script_args.dataset_dir, script_args.dataset_split, limit=script_args.max_train_samples)
    trainer = build_grpo_trainer(
        script_args.model_name_or_path,
        dataset,
        training_args,
        rewards=list(script_args.rewards),
        verifier_max_new_tokens=script_args.verifier_max_new_tokens,
        dtype=script_args.dtype,
    )
    start = time.perf_counter()
    trainer.train()
    out = Path(training_args.output_dir)
    trainer.save_model(str(out))
    trainer.processing_class.save_pretrained(str(out))
    curve = reward_curve(trainer.state.log_history)
    png = save_reward_curve_png(curve, script_args.reward_curve_png or out / "reward_curve.png")
    print(f"GRPO done: {trainer.state.global_step} steps in {time.perf_counter() - start:.1f} s; saved to {out}")
    for key, points in sorted(curve.items()):
        print(f"  {key:>22}: " + " ".join(f"{v:.3f}" for _, v in points))
    print(f"  reward curve: {png}")
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry: `python -m train.grpo --config YAML --dataset_dir D --model_name_or_path M --output_dir O`."""
    logging.basicConfig(level=logging.INFO)
    parser = TrlParser((GrpoScriptArguments, GRPOConfig))
    script_args, training_args = parser.parse_args_and_config(argv)
    run_grpo(script_args, training_args)


if __name__ == "__main__":
    main()
