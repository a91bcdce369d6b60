"""Output files written atomically (a temporary name renamed into place), and the one-line error for a full disk.

Every output of a run (case-store entries, shards, manifests, summaries) goes through `writing`: a failed write leaves
no temporary file, and a failure for lack of room (ENOSPC, EDQUOT, EFBIG) becomes an `OutputWriteError` naming the
file and the fix. Shared by the case store (`labeling.case_store`) and the tables (`tables.*`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


# errno -> (what happened, the fix) for a write that failed for lack of room
_NO_ROOM = {
    errno.ENOSPC: ("the disk is full", "free space and rerun"),
    errno.EDQUOT: ("the disk quota is used up", "free space (or raise the quota) and rerun"),
    errno.EFBIG: ("the file-size limit (ulimit -f) is reached", "raise the limit and rerun"),
}
_NO_ROOM_TEXT = {os.strerror(code): code for code in _NO_ROOM}  # pyarrow's errors carry the text, not always errno


class OutputWriteError(OSError):
    """A write of an output file failed for lack of room (ENOSPC, EDQUOT, or EFBIG under a file-size limit).

    The message is one line naming the file and the cause; no temporary file is left behind, and what was finished
    before (case-store entries, earlier tables) is kept, so a rerun resumes. `fix` says what to do.
    """

    def __init__(self, path: Path, code: int) -> None:
        what, fix = _NO_ROOM[code]
        name = errno.errorcode.get(code, str(code))
        message = f"{what} while writing {path} ({os.strerror(code)}, {name}); finished cases are kept, {fix}"
        super().__init__(code, message, os.fspath(path))
        self.fix = f"{fix} the same command: it resumes from the finished cases (no temporary file was left)"

    def __str__(self) -> str:
        return str(self.strerror)


def no_room_errno(err: BaseException) -> int | None:
    """The errno of a write that failed for lack of room (`err` or any exception it was raised from), else None."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _NO_ROOM:
            return current.errno
        text = str(current)
        code = next((c for message, c in _NO_ROOM_TEXT.items() if message in text), None)
        if code is not None:
            return code
        current = current.__cause__ or current.__context__
    return None


def temporary_path(path: Path) -> Path:
    """The temporary name `path` is written under before its rename: hidden, beside it (the rename stays on one file
    system), and unique to this process and thread (two writers of one path never share it)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")


@contextlib.contextmanager
def writing(path: Path, *tmp_paths: Path) -> Iterator[None]:
    """Around the write of `path` through `tmp_paths`: on any failure the temporary files are removed, and a failure
    for lack of room becomes an `OutputWriteError` naming `path` and the cause."""
    try:
        yield
    except BaseException as err:
        for tmp in tmp_paths:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        code = None if isinstance(err, OutputWriteError) else no_room_errno(err)
        if code is not None:
            raise OutputWriteError(path, code) from err
        raise


def write_json_atomic(data: Any, path: Path) -> None:
    """Write JSON (sorted keys, indented) through a temporary file and rename (`OutputWriteError` without room)."""
    write_text_atomic(json.dumps(data, indent=2, sort_keys=True) + "\n", path)


def write_text_atomic(text: str, path: Path) -> None:
    """Write text through a temporary file and rename (`OutputWriteError` without room; no temporary file left)."""
    write_bytes_atomic(text.encode(), path)


def write_bytes_atomic(data: bytes, path: Path) -> None:
    """Write bytes through a temporary file and rename (`OutputWriteError` without room; no temporary file left)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    with writing(path, tmp):
        with tmp.open("wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
