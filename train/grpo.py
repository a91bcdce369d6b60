"""E-MRL stage 2: GRPO of Qwen3-VL with the rewards r_e, r_f, r_c (docs/contract.md#scoring, docs/contract.md#training-recipe, docs/training.md).

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

import copy
import gc
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3VLForConditionalGeneration
from trl import GRPOConfig, GRPOTrainer

from emrl_data.text.scoring import ScoringConfig
from train.checks import (
    RunStopped,
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
from train.data import (
    VIDEO_TRIPLE,
    CTQwen3VLProcessor,
    frames_to_array,
    load_split,
    to_grpo_dataset,
    video_key,
)
from train.distributed import (
    add_rank_report,
    policy_load_kwargs,
    prompt_seeded_rng,
)
from train.entry import train_main
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
    _vllm_rows: list[tuple[Any, list[int], str]] | None = None  # per rollout row: (frames, served ids, name)
    rollout_seed = "global"  # "prompt": rollouts seeded by (seed, step, prompts) (GrpoScriptArguments.rollout_seed)
    vllm: Any = None  # train.vllm_rollout.VLLMRollout when the config says use_vllm: true

    def __init__(self, *args: Any, **kwargs: Any):
        use_vllm = kwargs.get("args") is not None and kwargs["args"].use_vllm
        if use_vllm:  # TRL's own vLLM path drops the video: never hand it the flag (train.vllm_rollout)
            from train.vllm_rollout import check_vllm_settings  # noqa: PLC0415

            check_vllm_settings(kwargs["args"], n_processes=int(os.environ.get("WORLD_SIZE", "1")))
            kwargs["args"] = copy.copy(kwargs["args"])
            kwargs["args"].use_vllm = False
        super().__init__(*args, **kwargs)
        for func in self.reward_funcs:
            verifier = getattr(func, "verifier", None)
            if verifier is not None:
                verifier.trainer = self
        self._vllm_step = -1
        if use_vllm:
            self._start_vllm()
            # TRL's importance-sampling correction (vLLM's sampled-token log-probs against the policy's) runs on
            # `use_vllm`; generation itself never reaches TRL's vLLM path (`_generate_single_turn` is ours).
            self.use_vllm = bool(self.args.vllm_importance_sampling_correction)

    def _start_vllm(self) -> None:
        """Start the in-process engine on the policy's checkpoint, check names and prompt lengths, push weights."""
        from train.vllm_rollout import (  # noqa: PLC0415
            VLLMRollout,
            check_prompt_lengths,
            check_served_checkpoint,
            check_weight_names,
            policy_weights,
            prompt_token_counts,
        )

        model = self.accelerator.unwrap_model(self.model)
        path = getattr(model, "name_or_path", None) or model.config._name_or_path
        cpu = not torch.cuda.is_available()
        check_served_checkpoint(path, cpu=cpu)
        max_len = self.args.vllm_max_model_length or 8192
        if self.train_dataset is not None:
            counts = prompt_token_counts(self.train_dataset, self.processing_class)
            check_prompt_lengths(counts, self.max_completion_length, max_len)
        from train.vllm_rollout import checkpoint_tensor_shapes  # noqa: PLC0415

        check_weight_names({k: tuple(v.shape) for k, v in policy_weights(model).items()},
                           checkpoint_tensor_shapes(path))  # fmt: skip
        dtype = "float32" if cpu or not self.args.bf16 else "bfloat16"
        self.vllm = VLLMRollout(path, max_model_len=max_len, gpu_memory_utilization=self.args.vllm_gpu_memory_utilization,
                                dtype=dtype, seed=self.args.seed)  # fmt: skip
        self.sync_vllm_weights()

    def sync_vllm_weights(self, *, finalize: bool = True) -> None:
        """Push the policy's weights (LoRA: merged) into the engine; `finalize=False` skips the repacking (tests)."""
        from train.vllm_rollout import policy_weights  # noqa: PLC0415

        model = self.accelerator.unwrap_model(self.model)
        self.vllm.push_weights(policy_weights(model), finalize=finalize)
        self._vllm_step = self.state.global_step

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        inputs = [dict(x) for x in inputs]
        proc: CTQwen3VLProcessor = self.processing_class
        encoded: dict[Any, tuple[Any, torch.Tensor, torch.Tensor]] = {}  # one decode + encode per prompt, not per row
        videos = []
        served: dict[Any, list[int]] = {}
        vllm_rows: list[tuple[Any, list[int], str]] = []
        for x in inputs:
            key = _prompt_key(x)
            if key not in encoded:
                try:
                    arr = frames_to_array(x["frames"])
                except Exception as exc:  # a corrupt PNG or mixed sizes: name the row, not a PIL traceback
                    raise RunStopped(
                        f"row {_row_name(x)}: its frames do not decode ({type(exc).__name__}: {exc}); rebuild the set "
                        "or drop the row."
                    ) from exc
                _, pixels, grids = proc.expand_videos([VIDEO_TRIPLE], [arr])
                encoded[key] = (arr, pixels[0], grids[0])
            arr, pixel, grid = encoded[key]
            last = x["prompt"][-1]
            text = last["content"] if isinstance(last["content"], str) else last["content"][-1]["text"]
            x["prompt"] = x["prompt"][:-1] + [
                {"role": "user", "content": [{"type": "video", "video": arr}, {"type": "text", "text": text}]}
            ]
            videos.append((pixel, grid))
            if self.vllm is not None:
                if key not in served:
                    from train.vllm_rollout import served_prompt_ids  # noqa: PLC0415

                    served[key] = served_prompt_ids(proc, x["prompt"])
                vllm_rows.append((arr, served[key], _row_name(x)))
        self._ct_videos = videos
        self._vllm_rows = vllm_rows if self.vllm is not None else None
        # TRL's prompt tokenisation re-encodes each prompt's video; the cache hands back the encoding made above.
        proc.video_cache = {video_key(arr): (p, g) for arr, p, g in encoded.values()}
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._ct_videos = None
            self._vllm_rows = None
            proc.__dict__.pop("video_cache", None)  # back to the class default (None); never saved with the processor
        # Lists (not tensors) survive TRL's shuffle/split of the generation buffer row by row.
        out["ct_pixel_values_videos"] = [p for p, _ in videos]
        out["ct_video_grid_thw"] = [g for _, g in videos]
        return out

    def _generate_single_turn(self, prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if self.vllm is not None:
            return self._generate_vllm(prompt_ids, *args, **kwargs)
        if self.rollout_seed != "prompt":
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        with prompt_seeded_rng(self.args.seed, self.state.global_step, prompt_ids):
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    def _generate_vllm(self, prompt_ids: Any, images: Any, multimodal_fields: Any, num_generations: int,
                       has_tool_images: bool = False) -> tuple[list[list[int]], list[list[float]] | None]:  # fmt: skip
        """Generate through the engine: video rows with their frames, verifier rows with their key-frame image.

        Prompt ids are the ones TRL tokenised for the policy (each row repeated G times already); vLLM gets the
        unexpanded form and must rebuild exactly these ids (`VLLMRollout.generate` checks). Sampling settings are the
        trainer's current `generation_config` (the verifier swaps in greedy ones). Weights are pushed first when an
        optimizer step happened since the last push.
        """
        from train.vllm_rollout import collapse_runs, sampling_params, video_input  # noqa: PLC0415

        if self.state.global_step != self._vllm_step:
            self.sync_vllm_weights()
        proc: CTQwen3VLProcessor = self.processing_class
        requests, names = [], []
        for i, ids in enumerate(prompt_ids):
            ids = list(ids)
            row_images = images[i] if images is not None else None
            if row_images:
                if len(row_images) != 1:
                    raise ValueError(f"a verifier prompt holds one image; row {i} holds {len(row_images)}.")
                image = row_images[0].convert("RGB") if hasattr(row_images[0], "convert") else row_images[0]
                requests.append({"prompt_token_ids": collapse_runs(ids, proc.image_token_id),
                                 "multi_modal_data": {"image": image}})  # fmt: skip
                names.append(f"verifier query {i}")
            elif proc.video_token_id in ids:
                if self._vllm_rows is None or len(self._vllm_rows) != len(prompt_ids):
                    raise RuntimeError("a video prompt reached vLLM without its frames; the row order was lost.")
                frames, served, name = self._vllm_rows[i]
                requests.append({"prompt_token_ids": served,
                                 "multi_modal_data": {"video": video_input(frames, proc.video_fps)}})  # fmt: skip
                names.append(name)
            else:
                requests.append({"prompt_token_ids": ids})
                names.append(str(i))
        gen = self.generation_config
        vocab = self.accelerator.unwrap_model(self.model).config.text_config.vocab_size
        # No per-request seed: the engine's generator (seeded with args.seed at start) draws the samples. vLLM 0.32's
        # CPU runner fails on seeded requests whose prefill is split ("CPU Generator does not use offset").
        params = sampling_params(gen, proc.vision_token_ids, vocab, seed=None, logprobs=self.use_vllm)
        from train.vllm_rollout import RolloutPromptMismatch  # noqa: PLC0415

        try:
            completions, logprobs = self.vllm.generate(requests, params, [list(ids) for ids in prompt_ids], names)
        except RolloutPromptMismatch:
            raise
        except Exception as exc:  # the engine died: stop the run here (the last saved checkpoint stays as it is)
            raise RunStopped(
                f"vLLM engine failed at step {self.state.global_step} generating rows {', '.join(sorted(set(names)))}: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; the run stops, the last saved "
                "checkpoint is intact; resume from it (use_vllm: false falls back to HF generate)."
            ) from exc
        return completions, logprobs

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


def _row_name(row: dict[str, Any]) -> str:
    """A rollout row's name for messages: (case_id, organ) when present."""
    if "case_id" in row and "organ" in row:
        return f"({row['case_id']}, {row['organ']})"
    return "?"


def _prompt_key(row: dict[str, Any]) -> Any:
    """Identity of a GRPO row's prompt: TRL repeats each row `num_generations` times in one batch."""
    if "case_id" in row and "organ" in row:
        return (row["case_id"], row["organ"], row.get("split"))
    return id(row["frames"])


@dataclass
class GrpoScriptArguments:
    """Our knobs beside TRL's `GRPOConfig` (one YAML holds both)."""

    dataset_dir: str | None = field(default=None, metadata={"help": "Table folder, e.g. <out>/rl_hardset."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "SFT checkpoint (local path or Hub id)."})
    dataset_split: str = field(default="train", metadata={"help": "Shard split to train on."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N rows."})
    rewards: list[str] = field(
        default_factory=lambda: ["r_e", "r_f", "r_c"],
        metadata={"help": "Ablation: [r_e] | [r_e, r_f] | [r_e, r_f, r_c]; weights from ScoringConfig."},
    )
    verifier_max_new_tokens: int = field(default=128, metadata={"help": "Greedy tokens of the verifier answer."})
    box_weight: float = field(default=0.0, metadata={"help": "r_c box term weight (ablation; 0 = paper's r_c)."})
    negative_rows: str = field(
        default="skip",
        metadata={"help": "r_c on true negatives: skip (None, the paper) | query_named_slice (the verifier is shown the "
                  "frame a false positive names; docs/contract.md#scoring)."},
    )  # fmt: skip
    cross_view: str = field(
        default="full",
        metadata={"help": "r_c's view: full (the paper) | distance_only (the window term alone, no verifier) | "
                  "random_frame (the verifier sees another row's frame: a blind control)."},
    )  # fmt: skip
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
        metadata={"help": "global: the process's generator; prompt: seeded by (seed, step, prompts), so rollouts "
                  "do not depend on the number of processes (train.distributed.prompt_seeded_rng)."},
    )  # fmt: skip
    step_logs: bool = field(
        default=True,
        metadata={
            "help": "Print each logged step's metrics (always kept in trainer_state.json); the demo sets false."
        },
    )

    def __post_init__(self) -> None:
        self.scoring_config()  # a bad r_c option is a one-line error at parse time

    def scoring_config(self) -> ScoringConfig:
        """Return the `ScoringConfig` of these options (weights and λ stay its defaults: the one table).

        Raises:
            TrainConfigError: naming the option and its allowed values.
        """
        try:
            return ScoringConfig(box_weight=self.box_weight, negative_rows=self.negative_rows,
                                 cross_view=self.cross_view)  # fmt: skip
        except ValueError as exc:
            raise TrainConfigError(f"GRPO option {exc}") from None


def make_grpo_config(processor: CTQwen3VLProcessor, rewards: list[str], **overrides: Any) -> GRPOConfig:
    """Return a `GRPOConfig` with the paper defaults (docs/contract.md#training-recipe), our required settings and `overrides`.

    The reward weights come from `ScoringConfig` (`reward_weights_for`) unless `overrides` gives one per reward.
    """
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
    base["reward_weights"] = reward_weights_for(rewards, base.get("reward_weights"))
    return finalize_grpo_config(GRPOConfig(**base), processor, rewards)


def finalize_grpo_config(args: GRPOConfig, processor: CTQwen3VLProcessor, rewards: list[str]) -> GRPOConfig:
    """Set what the video trainer needs: keep every column, suppress the vision tokens, weights per reward, and a bf16
    reference model when `bf16` compute is on (half the memory of TRL's default, the policy's fp32; bf16 autocast
    rounds the matmul weights to bf16 anyway).

    Raises:
        ValueError: when `reward_weights` is given with a length other than the number of rewards.
    """
    args.remove_unused_columns = False
    if args.bf16 and args.beta > 0:  # TRL builds the frozen reference in the policy's dtype (fp32) unless told
        args.model_init_kwargs = {**(args.model_init_kwargs or {}), "dtype": "bfloat16"}
    gen = dict(args.generation_kwargs or {})
    gen["suppress_tokens"] = sorted(set(gen.get("suppress_tokens", [])) | set(processor.vision_token_ids))
    args.generation_kwargs = gen
    if all(r in REWARD_NAMES for r in rewards):
        args.reward_weights = reward_weights_for(rewards, args.reward_weights)
    elif args.reward_weights is not None and len(args.reward_weights) != len(rewards):
        raise ValueError(
            f"reward_weights={args.reward_weights} needs one weight per reward function ({len(rewards)})."
        )
    return args


def _apply_lora(model: Any, r: int, alpha: int) -> Any:
    """Wrap the LLM's linear layers with LoRA (rank r); the projector trains in full (peft `modules_to_save`)."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415

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
        rewards: reward names (ablation switch); ignored when `reward_funcs` is given.
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
        TrainConfigError: `cross_view="random_frame"` with generation batches of a single prompt (no other row).
    """
    cfg = scoring_config or ScoringConfig()
    queries = "r_c" in rewards and cfg.cross_view != "distance_only"
    if "r_c" in rewards and cfg.cross_view == "random_frame":
        per_call = args.per_device_train_batch_size * (args.steps_per_generation or args.gradient_accumulation_steps)
        if per_call < 2 * args.num_generations:
            raise TrainConfigError(
                f"cross_view=random_frame shows the verifier another row's frame, but a generation batch holds "
                f"{per_call} completions = {per_call / args.num_generations:g} prompt(s) of num_generations="
                f"{args.num_generations}; make per_device_train_batch_size x steps_per_generation >= "
                f"{2 * args.num_generations}."
            )
    verifier = Verifier(max_new_tokens=verifier_max_new_tokens) if queries else None
    return make_reward_funcs(rewards, verifier=verifier, scoring_config=scoring_config, seed=args.seed)


def reward_curve(log_history: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Return `{metric: [(step, value), ...]}` for `reward` and every `rewards/<name>/mean` logged by TRL."""
    curve: dict[str, list[tuple[int, float]]] = {}
    for entry in log_history:
        for key, value in entry.items():
            if (key == "reward" or (key.startswith("rewards/") and key.endswith("/mean"))) and "step" in entry:
                if isinstance(value, int | float) and not math.isnan(value):
                    curve.setdefault(key, []).append((int(entry["step"]), float(value)))
    return curve


_CURVE_STYLE = {"reward": ("R", "black"), "rewards/r_e/mean": ("r_e", "tab:blue"),
                "rewards/r_f/mean": ("r_f", "tab:orange"), "rewards/r_c/mean": ("r_c", "tab:green")}  # fmt: skip


def save_reward_curve_png(
    curve: dict[str, list[tuple[int, float]]],
    path: str | Path,
    control: dict[str, list[tuple[int, float]]] | None = None,
) -> Path:
    """Plot r_e, r_f, r_c and R per step (solid: the run; dashed: the lr-0 control) to a PNG; return its path."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for source, style, suffix in ((curve, "-", "GRPO"), (control or {}, "--", "lr-0 control")):
        for key, points in sorted(source.items()):
            label, color = _CURVE_STYLE.get(key, (key, None))
            ax.plot([s for s, _ in points], [v for _, v in points], style, marker="o", ms=3, color=color,
                    lw=2.2 if key == "reward" else 1.4, label=f"{label} ({suffix})")  # fmt: skip
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward over the step's completions")
    ax.set_title("E-MRL GRPO reward: run (solid) vs learning-rate-0 control (dashed), same prompts")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


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
    trainer.train()
    return trainer


def _mean(points: list[tuple[int, float]]) -> float:
    return sum(v for _, v in points) / max(1, len(points))


def run_minus_control(run: list[tuple[int, float]], control: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Mean per-step value of the run minus the control's, and its standard error (Welch: sample variances over
    counts); None with fewer than 2 steps on either side. Steps are treated as independent draws, which a short run's
    reward mostly is (each step samples new completions), so the error says how much of the gap is noise."""
    if len(run) < 2 or len(control) < 2:
        return None
    a, b = [v for _, v in run], [v for _, v in control]
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    var_a = sum((v - mean_a) ** 2 for v in a) / (len(a) - 1)
    var_b = sum((v - mean_b) ** 2 for v in b) / (len(b) - 1)
    return mean_a - mean_b, math.sqrt(var_a / len(a) + var_b / len(b))


def run_grpo(script_args: GrpoScriptArguments, training_args: GRPOConfig) -> Path:
    """Train; save model, processor, `trainer_state.json` and the reward curve to `output_dir`; return the dir.

    With `lr0_control`, a second run with learning rate 0 (same seed, so the same prompts per step) goes to
    `<output_dir>/lr0_control/trainer_state.json` and beside the run in the PNG.
    """
    dataset = _load_checked(script_args)
    start = time.perf_counter()
    trainer = _train_one(script_args, training_args, dataset)
    out = Path(training_args.output_dir)
    trainer.save_model(str(out))
    trainer.save_state()
    trainer.processing_class.save_pretrained(str(out))
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
    png = save_reward_curve_png(curve, script_args.reward_curve_png or out / "reward_curve.png", control)
    print(f"GRPO done: {steps} steps in {time.perf_counter() - start:.1f} s; saved to {out}")
    for key, points in sorted(curve.items()):
        ctrl = f"   (lr-0 control mean {_mean(control[key]):.3f})" if control and key in control else ""
        print(f"  {key:>22}: " + " ".join(f"{v:.3f}" for _, v in points) + f"   mean {_mean(points):.3f}{ctrl}")
    gap = None
    if control and "reward" in curve and "reward" in control:
        gap = run_minus_control(curve["reward"], control["reward"])
    if gap is not None:
        print(
            f"  reward, run - lr-0 control: {gap[0]:+.3f} ± {gap[1]:.3f} (1 standard error over {len(curve['reward'])} "
            f"and {len(control['reward'])} steps; a gap inside ~2 errors is noise)"
        )
    zero_std = [h["frac_reward_zero_std"] for h in logs]
    grad = [h.get("grad_norm", float("nan")) for h in logs]
    print(f"  frac_reward_zero_std per step: {zero_std}; grad_norm per step: {[round(g, 4) for g in grad]}")
    print(f"  reward curve: {png}")
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry: `python -m train.grpo --config YAML --dataset_dir D --model_name_or_path M --output_dir O`."""
    train_main("grpo", GrpoScriptArguments, GRPOConfig, run_grpo, argv)


if __name__ == "__main__":
    run_cli(main)
