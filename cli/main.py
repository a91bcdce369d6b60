"""The `emrl` command line: synthetic atlas, the flows, evaluation, and the one-command demo.

    emrl synth OUT [--cases 32] [--layout split|combined]
    emrl layouts
    emrl overlaps OUT_A OUT_B [--out FILE]
    emrl build-sft-set ATLAS OUT [--cases-per-task 8] [--workers 2] [--limit N] [--frame-size 448] [--max-frames 32]
    emrl build-rl-hardset OUT/sft OUT (--model SFT_DIR | --endpoint URL --endpoint-model NAME [--dialect openai])
    emrl publish OUT/sft ORG/NAME X.Y.Z [--local-root DIR]
    emrl eval OUT/predictions [OTHER/predictions ...] [--out eval-output]
    emrl demo [--out demo-output]

A thin shell: each command is a module of `cli.commands` (its options generated from `cli.settings`), the
cheap checks before Prefect starts are `cli.preflight`, Ctrl-C is `cli.interrupt`. It runs the Prefect flows of
`flows/`, which never import it; `emrl_data` stays free of Prefect.

A user's mistake ends in a short message naming the problem and the fix (exit 2), a failure in one or two lines
(exit 1), Ctrl-C in "interrupted; rerun to resume" (exit 130); `--debug` (or `EMRL_DEBUG=1`) shows tracebacks.
Prefect's settings are made before `prefect` is imported (`cli.prefect_env`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from cli.commands import (
    build_rl_hardset,
    build_sft_set,
    demo,
    evaluate,
    fetch_atlas,
    layouts,
    overlaps,
    publish,
    server,
    synth,
    upgrade_checkpoint,
)
from cli.commands.parsing import CREDENTIALS, Formatter, Parser, debug_parent
from cli.errors import UsageError
from cli.interrupt import INTERRUPT_GRACE_S, exit_within, interrupt_handler
from cli.prefect_env import configure_prefect_environment, prefect_session


COMMANDS = (
    synth,
    build_sft_set,
    layouts,
    overlaps,
    fetch_atlas,
    build_rl_hardset,
    publish,
    evaluate,
    demo,
    server,
    upgrade_checkpoint,
)


def build_parser() -> argparse.ArgumentParser:
    """The `emrl` argument parser (every option documented, with its default)."""
    common = [debug_parent()]
    parser = Parser(
        prog="emrl",
        description="E-MRL data: AbdomenAtlas 3.0 -> E-MRL training data.",
        epilog=CREDENTIALS,
        formatter_class=Formatter,
        parents=common,
    )
    parser.set_defaults(debug=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.add(sub, common)
    for choice in sub.choices.values():
        choice.formatter_class = Formatter
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
    if name == "HubAccessError":  # the line names the repository and what access it needs
        return text, "give HF_TOKEN the access the line above names, then rerun (nothing was downloaded)"
    if name == "EndpointAuthError":
        return text, "export OPENAI_API_KEY=<a key the endpoint accepts>, then rerun (finished rows are kept)"
    if name in ("PartsFailedError", "ScratchSpaceError"):  # the line names the parts (or the folder) and why, whole
        return " ".join(str(exc).split()), getattr(
            exc, "fix", "free space there or change --scratch-dir / --scratch-budget, then rerun"
        )
    if name == "FailedPredictionsError":  # the fix says what a rerun does with the failed rows
        return text, getattr(exc, "fix", "rerun the same command")
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
        signal.signal(signal.SIGINT, interrupt_handler())
    prog = f"emrl {args.command}"
    try:
        status = _run(args)
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted. Finished work is kept: rerun the same command to resume.", file=sys.stderr)
        if in_main_thread and argv_given is None:  # the `emrl` process itself, not a caller's in-process main([...])
            exit_within(INTERRUPT_GRACE_S, 130, debug=args.debug)
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
    main()
