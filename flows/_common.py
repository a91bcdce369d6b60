"""Small helpers shared by the flows: provenance, batching, progress artifacts."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.exceptions import MissingContextError

from emrl_data import PROJECT_ROOT
from emrl_data.labeling.case_store import CaseStore
from emrl_data.live_view import PROGRESS_RECORD, duration


T = TypeVar("T")
# Prefect's UI cuts table cells off at the table's edge (no wrap, no visible scroll bar): artifact cells stay short.
ARTIFACT_DETAIL_CHARS = 40  # the rejections table fits its 4 columns at 1024 px (looked at in Chromium)


def git_sha() -> str | None:
    """Return the project's git commit (with `-dirty` when the tree has changes), or None outside a checkout."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def clip(text: str, max_chars: int = ARTIFACT_DETAIL_CHARS) -> str:
    """`text` cut to at most `max_chars` characters, ending in "…" when it was cut."""
    return text if len(text) <= max_chars else text[: max_chars - 1].rstrip() + "…"


def rejection_table(rejections: Sequence[Any], detail_chars: int = ARTIFACT_DETAIL_CHARS) -> list[dict[str, str]]:
    """The rows of the rejections table artifact: case, organ, step/reason and a detail short enough for the UI.

    The detail drops the file's folders up to the case's own (the case id is in its column) and is clipped to
    `detail_chars`; the full text stays in the `rejections` table and `qa.md`. One placeholder row when there is none.
    """
    rows = []
    for r in rejections:
        detail = r.detail
        if r.path and detail.startswith(r.path):
            detail = r.path.split(f"{r.case_id}/", 1)[-1] + detail[len(r.path) :]
        rows.append(
            {
                "case_id": r.case_id,
                "organ": r.organ or "",
                "step/reason": f"{r.step}/{r.reason}",
                "detail": clip(detail, detail_chars),
            }
        )
    return rows or [{"case_id": "", "organ": "", "step/reason": "none", "detail": ""}]


def batched(items: Sequence[T], size: int) -> list[list[T]]:
    """Split `items` into consecutive batches of at most `size`."""
    if size < 1:
        raise ValueError(f"batch size={size} must be >= 1.")
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def new_progress_artifact(description: str) -> UUID:
    """A progress artifact at 0 %, its id (Prefect's creator is sync-compatible: in a flow or task it returns the id)."""
    return cast(UUID, create_progress_artifact(progress=0.0, description=description))


class Progress:
    """A Prefect progress artifact (0-100 %) plus a log line every `every_pct` % with the rate and the ETA.

    The log lines are what `prefect deployment run --watch` and the CLI show while a long step runs, e.g.
    `curating cases: 40/80 (50 %), 2.1 cases/s, ETA 19 s`.
    """

    def __init__(self, total: int, description: str, *, unit: str = "items", every_pct: float = 10.0) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.description = description
        self.unit = unit
        self.every_pct = every_pct
        self._counted = 0  # units done in this run (not resumed): the rate's numerator
        self._started = time.perf_counter()
        self._next_pct = every_pct
        self.artifact_id = new_progress_artifact(description)

    def advance(self, n: int = 1, *, resumed: int = 0) -> None:
        """Mark `n` more units done, `resumed` of them found finished already (they do not count in the rate)."""
        self.done += n
        self._counted += n - resumed
        pct = 100.0 * self.done / self.total
        update_progress_artifact(artifact_id=self.artifact_id, progress=pct)
        if pct + 1e-9 >= self._next_pct or self.done >= self.total:
            while self._next_pct <= pct + 1e-9:
                self._next_pct += self.every_pct
            self._log(pct)

    def line(self, pct: float) -> str:
        """The progress line for the current state."""
        elapsed = time.perf_counter() - self._started
        rate = self._counted / elapsed if elapsed > 0 else 0.0
        left = self.total - self.done
        eta = "done" if left <= 0 else (f"ETA {duration(left / rate)}" if rate > 0 else "ETA unknown")
        return f"{self.description}: {self.done}/{self.total} ({pct:.0f} %), {rate:.2f} {self.unit}/s, {eta}"

    def _log(self, pct: float) -> None:
        try:
            logger = get_run_logger()
        except MissingContextError:
            logger = logging.getLogger("emrl.progress")
        logger.info(self.line(pct), extra={PROGRESS_RECORD: True})  # the live view shows it on the terminal


def view_artifact(key: str, description: str) -> Callable[[str, float], None]:
    """A progress artifact (`key`) that follows a `LiveView`: its `on_mark`, which sets the artifact's percentage and
    starts its description with the view's status (bytes, MB/s, ETA, parts, cases, cases/s, rejections): the run's
    Artifacts tab shows a card's first line only."""
    artifact_id = cast(UUID, create_progress_artifact(progress=0.0, key=key, description=description))

    def on_mark(status: str, pct: float) -> None:
        update_progress_artifact(artifact_id=artifact_id, progress=pct, description=f"{status} ({description})")

    return on_mark


def count_rejections(store: CaseStore, keys: Sequence[str]) -> int:
    """The rejection rows of these finished cases (their store entries; a missing one counts none)."""
    results = (store.load_rows(k) for k in keys)
    return sum(len(r.rejections) for r in results if r is not None)
