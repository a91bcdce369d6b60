"""The `emrl` command line: synthetic atlas, the flows, evaluation, and the one-command demo.

    emrl synth OUT [--cases 32] [--layout split|combined]
    emrl build-sft-set ATLAS OUT [--batch-size 8] [--workers 2] [--limit N]
    emrl build-rl-hardset OUT/sft OUT (--model SFT_DIR | --endpoint URL --endpoint-model NAME)
    emrl publish OUT/sft ORG/NAME X.Y.Z [--local-root DIR]
    emrl eval PREDICTIONS [--out eval-output]
    emrl demo [--out demo-output]

It lives in `flows/` because it runs the Prefect flows; `emrl_data` stays free of Prefect.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path


PROJECT_ROOT = Path(__file__).resolve().parent.parent


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


def _build_rl_hardset(args: argparse.Namespace) -> dict:
    from flows.build_rl_hardset import build_rl_hardset_flow

    summary = build_rl_hardset_flow(
        sft_dir=str(args.sft_dir),
        output_dir=str(args.out),
        model_path=None if args.model is None else str(args.model),
        backend="openai" if args.endpoint else "transformers",
        endpoint_url=args.endpoint,
        endpoint_model=args.endpoint_model,
        target_size=args.target_size,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        limit=args.limit,
    )
    print()
    print((Path(args.out) / "rl_hardset" / "summary.md").read_text())
    return summary


def _publish(args: argparse.Namespace) -> dict:
    from flows.publish import publish_dataset_flow

    result = publish_dataset_flow(
        table_dir=str(args.table_dir),
        repo_id=args.repo_id,
        version=args.version,
        target="local" if args.local_root else "hub",
        local_root=None if args.local_root is None else str(args.local_root),
        private=not args.public,
    )
    print(json.dumps({k: v for k, v in result.items() if k != "files"}, indent=2, default=str))
    return result


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


# The CPU demo renders smaller frames than the real default (448 px x <= 32 frames) so that training and mining a
# tiny model finish in minutes; everything else is the production path.
DEMO_FRAMES = {"frames": {"frame_size_px": 224, "max_frames": 16}}


def _run_train(module: str, *args: str) -> None:
    """Run a `train/` script in its own process (flows never import train)."""
    cmd = [sys.executable, "-m", module, *args]
    subprocess.run(cmd, cwd=PROJECT_ROOT, check=True)


def _demo(args: argparse.Namespace) -> None:
    from flows.build_rl_hardset import build_rl_hardset_flow
    from flows.build_sft_set import build_sft_set_flow

    out = Path(args.out).resolve()
    atlas = out / "atlas"
    started = time.perf_counter()
    print(f"== 1/5  synthetic AbdomenAtlas -> {atlas}")
    _synth(argparse.Namespace(out=atlas, cases=args.cases, seed=0, layout="split"))

    print(f"\n== 2/5  build-sft-set (Prefect flow) -> {out}")
    build_sft_set_flow(atlas_root=str(atlas), output_dir=str(out), batch_size=4, max_workers=2, config=DEMO_FRAMES)
    print((out / "summary.md").read_text())
    if args.skip_training:
        return _print_outputs(out, started)

    print(f"== 3/5  tiny Qwen3-VL: LM warm-up on the reports, then the paper's SFT freezing -> {out / 'sft_model'}")
    _run_train("train.sft", "--config", "train/configs/sft_demo.yaml", "--dataset_dir", str(out / "sft"),
               "--output_dir", str(out / "sft_model"))  # fmt: skip

    print(f"\n== 4/5  build-rl-hardset (Prefect flow) with the tiny SFT model -> {out / 'rl_hardset'}")
    build_rl_hardset_flow(
        sft_dir=str(out / "sft"), output_dir=str(out), model_path=str(out / "sft_model"), max_new_tokens=128,
        n_bootstrap=200, device="cpu",
    )  # fmt: skip
    print((out / "rl_hardset" / "summary.md").read_text())

    print(f"== 5/5  E-MRL GRPO (r_e + r_f + r_c, verifier) beside an lr-0 control -> {out / 'grpo_model'}")
    _run_train("train.grpo", "--config", "train/configs/grpo_demo.yaml", "--dataset_dir", str(out / "rl_hardset"),
               "--model_name_or_path", str(out / "sft_model"), "--output_dir", str(out / "grpo_model"))  # fmt: skip
    _print_outputs(out, started)


def _print_outputs(out: Path, started: float) -> None:
    print(f"\nDemo outputs ({time.perf_counter() - started:.0f} s):")
    items = [
        ("atlas", out / "atlas", "synthetic AbdomenAtlas + synthetic_truth.json"),
        ("findings", out / "findings", "every organ row, all labels"),
        ("sft", out / "sft", "SFT set (Hub layout)"),
        ("rejections", out / "rejections", "defective cases with reason codes"),
        ("contact", out / "contact_sheet.png", "key frames with their boxes"),
        ("sft_model", out / "sft_model", "tiny SFT checkpoint"),
        ("predictions", out / "predictions", "the SFT model's reports, parsed and scored"),
        ("rl_hardset", out / "rl_hardset", "hard set + metrics.md (Table 1/2)"),
        ("grpo_model", out / "grpo_model", "tiny GRPO checkpoint + reward_curve.png"),
        ("manifest", out / "manifest.json", "versions, config fingerprint, input hashes, counts"),
    ]
    for name, path, what in items:
        if path.exists():
            print(f"  {name:<12} {path}  ({what})")
    print(f"\n  load: datasets.load_dataset('parquet', data_dir='{out / 'sft' / 'data'}')")


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

    p = sub.add_parser("build-rl-hardset", help="run the build-rl-hardset flow (SFT model -> hard set)")
    p.add_argument("sft_dir", type=Path, help="the sft table folder (OUT/sft)")
    p.add_argument("out", type=Path, help="output folder (usually OUT)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--model", type=Path, help="local SFT checkpoint directory")
    who.add_argument("--endpoint", help="OpenAI-compatible base URL including /v1 (e.g. vllm serve)")
    p.add_argument("--endpoint-model", help="model name served by the endpoint")
    p.add_argument("--target-size", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--limit", type=int, default=None)
    p.set_defaults(func=_build_rl_hardset)

    p = sub.add_parser("publish", help="publish a table folder as an immutable vX.Y.Z version")
    p.add_argument("table_dir", type=Path, help="e.g. OUT/sft")
    p.add_argument("repo_id", help="e.g. my-org/emrl-sft")
    p.add_argument("version", help="X.Y.Z (tagged vX.Y.Z; an existing tag is never moved)")
    p.add_argument("--local-root", type=Path, default=None, help="publish to this folder instead of the Hub")
    p.add_argument("--public", action="store_true", help="create the Hub repo public (default private)")
    p.set_defaults(func=_publish)

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
    p.add_argument("--skip-training", action="store_true", help="stop after build-sft-set")
    p.set_defaults(func=_demo)

    from flows.server import add_server_commands

    add_server_commands(sub)  # emrl server up | down | status

    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("EMRL_LOG_LEVEL", "WARNING"))
    status = args.func(args)
    if isinstance(status, int) and status:
        raise SystemExit(status)


if __name__ == "__main__":
    sys.exit(main())
