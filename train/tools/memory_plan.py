"""GPU memory plan of E-MRL GRPO at the paper's shape, computed from the Qwen3-VL-8B model config (not typed by hand).

Shape (docs/contract.md#training-recipe): Qwen3-VL-8B, 32 frames of 448² (16 frame pairs x 196 tokens = 3,136 video tokens, ≈3.5k prompt
tokens), 512-token completions, G = 8, verifier on, per-device micro-batch 1, bf16 compute with fp32 master weights.
Parameter counts come from instantiating the model on the meta device from `train.tiny.model.build_config(..., "8b")`.

Per GPU, in GiB: weights (bf16 compute copy and/or fp32 masters), gradients, AdamW state (fp32 m and v), the β > 0
reference model, activations of one micro-batch with activation checkpointing, and generation as it runs: the KV cache
of every row one generate call holds (TRL generates a whole generation batch at once: per-device batch x
accumulation rows, read from the path's config: 8 for `grpo.yaml`, 64 for `grpo_lora.yaml`), the full model ZeRO-3
gathers for each call, and, with vLLM rollouts (`use_vllm: true`, `train.vllm_rollout`), the memory vLLM reserves
(`vllm_gpu_memory_utilization` x the card) beside the trainer's states instead of the HF KV cache and the gather. Estimates of activations follow Korthikanti et al. 2022 with flash
attention (34·s·h bytes for the one layer being recomputed, 2·s·h per checkpointed layer input) plus the fp32
logits of the completion tokens (and their gradient).

    python -m train.tools.memory_plan            # markdown table (pasted into docs/training.md by --write-docs)
    python -m train.tools.memory_plan --write-docs docs/training.md
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import Qwen3VLForConditionalGeneration

from emrl_data.config import FrameConfig
from train.freeze import parameter_group
from train.tiny.model import build_config, build_tokenizer


GIB = 2**30
BEGIN, END = "<!-- memory-plan:begin -->", "<!-- memory-plan:end -->"


@dataclass(frozen=True)
class Shape:
    """The paper's per-device GRPO shape."""

    frames: int = FrameConfig().max_frames  # the E-MRL frames (emrl_data.config, the one home of the default)
    frame_px: int = FrameConfig().frame_size_px
    text_tokens: int = 400
    completion_tokens: int = 512
    group: int = 8
    lora_rank: int = 64


def parameter_counts() -> dict[str, int]:
    """Return parameter counts per group (`vit`, `projector`, `llm`) and per LLM part of the 8B model (meta device)."""
    config = build_config(build_tokenizer(), "8b")
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    counts = {"vit": 0, "projector": 0, "llm": 0, "lora": 0}
    text: Any = config.text_config  # a Qwen3VLTextConfig (transformers types it as any sub-config)
    for name, param in model.named_parameters():
        counts[parameter_group(name)] += param.numel()
    r = Shape().lora_rank
    h, i, kv = text.hidden_size, text.intermediate_size, text.num_key_value_heads * text.head_dim
    per_layer = r * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 2 + (i + h))  # q, o, k, v, gate, up, down
    counts["lora"] = per_layer * text.num_hidden_layers
    counts["layers"], counts["hidden"], counts["vocab"] = text.num_hidden_layers, h, text.vocab_size
    counts["kv_dim"] = kv
    return counts


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def rows_per_generate_call(config: str) -> int:
    """Rows one HF generate call holds on a device for a GRPO config (`train/configs/<config>`): TRL generates the
    whole generation batch at once, per-device batch x `steps_per_generation` (default: the accumulation steps)."""
    cfg = yaml.safe_load((CONFIGS / config).read_text())
    steps = cfg.get("steps_per_generation") or cfg["gradient_accumulation_steps"]
    return int(cfg["per_device_train_batch_size"]) * int(steps)


def kv_bytes_per_row(c: dict[str, int], shape: Shape) -> int:
    """bf16 K and V of every layer for one row of prompt + completion tokens."""
    return 2 * c["layers"] * c["kv_dim"] * 2 * _tokens(shape)[1]


def vllm_fraction(c: dict[str, int], rows: int, card_gib: float, shape: Shape) -> float:
    """The `vllm_gpu_memory_utilization` that holds vLLM's bf16 weights and the KV cache of `rows` rows at once
    (rounded up to 0.01); vLLM runs with less, then it schedules fewer rows at a time."""
    total = c["vit"] + c["projector"] + c["llm"]
    need = (2 * total + rows * kv_bytes_per_row(c, shape)) / GIB
    return math.ceil(100 * need / card_gib) / 100


def _tokens(shape: Shape) -> tuple[int, int]:
    pairs, per_pair = shape.frames // 2, (shape.frame_px // 32) ** 2
    prompt = pairs * per_pair + pairs * 6 + shape.text_tokens
    return prompt, prompt + shape.completion_tokens


def plan(n_gpus_multi: int = 8, card_gib: float = 139.0) -> list[dict[str, object]]:
    """Return one row per training path with GiB per GPU and whether it fits 80 / 141 GB cards.

    * gradients: under ZeRO-2/3 DeepSpeed keeps the bf16 gradient partition and an fp32 copy of it for the optimizer
      step (6 bytes per trainable parameter / n); one GPU keeps fp32 gradients of the fp32 weights.
    * reference: bf16 (`train.grpo.finalize_grpo_config` sets `model_init_kwargs.dtype` to bfloat16 when `bf16` is
      on; TRL would otherwise build it in the policy's fp32); replicated under ZeRO-2 (TRL prepares it with stage 0),
      sharded under ZeRO-3; none in the LoRA path (adapters disabled) beyond the projector's original copy.
    * KV cache (HF generate): bf16 K and V of every row one generate call holds (`rows_per_generate_call`).
    * gathered for generation: ZeRO-3 gathers the full bf16 weights on every rank for each generate call
      (`ds3_gather_for_generation`, the rollouts and the verifier), on top of the rank's own shard.
    * vLLM reserved: with `use_vllm: true` on 1 GPU (several: `vllm_rank_plan`) vLLM takes `vllm_fraction` of the card (its bf16
      weights + the KV cache of the same rows at once) up front; the trainer then holds no KV cache and gathers
      nothing. Computed for a `card_gib` card (H200); on an 80 GB card the fraction is larger, the GiB the same.
    * total: the sum of every column (conservative: the training activations and the generation-time gather plus
      KV cache are not alive at the same moment; vLLM's reservation is).
    """
    c, shape = parameter_counts(), Shape()
    total = c["vit"] + c["projector"] + c["llm"]
    trainable = c["projector"] + c["llm"]  # GRPO: projector + LLM, ViT frozen
    _, seq = _tokens(shape)
    h, layers = c["hidden"], c["layers"]
    act = (layers * 2 * seq * h + 34 * seq * h) + 2 * shape.completion_tokens * c["vocab"] * 4
    kv_row = kv_bytes_per_row(c, shape)
    rows_full, rows_lora = rows_per_generate_call("grpo.yaml"), rows_per_generate_call("grpo_lora.yaml")
    n = n_gpus_multi
    lora_trained = c["lora"] + c["projector"]
    lora_states = (2 * total + 4 * lora_trained, 4 * lora_trained, 8 * lora_trained, 2 * c["projector"])
    full_states = (4 * total, 4 * trainable, 8 * trainable, 2 * total)
    fraction = vllm_fraction(c, rows_lora, card_gib, shape)
    rows = [
        ("1 GPU, full parameters, fp32 weights + bf16 autocast", *full_states, rows_full, 0, 0),
        (f"ZeRO-2 on {n} GPUs, full parameters (bf16 weights, fp32 masters sharded)",
         2 * total + 4 * trainable / n, 6 * trainable / n, 8 * trainable / n, 2 * total, rows_full, 0, 0),
        (f"ZeRO-3 on {n} GPUs, full parameters (all states sharded, reference sharded)",
         (2 * total + 4 * trainable) / n, 6 * trainable / n, 8 * trainable / n, 2 * total / n, rows_full,
         2 * total * (n - 1) / n, 0),
        (f"1 GPU, LoRA r={shape.lora_rank} on the LLM + projector in full (bf16 frozen base)", *lora_states, rows_lora,
         0, 0),
        (f"1 GPU, LoRA r={shape.lora_rank}, rollouts on vLLM (colocate, vllm_gpu_memory_utilization {fraction:.2f})",
         *lora_states, rows_lora, 0, fraction * card_gib * GIB),
    ]  # fmt: skip
    host = host_plan(n)
    host.append(host[-1])  # the vLLM variant loads the policy as the LoRA path does (vLLM loads from the page cache)
    out = []
    for (name, weights, grads, optim, ref, n_rows, gather, vllm), host_row in zip(rows, host, strict=True):
        kv = 0 if vllm else n_rows * kv_row
        parts = {"weights": weights, "gradients": grads, "optimizer": optim, "reference": ref,
                 "activations": act, "kv_cache": kv, "gather": gather, "vllm": vllm}  # fmt: skip
        gib = {k: v / GIB for k, v in parts.items()}
        gib["total"] = sum(gib.values())
        out.append({"path": name, "rows_per_call": n_rows, **gib, "fits_80": gib["total"] < 80 * 0.9,
                    "fits_141": gib["total"] < 139 * 0.9, "host_gib_per_node": host_row["host_gib_per_node"],
                    "host_gib_per_node_before": host_row["before"]})  # fmt: skip
    return out


def vllm_rank_plan(n_gpus_multi: int = 8, card_gib: float = 139.0) -> list[dict[str, object]]:
    """Return the multi-GPU paths with vLLM rollouts on every rank (`use_vllm: true`, one engine per rank, tensor
    parallel 1), in `plan`'s columns, GiB per GPU.

    Each rank's engine holds the whole model in bf16 and the KV cache of the rank's own rows (what it generates: the
    same rows per call as the HF path), `vllm_fraction` of the card; the trainer then keeps no HF KV cache. ZeRO-2
    pushes from the rank's own bf16 copy (nothing gathered); ZeRO-3 gathers one decoder layer at a time for the push
    (`train.vllm_rollout.gathered_weight_groups`: 'gathered' is that layer in bf16) instead of the whole model
    per generate call, but its engine still holds a full copy: vLLM takes back most of what ZeRO-3 shards. LoRA on
    several GPUs is DDP of the LoRA path (each rank the whole bf16 base), each rank pushing its merged weights.
    """
    c, shape, n = parameter_counts(), Shape(), n_gpus_multi
    total = c["vit"] + c["projector"] + c["llm"]
    trainable = c["projector"] + c["llm"]
    _, seq = _tokens(shape)
    act = (c["layers"] * 2 * seq * c["hidden"] + 34 * seq * c["hidden"]) + 2 * shape.completion_tokens * c["vocab"] * 4
    rows_full, rows_lora = rows_per_generate_call("grpo.yaml"), rows_per_generate_call("grpo_lora.yaml")
    layer = 2 * (c["llm"] - 2 * c["vocab"] * c["hidden"]) / c["layers"]  # one bf16 decoder layer
    lora_trained = c["lora"] + c["projector"]
    host = host_plan(n)
    rows = [
        (f"ZeRO-2 on {n} GPUs, vLLM on every rank",
         (2 * total + 4 * trainable / n, 6 * trainable / n, 8 * trainable / n, 2 * total), rows_full, 0, host[1]),
        (f"ZeRO-3 on {n} GPUs, vLLM on every rank",
         ((2 * total + 4 * trainable) / n, 6 * trainable / n, 8 * trainable / n, 2 * total / n), rows_full, layer,
         host[2]),
        (f"LoRA r={shape.lora_rank}, DDP on {n} GPUs, vLLM on every rank",
         (2 * total + 4 * lora_trained, 4 * lora_trained, 8 * lora_trained, 2 * c["projector"]), rows_lora, 0,
         {k: n * v for k, v in host[3].items()}),
    ]  # fmt: skip
    out = []
    for name, (weights, grads, optim, ref), n_rows, gather, host_row in rows:
        fraction = vllm_fraction(c, n_rows, card_gib, shape)
        parts = {"weights": weights, "gradients": grads, "optimizer": optim, "reference": ref, "activations": act,
                 "kv_cache": 0, "gather": gather, "vllm": fraction * card_gib * GIB}  # fmt: skip
        gib = {k: v / GIB for k, v in parts.items()}
        gib["total"] = sum(gib.values())
        out.append({"path": f"{name} ({fraction:.2f})", "rows_per_call": n_rows, **gib,
                    "fits_80": gib["total"] < 80 * 0.9, "fits_141": gib["total"] < 139 * 0.9,
                    "host_gib_per_node": host_row["host_gib_per_node"],
                    "host_gib_per_node_before": host_row["before"]})  # fmt: skip
    return out


def host_plan(n_gpus_multi: int = 8) -> list[dict[str, float]]:
    """Host memory per node at start-up (GiB), besides the checkpoint's page cache (bf16 safetensors, shared, evictable).

    * 1 GPU and ZeRO-2: the policy loads straight onto the rank's GPU (`train.distributed.policy_load_kwargs`); the
      bf16 reference is built on the host by TRL (it forces `device_map=None` under several processes) and moved to the
      GPU when prepared: 2 bytes x all parameters per rank, held at the same time by every rank of the node.
    * ZeRO-3: `zero.Init` (accelerate's `zero3_init_flag: true`) materialises each rank's shard on its GPU; the
      reference too. Nothing model-sized on the host.
    * LoRA: the bf16 base loads straight onto the GPU; no separate reference.
    * before: what the code did before (policy in fp32 and the reference in the policy's fp32, both on the host of
      every rank; ZeRO-3 was already sharded at load: the training arguments, parsed first, register the ZeRO-3
      config, so `from_pretrained` runs under `zero.Init`).
    """
    c, n = parameter_counts(), n_gpus_multi
    total = c["vit"] + c["projector"] + c["llm"]
    rows = [(2 * total, 8 * total), (n * 2 * total, n * 8 * total), (0, 0), (0, 2 * total)]
    return [{"host_gib_per_node": now / GIB, "before": before / GIB} for now, before in rows]


def markdown(n_gpus_multi: int = 8) -> str:
    """Return the plan as a markdown table with the counts it was computed from."""
    c = parameter_counts()
    prompt, seq = _tokens(Shape())
    kv_row = kv_bytes_per_row(c, Shape()) / GIB
    lines = [
        f"Computed by `python -m train.tools.memory_plan` from the Qwen3-VL-8B config: ViT {c['vit'] / 1e9:.3f} B, "
        f"projector {c['projector'] / 1e9:.3f} B, LLM (incl. embeddings and lm_head) {c['llm'] / 1e9:.3f} B "
        f"parameters; LoRA r={Shape().lora_rank} adds {c['lora'] / 1e6:.0f} M. Sequence: {prompt} prompt + "
        f"{Shape().completion_tokens} completion tokens, G = {Shape().group}. GiB per GPU; 'fits' keeps 10 % headroom. "
        "Gradients under ZeRO include DeepSpeed's fp32 copy of the gradient partition; the reference is bf16. "
        f"Generation as it runs: 'rows' is what one generate call holds per GPU (per-device batch x accumulation of "
        f"the path's config), each row's bf16 KV cache is {kv_row:.2f} GiB; 'gathered' is the full bf16 model ZeRO-3 "
        "gathers for each generate call; 'vLLM' is vLLM's reservation beside the trainer (bf16 weights + the same rows' "
        "KV cache; the path names its fraction of an H200), replacing the HF KV cache; the total adds every column. Host: GiB of host memory per node while the models load, besides the checkpoint's page cache (in "
        "brackets: before the policy loaded onto the GPU and the reference became bf16; `host_plan`).",
        "",
        "| path | weights | gradients | AdamW | reference | activations | rows per call | KV cache | gathered | vLLM "
        "| total | fits 80 GB | fits H200 | host per node at start (before) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in plan(n_gpus_multi) + vllm_rank_plan(n_gpus_multi):
        lines.append(
            f"| {r['path']} | {r['weights']:.1f} | {r['gradients']:.1f} | {r['optimizer']:.1f} | {r['reference']:.1f} "
            f"| {r['activations']:.1f} | {r['rows_per_call']} | {r['kv_cache']:.1f} | {r['gather']:.1f} "
            f"| {r['vllm']:.1f} | **{r['total']:.1f}** "
            f"| {'yes' if r['fits_80'] else 'no'} | {'yes' if r['fits_141'] else 'no'} "
            f"| {r['host_gib_per_node']:.0f} ({r['host_gib_per_node_before']:.0f}) |"
        )
    return "\n".join(lines)


def write_docs(path: str | Path) -> None:
    """Replace the text between the memory-plan markers in `path` by `markdown()`."""
    p = Path(path)
    text = p.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    p.write_text(f"{head}{BEGIN}\n{markdown()}\n{END}{tail}")


def main(argv: list[str] | None = None) -> None:
    """CLI: print the table, or write it into a markdown file between the markers."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-docs", default=None, help="markdown file holding the memory-plan markers")
    args = parser.parse_args(argv)
    if args.write_docs:
        write_docs(args.write_docs)
    else:
        print(markdown())


if __name__ == "__main__":
    main()
