"""The per-case time bound (docs/operations.md, "Inputs that could stall a run"): a case still running after its bound
is abandoned and the run goes on.

`CaseThread` runs one worker's cases one at a time on a daemon thread and gives up waiting on a case past its bound;
`CaseTimes` keeps the curation times of a process's last cases and gives the default bound:
max(CASE_TIMEOUT_FLOOR_S, CASE_TIMEOUT_MEDIAN_FACTOR x their median). What an abandoned case becomes (a
`case_timeout` rejection) is the caller's.
"""

from __future__ import annotations

import math
import queue
import statistics
import threading
from collections import deque
from collections.abc import Callable
from typing import Any


CASE_TIMEOUT_FLOOR_S = 600.0
CASE_TIMEOUT_MEDIAN_FACTOR = 10.0
CASE_TIMES_KEPT = 1000  # the last cases whose times the median is taken over


class CaseTimes:
    """The curation times (seconds) of the last `kept` cases curated, and the time bound of the next case."""

    def __init__(
        self,
        kept: int = CASE_TIMES_KEPT,
        floor_s: float = CASE_TIMEOUT_FLOOR_S,
        median_factor: float = CASE_TIMEOUT_MEDIAN_FACTOR,
    ) -> None:
        self._seconds: deque[float] = deque(maxlen=kept)
        self._lock = threading.Lock()
        self.floor_s = floor_s
        self.median_factor = median_factor

    def record(self, seconds: float) -> None:
        """Add the curation time of one case (a case resumed from a store is not one: it took no curation)."""
        with self._lock:
            self._seconds.append(seconds)

    def bound_s(self, case_timeout_s: float | None) -> float:
        """The time bound of the next case: `case_timeout_s` when set, else max(floor, factor x median time)."""
        if case_timeout_s is not None:
            return case_timeout_s
        with self._lock:
            median_s = statistics.median(self._seconds) if self._seconds else 0.0
        return max(self.floor_s, self.median_factor * median_s)


CASE_TIMES = CaseTimes()  # this process's cases


class CaseOverrunError(Exception):
    """A case ran past its time bound (its thread is abandoned)."""


class CaseThread:
    """A daemon thread that runs the cases of one worker thread one at a time, under a time bound.

    Kept per worker thread (so the decode buffers of its per-thread pool are reused from case to case) and replaced
    when a case overruns: the abandoned thread finishes (or not) on its own and then exits; it holds no lock the run
    needs, and being a daemon it never keeps the process alive.
    """

    _local = threading.local()

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=_serve_cases, args=(self._jobs,), name="emrl-case", daemon=True).start()

    @classmethod
    def current(cls) -> CaseThread:
        """The calling worker thread's case thread (started on first use)."""
        found = getattr(cls._local, "thread", None)
        if found is None:
            found = cls._local.thread = cls()
        return found

    def run(self, job: Callable[[], Any], timeout_s: float) -> Any:
        """Run `job` on this thread and return its result (or raise its exception) within `timeout_s`.

        Raises:
            CaseOverrunError: `job` is still running after `timeout_s`: this thread is abandoned (it exits once the
                job ends) and the worker's next case gets a fresh one.
        """
        outcome: list[tuple[bool, Any]] = []
        finished = threading.Event()
        self._jobs.put((job, outcome, finished))
        if not finished.wait(None if math.isinf(timeout_s) else timeout_s):
            self._jobs.put(None)  # the thread exits when (if ever) the job ends
            if getattr(CaseThread._local, "thread", None) is self:
                CaseThread._local.thread = None
            raise CaseOverrunError(f"still running after {timeout_s:g} s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def __del__(self) -> None:  # its worker thread ended: let the case thread end too
        self._jobs.put(None)


def _serve_cases(jobs: queue.SimpleQueue[Any]) -> None:
    while (item := jobs.get()) is not None:
        job, outcome, finished = item
        try:
            outcome.append((True, job()))
        except BaseException as exc:  # noqa: BLE001 (handed to the waiting worker)
            outcome.append((False, exc))
        finished.set()
