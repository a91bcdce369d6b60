"""`cli/settings.py` is the one home of every run setting: the CLI, the flow signatures and `prefect.yaml` agree.

A default restated elsewhere (a flow signature, `prefect.yaml`'s parameters or its header comment, the demo) that
drifts from the table fails here. No Prefect run, no server: milliseconds.
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli import settings
from cli.main import build_parser
from cli.settings import (
    BUILD_RL_HARDSET,
    BUILD_SFT_SET,
    DEMO,
    DEMO_FRAMES,
    FRAME_SETTINGS,
    Setting,
    by_name,
    demo_kwargs,
)
from emrl_data.config import FrameConfig, SftConfig


ROOT = Path(__file__).resolve().parents[2]

# Flow parameters that are inputs (what to read, where to write, which model), not settings with a default to declare.
FLOW_INPUTS = {
    "build-sft-set": {"atlas_root", "output_dir", "config"},
    "build-rl-hardset": {"sft_dir", "output_dir", "model_path", "backend", "endpoint_url", "endpoint_model", "splits"},
}


def _flows() -> dict[str, tuple[Callable[..., Any], tuple[Setting, ...]]]:
    from flows.build_rl_hardset import build_rl_hardset_flow
    from flows.build_sft_set import build_sft_set_flow

    return {
        "build-sft-set": (build_sft_set_flow.fn, BUILD_SFT_SET),
        "build-rl-hardset": (build_rl_hardset_flow.fn, BUILD_RL_HARDSET),
    }


def _all_tables() -> Iterator[tuple[str, tuple[Setting, ...]]]:
    for name, value in vars(settings).items():
        if name.isupper() and isinstance(value, tuple) and value and all(isinstance(s, Setting) for s in value):
            yield name, value


@pytest.mark.parametrize("flow_name", ["build-sft-set", "build-rl-hardset"])
def test_flow_signature_defaults_are_the_tables(flow_name: str) -> None:
    fn, table = _flows()[flow_name]
    params = inspect.signature(fn).parameters
    declared = {s.name: s for s in table if s.flow}
    for name, s in declared.items():
        assert name in params, f"{flow_name}: the setting {name} is no parameter of the flow"
        assert params[name].default == s.default, f"{flow_name}({name}=...): {params[name].default!r} != {s.default!r}"
    # every parameter with a default is declared in the table (or is an input): a new setting cannot skip the table
    undeclared = {n for n, p in params.items() if p.default is not inspect.Parameter.empty} - set(declared)
    assert undeclared <= FLOW_INPUTS[flow_name], f"{flow_name}: declare {sorted(undeclared)} in cli/settings.py"


def test_library_defaults_come_from_emrl_data_config() -> None:
    sft, frames = by_name(BUILD_SFT_SET), FrameConfig()
    assert sft["frame_size_px"].default == frames.frame_size_px == 448
    assert sft["max_frames"].default == frames.max_frames == 32
    for name in ("negatives_per_positive", "seed", "test_fraction"):
        assert sft[name].default == getattr(SftConfig(), name), name
    from train.tools.memory_plan import Shape  # the memory plan reads the same frames

    assert (Shape().frames, Shape().frame_px) == (frames.max_frames, frames.frame_size_px)


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize(
    ("command", "table"),
    [
        (("synth",), settings.SYNTH),
        (("build-sft-set",), BUILD_SFT_SET),
        (("build-rl-hardset",), BUILD_RL_HARDSET),
        (("publish",), settings.PUBLISH),
        (("eval",), settings.EVAL),
        (("demo",), DEMO),
        (("server", "up"), (*settings.SERVER_WHERE, *settings.SERVER_UP)),
        (("server", "status"), (*settings.SERVER_WHERE, *settings.SERVER_STATUS)),
    ],
)
def test_cli_options_are_generated_from_the_table(command: tuple[str, ...], table: tuple[Setting, ...]) -> None:
    parser = _subparser(build_parser(), *command)
    actions = {a.dest: a for a in parser._actions}  # noqa: SLF001
    for s in table:
        action = actions[s.name]
        assert action.option_strings == [s.option], s.name
        assert action.default == (None if s.unset else s.default), s.name
        assert s.unit is not None and s.help, s.name


def test_one_option_name_one_setting() -> None:
    """Two meanings never share an option (`--batch-size` was cases per task in one command, rows per call in the
    other); every option with a value names its unit in the table."""
    names: dict[str, set[str]] = {}
    for _, table in _all_tables():
        for s in table:
            if s.option is not None:
                names.setdefault(s.option, set()).add(s.name)
            if isinstance(s.default, (int, float)) and not isinstance(s.default, bool) and s.name != "seed":
                assert s.unit, f"{s.name}: a number without a unit"
    assert {option: n for option, n in names.items() if len(n) > 1} == {}
    assert "--batch-size" not in names
    options = {s for p in (build_parser(),) for a in p._actions for s in a.option_strings}  # noqa: SLF001
    assert "--batch-size" not in options


def test_prefect_yaml_parameters_are_the_demos_settings() -> None:
    """A deployment run after `make demo` resumes the demo's work: every parameter is the table's demo value."""
    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    deployments = {d["name"]: d["parameters"] for d in config["deployments"]}
    out = str(by_name(DEMO)["out"].default)
    checked = 0
    for flow_name, (_, table) in _flows().items():
        params, declared = deployments[flow_name], by_name(table)
        for key, value in params.items():
            if key in declared:
                assert value == declared[key].demo_value, f"prefect.yaml {flow_name}.{key}: {value!r}"
                checked += 1
            elif key == "config":
                assert value == DEMO_FRAMES, f"prefect.yaml {flow_name}.config"
            elif key in ("atlas_root", "output_dir", "sft_dir", "model_path"):  # the demo's folders
                assert value == out or value.startswith(out + "/"), f"prefect.yaml {flow_name}.{key}: {value!r}"
            else:
                assert key in FLOW_INPUTS[flow_name], f"prefect.yaml {flow_name}.{key}: not in cli/settings.py"
        # the demo's own values are all in the deployment (demo and deployment cannot drift apart)
        for key, value in demo_kwargs(table).items():
            assert params.get(key) == value, f"prefect.yaml {flow_name}.{key} should be the demo's {value!r}"
    assert checked >= 10
    assert deployments["build-sft-set"]["atlas_root"] == f"{out}/atlas"
    assert deployments["build-rl-hardset"]["model_path"] == f"{out}/sft_model"


def test_prefect_yaml_header_states_the_demos_settings() -> None:
    """The header comment's numbers (frames, px, new tokens) are the table's demo values."""
    header = "".join(line for line in (ROOT / "prefect.yaml").read_text().splitlines(True) if line.startswith("#"))
    text = " ".join(header.replace("#", " ").split())
    found = re.search(r"(\S+)/, (\d+) px x (\d+) frames, (\d+) new tokens on (\w+)", text)
    assert found, "prefect.yaml's header no longer states the demo's folder, frames and tokens"
    frames, rl = by_name(FRAME_SETTINGS), by_name(BUILD_RL_HARDSET)
    assert found.group(1) == str(by_name(DEMO)["out"].default)
    assert int(found.group(2)) == frames["frame_size_px"].demo_value
    assert int(found.group(3)) == frames["max_frames"].demo_value
    assert int(found.group(4)) == rl["max_new_tokens"].demo_value
    assert found.group(5).lower() == rl["device"].demo_value


def test_demo_description_and_frames_are_the_tables() -> None:
    assert DEMO_FRAMES == {"frames": {"frame_size_px": 128, "max_frames": 16}}
    demo_help = _subparser(build_parser(), "demo").format_help()
    assert "on CPU (128 px x 16 frames)" in " ".join(demo_help.split())


@pytest.mark.parametrize("given", [["--batch-size", "2"], ["--batch-size=2"]])
def test_the_old_batch_size_option_names_its_successors(given: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["build-sft-set", "atlas", "out", *given])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert "--batch-size is now --cases-per-task (build-sft-set: cases per Prefect task) or --rows-per-call" in err
