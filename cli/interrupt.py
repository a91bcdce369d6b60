"""Ctrl-C for the `emrl` process: the first one stops the run in order, a second one or a stuck shutdown ends it.

Finished work is kept either way (the runs are resumable); a temporary Prefect server this process started is stopped.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from cli.prefect_env import kill_temporary_servers
from cli.settings import SHELL, by_name


INTERRUPT_GRACE_S = by_name(SHELL)["interrupt_grace_s"].default


def interrupt_handler() -> Callable[[int, Any], None]:
    """A SIGINT handler: KeyboardInterrupt the first time, exit 130 at once the second time."""
    count = [0]

    def handle(signum: int, frame: Any) -> None:
        count[0] += 1
        if count[0] == 1:
            raise KeyboardInterrupt
        print("\nInterrupted again: exiting now. A rerun resumes.", file=sys.stderr, flush=True)
        kill_temporary_servers()
        os._exit(130)

    return handle


def exit_within(seconds: float, code: int, *, debug: bool = False) -> None:
    """End the process `seconds` from now unless it has ended by then (an orderly exit comes first).

    After Ctrl-C, interpreter shutdown joins every non-daemon thread; a thread still blocked would keep it alive. Seen
    once in ~20 runs under load: a request worker that Ctrl-C caught while `ThreadPoolExecutor.submit` waited for it
    to start (fixed in `inference.backends.OpenAIBackend.generate`); a library thread could do the same. This daemon
    thread names the non-daemon threads still running (with `debug`, every thread's stack too), stops any temporary
    Prefect server this process started and exits with `code`.
    """

    def force() -> None:
        time.sleep(seconds)
        holding = sorted(
            t.name for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not main_thread
        )
        held_by = f" (threads still running: {', '.join(holding)})" if holding else ""
        print(
            f"Still stopping after {seconds:g} s{held_by}: exiting now. A rerun resumes.", file=sys.stderr, flush=True
        )
        if debug:  # where each thread is blocked, for a bug report
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        kill_temporary_servers()
        os._exit(code)

    main_thread = threading.main_thread()
    threading.Thread(target=force, name="emrl-exit-guard", daemon=True).start()
