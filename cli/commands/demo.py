"""`emrl demo`: the whole pipeline on a synthetic atlas, on CPU (the orchestration is `cli.demo`)."""

from __future__ import annotations

import argparse
from typing import Any

from cli.commands.parsing import add_settings
from cli.preflight import check_demo
from cli.settings import DEMO, DEMO_FRAMES


def add(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Declare `emrl demo`."""
    frames = DEMO_FRAMES["frames"]
    p = sub.add_parser(
        "demo",
        parents=common,
        help="synthetic atlas -> the whole pipeline, printing what it made",
        description="Synthetic atlas -> build-sft-set -> tiny SFT -> build-rl-hardset -> tiny GRPO, "
        f"on CPU ({frames['frame_size_px']} px x {frames['max_frames']} frames). Rerunning resumes.",
    )
    add_settings(p, DEMO)
    p.set_defaults(func=run, check=check_demo, prefect=True)


def run(args: argparse.Namespace) -> None:
    """Run the demo."""
    # lazy: cli.demo adds 0.33 s to `emrl --help`, its flows 0.9 s more when run (measured)
    from cli.demo import run_demo

    run_demo(args.out, cases=args.cases, skip_training=args.skip_training)
