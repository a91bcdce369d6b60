"""The `emrl` command line: synthetic atlas, the flows, evaluation, and the one-command demo.

    emrl synth OUT [--cases 32] [--layout split|combined]
    emrl build-sft-set ATLAS OUT [--batch-size 8] [--workers 2] [--limit N]
    emrl eval PREDICTIONS [--out eval-output]
    emrl demo [--out demo-output]

It lives in `flows/` because it runs the Prefect flows; `emrl_data` stays free of Prefect.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path


def _synth(args: argparse.Namespace) -> Path:
    from tqdm import tqdm

    from emrl_data.synthetic import demo_specs, write_atlas

    specs = demo_specs(n_cases=args.cases, seed=args.seed)
    out = Path(args.out)
    started = time.perf_counter()
    with tqdm(total=1, desc=f"writing {len(specs)} synthetic cases", unit="atlas", disable=None) as bar:
        write_atlas(out, specs, layout=args.layout)
        bar.update(1)
    print(
        f"Synthetic atlas: {len(specs)} cases ({args.layout} layout) in {out} ({time.perf_counter() - started:.1f} s)"
    )
    print(f"  ground truth: {out / 'synthetic_truth.json'}")
    return out


def _build_sft_set(args: argparse.Namespace) -> dict:
    from flows.build_sft_set import build_sft_set_flow

    summary = build_sft_set_flow(
        atlas_root=str(args.atlas),
        output_dir=str(args.out),
        batch_size=args.batch_size,
        max_workers=args.workers,
        limit=args.limit,
        negatives_per_positive=args.negatives_per_positive,
    )
    print()
    print((Path(args.out) / "summary.md").read_text())
    return summary


def _eval(args: argparse.Namespace) -> None:
    import polars as pl

    from emrl_data.evaluation import evaluate, score_predictions, write_evaluation

    path = Path(args.predictions)
    frame = pl.read_ndjson(path) if path.suffix in (".jsonl", ".ndjson") else pl.read_parquet(path)
    rows = score_predictions(frame.to_dicts(), text_column=args.text_column)
    result = evaluate(rows, n_bootstrap=args.bootstrap, seed=args.seed)
    paths = write_evaluation(result, Path(args.out))
    print(result.to_markdown())
    for kind, written in paths.items():
        print(f"  {kind:<9} {written}")


def _demo(args: argparse.Namespace) -> None:
    out = Path(args.out).resolve()
    atlas = out / "atlas"
    print(f"== 1/2  synthetic AbdomenAtlas -> {atlas}")
    _synth(argparse.Namespace(out=atlas, cases=args.cases, seed=0, layout="split"))
    print(f"\n== 2/2  build-sft-set (Prefect flow) -> {out}")
    _build_sft_set(
        argparse.Namespace(atlas=atlas, out=out, batch_size=4, workers=2, limit=None, negatives_per_positive=1.0)
    )
    print("Demo outputs:")
    for name in ("findings", "sft", "rejections"):
        print(f"  {name:<12} {out / name}  (load: datasets.load_dataset('parquet', data_dir='{out / name / 'data'}'))")
    print(f"  {'summary':<12} {out / 'summary.md'}")
    print(f"  {'manifest':<12} {out / 'manifest.json'}")
    print(f"  {'contact':<12} {out / 'contact_sheet.png'}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `emrl` command."""
    parser = argparse.ArgumentParser(prog="emrl", description="E-MRL data: AbdomenAtlas 3.0 -> E-MRL training data.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write a synthetic atlas in the real on-disk layout")
    p.add_argument("out", type=Path)
    p.add_argument("--cases", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=["split", "combined"], default="split")
    p.set_defaults(func=_synth)

    p = sub.add_parser("build-sft-set", help="run the build-sft-set flow")
    p.add_argument("atlas", type=Path, help="atlas root")
    p.add_argument("out", type=Path, help="output folder")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--negatives-per-positive", type=float, default=1.0)
    p.set_defaults(func=_build_sft_set)

    p = sub.add_parser("eval", help="Table 1/2 (paper) with bootstrap CIs from a predictions file")
    p.add_argument("predictions", type=Path, help="parquet or jsonl: sft truth columns + a report column, or scores")
    p.add_argument("--out", type=Path, default=Path("eval-output"))
    p.add_argument("--text-column", default="prediction")
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_eval)

    p = sub.add_parser("demo", help="synthetic atlas -> the whole pipeline, printing what it made")
    p.add_argument("--out", type=Path, default=Path("demo-output"))
    p.add_argument("--cases", type=int, default=32)
    p.set_defaults(func=_demo)

    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("EMRL_LOG_LEVEL", "WARNING"))
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
