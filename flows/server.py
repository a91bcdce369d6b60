"""Local Prefect operations: `emrl server up|down|status` (`make serve`, `make serve-stop`).

`server_up` starts, on loopback and with its own `PREFECT_HOME` (default `.prefect-home/server/` in the checkout):

1. a Prefect API server (`prefect server start`, UI included) on a free or given port, and waits for `/api/health`;
2. the process work pool `emrl-local` (`prefect work-pool create --type process --overwrite`);
3. every deployment of `prefect.yaml` (`prefect --no-prompt deploy --all`, with `EMRL_PROJECT_ROOT` set to the
   checkout: the pull step bakes it in at deploy time);
4. a process worker on that pool, from this interpreter's venv (flow runs use the worker's Python), and waits until
   the pool reports `READY`.

Each long-running process is started in its own session (process group) and recorded, with its start time, in a
state file (`<home>/emrl-server.json`) beside the logs (`<home>/logs/`). `server_down` stops exactly those
processes: SIGTERM to the group, then to any flow-run subprocess the worker left behind (they run in their own
sessions), SIGKILL after a grace period; a recorded PID whose start time no longer matches (reused by another
program) is left alone.

Ephemeral-mode trap: a `prefect` command run without `PREFECT_API_URL` silently starts a temporary server on a
throwaway database, and a deployment run created there never runs. Every command started here gets the URL and
`PREFECT_SERVER_EPHEMERAL_ENABLED=false` (a lost URL then fails with "No Prefect API URL provided");
`<home>/env.sh` exports the same for a shell; `server_status` and `require_api_url` fail loudly when the URL is unset
or points elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx


logger = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
POOL = "emrl-local"
HOST = "127.0.0.1"
STATE_NAME = "emrl-server.json"
ENV_NAME = "env.sh"
STATE_VERSION = 1
# Prefect settings of the caller that must not leak into the processes started here (they would point the CLI at
# another profile, home or Prefect Cloud).
_DROPPED_ENV = ("PREFECT_API_KEY", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH", "PREFECT_API_AUTH_STRING")
_LINUX_PROC = Path("/proc")


class ServerError(RuntimeError):
    """The local Prefect server could not be started, reached or stopped as expected."""


class EphemeralModeError(ServerError):
    """`PREFECT_API_URL` is unset (or wrong): Prefect would silently use a temporary server and database."""


@dataclass
class ProcessRecord:
    """A process started by `server_up`, identified well enough to never signal a stranger.

    Attributes:
        pid: process id; also its process group and session id (started with `start_new_session=True`).
        start_ticks: its start time in clock ticks since boot (`/proc/<pid>/stat` field 22), None off Linux.
        log: file that receives its stdout and stderr.
        argv: the command line it was started with.
    """

    pid: int
    start_ticks: int | None
    log: str
    argv: list[str]


@dataclass
class ServerState:
    """What `server_up` started; saved as JSON in `<home>/emrl-server.json`.

    Attributes:
        host: loopback address the API listens on.
        port: its TCP port.
        prefect_home: the `PREFECT_HOME` of the server, the worker and the CLI calls made here.
        project_root: the checkout (`prefect.yaml`, `EMRL_PROJECT_ROOT` of the deployments).
        pool: the process work pool.
        started_at: ISO-8601 UTC time of `server_up`.
        processes: `"server"` and (when started) `"worker"` -> their records.
        deployments: `FLOW/DEPLOYMENT` names registered at start.
    """

    host: str
    port: int
    prefect_home: str
    project_root: str
    pool: str = POOL
    started_at: str = ""
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    deployments: list[str] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        """The API URL, the value of `PREFECT_API_URL` for this server."""
        return f"http://{self.host}:{self.port}/api"

    @property
    def ui_url(self) -> str:
        """The UI address."""
        return f"http://{self.host}:{self.port}"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Return the environment for a `prefect` command against this server.

        Args:
            base: environment to start from; default `os.environ`. Caller settings that would redirect the CLI
                (`PREFECT_API_KEY`, `PREFECT_PROFILE`, ...) are dropped.

        Returns:
            `base` plus `PREFECT_API_URL`, `PREFECT_HOME`, ephemeral mode and analytics off, `EMRL_PROJECT_ROOT`.
        """
        env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _DROPPED_ENV}
        env.update(
            PREFECT_API_URL=self.api_url,
            PREFECT_HOME=self.prefect_home,
            PREFECT_SERVER_EPHEMERAL_ENABLED="false",
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            EMRL_PROJECT_ROOT=self.project_root,
        )
        return env

    def to_json(self) -> str:
        """Serialize (including the derived URLs, for readers that are not this module)."""
        return json.dumps(
            {"version": STATE_VERSION, **asdict(self), "api_url": self.api_url, "ui_url": self.ui_url}, indent=2
        )

    @classmethod
    def from_json(cls, text: str) -> ServerState:
        """Parse `to_json` output."""
        data = json.loads(text)
        if data.get("version") != STATE_VERSION:
            raise ServerError(f"Unknown server state version {data.get('version')!r}.")
        processes = {name: ProcessRecord(**record) for name, record in data["processes"].items()}
        return cls(
            host=data["host"],
            port=data["port"],
            prefect_home=data["prefect_home"],
            project_root=data["project_root"],
            pool=data["pool"],
            started_at=data["started_at"],
            processes=processes,
            deployments=list(data.get("deployments", [])),
        )


def default_home(project_root: Path = PROJECT_ROOT) -> Path:
    """Return the server's default `PREFECT_HOME`: `<project_root>/.prefect-home/server`.

    A subfolder, not `.prefect-home` itself: `make demo` runs flows in ephemeral mode on `.prefect-home/prefect.db`,
    and two servers on one SQLite file contend for its lock.
    """
    return Path(project_root).resolve() / ".prefect-home" / "server"


def state_path(home: Path) -> Path:
    """Return the state file of the server whose `PREFECT_HOME` is `home`."""
    return Path(home) / STATE_NAME


def read_state(home: Path) -> ServerState | None:
    """Return the recorded state under `home`, or None when no server was started there (or it was stopped)."""
    path = state_path(home)
    if not path.is_file():
        return None
    return ServerState.from_json(path.read_text())


def _write_state(state: ServerState) -> None:
    path = state_path(Path(state.prefect_home))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state.to_json())
    tmp.replace(path)


def free_port(host: str = HOST) -> int:
    """Return a TCP port that is free on `host` now (the OS picks it; another program may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Return whether something accepts TCP connections on `host:port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def prefect_executable() -> Path:
    """Return the `prefect` script of this interpreter's environment (the project venv when run from it)."""
    candidate = Path(sys.executable).with_name("prefect")
    if candidate.is_file():
        return candidate
    found = shutil.which("prefect")
    if found is None:
        raise ServerError(f"No `prefect` executable beside {sys.executable} or on PATH.")
    return Path(found)


def require_api_url(environ: Mapping[str, str] | None = None, expected: str | None = None) -> str:
    """Refuse to go on when Prefect would fall back to ephemeral mode.

    Call it before anything that creates deployment runs, schedules or work-pool objects.

    Args:
        environ: environment to check; default `os.environ`.
        expected: the API URL the caller means (e.g. `ServerState.api_url`); a different value is an error too.

    Returns:
        The `PREFECT_API_URL` value.

    Raises:
        EphemeralModeError: when the URL is unset or empty, or differs from `expected`.
    """
    env = os.environ if environ is None else environ
    url = env.get("PREFECT_API_URL", "").strip()
    hint = f"export PREFECT_API_URL={expected}" if expected else "start a server with `emrl server up` (make serve)"
    if not url:
        raise EphemeralModeError(
            "PREFECT_API_URL is not set: Prefect would start a temporary server with a throwaway database, and a "
            f"deployment run created there is never picked up by a worker. {hint}, or `source` the env.sh that "
            "`emrl server up` printed."
        )
    if expected is not None and url.rstrip("/") != expected.rstrip("/"):
        raise EphemeralModeError(f"PREFECT_API_URL={url} is not the local server's {expected}: {hint}.")
    return url


def api_healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    """Return whether `GET <api_url>/health` answers 200."""
    try:
        return httpx.get(f"{api_url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def deployment_names(api_url: str, timeout_s: float = 10.0) -> list[str]:
    """Return the `FLOW/DEPLOYMENT` names registered on a server, sorted (what `prefect deployment run` takes)."""
    with httpx.Client(base_url=api_url, timeout=timeout_s) as client:
        deployments = _post_json(client, "/deployments/filter", {})
        flows = {f["id"]: f["name"] for f in _post_json(client, "/flows/filter", {})}
    return sorted(f"{flows.get(d['flow_id'], '?')}/{d['name']}" for d in deployments)


def _post_json(client: httpx.Client, path: str, body: Mapping[str, Any]) -> Any:
    response = client.post(path, json=body)
    response.raise_for_status()
    return response.json()


def pool_status(api_url: str, pool: str, timeout_s: float = 5.0) -> str | None:
    """Return the work pool's status (`READY` once a worker polls it, `NOT_READY`, `PAUSED`), None if absent."""
    try:
        response = httpx.get(f"{api_url}/work_pools/{pool}", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return response.json().get("status")


def run_prefect(
    state: ServerState, args: Sequence[str], *, timeout_s: float = 300.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run one `prefect` CLI command against the server of `state`, from the project root.

    Args:
        state: the running server.
        args: arguments after `prefect`, e.g. `["deployment", "run", "build-sft-set/build-sft-set", "--watch"]`.
        timeout_s: wall-clock limit of the command.
        check: raise `ServerError` (with the command's output) when it exits non-zero.

    Returns:
        The finished process with text stdout and stderr.
    """
    argv = [str(prefect_executable()), "--no-prompt", *args]
    logger.info("$ %s", shlex.join(argv[1:]))
    result = subprocess.run(
        argv, cwd=state.project_root, env=state.env(), capture_output=True, text=True, timeout=timeout_s
    )
    if check and result.returncode != 0:
        raise ServerError(
            f"`prefect {shlex.join(args)}` exited {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
    return result


# Process bookkeeping ---------------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """Return (state, ppid, pgrp, start_ticks) from `/proc/<pid>/stat`, None when the process or /proc is absent."""
    try:
        text = (_LINUX_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def _have_proc() -> bool:
    return (_LINUX_PROC / "self" / "stat").is_file()


def _reap(pid: int) -> None:
    """Collect `pid`'s exit status when it is our child (started by `server_up` in this process)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _is_running(pid: int, start_ticks: int | None) -> bool:
    """Return whether `pid` is a live (non-zombie) process started at `start_ticks` (when known)."""
    _reap(pid)
    if _have_proc():
        stat = _proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            return False
        return start_ticks is None or stat[3] == start_ticks
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _all_stats() -> dict[int, tuple[str, int, int, int]]:
    stats = {}
    for entry in _LINUX_PROC.iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None and stat[0] not in ("Z", "X"):
                stats[int(entry.name)] = stat
    return stats


def _tree(pid: int) -> list[tuple[int, int | None]]:
    """Return (pid, start_ticks) of `pid`'s live process group members and descendants (Linux; else [])."""
    if not _have_proc():
        return []
    stats = _all_stats()
    children: dict[int, list[int]] = {}
    for child, (_, ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(child)
    found = {p for p, (_, _, pgrp, _) in stats.items() if pgrp == pid}
    stack = [pid, *found]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return sorted((p, stats[p][3]) for p in found if p in stats)


def _signal_all(members: Sequence[tuple[int, int | None]], signum: int) -> None:
    for pid, ticks in members:
        if _is_running(pid, ticks):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)


def _wait_gone(members: Sequence[tuple[int, int | None]], deadline: float) -> list[tuple[int, int | None]]:
    while True:
        alive = [(p, t) for p, t in members if _is_running(p, t)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def stop_process(record: ProcessRecord, timeout_s: float = 20.0) -> bool:
    """Stop a recorded process, its process group and its descendants; escalate to SIGKILL after `timeout_s`.

    Args:
        record: the process (its pid is also its process group id).
        timeout_s: grace period after SIGTERM, split between the group and leftover descendants.

    Returns:
        True when something was running and was stopped, False when it was already gone (or the PID was reused).
    """
    if not _is_running(record.pid, record.start_ticks):
        logger.info("pid %d already gone", record.pid)
        return False
    members = _tree(record.pid) or [(record.pid, record.start_ticks)]
    logger.info("stopping pid %d (%d processes incl. descendants)", record.pid, len(members))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(record.pid, signal.SIGTERM)
    alive = _wait_gone(members, time.monotonic() + timeout_s / 2)
    if alive:  # descendants in other sessions (flow-run subprocesses) do not get the group's signal
        _signal_all(alive, signal.SIGTERM)
        alive = _wait_gone(alive, time.monotonic() + timeout_s / 2)
    if alive:
        logger.warning("pid(s) %s ignored SIGTERM; sending SIGKILL", [p for p, _ in alive])
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, signal.SIGKILL)
        _signal_all(alive, signal.SIGKILL)
        alive = _wait_gone(alive, time.monotonic() + 5.0)
    if alive:
        raise ServerError(f"Could not stop pid(s) {[p for p, _ in alive]} (from {record.argv[:4]}).")
    return True


def _spawn(argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path) -> ProcessRecord:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as sink:
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group and session: `down` signals the group
        )
    # The Popen object is dropped on purpose: the process outlives this call (`emrl server up` exits); `_reap`
    # collects it when it ends while this interpreter is still its parent.
    proc.returncode = 0  # silences "subprocess still running" at garbage collection; the real status is reaped
    stat = _proc_stat(proc.pid) if _have_proc() else None
    return ProcessRecord(pid=proc.pid, start_ticks=None if stat is None else stat[3], log=str(log), argv=list(argv))


def _log_tail(path: str | Path, n_chars: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n_chars:]
    except OSError:
        return ""


def _wait_for(what: str, ready: Any, record: ProcessRecord, timeout_s: float, interval_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if not _is_running(record.pid, record.start_ticks):
            raise ServerError(f"{what}: the process exited. Last output ({record.log}):\n{_log_tail(record.log)}")
        time.sleep(interval_s)
    raise ServerError(
        f"{what}: not ready after {timeout_s:.0f} s. Last output ({record.log}):\n{_log_tail(record.log)}"
    )


# The commands ----------------------------------------------------------------------------------------------------


def server_up(
    *,
    project_root: Path = PROJECT_ROOT,
    home: Path | None = None,
    host: str = HOST,
    port: int | None = None,
    pool: str = POOL,
    deploy: bool = True,
    worker: bool = True,
    worker_query_seconds: float = 5.0,
    timeout_s: float = 180.0,
) -> ServerState:
    """Start the local Prefect server, pool, deployments and worker (idempotent: a healthy one is reused).

    Args:
        project_root: the checkout holding `prefect.yaml`; deployments run there.
        home: `PREFECT_HOME` of everything started (database, logs, results, state file); default
            `default_home(project_root)`.
        host: loopback address to listen on.
        port: TCP port; None picks a free one. A port in use is an error.
        pool: the process work pool to create and serve.
        deploy: run `prefect deploy --all` (False: server and pool only).
        worker: start a worker on `pool`.
        worker_query_seconds: how often the worker polls for scheduled runs (Prefect's default is 10 s).
        timeout_s: limit for the server to turn healthy and for the worker to report in, each.

    Returns:
        The state, also written to `state_path(home)`.

    Raises:
        ServerError: a step failed; everything this call started has been stopped again.
    """
    project_root = Path(project_root).resolve()
    home = (default_home(project_root) if home is None else Path(home)).resolve()
    home.mkdir(parents=True, exist_ok=True)
    existing = read_state(home)
    if existing is not None:
        if api_healthy(existing.api_url) and all(
            _is_running(r.pid, r.start_ticks) for r in existing.processes.values()
        ):
            logger.info("A server from %s is already running at %s", state_path(home), existing.api_url)
            return existing
        logger.warning("Stale server state in %s: stopping what is left of it", state_path(home))
        server_down(home=home)
    if port is None:
        port = free_port(host)
    elif port_in_use(host, port):
        raise ServerError(f"Port {port} on {host} is already in use; pick another (--port) or omit it.")

    state = ServerState(
        host=host,
        port=port,
        prefect_home=str(home),
        project_root=str(project_root),
        pool=pool,
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    prefect = str(prefect_executable())
    logs = home / "logs"
    try:
        server_argv = [prefect, "server", "start", "--host", host, "--port", str(port), "--analytics-off"]
        state.processes["server"] = _spawn(server_argv, state.env(), project_root, logs / "server.log")
        _write_state(state)
        started = time.monotonic()
        _wait_for("Prefect server", lambda: api_healthy(state.api_url), state.processes["server"], timeout_s)
        logger.info("server healthy at %s after %.1f s", state.api_url, time.monotonic() - started)

        run_prefect(state, ["work-pool", "create", pool, "--type", "process", "--overwrite"], timeout_s=timeout_s)
        if deploy:
            run_prefect(state, ["deploy", "--all"], timeout_s=timeout_s)
        state.deployments = deployment_names(state.api_url)

        if worker:
            worker_env = {
                **state.env(),
                "PREFECT_WORKER_QUERY_SECONDS": str(worker_query_seconds),
                "PREFECT_LOGGING_LEVEL": os.environ.get("EMRL_WORKER_LOG_LEVEL", "INFO"),
            }
            worker_argv = [prefect, "worker", "start", "--pool", pool, "--type", "process"]
            state.processes["worker"] = _spawn(worker_argv, worker_env, project_root, logs / "worker.log")
            _write_state(state)
            _wait_for(
                f"Worker on pool {pool!r}",
                lambda: pool_status(state.api_url, pool) == "READY",
                state.processes["worker"],
                timeout_s,
            )
    except BaseException:
        logger.error("server up failed; stopping what it started")
        _stop_recorded(state)
        state_path(home).unlink(missing_ok=True)
        raise
    _write_state(state)
    write_env_file(state)
    return state


def write_env_file(state: ServerState) -> Path:
    """Write `<home>/env.sh`: the exports a shell needs to talk to this server (`source` it)."""
    path = Path(state.prefect_home) / ENV_NAME
    lines = [
        f"# emrl server on {state.api_url} (written by `emrl server up`, {state.started_at})",
        f"export PREFECT_API_URL={shlex.quote(state.api_url)}",
        "# a forgotten URL then fails with 'No Prefect API URL provided' instead of using a throwaway server",
        "export PREFECT_SERVER_EPHEMERAL_ENABLED=false",
        f"export EMRL_PROJECT_ROOT={shlex.quote(state.project_root)}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _stop_recorded(state: ServerState, timeout_s: float = 20.0) -> list[str]:
    stopped = []
    for name in ("worker", "server"):  # the worker first: it reports its runs to the server on the way out
        record = state.processes.get(name)
        if record is not None and stop_process(record, timeout_s):
            stopped.append(f"{name} (pid {record.pid})")
    return stopped


def server_down(*, project_root: Path = PROJECT_ROOT, home: Path | None = None, timeout_s: float = 20.0) -> list[str]:
    """Stop what `server_up` started under `home` (by recorded PID and process group) and remove its state.

    Args:
        project_root: the checkout (only used for the default `home`).
        home: the server's `PREFECT_HOME`; default `default_home(project_root)`.
        timeout_s: grace period per process before SIGKILL.

    Returns:
        What was stopped, e.g. `["worker (pid 12)", "server (pid 10)"]`; empty when nothing was running.
    """
    home = (default_home(project_root) if home is None else Path(home)).resolve()
    state = read_state(home)
    if state is None:
        logger.info("No server state in %s: nothing to stop", home)
        return []
    stopped = _stop_recorded(state, timeout_s)
    state_path(home).unlink(missing_ok=True)
    (home / ENV_NAME).unlink(missing_ok=True)
    return stopped


def server_status(
    *, project_root: Path = PROJECT_ROOT, home: Path | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Report the local server and whether this shell would reach it.

    Args:
        project_root: the checkout (only used for the default `home`).
        home: the server's `PREFECT_HOME`; default `default_home(project_root)`.
        environ: the environment whose `PREFECT_API_URL` is checked; default `os.environ`.

    Returns:
        `{"running": bool, "ok": bool, "problems": [str], "state_file", ...}`; when a state exists also `api_url`,
        `ui_url`, `healthy`, `pool`, `pool_status`, `processes` (`name -> {"pid", "alive", "log"}`) and
        `deployments`. `ok` is True only when everything runs and `PREFECT_API_URL` points at it.
    """
    home = (default_home(project_root) if home is None else Path(home)).resolve()
    state = read_state(home)
    report: dict[str, Any] = {"running": False, "ok": False, "problems": [], "state_file": str(state_path(home))}
    if state is None:
        report["problems"].append(f"no server started from {home} (run `emrl server up` / make serve)")
        return report
    healthy = api_healthy(state.api_url)
    processes = {
        name: {"pid": r.pid, "alive": _is_running(r.pid, r.start_ticks), "log": r.log}
        for name, r in state.processes.items()
    }
    report.update(
        api_url=state.api_url,
        ui_url=state.ui_url,
        prefect_home=state.prefect_home,
        healthy=healthy,
        pool=state.pool,
        pool_status=pool_status(state.api_url, state.pool) if healthy else None,
        processes=processes,
        deployments=deployment_names(state.api_url) if healthy else [],
        env_file=str(home / ENV_NAME),
    )
    report["running"] = healthy and all(p["alive"] for p in processes.values())
    for name, p in processes.items():
        if not p["alive"]:
            report["problems"].append(f"{name} (pid {p['pid']}) is not running; see {p['log']}")
    if not healthy:
        report["problems"].append(f"the API at {state.api_url} does not answer /health")
    try:
        require_api_url(environ, expected=state.api_url)
    except EphemeralModeError as exc:
        report["problems"].append(str(exc))
    report["ok"] = report["running"] and not report["problems"]
    return report


def _display_prefect() -> str:
    exe = prefect_executable()
    on_path = shutil.which("prefect")
    if on_path is not None and Path(on_path).resolve() == exe.resolve():
        return "prefect"
    with contextlib.suppress(ValueError):
        return str(exe.relative_to(Path.cwd()))
    return str(exe)


def up_message(state: ServerState) -> str:
    """Return what `emrl server up` prints: addresses, the exact run commands, how to stop."""
    prefect = _display_prefect()
    home = Path(state.prefect_home)
    lines = [
        f"Prefect server running (PREFECT_HOME={home})",
        f"  UI:   {state.ui_url}",
        f"  API:  {state.api_url}",
        f"  pool: {state.pool}; "
        + ", ".join(f"{name} pid {r.pid} (log {r.log})" for name, r in state.processes.items()),
        "",
        "Run a deployment (runs are addressed FLOW/DEPLOYMENT; always pass the API URL, or Prefect silently uses a "
        "throwaway temporary server):",
    ]
    lines += [
        f"  PREFECT_API_URL={state.api_url} {prefect} deployment run {name} --watch" for name in state.deployments
    ]
    lines += [
        "",
        f"Or once per shell: source {home / ENV_NAME}",
        "Stop everything: make serve-stop   (or: emrl server down)",
    ]
    return "\n".join(lines)


def add_server_commands(subparsers: Any) -> None:
    """Add `server up|down|status` to the `emrl` CLI.

    Args:
        subparsers: the object `argparse.ArgumentParser.add_subparsers()` returned.
    """
    parser = subparsers.add_parser("server", help="local Prefect server + worker + deployments (make serve)")
    parser.set_defaults(func=_exit_with_status)
    actions = parser.add_subparsers(dest="server_action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--home", type=Path, default=None, help="PREFECT_HOME (default .prefect-home/server)")
    common.add_argument("--project-root", type=Path, default=PROJECT_ROOT)
    up = actions.add_parser("up", parents=[common], help="start server, pool, deployments and worker")
    up.add_argument("--port", type=int, default=None, help="TCP port on 127.0.0.1 (default: a free one)")
    up.add_argument("--no-deploy", dest="deploy", action="store_false", help="skip `prefect deploy --all`")
    up.add_argument("--no-worker", dest="worker", action="store_false", help="do not start a worker")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for server and worker")
    actions.add_parser("down", parents=[common], help="stop what `up` started (by PID)")
    status = actions.add_parser("status", parents=[common], help="is it running; is PREFECT_API_URL set right")
    status.add_argument("--json", action="store_true", help="print the report as JSON")


def server_command(args: argparse.Namespace) -> int:
    """Run a parsed `emrl server ...` command; return the exit status (0 ok, 1 problems)."""
    if args.server_action == "up":
        try:
            state = server_up(
                project_root=args.project_root,
                home=args.home,
                port=args.port,
                deploy=args.deploy,
                worker=args.worker,
                timeout_s=args.timeout,
            )
        except ServerError as exc:
            print(f"emrl server up failed: {exc}", file=sys.stderr)
            return 1
        print(up_message(state))
        return 0
    if args.server_action == "down":
        stopped = server_down(project_root=args.project_root, home=args.home)
        print("Stopped: " + ", ".join(stopped) if stopped else "Nothing was running.")
        return 0
    report = server_status(project_root=args.project_root, home=args.home)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        if report["running"]:
            deployments = ", ".join(report["deployments"]) or "none"
            print(
                f"running: UI {report['ui_url']}, API {report['api_url']}, pool {report['pool']} "
                f"({report['pool_status']}), deployments: {deployments}"
            )
        for problem in report["problems"]:
            print(f"PROBLEM: {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1


def _exit_with_status(args: argparse.Namespace) -> None:
    """`server_command` for a CLI whose `main()` ignores return values: a failure exits non-zero."""
    status = server_command(args)
    if status:
        raise SystemExit(status)


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.server up|down|status` (the same as `emrl server ...`)."""
    parser = argparse.ArgumentParser(prog="emrl", description="Local Prefect operations.")
    add_server_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["server", *(argv if argv is not None else sys.argv[1:])])
    logging.basicConfig(level=os.environ.get("EMRL_LOG_LEVEL", "WARNING"))
    return server_command(args)


if __name__ == "__main__":
    sys.exit(main())
