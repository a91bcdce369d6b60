"""Prefect for the `emrl` CLI, set up before `prefect` is imported (this module never imports it at the top).

- `PREFECT_HOME` defaults to `.prefect-home/` in the checkout (as `make` sets it), never `~/.prefect`; telemetry off.
- With `PREFECT_API_URL` set, that server is used (and must answer `/health`).
- Otherwise one line says that a temporary server starts, and it starts in its own session: Ctrl-C in the terminal
  reaches the flow, not the server, so the interrupted run is still recorded (Prefect's own ephemeral server shares
  the terminal's process group, dies first, and the run then fails with pages of `ConnectError`). It also gives
  process-pool and Dask workers the URL, so they do not each start a server of their own.
- Without `--debug`, tracebacks are kept out of the console (the Prefect UI and API logs keep them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path

from cli.errors import UsageError
from emrl_data import PROJECT_ROOT


DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no "Failed to send telemetry" offline
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
}


_RUNNING: list[subprocess.Popen] = []  # temporary servers of this process (a second Ctrl-C kills them)


def default_prefect_home(project_root: Path = PROJECT_ROOT) -> Path:
    """`.prefect-home/` in the checkout (the Makefile's value); in the working directory for a non-editable install."""
    root = project_root if (project_root / "pyproject.toml").is_file() else Path.cwd()
    return root / ".prefect-home"


def configure_prefect_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """Set Prefect's home and telemetry defaults where the user has not set them (call before importing prefect)."""
    env = os.environ if environ is None else environ
    env.setdefault("PREFECT_HOME", str(default_prefect_home()))
    for key, value in DEFAULTS.items():
        env.setdefault(key, value)


def _api_url_in_settings() -> str | None:
    """The API URL of an already imported Prefect's current settings (e.g. the test harness), else None."""
    if "prefect" not in sys.modules:
        return None
    # lazy: Prefect reads its settings at import, so it is imported after this module set them
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def _healthy(api_url: str, timeout_s: float = 3.0) -> bool:
    import httpx  # lazy: httpx adds 0.04 s to `emrl --help` (measured)

    try:
        return httpx.get(f"{api_url.rstrip('/')}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_temporary_server(home: Path, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """Start Prefect's API (no UI) on a free loopback port in its own session; return the process and API URL."""
    log = home / "logs" / "temporary-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    argv = [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"]
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    env.pop("PREFECT_API_URL", None)
    with log.open("ab") as sink:
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink, start_new_session=True
        )
    _RUNNING.append(proc)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + timeout_s
    while not _healthy(url, timeout_s=1.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_temporary_server(proc)
            raise UsageError(
                f"the temporary Prefect server did not start (see {log})",
                "start one with `make serve` and export the PREFECT_API_URL it prints",
            )
        time.sleep(0.2)
    return proc, url


def stop_temporary_server(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the server's session, SIGKILL after `timeout_s`."""
    if proc in _RUNNING:
        _RUNNING.remove(proc)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def kill_temporary_servers() -> None:
    """SIGKILL every temporary server this process started (the way out on a second Ctrl-C)."""
    for proc in list(_RUNNING):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _RUNNING.remove(proc)


class _NoTraceback(logging.Formatter):
    """Format a record with the wrapped formatter, without its traceback (the record itself is left unchanged)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def hide_console_tracebacks() -> None:
    """Keep tracebacks out of Prefect's console output (its API log handler, hence the UI, keeps them)."""
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in list(logging.root.manager.loggerDict))]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if type(handler).__name__ == "PrefectConsoleHandler" and not isinstance(handler.formatter, _NoTraceback):
                handler.setFormatter(_NoTraceback(handler.formatter))


@contextlib.contextmanager
def prefect_session(*, debug: bool = False) -> Iterator[str]:
    """Make Prefect usable for one CLI command; yield the API URL.

    Raises:
        UsageError: `PREFECT_API_URL` is set but its server does not answer, or the temporary server fails.
    """
    configure_prefect_environment()
    url = os.environ.get("PREFECT_API_URL", "").strip()
    if url and not _healthy(url):
        raise UsageError(
            f"PREFECT_API_URL={url} does not answer",
            "start that server (`make serve`), or unset PREFECT_API_URL to use a temporary one",
        )
    url = url or (_api_url_in_settings() or "")
    proc = None
    if not url:
        print(
            "Starting a temporary Prefect server (10-60 s; to use a running one, set PREFECT_API_URL: see `make serve`)",
            file=sys.stderr,
            flush=True,
        )
        timeout_s = max(180.0, float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))  # busy CPUs
        proc, url = start_temporary_server(Path(os.environ["PREFECT_HOME"]), timeout_s)
        os.environ["PREFECT_API_URL"] = url  # for this process and any worker process it starts
    try:
        # lazy: Prefect, after its settings (see _api_url_in_settings)
        import prefect.main  # noqa: F401 (sets up Prefect's logging, which the next lines adjust)

        # lazy: Prefect, after its settings (see _api_url_in_settings)
        from prefect.settings import PREFECT_API_URL, temporary_settings

        if not debug:
            hide_console_tracebacks()
        if level := os.environ.get("EMRL_LOG_LEVEL"):
            logging.getLogger().setLevel(level)
        with temporary_settings({PREFECT_API_URL: url}):
            yield url
    finally:
        if proc is not None:
            _drain_prefect_queues()  # logs and events still queued for the server, before it goes
            os.environ.pop("PREFECT_API_URL", None)
            stop_temporary_server(proc)


def _drain_prefect_queues(timeout_s: float = 5.0) -> None:
    with contextlib.suppress(Exception):
        from prefect.events.worker import EventsWorker  # lazy: Prefect (see _api_url_in_settings)
        from prefect.logging.handlers import APILogWorker  # lazy: Prefect (see _api_url_in_settings)

        APILogWorker.drain_all(timeout=timeout_s)
        EventsWorker.drain_all(timeout=timeout_s)
