"""Shared fixtures: one temporary Prefect API server per test session (not per test), and one tiny Qwen3-VL checkpoint
for the `train` and `inference` tests."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.logging.handlers import PrefectConsoleHandler
from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Run the test session's flows against a temporary SQLite-backed API server (about 8 s to start, once).

    Result storage is isolated too: the harness isolates the database but not `$PREFECT_HOME/storage`, so task caches
    would otherwise leak from one pytest run into the next (a second run saw `Cached` states). Request it from tests that run flows through
    the engine (retries, artifacts, `get_run_logger`); `.fn()` tests do not need it.
    """
    with temporary_settings({PREFECT_RESULTS_LOCAL_STORAGE_PATH: tmp_path_factory.mktemp("prefect-results")}):
        with prefect_test_harness(server_startup_timeout=120):
            yield


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-VL checkpoint built locally from a config (seed 0; nothing downloaded), shared by every test of the run."""
    from train.tiny.model import save_tiny  # torch and transformers: only for the tests that ask for it

    return save_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)


class _CurrentStderr(io.TextIOBase):
    """Writes to whatever `sys.stderr` is at the moment of the write (this test's capture, not an earlier one's)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return False


@pytest.fixture(autouse=True)
def _prefect_console_follows_the_capture() -> None:
    """Point Prefect's console log handlers at the current stderr, whichever test created them.

    A `PrefectConsoleHandler` keeps the stream it was built with. Built during a test that uses `capsys`, that is the
    test's capture, closed when the test ends; every later log line then failed with "I/O operation on closed file",
    and logging printed "--- Logging error --- Traceback" into the next test's stderr (the mid-run 401 test of
    test_cli_errors.py failed that way when run after test_cli.py). Writing through `_CurrentStderr` keeps every
    test's Prefect log lines in that test's own capture.
    """
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in list(logging.root.manager.loggerDict))]
    for handler in {h for logger in loggers for h in getattr(logger, "handlers", [])}:
        if isinstance(handler, PrefectConsoleHandler) and not isinstance(handler.stream, _CurrentStderr):
            handler.stream = handler.console.file = _CurrentStderr()
