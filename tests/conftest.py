"""Shared fixtures of the flow tests: one temporary Prefect API server per test session (not per test)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Run the session's flows against a temporary SQLite-backed API server (about 8 s to start, once).

    Result storage is isolated too: the harness isolates the database but not `$PREFECT_HOME/storage`, so task caches
    would otherwise leak between sessions (`notes/prefect_hub.md` §2.4). Request it from tests that run flows through
    the engine (retries, artifacts, `get_run_logger`); `.fn()` tests do not need it.
    """
    with temporary_settings({PREFECT_RESULTS_LOCAL_STORAGE_PATH: tmp_path_factory.mktemp("prefect-results")}):
        with prefect_test_harness(server_startup_timeout=120):
            yield
