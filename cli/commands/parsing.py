"""The `emrl` parser's pieces: a two-line error, defaults shown in the help, options generated from `cli.settings`."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence
from typing import Any

from cli.settings import RENAMED, Setting


CREDENTIALS = """\
credentials and settings (environment):
  HF_TOKEN             Hugging Face token for `emrl publish` to the Hub (or log in once with `hf auth login`)
  OPENAI_API_KEY       bearer key sent to an OpenAI-compatible --endpoint (`vllm serve --api-key ...`)
  PREFECT_API_URL      use this running Prefect server (`make serve` prints it); unset: a temporary one starts
  PREFECT_HOME         Prefect's database and results (default: .prefect-home/ in the checkout)
  EMRL_DEBUG=1         show tracebacks (same as --debug); EMRL_LOG_LEVEL=INFO for library logs
"""


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show each option's default, except where it is None or a flag's False (the help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, argparse.SUPPRESS) or isinstance(action.default, bool):  # flags say it
            return action.help or ""
        return super()._get_help_string(action) or ""


class Parser(argparse.ArgumentParser):
    """argparse with a two-line error (the problem and where the help is) instead of the whole usage block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("description"):
            kwargs["description"] = textwrap.fill(kwargs["description"], 100)
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # noqa: D102 (argparse's API)
        given = {word.split("=")[0] for word in message.split()}
        renamed = "".join(f"; {old} is now {new}" for old, new in RENAMED.items() if old in given)
        self.exit(2, f"{self.prog}: error: {message}{renamed}\n  see `{self.prog} --help`\n")


def debug_parent() -> argparse.ArgumentParser:
    """The `--debug` option every command shares."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks (also EMRL_DEBUG=1)"
    )
    return parent


def add_settings(parser: Any, settings: Sequence[Setting]) -> None:
    """Add one option per setting (those with an option), named, typed and documented as the table says."""
    for s in settings:
        if s.option is None:
            continue
        kwargs: dict[str, Any] = {"dest": s.name, "help": s.help.replace("{default}", str(s.default))}
        if s.is_flag:
            kwargs.update(action="store_false" if s.default else "store_true", default=s.default)
        else:
            kwargs.update(default=None if s.unset else s.default)
            if s.type is not None:
                kwargs["type"] = s.type
            if s.metavar is not None:
                kwargs["metavar"] = s.metavar
            if s.choices is not None:
                kwargs["choices"] = list(s.choices)
        parser.add_argument(s.option, **kwargs)
