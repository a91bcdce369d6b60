"""The error a user can fix, raised by the checks before Prefect starts and by the commands."""

from __future__ import annotations


class UsageError(Exception):
    """A mistake the user can fix: `problem` names it, `fix` says what to do."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix
