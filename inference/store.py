"""Per-row inference results that survive a crash, and the resumable run loop.

`ResultStore` is an append-only JSONL file, one line per finished request (success or error), written, flushed and
fsync'd as soon as the request is done; `pending` returns the requests it has no line for, so a rerun after a crash
does only the missing rows. Rules:

* a later line for the same `request_id` replaces an earlier one (used when errors are retried);
* the last line may be torn by a crash mid-write: if it is unterminated or does not parse, it is dropped and the file
  truncated to the last good line (logged), so the next append starts on a clean line;
* any other unparsable line is real corruption and raises `ValueError` (nothing is silently dropped);
* one writer at a time: the file is locked (`flock`, exclusive, non-blocking) while a store holds it open.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from inference.backends import InferenceBackend
from inference.requests import InferenceRequest, InferenceResult


logger = logging.getLogger(__name__)

_FIELDS = ("request_id", "text", "error", "seconds", "attempts")
_OPTIONAL = ("model",)  # written only when set, so lines of backends without it stay as they were


def _to_line(result: InferenceResult) -> bytes:
    """One JSONL line; text that UTF-8 cannot carry as it is (a lone surrogate) is written as JSON escapes instead.

    Raises:
        ValueError: a result that is not JSON (e.g. `seconds` NaN): a bug in the backend, not an answer.
    """
    record = {name: getattr(result, name) for name in _FIELDS}
    record |= {name: value for name in _OPTIONAL if (value := getattr(result, name)) is not None}
    text = json.dumps(record, ensure_ascii=False, allow_nan=False)
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:  # read back as the same string: nothing is lost or raised
        return (json.dumps(record, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")


def _from_line(line: bytes) -> InferenceResult:
    record = json.loads(line)
    if not isinstance(record, dict) or not set(_FIELDS) <= set(record) <= {*_FIELDS, *_OPTIONAL}:
        raise ValueError(f"expected the keys {_FIELDS} (and optionally {_OPTIONAL})")
    return InferenceResult(**record)


class ResultStore:
    """Append-only JSONL store of `InferenceResult`s keyed by `request_id` (see the module docstring).

    Args:
        path: the JSONL file; created (with its parent folder) on the first `add`.

    Raises:
        ValueError: when a line other than the last one does not parse.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._results: dict[str, InferenceResult] = {}
        self._fh: IO[bytes] | None = None
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        good_len = 0  # bytes up to the end of the last good line
        lines = data.split(b"\n")
        complete, tail = lines[:-1], lines[-1]  # `tail` is b"" when the file ends with a newline
        for i, line in enumerate(complete):
            end = good_len + len(line) + 1
            if not line.strip():
                good_len = end
                continue
            try:
                result = _from_line(line)
            except (ValueError, TypeError) as exc:
                if i == len(complete) - 1 and not tail:
                    logger.warning("%s: dropping a corrupt last line %d (%s)", self.path, i + 1, exc)
                    break
                raise ValueError(f"{self.path}: line {i + 1} is corrupt ({exc}); it is not the last line.") from exc
            self._results[result.request_id] = result
            good_len = end
        if tail:
            logger.warning(
                "%s: dropping an unterminated last line (%d bytes, a crash mid-write)", self.path, len(tail)
            )
        if good_len != len(data):
            os.truncate(self.path, good_len)

    def _open(self) -> IO[bytes]:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            created = not self.path.exists()
            fh = open(self.path, "ab")  # noqa: SIM115 (kept open for the store's life; closed by `close`)
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                fh.close()
                raise RuntimeError(f"{self.path} is in use by another writer.") from exc
            if created:  # make the new directory entry durable too
                dir_fd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            self._fh = fh
        return self._fh

    def add(self, result: InferenceResult) -> None:
        """Append one result as a line, flush and fsync it; it replaces any earlier result of the same id."""
        fh = self._open()
        fh.write(_to_line(result))
        fh.flush()
        os.fsync(fh.fileno())
        self._results[result.request_id] = result

    def get(self, request_id: str) -> InferenceResult | None:
        """Return the latest stored result of `request_id`, or None."""
        return self._results.get(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._results

    def __len__(self) -> int:
        return len(self._results)

    @property
    def results(self) -> dict[str, InferenceResult]:
        """A copy of every stored result, by request id."""
        return dict(self._results)

    def pending(self, requests: Sequence[InferenceRequest], *, retry_errors: bool = False) -> list[InferenceRequest]:
        """Return the requests without a stored result (and, with `retry_errors`, those whose result is an error)."""
        return [
            r
            for r in requests
            if (res := self._results.get(r.request_id)) is None or (retry_errors and res.error is not None)
        ]

    def close(self) -> None:
        """Release the file (and its lock)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_inference(
    backend: InferenceBackend,
    requests: Sequence[InferenceRequest],
    store: ResultStore,
    *,
    batch_size: int,
    progress: Callable[[int], None] | None = None,
    retry_errors: bool = False,
) -> dict[str, InferenceResult]:
    """Run the requests the store has no result for, `batch_size` at a time, storing each batch as it finishes.

    A crash loses at most the batch in flight; a rerun with the same store does only the missing rows. With an
    `OpenAIBackend`, use `batch_size` several times `max_concurrency` so the pool stays busy.

    Args:
        backend: the backend.
        requests: all requests of the run (unique ids).
        store: where results are kept.
        batch_size: requests per `backend.generate` call (>= 1).
        progress: called with the number of requests finished after each batch (e.g. `tqdm.update`).
        retry_errors: also rerun requests whose stored result is an error.

    Returns:
        The result of every request (including those from earlier runs), by request id, in request order.

    Raises:
        ValueError: on duplicate request ids or `batch_size < 1`.
        RuntimeError: when the backend returns results that do not match its requests one to one, in order.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}.")
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"Duplicate request ids, e.g. {dup}.")
    todo = store.pending(requests, retry_errors=retry_errors)
    logger.info(
        "run_inference[%s]: %d requests, %d already stored, %d to run",
        getattr(backend, "name", type(backend).__name__),
        len(requests),
        len(requests) - len(todo),
        len(todo),
    )
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        results = backend.generate(chunk)
        got = [r.request_id for r in results]
        want = [r.request_id for r in chunk]
        if got != want:
            raise RuntimeError(f"Backend {backend!r} returned results for {got[:5]}... for requests {want[:5]}...")
        for result in results:
            store.add(result)
        if progress is not None:
            progress(len(chunk))
    n_err = sum(1 for r in map(store.get, ids) if r is not None and r.error is not None)
    if n_err:
        logger.warning("run_inference: %d of %d requests have an error result", n_err, len(ids))
    return {i: store.get(i) for i in ids}  # type: ignore[misc]
