"""`emrl eval PREDICTIONS...`: Table 1/2 with bootstrap intervals (the logic is `cli.evaluate`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cli.commands.parsing import add_settings
from cli.preflight import check_eval
from cli.settings import EVAL


def add(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Declare `emrl eval`."""
    p = sub.add_parser(
        "eval",
        parents=common,
        help="Table 1/2 (paper) with bootstrap CIs from predictions",
        description="Score reports against the truth and print Table 1 (detection) and Table 2 "
        "(attributes) with 95 % bootstrap intervals; several models: each one's paired differences from the "
        "first; --text-metrics: BLEU, ROUGE-L, CIDEr-D. Writes metrics.md/json/png and the results card.",
    )
    p.add_argument(
        "predictions",
        type=Path,
        nargs="+",
        help="OUT/predictions (from build-rl-hardset), or a parquet/jsonl file with the sft truth "
        "columns and a report column; several (e.g. our model's and a hosted model's): Table 1/2 per model, "
        "named by the rows' model column, each in OUT/model-N/, then the models side by side and each one's paired "
        "differences against the first (OUT/metrics.md and .json)",
    )
    add_settings(p, EVAL)
    p.set_defaults(func=run, check=check_eval)


def run(args: argparse.Namespace) -> None:
    """Evaluate."""
    # lazy: polars and matplotlib add 0.33 s to `emrl --help` (see cli/preflight.py)
    from cli.evaluate import evaluate_predictions

    evaluate_predictions(
        args.predictions,
        args.out,
        split=args.split,
        text_column=args.text_column,
        n_bootstrap=args.n_bootstrap,
        seed=args.seed,
        text_metrics=args.text_metrics,
        gold=args.gold,
        against=args.against,
    )
