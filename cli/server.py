"""Local Prefect operations behind `emrl server up|down|status` (`make serve`, `make serve-stop`).

`server_up` (own `PREFECT_HOME`, default `.prefect-home/server/`) prints each step: `prefect server start` on
loopback, the process pool `emrl-local`, `prefect deploy --all` (`EMRL_PROJECT_ROOT` baked into the pull step), a
worker from this venv; server and worker each in its own session with its log in `<home>/logs/`, recorded with their
start times in `<home>/emrl-server.json`. (Not `prefect server start --background`: its server keeps writing to pipes
whose reader, the CLI, has exited, so its log is lost; see docs/decisions.md.) `server_down` marks the pool's active flow runs Cancelled, stops the worker's
group and the flow-run processes it left in other sessions (SIGTERM, then SIGKILL; a reused PID is never signalled),
then the server. Ephemeral-mode guard: every command started here gets `PREFECT_API_URL` and
`PREFECT_SERVER_EPHEMERAL_ENABLED=false`, `<home>/env.sh` exports them (and the venv on PATH), `require_api_url`
refuses a missing URL (a run created on a throwaway temporary server never runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import yaml

from cli._procs import ProcessRecord, is_running, spawn, stop_process
from emrl_data import PROJECT_ROOT
from emrl_data.atomic_write import write_text_atomic


POOL, HOST, STATE_NAME, ENV_NAME = "emrl-local", "127.0.0.1", "emrl-server.json", "env.sh"
_DROPPED_ENV = ("PREFECT_API_KEY", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH", "PREFECT_API_AUTH_STRING")
_ACTIVE = ["RUNNING", "PENDING", "CANCELLING"]
# Off by default in Prefect 3.9: `prefect deployment run --watch` would show state events but no log lines.
_LOG_STREAM = {f"PREFECT_SERVER_LOGS_STREAM_{k}_ENABLED": "true" for k in ("OUT", "PUBLISHING")}


class ServerError(RuntimeError):
    """The local Prefect server could not be started, reached or stopped as expected."""


class EphemeralModeError(ServerError):
    """`PREFECT_API_URL` is unset (or wrong): Prefect would silently use a temporary server and database."""


@dataclass
class ServerState:
    """What `server_up` started; saved as JSON in `<home>/emrl-server.json`."""

    host: str
    port: int
    prefect_home: str
    project_root: str
    pool: str = POOL
    started_at: str = ""
    processes: dict[str, ProcessRecord] = field(default_factory=dict)  # "server", "worker" -> record
    deployments: list[str] = field(default_factory=list)  # FLOW/DEPLOYMENT in prefect.yaml (pipeline) order

    @property
    def api_url(self) -> str:
        """The value of `PREFECT_API_URL` for this server."""
        return f"http://{self.host}:{self.port}/api"

    ui_url = property(lambda self: f"http://{self.host}:{self.port}", doc="The UI address.")

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (default `os.environ`) without redirecting Prefect settings, plus this server's URL and home."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _DROPPED_ENV}
        env.update(
            PREFECT_API_URL=self.api_url,
            PREFECT_HOME=self.prefect_home,
            EMRL_PROJECT_ROOT=self.project_root,
            PREFECT_SERVER_EPHEMERAL_ENABLED="false",
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            **_LOG_STREAM,
        )
        return env


def default_home(project_root: Path = PROJECT_ROOT) -> Path:
    """`<project_root>/.prefect-home/server` (not `.prefect-home`: the CLI's temporary servers use that database)."""
    return Path(project_root).resolve() / ".prefect-home" / "server"


def state_path(home: Path) -> Path:
    """The state file of the server whose `PREFECT_HOME` is `home`."""
    return Path(home) / STATE_NAME


def read_state(home: Path) -> ServerState | None:
    """The recorded state under `home`, or None when nothing was started there (or it was stopped)."""
    if not (path := state_path(home)).is_file():
        return None
    data = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("api_url", "ui_url")}
    return ServerState(**data | {"processes": {k: ProcessRecord(**v) for k, v in data["processes"].items()}})


def _write_state(state: ServerState) -> None:
    path = state_path(Path(state.prefect_home))
    data = {**asdict(state), "api_url": state.api_url, "ui_url": state.ui_url}  # URLs: for other readers
    write_text_atomic(json.dumps(data, indent=2), path)


def require_api_url(environ: Mapping[str, str] | None = None, expected: str | None = None) -> str:
    """Return `PREFECT_API_URL`; raise `EphemeralModeError` when it is unset, blank, or not `expected`."""
    url = (os.environ if environ is None else environ).get("PREFECT_API_URL", "").strip()
    hint = f"export PREFECT_API_URL={expected}" if expected else "start a server with `emrl server up` (make serve)"
    if not url:
        raise EphemeralModeError(
            f"PREFECT_API_URL is not set: Prefect would use a throwaway temporary server whose "
            f"runs no worker picks up. {hint}, or `source` the env.sh `emrl server up` printed."
        )
    if expected is not None and url.rstrip("/") != expected.rstrip("/"):
        raise EphemeralModeError(f"PREFECT_API_URL={url} is not the local server's {expected}: {hint}.")
    return url


def api_healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    """Whether `GET <api_url>/health` answers 200."""
    try:
        return httpx.get(f"{api_url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def _api(api_url: str, method: str, path: str, body: Any = None) -> Any:
    response = httpx.request(method, f"{api_url}{path}", json=body, timeout=10)
    response.raise_for_status()
    return response.json() if response.content else None


def deployment_names(api_url: str, project_root: Path = PROJECT_ROOT) -> list[str]:
    """`FLOW/DEPLOYMENT` names on the server, in `prefect.yaml` order (the pipeline order), others last."""
    flows = {f["id"]: f["name"] for f in _api(api_url, "POST", "/flows/filter", {})}
    names = [f"{flows.get(d['flow_id'], '?')}/{d['name']}" for d in _api(api_url, "POST", "/deployments/filter", {})]
    order = [d["name"] for d in yaml.safe_load((Path(project_root) / "prefect.yaml").read_text())["deployments"]]
    return sorted(names, key=lambda n: (order.index(n.split("/")[1]) if n.split("/")[1] in order else len(order), n))


def pool_status(api_url: str, pool: str) -> str | None:
    """The work pool's status (`READY` once a worker polls it), None when absent or unreachable."""
    with contextlib.suppress(httpx.HTTPError):
        return _api(api_url, "GET", f"/work_pools/{pool}").get("status")
    return None


def run_prefect(state: ServerState, args: Sequence[str], *, timeout_s: float = 300.0, check: bool = True, **kw: Any):
    """Run `prefect --no-prompt ARGS` against the server of `state`, from the project root; `ServerError` on failure."""
    argv = [str(Path(sys.executable).with_name("prefect")), "--no-prompt", *args]
    result = subprocess.run(
        argv, cwd=state.project_root, env=state.env(), capture_output=True, text=True, timeout=timeout_s, **kw
    )
    if check and result.returncode != 0:
        raise ServerError(
            f"`prefect {shlex.join(args)}` exited {result.returncode}:\n{result.stdout[-3000:]}"
            f"\n{result.stderr[-3000:]}"
        )
    return result


def _wait(what: str, ready: Callable[[], bool], timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if not alive() or time.monotonic() > deadline:
            raise ServerError(f"{what}: not ready after {timeout_s:.0f} s (or it exited)")
        time.sleep(0.3)


_say = partial(print, flush=True)  # each step shows as it happens, also through `make`


# The commands -------------------------------------------------------------------------------------------------------


def server_up(
    *,
    project_root: Path = PROJECT_ROOT,
    home: Path | None = None,
    port: int | None = None,
    deploy: bool = True,
    worker: bool = True,
    timeout_s: float = 180.0,
) -> ServerState:
    """Start (or reuse, when healthy) server, pool, deployments and worker; print each step; return the state.

    Raises:
        ServerError: a step failed; everything this call started has been stopped again.
    """
    project_root = Path(project_root).resolve()
    home = (default_home(project_root) if home is None else Path(home)).resolve()
    home.mkdir(parents=True, exist_ok=True)
    if (old := read_state(home)) is not None:
        if api_healthy(old.api_url) and all(is_running(r.pid, r.start_ticks) for r in old.processes.values()):
            return old
        _say(f"A stale server state in {home}: stopping what is left of it")
        server_down(project_root=project_root, home=home)
    with socket.socket() as probe, socket.socket() as free:
        if port is not None and probe.connect_ex((HOST, port)) == 0:
            raise ServerError(f"Port {port} on {HOST} is already in use; pick another (--port) or omit it.")
        free.bind((HOST, port or 0))
        port = int(free.getsockname()[1])
    state = ServerState(HOST, port, str(home), str(project_root), started_at=datetime.now(UTC).isoformat()[:19])
    started = time.monotonic()
    try:
        _say(f"[1/4] starting the Prefect server on {state.ui_url} (PREFECT_HOME={home})")
        _write_state(state)
        prefect = str(Path(sys.executable).with_name("prefect"))
        argv = [prefect, "server", "start", "--host", HOST, "--port", str(port), "--analytics-off"]
        server = state.processes["server"] = spawn(argv, state.env(), project_root, home / "logs" / "server.log")
        _write_state(state)
        _wait(
            f"Prefect server (log {server.log})",
            lambda: api_healthy(state.api_url),
            timeout_s,
            lambda: is_running(server.pid, server.start_ticks),
        )
        _say(f"      healthy after {time.monotonic() - started:.0f} s\n[2/4] work pool {state.pool} (process)")
        run_prefect(state, ["work-pool", "create", state.pool, "--type", "process", "--overwrite"])
        if deploy:
            _say("[3/4] registering the deployments of prefect.yaml (prefect deploy --all)")
            run_prefect(state, ["deploy", "--all"], timeout_s=timeout_s)
        state.deployments = deployment_names(state.api_url, project_root)
        if worker:
            _say(f"[4/4] starting a worker on {state.pool} and waiting for it to report in")
            env = {**state.env(), "PREFECT_WORKER_QUERY_SECONDS": "5", "PREFECT_LOGGING_LEVEL": "INFO"}
            argv = [prefect, "worker", "start", "--pool", state.pool]
            record = state.processes["worker"] = spawn(argv, env, project_root, home / "logs" / "worker.log")
            _write_state(state)
            _wait(
                f"worker (log {record.log})",
                lambda: pool_status(state.api_url, state.pool) == "READY",
                timeout_s,
                lambda: is_running(record.pid, record.start_ticks),
            )
    except BaseException:
        _say("server up failed; stopping what it started")
        server_down(project_root=project_root, home=home)
        raise
    _write_state(state)
    write_env_file(state)
    _say(f"      ready after {time.monotonic() - started:.0f} s\n")
    return state


def server_down(*, project_root: Path = PROJECT_ROOT, home: Path | None = None, timeout_s: float = 20.0) -> list[str]:
    """Stop what `server_up` started under `home`, marking its active runs Cancelled; return what was stopped."""
    home = (default_home(project_root) if home is None else Path(home)).resolve()
    if (state := read_state(home)) is None:
        return []
    runs: list[str] = []
    query = {"flow_runs": {"state": {"type": {"any_": _ACTIVE}}}, "work_pools": {"name": {"any_": [state.pool]}}}
    with contextlib.suppress(httpx.HTTPError):  # the runs the worker is executing, before it goes
        runs = [r["id"] for r in _api(state.api_url, "POST", "/flow_runs/filter", query)]
    worker, server = state.processes.get("worker"), state.processes.get("server")
    stopped = [f"worker (pid {worker.pid})"] if worker and stop_process(worker, timeout_s) else []
    cancel = {"type": "CANCELLED", "name": "Cancelled", "message": "stopped by `emrl server down`; a rerun resumes"}
    with contextlib.suppress(httpx.HTTPError):  # force: the worker that would report them is gone
        for run_id in runs:
            _api(state.api_url, "POST", f"/flow_runs/{run_id}/set_state", {"state": cancel, "force": True})
        runs = [r for r in runs if _api(state.api_url, "GET", f"/flow_runs/{r}")["state_type"] == "CANCELLED"]
    stopped += [f"{len(runs)} flow run(s), marked Cancelled"] if runs else []
    stopped += [f"server (pid {server.pid})"] if server and stop_process(server, timeout_s) else []
    for path in (state_path(home), home / ENV_NAME):
        path.unlink(missing_ok=True)
    return stopped


def server_status(
    *, project_root: Path = PROJECT_ROOT, home: Path | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The local server's state, `problems` (incl. a shell whose `PREFECT_API_URL` would miss it) and `ok`."""
    home = (default_home(project_root) if home is None else Path(home)).resolve()
    if (state := read_state(home)) is None:
        return {"running": False, "ok": False, "problems": [f"no server started from {home} (run make serve)"]}
    healthy = api_healthy(state.api_url)
    alive = {n: is_running(r.pid, r.start_ticks) for n, r in state.processes.items()}
    problems = [
        f"{n} (pid {state.processes[n].pid}) is not running; see {state.processes[n].log}"
        for n, ok in alive.items()
        if not ok
    ] + ([] if healthy else [f"{state.api_url} does not answer"])
    try:
        require_api_url(environ, expected=state.api_url)
    except EphemeralModeError as exc:
        problems.append(str(exc))
    report = {
        "running": healthy and all(alive.values()),
        "problems": problems,
        "api_url": state.api_url,
        "ui_url": state.ui_url,
        "pool": state.pool,
        "alive": alive,
        "pool_status": pool_status(state.api_url, state.pool) if healthy else None,
        "deployments": deployment_names(state.api_url, Path(state.project_root)) if healthy else [],
    }
    return report | {"ok": report["running"] and not problems}


def write_env_file(state: ServerState) -> Path:
    """Write `<home>/env.sh` (`source` it): the server's URL, ephemeral mode off, and the venv's bin/ on PATH."""
    path = Path(state.prefect_home) / ENV_NAME
    path.write_text(
        f"# emrl server on {state.api_url} (written by `emrl server up`, {state.started_at})\n"
        f"export PREFECT_API_URL={shlex.quote(state.api_url)}\n"
        "export PREFECT_SERVER_EPHEMERAL_ENABLED=false  # a lost URL fails instead of using a throwaway server\n"
        f"export EMRL_PROJECT_ROOT={shlex.quote(state.project_root)}\n"
        f'export PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"  # prefect, emrl\n'
    )
    return path
