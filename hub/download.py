"""One file of a pinned commit downloaded through huggingface_hub's own download path, resumable and verified.

`download_file` resolves the file's location with `get_hf_file_metadata` (a HEAD that follows only Hub redirects and
retries 408/429/5xx, honouring `Retry-After`), then either
- `xet_get` when the file is Xet-stored and `hf_xet` is installed (chunked, deduplicated, its chunk cache resumes), or
- `http_get` from the location (a CDN after a redirect: the token is dropped for another host) into
  `DEST.incomplete`, resumed with an HTTP Range request from the bytes already there; `http_get` retries 408/429
  and resumes a connection cut mid-body, and `call_with_retry` adds what it lacks (a 5xx answering the GET).
Every file is checked before it is renamed to `DEST`: an LFS or Xet file against the sha256 of the listing, any other
against its git blob id. huggingface_hub 1.33's `hf_hub_download` is not used as a whole: it writes to a temporary
name unique to the process and deletes it on failure, so a crashed run would start a 14 GB part over
(docs/decisions.md#hub-downloads-the-librarys-parts-our-resume).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, cast
from urllib.parse import urlparse

from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.file_download import get_hf_file_metadata, http_get, is_xet_available, xet_get
from huggingface_hub.utils import build_hf_headers

from emrl_data.reading.release import HubFile
from hub.listing import HubCommit, access_error
from hub.retry import call_with_retry, is_busy


_CHUNK_BYTES = 1 << 20
logger = logging.getLogger(__name__)


class ChecksumMismatchError(Exception):
    """A downloaded file does not hash to the sha256 (or git blob id) the Hub lists for it."""


@dataclass(frozen=True)
class Download:
    """One finished download: the file, bytes read over the network this time, where it resumed from, seconds."""

    path: Path
    bytes_read: int
    resumed_from: int
    seconds: float


def git_blob_id(path: Path) -> str:
    """The git blob id of a file: `sha1(b"blob <size>\\0" + bytes)`, what the Hub lists for a non-LFS file."""
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def mismatch(path: Path, expected: HubFile) -> str | None:
    """Why the file at `path` is not `expected` (size, sha256, else git blob id), None when it is."""
    size = path.stat().st_size
    if size != expected.size:
        return f"{size} bytes, the Hub lists {expected.size}"
    if expected.sha256 is not None:
        got = sha256_file(path)
        return None if got == expected.sha256 else f"sha256 {got}, the Hub lists {expected.sha256}"
    if expected.blob_id is not None:
        got = git_blob_id(path)
        return None if got == expected.blob_id else f"git blob id {got}, the Hub lists {expected.blob_id}"
    return None


class _Counted:
    """A file for `http_get` that counts the bytes written through it."""

    def __init__(self, fh: IO[bytes], on_bytes: Callable[[int], None] | None) -> None:
        self.fh, self.on_bytes, self.written = fh, on_bytes, 0

    def write(self, data: bytes) -> int:
        n = self.fh.write(data)
        self.written += n
        if self.on_bytes is not None:
            self.on_bytes(n)
        return n

    def __getattr__(self, name: str) -> Any:  # tell, seek, truncate (a Range request answered by the whole file)
        return getattr(self.fh, name)


def download_file(
    release: HubCommit,
    path: str,
    dest: Path,
    expected: HubFile,
    *,
    on_bytes: Callable[[int], None] | None = None,
    on_start: Callable[[bool], None] | None = None,
) -> Download:
    """Download `path` of the release's commit to `dest`, resuming a `dest.incomplete`; verify it; see the module.

    `on_start(sequential)` is called before the first byte is written: False when Xet will write the file out of
    order (a reader of the growing file must then wait for the end).

    Raises:
        ChecksumMismatchError: the bytes do not match (`dest.incomplete` is removed, so the next try starts over).
        HubAccessError: gated, private or refused.
        huggingface_hub / httpx errors: the file failed after every retry.
    """
    partial = dest.with_name(dest.name + ".incomplete")
    dest.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    url = release.url(path)
    headers = build_hf_headers()
    try:  # the library retries 408/429/5xx and dropped connections here itself
        meta = get_hf_file_metadata(url, headers=headers, endpoint=release.endpoint, retry_on_errors=True)
    except HfHubHTTPError as err:
        refused = access_error(release.repo_id, err)
        if refused is not None:
            raise refused from None
        raise
    location = meta.location or url
    if urlparse(location).netloc != urlparse(url).netloc:
        headers.pop("authorization", None)  # a signed URL on another host: the token stays with the Hub
    if partial.exists() and partial.stat().st_size > expected.size:
        partial.unlink()
    resumed_from = partial.stat().st_size if partial.exists() else 0
    read = 0
    xet = meta.xet_file_data is not None and is_xet_available() and not constants.HF_HUB_DISABLE_XET
    if on_start is not None:
        on_start(not xet)
    if xet:
        assert meta.xet_file_data is not None
        xet_get(incomplete_path=partial, xet_file_data=meta.xet_file_data, headers=headers,
                expected_size=expected.size, displayed_filename=path)  # fmt: skip
        read = expected.size - resumed_from
        if on_bytes is not None:
            on_bytes(read)
    else:

        def fetch() -> int:
            offset = partial.stat().st_size if partial.exists() else 0
            with partial.open("ab") as fh:
                counted = _Counted(fh, on_bytes)
                try:
                    http_get(location, cast(BinaryIO, counted), resume_size=offset, headers=headers, expected_size=expected.size,
                             displayed_filename=path)  # fmt: skip
                finally:
                    nonlocal read
                    read += counted.written
            return offset

        call_with_retry(fetch, f"{path}: download", retry_on=is_busy)  # http_get itself: 408/429, cut connections
    problem = mismatch(partial, expected)
    if problem is not None:
        partial.unlink()
        raise ChecksumMismatchError(f"{expected.path}: got {problem}")
    partial.replace(dest)
    return Download(dest, read, resumed_from, time.perf_counter() - started)


def download_verified(
    release: HubCommit,
    path: str,
    dest: Path,
    expected: HubFile,
    *,
    on_bytes: Callable[[int], None] | None = None,
    tries: int = 2,
) -> tuple[Download | None, int, str | None]:
    """`download_file`, and again from scratch when the bytes fail verification (`tries` in all).

    Returns:
        (the download or None, bytes read over every try, the mismatch message when every try failed).
    """
    read = 0
    message = None
    for attempt in range(1, tries + 1):
        try:
            done = download_file(release, path, dest, expected, on_bytes=on_bytes)
            return done, read + done.bytes_read, None
        except ChecksumMismatchError as err:
            read += expected.size
            logger.warning("%s (try %d of %d)", err, attempt, tries)
            message = str(err)
    return None, read, message


class DownloadStoppedError(RuntimeError):
    """The download a `GrowingFile` follows failed, or rewrote bytes already read: the reading must start over."""


class GrowingFile(io.RawIOBase):
    """The bytes of a download as they land in its `.incomplete` file, read while it grows: `read` waits for bytes
    (or the download's end) and returns a short read only at the end of the file.

    `finish(error)` is called by the downloading thread when it ends (`error` None once the file is verified and
    renamed to `dest`).
    """

    def __init__(
        self,
        partial: Path,
        dest: Path,
        size: int,
        *,
        on_read: Callable[[int], None] | None = None,
        poll_s: float = 0.02,
    ) -> None:
        self.partial, self.dest, self.size, self.on_read, self.poll_s = partial, dest, size, on_read, poll_s
        self.offset = 0
        self._ended = threading.Event()
        self._error: BaseException | None = None
        self._stopped: str | None = None
        self._fh: IO[bytes] | None = None

    def finish(self, error: BaseException | None) -> None:
        """The download ended (with `error`, or None)."""
        self._error = error
        self._ended.set()

    def stop(self, reason: str) -> None:
        """The reader must not go on (the download writes out of order): its next read raises."""
        self._stopped = reason

    def readable(self) -> bool:
        return True

    def _open(self) -> IO[bytes] | None:
        for path in (self.partial, self.dest) if not self._ended.is_set() else (self.dest,):
            try:
                return path.open("rb")
            except FileNotFoundError:
                continue
        return None

    def readinto(self, buffer: Any) -> int:
        while True:
            if self._stopped is not None:
                raise DownloadStoppedError(self._stopped)
            if self._ended.is_set() and self._error is not None:
                raise DownloadStoppedError(f"the download stopped: {self._error}") from self._error
            if self._fh is None:
                self._fh = self._open()
            have = os.fstat(self._fh.fileno()).st_size if self._fh is not None else 0
            if have < self.offset:
                raise DownloadStoppedError(f"{self.partial.name} was rewritten under the reader")
            if self._fh is not None and have > self.offset:
                self._fh.seek(self.offset)
                data = self._fh.read(min(len(buffer), have - self.offset))
                buffer[: len(data)] = data
                self.offset += len(data)
                if self.on_read is not None:
                    self.on_read(len(data))
                return len(data)
            if self.offset >= self.size or (self._ended.is_set() and self._fh is not None):
                return 0
            if self._ended.is_set():  # verified and renamed before the reader opened it
                self._fh = self._open()
                if self._fh is None:
                    raise DownloadStoppedError(f"{self.dest.name} is gone")
                continue
            self._ended.wait(self.poll_s)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        super().close()
