"""File checksums and the per-case cache key: a real checksum of each file a row reads, never of files it does not.

`case_cache_key` changes when any file a row reads, the config, the split or the code version changes; it names a
case's entry in the case store (`emrl_data.labeling.case_store`). `file_checksum` opens only regular files.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import zlib
from pathlib import Path

import xxhash

from emrl_data import __version__
from emrl_data.config import CurateConfig
from emrl_data.reading.atlas import USED_STRUCTURES, CaseRef, structure_of
from emrl_data.reading.fileio import FileChangedError, NotRegularFileError, check_unchanged, open_regular


def case_cache_key(ref: CaseRef, cfg: CurateConfig, split: str, metadata_key: str = "") -> str:
    """Return a key that changes when any file a row reads, the config, the split or the code version changes.

    Per file a row may read (the CT and every mask-folder file of a structure in `USED_STRUCTURES`, or the case's label
    map) a real checksum
    of its content (`file_checksum`); every other entry of the mask folder enters by its name alone and is never
    opened (a stray huge file or a named pipe costs nothing; its name stays in the key because the rows' warnings
    name lesion-like files no rule reads). Paths do not enter the key, so a moved atlas reuses its cache. Never
    raises for a file problem: an unreadable file, a special file (named pipe, device) or a folder enters the key as
    its error, so the case is curated (and rejected as `unreadable_file`) and is curated again once it is fixed.
    """
    digest = hashlib.sha256()
    digest.update(f"{__version__}|{cfg.fingerprint()}|{ref.case_id}|{split}|{metadata_key}".encode())
    entries: list[tuple[str, Path | None]] = [("ct", ref.ct_path)]
    if ref.labels is not None:  # a label map is every mask of its case; its folder holds other cases' files
        entries.append((f"labels {ref.labels.table.describe()}", ref.labels.path))
    try:
        names = [] if ref.labels is not None else sorted(os.listdir(ref.mask_dir))
    except (FileNotFoundError, NotADirectoryError):
        names = []
    except OSError as err:
        names = []
        digest.update(f"|segmentations/|error {err.errno}".encode())
    entries += [(name, ref.mask_dir / name if structure_of(name) in USED_STRUCTURES else None) for name in names]
    for rel, path in entries:
        if path is None:
            fingerprint = "name only"
        else:
            try:
                fingerprint = file_checksum(path) if os.path.lexists(path) else "absent"
            except NotRegularFileError as err:
                fingerprint = f"not a regular file: {err.kind}"
            except OSError as err:
                fingerprint = f"error {err.errno}"
        digest.update(f"|{rel}|{fingerprint}".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:32]


_HEAD_BYTES = 65536
_CHUNK_BYTES = 1 << 20


def file_checksum(path: Path) -> str:
    """Return a checksum of a file's content: `gz:`-prefixed for a trusted gzip trailer, else `xxh3:` of every byte.

    A gzip file's trailer (CRC32 and ISIZE of its payload) is a checksum of the payload when the file is ONE gzip
    member: the loader verifies that CRC while inflating, so the trailer cannot disagree with what is read. It is
    used (with the size and the sha256 of the first 64 KiB) only when ISIZE equals the payload size the NIfTI header
    in the first bytes implies; a multi-member stream, trailing padding or any other doubt falls back to xxh3-128 of
    the whole file, as does every uncompressed file.

    Only a regular file is opened (`open_regular`), and never more than the size `stat` reported at the start is read.

    Raises:
        NotRegularFileError: a named pipe, socket, device or folder (never opened, never read).
        FileChangedError: the file changed size or was rewritten while it was read.
        OSError: the file cannot be read.
    """
    with open_regular(path) as fh:
        before = os.fstat(fh.fileno())
        size = before.st_size
        head = fh.read(min(_HEAD_BYTES, size))
        if head[:2] == b"\x1f\x8b" and size >= 18:
            fh.seek(size - 8)
            tail = fh.read(8)
            expected = _nifti_payload_size(head)
            if len(tail) == 8 and expected is not None and struct.unpack("<I", tail[4:])[0] == expected % 2**32:
                check_unchanged(fh, before, path)
                return f"gz:{size}:{hashlib.sha256(head).hexdigest()}:{tail.hex()}"
        fh.seek(0)
        hasher = xxhash.xxh3_128()
        left = size
        while left > 0 and (chunk := fh.read(min(_CHUNK_BYTES, left))):
            hasher.update(chunk)
            left -= len(chunk)
        if left:
            raise FileChangedError(path, f"{size} bytes at the start, {size - left} could be read")
        check_unchanged(fh, before, path)
    return f"xxh3:{size}:{hasher.hexdigest()}"


def _nifti_payload_size(head: bytes) -> int | None:
    """The uncompressed size (vox_offset + voxel bytes) the NIfTI-1/2 header in a gzip head implies; None if unsure."""
    try:
        header = zlib.decompressobj(wbits=31).decompress(head, 544)
    except zlib.error:
        return None
    for endian in "<>":
        if len(header) >= 348 and struct.unpack(f"{endian}i", header[:4])[0] == 348:
            dims = struct.unpack(f"{endian}8h", header[40:56])
            bitpix, vox_offset = (
                struct.unpack(f"{endian}h", header[72:74])[0],
                struct.unpack(f"{endian}f", header[108:112])[0],
            )
        elif len(header) >= 540 and struct.unpack(f"{endian}i", header[:4])[0] == 540:
            dims = struct.unpack(f"{endian}8q", header[16:80])
            bitpix, vox_offset = (
                struct.unpack(f"{endian}h", header[14:16])[0],
                struct.unpack(f"{endian}q", header[168:176])[0],
            )
        else:
            continue
        ndim = dims[0]
        if not 1 <= ndim <= 7 or bitpix <= 0 or bitpix % 8 or not math.isfinite(vox_offset) or vox_offset < 0:
            return None
        if any(d <= 0 for d in dims[1 : ndim + 1]):
            return None
        return int(vox_offset) + math.prod(dims[1 : ndim + 1]) * bitpix // 8
    return None
