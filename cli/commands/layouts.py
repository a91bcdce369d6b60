"""`emrl layouts`: the dataset layouts `emrl build-sft-set` reads, with what each annotates, licence and command."""

from __future__ import annotations

import argparse
from typing import Any

from emrl_data.reading.layout import LAYOUTS


def add(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Declare `emrl layouts`."""
    p = sub.add_parser(
        "layouts",
        parents=common,
        help="list the dataset layouts build-sft-set reads",
        description="List the dataset layouts `emrl build-sft-set` detects from a folder (or reads by --layout NAME): "
        "what each annotates (an organ it does not annotate gets no row), its label table (ignored labels said so), "
        "licence (SPDX id), citation and a one-line command.",
    )
    p.set_defaults(func=run)


def describe() -> str:
    """The layouts as text, one block each, in detection order."""
    blocks = []
    for layout in LAYOUTS:
        blocks.append(
            f"{layout.name}: {layout.title}\n"
            f"  annotates: {', '.join(layout.organs)}\n"
            f"  labels:    {layout.labels}\n"
            f"  licence:   {layout.licence} ({layout.terms})\n"
            f"  cite:      {layout.citation}\n"
            f"  run:       {layout.command}"
        )
    return "\n\n".join(blocks)


def run(args: argparse.Namespace) -> int:
    """Print the layouts."""
    print(describe())
    return 0
