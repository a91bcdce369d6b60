"""`VideoGRPOTrainer`: TRL 1.16's `GRPOTrainer` with the CT video in every rollout and every log-prob forward.

Stock TRL passes images to generation and to its log-prob forwards, never a video: a Qwen3-VL prompt that holds the
row's frames as a video would be generated from and scored without them. The one shared reason for every override
below is that TRL has no public hook for a per-row video; the trainer therefore overrides four private methods of
TRL's `GRPOTrainer` (pinned `trl==1.16.0`; `tests/train/test_trl_seam.py` pins the version and their signatures):

| TRL method | why we override it | what breaks if TRL changes it |
| --- | --- | --- |
| `_generate_and_score_completions(inputs)` | puts each row's frames in its prompt as a video block, encodes each prompt's video once (handed to TRL's tokenisation through `CTQwen3VLProcessor.video_cache`), stashes the encoded videos in row order for the log-prob forwards, and returns them as lists (`ct_pixel_values_videos`, `ct_video_grid_thw`) that survive TRL's row-wise shuffle and split of the generation buffer | a new argument, or an output that is no longer a dict of per-row values split row by row, loses the videos of the loss forward (the loss then runs without the frames) |
| `_generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)` | rollouts and verifier queries through the in-process vLLM engine that carries the video (`train.vllm_rollout`), or through TRL's HF `generate` under a prompt-seeded generator (`rollout_seed: prompt`) | another argument list or return shape (`(completion ids, sampling log-probs or None)`) makes the vLLM path fail on its first call |
| `_compute_loss(model, inputs)` | hands the loss forward the videos of the rows of this micro-batch (the lists above) | a loss that is no longer computed through `_get_per_token_logps_and_entropies` with these `inputs` runs without the video |
| `_get_per_token_logps_and_entropies(model, input_ids, ...)` | adds `pixel_values_videos`, `video_grid_thw` and `mm_token_type_ids` to every forward (policy, old policy, reference) by wrapping `model` in a function TRL calls once per chunk of consecutive rows | a forward called otherwise than `model(**inputs)` per chunk of consecutive rows, in row order, scores the wrong row's video or none |

One TRL attribute is read too: TRL's inherited code decides its importance-sampling correction (the sampling
log-probs of vLLM against the policy's) on `self.use_vllm and self.vllm_importance_sampling_correction`, and nothing
else of TRL's vLLM path may run (its server client and colocated engine drop the video). The trainer keeps its own
flags: `vllm_rollouts` (generation goes through `train.vllm_rollout`) and `importance_sampling_correction` (set from
`vllm_importance_sampling_correction` when rollouts come from vLLM); `use_vllm` is a read-only view of the latter
for TRL's inherited code. `tests/train/test_trl_seam.py` pins every line of TRL's trainer that reads `self.use_vllm`.

Rollouts and the verifier generate exactly what the policy generates on its own (greedy: token for token), and the
loss forward scores the same M-RoPE positions as a plain unpadded forward; `tests/train/test_stages.py` checks both.
Any generation during training must go through TRL's path, which turns activation checkpointing off for the call
(a checkpointed layer discards the KV cache; see `train.rewards.Verifier`).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import psutil
import torch
import torch.distributed as dist
from trl import GRPOConfig, GRPOTrainer

from model_io.checkpoint import VIDEO_TRIPLE
from model_io.processor import CTQwen3VLProcessor
from model_io.video import frames_to_array, video_key
from train.checks import RunStopped
from train.distributed import prompt_seed, prompt_seeded_rng
from train.vllm_rollout import (
    RankLayout,
    RolloutPromptMismatch,
    VLLMRollout,
    check_host_kv_space,
    check_prompt_lengths,
    check_ranks_agree,
    check_served_checkpoint,
    check_vllm_settings,
    check_weight_names,
    checkpoint_bytes,
    checkpoint_tensor_shapes,
    collapse_runs,
    device_bytes,
    engine_memory_fraction,
    gathered_weight_groups,
    is_zero3,
    policy_shapes,
    policy_weights,
    prompt_token_counts,
    rank_info,
    sampling_params,
    served_prompt_ids,
    video_input,
    vllm_version,
)


class VideoGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose prompts carry the row's CT frames as a Qwen3-VL video (column `frames`).

    Rows keep their frames in the `frames` column (Arrow cannot hold arrays inside messages); this class injects
    the video block before generation and stashes the encoded video per row, in row order, for the log-prob forwards.
    Reward functions that have a `verifier` attribute get it bound to this trainer.
    """

    args: GRPOConfig  # what TRL's trainer holds, narrowed from `TrainingArguments` for the type checker
    processing_class: CTQwen3VLProcessor  # build_grpo_trainer always passes one
    max_completion_length: int
    _ct_videos: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    _vllm_rows: list[tuple[Any, list[int], str]] | None = None  # per rollout row: (frames, served ids, name)
    rollout_seed = "global"  # "prompt": rollouts seeded by (seed, step, prompts) (GrpoScriptArguments.rollout_seed)
    vllm: VLLMRollout | None = None  # the in-process engine when the config says use_vllm: true
    vllm_rollouts = False  # generation goes through `self.vllm` (the config's use_vllm)
    importance_sampling_correction = False  # TRL's correction by vLLM's sampling log-probs (vLLM rollouts only)

    def __init__(self, *args: Any, **kwargs: Any):
        config = kwargs.get("args")
        vllm_rollouts = config is not None and config.use_vllm
        if vllm_rollouts:  # TRL's own vLLM path drops the video: never hand it the flag (train.vllm_rollout)
            check_vllm_settings(config, n_processes=int(os.environ.get("WORLD_SIZE", "1")))
            kwargs["args"] = copy.copy(config)
            kwargs["args"].use_vllm = False
        super().__init__(*args, **kwargs)
        for func in self.reward_funcs:
            verifier = getattr(func, "verifier", None)
            if verifier is not None:
                verifier.trainer = self
        self._vllm_step = -1
        if vllm_rollouts:
            self.vllm_rollouts = True
            self._start_vllm()
            self.importance_sampling_correction = bool(self.args.vllm_importance_sampling_correction)

    @property
    def use_vllm(self) -> bool:
        """TRL's flag, as its inherited code reads it: true only where TRL's importance-sampling correction must run.

        TRL reads `self.use_vllm` to build its vLLM engine or server client (at `__init__`, where it is false), to
        generate through them (`_generate_single_turn`, overridden), in its tool loop and custom-rollout path (neither
        used here), and, together with `vllm_importance_sampling_correction`, to apply the correction: only that last
        use may see true. Generation never reaches TRL's vLLM path, whatever this says.
        """
        return self.importance_sampling_correction

    @use_vllm.setter
    def use_vllm(self, value: bool) -> None:
        """TRL's `__init__` assigns `args.use_vllm`, which this class has set to false; true would start TRL's own
        (video-dropping) vLLM path."""
        if value:
            raise RuntimeError("VideoGRPOTrainer generates through train.vllm_rollout; TRL's use_vllm stays false.")

    def _start_vllm(self) -> None:
        """Start the in-process engine on the policy's checkpoint, check names and prompt lengths, push weights.

        Several processes: one engine per rank (tensor parallel 1), built at the same point on every rank (vLLM
        builds its groups from the trainer's world), each with its share of the device's memory and its own seed;
        before that the ranks compare vLLM version, model and tensors (a collective under the `ddp_timeout`).
        """
        model = self.accelerator.unwrap_model(self.model)
        path = getattr(model, "name_or_path", None) or model.config._name_or_path
        cpu = not torch.cuda.is_available()
        check_served_checkpoint(path, cpu=cpu)
        max_len = self.args.vllm_max_model_length or 8192
        if self.train_dataset is not None:
            counts = prompt_token_counts(self.train_dataset, self.processing_class)
            check_prompt_lengths(counts, self.max_completion_length, max_len)
        shapes = policy_shapes(model)
        check_weight_names(shapes, checkpoint_tensor_shapes(path))
        dtype = "float32" if cpu or not self.args.bf16 else "bfloat16"
        layout = RankLayout.from_env(cuda=not cpu)
        fraction = engine_memory_fraction(
            self.args.vllm_gpu_memory_utilization, layout, checkpoint_bytes(path, dtype), device_bytes(not cpu)
        )
        if cpu:
            check_host_kv_space(layout, checkpoint_bytes(path, dtype), psutil.virtual_memory().available)
        distributed = self.accelerator.num_processes > 1
        if distributed:
            self._check_ranks_agree(path, shapes)
        self.vllm = VLLMRollout(
            path,
            max_model_len=max_len,
            gpu_memory_utilization=fraction,
            dtype=dtype,
            seed=self.args.seed + self.accelerator.process_index,
            distributed=distributed,
        )
        self.accelerator.wait_for_everyone()
        self.sync_vllm_weights()

    def _check_ranks_agree(self, path: str, shapes: dict[str, tuple[int, ...]]) -> None:
        """Gather every rank's vLLM version, model and tensor digest; refuse a difference on every rank at once."""
        infos: list[Any] = [None] * self.accelerator.num_processes
        dist.all_gather_object(infos, rank_info(path, vllm_version(), shapes))
        check_ranks_agree(infos)

    def sync_vllm_weights(self) -> None:
        """Push the policy's weights (LoRA: merged) into this rank's engine. DDP and ZeRO-2: from the rank's own full
        copy. ZeRO-3: gathered one layer group at a time (a collective: every rank syncs at the same step)."""
        assert self.vllm is not None
        model = self.accelerator.unwrap_model(self.model)
        if is_zero3(model):
            self.vllm.push_weight_groups(gathered_weight_groups(model))
        else:
            self.vllm.push_weights(policy_weights(model))
        self._vllm_step = self.state.global_step

    def close_vllm(self) -> None:
        """Tear this rank's engine down (its process groups before the trainer's); a no-op without one."""
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's rollout-and-score step, with each row's frames as a video in its prompt.

        Before TRL's own step: the frames of each distinct prompt are decoded and encoded once, the prompt's last
        user turn becomes `[video, text]`, the encoded videos are stashed in row order (`_ct_videos`, read by the
        log-prob forwards TRL runs inside this step) and, for vLLM rollouts, the served prompt ids (`_vllm_rows`).
        After it: the videos join TRL's output as per-row lists, which the loss forward of each micro-batch reads.

        Raises:
            RunStopped: naming the row whose frames do not decode.
        """
        inputs = [dict(x) for x in inputs]
        if self.vllm is not None and self.state.global_step != self._vllm_step:
            self.sync_vllm_weights()  # here, not at the first generate: every rank reaches this point (ZeRO-3 gathers)
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
        """TRL's one-turn generation: through the video-carrying vLLM engine when rollouts come from vLLM, else TRL's
        HF `generate`, under a generator seeded by (seed, step, prompt ids) when `rollout_seed` is `prompt`."""
        if self.vllm is not None:
            return self._generate_vllm(prompt_ids, *args, **kwargs)
        if self.rollout_seed != "prompt":
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        with prompt_seeded_rng(self.args.seed, self.state.global_step, prompt_ids):
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    def _generate_vllm(
        self, prompt_ids: Any, images: Any, multimodal_fields: Any, num_generations: int, has_tool_images: bool = False
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Generate through the engine: video rows with their frames, verifier rows with their key-frame image.

        Prompt ids are the ones TRL tokenised for the policy (each row repeated G times already); vLLM gets the
        unexpanded form and must rebuild exactly these ids (`VLLMRollout.generate` checks). Sampling settings are the
        trainer's current `generation_config` (the verifier swaps in greedy ones). Weights are pushed first when an
        optimizer step happened since the last push.
        """
        assert self.vllm is not None
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
                requests.append(
                    {"prompt_token_ids": collapse_runs(ids, proc.image_token_id), "multi_modal_data": {"image": image}}
                )
                names.append(f"verifier query {i}")
            elif proc.video_token_id in ids:
                if self._vllm_rows is None or len(self._vllm_rows) != len(prompt_ids):
                    raise RuntimeError("a video prompt reached vLLM without its frames; the row order was lost.")
                frames, served, name = self._vllm_rows[i]
                requests.append(
                    {"prompt_token_ids": served, "multi_modal_data": {"video": video_input(frames, proc.video_fps)}}
                )
                names.append(name)
            else:
                requests.append({"prompt_token_ids": ids})
                names.append(str(i))
        gen = self.generation_config
        vocab = self.accelerator.unwrap_model(self.model).config.text_config.vocab_size
        params = sampling_params(
            gen, proc.vision_token_ids, vocab, seed=None, logprobs=self.importance_sampling_correction
        )
        if gen.do_sample and self.rollout_seed == "prompt":
            params = self._prompt_seeded(params, prompt_ids)
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

    def _prompt_seeded(self, params: Any, prompt_ids: Any) -> list[Any]:
        """One `SamplingParams` per request, seeded by (seed, step, the request's prompt ids) plus the request's index
        among the copies of its prompt: the samples are then a function of the prompt, whatever the rank or batch
        (`rollout_seed: prompt`). Without it, each rank's engine generator (seeded with seed + rank) draws them."""
        seen: dict[tuple[int, ...], int] = {}
        out = []
        for ids in prompt_ids:
            key = tuple(int(t) for t in ids)
            seen[key] = seen.get(key, -1) + 1
            seeded = params.clone()
            seeded.seed = (prompt_seed(self.args.seed, self.state.global_step, [key]) + seen[key]) % 2**63
            out.append(seeded)
        return out

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's loss on one micro-batch, with that micro-batch's videos stashed for its log-prob forwards."""
        self._ct_videos = list(zip(inputs["ct_pixel_values_videos"], inputs["ct_video_grid_thw"], strict=True))
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._ct_videos = None

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any):
        """TRL's chunked log-prob forward, each chunk given its rows' stashed videos and token types.

        Without stashed videos (a forward outside a rollout or loss step) it is TRL's own.

        Raises:
            RuntimeError: when the stashed videos do not match the rows one to one.
        """
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
