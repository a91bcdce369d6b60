"""Small helpers shared by the flows: provenance, batching, progress artifacts."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from prefect.artifacts import create_progress_artifact, update_progress_artifact


T = TypeVar("T")
PROJECT_ROOT = Path(__file__).resolve().parent.parent


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


def batched(items: Sequence[T], size: int) -> list[list[T]]:
    """Split `items` into consecutive batches of at most `size`."""
    if size < 1:
        raise ValueError(f"batch size={size} must be >= 1.")
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


class Progress:
    """A Prefect progress artifact (0-100 %) updated as work completes."""

    def __init__(self, total: int, description: str) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.artifact_id = create_progress_artifact(progress=0.0, description=description)

    def advance(self, n: int = 1) -> None:
        """Mark `n` more units done."""
        self.done += n
        update_progress_artifact(artifact_id=self.artifact_id, progress=100.0 * self.done / self.total)
