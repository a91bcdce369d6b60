"""The one entry point of `python -m train.sft` and `python -m train.grpo`: parse, check the launch, run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from trl import TrlParser

from train.distributed import check_launch, end_process_group, leave_launched_rank, prepare_deepspeed_cpu


def train_main(
    stage: str,
    script_args_class: Any,
    config_class: Any,
    run: Callable[[Any, Any], Any],
    argv: list[str] | None = None,
) -> None:
    """Parse `--config YAML [overrides]` into the stage's script arguments and TRL config, refuse an inconsistent
    launch before any weight loads, then `run(script_args, training_args)`.

    Args:
        stage: "sft" or "grpo" (`train.distributed.check_launch`).
        script_args_class: the stage's script-argument dataclass (`SftScriptArguments`, `GrpoScriptArguments`).
        config_class: TRL's config class (`SFTConfig`, `GRPOConfig`).
        run: the stage's run function (`run_sft`, `run_grpo`).
        argv: the command-line arguments (the process's when None).
    """
    logging.basicConfig(level=logging.INFO)
    prepare_deepspeed_cpu()
    parser = TrlParser((script_args_class, config_class))
    script_args, training_args = parser.parse_args_and_config(argv)
    check_launch(stage, script_args, training_args)  # before any weight loads
    run(script_args, training_args)
    end_process_group()  # every rank done and the groups torn down, then no interpreter finalization under a launch
    leave_launched_rank()
