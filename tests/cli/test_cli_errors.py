"""The `emrl` CLI on a user's mistakes and failures: a short message naming the problem and the fix, a non-zero
exit, no traceback; Ctrl-C exits 130 and says that a rerun resumes.

Most cases fail in the cheap checks that run before Prefect starts, so they call `main()` in-process and take
milliseconds. The endpoint cases use a loopback OpenAI-compatible stub; the mid-run 401 runs the real flow under the
test harness; Ctrl-C needs a real process (a subprocess against the harness's server).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from cli.main import build_parser, main
from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
from emrl_data.text.report import NEGATIVE_FINDINGS, NEGATIVE_IMPRESSION
from emrl_data.types import Organ, Split
from tests.loopback import loopback_http


ROOT = Path(__file__).resolve().parents[2]


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], code: int = 2) -> str:
    """Run `emrl ARGV`, assert exit `code`, no traceback and at most 3 lines on stderr; return stderr."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    assert exited.value.code == code, out + err
    assert "Traceback" not in out + err
    assert 1 <= len(err.strip().splitlines()) <= 3, err
    return err


@pytest.fixture(scope="module")
def atlas(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("atlas")
    lesion = (LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 10.0), "hypo"),)
    specs = [
        CaseSpec(f"BDMAP_0000000{i}", shape=(96, 80, 32), lesions=lesion, seed=i, split=split)
        for i, split in ((1, Split.TRAIN), (2, Split.TRAIN), (3, Split.TEST))
    ]
    write_atlas(root, specs)
    return root


# Cheap checks: no Prefect ----------------------------------------------------------------------------------------


def test_missing_atlas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(["build-sft-set", str(tmp_path / "nope"), str(tmp_path / "out")], capsys)
    assert f"the atlas folder {tmp_path / 'nope'} does not exist" in err and "emrl synth DIR" in err


def test_empty_atlas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "atlas" / "image_only" / "not_a_case").mkdir(parents=True)
    err = _fails(["build-sft-set", str(tmp_path / "atlas"), str(tmp_path / "out")], capsys)
    assert "no case under" in err and "BDMAP_XXXXXXXX" in err and "fix: point at the atlas root" in err


def test_output_path_is_a_file(atlas: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").write_text("x")
    err = _fails(["build-sft-set", str(atlas), str(tmp_path / "out")], capsys)
    assert f"the output path {tmp_path / 'out'} is a file" in err and "pass a folder" in err
    err = _fails(["build-sft-set", str(atlas), str(tmp_path / "out" / "sub")], capsys)
    assert f"{tmp_path / 'out'} (in the output path" in err


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--cases-per-task", "0", "argument --cases-per-task: must be >= 1, got 0"),
        ("--workers", "-1", "argument --workers: must be >= 1, got -1"),
        ("--frame-size", "4", "argument --frame-size: must be >= 8, got 4"),
        ("--limit", "many", "argument --limit: expected a number, got 'many'"),
        ("--task-runner", "gpu", "argument --task-runner: invalid choice: 'gpu'"),
    ],
)
def test_bad_numbers_and_choices(
    option: str, value: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _fails(["build-sft-set", str(tmp_path), str(tmp_path / "out"), option, value], capsys)
    assert message in err and "see `emrl build-sft-set --help`" in err


def test_build_rl_hardset_before_build_sft_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(["build-rl-hardset", str(tmp_path / "sft"), str(tmp_path), "--model", str(tmp_path)], capsys)
    assert f"no SFT set in {tmp_path / 'sft'}" in err and "run `emrl build-sft-set ATLAS OUT` first" in err
    # the output root instead of OUT/sft: the fix names the right folder
    (tmp_path / "sft" / "data").mkdir(parents=True)
    (tmp_path / "sft" / "data" / "train-00000-of-00001.parquet").write_bytes(b"")
    err = _fails(["build-rl-hardset", str(tmp_path), str(tmp_path), "--model", str(tmp_path)], capsys)
    assert f"pass {tmp_path / 'sft'}" in err


@pytest.fixture
def sft_dir(tmp_path: Path) -> Path:
    """A folder that passes the cheap SFT-set check (the flow itself is not run by these tests)."""
    data = tmp_path / "out" / "sft" / "data"
    data.mkdir(parents=True)
    (data / "train-00000-of-00001.parquet").write_bytes(b"")
    return data.parent


def test_endpoint_needs_a_model_name(sft_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(
        ["build-rl-hardset", str(sft_dir), str(sft_dir.parent), "--endpoint", "http://127.0.0.1:9/v1"], capsys
    )
    assert "--endpoint needs --endpoint-model" in err and "add --endpoint-model NAME" in err
    err = _fails(["build-rl-hardset", str(sft_dir), str(sft_dir.parent)], capsys)
    assert "one of the arguments --model --endpoint is required" in err


@pytest.mark.parametrize(
    "option", [["--dialect", "openai"], ["--max-tokens-field", "max_completion_tokens"], ["--no-probe"]]
)
def test_endpoint_options_need_an_endpoint(
    option: list[str], sft_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")  # a checkpoint folder as far as the cheap checks go
    err = _fails(["build-rl-hardset", str(sft_dir), str(sft_dir.parent), "--model", str(tmp_path), *option], capsys)
    assert f"{option[0]} is only used with --endpoint" in err and "add --endpoint URL/v1, or drop it" in err


def test_missing_model_folder(sft_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(["build-rl-hardset", str(sft_dir), str(sft_dir.parent), "--model", str(sft_dir / "nope")], capsys)
    assert f"the model folder {sft_dir / 'nope'} does not exist" in err
    err = _fails(["build-rl-hardset", str(sft_dir), str(sft_dir.parent), "--model", str(sft_dir)], capsys)
    assert f"{sft_dir} is not a model checkpoint (no config.json)" in err


class _Stub(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint: `/models` per `models_status`, chat completions per `chat_status`."""

    models_status = 200
    chat_status = 200
    hold_from = 0  # hold the answer to this request (1-based) and later ones until `release` is set; 0: never
    release = threading.Event()
    refuse_together = 0  # hold a refusal until this many requests arrived (both of a batch in flight, not a race)
    posts: list[float] = []

    def _send(self, status: int, body: Any) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.models_status != 200:
            return self._send(self.models_status, {"error": {"message": "Invalid API key"}})
        self._send(200, {"object": "list", "data": [{"id": "stub-model"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).posts.append(time.monotonic())
        if self.chat_status != 200:
            deadline = time.monotonic() + 10.0
            while len(self.posts) < self.refuse_together and time.monotonic() < deadline:
                time.sleep(0.01)
            return self._send(self.chat_status, {"error": {"message": "Invalid API key"}})
        if self.hold_from and len(self.posts) >= self.hold_from:
            self.release.wait(timeout=120)  # a hang guard: the test sets it
        prompt = next(p["text"] for p in body["messages"][0]["content"] if p["type"] == "text").lower()
        organ = min((prompt.find(str(o)), o) for o in Organ if str(o) in prompt)[1]
        text = (
            f"<findings>{NEGATIVE_FINDINGS[organ]}</findings> || <impression>{NEGATIVE_IMPRESSION[organ]}</impression>"
        )
        self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})

    def log_message(self, *args: Any) -> None:
        pass


def _serve(**attributes: Any) -> Iterator[str]:
    handler = type("Stub", (_Stub,), {"posts": [], "release": threading.Event(), **attributes})
    with loopback_http(handler) as base:
        yield f"{base}/v1"


@pytest.mark.parametrize(("status", "key"), [(401, None), (403, "wrong")])
def test_endpoint_refusing_the_key_fails_before_any_row(
    status: int, key: str | None, sft_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if key is None:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    else:
        monkeypatch.setenv("OPENAI_API_KEY", key)
    for url in _serve(models_status=status):
        args = ["build-rl-hardset", str(sft_dir), str(sft_dir.parent), "--endpoint", url, "--endpoint-model", "x"]
        err = _fails(args, capsys)
    assert (
        f"the endpoint answered HTTP {status}: OPENAI_API_KEY {'is not set' if key is None else 'was refused'}" in err
    )
    assert "export OPENAI_API_KEY=" in err


def test_endpoint_unreachable_or_serving_another_model(sft_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for url in _serve():
        args = ["build-rl-hardset", str(sft_dir), str(sft_dir.parent), "--endpoint", url, "--endpoint-model", "x"]
        assert "the endpoint serves stub-model, not 'x'" in _fails(args, capsys)
    err = _fails(args, capsys)  # the stub is gone now
    assert f"cannot reach the endpoint {url} (ConnectError)" in err and "vllm serve" in err


def test_prefect_api_url_that_does_not_answer(
    atlas: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    err = _fails(["build-sft-set", str(atlas), str(tmp_path / "out")], capsys)
    assert "PREFECT_API_URL=http://127.0.0.1:9/api does not answer" in err and "unset PREFECT_API_URL" in err


def test_eval_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(["eval", str(tmp_path / "nope")], capsys)
    assert f"{tmp_path / 'nope'} does not exist" in err and "OUT/predictions" in err
    (tmp_path / "empty").mkdir()
    assert "no .parquet or .jsonl files in" in _fails(["eval", str(tmp_path / "empty")], capsys)
    (tmp_path / "preds.csv").write_text("a\n")
    assert "is not a .parquet or .jsonl file" in _fails(["eval", str(tmp_path / "preds.csv")], capsys)


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    from cli.errors import UsageError

    with pytest.raises(UsageError, match="does not exist"):
        main(["build-sft-set", str(tmp_path / "nope"), str(tmp_path / "out"), "--debug"])


# Help -----------------------------------------------------------------------------------------------------------


def _parsers(parser: Any, prog: str = "emrl") -> Iterator[tuple[str, Any]]:
    yield prog, parser
    for action in parser._actions:  # noqa: SLF001 (argparse keeps its parsers there)
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, child in action.choices.items():
                yield from _parsers(child, f"{prog} {name}")


def test_every_option_of_every_command_is_documented_with_its_default() -> None:
    seen = 0
    for prog, parser in _parsers(build_parser()):
        help_text = parser.format_help()
        assert "HF_TOKEN" in help_text and "OPENAI_API_KEY" in help_text, prog
        for action in parser._actions:  # noqa: SLF001
            if action.dest in ("help", "command", "server_action"):
                continue
            assert action.help and action.help.strip(), f"{prog} {action.option_strings or action.dest}: no help"
            if action.option_strings and not isinstance(action.default, bool) and action.default is not None:
                flat = "".join(help_text.split())  # argparse wraps anywhere, even after a hyphen
                assert f"(default:{action.default})" in flat, f"{prog} {action.option_strings}: default not shown"
            elif action.option_strings and action.default is None:
                assert any(w in action.help for w in ("(default: ", "needed with", "one of --")), (
                    f"{prog} {action.option_strings}: says nothing about what happens without it"
                )
            seen += 1
    assert seen > 50


def test_help_exposes_seed_frames_runner_concurrency_and_bootstrap() -> None:
    parser = build_parser()
    options = {
        prog: {s for a in p._actions for s in a.option_strings}  # noqa: SLF001
        for prog, p in _parsers(parser)
    }
    assert {"--seed", "--frame-size", "--max-frames", "--task-runner", "--workers"} <= options["emrl build-sft-set"]
    assert {"--concurrency", "--bootstrap", "--rows-per-call"} <= options["emrl build-rl-hardset"]
    assert {"--bootstrap", "--seed", "--split"} <= options["emrl eval"]


# eval on the folder the pipeline writes -------------------------------------------------------------------------


def test_eval_accepts_the_predictions_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truth = {"organ": "liver", "attenuation": None, "location": [], "key_slice_frame": None, "long_axis_mm": None}
    negative = f"<findings>{NEGATIVE_FINDINGS[Organ.LIVER]}</findings> || <impression>{NEGATIVE_IMPRESSION[Organ.LIVER]}</impression>"
    rows = [
        {**truth, "split": "train", "has_lesion": False, "prediction": negative, "inference_error": None},
        {**truth, "split": "test", "has_lesion": False, "prediction": negative, "inference_error": None},
        {**truth, "split": "test", "has_lesion": False, "prediction": None, "inference_error": "HTTP 500: boom"},
    ]
    data = tmp_path / "predictions" / "data"
    data.mkdir(parents=True)
    pl.DataFrame(rows[:1]).write_parquet(data / "train-00000-of-00001.parquet")
    pl.DataFrame(rows[1:]).write_parquet(data / "test-00000-of-00001.parquet")
    (tmp_path / "predictions" / "README.md").write_text("card")

    main(["eval", str(tmp_path / "predictions"), "--out", str(tmp_path / "eval"), "--bootstrap", "10"])
    out = capsys.readouterr().out
    assert "1 row(s) without a prediction (inference errors) left out" in out
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["counts"]["liver"]["negatives"] == 2  # both answered rows, the failed one left out
    main(["eval", str(tmp_path / "predictions"), "--out", str(tmp_path / "eval"), "--split", "test"])
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["counts"]["liver"]["negatives"] == 1


# Hub checks before Prefect ----------------------------------------------------------------------------------------


@pytest.fixture
def table(tmp_path: Path) -> Path:
    (tmp_path / "sft" / "data").mkdir(parents=True)
    return tmp_path / "sft"


def test_publish_without_network_fails_in_seconds(
    table: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    err = _fails(["publish", str(table), "org/name", "1.0.0"], capsys)
    assert "cannot reach the Hub at http://127.0.0.1:9 (ConnectError)" in err and "--local-root DIR" in err


class _Hub(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        payload = b'{"error": "Invalid credentials in Authorization header"}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


def test_publish_with_a_refused_token(
    table: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    with loopback_http(_Hub) as base:
        monkeypatch.setattr(constants, "ENDPOINT", base)
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        err = _fails(["publish", str(table), "org/name", "1.0.0"], capsys)
    assert "the Hub refused the token (HTTP 401)" in err and "export HF_TOKEN=" in err


# Failures inside the flows: the real engine -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_out(prefect_harness, atlas: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flows.build_sft_set import build_sft_set_flow

    out = tmp_path_factory.mktemp("out")
    build_sft_set_flow(
        atlas_root=str(atlas), output_dir=str(out), config={"frames": {"frame_size_px": 32, "max_frames": 4}}
    )
    return out


@pytest.mark.slow
def test_a_key_refused_mid_run_stops_at_the_first_batch(
    sft_out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # /models answers (no auth there), chat completions refuse the key once both requests of the first batch are in
    # flight (without the hold, the second thread may start after the first refusal and rightly not send at all)
    for url in _serve(chat_status=401, refuse_together=2):
        handler_posts = _Stub.__subclasses__()[-1].posts
        args = [
            "build-rl-hardset",
            str(sft_out / "sft"),
            str(tmp_path),
            "--endpoint",
            url,
            "--endpoint-model",
            "stub-model",
            "--rows-per-call",
            "2",
            "--concurrency",
            "2",
            "--no-probe",
        ]
        with pytest.raises(SystemExit) as exited:
            main(args)
    out, err = capsys.readouterr()
    assert exited.value.code == 1 and "Traceback" not in out + err
    assert err.splitlines()[-2:] == [
        f"emrl build-rl-hardset: failed: {url}/chat/completions refused the request (HTTP 401: Invalid API key); "
        "$OPENAI_API_KEY is not set: set it to the endpoint's API key.",
        "  fix: export OPENAI_API_KEY=<a key the endpoint accepts>, then rerun (finished rows are kept)",
    ]
    assert len(handler_posts) == 2  # the first batch only, not every row (the next batch is not sent)
    stored = [line for p in (tmp_path / ".work").glob("predictions-*.jsonl") for line in p.read_text().splitlines()]
    assert stored == []  # the refused rows are not stored: a rerun with a good key does them


@pytest.mark.slow
def test_ctrl_c_stops_mining_promptly_and_the_rerun_resumes(
    sft_out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefect.settings import PREFECT_API_URL

    # the stub answers the first row at once and holds the second: Ctrl-C lands mid-run, with one row stored and one
    # in flight, however fast or slow the machine
    for url in _serve(hold_from=2):
        stub = _Stub.__subclasses__()[-1]
        args = [
            "build-rl-hardset",
            str(sft_out / "sft"),
            str(tmp_path),
            "--endpoint",
            url,
            "--endpoint-model",
            "stub-model",
            "--rows-per-call",
            "1",
            "--concurrency",
            "1",
            "--bootstrap",
            "10",
            "--no-probe",
        ]
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", *args],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "SFT model predictions: " in line:  # a progress line: mining is under way
                break
        deadline = time.monotonic() + 120  # a hang guard, not a timing assertion
        while len(stub.posts) < 2:  # the second row is in flight (held): the first one is stored
            assert time.monotonic() < deadline and proc.poll() is None, "the second request never came"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        stub.release.set()  # the row in flight gets its answer; Ctrl-C stops the run before the next one is sent
        rest, _ = proc.communicate(timeout=120)  # a hang guard, not a timing assertion
        output = "".join(lines) + rest
        assert proc.returncode == 130, output
        assert "Traceback" not in output and "ConnectError" not in output
        assert "emrl build-rl-hardset: interrupted. Finished work is kept: rerun the same command to resume." in output
        stored_before = _stored_predictions(tmp_path)
        done_before = len(stub.posts)
        assert done_before <= stored_before + 1  # after Ctrl-C nothing more was sent: at most the row in flight lost

        stub.hold_from = 0
        main(args)
    total = json.loads((tmp_path / "rl_hardset" / "summary.json").read_text())["predictions"]
    assert 1 <= stored_before < total
    assert len(stub.posts) - done_before == total - stored_before  # the rerun asked only for the rows not stored


@pytest.mark.parametrize("debug", [False, True])
def test_an_interrupted_process_ends_even_when_a_thread_holds_shutdown(debug: bool) -> None:
    """The guard armed after Ctrl-C: a non-daemon thread that would keep the interpreter alive for 60 s does not, and
    the message names it (with --debug, every thread's stack follows)."""
    code = (
        "import sys, threading, time\n"
        "from cli.interrupt import exit_within as _exit_within\n"
        "threading.Thread(target=time.sleep, args=(60,), name='stuck-client').start()  # a blocked library thread\n"
        "threading.Thread(target=time.sleep, args=(60,), name='a-daemon', daemon=True).start()  # not holding exit\n"
        f"_exit_within(0.5, 130, debug={debug})\n"
        "sys.exit(130)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=30,
    )  # a hang guard, not a timing assertion
    assert done.returncode == 130, done.stderr
    first, *rest = done.stderr.splitlines()
    assert first == "Still stopping after 0.5 s (threads still running: stuck-client): exiting now. A rerun resumes."
    if debug:  # faulthandler's dump: one block per thread, the stuck one asleep in its run()
        assert sum(line.startswith("Thread 0x") for line in rest) == 3  # main, stuck-client, a-daemon
        assert sum(line.startswith("Current thread 0x") for line in rest) == 1  # the guard itself
        assert any("in run" in line for line in rest)
    else:
        assert rest == []


def _stored_predictions(out: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in (out / ".work").glob("predictions-*.jsonl"))


def test_a_hub_that_refuses_the_repository_is_one_problem_line_and_its_fix() -> None:
    from cli.main import _explain
    from hub.listing import HubAccessError

    err = HubAccessError("hf://datasets/o/n is gated and no Hugging Face token is set: set HF_TOKEN")
    assert _explain(err) == (
        "hf://datasets/o/n is gated and no Hugging Face token is set: set HF_TOKEN",
        "give HF_TOKEN the access the line above names, then rerun (nothing was downloaded)",
    )


def test_an_unknown_layout_is_one_line_naming_the_layouts(atlas: Path, tmp_path: Path, capsys) -> None:
    err = _fails(["build-sft-set", str(atlas), str(tmp_path / "out"), "--layout", "nope"], capsys)
    assert "no layout 'nope'; the layouts are msd-task03, msd-task07, kits23, lits, panorama, abdomenatlas" in err
    err = _fails(["build-sft-set", str(atlas), str(tmp_path / "out"), "--labels", str(tmp_path)], capsys)
    assert "the abdomenatlas layout reads its labels in place (only panorama takes a folder)" in err
