"""Device check: one SFT step and one E-MRL GRPO step (accumulation 2, verifier in the loop, KL on) on one GPU.

Qwen3-VL-8B-shaped random model built in memory (no download), 32 frames of 448² (3,136 video tokens), G = 8, up to
512-token completions. It follows the single-GPU memory plan (`docs/training.md`): fp32 masters for everything that
trains, bf16 for frozen weights and compute. It must finish within 6 minutes (`train/tools/device_check.sh` stops it
at 360 s, `DEVICE_CHECK_TIMEOUT_S`).

* SFT step: ViT + projector train (fp32), the LLM is frozen (bf16).
* The SFT trainer is freed (no reference cycle keeps it) before GRPO; the same model object goes on: no save/reload.
* GRPO step: LoRA on the LLM + projector in full (fp32), the ViT frozen (bf16); the reference model is the base with
  the adapters disabled (no second copy), beta = 0.01 so the KL term runs; gradient accumulation 2 over two rows (a
  positive and a negative, one group of G each, `steps_per_generation: 1`).
* r_c in the loop: `sequence_bias` pushes the random policy towards the positive row's report (`report_bias`), so the
  rollouts name a usable key frame and the verifier answers inside the step (asserted: >= 1 query).
* Rewards: r_e, r_f, r_c (weights from `ScoringConfig`) + `r_overlap` (character-bigram overlap of the completion with the report, weight 0.1), which
  varies within every group, so the check can assert a nonzero policy gradient. Ids beyond the report tokenizer
  (the 8B vocabulary is 151,936) are suppressed, so every sampled token decodes.
* No full-model copies: parameter changes are judged on <= 4096 evenly spaced samples per tensor kept on the GPU.
* `plan_8b`: the 8B GRPO LoRA model on the meta device, its trainable parameters checked against `train.tools.memory_plan`
  (the CPU rehearsal runs it too); on the GPU the JSON line gives the measured peak over the planned GiB.

Asserts: finite losses, nonzero gradient norms, changed/unchanged parameter groups, >= 1 verifier query in the loop,
a finite KL, peak memory below the card's capacity (margin printed); and that the processor, saved as `train/` saves
checkpoints, loads with stock `AutoProcessor` as a `Qwen3VLProcessor` with a `Qwen3VLVideoProcessor` whose encoding
equals `encode_ct_video` (needs torchvision, so skipped with a printed reason under `--tiny`). Prints one
JSON line. `--tiny` runs the same code on CPU with the tiny model (suite; the rehearsal).

    python3 -m train.tools.device_check --output $OUT/device_check.json
    python3 -m train.tools.device_check --tiny --output /tmp/device_check.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoProcessor, TrainerCallback

from model_io.video import encode_ct_video, frames_to_array
from train.data import load_split, to_grpo_dataset
from train.freeze import parameter_group, set_stage_trainable
from train.grpo import _apply_lora, make_grpo_config
from train.grpo_trainer import VideoGRPOTrainer
from train.rewards import REWARD_NAMES, Verifier, completion_text, make_reward_funcs, reward_weights_for
from train.sft import build_sft_trainer, make_sft_config
from train.tiny.model import build_model, build_processor
from train.tiny.synthetic import write_sft_table
from train.tools.memory_plan import parameter_counts, plan


class _StepStats(TrainerCallback):
    """Record wall time and gradient norm per optimizer step."""

    def __init__(self, model: Any) -> None:
        self.model, self._t0 = model, 0.0
        self.times: list[float] = []
        self.grad_norms: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _sync()
        self._t0 = time.perf_counter()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        grads = [p.grad.float().norm() for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        self.grad_norms.append(float(torch.stack(grads).norm()) if grads else 0.0)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _sync()
        self.times.append(time.perf_counter() - self._t0)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def _reset_peak() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _bigrams(text: str) -> set[str]:
    return {text[i : i + 2] for i in range(len(text) - 1)}


def r_overlap(completions: list[Any], report: list[str], **kwargs: Any) -> list[float]:
    """Share of the row report's character bigrams that the completion contains (varies even at random init)."""
    out = []
    for completion, truth in zip(completions, report, strict=True):
        grams = _bigrams(truth)
        out.append(len(grams & _bigrams(completion_text(completion))) / max(1, len(grams)))
    return out


FINGERPRINT_SAMPLES = 4096  # elements kept per parameter, on its device (no full-model copy, no host transfer)


def _sample(p: torch.Tensor) -> torch.Tensor:
    flat = p.detach().reshape(-1)
    step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
    return flat[::step][:FINGERPRINT_SAMPLES].clone()


def _snapshot(model: Any) -> dict[str, torch.Tensor]:
    """Evenly spaced samples of every parameter (<= 4096 each), kept on the GPU: an AdamW step moves nearly every
    element, so a changed parameter shows in its samples; a frozen one keeps them bitwise."""
    return {n: _sample(p) for n, p in model.named_parameters()}


def _changed_groups(before: dict[str, torch.Tensor], model: Any) -> tuple[set[str], set[str]]:
    """Return (groups with a changed tensor, groups with an unchanged tensor), base names without peft prefixes."""
    changed: set[str] = set()
    same: set[str] = set()
    for name, p in model.named_parameters():
        if name in before:
            group = parameter_group(name.replace("base_model.model.", "").replace(".base_layer", ""))
            (same if torch.equal(before[name], _sample(p)) else changed).add(group)
    return changed, same


def report_bias(processor: Any, report: str, bias: float = 12.0) -> list:
    """`generation_kwargs.sequence_bias` entries that push a random policy towards `report` (then EOS).

    +`bias` logits on each report token given the chat template's last two tokens and the report so far, so the
    rollouts mostly write the row's report, name its key frame and r_c queries the verifier in the loop; completions
    that drift off it still vary the rewards within the group.
    """
    tok = processor.tokenizer
    ids = tok(report, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(tok.eos_token)]
    text = processor.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    tail = tok(text, add_special_tokens=False)["input_ids"][-2:]
    return [[tail + ids[: i + 1], bias] for i in range(len(ids))]


def _cast_frozen(model: Any, dtype: torch.dtype) -> None:
    """Store frozen parameters in `dtype` (bf16 on GPU); trainable ones stay fp32 (the master copy)."""
    for p in model.parameters():
        p.data = p.data.to(torch.float32 if p.requires_grad else dtype)


def _sft_step(model: Any, processor: Any, dataset: Any, work: Path, common: dict, frozen: torch.dtype) -> dict:
    set_stage_trainable(model, "sft")
    _cast_frozen(model, frozen)
    before = _snapshot(model)
    args = make_sft_config(
        output_dir=str(work / "sft"),
        max_steps=1,
        per_device_train_batch_size=1,
        learning_rate=1e-4,
        gradient_checkpointing=True,
        **common,
    )
    trainer = build_sft_trainer(model, processor, dataset, args)
    stats = _StepStats(model)
    trainer.add_callback(stats)
    _reset_peak()
    trainer.train()
    seq = int(trainer.data_collator([dataset[0]])["input_ids"].shape[1])
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]
    changed, same = _changed_groups(before, model)
    out = {
        "step_s": round(stats.times[-1], 3),
        "seq_len": seq,
        "tokens_per_s": round(seq / stats.times[-1], 1),
        "loss": loss,
        "grad_norm": stats.grad_norms[-1],
        "peak_mem_gib": round(_peak_gib(), 2),
        "changed": sorted(changed),
        "unchanged": sorted(same),
    }
    trainer.callback_handler.callbacks.clear()
    del trainer, stats
    gc.collect()  # the SFT trainer (and its optimizer state) is gone before GRPO allocates
    return out


def _grpo_steps(model: Any, processor: Any, dataset: Any, work: Path, common: dict, shape: dict) -> dict:
    set_stage_trainable(model, "grpo")
    model = _apply_lora(model, shape["lora_r"], 2 * shape["lora_r"])
    _cast_frozen(model, shape["frozen"])
    before = _snapshot(model)
    vocab_extra = list(range(len(processor.tokenizer), model.config.text_config.vocab_size))
    positive = next(r for r in dataset if r["has_lesion"])  # the rollouts are pushed towards its report (r_c in loop)
    args = make_grpo_config(
        processor,
        [*REWARD_NAMES, "r_overlap"],
        reward_weights=[*reward_weights_for(REWARD_NAMES), 0.1],
        output_dir=str(work / "grpo"),
        max_steps=1,
        num_generations=shape["group"],
        beta=0.01,
        per_device_train_batch_size=shape["group"],
        gradient_accumulation_steps=2,
        steps_per_generation=1,
        max_completion_length=shape["completion"],
        gradient_checkpointing=True,
        learning_rate=1e-4,
        generation_kwargs={
            "suppress_tokens": vocab_extra,
            "sequence_bias": report_bias(processor, positive["report"]),
        },
        **common,
    )
    verifier = Verifier(max_new_tokens=shape["verifier"])
    funcs = [*make_reward_funcs(REWARD_NAMES, verifier=verifier), r_overlap]
    rows = _grpo_rows(dataset.select(range(2)))  # a positive and a negative row: one group each per micro-step
    trainer = VideoGRPOTrainer(
        model=model, reward_funcs=funcs, args=args, train_dataset=rows, processing_class=processor
    )
    stats = _StepStats(trainer.model)
    trainer.add_callback(stats)
    _reset_peak()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    changed, same = _changed_groups(before, trainer.model)
    in_loop_queries = verifier.n_queries
    # Also time one full verifier batch (G key frames) directly.
    frames = frames_to_array(dataset[0]["frames"])
    _sync()
    t0 = time.perf_counter()
    answers = verifier([frames[len(frames) // 2]] * shape["group"])
    _sync()
    verifier_s = time.perf_counter() - t0
    n_tok = shape["group"] * (shape["prompt_len"] + shape["completion"])
    return {
        "step_s": [round(t, 3) for t in stats.times],
        "tokens_per_s": round(n_tok / min(stats.times), 1),
        "loss": [h["loss"] for h in logs],
        "grad_norm": stats.grad_norms,
        "peak_mem_gib": round(_peak_gib(), 2),
        "verifier_queries": in_loop_queries,
        "verifier_batch_s": round(verifier_s, 3),
        "verifier_answers": len(answers),
        "reward": [h.get("reward") for h in logs],
        "r_c": [h.get("rewards/r_c/mean") for h in logs],
        "kl": [h.get("kl") for h in logs],
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "frac_reward_zero_std": [h.get("frac_reward_zero_std") for h in logs],
        "changed": sorted(changed),
        "unchanged": sorted(same),
    }


def auto_processor_check(processor: Any, config: Any, work: Path, frames: Any) -> dict[str, Any]:
    """Save the processor as every `train/` checkpoint is saved; load it back with stock `AutoProcessor`.

    Asserts that transformers resolves a `Qwen3VLProcessor` with a `Qwen3VLVideoProcessor` (needs torchvision) and
    that the stock video processor, with the saved settings and `video_metadata` fps = 1, gives the pixels and grid
    of `encode_ct_video` (max |diff| <= 1e-6).

    Args:
        processor: the training processor (`CTQwen3VLProcessor`).
        config: the model config (written beside the processor files, as in a checkpoint).
        work: a scratch folder; the files go to `work/checkpoint`.
        frames: `(N, H, W)` uint8 frames to encode both ways.
    """
    ckpt = work / "checkpoint"
    processor.save_pretrained(ckpt)
    config.save_pretrained(ckpt)
    stock = AutoProcessor.from_pretrained(ckpt)
    names = (type(stock).__name__, type(getattr(stock, "video_processor", None)).__name__)
    assert names == ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"), f"AutoProcessor loaded {names}"
    n = len(frames)
    meta = [{"total_num_frames": n, "fps": 1.0, "frames_indices": list(range(n))}]
    out = stock.video_processor(
        videos=[np.repeat(frames[..., None], 3, axis=-1)], video_metadata=meta, return_tensors="pt"
    )
    pixels, grid, _ = encode_ct_video(frames)
    assert out["video_grid_thw"].tolist() == grid.tolist(), (out["video_grid_thw"].tolist(), grid.tolist())
    diff = float((out["pixel_values_videos"].float() - pixels).abs().max())
    assert diff <= 1e-6, f"stock video processor differs from encode_ct_video by {diff}"
    return {
        "processor": names[0],
        "video_processor": names[1],
        "video_grid_thw": grid.tolist()[0],
        "video_pixels_max_abs_diff": diff,
    }


def _auto_processor_step(processor: Any, config: Any, work: Path, frames: Any, tiny: bool) -> dict[str, Any]:
    """Run `auto_processor_check` on the GPU machine; on CPU (`--tiny`) skip it with a printed reason."""
    reason = None
    if tiny:
        reason = (
            "--tiny (CPU): torchvision cannot be imported next to the CPU torch; tests/train/"
            "test_standard_checkpoint.py runs this check in a torchvision subprocess"
        )
    elif importlib.util.find_spec("torchvision") is None:
        reason = "torchvision is not installed here, and Qwen3VLVideoProcessor requires it"
    if reason is not None:
        print(f"device check: AutoProcessor step skipped: {reason}")
        return {"skipped": reason}
    return auto_processor_check(processor, config, work, frames)


def plan_8b(lora_r: int = 64) -> dict[str, Any]:
    """The 8B shape on the meta device (no memory): the GRPO LoRA model's trainable parameters per group, checked
    against `train.tools.memory_plan`'s counts, and the plan's GiB for this path (the check's peak is compared with it)."""
    processor = build_processor()
    with torch.device("meta"):
        model = build_model(processor.tokenizer, "8b")
    set_stage_trainable(model, "grpo")
    model = _apply_lora(model, lora_r, 2 * lora_r)
    groups: dict[str, int] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            group = "lora" if "lora_" in name else parameter_group(name.replace("base_model.model.", ""))
            groups[group] = groups.get(group, 0) + p.numel()
    counts, row = parameter_counts(), plan()[3]
    assert groups.get("lora") == counts["lora"], (groups, counts["lora"])  # the plan counts what LoRA trains
    assert groups.get("projector") == counts["projector"], (groups, counts["projector"])
    assert "vit" not in groups, groups
    return {
        "trainable_m": {k: round(v / 1e6, 1) for k, v in sorted(groups.items())},
        "planned_gib": round(float(row["total"]), 1),  # type: ignore[arg-type]
        "path": row["path"],
    }


def _grpo_rows(dataset: Any) -> Any:
    return to_grpo_dataset(dataset)


def _assert_results(res: dict) -> None:
    sft, grpo = res["sft"], res["grpo"]
    assert math.isfinite(sft["loss"]) and all(math.isfinite(v) for v in grpo["loss"]), "non-finite loss"
    assert sft["grad_norm"] > 0 and all(g > 0 for g in grpo["grad_norm"]), "zero gradient"
    assert set(sft["changed"]) == {"vit", "projector"} and "llm" in sft["unchanged"], sft
    assert {"projector", "llm"} <= set(grpo["changed"]) and "vit" not in grpo["changed"], grpo
    assert grpo["verifier_queries"] >= 1, "r_c never queried the verifier in the loop"
    assert all(k is not None and math.isfinite(k) for k in grpo["kl"]), "the KL term (reference model) did not run"
    if res["capacity_gib"]:
        assert max(sft["peak_mem_gib"], grpo["peak_mem_gib"]) < res["capacity_gib"], "peak memory over capacity"


def run_check(*, tiny: bool, work_dir: Path) -> dict[str, Any]:
    """Run the SFT step and the GRPO steps, assert, and return the measurements."""
    on_gpu = torch.cuda.is_available() and not tiny
    shape: dict[str, Any] = {
        "frames": 8,
        "px": 64,
        "group": 4,
        "completion": 120,
        "verifier": 6,
        "lora_r": 4,
        "frozen": torch.float32,
    }
    if not tiny:
        shape = {
            "frames": 32,
            "px": 448,
            "group": 8,
            "completion": 512,
            "verifier": 64,
            "lora_r": 64,
            "frozen": torch.bfloat16 if on_gpu else torch.float32,
        }
    t0 = time.perf_counter()
    processor = build_processor(min_image_pixels=32 * 32 if tiny else 65536)
    with torch.device("cuda" if on_gpu else "cpu"):
        model = build_model(processor.tokenizer, "tiny" if tiny else "8b")
    capacity = torch.cuda.get_device_properties(0).total_memory / 2**30 if on_gpu else 0.0
    res: dict[str, Any] = {
        "shape": "tiny" if tiny else "8b",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "n_parameters": model.num_parameters(),
        "capacity_gib": round(capacity, 1),
        "frames": shape["frames"],
        "frame_px": shape["px"],
    }
    table = write_sft_table(
        work_dir / "table", n_train=shape["group"], n_test=0, n_frames=shape["frames"], size_px=shape["px"]
    )
    dataset = load_split(table, "train")
    res["build_s"] = round(time.perf_counter() - t0, 1)
    frames = frames_to_array(dataset[0]["frames"])
    res["plan_8b"] = plan_8b()
    res["auto_processor"] = _auto_processor_step(processor, model.config, work_dir, frames, tiny)
    common = {"bf16": on_gpu, "use_cpu": not on_gpu, "report_to": "none", "save_strategy": "no", "logging_steps": 1}
    res["sft"] = _sft_step(model, processor, dataset, work_dir, common, shape["frozen"])
    shape["prompt_len"] = res["sft"]["seq_len"]
    res["grpo"] = _grpo_steps(model, processor, dataset, work_dir, common, shape)
    peak = max(res["sft"]["peak_mem_gib"], res["grpo"]["peak_mem_gib"])
    res["memory_margin_gib"] = round(capacity - peak, 1) if on_gpu else None
    res["peak_over_plan"] = round(peak / res["plan_8b"]["planned_gib"], 2) if on_gpu else None
    res["total_s"] = round(time.perf_counter() - t0, 1)
    _assert_results(res)
    return res


def main(argv: list[str] | None = None) -> None:
    """CLI: `python3 -m train.tools.device_check [--tiny] --output PATH`; prints one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model, 8 frames of 64², CPU")
    parser.add_argument("--output", default="device_check.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = run_check(tiny=args.tiny, work_dir=Path(tmp))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(results, separators=(",", ":"))
    out.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
