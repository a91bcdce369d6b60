"""`emrl upgrade-checkpoint DIR...`: rewrite an old checkpoint as a standard Qwen3-VL one (train.tools.upgrade_checkpoint)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

from emrl_data import PROJECT_ROOT


def add(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Declare `emrl upgrade-checkpoint`."""
    p = sub.add_parser(
        "upgrade-checkpoint",
        parents=common,
        help="rewrite an old checkpoint (custom processor class) as a standard Qwen3-VL one, in place",
        description="Set processor_class Qwen3VLProcessor and write the image/video processor configs, so "
        "AutoProcessor, vLLM and `transformers serve` load it as Qwen3-VL (python -m train.tools.upgrade_checkpoint). "
        "Idempotent; exit 2 when DIR is not a Qwen3-VL checkpoint.",
    )
    p.add_argument("dirs", nargs="+", metavar="DIR", type=Path, help="checkpoint folder (e.g. OUT/sft_model)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run `python -m train.tools.upgrade_checkpoint` in a subprocess (the CLI, like the flows, never imports train); return its status."""
    cmd = [sys.executable, "-m", "train.tools.upgrade_checkpoint", *(str(Path(d).resolve()) for d in args.dirs)]
    return subprocess.run(cmd, cwd=PROJECT_ROOT, check=False).returncode
