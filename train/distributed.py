"""Training across processes: launch checks, DeepSpeed on CPU, per-rank reports, rank-independent rollouts.

* `check_launch(stage, script_args, training_args)` runs first in `train.sft` / `train.grpo` (before any weight
  loads). It rebuilds the launch settings `accelerate launch` exports to each process (`WORLD_SIZE`,
  `ACCELERATE_USE_DEEPSPEED`, `ACCELERATE_DEEPSPEED_ZERO_STAGE`, `ACCELERATE_MIXED_PRECISION`, ...) and applies the
  same rules as `train.checks.validate_launch` on the YAML files (the launchers run that one before
  `accelerate launch`): a ZeRO stage needs DeepSpeed installed, bf16 compute on GPU with fp32 weights, processes x
  micro-batch x accumulation = the configured completions (samples) per step, whole GRPO groups per generation batch.
* `prepare_deepspeed_cpu()`: DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce kernel when its
  communication backend starts (≈2 min on 2 cores, needs a C++ compiler). Training never uses it (ZeRO's
  collectives go through `torch.distributed` on gloo; the kernel serves DeepSpeed inference's all-reduce), so
  without a GPU it is marked unavailable and nothing is compiled.
* `RankReport`: with `EMRL_RANK_REPORT_DIR=DIR` in the environment each rank writes `DIR/rank<r>.json` at the end of
  training (checksum of the full trainable weights, gathered under ZeRO-3; verifier calls and queries; losses and
  rewards logged) and `DIR/rank<r>.step<n>` when optimizer step n begins. The multi-process tests read them.
* `prompt_seeded_rng(...)`: rollouts drawn from a generator seeded by (seed, optimizer step, the prompts' token ids),
  so a run samples the same completions for the same prompts whatever the number of processes (`rollout_seed:
  prompt` in a GRPO config). The default (`global`) keeps the process-global generator.
* `end_process_group()` then `leave_launched_rank()`: the last steps of `train.sft` / `train.grpo` on every rank: a
  barrier, the process groups torn down, then, in a process of a multi-process launch, `os._exit(0)` after flushing.
  The interpreter's own exit finalizes objects in no set order, and torch.distributed's C++ side (gloo's worker
  threads, asynchronous work that DeepSpeed's ZeRO-3 keeps holding tensors) can be destroyed there: a thread destroyed
  while joinable, or one taking the GIL of a finalizing interpreter, aborts the rank (`terminate called without an
  active exception`, SIGABRT) after its work is written. The barrier and teardown alone left 1 abort in a loaded
  full test run; no rank of a launch goes through that finalization.
* Collective timeout: `ddp_timeout` (seconds, TrainingArguments) is the process-group timeout for DDP and DeepSpeed
  (gloo and NCCL); a rank that waits longer on a collective (its peer died or skipped it) raises instead of hanging,
  and `accelerate launch` (torchrun) then stops the other ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from train.checks import TrainConfigError, check_launch_settings


RANK_REPORT_ENV = "EMRL_RANK_REPORT_DIR"
DEEPSPEED_INSTALL = "DS_BUILD_OPS=0 pip install --no-build-isolation '.[deepspeed]' (deepspeed==0.19.8, no op builds)"


def _truthy(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes")


def launch_settings_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Return the launch as an accelerate-config dict, read from what `accelerate launch` exports to each process.

    Without `accelerate launch` (plain `python -m`), a single process with no DeepSpeed and no mixed-precision key.
    """
    env = os.environ if env is None else env
    acc: dict[str, Any] = {"num_processes": int(env.get("WORLD_SIZE", "1") or 1)}
    if "ACCELERATE_MIXED_PRECISION" in env:
        acc["mixed_precision"] = env["ACCELERATE_MIXED_PRECISION"]
    if "ACCELERATE_USE_CPU" in env:
        acc["use_cpu"] = _truthy(env["ACCELERATE_USE_CPU"])
    if _truthy(env.get("ACCELERATE_USE_DEEPSPEED")):
        ds: dict[str, Any] = {}
        if env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"):
            ds["zero_stage"] = int(env["ACCELERATE_DEEPSPEED_ZERO_STAGE"])
        for key in ("offload_optimizer_device", "offload_param_device"):
            if f"ACCELERATE_DEEPSPEED_{key.upper()}" in env:
                ds[key] = env[f"ACCELERATE_DEEPSPEED_{key.upper()}"]
        if "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL" in env:
            ds["zero3_save_16bit_model"] = _truthy(env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"])
        if "ACCELERATE_DEEPSPEED_ZERO3_INIT" in env:
            ds["zero3_init_flag"] = _truthy(env["ACCELERATE_DEEPSPEED_ZERO3_INIT"])
        acc.update(distributed_type="DEEPSPEED", deepspeed_config=ds)
    elif acc["num_processes"] > 1:
        acc["distributed_type"] = "MULTI_GPU"
    return acc


def training_settings(stage: str, script_args: Any, training_args: Any) -> dict[str, Any]:
    """Return the keys of the parsed training config that the launch rules read (`use_cpu` is true without CUDA)."""
    train = {
        "bf16": bool(training_args.bf16),
        "use_cpu": bool(training_args.use_cpu) or not torch.cuda.is_available(),
        "dtype": script_args.dtype,
        "lora_r": int(getattr(script_args, "lora_r", 0)),
        "per_device_train_batch_size": int(training_args.per_device_train_batch_size),
        "gradient_accumulation_steps": int(training_args.gradient_accumulation_steps),
    }
    per_step = getattr(script_args, "completions_per_step" if stage == "grpo" else "samples_per_step", None)
    if per_step is not None:
        train["completions_per_step" if stage == "grpo" else "samples_per_step"] = int(per_step)
    if stage == "grpo":
        train["num_generations"] = int(training_args.num_generations)
        train["steps_per_generation"] = training_args.steps_per_generation
    return train


def check_launch(stage: str, script_args: Any, training_args: Any, env: Mapping[str, str] | None = None) -> None:
    """Refuse an inconsistent launch before any weight loads (one-line `TrainConfigError`).

    Args:
        stage: "sft" or "grpo".
        script_args: the parsed `SftScriptArguments` / `GrpoScriptArguments`.
        training_args: the parsed `SFTConfig` / `GRPOConfig`.
        env: the environment (the process's by default).

    Raises:
        TrainConfigError: naming each inconsistent setting and the fix.
    """
    if stage == "grpo" and getattr(script_args, "rollout_seed", "global") not in ("global", "prompt"):
        raise TrainConfigError(f"rollout_seed={script_args.rollout_seed!r} is unknown; use global or prompt.")
    acc = launch_settings_from_env(env)
    if acc.get("distributed_type") == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:
        stage_no = acc["deepspeed_config"].get("zero_stage", "?")
        raise TrainConfigError(
            f"the launch asks for DeepSpeed ZeRO-{stage_no} but deepspeed is not installed; "
            f"install it with {DEEPSPEED_INSTALL}, or launch with train/launch/ddp.yaml."
        )
    problems = check_launch_settings(acc, training_settings(stage, script_args, training_args))
    if problems:
        raise TrainConfigError(f"{stage} launch ({acc['num_processes']} processes): " + "; ".join(problems))
    if stage == "sft" and acc.get("deepspeed_config", {}).get("zero_stage") == 3:
        if acc["deepspeed_config"].get("zero3_init_flag") and script_args.model_name_or_path is None:
            raise TrainConfigError(
                "ZeRO-3 with zero3_init_flag builds the weights sharded from a checkpoint; pass "
                "--model_name_or_path (python -m train.tiny.model --output_dir D writes a tiny one)."
            )


def end_process_group() -> None:
    """Every rank waits for the others, then the process group is torn down: its gloo threads are joined before the
    interpreter exits. Left alive, a rank exiting while its peer still writes the checkpoint could abort at exit
    (`terminate called without an active exception`, SIGABRT: a C++ thread destroyed while joinable). No-op in a single
    process."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def leave_launched_rank(env: Mapping[str, str] | None = None) -> None:
    """In a process of a multi-process launch (`WORLD_SIZE` > 1), flush the log handlers and standard streams, then
    end the process with status 0 without the interpreter's finalization (see the module doc); otherwise return.

    Call it last: nothing after it runs, atexit handlers included."""
    env = os.environ if env is None else env
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def prepare_deepspeed_cpu(env: Mapping[str, str] | None = None) -> bool:
    """Under DeepSpeed without CUDA, mark DeepSpeed's shared-memory all-reduce op unavailable (no JIT build).

    Returns True when it did so. Safe to call without DeepSpeed (returns False).
    """
    env = os.environ if env is None else env
    if not _truthy(env.get("ACCELERATE_USE_DEEPSPEED")) or importlib.util.find_spec("deepspeed") is None:
        return False
    if torch.cuda.is_available():
        return False
    import deepspeed.ops  # lazy: deepspeed is the optional `deepspeed` extra

    ops = dict(deepspeed.ops.__compatible_ops__)  # probed lazily by the module's __getattr__
    ops["deepspeed_shm_comm"] = False
    deepspeed.ops.__compatible_ops__ = ops
    return True


def policy_load_kwargs(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`from_pretrained` keyword arguments that load the policy straight onto this rank's GPU (no host copy).

    `{"device_map": {"": "cuda:<LOCAL_RANK>"}}` with CUDA, except under ZeRO-3 (`zero.Init` shards the weights at
    load and refuses a device map); `{}` on CPU. Host memory per node per path: `train.tools.memory_plan.host_plan`.
    """
    env = os.environ if env is None else env
    if not torch.cuda.is_available():
        return {}
    if launch_settings_from_env(env).get("deepspeed_config", {}).get("zero_stage") == 3:
        return {}
    return {"device_map": {"": f"cuda:{int(env.get('LOCAL_RANK', '0') or 0)}"}}


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def trainable_checksum(model: Any) -> tuple[str, int]:
    """Return (sha256 of every trainable parameter's full fp32 value in name order, element count).

    Under ZeRO-3 the partitioned parameters are gathered first (a collective: call it on every rank).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    gather: Any = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for _, p in named):
        import deepspeed  # lazy: the optional `deepspeed` extra (a ZeRO-3 model means it is installed)

        gather = deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None)
    digest, count = hashlib.sha256(), 0
    with gather, torch.no_grad():
        for name, param in named:
            value = param.detach().to(torch.float32).cpu().contiguous()
            digest.update(name.encode())
            digest.update(value.numpy().tobytes())
            count += value.numel()
    return digest.hexdigest(), count


def _verifier_counts(trainer: Any) -> dict[str, int] | None:
    for func in getattr(trainer, "reward_funcs", []) or []:
        verifier = getattr(func, "verifier", None)
        if verifier is not None:
            return {"calls": verifier.n_calls, "queries": verifier.n_queries}
    return None


def _make_rank_report() -> Any:
    class RankReport(TrainerCallback):
        """Write `rank<r>.step<n>` when step n begins and `rank<r>.json` at the end (see the module docstring)."""

        def __init__(self, directory: str | Path) -> None:
            self.directory = Path(directory)
            self.trainer: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rank, _ = _rank()
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / f"rank{rank}.step{state.global_step + 1}").write_text(str(os.getpid()))

        def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            rank, world = _rank()
            checksum, n = trainable_checksum(model)
            logs = state.log_history
            report = {
                "rank": rank,
                "world_size": world,
                "global_step": state.global_step,
                "trainable_sha256": checksum,
                "trainable_numel": n,
                "verifier": _verifier_counts(self.trainer),
                "loss": [h["loss"] for h in logs if "loss" in h],
                "logs": [h for h in logs if "loss" in h],
            }
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / f"rank{rank}.json").write_text(json.dumps(report, sort_keys=True))

    return RankReport


def add_rank_report(trainer: Any, env: Mapping[str, str] | None = None) -> Any:
    """Attach a `RankReport` when `EMRL_RANK_REPORT_DIR` is set; return `trainer`."""
    env = os.environ if env is None else env
    directory = env.get(RANK_REPORT_ENV)
    if directory:
        report = _make_rank_report()(directory)
        report.trainer = trainer
        trainer.add_callback(report)
    return trainer


def prompt_seed(seed: int, step: int, prompt_ids: Sequence[Sequence[int]]) -> int:
    """Return a 63-bit seed from the run seed, the optimizer step and the prompts' token ids (in order).

    >>> prompt_seed(0, 1, [[1, 2], [3]]) == prompt_seed(0, 1, [[1, 2], [3]]) != prompt_seed(0, 2, [[1, 2], [3]])
    True
    """
    digest = hashlib.sha256(f"{seed}:{step}:".encode())
    for ids in prompt_ids:
        digest.update(",".join(map(str, ids)).encode() + b";")
    return int.from_bytes(digest.digest()[:8], "little") >> 1


@contextlib.contextmanager
def prompt_seeded_rng(seed: int, step: int, prompt_ids: Sequence[Sequence[int]]) -> Iterator[int]:
    """Seed torch's generators (CPU and this process's GPU) by `prompt_seed` inside the block, restored after."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    value = prompt_seed(seed, step, prompt_ids)
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(value)
        yield value
