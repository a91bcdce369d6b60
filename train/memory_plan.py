"""GPU memory plan of E-MRL GRPO at the paper's shape, computed from the Qwen3-VL-8B model config (not typed by hand).

Shape (SPEC §9): Qwen3-VL-8B, 32 frames of 448² (16 frame pairs x 196 tokens = 3,136 video tokens, ≈3.5k prompt
tokens), 512-token completions, G = 8, verifier on, per-device micro-batch 1, bf16 compute with fp32 master weights.
Parameter counts come from instantiating the model on the meta device from `train.tiny.build_config(..., "8b")`.

Per GPU, in GiB: weights (bf16 compute copy and/or fp32 masters), gradients, AdamW state (fp32 m and v), the β > 0
reference model, activations of one micro-batch with activation checkpointing, and the generation KV cache of one
group (G sequences of prompt + completion). Estimates of activations follow Korthikanti et al. 2022 with flash
attention (34·s·h bytes for the one layer being recomputed, 2·s·h per checkpointed layer input) plus the fp32
logits of the completion tokens (and their gradient).

    python -m train.memory_plan            # markdown table (pasted into docs/training.md by --write-docs)
    python -m train.memory_plan --write-docs docs/training.md
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from train.freeze import parameter_group
from train.tiny import build_config, build_tokenizer


GIB = 2**30
BEGIN, END = "<!-- memory-plan:begin -->", "<!-- memory-plan:end -->"


@dataclass(frozen=True)
class Shape:
    """The paper's per-device GRPO shape."""

    frames: int = 32
    frame_px: int = 448
    text_tokens: int = 400
    completion_tokens: int = 512
    group: int = 8
    lora_rank: int = 64


def parameter_counts() -> dict[str, int]:
    """Return parameter counts per group (`vit`, `projector`, `llm`) and per LLM part of the 8B model (meta device)."""
    from transformers import Qwen3VLForConditionalGeneration  # noqa: PLC0415

    config = build_config(build_tokenizer(), "8b")
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    counts = {"vit": 0, "projector": 0, "llm": 0, "lora": 0}
    text = config.text_config
    for name, param in model.named_parameters():
        counts[parameter_group(name)] += param.numel()
    r = Shape().lora_rank
    h, i, kv = text.hidden_size, text.intermediate_size, text.num_key_value_heads * text.head_dim
    per_layer = r * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 2 + (i + h))  # q, o, k, v, gate, up, down
    counts["lora"] = per_layer * text.num_hidden_layers
    counts["layers"], counts["hidden"], counts["vocab"] = text.num_hidden_layers, h, text.vocab_size
    counts["kv_dim"] = kv
    return counts


def _tokens(shape: Shape) -> tuple[int, int]:
    pairs, per_pair = shape.frames // 2, (shape.frame_px // 32) ** 2
    prompt = pairs * per_pair + pairs * 6 + shape.text_tokens
    return prompt, prompt + shape.completion_tokens


def plan(n_gpus_multi: int = 8) -> list[dict[str, object]]:
    """Return one row per training path with GiB per GPU and whether it fits 80 / 141 GB cards."""
    c, shape = parameter_counts(), Shape()
    total = c["vit"] + c["projector"] + c["llm"]
    trainable = c["projector"] + c["llm"]  # GRPO: projector + LLM, ViT frozen
    prompt, seq = _tokens(shape)
    h, layers = c["hidden"], c["layers"]
    act = (layers * 2 * seq * h + 34 * seq * h) + 2 * shape.completion_tokens * c["vocab"] * 4
    kv = 2 * layers * c["kv_dim"] * 2 * seq * shape.group
    n = n_gpus_multi
    rows = [
        ("1 GPU, full parameters, fp32 weights + bf16 autocast", 4 * total, 4 * trainable, 8 * trainable, 2 * total),
        (f"ZeRO-2 on {n} GPUs, full parameters (bf16 weights, fp32 masters sharded)",
         2 * total + 4 * trainable / n, 2 * trainable / n, 8 * trainable / n, 2 * total),
        (f"ZeRO-3 on {n} GPUs, full parameters (all states sharded, reference sharded)",
         (2 * total + 4 * trainable) / n, 2 * trainable / n, 8 * trainable / n, 2 * total / n),
        (f"1 GPU, LoRA r={shape.lora_rank} on the LLM + projector in full (bf16 frozen base)",
         2 * total + 4 * (c["lora"] + c["projector"]), 4 * (c["lora"] + c["projector"]),
         8 * (c["lora"] + c["projector"]), 2 * c["projector"]),
    ]  # fmt: skip
    out = []
    for name, weights, grads, optim, ref in rows:
        parts = {"weights": weights, "gradients": grads, "optimizer": optim, "reference": ref,
                 "activations": act, "kv_cache": kv}  # fmt: skip
        gib = {k: v / GIB for k, v in parts.items()}
        gib["total"] = sum(gib.values())
        out.append({"path": name, **gib, "fits_80": gib["total"] < 80 * 0.9, "fits_141": gib["total"] < 139 * 0.9})
    return out


def markdown(n_gpus_multi: int = 8) -> str:
    """Return the plan as a markdown table with the counts it was computed from."""
    c = parameter_counts()
    prompt, seq = _tokens(Shape())
    lines = [
        f"Computed by `python -m train.memory_plan` from the Qwen3-VL-8B config: ViT {c['vit'] / 1e9:.3f} B, "
        f"projector {c['projector'] / 1e9:.3f} B, LLM (incl. embeddings and lm_head) {c['llm'] / 1e9:.3f} B "
        f"parameters; LoRA r={Shape().lora_rank} adds {c['lora'] / 1e6:.0f} M. Sequence: {prompt} prompt + "
        f"{Shape().completion_tokens} completion tokens, G = {Shape().group}. GiB per GPU; 'fits' keeps 10 % headroom.",
        "",
        "| path | weights | gradients | AdamW | reference | activations | KV cache | total | fits 80 GB | fits H200 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in plan(n_gpus_multi):
        lines.append(
            f"| {r['path']} | {r['weights']:.1f} | {r['gradients']:.1f} | {r['optimizer']:.1f} | {r['reference']:.1f} "
            f"| {r['activations']:.1f} | {r['kv_cache']:.1f} | **{r['total']:.1f}** | {'yes' if r['fits_80'] else 'no'} "
            f"| {'yes' if r['fits_141'] else 'no'} |"
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
