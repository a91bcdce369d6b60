"""Cheap checks of an `emrl` command's arguments, run before Prefect starts: a user's mistake fails here in one line.

Each `check_*` takes the parsed arguments and raises `UsageError(problem, fix)`; the endpoint and Hub checks make one
request each (a refused key or an unreachable server fails in seconds, not after retries).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cli.errors import UsageError
from cli.settings import SHELL, by_name
from emrl_data.reading.atlas import AtlasError, discover_cases
from emrl_data.tables.overlaps import FINGERPRINT_FILE
from emrl_data.tables.shards import split_shards


ENDPOINT_CHECK_TIMEOUT_S = by_name(SHELL)["endpoint_check_timeout_s"].default


def check_output(out: Path) -> None:
    """The output path is a folder or can become one."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"the output path {out} is a file", "pass a folder (it is created when missing)")
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UsageError(f"{parent} (in the output path {out}) is a file", "pass a folder path")


def check_synth(args: argparse.Namespace) -> None:
    """`emrl synth`."""
    check_output(args.out)


def check_fingerprint_table(out: Path) -> None:
    """An output folder of `emrl build-sft-set` with its fingerprint table (`--exclude-overlaps-with`)."""
    if not (out / FINGERPRINT_FILE).is_file():
        raise UsageError(
            f"--exclude-overlaps-with {out}: no {FINGERPRINT_FILE} there",
            "give an output folder of `emrl build-sft-set` (every run writes one; rerun it there to add it)",
        )


def check_build_sft_set(args: argparse.Namespace) -> None:
    """`emrl build-sft-set`: the atlas folder holds cases; the output path is usable; an `--exclude-overlaps-with`
    folder holds a fingerprint table."""
    from hub.listing import hub_repo, is_parts_folder  # lazy: hub.listing adds 0.16 s to `emrl --help` (measured)

    if getattr(args, "exclude_overlaps_with", None) is not None:
        check_fingerprint_table(Path(args.exclude_overlaps_with))
    try:
        if hub_repo(str(args.atlas)) is not None:  # the Hub release: listed when the flow starts
            check_output(args.out)
            return
    except ValueError as exc:
        raise UsageError(str(exc), "e.g. hf://datasets/AbdomenAtlas/AbdomenAtlas3.0Mini --revision main") from None
    atlas = Path(args.atlas)
    if is_parts_folder(atlas):  # release parts as `hf download` leaves them: paired when the flow starts
        check_output(args.out)
        return
    if not atlas.is_dir():
        what = "is a file" if atlas.exists() else "does not exist"
        raise UsageError(
            f"the atlas folder {atlas} {what}",
            "pass the AbdomenAtlas root (image_only/ + mask_only/, or BDMAP_* folders); `emrl synth DIR` writes one",
        )
    labels = None if args.labels_dir is None else Path(args.labels_dir)
    try:
        found = discover_cases(atlas, layout=args.layout, labels=labels)
    except (ValueError, FileNotFoundError) as exc:  # a layout no one has, --labels for a layout that takes none
        raise UsageError(str(exc), "pass a name `emrl layouts` lists, or leave --layout out to detect it") from None
    except AtlasError as exc:  # NoCasesError included: the message names what was found instead
        raise UsageError(
            str(exc), "point at the atlas root that holds image_only/ and mask_only/ (or BDMAP_* folders)"
        ) from None
    if not found.refs:
        raise UsageError(
            f"no cases in {atlas}: no valid BDMAP_######## folders ({len(found.rejections)} invalid ones)",
            "point at the atlas root that holds image_only/ and mask_only/ (or the BDMAP_* folders)",
        )
    check_output(args.out)


def check_build_rl_hardset(args: argparse.Namespace) -> None:
    """`emrl build-rl-hardset`: an SFT set, a checkpoint or an endpoint that answers, options that fit together."""
    sft = Path(args.sft_dir)
    if not split_shards(sft / "data", "train"):
        hint = f"pass {sft / 'sft'}" if (sft / "sft" / "data").is_dir() else "run `emrl build-sft-set ATLAS OUT` first"
        raise UsageError(f"no SFT set in {sft} (no data/train-*-of-*.parquet)", f"{hint}, then pass OUT/sft")
    if args.endpoint and not args.endpoint_model:
        raise UsageError(
            "--endpoint needs --endpoint-model", "add --endpoint-model NAME (the model the server serves)"
        )
    for given, option in (
        (args.endpoint_model, "--endpoint-model"),
        (args.dialect, "--dialect"),
        (args.max_tokens_field, "--max-tokens-field"),
        (not args.probe, "--no-probe"),
    ):
        if given and not args.endpoint:
            raise UsageError(f"{option} is only used with --endpoint", "add --endpoint URL/v1, or drop it")
    if args.model is not None and not Path(args.model).is_dir():
        raise UsageError(f"the model folder {args.model} does not exist", "pass a local checkpoint folder (--model)")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise UsageError(
            f"{args.model} is not a model checkpoint (no config.json)",
            "pass the folder `python -m train.sft` wrote (its --output_dir)",
        )
    check_output(args.out)
    if args.endpoint:
        check_endpoint(args.endpoint, args.endpoint_model)


def check_endpoint(base_url: str, model: str, timeout_s: float = ENDPOINT_CHECK_TIMEOUT_S) -> None:
    """Ask the endpoint for its models once: a refused key or an unreachable server fails here, before any row."""
    # lazy: httpx and the client add 0.09 s to `emrl --help` (measured)
    from inference.bounded_http import Deadlines, clean, exchange, make_client, mask, parse_json

    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadlines = Deadlines(timeout_s, timeout_s, timeout_s)  # a server that trickles its answer cannot hold the start
    with make_client(1, deadlines) as client:
        answer = exchange(client, "GET", base_url.rstrip("/") + "/models", deadlines=deadlines, headers=headers)
    if answer.status is None:
        words = (answer.error or "").split(": ")  # "connection error: ConnectError: ..." or "timeout: ..."
        raise UsageError(
            f"cannot reach the endpoint {base_url} ({words[1] if words[0] == 'connection error' else words[0]})",
            "start the server (`make vllm-serve CKPT=DIR`, or `vllm serve` with the flags of docs/serving.md) or fix "
            "--endpoint (the base URL including /v1)",
        )
    if answer.status in (401, 403):
        state = "is not set" if not key else "was refused"
        raise UsageError(
            f"the endpoint answered HTTP {answer.status}: OPENAI_API_KEY {state}",
            "export OPENAI_API_KEY=<a key the server accepts> (vllm: the value of --api-key)",
        )
    if answer.status == 200:
        data, _ = parse_json(answer.body)
        try:
            served = [mask(clean(str(m["id"])), [key or ""])[:100] for m in data.get("data", [])]
        except (AttributeError, KeyError, TypeError):
            return  # not the OpenAI models list: the first request will tell
        # `transformers serve PATH` lists its Hub cache, not the model it was given by path: the probe checks that name.
        if served and model not in served and not Path(model).is_dir():
            raise UsageError(
                f"the endpoint serves {', '.join(served[:5])}, not {model!r}", f"--endpoint-model {served[0]}"
            )


def check_demo(args: argparse.Namespace) -> None:
    """`emrl demo`."""
    check_output(args.out)


def check_eval(args: argparse.Namespace) -> None:
    """`emrl eval`: every predictions path holds prediction files."""
    from cli.evaluate import prediction_files  # lazy: polars and matplotlib, +0.33 s to `emrl --help` (measured)

    for path in args.predictions:
        prediction_files(Path(path))
    check_output(args.out)


def check_publish(args: argparse.Namespace) -> None:
    """`emrl publish`: a table folder; a Hub token the Hub accepts (unless publishing to a folder or a dry run)."""
    table = Path(args.table_dir)
    if not (table / "data").is_dir():
        raise UsageError(f"{table} is not a table folder (no data/)", "pass e.g. OUT/sft, written by build-sft-set")
    if args.local_root is None and not getattr(args, "dry_run", False):
        check_hub()


def check_hub() -> None:
    """One `whoami` call: no network, no token or a refused token fail here, in seconds, not after upload retries."""
    import httpx  # lazy: huggingface_hub and httpx add 0.16 s to `emrl --help` (measured)
    from huggingface_hub import HfApi, constants  # lazy: see httpx above
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError  # lazy: see httpx above

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
