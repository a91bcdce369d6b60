"""The per-case time bound: a case thread that gives up waiting past the bound, and the default bound."""

from __future__ import annotations

import threading
import time

import pytest

from emrl_data.time_bound import CASE_TIMES, CaseOverrunError, CaseThread, CaseTimes


def _case_threads() -> set[int | None]:
    return {t.ident for t in threading.enumerate() if t.name == "emrl-case"}


def test_case_thread_abandons_an_overrun_and_the_next_case_gets_a_fresh_thread() -> None:
    release = threading.Event()
    first = CaseThread.current()
    assert CaseThread.current() is first  # one per worker thread, reused from case to case
    assert first.run(lambda: 41 + 1, 30.0) == 42
    with pytest.raises(CaseOverrunError, match=r"^still running after 0.05 s$"):
        first.run(release.wait, 0.05)  # blocks until released: past any bound
    second = CaseThread.current()
    assert second is not first and second.run(lambda: "fresh", 30.0) == "fresh"
    with pytest.raises(ZeroDivisionError):
        second.run(lambda: 1 / 0, 30.0)  # a job's own exception reaches the worker
    assert second.run(lambda: "still serving", float("inf")) == "still serving"  # no bound: waits for the job
    before = _case_threads()
    release.set()  # the abandoned thread finishes its job and exits
    deadline = time.monotonic() + 30
    while len(_case_threads()) >= len(before):
        assert time.monotonic() < deadline, "the abandoned case thread did not exit"
        time.sleep(0.01)


def test_each_worker_thread_has_its_own_case_thread() -> None:
    found: list[CaseThread] = []
    worker = threading.Thread(target=lambda: found.append(CaseThread.current()))
    worker.start()
    worker.join()
    assert len(found) == 1 and found[0] is not CaseThread.current()


def test_the_default_time_bound_is_ten_times_the_median_case_with_a_floor() -> None:
    times = CaseTimes()
    assert times.bound_s(None) == 600.0  # no case yet: the floor
    for seconds in (1.0, 2.0, 100.0):
        times.record(seconds)
    assert times.bound_s(None) == 600.0  # 10 x the median (2 s) is under the floor
    times.record(90.0)
    times.record(95.0)
    assert times.bound_s(None) == 900.0  # 10 x the median, 90 s
    assert times.bound_s(7.5) == 7.5  # a configured bound is used as it is
    assert (CASE_TIMES.floor_s, CASE_TIMES.median_factor) == (600.0, 10.0)


def test_the_median_is_over_the_last_kept_cases() -> None:
    times = CaseTimes(kept=3, floor_s=1.0, median_factor=2.0)
    for seconds in (100.0, 100.0, 100.0, 4.0, 5.0, 6.0):  # the three 100 s cases fall out
        times.record(seconds)
    assert times.bound_s(None) == 10.0
