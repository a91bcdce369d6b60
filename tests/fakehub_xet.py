"""The fake Hub's Xet storage (test-only): LFS files stored as Xet files and served to the real hf_xet client over
HTTP, as the Xet protocol describes it.

A file is cut into chunks of `chunk_bytes` (fixed size here; the Hub cuts by content), the chunks packed in order into
xorbs of `chunks_per_xorb` chunks each, every chunk serialized with its 8-byte header (version 0, compressed length,
scheme 0 = none, uncompressed length; three little-endian bytes each). The CAS host answers:

- `GET /v1/reconstructions/{file_hash}` (with an optional `Range: bytes=a-b` of the file): the terms (xorb hash, chunk
  range, unpacked length) covering the range, `offset_into_first_range`, and per xorb the signed URL and byte range
  to fetch for each term (`fetch_info`); 416 past the end. `GET /v2/...` answers 404, so the client uses V1 (it falls
  back by itself, as it does against a CAS that predates V2).
- `GET /xorb/{xorb_hash}?expires=T&signature=S` with `Range`: the xorb's bytes; 403 once `T` has passed (the client
  then asks for the reconstruction again: fresh URLs).

Every CAS request needs `Authorization: Bearer <Xet token>`, a token the Hub's refresh route handed out (`issue`) and
not yet expired; xorb URLs carry their own signature instead (as presigned storage URLs do). hf_xet does not check
chunk hashes on download, so the hashes here are sha256 digests of the content, not Xet's Merkle hashes.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Any


CHUNK_HEADER_BYTES = 8


@dataclass(frozen=True)
class XorbTerm:
    """One term of a file's reconstruction: chunks `[chunk_start, chunk_end)` of xorb `xorb`."""

    xorb: str
    chunk_start: int
    chunk_end: int
    unpacked_bytes: int


@dataclass
class XetFile:
    """A file as Xet stores it: its hash, size and terms (one per xorb, in file order)."""

    file_hash: str
    size: int
    terms: list[XorbTerm]


@dataclass
class XetStore:
    """Xorbs (hash -> serialized chunks, byte offset of each chunk) and files (hash -> terms), and the Xet tokens."""

    chunk_bytes: int = 1 << 16
    chunks_per_xorb: int = 16
    url_ttl_s: float = 3600.0
    token_ttl_s: float = 3600.0
    xorbs: dict[str, bytes] = field(default_factory=dict)
    offsets: dict[str, list[int]] = field(default_factory=dict)  # xorb -> byte offset of each chunk, then the end
    files: dict[str, XetFile] = field(default_factory=dict)  # file hash -> file
    by_oid: dict[str, str] = field(default_factory=dict)  # LFS sha256 -> file hash
    tokens: dict[str, float] = field(default_factory=dict)  # Xet token -> expiry (unix seconds)

    def add(self, oid: str, data: bytes) -> XetFile:
        """Store `data` (the LFS object `oid`) as a Xet file, once."""
        if oid in self.by_oid:
            return self.files[self.by_oid[oid]]
        step = self.chunk_bytes * self.chunks_per_xorb
        terms = []
        for start in range(0, len(data), step):
            piece = data[start : start + step]
            serialized, offsets = bytearray(), []
            for i in range(0, len(piece), self.chunk_bytes):
                chunk = piece[i : i + self.chunk_bytes]
                offsets.append(len(serialized))
                n = len(chunk).to_bytes(3, "little")
                serialized += b"\x00" + n + b"\x00" + n + chunk
            offsets.append(len(serialized))
            xorb = hashlib.sha256(b"xorb\0" + bytes(serialized)).hexdigest()
            self.xorbs[xorb], self.offsets[xorb] = bytes(serialized), offsets
            terms.append(XorbTerm(xorb, 0, len(offsets) - 1, len(piece)))
        file_hash = hashlib.sha256(b"xet-file\0" + oid.encode()).hexdigest()
        self.files[file_hash] = XetFile(file_hash, len(data), terms)
        self.by_oid[oid] = file_hash
        return self.files[file_hash]

    def issue(self) -> tuple[str, float]:
        """A fresh Xet read token and its expiry."""
        token, expiry = f"xet_{secrets.token_hex(12)}", time.time() + self.token_ttl_s
        self.tokens[token] = expiry
        return token, expiry

    def token_ok(self, authorization: str) -> bool:
        """Whether `authorization` is `Bearer <a Xet token this store issued, not expired>`."""
        token = authorization[len("Bearer ") :] if authorization.startswith("Bearer ") else ""
        return self.tokens.get(token, 0.0) > time.time()

    def reconstruction(self, file_hash: str, first: int, last: int, base_url: str) -> dict[str, Any] | None:
        """The V1 reconstruction of bytes `[first, last]` of a file (None past its end): the terms whose chunks
        cover the range, cut to whole chunks, and one presigned xorb range per term."""
        xet = self.files[file_hash]
        last = min(last, xet.size - 1)
        if first > last:
            return None
        terms: list[dict[str, Any]] = []
        fetch: dict[str, list[dict[str, Any]]] = {}
        offset_into_first = 0
        position = 0  # file offset of the current term's first byte
        for term in xet.terms:
            term_end = position + term.unpacked_bytes
            if term_end <= first or position > last:
                position = term_end
                continue
            lo = max(first, position) - position
            hi = min(last + 1, term_end) - position
            c0, c1 = lo // self.chunk_bytes, (hi - 1) // self.chunk_bytes + 1
            if not terms:
                offset_into_first = lo - c0 * self.chunk_bytes
            unpacked = min(c1 * self.chunk_bytes, term.unpacked_bytes) - c0 * self.chunk_bytes
            terms.append({"hash": term.xorb, "unpacked_length": unpacked, "range": {"start": c0, "end": c1}})
            offsets = self.offsets[term.xorb]
            expires = int(time.time() + self.url_ttl_s)
            signature = hashlib.sha256(f"{term.xorb}/{expires}".encode()).hexdigest()[:16]
            fetch.setdefault(term.xorb, []).append(
                {
                    "range": {"start": c0, "end": c1},
                    "url": f"{base_url}/xorb/{term.xorb}?expires={expires}&signature={signature}",
                    "url_range": {"start": offsets[c0], "end": offsets[c1] - 1},
                }
            )
            position = term_end
        return {"offset_into_first_range": offset_into_first, "terms": terms, "fetch_info": fetch}

    def signed(self, xorb: str, expires: str, signature: str) -> bool:
        """Whether a xorb URL's signature is this store's and it has not expired."""
        good = hashlib.sha256(f"{xorb}/{expires}".encode()).hexdigest()[:16]
        return xorb in self.xorbs and signature == good and expires.isdigit() and int(expires) >= time.time()
