"""Device check: one SFT step and one E-MRL GRPO step (with the verifier) on a Qwen3-VL-8B-shaped random model.

No internet is needed: the model is built from the config (random weights, bf16, on the GPU), the tokenizer is the
local BPE from `train.tiny`, and the data is a synthetic sft table with realistic sequence length (32 frames of
448², i.e. 16 x 196 = 3,136 video tokens per prompt). Prints and writes a JSON with tokens/s, step time and peak
memory per stage. `--tiny` runs the same code path on CPU with the tiny model and small frames (for CI).

    python -m train.device_check --output runs/device_check.json            # H200: ~8B model
    python -m train.device_check --tiny --output /tmp/device_check.json     # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from train.data import load_split
from train.grpo import VideoGRPOTrainer, build_grpo_trainer, make_grpo_config
from train.rewards import REWARD_NAMES
from train.sft import build_sft_trainer, make_sft_config
from train.synthetic import write_sft_table
from train.tiny import build_model, build_processor


logger = logging.getLogger(__name__)


class _StepTimer(TrainerCallback):
    """Record wall time per optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t0)


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_check(
    *,
    tiny: bool,
    work_dir: Path,
    n_frames: int,
    frame_px: int,
    num_generations: int,
    max_completion_length: int,
    verifier_tokens: int,
) -> dict[str, Any]:
    """Run the SFT and GRPO steps and return the measurements."""
    on_gpu = torch.cuda.is_available() and not tiny
    dtype = torch.bfloat16 if on_gpu else torch.float32
    results: dict[str, Any] = {
        "shape": "tiny" if tiny else "8b",
        "device": torch.cuda.get_device_name(0) if on_gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "n_frames": n_frames,
        "frame_px": frame_px,
    }
    t0 = time.perf_counter()
    processor = build_processor(min_image_pixels=32 * 32 if tiny else 65536)
    if on_gpu:
        with torch.device("cuda"):
            model = build_model(processor.tokenizer, "8b", dtype=dtype)
    else:
        model = build_model(processor.tokenizer, "tiny" if tiny else "8b", dtype=dtype)
    results["n_parameters"] = model.num_parameters()
    results["build_s"] = round(time.perf_counter() - t0, 2)
    table = write_sft_table(work_dir / "sft", n_train=num_generations, n_test=0, n_frames=n_frames, size_px=frame_px)
    dataset = load_split(table, "train")
    common = {"bf16": on_gpu, "use_cpu": not on_gpu, "report_to": "none", "save_strategy": "no", "logging_steps": 1}

    # SFT: one optimizer step, batch 1.
    _reset_peak()
    sft_args = make_sft_config(output_dir=str(work_dir / "sft_out"), max_steps=1, per_device_train_batch_size=1,
                               learning_rate=1e-5, **common)  # fmt: skip
    trainer = build_sft_trainer(model, processor, dataset, sft_args)
    timer = _StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    sample = trainer.data_collator([dataset[0]])
    seq = int(sample["input_ids"].shape[1])
    results["sft"] = {
        "step_s": round(timer.times[-1], 3),
        "seq_len": seq,
        "tokens_per_s": round(seq / timer.times[-1], 1),
        "peak_mem_gib": _peak_gib(),
    }
    del trainer
    t0 = time.perf_counter()
    model_dir = work_dir / "policy"
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    del model
    results["save_s"] = round(time.perf_counter() - t0, 2)

    # GRPO: one step, one prompt x num_generations completions, all three rewards (verifier included).
    _reset_peak()
    try:
        import emrl_data.scoring  # noqa: F401, PLC0415

        rewards = list(REWARD_NAMES)
    except ImportError:  # scoring not landed yet: still time the rollout + verifier-free loss
        rewards = None
        results["note"] = "emrl_data.scoring missing: GRPO ran with a completion-length reward, no verifier"
    args = make_grpo_config(
        processor,
        rewards or ["r_e"],
        output_dir=str(work_dir / "grpo_out"),
        max_steps=1,
        num_generations=num_generations,
        per_device_train_batch_size=num_generations,
        gradient_accumulation_steps=1,
        max_completion_length=max_completion_length,
        gradient_checkpointing=on_gpu,
        **common,
    )
    funcs = None if rewards else [lambda completions, **kw: [float(len(c[0]["content"]) % 5) for c in completions]]
    if funcs is not None:
        args.reward_weights = None
    trainer2: VideoGRPOTrainer = build_grpo_trainer(
        str(model_dir),
        dataset,
        args,
        rewards=rewards,
        reward_funcs=funcs,
        verifier_max_new_tokens=verifier_tokens,
        dtype="bfloat16" if on_gpu else "float32",
    )
    timer2 = _StepTimer()
    trainer2.add_callback(timer2)
    trainer2.train()
    logs = [h for h in trainer2.state.log_history if "loss" in h]
    verifier = next((getattr(f, "verifier", None) for f in trainer2.reward_funcs if hasattr(f, "verifier")), None)
    step = timer2.times[-1]
    n_tok = num_generations * (seq + max_completion_length)
    results["grpo"] = {
        "step_s": round(step, 3),
        "completions": num_generations,
        "tokens_per_s": round(n_tok / step, 1),
        "peak_mem_gib": _peak_gib(),
        "verifier_queries": verifier.n_queries if verifier is not None else 0,
        "logged": {k: v for k, v in (logs[-1] if logs else {}).items() if isinstance(v, int | float)},
    }
    return results


def main(argv: list[str] | None = None) -> None:
    """CLI: `python -m train.device_check [--tiny] --output PATH`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model, 8 frames of 64², CPU")
    parser.add_argument("--output", default="device_check.json")
    parser.add_argument("--n_frames", type=int, default=None)
    parser.add_argument("--frame_px", type=int, default=None)
    parser.add_argument("--num_generations", type=int, default=None)
    parser.add_argument("--max_completion_length", type=int, default=None)
    parser.add_argument("--verifier_tokens", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    defaults = (8, 64, 2, 12, 6) if args.tiny else (32, 448, 8, 128, 64)
    values = [
        d if v is None else v
        for v, d in zip(
            (args.n_frames, args.frame_px, args.num_generations, args.max_completion_length, args.verifier_tokens),
            defaults,
            strict=True,
        )
    ]
    with tempfile.TemporaryDirectory() as tmp:
        results = run_check(
            tiny=args.tiny,
            work_dir=Path(tmp),
            n_frames=values[0],
            frame_px=values[1],
            num_generations=values[2],
            max_completion_length=values[3],
            verifier_tokens=values[4],
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
