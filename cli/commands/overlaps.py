"""`emrl overlaps OUT_A OUT_B`: the cases of two build-sft-set output folders that are the same CT."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cli.errors import UsageError
from emrl_data.tables.overlaps import find_overlaps, read_fingerprints, write_overlaps_csv


def add(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Declare `emrl overlaps`."""
    p = sub.add_parser(
        "overlaps",
        parents=common,
        help="list the cases two output folders share (the same CT in two datasets)",
        description="Compare the CT fingerprints (fingerprints.parquet) of two build-sft-set output folders and list "
        "every pair of cases that is the same CT, even re-saved, re-oriented, cast to another dtype or cropped to "
        "the body (docs/data.md). Prints the pairs as a table and writes them as CSV.",
    )
    p.add_argument("out_a", type=Path, help="an output folder of `emrl build-sft-set`")
    p.add_argument("out_b", type=Path, help="another output folder of `emrl build-sft-set`")
    p.add_argument(
        "--out", type=Path, default=None, help="the CSV of pairs (default: OUT_A/overlaps.csv)", metavar="FILE"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Find the pairs, print them, write the CSV; 0 whether or not any is found."""
    tables = []
    for folder in (args.out_a, args.out_b):
        try:
            tables.append(read_fingerprints(folder))
        except (FileNotFoundError, ValueError) as err:
            raise UsageError(str(err), "give two output folders of `emrl build-sft-set`") from None
    pairs = find_overlaps(tables[0], tables[1])
    path = args.out or args.out_a / "overlaps.csv"
    write_overlaps_csv(pairs, path)
    print(f"| {args.out_a} | split | {args.out_b} | split | matched slices |")
    print("|---|---|---|---|---|")
    for pair in pairs:
        print(f"| {pair.case_id_a} | {pair.split_a} | {pair.case_id_b} | {pair.split_b} | {pair.matched_slices} |")
    print(f"\n{len(pairs)} pair(s) of the same CT among {len(tables[0])} x {len(tables[1])} cases; written to {path}")
    return 0
