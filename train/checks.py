"""Input and precision checks of the training CLIs: one-line errors that name the problem and the fix.

Precision rule (docs/contract.md#training-recipe, docs/training.md#precision-fp32-master-weights-on-every-path): every trainable parameter is fp32 (the master copy);
bf16 is used only for compute (`bf16: true` = autocast / DeepSpeed bf16 with fp32 masters) and, in the LoRA path, for
frozen weights. AdamW at lr 5e-6 on bf16 weights rounds most updates away (bf16 keeps 8 significant bits, a relative
step of 2^-9 ≈ 0.2 %), so a bf16 model with a bf16 optimizer state is refused, not trained.

`python -m train.checks ACCEL_YAML TRAINING_YAML` runs before every launch: at import this module loads the standard
library, `yaml` and `emrl_data` only; torch, transformers and pyarrow are imported by the checks that use them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from emrl_data.text.scoring import TRUTH_COLUMNS


# Columns `train.sft` / `train.grpo` read from a table folder (the `sft` layout; rl_hardset carries them too).
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "sft": ("organ", "frames", "prompt", "report"),
    "grpo": ("frames", "prompt", *TRUTH_COLUMNS),  # the rewards score against the truth columns
}
FULL_PRECISION = ("float32",)
HALF_PRECISION = ("bfloat16", "float16")


class TrainConfigError(ValueError):
    """A user-facing configuration or input error; the CLIs print its message as one line and exit 2."""


class SeedMissed(TrainConfigError):
    """A seed's model missed a gate before its arms trained (the warm-up's targets, the SFT policy's check): a study
    excludes the seed instead of training on."""


def config_dict(value: dict[str, Any] | str | None, name: str) -> dict[str, Any]:
    """A copy of a config field that TRL types `dict | str | None`: a dict, or empty when unset.

    `TrainingArguments` parses a JSON string given for such a field when the config is built, so a string left here
    is one it could not parse.

    Raises:
        TrainConfigError: naming the field, when it is still a string.
    """
    if isinstance(value, str):
        raise TrainConfigError(f"{name}={value!r} is not a JSON object; give {name} as a mapping in the YAML.")
    return dict(value or {})


class RunStopped(RuntimeError):
    """A run stopped mid-way by bad input or a failed component (a row whose frames do not decode, a vLLM engine that
    died, a rollout prompt vLLM built differently): the CLIs print its message as one line and exit 1; checkpoints
    already saved stay as they are."""


def check_precision(dtype: str, *, lora: bool = False) -> None:
    """Refuse trainable weights stored below fp32 (no master copy).

    Args:
        dtype: the `dtype` key (dtype the weights are loaded in).
        lora: the LoRA path, where `dtype` applies to the frozen base only (adapters and projector stay fp32).

    Raises:
        TrainConfigError: on an unknown dtype, or a half dtype for full-parameter training.
    """
    if dtype not in FULL_PRECISION + HALF_PRECISION:
        raise TrainConfigError(f"dtype={dtype!r} is unknown; use float32 (with bf16: true for bf16 compute).")
    if dtype in HALF_PRECISION and not lora:
        raise TrainConfigError(
            f"dtype={dtype} trains {dtype} weights with a {dtype} AdamW state and no fp32 master copy "
            "(updates at lr 5e-6 round away); set dtype: float32 and bf16: true (fp32 master weights, bf16 compute)."
        )


def require_fp32_trainable(model: Any) -> None:
    """Raise unless every trainable parameter is fp32 (the optimizer then keeps fp32 state and masters).

    Raises:
        TrainConfigError: naming the first offending parameter.
    """
    import torch  # lazy: `python -m train.checks` runs before every launch without torch (+3 s, measured)

    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype != torch.float32:
            raise TrainConfigError(
                f"trainable parameter {name} is {param.dtype}, not fp32: an optimizer step would round most updates "
                "away; load with dtype: float32 and use bf16: true for bf16 compute."
            )


def check_columns(dataset_dir: str | Path, columns: Iterable[str], stage: str) -> None:
    """Raise when the table lacks a column `stage` reads.

    Raises:
        TrainConfigError: naming the missing columns and the table.
    """
    missing = [c for c in REQUIRED_COLUMNS[stage] if c not in set(columns)]
    if missing:
        raise TrainConfigError(
            f"dataset {dataset_dir} lacks the columns {missing} that {stage} reads; pass a table folder written by "
            "`emrl build-sft-set` (sft) or `emrl build-rl-hardset` (rl_hardset)."
        )


def check_frames(n_frames: int, limit: int) -> None:
    """Raise when a row has more frames than `limit` (`max_frames` of the run).

    Raises:
        TrainConfigError: naming the count, the limit and the fix.
    """
    if n_frames > limit:
        raise TrainConfigError(
            f"a row has {n_frames} frames, more than max_frames={limit}; rebuild the set with fewer frames "
            f"(frames.max_frames) or raise --max_frames if the model's context allows it."
        )


def max_frames_in(dataset: Any) -> int:
    """Return the largest frame count of a `datasets.Dataset` with a `frames` list column (0 when empty)."""
    import pyarrow.compute as pc  # lazy: pyarrow.compute adds 0.1 s to that pre-launch check (measured)

    if len(dataset) == 0:
        return 0
    lengths = pc.list_value_length(dataset.data.column("frames"))
    return int(pc.max(lengths).as_py() or 0)


def check_qwen3_vl_checkpoint(path: str | None) -> None:
    """Raise when a local checkpoint is not a Qwen3-VL model (its config.json `model_type` is not `qwen3_vl`).

    Hub ids (no local folder) are not checked here; `from_pretrained` checks them.

    Raises:
        TrainConfigError: naming the found model type.
    """
    if path is None or not Path(path).exists():
        return
    config = Path(path) / "config.json"
    if not config.is_file():
        raise TrainConfigError(f"{path} has no config.json; pass a Qwen3-VL checkpoint folder (model + processor).")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type != "qwen3_vl":
        raise TrainConfigError(
            f"{path} is a {model_type!r} checkpoint, not Qwen3-VL (model_type qwen3_vl); pass a Qwen3-VL checkpoint "
            "such as Qwen/Qwen3-VL-8B-Instruct or a folder written by train.sft."
        )


def _say(line: str) -> None:
    """Print an error line on stderr once per launch (local rank 0, or a process outside `accelerate launch`)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(line, file=sys.stderr)


def run_cli(main: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> None:
    """Run a training CLI; a configuration or input error ends with one line on stderr and exit code 2.

    `TrainConfigError`, the parser's unknown-key `ValueError` and a missing file are user errors (exit 2); `RunStopped`
    is a run stopped by bad input or a failed component (one line, exit 1); anything else is a bug and keeps its
    traceback. Under `accelerate launch` every rank exits 2 but only local rank 0 prints the line.
    """
    try:
        main(argv)
    except (TrainConfigError, FileNotFoundError) as exc:
        _say(f"error: {exc}")
        raise SystemExit(2) from None
    except RunStopped as exc:
        _say(f"error: {exc}")
        raise SystemExit(1) from None
    except ValueError as exc:
        text = str(exc)
        if "Unknown arguments from config file" in text or "not used by the HfArgumentParser" in text:
            _say(f"error: unknown config key: {text.splitlines()[0]}")
            raise SystemExit(2) from None
        if "generation_batch_size" in text or "num_generations" in text:  # GRPOConfig's batch checks (world size)
            _say(
                f"error: GRPO batch: {text.splitlines()[0]} Make processes x per_device_train_batch_size x "
                "gradient_accumulation_steps a multiple of num_generations."
            )
            raise SystemExit(2) from None
        raise


def check_launch_settings(acc: dict[str, Any], train: dict[str, Any]) -> list[str]:
    """Return the problems of a launch (an accelerate config dict) with a training config dict ([] = consistent).

    Rules: DeepSpeed ZeRO stage 2 or 3, offload devices none|cpu, ZeRO-3 saves a 16-bit (gathered) model; off the CPU,
    bf16 compute in both (`mixed_precision: bf16` where the launch states one, `bf16: true`) with fp32 trainable
    weights; processes x micro-batch x accumulation = `completions_per_step` (GRPO) / `samples_per_step` (SFT) when
    the training config states one; GRPO: whole groups of `num_generations` per optimizer step and per generation
    batch (processes x micro-batch x `steps_per_generation`, which defaults to the accumulation).
    """
    problems = []
    if acc.get("distributed_type") == "DEEPSPEED":
        ds = acc.get("deepspeed_config", {})
        if ds.get("zero_stage") not in (2, 3):
            problems.append(f"zero_stage={ds.get('zero_stage')} (use 2 or 3)")
        for key in ("offload_optimizer_device", "offload_param_device"):
            if ds.get(key, "none") not in ("none", "cpu"):
                problems.append(f"{key}={ds.get(key)} (none or cpu)")
        if ds.get("zero_stage") == 3 and not ds.get("zero3_save_16bit_model"):
            problems.append("zero3_save_16bit_model is off (checkpoints would be unusable shards)")
    on_cpu = bool(acc.get("use_cpu")) or bool(train.get("use_cpu"))
    if not on_cpu and (acc.get("mixed_precision", "bf16") != "bf16" or not train.get("bf16")):
        problems.append("bf16 compute must be on in both files (mixed_precision: bf16, bf16: true)")
    try:
        check_precision(str(train.get("dtype", "float32")), lora=int(train.get("lora_r", 0)) > 0)
    except TrainConfigError as exc:
        problems.append(str(exc).rstrip("."))
    n_proc, micro = int(acc.get("num_processes", 1)), int(train.get("per_device_train_batch_size", 1))
    accum = int(train.get("gradient_accumulation_steps", 1))
    per_step = n_proc * micro * accum
    key = "completions_per_step" if "completions_per_step" in train else "samples_per_step"
    target = train.get(key)
    if target is not None and per_step != int(target):
        fix = f"{key}: {per_step}"
        if int(target) % (n_proc * micro) == 0:
            fix = f"gradient_accumulation_steps: {int(target) // (n_proc * micro)} or {fix}"
        problems.append(
            f"num_processes x per_device_train_batch_size x gradient_accumulation_steps = {n_proc} x "
            f"{micro} x {accum} = {per_step}, not {key}={target} (set {fix})"
        )
    group = train.get("num_generations")
    if group:
        steps_per_gen = int(train.get("steps_per_generation") or accum)
        if per_step % int(group):
            problems.append(
                f"{per_step} completions per step is not a whole number of groups of num_generations={group}"
            )
        elif (n_proc * micro * steps_per_gen) % int(group):
            problems.append(
                f"the generation batch (num_processes x per_device_train_batch_size x steps_per_generation"
                f" = {n_proc * micro * steps_per_gen}) is not a whole number of groups of "
                f"num_generations={group}"
            )
    return problems


def validate_launch(
    accelerate_yaml: str | Path,
    training_yaml: str | Path,
    *,
    completions_per_step: int = 64,
    num_processes: int | None = None,
    training_overrides: dict[str, Any] | None = None,
) -> dict:
    """Check an accelerate (+ DeepSpeed) config against a training config without importing deepspeed.

    The rules are `check_launch_settings`; the per-step target is the training config's `completions_per_step` /
    `samples_per_step`, else `completions_per_step` (the paper's 8 prompts x 8 completions). The launchers
    (`train/launch/*.sh`) run this as `python -m train.checks ACCEL_YAML TRAINING_YAML` before `accelerate launch`;
    the entry points apply the same rules to what `accelerate launch` exported (`train.distributed.check_launch`).
    `accelerate_yaml` "none" is one process without `accelerate launch` (the 1-GPU launchers). `num_processes`
    overrides the accelerate file's count, `training_overrides` the training file's keys (CLI flags of the run) (`accelerate launch --num_processes N`). Returns the
    parsed accelerate config.

    Raises:
        TrainConfigError: naming the inconsistent keys.
    """
    acc = {"num_processes": 1} if str(accelerate_yaml) == "none" else yaml.safe_load(Path(accelerate_yaml).read_text())
    if num_processes is not None:
        acc["num_processes"] = num_processes
    train = {**(yaml.safe_load(Path(training_yaml).read_text()) or {}), **(training_overrides or {})}
    if str(accelerate_yaml) != "none":  # an accelerate file without mixed_precision runs fp32
        acc.setdefault("mixed_precision", "no")
    if "completions_per_step" not in train and "samples_per_step" not in train:
        train["completions_per_step"] = completions_per_step
    problems = check_launch_settings(acc, train)
    if problems:
        raise TrainConfigError(f"{accelerate_yaml} with {training_yaml}: " + "; ".join(problems))
    return acc


def bar_only(trainer: Any) -> Any:
    """Keep the trainer's progress bar but stop it printing each logged step's metric dict (`step_logs: false`).

    The metrics still reach `trainer_state.json`, the reward curve and the run's summary lines; only the console copy
    goes (the demo prints a summary a person can read instead of ~40 dict lines). Returns `trainer`.
    """
    # lazy: transformers: +7 s (measured; see require_fp32_trainable)
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    class BarOnlyProgress(ProgressCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            return None

    printers = [cb for cb in trainer.callback_handler.callbacks if type(cb) in (ProgressCallback, PrinterCallback)]
    for callback in printers:
        trainer.remove_callback(callback)
    if any(type(cb) is ProgressCallback for cb in printers):
        trainer.add_callback(BarOnlyProgress)
    return trainer


def main(argv: list[str] | None = None) -> None:
    """CLI: `python -m train.checks ACCELERATE_YAML TRAINING_YAML`; exit 2 with one `error:` line on a mismatch."""
    parser = argparse.ArgumentParser(description="Check an accelerate config against a training config.")
    parser.add_argument("accelerate_yaml", help='accelerate config, or "none" for one process without accelerate')
    parser.add_argument("training_yaml")
    parser.add_argument("--num_processes", type=int, default=None, help="override the accelerate file's count")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=None, help="override the training file's")
    args = parser.parse_args(argv)

    try:
        acc = {} if args.accelerate_yaml == "none" else yaml.safe_load(Path(args.accelerate_yaml).read_text()) or {}
        if acc.get("distributed_type") == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:
            raise TrainConfigError(
                f"{args.accelerate_yaml} uses DeepSpeed, which is not installed; install it with "
                "DS_BUILD_OPS=0 pip install --no-build-isolation '.[deepspeed]'."
            )
        overrides = {}
        if args.gradient_accumulation_steps is not None:
            overrides["gradient_accumulation_steps"] = args.gradient_accumulation_steps
        validate_launch(
            args.accelerate_yaml, args.training_yaml, num_processes=args.num_processes, training_overrides=overrides
        )
    except (TrainConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"launch ok: {args.accelerate_yaml} with {args.training_yaml}")


if __name__ == "__main__":
    main()
