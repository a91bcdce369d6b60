"""AbdomenAtlas 3.0 read from the Hub: the revision pinned to a commit, parts listed with their sha256, downloads that
resume and are verified, and the part ledger that lets a rerun skip every part it already curated.

Used by the `build-sft-set` flow (`flows.hub_parts`) and by `emrl fetch-atlas`. The Hub client (`huggingface_hub`)
is only used here: the endpoint is `HF_ENDPOINT` (default the Hub), the token the usual one (`HF_TOKEN` or
`hf auth login`); against the real Hub and the test's fake Hub only the endpoint differs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from huggingface_hub import HfApi
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from emrl_data.atomic_write import write_json_atomic
from emrl_data.reading.release import HubFile, PartPair, pair_parts


HUB_PREFIX = "hf://datasets/"
DOWNLOAD_ATTEMPTS = 3  # a dropped connection is resumed this many times before the task fails
_CHUNK_BYTES = 1 << 20
logger = logging.getLogger(__name__)


def hub_repo(atlas_root: str) -> str | None:
    """The dataset repo of an `hf://datasets/OWNER/NAME` atlas root, None for a local path.

    >>> hub_repo("hf://datasets/AbdomenAtlas/AbdomenAtlas3.0Mini")
    'AbdomenAtlas/AbdomenAtlas3.0Mini'
    """
    if not atlas_root.startswith(HUB_PREFIX):
        return None
    repo = atlas_root[len(HUB_PREFIX) :].strip("/")
    if repo.count("/") != 1 or "@" in repo:
        raise ValueError(f"{atlas_root!r}: expected hf://datasets/OWNER/NAME (the revision goes in --revision).")
    return repo


@dataclass(frozen=True)
class HubRelease:
    """One revision of the release: its commit, every file with size and sha256, the part pairs."""

    repo_id: str
    revision: str  # as asked (branch, tag or sha)
    sha: str  # the commit it resolved to
    endpoint: str
    files: dict[str, HubFile]
    pairs: tuple[PartPair, ...]
    warnings: tuple[str, ...]

    @property
    def source(self) -> str:
        """`hf://datasets/OWNER/NAME@SHA`: what the run read, pinned."""
        return f"{HUB_PREFIX}{self.repo_id}@{self.sha}"

    def url(self, path: str) -> str:
        """The download URL of a file of this commit."""
        return f"{self.endpoint.rstrip('/')}/datasets/{self.repo_id}/resolve/{self.sha}/{quote(path)}"


def resolve_release(repo_id: str, revision: str | None = None) -> HubRelease:
    """Resolve `revision` (default `main`) to its commit and list the files of that commit (no part is read).

    Raises:
        ValueError: the revision holds no released part.
        huggingface_hub errors: repository or revision not found, refused token.
    """
    api = HfApi()
    sha = api.dataset_info(repo_id, revision=revision).sha
    assert sha is not None  # the Hub always answers a sha
    files = {
        e.path: HubFile(e.path, e.size, e.lfs.sha256 if e.lfs is not None else None)
        for e in api.list_repo_tree(repo_id, recursive=True, revision=sha, repo_type="dataset")
        if isinstance(e, RepoFile)
    }
    pairs, warnings = pair_parts(files.values())
    if not pairs:
        raise ValueError(
            f"{HUB_PREFIX}{repo_id}@{sha[:12]} holds no image_only/AbdomenAtlas3_images_BDMAP_BDMAP_*.tar.gz or "
            "mask_only/AbdomenAtlas3_masks_BDMAP_BDMAP_*.tar.gz part"
        )
    return HubRelease(repo_id, revision or "main", sha, api.endpoint, files, tuple(pairs), tuple(warnings))


class _RangeIgnoredError(Exception):
    """The server answered a Range request with the whole file."""


class ChecksumMismatchError(Exception):
    """A downloaded file does not hash to the sha256 the Hub lists for it."""


@dataclass(frozen=True)
class Download:
    """One finished download: the file, bytes read over the network this time, where it resumed from, seconds."""

    path: Path
    bytes_read: int
    resumed_from: int
    seconds: float


def download_file(
    url: str, dest: Path, expected: HubFile, *, on_bytes: Callable[[int], None] | None = None
) -> Download:
    """Download `url` to `dest`, resuming a `dest.incomplete` left by an interrupted run; verify size and sha256.

    The bytes go to `dest.incomplete` (appended with an HTTP Range request when it exists) and are hashed as they
    arrive; the file is renamed to `dest` only when its size and sha256 (the LFS oid; size only for a non-LFS file)
    match the listing. At most `expected.size` bytes are ever read. A dropped connection is resumed up to
    `DOWNLOAD_ATTEMPTS` times.

    Raises:
        ChecksumMismatchError: the bytes do not match (`dest.incomplete` is removed, so the next try starts over).
        httpx / huggingface_hub errors: the server refused the file, or the connection failed every attempt.
    """
    partial = dest.with_name(dest.name + ".incomplete")
    dest.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    resumed_from = partial.stat().st_size if partial.exists() else 0
    if resumed_from > expected.size:
        partial.unlink()
        resumed_from = 0
    digest = hashlib.sha256()
    with partial.open("ab+") as fh:  # the bytes already there count in the hash (read back from disk)
        fh.seek(0)
        while chunk := fh.read(_CHUNK_BYTES):
            digest.update(chunk)
    read = 0
    for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
        try:
            read += _fetch_into(url, partial, expected.size, digest, on_bytes)
            break
        except _RangeIgnoredError:  # the server sent the whole file: start over
            partial.write_bytes(b"")
            digest = hashlib.sha256()
        except httpx.TransportError as err:
            if attempt == DOWNLOAD_ATTEMPTS:
                raise
            logger.warning("%s: %s; resuming (attempt %d of %d)", expected.path, err, attempt + 1, DOWNLOAD_ATTEMPTS)
    size = partial.stat().st_size
    if size != expected.size or (expected.sha256 is not None and digest.hexdigest() != expected.sha256):
        partial.unlink()
        got = f"sha256 {digest.hexdigest()}" if size == expected.size else f"{size} bytes"
        raise ChecksumMismatchError(
            f"{expected.path}: got {got}, the Hub lists {expected.size} bytes, sha256 {expected.sha256}"
        )
    partial.replace(dest)
    return Download(dest, read, resumed_from, time.perf_counter() - started)


def _fetch_into(url: str, partial: Path, size: int, digest: Any, on_bytes: Callable[[int], None] | None) -> int:
    """Append the missing bytes of `url` to `partial` (one HTTP request); return how many were read."""
    offset = partial.stat().st_size
    if offset >= size:
        return 0
    headers = build_hf_headers()
    if offset:
        headers["Range"] = f"bytes={offset}-"
    read = 0
    with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=60) as response:
        hf_raise_for_status(response)
        if offset and response.status_code != 206:
            raise _RangeIgnoredError
        with partial.open("ab") as fh:
            for chunk in response.iter_bytes(_CHUNK_BYTES):
                chunk = chunk[: size - offset - read]  # never more than the listing says
                fh.write(chunk)
                digest.update(chunk)
                read += len(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))
                if offset + read >= size:
                    break
    return read


def download_verified(
    release_url: str, dest: Path, expected: HubFile, *, on_bytes: Callable[[int], None] | None = None
) -> tuple[Download | None, int, str | None]:
    """`download_file`, and once more from scratch when the bytes fail verification.

    Returns:
        (the download or None, bytes read over both tries, the mismatch message when both failed).
    """
    read = 0
    for attempt in (1, 2):
        try:
            done = download_file(release_url, dest, expected, on_bytes=on_bytes)
            return done, read + done.bytes_read, None
        except ChecksumMismatchError as err:
            read += expected.size
            logger.warning("%s (try %d of 2)", err, attempt)
            message = str(err)
    return None, read, message


class PartLedger:
    """Which case-store entries each curated part pair produced, keyed by everything the cases depend on.

    One JSON file per key under `root`: written only once every case of the pair is in the case store, so a rerun
    whose key is here (same part checksums, config, splits and metadata) reads no byte of the part.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> dict[str, Any] | None:
        """The entry of `key`, or None (also for an entry that cannot be read: the part is then read again)."""
        path = self.root / f"{key}.json"
        try:
            entry: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            if path.exists():
                logger.warning("part ledger entry %s is unusable (%s): the part is read again", path.name, err)
            return None
        return entry

    def put(self, key: str, entry: dict[str, Any]) -> None:
        """Record an entry (atomically)."""
        write_json_atomic(entry, self.root / f"{key}.json")
