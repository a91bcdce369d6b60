"""`emrl build-sft-set ATLAS OUT`: run the build-sft-set flow (atlas -> findings, sft and rejections tables)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cli.commands.parsing import add_settings
from cli.preflight import check_build_sft_set
from cli.settings import BUILD_SFT_SET, FRAME_SETTINGS, frame_overrides


def add(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Declare `emrl build-sft-set`."""
    p = sub.add_parser(
        "build-sft-set",
        parents=common,
        help="run the build-sft-set flow (atlas -> SFT set)",
        description="Curate an AbdomenAtlas-layout folder into the findings, sft and rejections tables "
        "(Hub layout). Resumable: a rerun with the same settings reuses finished cases.",
    )
    p.add_argument(
        "atlas",
        help="atlas root (image_only/ + mask_only/, or BDMAP_* folders), the Hub release "
        "hf://datasets/AbdomenAtlas/AbdomenAtlas3.0Mini (read part by part; docs/data.md), or a folder of its parts "
        "as `hf download` leaves them (image_only/*.tar.gz, read in place)",
    )
    p.add_argument("out", type=Path, help="output folder (findings/, sft/, rejections/, manifest.json)")
    add_settings(p, BUILD_SFT_SET)
    p.set_defaults(func=run, check=check_build_sft_set, prefect=True)


def run(args: argparse.Namespace) -> dict:
    """Run the flow with the options; print its summary."""
    # lazy: Prefect and the flow add 0.9 s to `emrl --help` (measured)
    from flows.build_sft_set import build_sft_set_flow

    options = {s.name: getattr(args, s.name) for s in BUILD_SFT_SET if s.flow}
    frames = {s.name: getattr(args, s.name) for s in FRAME_SETTINGS}
    summary = build_sft_set_flow(
        atlas_root=str(args.atlas), output_dir=str(args.out), config=frame_overrides(frames), **options
    )
    print()
    print((Path(args.out) / "summary.md").read_text())
    return summary
