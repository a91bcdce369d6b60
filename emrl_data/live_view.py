"""One live view of a long run on stderr: a tqdm bar on a terminal, a plain line every 10 % (or 15 s) otherwise.

The view counts bytes downloaded, part pairs done, cases (or rows) done and the rejections so far, and says them in
one line (`status_line`): `1.2 MiB of 3.4 MiB (35 %), 0.21 MB/s, ETA 11 s; part pairs 1/2; cases 3/8, 0.42 cases/s;
rejections 0`. The percentage and the ETA come from bytes when the run downloads (bytes dominate its time), else
from cases. On a terminal (`stream.isatty()`) the line is the tail of one bar redrawn in place; anywhere else (CI, a
log file) the line is printed at every 10 % and at least every 15 s, and once at the end: never both. While a view is
open, log records marked as progress (`PROGRESS_RECORD`: the flows' per-10 % lines) are kept off every console
stream handler, so the terminal shows the progress once; they still reach other handlers (Prefect's API: the UI).

Anything that counts (a download thread, a task in the same process) finds the open view with `current_view()`.
`on_mark(status, pct)` is called at every mark, in either mode, outside the view's lock (the flows update a Prefect
progress artifact there).
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import IO, Any

from tqdm import tqdm

from emrl_data.reading.release import format_size


PROGRESS_RECORD = "emrl_progress"  # `extra={PROGRESS_RECORD: True}`: a log line the live view already shows
EVERY_PCT = 10.0
EVERY_S = 15.0
_current: LiveView | None = None
_current_lock = threading.Lock()


@dataclass(frozen=True)
class Counts:
    """What a run has done so far; a total of None is unknown (not shown)."""

    elapsed_s: float = 0.0
    bytes_done: int = 0
    bytes_total: int | None = None
    parts_done: int = 0
    parts_total: int | None = None
    cases_done: int = 0
    cases_resumed: int = 0  # found finished: not in the rate
    cases_total: int | None = None
    rejections: int | None = None  # None: the run has no rejections to count
    unit: str = "cases"
    parts_unit: str = "part pairs"

    def pct(self) -> float:
        """Percent done: of the bytes when the run downloads, else of the cases."""
        if self.bytes_total:
            return min(100.0, 100.0 * self.bytes_done / self.bytes_total)
        return min(100.0, 100.0 * self.cases_done / self.cases_total) if self.cases_total else 0.0


def duration(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `2 h 10 min`."""
    seconds = round(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _eta(left: float, rate: float) -> str:
    return "done" if left <= 0 else (f"ETA {duration(left / rate)}" if rate > 0 else "ETA unknown")


def status_line(c: Counts) -> str:
    """The view's line.

    >>> status_line(Counts(10.0, 3 << 20, 6 << 20, 1, 2, 4, 0, 8, 1))
    '3.0 MiB of 6.0 MiB (50 %), 0.31 MB/s, ETA 10 s; part pairs 1/2; cases 4/8, 0.40 cases/s; rejections 1'
    >>> status_line(Counts(4.0, cases_done=10, cases_resumed=2, cases_total=40, unit="rows"))
    'rows 10/40 (25 %), 2.00 rows/s, ETA 15 s'
    """
    s = max(c.elapsed_s, 1e-9)
    case_rate = (c.cases_done - c.cases_resumed) / s
    of_cases = f"/{c.cases_total}" if c.cases_total is not None else ""
    cases = f"{c.unit} {c.cases_done}{of_cases}"
    pieces = []
    if c.bytes_total is not None:
        rate = c.bytes_done / s
        head = f"{format_size(c.bytes_done)} of {format_size(c.bytes_total)} ({c.pct():.0f} %), {rate / 1e6:.2f} MB/s"
        pieces.append(f"{head}, {_eta(c.bytes_total - c.bytes_done, rate)}")
        if c.parts_total is not None:
            pieces.append(f"{c.parts_unit} {c.parts_done}/{c.parts_total}")
        pieces.append(f"{cases}, {case_rate:.2f} {c.unit}/s")
    else:
        left = (c.cases_total or 0) - c.cases_done
        pct = f" ({c.pct():.0f} %)" if c.cases_total else ""
        pieces.append(f"{cases}{pct}, {case_rate:.2f} {c.unit}/s, {_eta(left, case_rate)}")
    if c.rejections is not None:
        pieces.append(f"rejections {c.rejections}")
    return "; ".join(pieces)


class _QuietProgress(logging.Filter):
    """Drops progress records (the live view shows them) on a console handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, PROGRESS_RECORD, False)


def _console_handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    handlers = {h for lg in loggers for h in getattr(lg, "handlers", [])}
    return [h for h in handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


def current_view() -> LiveView | None:
    """The view open in this process, if any."""
    return _current


class LiveView:
    """The live view of one run (a context manager); see the module. Thread-safe."""

    def __init__(
        self,
        title: str,
        counts: Counts,
        *,
        stream: IO[str] | None = None,
        on_mark: Callable[[str, float], None] | None = None,
        every_pct: float = EVERY_PCT,
        every_s: float = EVERY_S,
    ) -> None:
        self.title, self.counts, self.on_mark = title, counts, on_mark
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_pct, self.every_s = every_pct, every_s
        self._lock = threading.RLock()  # a log line said while the view holds it is printed, not a deadlock
        self._started = self._last_mark = time.monotonic()
        self._next_pct = every_pct
        self._bar: Any = None
        self._quiet = _QuietProgress()
        self._filtered: list[logging.Handler] = []
        self._settled: dict[str, tuple[int, int]] = {}  # part -> (bytes, cases) counted live
        self._printed = ""  # the last plain line (the end prints one only when it says something new)

    def __enter__(self) -> LiveView:
        global _current
        if self.tty:
            size = shutil.get_terminal_size()  # 80 x 24 where the terminal says 0 x 0 (a bare pty: tqdm would hide)
            self._bar = tqdm(
                total=1000,
                file=self.stream,
                bar_format="{bar:10}| {desc}",
                ncols=size.columns,
                nrows=size.lines,
                mininterval=0.2,
            )
            self._bar.set_description_str(status_line(self.counts), refresh=True)
        self._filtered = _console_handlers()
        for handler in self._filtered:
            handler.addFilter(self._quiet)
            if self._bar is not None:
                handler.emit = partial(self._emit_above_bar, handler.emit)  # type: ignore[method-assign]
        with _current_lock:
            _current = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _current
        with _current_lock:
            if _current is self:
                _current = None
        self._mark(force=True)
        for handler in self._filtered:
            handler.removeFilter(self._quiet)
            if "emit" in vars(handler):
                del handler.emit
        if self._bar is not None:
            self._bar.close()

    def _emit_above_bar(self, emit: Callable[[logging.LogRecord], None], record: logging.LogRecord) -> None:
        """A console log line on a terminal: the bar is cleared, the line printed, the bar drawn again below it."""
        with self._lock:
            self._bar.clear()
            emit(record)
            self._bar.refresh()

    def _change(self, **deltas: int) -> None:
        with self._lock:
            c = self.counts
            values: dict[str, Any] = {k: (getattr(c, k) or 0) + v for k, v in deltas.items()}
            self.counts = replace(c, elapsed_s=time.monotonic() - self._started, **values)
        self._mark()

    def add_bytes(self, n: int, part: str | None = None) -> None:
        """Count `n` bytes downloaded (of `part`: `settle_part` then counts only what this did not)."""
        if part is not None:
            with self._lock:
                b, k = self._settled.get(part, (0, 0))
                self._settled[part] = (b + n, k)
        self._change(bytes_done=n)

    def add_case(self, part: str | None = None) -> None:
        """Count one case done (of `part`, as `add_bytes`)."""
        if part is not None:
            with self._lock:
                b, k = self._settled.get(part, (0, 0))
                self._settled[part] = (b, k + 1)
        self._change(cases_done=1)

    def add_cases(self, n: int, *, resumed: int = 0, rejections: int = 0) -> None:
        """Count `n` cases done, `resumed` of them found finished, with `rejections` rejection rows."""
        self._change(cases_done=n, cases_resumed=resumed, **({"rejections": rejections} if rejections else {}))

    def settle_part(self, part: str, *, bytes_read: int, cases: int, resumed: int, rejections: int) -> None:
        """A part pair finished: count what was not counted live, and the part (a part from the ledger read no byte:
        its size leaves the total)."""
        with self._lock:
            live_bytes, live_cases = self._settled.pop(part, (0, 0))
        self._change(
            bytes_done=max(bytes_read - live_bytes, 0),
            cases_done=max(cases - live_cases, 0),
            cases_resumed=resumed,
            parts_done=1,
            rejections=rejections,
        )

    def fail_part(self, part: str, size_bytes: int) -> None:
        """A part pair failed: it counts as done, and the bytes it did not read leave the total."""
        with self._lock:
            live_bytes, _ = self._settled.pop(part, (0, 0))
        self._change(parts_done=1, bytes_total=-max(size_bytes - live_bytes, 0))

    def drop_bytes(self, n: int) -> None:
        """`n` bytes that will not be downloaded (a part found finished) leave the total."""
        self._change(bytes_total=-n)

    def _mark(self, force: bool = False) -> None:
        with self._lock:
            now, pct = time.monotonic(), self.counts.pct()
            due = force or pct + 1e-9 >= self._next_pct or now - self._last_mark >= self.every_s
            status = status_line(self.counts)
            line = f"{self.title}: {status}"
            if self._bar is not None:
                self._bar.n = round(10 * pct)
                self._bar.set_description_str(status, refresh=False)  # no title: the bar fits 110 columns
                self._bar.update(0)  # redrawn at most every `mininterval`
            if due:
                self._last_mark = now
                while self._next_pct <= pct + 1e-9:
                    self._next_pct += self.every_pct
                if self._bar is None and line != self._printed:
                    self.stream.write(line + "\n")
                    self.stream.flush()
                    self._printed = line
        if due and self.on_mark is not None:
            self.on_mark(status, pct)
