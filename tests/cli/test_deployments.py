"""The deployments end to end: `emrl server up`, `prefect deployment run FLOW/DEPLOYMENT --watch`, `emrl server down`.

A real Prefect server on a free loopback port with its own PREFECT_HOME, the `emrl-local` process pool, every
deployment of `prefect.yaml` (`prefect deploy --all`) and a process worker, all started by `emrl server up` (the
`make serve` command; `python -m cli.main server up` here) in a subprocess; then the deployments run through the
`prefect` CLI exactly as a user types them, on a small synthetic atlas; then `server_down` stops everything by PID, also when a test failed, and the
fixture checks that nothing it started is left running.

About 1-2 minutes on 2 busy cores: server start ~10 s, deploy ~5 s, each run ~10-20 s (worker poll + subprocess).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
import yaml

from cli import _procs
from cli import server as ops
from emrl_data.synthetic import demo_specs, write_atlas
from emrl_data.text.report import NEGATIVE_FINDINGS, NEGATIVE_IMPRESSION
from emrl_data.types import Organ
from flows.build_sft_set import build_sft_set_flow
from tests.loopback import loopback_http


pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240
SMALL_FRAMES = {"frames": {"frame_size_px": 64, "max_frames": 8}}


# Fast checks of the pieces, no server ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected", "message"),
    [
        ({}, None, "PREFECT_API_URL is not set"),  # forgotten: the ephemeral trap
        ({"PREFECT_API_URL": ""}, None, "PREFECT_API_URL is not set"),  # exported but empty
        ({"PREFECT_API_URL": "  "}, None, "PREFECT_API_URL is not set"),  # whitespace only
        ({"PREFECT_API_URL": "http://127.0.0.1:1/api"}, "http://127.0.0.1:2/api", "is not the local server"),  # other
    ],
)
def test_require_api_url_refuses(environ: dict[str, str], expected: str | None, message: str) -> None:
    with pytest.raises(ops.EphemeralModeError, match=message):
        ops.require_api_url(environ, expected=expected)


def test_require_api_url_accepts() -> None:
    url = "http://127.0.0.1:4200/api"
    assert ops.require_api_url({"PREFECT_API_URL": url}) == url  # any server when none is expected
    assert ops.require_api_url({"PREFECT_API_URL": url + "/"}, expected=url) == url + "/"  # trailing slash


def test_stop_process_stops_the_group_its_orphans_and_spares_strangers(tmp_path: Path) -> None:
    # sh, two sleeps in its group, and one in a session of its own (as a worker's flow-run subprocess is)
    script = "sleep 60 & sleep 60 & setsid sleep 60 & wait"
    record = _procs.spawn(["sh", "-c", script], dict(os.environ), tmp_path, tmp_path / "log")
    deadline = time.monotonic() + 10
    while len(_procs.process_tree(record.pid)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    members = _procs.process_tree(record.pid)
    assert len(members) == 4
    # A record whose start time does not match (the PID was reused by someone else) is never signalled.
    stranger = _procs.ProcessRecord(record.pid, (record.start_ticks or 0) + 1, record.log, record.argv)
    assert _procs.stop_process(stranger) is False
    assert all(_procs.is_running(p, t) for p, t in members)
    assert _procs.stop_process(record, timeout_s=10) is True
    assert not any(_procs.is_running(p, t) for p, t in members)
    assert _procs.stop_process(record) is False  # already gone


def test_up_refuses_a_busy_port_and_down_without_state(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ops.ServerError, match="already in use"):
            ops.server_up(home=tmp_path, port=busy.getsockname()[1])
    assert ops.read_state(tmp_path) is None
    assert ops.server_down(home=tmp_path) == []
    assert ops.server_status(home=tmp_path, environ={})["problems"] == [
        f"no server started from {tmp_path.resolve()} (run make serve)"
    ]


# The real thing -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ops.ServerState, str]]:
    """`emrl server up` in a subprocess; yields the state and what it printed; stops everything afterwards."""
    home = tmp_path_factory.mktemp("prefect-home")
    state = None
    try:
        up = subprocess.run(
            [sys.executable, "-m", "cli.main", "server", "up", "--home", str(home), "--project-root", str(ROOT)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        state = ops.read_state(home)
        assert state is not None
        yield state, up.stdout
    finally:
        recorded = ops.read_state(home) or state  # what up recorded, even if it died half-way
        ops.server_down(home=home)  # (the last test may have stopped it already)
        if recorded is not None:
            for name, record in recorded.processes.items():
                assert not _procs.is_running(record.pid, record.start_ticks), f"{name} still running after down"
                assert not _procs.process_tree(record.pid), f"{name}'s process group or descendants survived down"
        assert ops.read_state(home) is None
        assert not (home / ops.ENV_NAME).exists()


@pytest.fixture(scope="module")
def atlas(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("atlas")
    write_atlas(root, demo_specs(8))
    return root


def _param(name: str, value: Any) -> list[str]:
    return ["-p", f"{name}={json.dumps(value)}"]


def _run_deployment(state: ops.ServerState, name: str, params: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """`prefect deployment run NAME --watch -p ...` exactly as a user types it (with the server's URL)."""
    args = ["deployment", "run", name, "--watch", "--watch-interval", "1", "--watch-timeout", str(RUN_TIMEOUT_S)]
    for key, value in params.items():
        args += _param(key, value)
    return ops.run_prefect(state, args, timeout_s=RUN_TIMEOUT_S + 60, check=False)


def _last_state(state: ops.ServerState, deployment: str) -> str:
    """The state type of the newest flow run of `FLOW/DEPLOYMENT`, read back from the API."""
    flow_name, deployment_name = deployment.split("/")
    with httpx.Client(base_url=state.api_url, timeout=10) as client:
        found = client.get(f"/deployments/name/{flow_name}/{deployment_name}")
        found.raise_for_status()
        runs = client.post(
            "/flow_runs/filter",
            json={"deployments": {"id": {"any_": [found.json()["id"]]}}, "sort": "START_TIME_DESC", "limit": 1},
        )
        runs.raise_for_status()
    return runs.json()[0]["state_type"]


def _rows(table_dir: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in sorted((table_dir / "data").glob("*.parquet")):
        split = path.name.split("-")[0]
        counts[split] = counts.get(split, 0) + pq.ParquetFile(path).metadata.num_rows
    return counts


@pytest.fixture(scope="module")
def built(served: tuple[ops.ServerState, str], atlas: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The build-sft-set deployment run once (process task runner when the flow offers the choice)."""
    state, _ = served
    out = tmp_path_factory.mktemp("out")
    params: dict[str, Any] = {
        "atlas_root": str(atlas),
        "output_dir": str(out),
        "cases_per_task": 4,
        "config": SMALL_FRAMES,
    }
    if "task_runner" in inspect.signature(build_sft_set_flow.fn).parameters:
        params["task_runner"] = "process"
    result = _run_deployment(state, "build-sft-set/build-sft-set", params)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert "Completed" in result.stdout
    assert "curating cases: 8/8 (100 %)" in " ".join(result.stdout.split())  # progress lines reach `--watch`
    return out


def test_up_prints_addresses_and_exact_run_lines(served: tuple[ops.ServerState, str]) -> None:
    state, printed = served
    assert state.host == "127.0.0.1" and set(state.processes) == {"server", "worker"}
    steps = [line.split("]")[0] + "]" for line in printed.splitlines() if line.startswith("[")]
    assert steps == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]  # each step printed as it happens
    assert f"UI:   http://127.0.0.1:{state.port}\n" in printed
    assert f"API:  http://127.0.0.1:{state.port}/api\n" in printed
    # Every deployment of prefect.yaml is registered under FLOW/DEPLOYMENT and printed, in pipeline order.
    names = [d["name"] for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]]
    assert [f"{n}/{n}" for n in names] == state.deployments == ops.deployment_names(state.api_url)
    run_lines = [line.strip() for line in printed.splitlines() if "deployment run" in line]
    assert run_lines == [f"prefect deployment run {n}/{n} --watch" for n in names]
    assert ops.pool_status(state.api_url, state.pool) == "READY"


def test_status_fails_loudly_without_the_api_url(served: tuple[ops.ServerState, str]) -> None:
    state, _ = served
    good = ops.server_status(home=Path(state.prefect_home), environ={"PREFECT_API_URL": state.api_url})
    assert good["ok"] and good["running"] and good["problems"] == []
    assert good["alive"] == {"server": True, "worker": True} and good["pool_status"] == "READY"

    unset = ops.server_status(home=Path(state.prefect_home), environ={})
    assert unset["running"] and not unset["ok"]
    assert any("PREFECT_API_URL is not set" in p for p in unset["problems"])
    cli = subprocess.run(
        [sys.executable, "-m", "cli.main", "server", "status", "--home", state.prefect_home],
        cwd=ROOT,
        env={k: v for k, v in state.env().items() if k != "PREFECT_API_URL"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 1 and "PREFECT_API_URL is not set" in cli.stderr
    # The env file a shell sources holds the URL and turns the silent fallback into an error.
    env_sh = (Path(state.prefect_home) / ops.ENV_NAME).read_text()
    assert f"export PREFECT_API_URL={state.api_url}\n" in env_sh
    assert "export PREFECT_SERVER_EPHEMERAL_ENABLED=false" in env_sh
    # ... and puts the venv's `prefect` on PATH: the printed run lines work as they are
    which = subprocess.run(
        ["bash", "-c", f"source {Path(state.prefect_home) / ops.ENV_NAME} && command -v prefect"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert which.stdout.strip() == str(Path(sys.executable).with_name("prefect"))
    # `up` again reuses the healthy server instead of starting a second one.
    assert ops.server_up(home=Path(state.prefect_home), project_root=ROOT).processes == state.processes


def test_build_sft_set_deployment(served: tuple[ops.ServerState, str], built: Path) -> None:
    state, _ = served
    assert _last_state(state, "build-sft-set/build-sft-set") == "COMPLETED"
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["cases"] == 8 and manifest["unexpected_errors"] == 0
    for table in ("findings", "sft", "rejections"):
        assert (built / table / "README.md").is_file() and (built / table / "manifest.json").is_file()
    sft = _rows(built / "sft")
    assert set(sft) == {"train", "test"} and sft["train"] == manifest["sft_rows"]["train"]["total"]
    row = pq.read_table(sorted((built / "sft/data").glob("train-*.parquet"))[0]).slice(0, 1).to_pylist()[0]
    assert 1 <= row["n_frames"] <= 8 and len(row["frames"]) == row["n_frames"]


def test_publish_dataset_deployment(served: tuple[ops.ServerState, str], built: Path, tmp_path: Path) -> None:
    state, _ = served
    params = {"table_dir": str(built / "sft"), "local_root": str(tmp_path), "target": "local", "version": "1.2.3"}
    result = _run_deployment(state, "publish-dataset/publish-dataset", params)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert _last_state(state, "publish-dataset/publish-dataset") == "COMPLETED"
    release = tmp_path / "emrl" / "abdomenatlas-sft" / ".tags" / "v1.2.3"
    expected = json.loads((built / "sft" / "manifest.json").read_text())["files"]
    assert sorted(p.relative_to(release).as_posix() for p in release.rglob("*") if p.is_file()) == sorted(
        [*expected, "manifest.json"]
    )
    assert _rows(release) == _rows(built / "sft")

    mtimes = {p: p.stat().st_mtime_ns for p in release.rglob("*")}
    again = _run_deployment(state, "publish-dataset/publish-dataset", params)  # the same content: a no-op
    assert again.returncode == 0 and _last_state(state, "publish-dataset/publish-dataset") == "COMPLETED"
    assert {p: p.stat().st_mtime_ns for p in release.rglob("*")} == mtimes  # the release was not touched


class _NegativeReportHandler(BaseHTTPRequestHandler):
    """OpenAI chat completions that always answer the negative report of the organ named in the prompt."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = next(p["text"] for p in body["messages"][0]["content"] if p["type"] == "text").lower()
        organ = min((prompt.find(str(o)), o) for o in Organ if str(o) in prompt)[1]
        text = (
            f"<findings>{NEGATIVE_FINDINGS[organ]}</findings> || <impression>{NEGATIVE_IMPRESSION[organ]}</impression>"
        )
        payload = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def negative_model() -> Iterator[str]:
    """A loopback OpenAI-compatible endpoint (a model that never sees a lesion); yields its base URL (…/v1)."""
    with loopback_http(_NegativeReportHandler) as base:
        yield f"{base}/v1"


def test_build_rl_hardset_deployment(
    served: tuple[ops.ServerState, str], built: Path, negative_model: str, tmp_path: Path
) -> None:
    state, _ = served
    names = [n for n in state.deployments if n.startswith("build-rl-hardset/")]
    if not names:
        pytest.skip("prefect.yaml has no build-rl-hardset deployment yet")
    params = {
        "sft_dir": str(built / "sft"),
        "output_dir": str(tmp_path),
        "backend": "openai",
        "endpoint_url": negative_model,
        "endpoint_model": "negative-stub",
        "n_bootstrap": 10,
    }
    result = _run_deployment(state, names[0], params)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert _last_state(state, names[0]) == "COMPLETED"
    watched = " ".join(result.stdout.split())  # rich wraps the lines
    assert re.search(r"SFT model predictions: (\d+)/\1 \(100 %\)", watched) and ", ETA " in watched, result.stdout
    # Every SFT row got a prediction; the model misses every lesion, so the hard set is made of train positives.
    assert _rows(tmp_path / "predictions") == _rows(built / "sft")
    hard = pq.read_table(tmp_path / "rl_hardset" / "data").to_pylist()
    sft_train = pq.read_table(built / "sft" / "data", columns=["case_id", "organ", "split", "has_lesion"]).to_pylist()
    positives = {(r["case_id"], r["organ"]) for r in sft_train if r["split"] == "train" and r["has_lesion"]}
    assert hard and {(r["case_id"], r["organ"]) for r in hard} <= positives


class _HeldNegativeReportHandler(_NegativeReportHandler):
    """Holds every request until `release` is set, so the run is surely still running when the server stops."""

    release = threading.Event()

    def do_POST(self) -> None:  # noqa: N802
        self.release.wait(timeout=RUN_TIMEOUT_S)
        super().do_POST()


def test_serve_stop_marks_a_running_flow_run_cancelled(served: tuple[ops.ServerState, str], built: Path) -> None:
    """`make serve-stop` during a run: the run is stopped and shows Cancelled, not Running forever (runs last)."""
    state, _ = served
    _HeldNegativeReportHandler.release.clear()
    with loopback_http(_HeldNegativeReportHandler) as base:
        params = {
            "sft_dir": str(built / "sft"),
            "output_dir": str(built / "slow"),
            "backend": "openai",
            "endpoint_url": f"{base}/v1",
            "endpoint_model": "slow",
            "rows_per_call": 1,
            "max_concurrency": 1,
        }
        args = ["deployment", "run", "build-rl-hardset/build-rl-hardset"]
        for key, value in params.items():
            args += _param(key, value)
        ops.run_prefect(state, args, timeout_s=120)  # no --watch: returns once the run is scheduled
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while _last_state(state, "build-rl-hardset/build-rl-hardset") != "RUNNING":
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(1)
        try:
            stopped = ops.server_down(home=Path(state.prefect_home))
        finally:
            _HeldNegativeReportHandler.release.set()  # let the held request threads end before the stub stops
    assert stopped[0].startswith("worker (pid ") and "1 flow run(s), marked Cancelled" in stopped
    assert stopped[-1].startswith("server (pid ")
