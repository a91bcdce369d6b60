"""Opening input files that can never stall a run: regular files only, reads bounded by the size found at the start.

Every input file the pipeline reads (CT, masks, lesion files, metadata and split CSVs, case-store entries) goes through
`open_regular`: the path is checked with `stat` (symlinks followed by the kernel, at most 40 of them, else ELOOP)
*before* it is opened, and the opened descriptor is checked again with `fstat` (the open itself is non-blocking, so a
file swapped for a named pipe between the two never blocks). A named pipe, socket, character or block device (e.g. a
symlink to `/dev/zero` or `/dev/urandom`) or folder raises `NotRegularFileError` naming its kind; the caller turns it
into an `unreadable_file` rejection (a file a row needs) or a run warning (a file nothing needs).

Reads are bounded by the size `stat` reported at the start (`read_regular_bytes`, `check_unchanged`): a file that grows,
shrinks or is rewritten while being read raises `FileChangedError`, never a hang or a silent mix of two versions.
"""

from __future__ import annotations

import errno
import os
import stat
from io import BufferedReader
from pathlib import Path
from typing import BinaryIO, cast


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def file_kind(mode: int) -> str:
    """Name the kind of a file from its `st_mode`: "a regular file", "a named pipe", "a character device", ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def describe_special(path: Path, mode: int) -> str:
    """`file_kind`, prefixed with "a symlink to" (and the link's target) when `path` itself is a symlink."""
    kind = file_kind(mode)
    try:
        target = os.readlink(path)
    except OSError:
        return kind
    return f"a symlink to {kind} ({target!r})"


class NotRegularFileError(OSError):
    """The path is a named pipe, socket, device or folder where a regular file is read; `kind` names it."""

    def __init__(self, path: Path | str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{kind}, not a regular file", os.fspath(path))
        self.kind = kind


class FileChangedError(OSError):
    """The file grew, shrank or was rewritten while it was being read."""

    def __init__(self, path: Path | str, what: str) -> None:
        super().__init__(errno.EIO, f"changed while being read ({what})", os.fspath(path))


def stat_regular(path: Path | str) -> os.stat_result:
    """`os.stat` of `path` (symlinks followed), raising `NotRegularFileError` unless it is a regular file.

    Raises:
        NotRegularFileError: a folder, named pipe, socket or device (or a symlink to one).
        OSError: the path cannot be reached (FileNotFoundError, ELOOP for a symlink loop, EACCES, ...).
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(path, describe_special(Path(path), st.st_mode))
    return st


def open_regular(path: Path | str) -> BufferedReader:
    """Open a regular file for binary reading without ever blocking on a special file.

    `stat` first (a special file is refused without being opened), then a non-blocking open whose descriptor is
    checked again with `fstat` (a path swapped for a pipe in between is refused too, and O_NONBLOCK makes the open of
    a pipe return at once). The returned file's `stat` is the one read loops are bounded by (`os.fstat(f.fileno())`).

    Raises:
        NotRegularFileError: the path is not a regular file.
        OSError: the path cannot be opened.
    """
    stat_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(path, file_kind(st.st_mode))
        os.set_blocking(fd, True)
        return cast(BufferedReader, os.fdopen(fd, "rb"))
    except BaseException:
        os.close(fd)
        raise


def check_unchanged(fh: BinaryIO, before: os.stat_result, path: Path | str) -> None:
    """Raise `FileChangedError` when the open file's size or modification time differ from `before` (the file grew,
    shrank or was rewritten while it was read)."""
    now = os.fstat(fh.fileno())
    if now.st_size != before.st_size:
        raise FileChangedError(path, f"{before.st_size} bytes at the start, {now.st_size} at the end")
    if now.st_mtime_ns != before.st_mtime_ns:
        raise FileChangedError(path, "rewritten while it was read: its modification time changed")


def read_regular_bytes(path: Path | str, limit: int | None = None) -> bytes:
    """Read a whole regular file, bounded by the size `stat` reported when it was opened.

    Raises:
        NotRegularFileError: not a regular file.
        FileChangedError: the file changed size or was rewritten while being read.
        ValueError: the file holds more than `limit` bytes (refused before reading).
        OSError: the file cannot be read.
    """
    with open_regular(path) as fh:
        before = os.fstat(fh.fileno())
        if limit is not None and before.st_size > limit:
            raise ValueError(f"{Path(path).name}: {before.st_size} bytes, more than the {limit} allowed")
        data = fh.read(before.st_size)
        if len(data) != before.st_size:
            raise FileChangedError(path, f"{before.st_size} bytes at the start, {len(data)} could be read")
        check_unchanged(fh, before, path)
    return data
