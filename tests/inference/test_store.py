"""ResultStore: append-only JSONL that survives a crash; run_inference resumes with only the missing rows."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inference.requests import InferenceRequest, InferenceResult
from inference.store import ResultStore, run_inference
from tests.inference.helpers import EchoBackend, text_requests


ROOT = Path(__file__).resolve().parents[2]


def _res(rid: str, text: str | None = "t", error: str | None = None) -> InferenceResult:
    return InferenceResult(rid, text, error, 0.5, 1)


def test_roundtrip_and_reopen(tmp_path):
    path = tmp_path / "sub" / "results.jsonl"
    with ResultStore(path) as store:
        store.add(_res("a", "héllo \x7f\ufffd"))  # non-ASCII and control characters survive JSON
        store.add(_res("b", None, "HTTP 400: bad"))
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 3  # one terminated line per result
    reopened = ResultStore(path)
    assert reopened.get("a") == _res("a", "héllo \x7f\ufffd")
    assert reopened.get("b") == _res("b", None, "HTTP 400: bad")
    assert len(reopened) == 2 and "a" in reopened and "c" not in reopened


@pytest.mark.parametrize(
    ("tail", "kept"),
    [
        (b'{"request_id": "c", "te', ["a", "b"]),  # torn write: unterminated partial JSON is dropped
        (b"garbage\n", ["a", "b"]),  # terminated but unparsable last line is dropped
        (b'{"request_id": "c"}\n', ["a", "b"]),  # parsable JSON with missing fields counts as corrupt
        (b"", ["a", "b"]),  # clean file: nothing dropped
        (b"\n\n", ["a", "b"]),  # blank lines are skipped, not corrupt
    ],
)
def test_corrupt_last_line_is_ignored_and_truncated(tmp_path, tail, kept):
    path = tmp_path / "r.jsonl"
    with ResultStore(path) as store:
        store.add(_res("a"))
        store.add(_res("b"))
    good = path.read_bytes()
    path.write_bytes(good + tail)
    store = ResultStore(path)
    assert sorted(store.results) == kept
    assert path.read_bytes() == good + (tail if tail.strip() == b"" else b"")  # torn line cut off
    store.add(_res("c"))  # the next append starts on a clean line
    store.close()
    assert sorted(ResultStore(path).results) == ["a", "b", "c"]


def test_corrupt_middle_line_raises(tmp_path):
    path = tmp_path / "r.jsonl"
    line = json.dumps({"request_id": "a", "text": "t", "error": None, "seconds": 0.1, "attempts": 1})
    path.write_text(f"{line}\nnot json\n{line}\n")
    with pytest.raises(ValueError, match="line 2 is corrupt"):
        ResultStore(path)


def test_later_line_wins_and_pending(tmp_path):
    reqs = text_requests(3)
    with ResultStore(tmp_path / "r.jsonl") as store:
        store.add(_res("r000"))
        store.add(_res("r001", None, "timeout after 1.0 s"))
        assert [r.request_id for r in store.pending(reqs)] == ["r002"]
        assert [r.request_id for r in store.pending(reqs, retry_errors=True)] == ["r001", "r002"]
        store.add(_res("r001", "fixed"))
    assert ResultStore(tmp_path / "r.jsonl").get("r001").text == "fixed"


def test_single_writer_lock(tmp_path):
    path = tmp_path / "r.jsonl"
    with ResultStore(path) as first:
        first.add(_res("a"))
        with pytest.raises(RuntimeError, match="in use"):
            ResultStore(path).add(_res("b"))


def test_run_inference_batches_progress_and_resume(tmp_path):
    reqs = text_requests(7)
    ticks: list[int] = []
    backend = EchoBackend()
    with ResultStore(tmp_path / "r.jsonl") as store:
        out = run_inference(backend, reqs[:4], store, batch_size=3, progress=ticks.append)
    assert ticks == [3, 1]  # one tick per batch, with the batch's size
    assert list(out) == [r.request_id for r in reqs[:4]]
    rerun = EchoBackend()
    with ResultStore(tmp_path / "r.jsonl") as store:
        out = run_inference(rerun, reqs, store, batch_size=3)
    assert rerun.seen == ["r004", "r005", "r006"]  # only the missing rows
    assert list(out) == [r.request_id for r in reqs]  # every row, in request order
    assert all(out[r.request_id].text == f"echo:{r.request_id}" for r in reqs)


def test_run_inference_rejects_duplicates_and_misordered_backends(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")  # nothing is ever written: no file handle to close
    dup = [InferenceRequest("x", "p", [b""]), InferenceRequest("x", "q", [b""])]
    with pytest.raises(ValueError, match="Duplicate"):
        run_inference(EchoBackend(), dup, store, batch_size=2)

    class Reversed(EchoBackend):
        def generate(self, requests):
            return super().generate(requests)[::-1]

    with pytest.raises(RuntimeError, match="returned results"):
        run_inference(Reversed(), text_requests(2), store, batch_size=2)
    assert len(store) == 0  # nothing stored from a mismatched batch


def test_kill_after_k_rows_then_rerun_does_only_the_rest(tmp_path):
    path = tmp_path / "r.jsonl"
    n, k = 40, 5
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tests.inference.helpers", str(path), str(n), str(k)]  # blocks after k rows
    log = tmp_path / "run.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while (not path.exists() or path.read_bytes().count(b"\n") < k) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # a real crash, mid-run: row k+1 is being generated
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    store = ResultStore(path)
    done = set(store.results)
    assert len(done) == k  # every row written before the crash, none after
    backend = EchoBackend()
    with store:
        out = run_inference(backend, text_requests(n), store, batch_size=4)
    assert sorted(backend.seen) == sorted({f"r{i:03d}" for i in range(n)} - done)  # exactly the missing rows
    assert len(out) == n and all(r.ok for r in out.values())


def test_text_utf8_cannot_carry_is_stored_escaped_and_read_back_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with ResultStore(path) as store:
        store.add(InferenceResult("r000", "a \ud800 b", None, 0.0, 1, "m"))
    assert b"\\ud800" in path.read_bytes()
    with ResultStore(path) as store:
        assert store.get("r000") == InferenceResult("r000", "a \ud800 b", None, 0.0, 1, "m")
