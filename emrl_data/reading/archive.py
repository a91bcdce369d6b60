"""Reading one released part (`tar.gz`) safely: member by member, into a scratch folder, within a byte allowance.

Only the stdlib `tarfile` in stream mode (`r|gz`: one pass, no seek) is used, and no member is ever extracted by
`tarfile` itself: each member is checked, then its bytes are copied to a path built here from validated names
(`<dest>/image_only/<case>/ct.nii.gz`, `<dest>/mask_only/<case>/segmentations/<name>`), so nothing is written
outside `dest` whatever the archive says. What is refused, and how it is reported:

| member | outcome |
|---|---|
| a path with `..`, an absolute path, a symlink, a hard link, a device, a FIFO, a sparse file | `unsafe_archive_member` rejection of its case (a warning when it names no case of the part) |
| the same path twice, or two names that differ only in case | `unsafe_archive_member` rejection of its case |
| a size larger than the scratch allowance left | `unsafe_archive_member` rejection of its case; its bytes are skipped, never read into memory |
| a file that cannot be written (any `OSError` but a full disk) | `unsafe_archive_member` rejection of its case |
| a second CT of a case (`ct.nii` beside `ct.nii.gz`) | `duplicate_ct` rejection of the case |
| data longer than its header claims, a truncated tar or gzip stream, a bad header or a negative size | `corrupt_archive`: the case being read and every case of the part not finished yet |
| a case outside the part's range, an entry outside the case layout, a non-case folder | a warning (counted per kind), skipped |
| a mask name over `MAX_NAME_BYTES` or with characters outside `[A-Za-z0-9._-]` | a warning, skipped (checked before any write) |
| a case folder whose name is not `BDMAP_` + 8 digits | `invalid_case_id`, as on disk |

Header blocks are bounded too: a pax or GNU long-name header over `MAX_HEADER_BYTES`, a chain of more than
`MAX_HEADER_CHAIN` extended headers, more than `max_members` members, or a member whose declared size would take the
bytes inflated past `MAX_MEMBER_BYTES` or the part's `max_inflated_bytes` (skipped members count: skipping one
inflates it) is `corrupt_archive`; the member list `tarfile` keeps is cleared as it goes (memory stays flat).
"""

from __future__ import annotations

import errno
import os
import re
import tarfile
import threading
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading.atlas import NIFTI_SUFFIXES, SPLIT_LAYOUT_DIRS
from emrl_data.types import is_valid_case_id


MAX_HEADER_BYTES = 1 << 20  # a pax / GNU long-name header longer than this is refused (real ones are < 1 KiB)
MEMBERS_PER_CASE = 500  # the released mask parts hold ~50 files per case
MAX_HEADER_CHAIN = 16  # extended headers in a row before a member (real archives: 1 or 2)
MAX_MEMBER_BYTES = 16 << 30  # a member larger than this is never inflated (a released CT is < 1 GiB)
INFLATE_RATIO = 16  # a part's members may declare at most this x its compressed bytes (+ INFLATE_SLACK_BYTES)
INFLATE_SLACK_BYTES = 64 << 20
MAX_NAME_BYTES = 128  # a mask file name longer than this (UTF-8) is skipped, never created
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
_COPY_BYTES = 1 << 20
_TRAILER_BYTES = 1 << 20  # at most this much is read after the end-of-archive marker (tar pads to 10 KiB records)
IMAGE_KIND, MASK_KIND = SPLIT_LAYOUT_DIRS
CT_NAMES = tuple(f"ct{s}" for s in NIFTI_SUFFIXES)


class ScratchFullError(Exception):
    """Writing would take the scratch folder past its allowance."""


class ArchiveCorruptError(Exception):
    """The tar stream cannot be read on (bad or truncated header, truncated or corrupt gzip, data past a member)."""


class ScratchMeter:
    """The bytes a part holds in its scratch folder (downloads and unpacked members), against an allowance.

    Callers reserve before they write and release after they delete; `peak_bytes` is the most held at once.
    """

    def __init__(self, allowance_bytes: int) -> None:
        self.allowance_bytes = allowance_bytes
        self.used_bytes = 0
        self.peak_bytes = 0

    @property
    def free_bytes(self) -> int:
        """Bytes that may still be written."""
        return self.allowance_bytes - self.used_bytes

    def reserve(self, n: int, what: str) -> None:
        """Count `n` more bytes held; raise `ScratchFullError` (holding nothing more) when they do not fit."""
        if n > self.free_bytes:
            raise ScratchFullError(
                f"{what} needs {n} bytes of scratch, {self.free_bytes} of the allowance of {self.allowance_bytes} left"
            )
        self.used_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def release(self, n: int) -> None:
        """Count `n` bytes fewer held (after a delete)."""
        self.used_bytes = max(0, self.used_bytes - n)


@dataclass
class PartReading:
    """What reading one part found: cases with files, case-level rejections, warnings and a stream break."""

    archive: str  # the part's path in the release, for messages and rejection paths
    cases: list[str] = field(default_factory=list)  # cases with at least one file unpacked, in archive order
    rejected: dict[str, Rejection] = field(default_factory=dict)  # case id -> why the archive rules it out
    skipped: Counter[str] = field(default_factory=Counter)  # warning kind -> members skipped
    examples: dict[str, str] = field(default_factory=dict)  # warning kind -> the first member of that kind
    broken: str | None = None  # why the stream stopped early, None when it was read to its end

    def reject(self, case_id: str, reason: RejectReason, detail: str, member: str | None = None) -> None:
        """Rule a case out (the first reason found stands)."""
        path = f"{self.archive}:{member}" if member else self.archive
        self.rejected.setdefault(case_id, Rejection(case_id, None, "archive", reason, detail, path))

    def skip(self, kind: str, member: str) -> None:
        """Count a member skipped with a warning of `kind`."""
        self.skipped[kind] += 1
        self.examples.setdefault(kind, member)

    def warnings(self) -> list[str]:
        """One line per kind of skipped member, then the stream break."""
        lines = [
            f"{self.archive}: {n} member{'s' if n > 1 else ''} skipped, {kind} (first: {self.examples[kind]!r})"
            for kind, n in sorted(self.skipped.items())
        ]
        return lines + ([f"{self.archive}: {self.broken}"] if self.broken else [])


class _BoundedTarInfo(tarfile.TarInfo):
    """A `TarInfo` whose header reading refuses huge pax/long-name headers and never ends an archive silently.

    Stock `tarfile` treats a bad, truncated or missing header after the first as the end of the archive; here each
    is an `ArchiveCorruptError`, so data longer than its header claims or a cut-off tar is seen.
    """

    _chain = threading.local()  # extended headers read in a row on this thread (tarfile recurses through them)

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> Any:  # noqa: D102 (tarfile's API)
        depth = getattr(cls._chain, "depth", 0)
        if depth > MAX_HEADER_CHAIN:
            raise ArchiveCorruptError(f"more than {MAX_HEADER_CHAIN} extended headers in a row")
        cls._chain.depth = depth + 1
        try:
            return cls._read_header(tarfile_)
        finally:
            cls._chain.depth = depth

    @classmethod
    def _read_header(cls, tarfile_: tarfile.TarFile) -> Any:
        buf = tarfile_.fileobj.read(tarfile.BLOCKSIZE)  # type: ignore[union-attr]
        try:
            obj = cls.frombuf(buf, tarfile_.encoding, tarfile_.errors)  # type: ignore[arg-type]
        except tarfile.EOFHeaderError:  # type: ignore[attr-defined]
            raise
        except tarfile.HeaderError as err:
            raise ArchiveCorruptError(f"no valid tar header where one belongs ({err})") from None
        obj.offset = tarfile_.fileobj.tell() - tarfile.BLOCKSIZE  # type: ignore[union-attr]
        header_types = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE)
        if obj.type in (*header_types, tarfile.SOLARIS_XHDTYPE) and obj.size > MAX_HEADER_BYTES:
            raise ArchiveCorruptError(f"a {obj.size}-byte extended header (more than {MAX_HEADER_BYTES})")
        return obj._proc_member(tarfile_)  # type: ignore[attr-defined,no-any-return]


def _member_path(name: str, kind: str) -> list[str] | None:
    """The member's path components without `./` and the optional leading `image_only/`/`mask_only/`; None when
    the path is absolute or climbs (`..`) and so can never be unpacked."""
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return None
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        return None
    if parts and parts[0] == kind:
        parts = parts[1:]
    return parts


def _layout_target(parts: list[str], kind: str) -> str | None:
    """The file of the case layout a member is (`ct.nii.gz`, `segmentations/liver.nii.gz`), or None."""
    if kind == IMAGE_KIND and len(parts) == 2 and parts[1] in CT_NAMES:
        return parts[1]
    if kind == MASK_KIND and len(parts) == 3 and parts[1] == "segmentations":
        return f"segmentations/{parts[2]}"
    return None


def _bad_name(target: str) -> bool:
    """A layout file name that is too long or holds characters no released name has (checked before any write)."""
    name = target.rsplit("/", 1)[-1]
    return len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES or _SAFE_NAME.fullmatch(name) is None


def _unsafe_kind(info: tarfile.TarInfo) -> str | None:
    """What makes a member unsafe to unpack as a file, or None for a plain regular file."""
    if info.issym():
        return f"a symlink to {info.linkname!r}"
    if info.islnk():
        return f"a hard link to {info.linkname!r}"
    if info.ischr() or info.isblk():
        return "a device"
    if info.isfifo():
        return "a FIFO"
    if info.issparse():
        return "a sparse file"
    if not info.isreg():
        return f"a member of tar type {info.type!r}"
    return None


def read_part(
    archive: IO[bytes],
    *,
    name: str,
    kind: str,
    dest: Path,
    case_range: tuple[int, int],
    meter: ScratchMeter,
    on_file: Callable[[str, Path], None] | None = None,
    max_members: int | None = None,
    max_inflated_bytes: int | None = None,
    reading: PartReading | None = None,
) -> PartReading:
    """Unpack the case-layout members of one part into `dest/<kind>/<case>/...`, calling `on_file` after each.

    Args:
        archive: the part's bytes (a `tar.gz` stream, read once from its start).
        name: the part's path in the release (messages, rejection paths).
        kind: `image_only` or `mask_only`: which layout the members must follow.
        dest: the scratch folder of the part pair (the atlas root its cases are curated from).
        case_range: the part's `(start, end)` case numbers, inclusive.
        meter: the scratch allowance; each member's header size is reserved before it is written.
        on_file: called with `(case_id, path)` once a member's bytes are all on disk (image parts: the CT is in,
            the case can be curated); the callee may delete the file and release its bytes.
        max_members: members read at most (default: `MEMBERS_PER_CASE` per case of the range, plus 1000).
        max_inflated_bytes: bytes the members may declare in all (default: `INFLATE_RATIO` x the archive's size on
            disk + `INFLATE_SLACK_BYTES`; `MAX_MEMBER_BYTES` per member when the size is unknown).
        reading: the record to fill (so that `on_file` sees the rejections found so far); default a new one.

    Returns:
        What was found; a stream that breaks is recorded in `broken` (and the case being read is rejected), never
        raised.
    """
    reading = reading if reading is not None else PartReading(name)
    limit = max_members or MEMBERS_PER_CASE * (case_range[1] - case_range[0] + 1) + 1000
    inflate_left = max_inflated_bytes if max_inflated_bytes is not None else _inflate_cap(archive)
    written: dict[str, str] = {}  # case-folded path -> the path written (names that differ only in case collide)
    current: str | None = None  # the case whose member is being read
    try:
        with tarfile.open(fileobj=archive, mode="r|gz", tarinfo=_BoundedTarInfo) as tar:
            for count, info in enumerate(tar, start=1):
                tar.members.clear()  # type: ignore[attr-defined]  # stream mode keeps every TarInfo otherwise
                if count > limit:
                    raise ArchiveCorruptError(f"more than {limit} members")
                if info.size < 0:
                    raise ArchiveCorruptError(f"{info.name[:200]!r} declares a negative size ({info.size})")
                if info.size > min(inflate_left, MAX_MEMBER_BYTES):  # reading on would inflate it, even to skip
                    raise ArchiveCorruptError(
                        f"{info.name[:200]!r} declares {info.size} bytes, more than the {min(inflate_left, MAX_MEMBER_BYTES)} "
                        "the part may still inflate"
                    )
                inflate_left -= info.size
                current = None
                found = _check_member(info, kind, case_range, reading, written)
                if found is None:
                    continue
                current, target = found
                path = dest / kind / current / target
                if _unpack(tar, info, path, meter, reading, current):
                    written[f"{current}/{target}".casefold()] = f"{current}/{target}"
                    if current not in reading.cases:
                        reading.cases.append(current)
                    if on_file is not None:
                        on_file(current, path)
                current = None
            _check_trailer(tar)
    except (ArchiveCorruptError, tarfile.TarError, EOFError, zlib.error, OSError, RecursionError, UnicodeError) as err:
        if isinstance(err, OSError) and not _is_stream_error(err):
            raise
        reading.broken = f"the archive cannot be read on ({err}); unfinished cases are corrupt_archive rejections"
        if current is not None:
            reading.reject(current, RejectReason.CORRUPT_ARCHIVE, f"{name} broke while this case was read: {err}")
    return reading


def _inflate_cap(archive: IO[bytes]) -> int:
    """`INFLATE_RATIO` x the archive's bytes on disk + `INFLATE_SLACK_BYTES`, or `MAX_MEMBER_BYTES` x 1024 when its
    size is unknown (a stream)."""
    try:
        return INFLATE_RATIO * os.fstat(archive.fileno()).st_size + INFLATE_SLACK_BYTES
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both an OSError and a ValueError
        return MAX_MEMBER_BYTES * 1024


def _is_stream_error(err: OSError) -> bool:
    """gzip's `BadGzipFile` and tarfile's stream errors are OSErrors; a disk error is not a stream error."""
    return type(err).__name__ in ("BadGzipFile", "StreamError", "CompressionError") or err.errno is None


def _check_member(
    info: tarfile.TarInfo, kind: str, case_range: tuple[int, int], reading: PartReading, written: dict[str, str]
) -> tuple[str, str] | None:
    """`(case id, layout file)` a member unpacks to, or None after recording why it is skipped or rejects its case."""
    parts = _member_path(info.name, kind)
    named = [p for p in info.name.replace("\\", "/").split("/") if p not in ("", ".", kind)]
    first = parts[0] if parts else named[0] if parts is None and named else ""  # an unsafe path still names its case
    in_range = is_valid_case_id(first) and case_range[0] <= int(first[6:]) <= case_range[1]
    unsafe = "an absolute or climbing (..) path" if parts is None else None if info.isdir() else _unsafe_kind(info)
    if unsafe is not None:
        if in_range:
            reading.reject(first, RejectReason.UNSAFE_ARCHIVE_MEMBER, f"{info.name!r} is {unsafe}; refused", info.name)
        else:
            reading.skip(f"unsafe ({unsafe.split(' to ')[0]})", info.name)
        return None
    if info.isdir() or not parts:
        return None
    if first[:5].upper() != "BDMAP":
        reading.skip("not a case folder (name does not start with BDMAP)", info.name)
        return None
    if not is_valid_case_id(first):
        hint = f" (did you mean {first.upper()!r}?)" if is_valid_case_id(first.upper()) else ""
        detail = f"folder {f'{kind}/{first}'!r} is not BDMAP_ followed by 8 digits{hint}"
        reading.rejected.setdefault(
            first, Rejection(first, None, "discover", RejectReason.INVALID_CASE_ID, detail, f"{kind}/{first}")
        )
        return None
    if not in_range:
        reading.skip(
            f"a case outside the part's range BDMAP_{case_range[0]:08d}..BDMAP_{case_range[1]:08d}", info.name
        )
        return None
    target = _layout_target(parts, kind)
    if target is None:
        reading.skip("outside the case layout", info.name)
        return None
    if _bad_name(target):
        reading.skip(f"a name over {MAX_NAME_BYTES} bytes or with characters outside [A-Za-z0-9._-]", info.name[:300])
        return None
    seen = written.get(f"{first}/{target}".casefold())
    if seen is not None:
        twice = "appears twice in the part" if seen == f"{first}/{target}" else f"differs from {seen!r} only in case"
        reading.reject(first, RejectReason.UNSAFE_ARCHIVE_MEMBER, f"{info.name!r} {twice}", info.name)
        return None
    if target in CT_NAMES and any(f"{first}/{ct}".casefold() in written for ct in CT_NAMES):
        detail = f"{info.name!r} is a second CT of the case; which one is the case's is unknown"
        reading.reject(first, RejectReason.DUPLICATE_CT, detail, info.name)
        return None
    return None if first in reading.rejected else (first, target)


def _unpack(
    tar: tarfile.TarFile, info: tarfile.TarInfo, path: Path, meter: ScratchMeter, reading: PartReading, case_id: str
) -> bool:
    """Copy one checked member to `path` (exactly its header size); False when its size does not fit the allowance."""
    try:
        meter.reserve(info.size, f"{info.name!r}")
    except ScratchFullError as err:
        reading.reject(case_id, RejectReason.UNSAFE_ARCHIVE_MEMBER, f"{err}; refused", info.name)
        return False
    source = tar.extractfile(info)
    assert source is not None  # a regular file
    left = info.size
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        out = os.fdopen(os.open(path, flags, 0o644), "wb")
    except OSError as err:
        return _unwritable(path, info, reading, case_id, meter, err, created=False)
    with out:
        while left > 0:
            chunk = source.read(min(_COPY_BYTES, left))
            if not chunk:
                raise ArchiveCorruptError(f"{info.name!r} ends before the {info.size} bytes its header claims")
            try:
                out.write(chunk)
            except OSError as err:
                return _unwritable(path, info, reading, case_id, meter, err, created=True)
            left -= len(chunk)
    return True


def _unwritable(
    path: Path,
    info: tarfile.TarInfo,
    reading: PartReading,
    case_id: str,
    meter: ScratchMeter,
    err: OSError,
    *,
    created: bool,
) -> bool:
    """A member that cannot be written rejects its case (its bytes are skipped by the stream); a full disk is raised."""
    if err.errno in _FULL_DISK:
        raise err
    if created:
        path.unlink(missing_ok=True)
    meter.release(info.size)
    detail = f"{info.name[:300]!r} cannot be written ({os.strerror(err.errno) if err.errno else err}); refused"
    reading.reject(case_id, RejectReason.UNSAFE_ARCHIVE_MEMBER, detail, info.name[:300])
    return False


def _check_trailer(tar: tarfile.TarFile) -> None:
    """After the end-of-archive marker only zero padding may follow, then the gzip end (its CRC checked)."""
    stream: Any = tar.fileobj
    seen = 0
    while chunk := stream.read(64 << 10):
        seen += len(chunk)
        if chunk.count(0) != len(chunk):
            raise ArchiveCorruptError("data after the end-of-archive marker")
        if seen > _TRAILER_BYTES:
            raise ArchiveCorruptError(f"more than {_TRAILER_BYTES} bytes after the end-of-archive marker")


def finish_broken(reading: PartReading, open_cases: list[str], finished: set[str]) -> None:
    """After a break, reject every case known to the part pair that was not finished as `corrupt_archive`."""
    if reading.broken is None:
        return
    for case_id in open_cases:
        if case_id not in finished:
            reading.reject(case_id, RejectReason.CORRUPT_ARCHIVE, f"{reading.archive} broke before this case was read")
