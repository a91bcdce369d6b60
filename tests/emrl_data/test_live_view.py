"""The live view on constructed counts: its line, plain lines at every 10 % off a terminal, one bar on a terminal,
and the flows' progress log lines kept off the console while it is open (and only then)."""

from __future__ import annotations

import io
import logging
import re

import pytest

from emrl_data.live_view import PROGRESS_RECORD, Counts, LiveView, current_view, status_line


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_line_says_bytes_parts_cases_and_rejections_with_an_eta_from_bytes() -> None:
    downloading = Counts(20.0, 6 << 20, 24 << 20, 1, 4, 12, 2, 40, rejections=3)
    assert status_line(downloading) == (
        "6.0 MiB of 24.0 MiB (25 %), 0.31 MB/s, ETA 60 s; part pairs 1/4; cases 12/40, 0.50 cases/s; rejections 3"
    )
    local = Counts(8.0, cases_done=20, cases_total=80, rejections=0)
    assert status_line(local) == "cases 20/80 (25 %), 2.50 cases/s, ETA 24 s; rejections 0"
    assert status_line(Counts(1.0, cases_total=10, unit="rows")) == "rows 0/10 (0 %), 0.00 rows/s, ETA unknown"
    assert status_line(Counts(300.0, 5, 5, 2, 2, 3, 3, 3)) == (
        "5 B of 5 B (100 %), 0.00 MB/s, done; part pairs 2/2; cases 3/3, 0.00 cases/s"
    )


def test_off_a_terminal_a_plain_line_at_every_10_percent_and_none_twice() -> None:
    stream = io.StringIO()
    with LiveView("fetch", Counts(bytes_total=1000, parts_total=1, rejections=0), stream=stream) as view:
        assert current_view() is view
        for _ in range(20):
            view.add_bytes(50, part="p")  # 5 % each
        view.settle_part("p", bytes_read=1000, cases=0, resumed=0, rejections=2)  # all counted live: +0 bytes
    assert current_view() is None
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [re.match(r"fetch: (\d+) B of 1000 B", line)[1] for line in lines] == [  # type: ignore[index]
        *(str(100 * i) for i in range(1, 11)),
        "1000",  # the end: part and rejections counted
    ]
    assert lines[-2].endswith("done; part pairs 0/1; cases 0, 0.00 cases/s; rejections 0")
    assert lines[-1].endswith("done; part pairs 1/1; cases 0, 0.00 cases/s; rejections 2")


def test_on_a_terminal_one_bar_redrawn_in_place_and_no_plain_line() -> None:
    terminal = _Terminal()
    with LiveView("build-sft-set", Counts(cases_total=4, rejections=0), stream=terminal, every_s=0.0) as view:
        for _ in range(4):
            view.add_cases(1, rejections=1)
    text = terminal.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # the bar's own end, nothing else
    assert "build-sft-set:" not in text  # no plain line
    last = text.rstrip("\n").split("\r")[-1]  # what the terminal shows at the end
    assert re.fullmatch(r"[#█]{10}\| cases 4/4 \(100 %\), [\d.]+ cases/s, done; rejections 4 *", last), last


def test_progress_records_stay_off_the_console_only_while_a_view_is_open() -> None:
    stream = io.StringIO()
    console = logging.StreamHandler(stream)
    logger = logging.getLogger("tests.live_view")
    logger.addHandler(console)
    logger.setLevel(logging.INFO)
    try:
        with LiveView("x", Counts(cases_total=1), stream=io.StringIO()):
            logger.info("progress 10 %", extra={PROGRESS_RECORD: True})
            logger.info("a warning the view does not show")
        logger.info("progress after", extra={PROGRESS_RECORD: True})
    finally:
        logger.removeHandler(console)
    assert stream.getvalue().splitlines() == ["a warning the view does not show", "progress after"]


def test_a_log_line_on_a_terminal_is_printed_above_the_bar() -> None:
    terminal = _Terminal()
    console = logging.StreamHandler(terminal)
    logger = logging.getLogger("tests.live_view.tty")
    logger.addHandler(console)
    try:
        with LiveView("x", Counts(cases_total=2), stream=terminal) as view:
            view.add_cases(1)
            logger.warning("HTTP 429 from hub: waiting 2 s, try 2 of 6")
            assert "emit" in vars(console)
        assert "emit" not in vars(console)  # the handler is as it was
    finally:
        logger.removeHandler(console)
    before, _, after = terminal.getvalue().partition("HTTP 429 from hub: waiting 2 s, try 2 of 6\n")
    assert before.endswith("\r") and "cases 0/2" in before  # the bar as last drawn, then cleared
    assert after.startswith("\r") and "cases 1/2" in after  # drawn again under the line, up to date


@pytest.mark.parametrize("skipped", [True, False])
def test_a_part_counted_live_is_not_counted_twice_when_it_settles(skipped: bool) -> None:
    with LiveView("x", Counts(bytes_total=300, parts_total=2, cases_total=4), stream=io.StringIO()) as view:
        view.add_bytes(100, part="a")
        view.add_case(part="a")
        view.settle_part("a", bytes_read=150, cases=2, resumed=0, rejections=1)  # 50 bytes and a case not seen live
        if skipped:
            view.drop_bytes(150)
            view.settle_part("b", bytes_read=0, cases=2, resumed=2, rejections=0)
    c = view.counts
    assert (c.bytes_done, c.bytes_total, c.parts_done, c.cases_done, c.rejections) == (
        (150, 150, 2, 4, 1) if skipped else (150, 300, 1, 2, 1)
    )
