"""Header-bounded file reading: gzip as gzip means it, libdeflate speed, and per-thread reused decode buffers.

`read_payload` reads one (possibly gzip-compressed) file into a buffer whose size the caller derives from the
file's own header, parsed from the first (inflated) bytes before anything large is allocated:

- gzip streams of one or more members, each member's CRC32 and ISIZE verified by libdeflate during the inflate,
  trailing zero padding accepted (as `gzip -t` and nibabel accept it), anything else after the last member refused;
- memory bounded by the header: the compressed bytes held at once are bounded by the largest valid encoding of the
  header-implied size, the output buffer has exactly that size, and the inflate stops with `corrupt_gzip` the moment
  the stream would exceed it (a forged-ISIZE bomb never allocates more than the header claims);
- uncompressed files: the header is checked from the first 544 bytes, then exactly the implied bytes are read.

Speed: libdeflate (the pinned `deflate` wheel's bundled library, called through its exported C API with ctypes so
that it writes into our buffer and reports how many input bytes each member used) inflates 1.3-1.9x faster than
ISA-L here. Decode buffers come from a per-thread `BufferPool`: a buffer is handed out again only when nothing
else references it (CPython reference count), so arrays that are views over an earlier read (the CT's `ct_hu`, a
zero-copy mask) are never overwritten while alive, and no consumer has to release anything explicitly.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import threading
import zlib
from collections.abc import Callable
from io import BufferedReader
from pathlib import Path
from typing import Any

import deflate
import numpy as np
from isal import isal_zlib

from emrl_data.outcome import CaseDataError, RejectReason
from emrl_data.reading.fileio import check_unchanged, open_regular


GZIP_MAGIC = b"\x1f\x8b"
HEADER_PREFIX_BYTES = 544  # NIfTI-2 header (540) + the 4-byte extension flag
_GZIP_MIN_BYTES = 18  # 10-byte member header + 8-byte trailer (CRC32, ISIZE)
_PREFIX_MAX_COMPRESSED = 1 << 20  # a NIfTI header must appear within the first 1 MiB of compressed bytes
_MAX_DEFLATE_RATIO = 1032  # deflate's ceiling: a 258-byte match per 2 bits at best
_CHUNK_BYTES = 1 << 22  # reads of zero padding and of the header prefix go in 4 MiB chunks
_INFLATE_ERRORS: tuple[type[BaseException], ...] = (isal_zlib.error, zlib.error)  # type: ignore[assignment]
DEFAULT_POOL_MAX_BYTES = 768 << 20

# libdeflate_result
_LD_SUCCESS, _LD_BAD_DATA, _LD_SHORT_OUTPUT, _LD_INSUFFICIENT_SPACE = 0, 1, 2, 3


def _load_libdeflate() -> ctypes.CDLL:
    """Bind libdeflate's gzip decoder from the `deflate` wheel's extension module (it exports the C API)."""
    lib = ctypes.CDLL(deflate._deflate.__file__)
    lib.libdeflate_alloc_decompressor.restype = ctypes.c_void_p
    lib.libdeflate_alloc_decompressor.argtypes = []
    lib.libdeflate_free_decompressor.restype = None
    lib.libdeflate_free_decompressor.argtypes = [ctypes.c_void_p]
    size_p = ctypes.POINTER(ctypes.c_size_t)
    fn = lib.libdeflate_gzip_decompress_ex
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, size_p, size_p]
    return lib


_LIB = _load_libdeflate()


class _Decompressor:
    """One libdeflate decompressor (not thread-safe: one per thread), freed with its thread."""

    def __init__(self) -> None:
        self._free = _LIB.libdeflate_free_decompressor  # kept: module globals may be gone at interpreter exit
        self._ptr = _LIB.libdeflate_alloc_decompressor()
        if not self._ptr:
            raise MemoryError("libdeflate_alloc_decompressor failed")
        self._in_used = ctypes.c_size_t()
        self._out_used = ctypes.c_size_t()

    def member(self, src: np.ndarray, dst: np.ndarray) -> tuple[int, int, int]:
        """Inflate one gzip member from the start of `src` into the start of `dst`; CRC32 and ISIZE are checked.

        Returns:
            (libdeflate result code, input bytes used, output bytes written); the GIL is released meanwhile.
        """
        rc = _LIB.libdeflate_gzip_decompress_ex(
            self._ptr,
            src.ctypes.data,
            src.size,
            dst.ctypes.data if dst.size else None,
            dst.size,
            ctypes.byref(self._in_used),
            ctypes.byref(self._out_used),
        )
        return int(rc), int(self._in_used.value), int(self._out_used.value)

    def __del__(self) -> None:
        if getattr(self, "_ptr", None):
            self._free(self._ptr)
            self._ptr = None


class BufferPool:
    """Reusable uint8 decode buffers for one thread, in size classes (at most 12.5 % larger than asked).

    Ownership rule: a buffer is idle (reusable) exactly when the pool holds the only reference to it. `acquire`
    hands out a view whose `.base` is the pool buffer, and every array derived from it (numpy collapses `.base` to
    the owner) keeps that reference, so while any of them is alive the buffer is busy and another one is used: an
    array handed to a caller (the CT's `ct_hu`, a zero-copy mask) is never overwritten, and nobody has to release
    anything explicitly. Buffers beyond `max_bytes` in total are not kept, least recently used dropped first;
    `max_bytes=0` disables reuse (every read gets fresh memory).
    """

    def __init__(self, max_bytes: int = DEFAULT_POOL_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buffers: list[np.ndarray] = []  # most recently acquired last

    def acquire(self, nbytes: int) -> np.ndarray:
        """Return a writable 1-D uint8 array of exactly `nbytes` bytes that nothing else references."""
        cls = _size_class(nbytes)
        for i in range(len(self._buffers)):
            if self._buffers[i].size == cls and _refcount_at(self._buffers, i) <= _IDLE_REFS:
                self._buffers.append(self._buffers.pop(i))
                return self._buffers[-1][:nbytes]
        buf = np.empty(cls, dtype=np.uint8)
        if cls <= self.max_bytes:
            self._trim(self.max_bytes - cls)
            if self.retained_bytes() + cls <= self.max_bytes:
                self._buffers.append(buf)
        return buf[:nbytes]

    def retained_bytes(self) -> int:
        """Total size of the buffers the pool keeps (busy and idle)."""
        return sum(b.size for b in self._buffers)

    def clear(self) -> None:
        """Forget every buffer (busy ones stay alive through their views)."""
        self._buffers.clear()

    def trim(self, budget: int) -> None:
        """Forget buffers, least recently used and idle first, until the kept total fits `budget`."""
        self._trim(budget)

    def _trim(self, budget: int) -> None:
        for idle_only in (True, False):
            i = 0
            while self.retained_bytes() > budget and i < len(self._buffers):
                if idle_only and _refcount_at(self._buffers, i) > _IDLE_REFS:
                    i += 1
                    continue
                self._buffers.pop(i)


def _size_class(nbytes: int) -> int:
    """Round up to 8 steps per power of two (so a 300- and a 310-slice CT share a buffer)."""
    if nbytes <= 1 << 16:
        return max(nbytes, 1)
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


def _refcount_at(buffers: list[np.ndarray], i: int) -> int:
    """`sys.getrefcount` of `buffers[i]`, always measured through this same call path."""
    return sys.getrefcount(buffers[i])


_IDLE_REFS = _refcount_at([np.empty(1, dtype=np.uint8)], 0)  # only the list references it


_local = threading.local()
_pool_max_bytes = DEFAULT_POOL_MAX_BYTES


def configure_buffer_pool(max_bytes: int) -> None:
    """Set how many bytes of idle decode buffers each thread keeps (0 disables reuse); applies to new threads
    and to the calling thread's pool."""
    global _pool_max_bytes
    if max_bytes < 0:
        raise ValueError(f"max_bytes={max_bytes} must be >= 0.")
    _pool_max_bytes = max_bytes
    pool = getattr(_local, "pool", None)
    if pool is not None:
        pool.max_bytes = max_bytes
        pool.trim(max_bytes)


def thread_pool() -> BufferPool:
    """Return the calling thread's buffer pool (created on first use)."""
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = BufferPool(_pool_max_bytes)
    return pool


def release_thread_buffers() -> None:
    """Drop the calling thread's pooled buffers (e.g. when a worker finishes); arrays still alive keep theirs."""
    pool = getattr(_local, "pool", None)
    if pool is not None:
        pool.clear()


def _decompressor() -> _Decompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = _Decompressor()
    return dec


# --- reading --------------------------------------------------------------------------------------------------


def read_payload(
    path: Path, name: str, payload_size: Callable[[bytes], int], *, force_gzip: bool = False
) -> tuple[np.ndarray, str]:
    """Read a file into a pooled buffer of the size its header implies.

    Args:
        path: the file.
        name: how messages and `CaseDataError.path` call the file.
        payload_size: parses the header from the first (inflated) bytes and returns the total number of bytes the
            file must hold (header + voxels), raising `CaseDataError` to refuse it before anything is allocated.
        force_gzip: refuse bytes that are not gzip (a `.gz` name) with NOT_NIFTI.

    Returns:
        (1-D uint8 array of exactly `payload_size` bytes, a view over a pooled buffer; sha256 hex of the file).

    Raises:
        CaseDataError: CORRUPT_GZIP (bad stream, CRC/ISIZE mismatch, stream longer or shorter than the header says,
            garbage after the last member), ABSURD_SIZE (an uncompressed file of another size than its header
            implies), NOT_NIFTI (not gzip under a `.gz` name), or whatever `payload_size` raises.
        NotRegularFileError: `path` is a named pipe, socket, device or folder (refused before it is opened).
        FileChangedError: the file changed size or was rewritten while it was read (never a mix of two versions).
        OSError: the file cannot be opened or read.
    """
    with open_regular(path) as f:
        before = os.fstat(f.fileno())
        size = before.st_size  # no read goes past it
        head = f.read(min(size, _CHUNK_BYTES))
        if head[:2] != GZIP_MAGIC:
            if force_gzip:
                raise CaseDataError(RejectReason.NOT_NIFTI, f"{name}: not a gzip stream", path=name)
            read = _read_plain(f, head, size, name, payload_size)
        else:
            read = _read_gzip(f, head, size, name, payload_size)
        check_unchanged(f, before, path)
        return read


def _read_plain(
    f: BufferedReader, head: bytes, size: int, name: str, payload_size: Callable[[bytes], int]
) -> tuple[np.ndarray, str]:
    expected = payload_size(head[:HEADER_PREFIX_BYTES])
    if size != expected:
        what = "truncated" if size < expected else f"{size - expected} bytes after the image"
        raise CaseDataError(
            RejectReason.ABSURD_SIZE,
            f"{name}: file has {size} bytes, header implies {expected} ({what})",
            path=name,
        )
    out = thread_pool().acquire(expected)
    n = len(head)
    out[:n] = np.frombuffer(head, dtype=np.uint8)
    view = memoryview(out)  # type: ignore[arg-type]
    while n < expected:
        got = f.readinto(view[n:])
        if not got:
            raise CaseDataError(RejectReason.ABSURD_SIZE, f"{name}: file shrank while reading", path=name)
        n += got
    del view
    return out, hashlib.sha256(out).hexdigest()  # type: ignore[arg-type]


def _read_gzip(
    f: BufferedReader, head: bytes, size: int, name: str, payload_size: Callable[[bytes], int]
) -> tuple[np.ndarray, str]:
    if size < _GZIP_MIN_BYTES:
        raise CaseDataError(RejectReason.CORRUPT_GZIP, f"{name}: {size} bytes is too short for gzip", path=name)
    expected = payload_size(_inflate_prefix(head, name))
    if expected > _MAX_DEFLATE_RATIO * size + (1 << 20):
        raise CaseDataError(
            RejectReason.ABSURD_SIZE,
            f"{name}: header implies {expected} bytes, but {size} bytes of deflate can hold at most "
            f"{_MAX_DEFLATE_RATIO * size} (truncated file or forged header); refused before allocating",
            path=name,
        )
    # The largest valid encoding of `expected` bytes: stored blocks (5 bytes per 65535) plus member headers.
    bound = min(size, expected + expected // 8192 + (1 << 20))
    pool = thread_pool()
    src = pool.acquire(bound)
    n = len(head[:bound])
    src[:n] = np.frombuffer(head[:bound], dtype=np.uint8)
    view = memoryview(src)  # type: ignore[arg-type]
    while n < bound:
        got = f.readinto(view[n:])
        if not got:
            raise CaseDataError(RejectReason.CORRUPT_GZIP, f"{name}: file shrank while reading", path=name)
        n += got
    del view
    digest = hashlib.sha256(src)  # type: ignore[arg-type]
    out = pool.acquire(expected)
    _inflate_members(src, out, name, more_follows=size > bound)
    del src
    f.seek(bound)
    _check_zero_tail(f, size - bound, digest, name)
    return out, digest.hexdigest()


def _inflate_members(src: np.ndarray, out: np.ndarray, name: str, *, more_follows: bool) -> int:
    """Inflate every gzip member of `src` into `out` (which it must fill exactly); return input bytes used.

    After the last member only zero bytes may follow (gzip's padding rule); `more_follows` says the file goes on
    past `src` (whose end is then no member boundary).
    """
    dec = _decompressor()
    pos_in = pos_out = 0
    members = 0
    while True:
        rc, used_in, used_out = dec.member(src[pos_in:], out[pos_out:])
        members += 1
        if rc == _LD_INSUFFICIENT_SPACE:
            raise CaseDataError(
                RejectReason.CORRUPT_GZIP,
                f"{name}: gzip stream inflates to more than the header's {out.size} bytes (member {members}); "
                "refused before allocating more",
                path=name,
            )
        if rc != _LD_SUCCESS:
            cut = " (the compressed stream is longer than any valid encoding of the header's size)"
            raise CaseDataError(
                RejectReason.CORRUPT_GZIP,
                f"{name}: gzip member {members} is corrupt or truncated (bad data, CRC32 or ISIZE mismatch)"
                + (cut if more_follows else ""),
                path=name,
            )
        pos_in += used_in
        pos_out += used_out
        rest = src[pos_in:]
        if rest.size >= 2 and rest[0] == 0x1F and rest[1] == 0x8B:
            continue  # another member (it may add 0 bytes; more than the header allows is refused above)
        if rest.any():
            raise CaseDataError(
                RejectReason.CORRUPT_GZIP,
                f"{name}: {rest.size} bytes after gzip member {members} are neither a gzip member nor zero padding",
                path=name,
            )
        break
    if pos_out != out.size:
        raise CaseDataError(
            RejectReason.CORRUPT_GZIP,
            f"{name}: gzip stream ({members} member(s)) inflates to {pos_out} bytes, header needs {out.size}; "
            "truncated or corrupt",
            path=name,
        )
    return pos_in


def _check_zero_tail(f: BufferedReader, nbytes: int, digest: Any, name: str) -> None:
    """Read the rest of the file in chunks (bounded memory); it must be zero padding."""
    left = nbytes
    chunk = thread_pool().acquire(min(_CHUNK_BYTES, nbytes)) if nbytes else None
    while left > 0 and chunk is not None:
        got = f.readinto(memoryview(chunk)[: min(left, chunk.size)])  # type: ignore[arg-type]
        if not got:
            break
        part = chunk[:got]
        digest.update(part)
        if part.any():
            raise CaseDataError(
                RejectReason.CORRUPT_GZIP,
                f"{name}: non-zero bytes after the gzip stream (at byte {nbytes - left} of the {nbytes}-byte tail)",
                path=name,
            )
        left -= got


def _inflate_prefix(head: bytes, name: str) -> bytes:
    """Inflate only the first bytes of a gzip stream (enough for a NIfTI-2 header), across member boundaries."""
    out = bytearray()
    data = memoryview(head)[:_PREFIX_MAX_COMPRESSED]
    try:
        while len(out) < HEADER_PREFIX_BYTES and len(data) >= 2 and bytes(data[:2]) == GZIP_MAGIC:
            dec = isal_zlib.decompressobj(wbits=31)
            pos = 0
            while len(out) < HEADER_PREFIX_BYTES and not dec.eof:
                chunk = dec.unconsumed_tail or data[pos : pos + 4096]
                if not dec.unconsumed_tail:
                    pos += 4096
                if not len(chunk):
                    break
                out += dec.decompress(chunk, HEADER_PREFIX_BYTES - len(out))
            if not dec.eof:
                break
            data = memoryview(dec.unused_data + bytes(data[pos:]))
    except _INFLATE_ERRORS as err:
        raise CaseDataError(RejectReason.CORRUPT_GZIP, f"{name}: gzip stream is corrupt: {err}", path=name) from err
    return bytes(out)
