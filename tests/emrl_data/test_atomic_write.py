"""Outputs written through a temporary name: the name, concurrent writers of one path, and a write without room."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from emrl_data.atomic_write import temporary_path, write_bytes_atomic, write_json_atomic


REPO = Path(__file__).resolve().parents[2]


def test_the_temporary_name_is_hidden_beside_the_file_and_unique_per_thread(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "manifest.json"
    here = temporary_path(path)
    assert here.parent == path.parent
    assert here.name == f".manifest.json.tmp-{os.getpid()}-{threading.get_ident()}"
    other: list[Path] = []
    worker = threading.Thread(target=lambda: other.append(temporary_path(path)))
    worker.start()
    worker.join()
    assert other[0] != here and other[0].name.startswith(f".manifest.json.tmp-{os.getpid()}-")


def test_threads_writing_one_path_at_once_all_succeed_and_leave_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "out" / "entry.bin"
    payloads = [bytes([i]) * 65536 for i in range(8)]
    errors: list[BaseException] = []

    def write_many(data: bytes) -> None:
        try:
            for _ in range(25):
                write_bytes_atomic(data, path)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)

    threads = [threading.Thread(target=write_many, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert path.read_bytes() in payloads  # one whole payload, never a mix
    assert sorted(p.name for p in path.parent.iterdir()) == ["entry.bin"]


def test_json_is_sorted_indented_and_ends_with_a_newline(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_json_atomic({"b": 1, "a": [1, 2]}, path)
    assert path.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'


def test_a_write_past_the_file_size_limit_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """A real EFBIG: the child process's file-size limit is 4 KiB and it writes 64 KiB."""
    code = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from emrl_data.atomic_write import OutputWriteError, write_bytes_atomic\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "path = Path(sys.argv[1])\n"
        "try:\n"
        "    write_bytes_atomic(b'x' * 65536, path)\n"
        "except OutputWriteError as err:\n"
        "    print(err)\n"
        "    print(err.fix)\n"
    )
    path = tmp_path / "big.bin"
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    message, fix = done.stdout.splitlines()
    assert message == (
        f"the file-size limit (ulimit -f) is reached while writing {path} (File too large, EFBIG); finished cases are "
        "kept, raise the limit and rerun"
    )
    assert (
        fix
        == "raise the limit and rerun the same command: it resumes from the finished cases (no temporary file was left)"
    )
    assert list(tmp_path.iterdir()) == []
