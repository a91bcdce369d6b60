"""Processes that outlive the command that started them, stopped by their whole tree, never a stranger.

`spawn` starts a process in its own session (Ctrl-C in the terminal does not reach it) and records its start time;
`stop_process` signals its process group and every descendant, including those in other sessions (a Prefect worker's
flow-run subprocesses), SIGTERM then SIGKILL. A recorded PID whose start time no longer matches (reused by another
program) is never signalled. Linux (/proc).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


_PROC = Path("/proc")


@dataclass
class ProcessRecord:
    """A process started here: pid (= its process group), start time in ticks (/proc), log file, command line."""

    pid: int
    start_ticks: int | None
    log: str
    argv: list[str]


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgrp, start_ticks) from /proc/<pid>/stat; None when gone (or a zombie)."""
    with contextlib.suppress(OSError):
        text = (_PROC / str(pid) / "stat").read_text()
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
        return None if fields[0] in ("Z", "X") else (fields[0], int(fields[1]), int(fields[2]), int(fields[19]))
    return None


def is_running(pid: int, start_ticks: int | None) -> bool:
    """Whether `pid` is alive (not a zombie) and, when known, started at `start_ticks` (not a reused PID)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reap our own child
    return (stat := _stat(pid)) is not None and start_ticks in (None, stat[3])


def process_tree(pid: int) -> list[tuple[int, int]]:
    """(pid, start_ticks) of `pid`'s process group and all its descendants (flow runs in other sessions too)."""
    stats = {int(p.name): s for p in _PROC.iterdir() if p.name.isdigit() and (s := _stat(int(p.name)))}
    found = {p for p, s in stats.items() if s[2] == pid}
    stack = [pid, *found]
    while stack:
        parent = stack.pop()
        children = {p for p, s in stats.items() if s[1] == parent} - found
        found |= children
        stack += children
    return sorted((p, stats[p][3]) for p in found)


def stop_process(record: ProcessRecord, timeout_s: float = 20.0) -> bool:
    """SIGTERM a recorded process group and its descendants, SIGKILL after `timeout_s`; False if already gone."""
    if not is_running(record.pid, record.start_ticks):
        return False
    members = process_tree(record.pid) or [(record.pid, record.start_ticks or 0)]
    for signum, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        for pid, ticks in members:
            if is_running(pid, ticks):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signum)
        deadline = time.monotonic() + wait_s
        while (members := [m for m in members if is_running(*m)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not members:
            return True
    raise RuntimeError(f"Could not stop pid(s) {[p for p, _ in members]} (from {record.argv[:4]}).")


def spawn(argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path) -> ProcessRecord:
    """Start `argv` in its own session with stdout and stderr appended to `log`; return its record."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as sink:  # its own session: Ctrl-C in the terminal does not reach it, `down` does
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.returncode = 0  # it outlives this call; `is_running` reaps it
    stat = _stat(proc.pid)
    return ProcessRecord(proc.pid, None if stat is None else stat[3], str(log), list(argv))
