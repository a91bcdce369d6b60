"""`emrl synth OUT`: write a synthetic atlas in the real on-disk layout."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cli.commands.parsing import add_settings
from cli.preflight import check_synth
from cli.settings import SYNTH


def add(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Declare `emrl synth`."""
    p = sub.add_parser(
        "synth",
        parents=common,
        help="write a synthetic atlas in the real on-disk layout",
        description="Write a synthetic AbdomenAtlas 3.0 (NIfTI CTs, masks, metadata CSV, IID split "
        "files) with known lesions, plus synthetic_truth.json.",
    )
    p.add_argument("out", type=Path, help="folder to write (created)")
    add_settings(p, SYNTH)
    p.set_defaults(func=run, check=check_synth)


def run(args: argparse.Namespace) -> Path:
    """Write the atlas."""
    from cli.demo import synth_atlas  # lazy: cli.demo adds 0.33 s to `emrl --help` (measured)

    return synth_atlas(Path(args.out), cases=args.cases, seed=args.seed, layout=args.layout)
