"""One file of a pinned commit downloaded through huggingface_hub's and hf_xet's own clients, resumable and verified.

Each try resolves the file afresh with `get_hf_file_metadata` (a HEAD that follows only Hub redirects; a signed URL
from an earlier try may have expired), then appends to `DEST.incomplete` from its last byte:
- a Xet-stored file (`X-Xet-Hash`, hf_xet installed) through hf_xet's ordered stream from that offset
  (`XetDownloadStreamGroup.download_stream(info, start=offset)`): the Hub's token goes to the Hub's refresh route
  (a gated repository needs it there), the Xet token it hands out to the storage, the Hub token never;
- any other file with `http_get` from the resolved location and an HTTP Range (the token dropped for another host).
Both write in file order, so the `.incomplete` file is always a prefix of the file: a reader can follow it as it
grows (`GrowingFile`), and a crash, a `kill -9` or a failed try loses at most what was in flight. Bytes are reported
as they are written. `call_with_retry` retries a try that failed on a rate limit, a 5xx, a reset or cut connection
(hf_xet has already retried each request by then) or a refused signed URL; each retry resumes.
Every file is checked before it is renamed to `DEST`: an LFS or Xet file against the sha256 of the listing, any other
against its git blob id. huggingface_hub 1.33's `hf_hub_download` is not used as a whole: it writes to a temporary
name unique to the process and deletes it on failure, and hf_xet's file download truncates the destination, so a
crashed run would start a 14 GB part over (docs/decisions.md#hub-downloads-the-librarys-parts-our-resume).
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
from huggingface_hub.file_download import HfFileMetadata, get_hf_file_metadata, http_get, is_xet_available
from huggingface_hub.utils import build_hf_headers, is_package_available
from huggingface_hub.utils._xet import get_xet_session, refresh_xet_connection_info, xet_headers_without_auth
from huggingface_hub.utils.sha import sha_fileobj

from emrl_data.reading.release import HubFile
from hub.listing import HubCommit, access_error
from hub.logs import route_library_logs
from hub.retry import call_with_retry, is_refused_by_storage, is_transient


_CHUNK_BYTES = 1 << 20
# `http_get` hands its writes the response in chunks of this size: bytes are counted (and shown) as they come, every
# 256 KiB rather than every 10 MiB, the library's default (a 10 MiB step is 5 s at 2 MB/s; 256 KiB costs about 400
# writes a second at 100 MB/s).
constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, 256 << 10)
# huggingface_hub 1.33 caches whether hf_xet is installed on first use, writing "N/A" before it looks: a second thread
# asking at that moment is told no, and would read a Xet file's bridge URL over HTTP (404). Asked once here, at import.
is_package_available("hf_xet")
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
    """The git blob id of a file: `sha1(b"blob <size>\\0" + bytes)`, what the Hub lists for a non-LFS file (the
    library's `git_hash` takes the bytes whole; a file is read here in 1 MiB chunks)."""
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    """The sha256 of a file, through the library's `sha_fileobj` (chunked)."""
    with path.open("rb") as fh:
        return sha_fileobj(fh).hex()


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
    """A file that counts the bytes written through it (and reports them: progress)."""

    def __init__(self, fh: IO[bytes], on_bytes: Callable[[int], None] | None) -> None:
        self.fh, self.on_bytes, self.written = fh, on_bytes, 0

    def write(self, data: bytes) -> int:
        n = self.fh.write(data)
        self.written += n
        if self.on_bytes is not None:
            self.on_bytes(n)
        return n

    def flush(self) -> None:
        self.fh.flush()

    def __getattr__(self, name: str) -> Any:  # tell, seek, truncate (a Range request answered by the whole file)
        return getattr(self.fh, name)


class IncompleteDownloadError(ConnectionError):
    """A transfer ended without an error before the file's last byte (retried: the next try resumes)."""


class XetTransferError(ConnectionError):
    """hf_xet gave up on a transfer after its own retries (retried here: the next try resumes)."""


def download_file(
    release: HubCommit,
    path: str,
    dest: Path,
    expected: HubFile,
    *,
    on_bytes: Callable[[int], None] | None = None,
) -> Download:
    """Download `path` of the release's commit to `dest`, resuming a `dest.incomplete`; verify it; see the module.

    Raises:
        ChecksumMismatchError: the bytes do not match (`dest.incomplete` is removed, so the next try starts over).
        HubAccessError: gated, private or refused.
        huggingface_hub / httpx / hf_xet errors: the file failed after every retry.
    """
    route_library_logs()
    partial = dest.with_name(dest.name + ".incomplete")
    dest.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if partial.exists() and partial.stat().st_size > expected.size:
        partial.unlink()
    resumed_from = partial.stat().st_size if partial.exists() else 0
    read = 0

    def one_try() -> None:
        nonlocal read
        headers = build_hf_headers()
        meta = _resolve(release, path, headers)
        offset = partial.stat().st_size if partial.exists() else 0
        with partial.open("ab") as fh:
            counted = _Counted(fh, on_bytes)
            try:
                if offset < expected.size:
                    _fetch(meta, release, path, headers, cast(BinaryIO, counted), offset, expected.size)
            finally:
                read += counted.written
        size = partial.stat().st_size
        if size < expected.size:
            raise IncompleteDownloadError(f"{path}: the transfer ended at byte {size} of {expected.size}")

    def retry_on(err: BaseException) -> bool:
        return is_transient(err) or is_refused_by_storage(err, release.endpoint)

    call_with_retry(one_try, f"{path}: download", retry_on=retry_on)
    problem = mismatch(partial, expected)
    if problem is not None:
        partial.unlink()
        raise ChecksumMismatchError(f"{expected.path}: got {problem}")
    partial.replace(dest)
    return Download(dest, read, resumed_from, time.perf_counter() - started)


def _resolve(release: HubCommit, path: str, headers: dict[str, str]) -> HfFileMetadata:
    """The file's metadata and location (the library retries 408/429/5xx and dropped connections on this HEAD)."""
    try:
        return get_hf_file_metadata(
            release.url(path), headers=headers, endpoint=release.endpoint, retry_on_errors=True
        )
    except HfHubHTTPError as err:
        refused = access_error(release.repo_id, err)
        if refused is not None:
            raise refused from None
        raise


def _fetch(
    meta: HfFileMetadata, release: HubCommit, path: str, headers: dict[str, str], out: BinaryIO, offset: int, size: int
) -> None:
    """Append the file's bytes from `offset` to `out`, through Xet when the file is Xet-stored, else over HTTP."""
    xet = meta.xet_file_data
    if xet is not None and is_xet_available() and not constants.HF_HUB_DISABLE_XET:
        try:  # the Hub token goes to the Hub's refresh route only: it hands out the Xet token for the storage
            info = refresh_xet_connection_info(file_data=xet, headers=headers)
        except HfHubHTTPError as err:
            refused = access_error(release.repo_id, err)
            if refused is not None:
                raise refused from None
            raise
        _xet_stream(xet.file_hash, size, offset, info, xet.refresh_route, headers, out)
        return
    url = release.url(path)
    location = meta.location or url
    if urlparse(location).netloc != urlparse(url).netloc:
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}  # a signed URL elsewhere
    http_get(
        location,
        out,
        resume_size=offset,
        headers=headers,
        expected_size=size,
        displayed_filename=path,
        tqdm_class=cast(Any, _NoBar),
    )


class _NoBar:
    """The progress bar `http_get` draws per file, not drawn: the run has one live view (`emrl_data.live_view`)."""

    def __init__(self, **_: Any) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def _xet_stream(
    file_hash: str, size: int, offset: int, info: Any, refresh_route: str, headers: dict[str, str], out: BinaryIO
) -> None:
    """hf_xet's ordered stream of the file from `offset` to its end, written to `out` as the bytes arrive."""
    from hf_xet import XetFileInfo  # lazy: hf_xet is a huggingface_hub dependency on x86_64 and arm64 machines only

    group = get_xet_session().new_download_stream_group(
        endpoint=info.endpoint,
        token=info.access_token,
        token_expiry_unix_secs=info.expiration_unix_epoch,
        token_refresh_url=refresh_route,
        token_refresh_headers=headers,
        custom_headers=xet_headers_without_auth(headers),
    )
    stream = group.download_stream(XetFileInfo(file_hash, size), start=offset)
    finished = False
    try:
        while True:
            try:
                piece = next(stream)
            except StopIteration:
                break
            except Exception as err:  # hf_xet raises ConnectionError or RuntimeError once its own retries are spent
                raise XetTransferError(f"Xet transfer stopped: {str(err).splitlines()[0][:200]}") from err
            out.write(piece)  # a full disk here is an OSError, not retried
            out.flush()
        finished = True
    finally:
        if not finished:
            stream.cancel()
            group.abort()


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
        self._fh: IO[bytes] | None = None

    def finish(self, error: BaseException | None) -> None:
        """The download ended (with `error`, or None)."""
        self._error = error
        self._ended.set()

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
