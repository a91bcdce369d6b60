"""The `emrl` command line: synthetic atlas, the flows, evaluation, and the one-command demo.

    emrl synth OUT [--cases 32] [--layout split|combined]
    emrl build-sft-set ATLAS OUT [--batch-size 8] [--workers 2] [--limit N] [--frame-size 448] [--max-frames 32]
    emrl build-rl-hardset OUT/sft OUT (--model SFT_DIR | --endpoint URL --endpoint-model NAME [--dialect openai])
    emrl publish OUT/sft ORG/NAME X.Y.Z [--local-root DIR]
    emrl eval OUT/predictions [OTHER/predictions ...] [--out eval-output]
    emrl demo [--out demo-output]

It lives in `flows/` because it runs the Prefect flows; `emrl_data` stays free of Prefect.

A user's mistake ends in a short message naming the problem and the fix (exit 2), a failure in one or two lines
(exit 1), Ctrl-C in "interrupted; rerun to resume" (exit 130); `--debug` (or `EMRL_DEBUG=1`) shows tracebacks.
Cheap checks (paths, numbers, the endpoint's answer to its API key) run before Prefect starts. Prefect's settings
are made before `prefect` is imported (`flows.prefect_env`).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flows.prefect_env import (
    PROJECT_ROOT,
    UsageError,
    configure_prefect_environment,
    kill_temporary_servers,
    prefect_session,
)


CREDENTIALS = """\
credentials and settings (environment):
  HF_TOKEN             Hugging Face token for `emrl publish` to the Hub (or log in once with `hf auth login`)
  OPENAI_API_KEY       bearer key sent to an OpenAI-compatible --endpoint (`vllm serve --api-key ...`)
  PREFECT_API_URL      use this running Prefect server (`make serve` prints it); unset: a temporary one starts
  PREFECT_HOME         Prefect's database and results (default: .prefect-home/ in the checkout)
  EMRL_DEBUG=1         show tracebacks (same as --debug); EMRL_LOG_LEVEL=INFO for library logs
"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show each option's default, except where it is None or a flag's False (the help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, argparse.SUPPRESS) or isinstance(action.default, bool):  # flags say it
            return action.help or ""
        return super()._get_help_string(action) or ""


class _Parser(argparse.ArgumentParser):
    """argparse with a two-line error (the problem and where the help is) instead of the whole usage block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("description"):
            kwargs["description"] = textwrap.fill(kwargs["description"], 100)
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # noqa: D102 (argparse's API)
        self.exit(2, f"{self.prog}: error: {message}\n  see `{self.prog} --help`\n")


def _positive(kind: type = int, minimum: float = 1) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    return parse


# Cheap checks, before Prefect starts --------------------------------------------------------------------------------


def _check_output(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"the output path {out} is a file", "pass a folder (it is created when missing)")
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UsageError(f"{parent} (in the output path {out}) is a file", "pass a folder path")


def _check_synth(args: argparse.Namespace) -> None:
    _check_output(args.out)


def _check_build_sft_set(args: argparse.Namespace) -> None:
    from emrl_data.reading.atlas import AtlasError, discover_cases

    atlas = Path(args.atlas)
    if not atlas.is_dir():
        what = "is a file" if atlas.exists() else "does not exist"
        raise UsageError(
            f"the atlas folder {atlas} {what}",
            "pass the AbdomenAtlas root (image_only/ + mask_only/, or BDMAP_* folders); `emrl synth DIR` writes one",
        )
    try:
        found = discover_cases(atlas)
    except AtlasError as exc:  # NoCasesError included: the message names what was found instead
        raise UsageError(
            str(exc), "point at the atlas root that holds image_only/ and mask_only/ (or BDMAP_* folders)"
        ) from None
    if not found.refs:
        raise UsageError(
            f"no cases in {atlas}: no valid BDMAP_######## folders ({len(found.rejections)} invalid ones)",
            "point at the atlas root that holds image_only/ and mask_only/ (or the BDMAP_* folders)",
        )
    _check_output(args.out)


def _check_build_rl_hardset(args: argparse.Namespace) -> None:
    sft = Path(args.sft_dir)
    if not sorted((sft / "data").glob("train-*-of-*.parquet")):
        hint = f"pass {sft / 'sft'}" if (sft / "sft" / "data").is_dir() else "run `emrl build-sft-set ATLAS OUT` first"
        raise UsageError(f"no SFT set in {sft} (no data/train-*.parquet)", f"{hint}, then pass OUT/sft")
    if args.endpoint and not args.endpoint_model:
        raise UsageError(
            "--endpoint needs --endpoint-model", "add --endpoint-model NAME (the model the server serves)"
        )
    for given, option in ((args.endpoint_model, "--endpoint-model"), (args.dialect, "--dialect"),
                          (args.max_tokens_field, "--max-tokens-field"), (args.no_probe, "--no-probe")):  # fmt: skip
        if given and not args.endpoint:
            raise UsageError(f"{option} is only used with --endpoint", "add --endpoint URL/v1, or drop it")
    if args.model is not None and not Path(args.model).is_dir():
        raise UsageError(f"the model folder {args.model} does not exist", "pass a local checkpoint folder (--model)")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"{args.model} is not a model checkpoint (no config.json)",
                         "pass the folder `python -m train.sft` wrote (its --output_dir)")  # fmt: skip
    _check_output(args.out)
    if args.endpoint:
        _check_endpoint(args.endpoint, args.endpoint_model)


def _check_endpoint(base_url: str, model: str, timeout_s: float = 10.0) -> None:
    """Ask the endpoint for its models once: a refused key or an unreachable server fails here, before any row."""
    import httpx

    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise UsageError(
            f"cannot reach the endpoint {base_url} ({type(exc).__name__})",
            "start the server (`make vllm-serve CKPT=DIR`, or `vllm serve` with the flags of docs/serving.md) or fix "
            "--endpoint (the base URL including /v1)",
        ) from exc
    if response.status_code in (401, 403):
        state = "is not set" if not key else "was refused"
        raise UsageError(
            f"the endpoint answered HTTP {response.status_code}: OPENAI_API_KEY {state}",
            "export OPENAI_API_KEY=<a key the server accepts> (vllm: the value of --api-key)",
        )
    if response.status_code == 200:
        try:
            served = [m["id"] for m in response.json().get("data", [])]
        except (ValueError, AttributeError, KeyError, TypeError):
            return  # not the OpenAI models list: the first request will tell
        # `transformers serve PATH` lists its Hub cache, not the model it was given by path: the probe checks that name.
        if served and model not in served and not Path(model).is_dir():
            raise UsageError(
                f"the endpoint serves {', '.join(served[:5])}, not {model!r}", f"--endpoint-model {served[0]}"
            )


def _check_demo(args: argparse.Namespace) -> None:
    _check_output(args.out)


def _check_eval(args: argparse.Namespace) -> None:
    for path in args.predictions:
        _prediction_files(Path(path))
    _check_output(args.out)


def _check_publish(args: argparse.Namespace) -> None:
    table = Path(args.table_dir)
    if not (table / "data").is_dir():
        raise UsageError(f"{table} is not a table folder (no data/)", "pass e.g. OUT/sft, written by build-sft-set")
    if args.local_root is None and not getattr(args, "dry_run", False):
        _check_hub()


def _check_hub() -> None:
    """One `whoami` call: no network, no token or a refused token fail here, in seconds, not after upload retries."""
    import httpx
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    fix_token = "export HF_TOKEN=<a write token> (or run `hf auth login`)"
    try:
        HfApi(endpoint=constants.ENDPOINT).whoami()
    except LocalTokenNotFoundError:
        raise UsageError("no Hugging Face token", fix_token) from None
    except HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        if status in (401, 403):
            raise UsageError(f"the Hub refused the token (HTTP {status})", fix_token) from None
        raise UsageError(f"the Hub answered HTTP {status}", "retry later, or check HF_ENDPOINT") from None
    except (httpx.HTTPError, OSError) as exc:
        raise UsageError(
            f"cannot reach the Hub at {constants.ENDPOINT} ({type(exc).__name__})",
            "check the network (or HF_ENDPOINT), or publish to a folder with --local-root DIR",
        ) from None


# The commands -------------------------------------------------------------------------------------------------------


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


def _frame_overrides(args: argparse.Namespace) -> dict[str, Any] | None:
    frames = {"frame_size_px": args.frame_size, "max_frames": args.max_frames}
    frames = {k: v for k, v in frames.items() if v is not None}
    return {"frames": frames} if frames else None


def _build_sft_set(args: argparse.Namespace) -> dict:
    from flows.build_sft_set import build_sft_set_flow

    summary = build_sft_set_flow(
        atlas_root=str(args.atlas),
        output_dir=str(args.out),
        batch_size=args.batch_size,
        max_workers=args.workers,
        limit=args.limit,
        negatives_per_positive=args.negatives_per_positive,
        seed=args.seed,
        test_fraction=args.test_fraction,
        max_unexpected_errors=args.max_unexpected_errors,
        config=_frame_overrides(args),
        task_runner=args.task_runner,
        task_runner_address=args.task_runner_address,
        case_timeout_s=args.case_timeout,
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
        dialect=args.dialect or "vllm",
        max_tokens_field=args.max_tokens_field or "max_tokens",
        probe=not args.no_probe,
        splits=None if args.split == "all" else [args.split],
        target_size=args.target_size,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        max_concurrency=args.concurrency,
        device=args.device,
        max_failed_predictions=args.max_failed_predictions,
        n_bootstrap=args.bootstrap,
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
        dry_run=args.dry_run,
    )
    for entry in result["plan"] if args.dry_run else []:
        print(f"{entry['action']:>9}  {entry['bytes']:>12}  {entry['path']}")
    print(result["message"])
    return result


def _prediction_files(path: Path) -> list[Path]:
    """The Parquet/JSONL files of a predictions file or table folder (`OUT/predictions`, its `data/`)."""
    if path.is_file():
        if path.suffix not in (".parquet", ".jsonl", ".ndjson"):
            raise UsageError(f"{path} is not a .parquet or .jsonl file", "pass OUT/predictions or a predictions file")
        return [path]
    if not path.is_dir():
        raise UsageError(f"{path} does not exist", "pass OUT/predictions (written by build-rl-hardset) or a file")
    for folder in (path / "data", path):
        files = sorted(folder.glob("*.parquet")) or sorted([*folder.glob("*.jsonl"), *folder.glob("*.ndjson")])
        if files:
            return files
    raise UsageError(f"no .parquet or .jsonl files in {path} or {path / 'data'}", "pass OUT/predictions or a file")


def _read_predictions(args: argparse.Namespace) -> Any:
    """All prediction rows of `args.predictions` as one polars frame (split filtered, failed inferences left out).

    With several inputs, a file without a `model` column is named by its path, so that it gets its own tables.
    """
    import polars as pl

    frames = []
    for given in args.predictions:
        for f in _prediction_files(Path(given)):
            frame = pl.read_ndjson(f) if f.suffix in (".jsonl", ".ndjson") else pl.read_parquet(f)
            if len(args.predictions) > 1 and "model" not in frame.columns:
                frame = frame.with_columns(pl.lit(str(given)).alias("model"))
            frames.append(frame)
    frame = pl.concat(frames, how="diagonal_relaxed")
    if args.split != "all":
        if "split" not in frame.columns:
            raise UsageError(f"--split {args.split}: the predictions have no split column", "use --split all")
        frame = frame.filter(pl.col("split") == args.split)
    if "inference_error" in frame.columns:  # rows the model never answered: left out, as build-rl-hardset does
        failed = frame.filter(pl.col("inference_error").is_not_null()).height
        frame = frame.filter(pl.col("inference_error").is_null())
        if failed:
            print(f"  {failed} row(s) without a prediction (inference errors) left out")
    if frame.height == 0:
        where = " ".join(str(p) for p in args.predictions)
        raise UsageError(f"no prediction rows in {where} (split {args.split})", "check the path/--split")
    return frame


def _by_model(frame: Any) -> list[tuple[str | None, Any]]:
    """Split the rows by their `model` column, in order of first appearance; one unnamed group without it."""
    import polars as pl

    if "model" not in frame.columns:
        return [(None, frame)]
    frame = frame.with_columns(pl.col("model").fill_null("(unnamed)"))
    names = frame.get_column("model").unique(maintain_order=True).to_list()
    return [(name, frame.filter(pl.col("model") == name)) for name in names]


def _eval(args: argparse.Namespace) -> None:
    from emrl_data.text.evaluation import evaluate, score_predictions, write_evaluation

    groups = _by_model(_read_predictions(args))
    compared = []
    for index, (model, part) in enumerate(groups, start=1):
        out = Path(args.out) if len(groups) == 1 else Path(args.out) / f"model-{index}"
        rows = score_predictions(part.to_dicts(), text_column=args.text_column)
        result = evaluate(rows, n_bootstrap=args.bootstrap, seed=args.seed)
        paths = write_evaluation(result, out, model=model)
        if model is not None:
            print(f"# Model: {model}\n")
        print(result.to_markdown())
        for kind, written in paths.items():
            print(f"  {kind:<9} {written}")
        compared.append((model, index, part.height, result))
    if len(groups) > 1:
        print(
            "\n## Models side by side\n\n| model | folder | rows | average B-Acc | Table 2 overall |\n| --- | --- | --- | --- | --- |"
        )
        for model, index, n_rows, result in compared:
            cells = f"{result.average_bacc.to_markdown()} | {result.table2_overall.to_markdown()}"
            print(f"| {model} | model-{index} | {n_rows} | {cells} |")


# The CPU demo renders smaller frames than the real default (448 px x <= 32 frames) so that training and mining a
# tiny model finish in minutes; everything else is the production path.
DEMO_FRAMES = {"frames": {"frame_size_px": 128, "max_frames": 16}}


def _run_train(module: str, *args: str) -> None:
    """Run a `train/` script in its own process (flows never import train)."""
    cmd = [sys.executable, "-m", module, *args]
    subprocess.run(cmd, cwd=PROJECT_ROOT, check=True)


def _demo(args: argparse.Namespace) -> None:
    # The tiny model runs faster on one thread per process (on a loaded 2-core machine, 2 threads per process made the
    # warm-up 7x slower); set before torch loads here or in the training subprocesses. An explicit setting wins.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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


def _debug_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks (also EMRL_DEBUG=1)"
    )
    return parent


def _add_synth(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "synth",
        parents=common,
        help="write a synthetic atlas in the real on-disk layout",
        description="Write a synthetic AbdomenAtlas 3.0 (NIfTI CTs, masks, metadata CSV, IID split "
        "files) with known lesions, plus synthetic_truth.json.",
    )
    p.add_argument("out", type=Path, help="folder to write (created)")
    p.add_argument("--cases", metavar="N", type=_positive(), default=32, help="number of cases")
    p.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the synthetic anatomy and lesions")
    p.add_argument(
        "--layout",
        choices=["split", "combined"],
        default="split",
        help="split: image_only/ + mask_only/ (AbdomenAtlas 3.0); combined: one folder per case",
    )
    p.set_defaults(func=_synth, check=_check_synth)


def _add_build_sft_set(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    from emrl_data.config import FrameConfig

    frames = FrameConfig()
    p = sub.add_parser(
        "build-sft-set",
        parents=common,
        help="run the build-sft-set flow (atlas -> SFT set)",
        description="Curate an AbdomenAtlas-layout folder into the findings, sft and rejections tables "
        "(Hub layout). Resumable: a rerun with the same settings reuses finished cases.",
    )
    p.add_argument("atlas", type=Path, help="atlas root (image_only/ + mask_only/, or BDMAP_* folders)")
    p.add_argument("out", type=Path, help="output folder (findings/, sft/, rejections/, manifest.json)")
    p.add_argument("--batch-size", metavar="N", type=_positive(), default=8, help="cases per Prefect task")
    p.add_argument(
        "--workers", metavar="N", type=_positive(), default=2, help="tasks running at once (threads or processes)"
    )
    p.add_argument(
        "--task-runner",
        choices=["thread", "process", "dask", "ray"],
        default="thread",
        help="where tasks run (docs/scaling.md); process/dask/ray are true CPU parallelism",
    )
    p.add_argument(
        "--task-runner-address",
        metavar="URL",
        default=None,
        help="an existing Dask scheduler (tcp://host:8786) or Ray cluster (ray://head:10001) (default: a local one)",
    )
    p.add_argument(
        "--limit", metavar="N", type=_positive(), default=None, help="only the first N cases by id (default: all)"
    )
    p.add_argument(
        "--frame-size",
        metavar="PX",
        type=_positive(minimum=8),
        default=None,
        help=f"frame edge in px (default: {frames.frame_size_px}, the E-MRL setting)",
    )
    p.add_argument(
        "--max-frames",
        metavar="N",
        type=_positive(),
        default=None,
        help=f"frames per organ at most (default: {frames.max_frames})",
    )
    p.add_argument(
        "--negatives-per-positive",
        metavar="X",
        type=_positive(float, 0),
        default=1.0,
        help="train negatives sampled per organ, as a ratio of its positives",
    )
    p.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the negative sampling")
    p.add_argument(
        "--test-fraction",
        metavar="X",
        type=_positive(float, 0),
        default=0.10,
        help="test share of the case-id hash split (when the atlas has no IID split files)",
    )
    p.add_argument(
        "--max-unexpected-errors",
        metavar="N",
        type=_positive(int, 0),
        default=0,
        help="fail when more cases than this hit an unexpected (non-data) error",
    )
    p.add_argument(
        "--case-timeout",
        metavar="SECONDS",
        type=_positive(float, 0.01),
        default=None,
        help="abandon a case still running after this long as a case_timeout rejection; the run goes on "
        "(default: max(600 s, 10x the median case time); docs/operations.md)",
    )
    p.set_defaults(func=_build_sft_set, check=_check_build_sft_set, prefect=True)


def _add_build_rl_hardset(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "build-rl-hardset",
        parents=common,
        help="run the build-rl-hardset flow (SFT model -> hard set)",
        description="Run the SFT model over the SFT set, score its reports and keep the train rows "
        "it gets wrong (the GRPO hard set), with Table 1/2 of the model. Resumable per row.",
    )
    p.add_argument("sft_dir", type=Path, help="the sft table folder (OUT/sft, written by build-sft-set)")
    p.add_argument("out", type=Path, help="output folder for predictions/ and rl_hardset/ (usually OUT)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--model",
        metavar="DIR",
        type=Path,
        default=None,
        help="local SFT checkpoint folder (transformers backend; one of --model, --endpoint)",
    )
    who.add_argument(
        "--endpoint",
        metavar="URL",
        default=None,
        help="OpenAI-compatible base URL including /v1, e.g. of `vllm serve` (one of --model, --endpoint; key: $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--endpoint-model",
        metavar="NAME",
        default=None,
        help="model name the endpoint serves (needed with --endpoint)",
    )
    _add_endpoint_options(p)
    p.add_argument(
        "--split",
        choices=["all", "train", "test"],
        default="all",
        help="predict the rows of this split only; test: evaluate a (served or hosted) model on the test split, "
        "no hard set",
    )
    p.add_argument(
        "--target-size", metavar="N", type=_positive(), default=2000, help="cap of the hard set (paper: about 2K)"
    )
    p.add_argument(
        "--batch-size", metavar="N", type=_positive(), default=4, help="rows per generate call / request batch"
    )
    p.add_argument("--max-new-tokens", metavar="N", type=_positive(), default=256, help="generation length cap")
    p.add_argument(
        "--concurrency", metavar="N", type=_positive(), default=8, help="requests in flight at once (--endpoint)"
    )
    p.add_argument("--device", metavar="DEV", default="auto", help="auto, cpu or cuda[:N] (--model)")
    p.add_argument(
        "--bootstrap", metavar="N", type=_positive(), default=1000, help="bootstrap replicates of the 95 %% intervals"
    )
    p.add_argument(
        "--max-failed-predictions",
        metavar="N",
        type=_positive(int, 0),
        default=0,
        help="fail when more rows than this got no prediction (a rerun retries only them)",
    )
    p.add_argument(
        "--limit",
        metavar="N",
        type=_positive(),
        default=None,
        help="only the first N rows of each split, for smoke runs (default: all)",
    )
    p.set_defaults(func=_build_rl_hardset, check=_check_build_rl_hardset, prefect=True)


def _add_endpoint_options(p: argparse.ArgumentParser) -> None:
    """The request options of `build-rl-hardset --endpoint` (docs/serving.md)."""
    p.add_argument(
        "--dialect",
        choices=["vllm", "openai"],
        default=None,
        help="request format, with --endpoint (default: vllm): vllm = the frames as one video_url plus vLLM's fields "
        "(our checkpoints on `vllm serve`); openai = one image_url per frame, standard fields only "
        "(`transformers serve`, hosted APIs). See docs/serving.md",
    )
    p.add_argument(
        "--max-tokens-field",
        choices=["max_tokens", "max_completion_tokens"],
        default=None,
        help="name of the length cap in requests, with --endpoint (default: max_tokens); OpenAI's newer models (o-series, "
        "GPT-5) want max_completion_tokens",
    )
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="skip the probe (--endpoint): by default the first row is sent twice (2 and 4 frames) before the "
        "run, and a wrong endpoint, model, key or dialect, or a server that drops the frames, stops it in one line",
    )


def _add_publish(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "publish",
        parents=common,
        help="publish a table folder as an immutable vX.Y.Z version",
        description="Publish a table folder to the Hugging Face Hub (token: $HF_TOKEN or `hf auth "
        "login`) or to a local folder, tagged vX.Y.Z; an existing tag is never moved.",
    )
    p.add_argument("table_dir", type=Path, help="the table folder, e.g. OUT/sft")
    p.add_argument("repo_id", help="Hub dataset repo, e.g. my-org/emrl-sft")
    p.add_argument("version", help="X.Y.Z (tagged vX.Y.Z; an existing tag is never moved)")
    p.add_argument(
        "--local-root",
        metavar="DIR",
        type=Path,
        default=None,
        help="publish to this folder instead of the Hub (default: the Hub)",
    )
    p.add_argument("--public", action="store_true", help="create the Hub repo public (default: private)")
    p.add_argument(
        "--dry-run", action="store_true", help="check token, table and tag; list what would be uploaded; write nothing"
    )
    p.set_defaults(func=_publish, check=_check_publish, prefect=True)


def _add_eval(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "eval",
        parents=common,
        help="Table 1/2 (paper) with bootstrap CIs from predictions",
        description="Score reports against the truth and print Table 1 (detection) and Table 2 "
        "(attributes) with 95 %% bootstrap intervals; writes metrics.md/json/png.",
    )
    p.add_argument(
        "predictions",
        type=Path,
        nargs="+",
        help="OUT/predictions (from build-rl-hardset), or a parquet/jsonl file with the sft truth "
        "columns and a report column; several (e.g. our model's and a hosted model's): Table 1/2 per model, "
        "named by the rows' model column, each in OUT/model-N/, then the models side by side",
    )
    p.add_argument(
        "--out", metavar="DIR", type=Path, default=Path("eval-output"), help="folder for metrics.md, .json and .png"
    )
    p.add_argument("--split", choices=["all", "train", "test"], default="all", help="rows of this split only")
    p.add_argument("--text-column", metavar="NAME", default="prediction", help="column holding the model's report")
    p.add_argument("--bootstrap", metavar="N", type=_positive(), default=1000, help="bootstrap replicates")
    p.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the bootstrap")
    p.set_defaults(func=_eval, check=_check_eval)


def _add_demo(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        parents=common,
        help="synthetic atlas -> the whole pipeline, printing what it made",
        description="Synthetic atlas -> build-sft-set -> tiny SFT -> build-rl-hardset -> tiny GRPO, "
        "on CPU (128 px x 16 frames). Rerunning resumes.",
    )
    p.add_argument("--out", metavar="DIR", type=Path, default=Path("demo-output"), help="output folder")
    p.add_argument("--cases", metavar="N", type=_positive(), default=32, help="synthetic cases")
    p.add_argument("--skip-training", action="store_true", help="stop after build-sft-set")
    p.set_defaults(func=_demo, check=_check_demo, prefect=True)


def _add_upgrade_checkpoint(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "upgrade-checkpoint",
        parents=common,
        help="rewrite an old checkpoint (custom processor class) as a standard Qwen3-VL one, in place",
        description="Set processor_class Qwen3VLProcessor and write the image/video processor configs, so "
        "AutoProcessor, vLLM and `transformers serve` load it as Qwen3-VL (python -m train.upgrade_checkpoint). "
        "Idempotent; exit 2 when DIR is not a Qwen3-VL checkpoint.",
    )
    p.add_argument("dirs", nargs="+", metavar="DIR", type=Path, help="checkpoint folder (e.g. OUT/sft_model)")
    p.set_defaults(func=_upgrade_checkpoint)


def _upgrade_checkpoint(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "train.upgrade_checkpoint", *(str(Path(d).resolve()) for d in args.dirs)]
    return subprocess.run(cmd, cwd=PROJECT_ROOT, check=False).returncode  # flows never import train


def _up_message(state: Any) -> str:
    """What `emrl server up` prints: addresses, the run commands in pipeline order, how to stop."""
    from flows.server import ENV_NAME

    home = Path(state.prefect_home)
    worker = ", ".join(f"{n} pid {r.pid} (log {r.log})" for n, r in state.processes.items())
    lines = [
        f"Prefect server running (PREFECT_HOME={home})",
        f"  UI:   {state.ui_url}",
        f"  API:  {state.api_url}",
        f"  pool: {state.pool}; {worker or 'no worker'}",
        "",
        f"In each shell: source {home / ENV_NAME}   (the API URL, and the venv's prefect and emrl on PATH)",
        "Then run the pipeline in this order (FLOW/DEPLOYMENT; --watch follows the run's logs):",
        *(f"  prefect deployment run {name} --watch" for name in state.deployments),
        "",
        "Stop everything: make serve-stop   (or: emrl server down)",
    ]
    return "\n".join(lines)


def _server(args: argparse.Namespace) -> int:
    """Run `emrl server up|down|status`; return the exit status (0 ok, 1 problems)."""
    from flows import server

    if args.server_action == "up":
        try:
            state = server.server_up(project_root=args.project_root, home=args.home, port=args.port,
                                     deploy=args.deploy, worker=args.worker, timeout_s=args.timeout)  # fmt: skip
        except server.ServerError as exc:
            print(f"emrl server up failed: {exc}", file=sys.stderr)
            return 1
        print(_up_message(state))
        return 0
    if args.server_action == "down":
        stopped = server.server_down(project_root=args.project_root, home=args.home)
        print("Stopped: " + ", ".join(stopped) if stopped else "Nothing was running.")
        return 0
    report = server.server_status(project_root=args.project_root, home=args.home)
    if args.json:
        print(json.dumps(report, indent=2))
    elif report["running"]:
        print(f"running: UI {report['ui_url']}, API {report['api_url']}, pool {report['pool']} "
              f"({report['pool_status']}), deployments: {', '.join(report['deployments']) or 'none'}")  # fmt: skip
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1


def _add_server(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("server", parents=common, help="local Prefect server + worker + deployments (make serve)",
                       description="A local Prefect server (UI included), the emrl-local process pool, the "
                       "deployments of prefect.yaml and a worker; state in .prefect-home/server/.")  # fmt: skip
    p.set_defaults(func=_server)
    actions = p.add_subparsers(dest="server_action", required=True, metavar="ACTION", parser_class=_Parser)
    where = argparse.ArgumentParser(add_help=False, parents=common)
    where.add_argument("--home", type=Path, default=None, help="its PREFECT_HOME (default: .prefect-home/server)")
    where.add_argument("--project-root", type=Path, default=PROJECT_ROOT, help="the checkout with prefect.yaml")
    up = actions.add_parser("up", parents=[where], help="start server, pool, deployments and worker")
    up.add_argument("--port", type=_positive(), default=None, help="TCP port on 127.0.0.1 (default: a free one)")
    up.add_argument("--no-deploy", dest="deploy", action="store_false", help="skip `prefect deploy --all`")
    up.add_argument("--no-worker", dest="worker", action="store_false", help="do not start a worker")
    up.add_argument("--timeout", type=_positive(float), default=180.0, help="seconds to wait for server and worker")
    actions.add_parser("down", parents=[where], help="stop what `up` started; mark its active runs Cancelled")
    status = actions.add_parser("status", parents=[where], help="is it running; is PREFECT_API_URL set right")
    status.add_argument("--json", action="store_true", help="print the report as JSON")
    for action in actions.choices.values():
        action.formatter_class, action.epilog = _Formatter, CREDENTIALS


def build_parser() -> argparse.ArgumentParser:
    """The `emrl` argument parser (every option documented, with its default)."""
    common = [_debug_parent()]
    parser = _Parser(
        prog="emrl",
        description="E-MRL data: AbdomenAtlas 3.0 -> E-MRL training data.",
        epilog=CREDENTIALS,
        formatter_class=_Formatter,
        parents=common,
    )
    parser.set_defaults(debug=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for add in (
        _add_synth,
        _add_build_sft_set,
        _add_build_rl_hardset,
        _add_publish,
        _add_eval,
        _add_demo,
        _add_server,
        _add_upgrade_checkpoint,
    ):
        add(sub, common)
    for choice in sub.choices.values():
        choice.formatter_class = _Formatter
        choice.epilog = choice.epilog or CREDENTIALS
    return parser


def _explain(exc: BaseException) -> tuple[str, str]:
    """(problem, fix) for a failure that is not a `UsageError`."""
    name = type(exc).__name__
    text = " ".join(str(exc).split())[:300] or name
    if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError)):
        return f"{name}: {text}", "check the path and its permissions"
    if name == "OutputWriteError":  # no room to write: the message names the file and the cause
        return text, getattr(exc, "fix", "free space and rerun")
    if name in ("AtlasError", "NoCasesError"):
        return text, "fix the atlas folder or the file named above, then rerun (docs/decisions.md: atlas robustness)"
    if name == "EndpointAuthError":
        return text, "export OPENAI_API_KEY=<a key the endpoint accepts>, then rerun (finished rows are kept)"
    if name == "EndpointProbeError":
        return text, getattr(exc, "fix", "check --endpoint, --endpoint-model and --dialect")
    if name == "ClusterPreflightError":
        return (
            text,
            "correct what the line above names (docs/scaling.md, 'Running on a cluster'), then rerun; no case was curated",
        )
    network = ("ConnectError", "ConnectTimeout", "ConnectionError", "OfflineModeIsEnabled", "ReadTimeout")
    if any(n in network for n in (name, *(type(c).__name__ for c in _causes(exc)))):
        return f"network problem: {name}: {text}", "check the connection (and HF_ENDPOINT / --endpoint), then rerun"
    return f"{name}: {text}", "rerun with --debug for the traceback"


def _causes(exc: BaseException) -> list[BaseException]:
    found, seen = [], set()
    while (exc := exc.__cause__ or exc.__context__) is not None and id(exc) not in seen:  # type: ignore[assignment]
        seen.add(id(exc))
        found.append(exc)
    return found


def _interrupt_handler() -> Callable[[int, Any], None]:
    count = [0]

    def handle(signum: int, frame: Any) -> None:
        count[0] += 1
        if count[0] == 1:
            raise KeyboardInterrupt
        print("\nInterrupted again: exiting now. A rerun resumes.", file=sys.stderr, flush=True)
        kill_temporary_servers()
        os._exit(130)

    return handle


INTERRUPT_GRACE_S = 10.0  # how long an interrupted run may take to shut down in order before it is ended


def _exit_within(seconds: float, code: int, *, debug: bool = False) -> None:
    """End the process `seconds` from now unless it has ended by then (an orderly exit comes first).

    After Ctrl-C, interpreter shutdown joins every non-daemon thread; a thread still blocked would keep it alive. Seen
    once in ~20 runs under load: a request worker that Ctrl-C caught while `ThreadPoolExecutor.submit` waited for it
    to start (fixed in `inference.backends.OpenAIBackend.generate`); a library thread could do the same. This daemon
    thread names the non-daemon threads still running (with `debug`, every thread's stack too), stops any temporary
    Prefect server this process started and exits with `code`.
    """

    def force() -> None:
        time.sleep(seconds)
        holding = sorted(
            t.name for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not main_thread
        )
        held_by = f" (threads still running: {', '.join(holding)})" if holding else ""
        print(
            f"Still stopping after {seconds:g} s{held_by}: exiting now. A rerun resumes.", file=sys.stderr, flush=True
        )
        if debug:  # where each thread is blocked, for a bug report
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        kill_temporary_servers()
        os._exit(code)

    main_thread = threading.main_thread()
    threading.Thread(target=force, name="emrl-exit-guard", daemon=True).start()


def _run(args: argparse.Namespace) -> Any:
    if getattr(args, "check", None) is not None:
        args.check(args)
    if not getattr(args, "prefect", False):
        return args.func(args)
    with prefect_session(debug=args.debug):
        return args.func(args)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `emrl` command; exits 2 on a usage mistake, 1 on a failure, 130 on Ctrl-C."""
    configure_prefect_environment()  # before anything imports prefect
    argv_given, argv = argv, sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    # `emrl --debug CMD` too (a subcommand's own default would otherwise reset it), and EMRL_DEBUG=1
    args.debug = args.debug or "--debug" in argv or os.environ.get("EMRL_DEBUG", "") not in ("", "0")
    if not getattr(args, "prefect", False):  # Prefect sets up its own console logging (basicConfig would replace it)
        logging.basicConfig(level=os.environ.get("EMRL_LOG_LEVEL", "WARNING"))
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT)
    if in_main_thread:
        signal.signal(signal.SIGINT, _interrupt_handler())
    prog = f"emrl {args.command}"
    try:
        status = _run(args)
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted. Finished work is kept: rerun the same command to resume.", file=sys.stderr)
        if in_main_thread and argv_given is None:  # the `emrl` process itself, not a caller's in-process main([...])
            _exit_within(INTERRUPT_GRACE_S, 130, debug=args.debug)
        raise SystemExit(130) from None
    except UsageError as exc:
        if args.debug:
            raise
        print(f"{prog}: error: {exc.problem}\n  fix: {exc.fix}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as exc:
        if args.debug:
            raise
        problem, fix = _explain(exc)
        print(f"{prog}: failed: {problem}\n  fix: {fix}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)
    if isinstance(status, int) and status:
        raise SystemExit(status)


if __name__ == "__main__":
    sys.exit(main())
