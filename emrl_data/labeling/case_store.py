"""The per-case work store: finished cases on disk, one entry per content key, what makes runs resumable.

Entries are an Arrow IPC frames file and a JSON file with a checksum (never pickle), both written through
`emrl_data.atomic_write`; a missing, truncated or tampered entry is "not there" and the case is curated again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from emrl_data.atomic_write import write_bytes_atomic
from emrl_data.labeling.curate import CaseResult
from emrl_data.labeling.fingerprint import CtFingerprint
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading.fileio import NotRegularFileError, read_regular_bytes


logger = logging.getLogger(__name__)


STORE_FORMAT = 1


class CaseStore:
    """Finished cases on disk, one entry per content key; a format that cannot run code.

    `<key>.frames.arrow` (Arrow IPC: organ, index, PNG bytes, path per frame) is written first, then
    `<key>.case.json` (rows without frames, rejections, digests, the sha256 of the frames file, and the sha256 of its
    own payload), which marks completion. Both are written atomically. An entry that is missing, truncated, empty or
    fails a checksum is "not there" (`load_rows` returns None, with a warning), so the case is curated again.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _json(self, key: str) -> Path:
        return self.root / f"{key}.case.json"

    def _arrow(self, key: str) -> Path:
        return self.root / f"{key}.frames.arrow"

    def has(self, key: str) -> bool:
        """True when the case with this key is finished and its entry passes its checksums."""
        return self.load_rows(key) is not None

    def save(self, key: str, result: CaseResult) -> None:
        """Store a finished case (frames first, so the JSON file marks completion)."""
        frames = pa.table(
            {
                "organ": pa.array([row["organ"] for row in result.rows for _ in row["frames"]], pa.string()),
                "bytes": pa.array([f["bytes"] for row in result.rows for f in row["frames"]], pa.binary()),
                "path": pa.array([f["path"] for row in result.rows for f in row["frames"]], pa.string()),
            }
        )
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, frames.schema) as writer:
            writer.write_table(frames)
        arrow_bytes = sink.getvalue().to_pybytes()
        payload = {
            "format": STORE_FORMAT,
            "case_id": result.case_id,
            "rows": [
                {**{k: v for k, v in row.items() if k != "frames"}, "frames_bytes": _frame_bytes(row)}
                for row in result.rows
            ],
            "rejections": [r.to_row() for r in result.rejections],
            "file_digests": dict(result.file_digests),
            "frames_sha256": hashlib.sha256(arrow_bytes).hexdigest(),
        }
        if result.warnings:  # only then: entries of cases without special files stay as they were
            payload["warnings"] = list(result.warnings)
        if result.fingerprint is not None:
            payload["fingerprint"] = result.fingerprint.to_dict()
        body = json.dumps(payload, sort_keys=True, allow_nan=True, default=_json_scalar)
        document = json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "payload": body})
        _write_atomic(arrow_bytes, self._arrow(key))
        _write_atomic(document.encode(), self._json(key))

    def load_rows(self, key: str) -> CaseResult | None:
        """Return the case without frames (each row has `frames_bytes`), or None when the entry is absent or broken."""
        found = self._payload(key)
        if found is None:
            return None
        payload = found[0]
        rejections = [
            Rejection(r["case_id"], r["organ"], r["step"], RejectReason(r["reason"]), r["detail"], r["path"])
            for r in payload["rejections"]
        ]
        return CaseResult(
            payload["case_id"],
            list(payload["rows"]),
            rejections,
            dict(payload["file_digests"]),
            list(payload.get("warnings", [])),
            CtFingerprint.from_dict(payload["fingerprint"]) if "fingerprint" in payload else None,
        )

    def add_fingerprint(self, key: str, fingerprint: CtFingerprint) -> bool:
        """Add the CT's fingerprint to an entry stored without one (rows and frames unchanged); False: no entry."""
        found = self._payload(key)
        if found is None:
            return False
        payload = {**found[0], "fingerprint": fingerprint.to_dict()}
        body = json.dumps(payload, sort_keys=True, allow_nan=True, default=_json_scalar)
        document = json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "payload": body})
        _write_atomic(document.encode(), self._json(key))
        return True

    def _payload(self, key: str) -> tuple[dict[str, Any], bytes] | None:
        path = self._json(key)
        if not path.is_file():
            return None
        try:
            document = json.loads(_read_bounded(path, _MAX_JSON_BYTES))
            body = document["payload"]
            if hashlib.sha256(body.encode()).hexdigest() != document["sha256"]:
                raise ValueError("checksum mismatch")
            payload: dict[str, Any] = json.loads(body)
            if payload.get("format") != STORE_FORMAT:
                raise ValueError(f"format {payload.get('format')!r}, expected {STORE_FORMAT}")
            arrow = _read_bounded(self._arrow(key), _MAX_ARROW_BYTES)
            if hashlib.sha256(arrow).hexdigest() != payload["frames_sha256"]:
                raise ValueError(f"{self._arrow(key).name}: checksum mismatch")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            logger.warning("case store entry %s is unusable (%s): the case is curated again", path.name, err)
            return None
        return payload, arrow

    def load_frames(self, key: str) -> dict[str, list[dict[str, Any]]]:
        """Return the frames of a case per organ.

        Raises:
            ValueError: the frames file does not match the checksum its entry recorded (changed since `has`).
        """
        found = self._payload(key)
        if found is None:
            raise ValueError(f"case store entry {key} is missing or corrupt")
        payload, arrow = found
        table = pa.ipc.open_file(pa.py_buffer(arrow)).read_all()
        frames: dict[str, list[dict[str, Any]]] = {row["organ"]: [] for row in payload["rows"]}
        for organ, data, name in zip(
            table["organ"].to_pylist(), table["bytes"].to_pylist(), table["path"].to_pylist(), strict=True
        ):
            frames[organ].append({"bytes": data, "path": name})
        return frames


def _json_scalar(value: Any) -> Any:
    """numpy scalars and arrays in a row -> Python values (what the Parquet writer would store anyway)."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable in a case store row")


def _frame_bytes(row: Mapping[str, Any]) -> int:
    return sum(len(f["bytes"]) for f in row["frames"])


_MAX_JSON_BYTES = 64 << 20  # rows of one case without frames: a few KiB
_MAX_ARROW_BYTES = 4 << 30  # frames of one case: a few MiB


def _read_bounded(path: Path, limit: int) -> bytes:
    """Read a store file that must be a regular file of at most `limit` bytes (a planted named pipe, link to a
    device or huge file is refused before it is opened or read)."""
    try:
        return read_regular_bytes(path, limit)
    except NotRegularFileError as err:
        raise ValueError(f"{path.name}: {err.strerror}") from None


def _write_atomic(data: bytes, path: Path) -> None:
    if path.is_dir() and not path.is_symlink():  # something planted where an entry belongs: replace it
        logger.warning("case store: %s is a folder where an entry belongs; replaced", path)
        shutil.rmtree(path)
    write_bytes_atomic(data, path)  # no room: `OutputWriteError` naming the entry, no temporary file left
