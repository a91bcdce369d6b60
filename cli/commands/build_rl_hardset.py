"""`emrl build-rl-hardset OUT/sft OUT`: run the build-rl-hardset flow (SFT model -> predictions -> hard set)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cli.commands.parsing import add_settings
from cli.preflight import check_build_rl_hardset
from cli.settings import BUILD_RL_HARDSET, by_name


def add(sub: Any, common: list[argparse.ArgumentParser]) -> None:
    """Declare `emrl build-rl-hardset`."""
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
    add_settings(p, BUILD_RL_HARDSET)
    p.set_defaults(func=run, check=check_build_rl_hardset, prefect=True)


def run(args: argparse.Namespace) -> dict:
    """Run the flow with the options; print its summary."""
    # lazy: Prefect and the flow add 0.9 s to `emrl --help` (measured)
    from flows.build_rl_hardset import build_rl_hardset_flow

    settings = by_name(BUILD_RL_HARDSET)
    options = {name: getattr(args, name) for name, s in settings.items() if s.flow}
    for name in ("dialect", "max_tokens_field"):  # None: not given (only valid with --endpoint), the default applies
        options[name] = options[name] or settings[name].default
    summary = build_rl_hardset_flow(
        sft_dir=str(args.sft_dir),
        output_dir=str(args.out),
        model_path=None if args.model is None else str(args.model),
        backend="openai" if args.endpoint else "transformers",
        endpoint_url=args.endpoint,
        endpoint_model=args.endpoint_model,
        splits=None if args.split == "all" else [args.split],
        **options,
    )
    print()
    print((Path(args.out) / "rl_hardset" / "summary.md").read_text())
    return summary
