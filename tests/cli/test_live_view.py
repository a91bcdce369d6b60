"""`emrl build-sft-set hf://…` and `emrl fetch-atlas` through a throttled fake Hub, as a person watches them: stderr
piped (a log, CI) shows plain lines whose bytes grow, never a carriage return; stderr on a terminal (a pseudo-terminal
here) shows one bar and no plain progress line, neither the view's nor the flow's per-10 % log lines."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL

from emrl_data.reading.release import format_size
from emrl_data.synthetic import demo_specs, write_atlas
from emrl_data.synthetic.pack_release import write_release
from tests.fakehub import FakeHub, serve_fake_hub


ROOT = Path(__file__).resolve().parents[2]
REPO = "AbdomenAtlas/AbdomenAtlas3.0Mini"
MB_PER_S = 0.5  # the two pairs' 2.6 MiB in about 5 s
SIZE = r"[\d.]+ (?:B|KiB|MiB)"
PLAIN = re.compile(rf"^build-sft-set: ({SIZE}) of ({SIZE}) \((\d+) %\)", re.MULTILINE)
FETCH_PLAIN = re.compile(rf"^fetch-atlas: ({SIZE}) of ({SIZE}) \((\d+) %\)", re.MULTILINE)
BAR = rf"[ █▏▎▍▌▋▊▉]{{10}}\| {SIZE} of "  # the bar's ten cells, then the view's line
FLOW_PROGRESS = re.compile(rf"curating part pairs: \d|BDMAP_\d+_BDMAP_\d+: {SIZE} of")  # the flow's per-10 % lines


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("live")
    write_atlas(root / "atlas", demo_specs(6))
    return write_release(root / "atlas", root / "release", part_cases=3)


@pytest.fixture
def hub(release: dict[str, bytes]) -> Iterator[FakeHub]:
    with serve_fake_hub(mb_per_s=MB_PER_S) as fake:
        fake.state.put_dataset(REPO, release)
        yield fake


def _argv_env(hub: FakeHub, tmp_path: Path, args: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """`emrl ARGS` (default: build-sft-set of the fake Hub's release) and its environment."""
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PYTHONPATH": str(ROOT)}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), COLUMNS="160", LINES="40")
    env.pop("HF_TOKEN", None)
    if args is None:
        args = ["build-sft-set", f"hf://datasets/{REPO}", str(tmp_path / "out"), "--frame-size", "64"]
        args += ["--max-frames", "4"]
    return [sys.executable, "-m", "cli.main", *args], env


def _fetch_argv_env(hub: FakeHub, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    return _argv_env(hub, tmp_path, ["fetch-atlas", str(tmp_path / "dest"), "--repo", REPO])


def _on_a_terminal(argv: list[str], env: dict[str, str]) -> str:
    """Run `argv` with stdout and stderr on one pseudo-terminal; what it showed there (asserting it succeeded)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=300) == 0
    return b"".join(chunks).decode(errors="replace")


def _parts(release: dict[str, bytes]) -> dict[str, int]:
    """The release's parts (image and mask archives): path -> bytes."""
    return {path: len(data) for path, data in release.items() if path.endswith(".tar.gz")}


def _in_bytes(size: str) -> float:
    value, unit = size.split()
    return float(value) * {"B": 1, "KiB": 1024, "MiB": 1024**2}[unit]


@pytest.mark.slow
def test_a_piped_run_prints_plain_lines_whose_bytes_grow(
    prefect_harness, hub: FakeHub, release: dict[str, bytes], tmp_path: Path
) -> None:
    argv, env = _argv_env(hub, tmp_path)
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\r" not in done.stderr and "\r" not in done.stdout
    lines = PLAIN.findall(done.stderr)
    assert len(lines) >= 5, done.stderr[-3000:]  # every 10 % of 2.6 MiB, read in 256 KiB steps
    sizes = [_in_bytes(b) for b, _, _ in lines]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    pcts = [int(p) for _, _, p in lines]
    assert pcts == sorted(pcts) and len(set(pcts[:-1])) == len(pcts) - 1  # a line per mark; the end says 100 again
    parts_bytes = sum(_parts(release).values())
    assert {t for _, t, _ in lines} == {format_size(parts_bytes)} and pcts[-1] == 100
    last = [line for line in done.stderr.splitlines() if line.startswith("build-sft-set: ")][-1]
    assert re.search(r", done; part pairs 2/2; cases 6/6, [\d.]+ cases/s; rejections 0$", last), last
    assert not FLOW_PROGRESS.search(done.stderr)  # the flow's per-10 % lines go to the Prefect UI only
    assert done.stdout.lstrip().startswith("# build-sft-set")  # the summary ends the run


@pytest.mark.slow
def test_a_run_on_a_terminal_shows_one_bar_and_no_plain_progress_line(
    prefect_harness, hub: FakeHub, tmp_path: Path
) -> None:
    said = _on_a_terminal(*_argv_env(hub, tmp_path))
    assert not PLAIN.search(said.replace("\r\n", "\n")), said[-3000:]  # no plain line of the view
    assert not FLOW_PROGRESS.search(said), said[-3000:]  # nor the flow's per-10 % log lines
    redraws = [s for s in said.split("\r") if re.match(BAR, s)]
    assert len(redraws) >= 5, said[-3000:]  # one bar, redrawn in place as the bytes come
    final = [s for s in redraws if "(100 %)" in s and "part pairs 2/2" in s]
    assert final and re.search(r"cases 6/6, [\d.]+ cases/s; rejections 0", final[-1]), redraws[-3:]
    sizes = [_in_bytes(m[1]) for s in redraws if (m := re.search(rf"\| ({SIZE}) of", s))]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    assert "# build-sft-set" in said.split(final[-1])[-1]  # the summary after the bar


@pytest.mark.slow
def test_a_piped_fetch_atlas_prints_plain_lines_whose_bytes_grow_to_the_release(
    hub: FakeHub, release: dict[str, bytes], tmp_path: Path
) -> None:
    argv, env = _fetch_argv_env(hub, tmp_path)
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\r" not in done.stderr and "\r" not in done.stdout
    lines = FETCH_PLAIN.findall(done.stderr)
    assert len(lines) >= 5, done.stderr[-3000:]  # every 10 % of 2.5 MiB, four parts at once
    sizes = [_in_bytes(b) for b, _, _ in lines]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    pcts = [int(p) for _, _, p in lines]
    assert pcts == sorted(pcts) and len(set(pcts[:-1])) == len(pcts) - 1  # a line per mark; the end says 100 again
    total = format_size(sum(_parts(release).values()))
    assert {t for _, t, _ in lines} == {total} and lines[-1][0] == total and pcts[-1] == 100
    last = done.stderr.splitlines()[-1]
    assert re.fullmatch(
        rf"fetch-atlas: {total} of {total} \(100 %\), [\d.]+ MB/s, done; parts 4/4; cases 6, [\d.]+ cases/s; "
        "rejections 0",
        last,
    ), last
    report = json.loads(done.stdout)  # the summary: all of stdout, after the view
    assert sorted(report["fetched"]) == sorted(_parts(release)) and report["failed"] == report["skipped"] == []
    assert sorted(p.name for p in (tmp_path / "dest" / "image_only").iterdir()) == [
        f"BDMAP_{i:08d}" for i in range(1, 7)
    ]


@pytest.mark.slow
def test_fetch_atlas_on_a_terminal_shows_one_bar_and_no_plain_view_line(
    hub: FakeHub, release: dict[str, bytes], tmp_path: Path
) -> None:
    said = _on_a_terminal(*_fetch_argv_env(hub, tmp_path))
    assert not FETCH_PLAIN.search(said.replace("\r\n", "\n")), said[-3000:]  # no plain line of the view
    redraws = [s for s in said.split("\r") if re.match(BAR, s)]
    assert len(redraws) >= 5, said[-3000:]  # one bar, redrawn in place as the bytes come
    sizes = [_in_bytes(m[1]) for s in redraws if (m := re.search(rf"\| ({SIZE}) of", s))]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    total = format_size(sum(_parts(release).values()))
    final = [s for s in redraws if f"{total} of {total} (100 %)" in s and "parts 4/4" in s]
    assert final and re.search(r"; cases 6, [\d.]+ cases/s; rejections 0", final[-1]), redraws[-3:]
    report = json.loads(said.split(final[-1])[-1].replace("\r\n", "\n"))  # the summary after the bar, alone
    assert sorted(report["fetched"]) == sorted(_parts(release))
