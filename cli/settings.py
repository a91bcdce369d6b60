"""Every run setting of the `emrl` commands and the flows, declared once: name, default, unit, help, demo value.

The `emrl` options are generated from these tables (`cli.commands.parsing.add_settings`); the flow signatures'
defaults and `prefect.yaml`'s parameters (and its header comment) are checked against them by
`tests/cli/test_settings.py`, so a copy that drifts fails `make test`.

Where a default is a property of the data it makes (frame size, frames per organ, negative sampling, the test share),
the library owns it (`emrl_data.config`) and the table reads it from there; the rest are run-only settings (how the
work is split, how many workers, timeouts, the demo's smaller shapes) and live here.

`demo` is the value the CPU demo (`emrl demo`, `cli.demo`) and the deployments of `prefect.yaml` use when it differs
from the default: smaller frames and fewer tokens, so that training and mining a tiny model finish in minutes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emrl_data import PROJECT_ROOT
from emrl_data.config import HARD_SET_SIZE, FrameConfig, SftConfig


_FRAMES, _SFT = FrameConfig(), SftConfig()


def positive(kind: type = int, minimum: float = 1) -> Callable[[str], Any]:
    """An argparse `type`: a number of `kind` that is at least `minimum` (a two-line error otherwise)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    return parse


_SAME = object()  # `demo` not given: the demo uses the default


@dataclass(frozen=True)
class Setting:
    """One run setting.

    Attributes:
        name: the flow parameter (and `prefect.yaml` key) it sets, and the argparse destination.
        option: the `emrl` option, or None for a setting without one (a timeout of the shell itself).
        default: the default value (the flow signature's default too, checked by a test).
        unit: what one unit of the value is ("cases", "px", "s", ...; "" for names and choices).
        help: the option's help; `{default}` in it is replaced by the default.
        type: argparse `type` (a parser of the text), None for strings.
        metavar: the placeholder in the usage line.
        choices: the allowed values, when they are a closed set.
        demo: the demo's and the deployments' value when it is not the default.
        flow: False for a CLI-only setting (no flow parameter of that name, e.g. `--split` → `splits`).
        unset: True when the option's own default is None, meaning "not given" (`default` applies then, or the
            option is only valid with another one); the help names the default.
    """

    name: str
    option: str | None
    default: Any
    unit: str
    help: str
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: Sequence[str] | None = None
    demo: Any = _SAME
    flow: bool = True
    unset: bool = False

    @property
    def demo_value(self) -> Any:
        """The value the demo and the deployments use."""
        return self.default if self.demo is _SAME else self.demo

    @property
    def is_flag(self) -> bool:
        """An on/off option without a value (`--dry-run`, `--no-probe`)."""
        return isinstance(self.default, bool)


def by_name(settings: Sequence[Setting]) -> dict[str, Setting]:
    """The settings keyed by name."""
    return {s.name: s for s in settings}


# One setting per call, wrapped by hand so that the tables read as tables.
# fmt: off

# `emrl synth` -------------------------------------------------------------------------------------------------------

SYNTH = (
    Setting("cases", "--cases", 32, "cases", "number of cases", positive(), "N"),
    Setting("seed", "--seed", 0, "", "seed of the synthetic anatomy and lesions", int, "N"),
    Setting("layout", "--layout", "split", "", "split: image_only/ + mask_only/ (AbdomenAtlas 3.0); combined: one "
            "folder per case", choices=("split", "combined")),
)

# `emrl build-sft-set` = the build-sft-set flow ----------------------------------------------------------------------

FRAME_SETTINGS = (  # the `frames` section of the flow's `config` (emrl_data.config.FrameConfig)
    Setting("frame_size_px", "--frame-size", _FRAMES.frame_size_px, "px", "frame edge in px (default: {default}, the "
            "E-MRL setting)", positive(minimum=8), "PX", demo=128, flow=False, unset=True),
    Setting("max_frames", "--max-frames", _FRAMES.max_frames, "frames", "frames per organ at most (default: {default})",
            positive(), "N", demo=16, flow=False, unset=True),
)

BUILD_SFT_SET = (
    Setting("cases_per_task", "--cases-per-task", 8, "cases", "cases per Prefect task", positive(), "N", demo=4),
    Setting("max_workers", "--workers", 2, "tasks", "tasks running at once (threads or processes)", positive(), "N"),
    Setting("task_runner", "--task-runner", "thread", "", "where tasks run (docs/scaling.md); process/dask/ray are "
            "true CPU parallelism", choices=("thread", "process", "dask", "ray")),
    Setting("task_runner_address", "--task-runner-address", None, "", "an existing Dask scheduler (tcp://host:8786) "
            "or Ray cluster (ray://head:10001) (default: a local one)", metavar="URL"),
    Setting("limit", "--limit", None, "cases", "only the first N cases by id (default: all)", positive(), "N"),
    *FRAME_SETTINGS,
    Setting("negatives_per_positive", "--negatives-per-positive", _SFT.negatives_per_positive, "negatives/positive",
            "train negatives sampled per organ, as a ratio of its positives", positive(float, 0), "X"),
    Setting("seed", "--seed", _SFT.seed, "", "seed of the negative sampling", int, "N"),
    Setting("test_fraction", "--test-fraction", _SFT.test_fraction, "share", "test share of the case-id hash split "
            "(when the atlas has no IID split files)", positive(float, 0), "X"),
    Setting("max_unexpected_errors", "--max-unexpected-errors", 0, "cases", "fail when more cases than this hit an "
            "unexpected (non-data) error", positive(int, 0), "N"),
    Setting("case_timeout_s", "--case-timeout", None, "s", "abandon a case still running after this long as a "
            "case_timeout rejection; the run goes on (default: max(600 s, 10x the median case time); "
            "docs/operations.md)", positive(float, 0.01), "SECONDS"),
    Setting("revision", "--revision", None, "", "hf:// atlas: branch, tag or commit of the release (default: "
            "main), pinned to its commit sha; a folder of parts: check every part against that revision's listing", metavar="REV"),
    Setting("scratch_dir", "--scratch", None, "", "hf:// atlas only: where parts are downloaded and unpacked "
            "(default: OUT/.work/scratch)", metavar="DIR"),
    Setting("scratch_budget", "--scratch-budget", "64G", "bytes", "hf:// atlas only: the most the scratch folder "
            "holds at once (K, M, G, T); sets how many part pairs run at once", metavar="SIZE"),
    Setting("exclude_overlaps_with", "--exclude-overlaps-with", None, "", "another output folder: a test case that is "
            "the same CT as one of its training cases becomes an overlaps_training_ct rejection (default: none, no "
            "case is refused; docs/data.md)", metavar="OUT_OTHER"),
    Setting("layout", "--layout", None, "", "read the folder as this dataset layout, one `emrl layouts` lists "
            "(default: detected from the folder)", metavar="NAME"),
    Setting("labels_dir", "--labels", None, "", "the label maps' folder of a dataset whose labels are released "
            "apart, e.g. panorama_labels/manual_labels (default: beside the images)", metavar="DIR"),
)

# `emrl build-rl-hardset` = the build-rl-hardset flow ----------------------------------------------------------------

ENDPOINT = (  # the request options of `build-rl-hardset --endpoint` (docs/serving.md); only valid with --endpoint
    Setting("dialect", "--dialect", "vllm", "", "request format, with --endpoint (default: {default}): vllm = the "
            "frames as one video_url plus vLLM's fields (our checkpoints on `vllm serve`); openai = one image_url "
            "per frame, standard fields only (`transformers serve`, hosted APIs). See docs/serving.md",
            choices=("vllm", "openai"), unset=True),
    Setting("max_tokens_field", "--max-tokens-field", "max_tokens", "", "name of the length cap in requests, with "
            "--endpoint (default: {default}); OpenAI's newer models (o-series, GPT-5) want max_completion_tokens",
            choices=("max_tokens", "max_completion_tokens"), unset=True),
    Setting("probe", "--no-probe", True, "", "skip the probe (--endpoint): by default the first row is sent twice (2 "
            "and 4 frames) before the run, and a wrong endpoint, model, key or dialect, or a server that drops the "
            "frames, stops it in one line"),
    Setting("connect_timeout_s", "--connect-timeout", 10.0, "s", "deadline to open a connection to --endpoint "
            "(retried)", positive(float, 0.01), "SECONDS"),
    Setting("first_byte_timeout_s", "--first-byte-timeout", 120.0, "s", "longest wait for any byte of an answer, the "
            "first included (--endpoint); past it the row is a timeout error", positive(float, 0.01), "SECONDS"),
    Setting("answer_timeout_s", "--answer-timeout", 300.0, "s", "deadline of a whole answer, first byte sent to last "
            "byte received (--endpoint); past it the row is a timeout error", positive(float, 0.01), "SECONDS"),
)

BUILD_RL_HARDSET = (
    *ENDPOINT,
    Setting("split", "--split", "all", "", "predict the rows of this split only; test: evaluate a (served or hosted) "
            "model on the test split, no hard set", choices=("all", "train", "test"), flow=False),
    Setting("target_size", "--target-size", HARD_SET_SIZE, "rows", "cap of the hard set (paper: about 2K)",
            positive(), "N"),
    Setting("rows_per_call", "--rows-per-call", 4, "rows", "rows per generate call / request batch", positive(), "N"),
    Setting("max_new_tokens", "--max-new-tokens", 256, "tokens", "generation length cap", positive(), "N", demo=128),
    Setting("max_concurrency", "--concurrency", 8, "requests", "requests in flight at once (--endpoint)",
            positive(), "N"),
    Setting("device", "--device", "auto", "", "auto, cpu or cuda[:N] (--model)", metavar="DEV", demo="cpu"),
    Setting("n_bootstrap", "--bootstrap", 1000, "replicates", "bootstrap replicates of the 95 %% intervals",
            positive(), "N", demo=200),
    Setting("max_failed_predictions", "--max-failed-predictions", 0, "rows", "fail when more rows than this got no "
            "prediction (a rerun retries only them)", positive(int, 0), "N"),
    Setting("retry_errors", "--keep-errors", True, "", "keep the rows stored as errors by an earlier run as they are "
            "(by default a rerun sends them again)"),
    Setting("limit", "--limit", None, "rows", "only the first N rows of each split, for smoke runs (default: all)",
            positive(), "N"),
)

# `emrl publish`, `emrl eval`, `emrl demo`, `emrl server` ------------------------------------------------------------

PUBLISH = (
    Setting("local_root", "--local-root", None, "", "publish to this folder instead of the Hub (default: the Hub)",
            Path, "DIR"),
    Setting("public", "--public", False, "", "create the Hub repo public (default: private)", flow=False),
    Setting("dry_run", "--dry-run", False, "", "check token, table and tag; list what would be uploaded; write "
            "nothing"),
    Setting("commercial", "--commercial", False, "", "declare the set for commercial use: a source under a "
            "non-commercial licence is refused (docs/decisions.md)"),
    Setting("config_per_source", "--config-per-source", False, "", "one config per source dataset instead of one "
            "`default` config: sources whose licences cannot be one work (two share-alike licences) go out apart"),
)

EVAL = (
    Setting("out", "--out", Path("eval-output"), "", "folder for metrics.md, .json and .png", Path, "DIR"),
    Setting("split", "--split", "all", "", "rows of this split only", choices=("all", "train", "test")),
    Setting("text_column", "--text-column", "prediction", "", "column holding the model's report", metavar="NAME"),
    Setting("n_bootstrap", "--bootstrap", 1000, "replicates", "bootstrap replicates", positive(), "N"),
    Setting("seed", "--seed", 0, "", "seed of the bootstrap", int, "N"),
    Setting("text_metrics", "--text-metrics", False, "", "also BLEU-1..4, ROUGE-L and CIDEr-D of the findings and "
            "the impression against the gold reports"),
    Setting("gold", "--gold", None, "", "the sft table holding the gold reports for --text-metrics (default: the "
            "one the predictions' manifest names)", Path, "DIR"),
    Setting("against", "--against", None, "", "an earlier evaluation (its folder or metrics.json): refused unless "
            "made on the same rows, split and parser; its headline numbers printed beside these (default: no "
            "earlier evaluation)", Path, "DIR"),
)

DEMO = (
    Setting("out", "--out", Path("demo-output"), "", "output folder", Path, "DIR"),
    Setting("cases", "--cases", 32, "cases", "synthetic cases", positive(), "N"),
    Setting("skip_training", "--skip-training", False, "", "stop after build-sft-set"),
)

SERVER_WHERE = (
    Setting("home", "--home", None, "", "its PREFECT_HOME (default: .prefect-home/server)", Path),
    Setting("project_root", "--project-root", PROJECT_ROOT, "", "the checkout with prefect.yaml", Path),
)
SERVER_UP = (
    Setting("port", "--port", None, "", "TCP port on 127.0.0.1 (default: a free one)", positive()),
    Setting("deploy", "--no-deploy", True, "", "skip `prefect deploy --all`"),
    Setting("worker", "--no-worker", True, "", "do not start a worker"),
    Setting("timeout_s", "--timeout", 180.0, "s", "seconds to wait for server and worker", positive(float), "TIMEOUT"),
)
SERVER_STATUS = (Setting("json", "--json", False, "", "print the report as JSON"),)

# The shell's own limits (no option) ---------------------------------------------------------------------------------

SHELL = (
    Setting("interrupt_grace_s", None, 10.0, "s", "how long an interrupted run may take to shut down in order before "
            "it is ended"),
    Setting("endpoint_check_timeout_s", None, 10.0, "s", "how long the pre-flight check waits for the endpoint's "
            "model list"),
)

# fmt: on


# Options that were renamed: a run that still passes one is told the new name (no alias: the old name had two meanings).
RENAMED = {
    "--batch-size": "--cases-per-task (build-sft-set: cases per Prefect task) or --rows-per-call "
    "(build-rl-hardset: rows per generate call)"
}


def demo_kwargs(settings: Sequence[Setting]) -> dict[str, Any]:
    """The flow arguments where the demo differs from the default (`build_sft_set_flow(**demo_kwargs(...))`)."""
    return {s.name: s.demo for s in settings if s.flow and s.demo is not _SAME}


def frame_overrides(values: dict[str, Any]) -> dict[str, Any] | None:
    """The flow's `config` for the given frame settings (None values left out; None when none is left)."""
    frames = {k: v for k, v in values.items() if v is not None}
    return {"frames": frames} if frames else None


# The demo's (and the deployments') frames: 128 px x <= 16 frames instead of 448 px x <= 32.
DEMO_FRAMES: dict[str, Any] = {"frames": {s.name: s.demo_value for s in FRAME_SETTINGS}}
