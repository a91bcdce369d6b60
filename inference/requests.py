"""The request and result types every inference backend speaks, and the request of one `sft` row.

An `InferenceRequest` is a row's prompt and its frames as PNG bytes (frame 1 = most inferior); an `InferenceResult`
is its outcome: the text, or `text=None` with a short `error`. `inference.store` writes results as they are.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from PIL import Image

from emrl_data.types import row_id


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One model call: a row's prompt and its frames.

    Attributes:
        request_id: unique key of the request in a run, e.g. `emrl_data.types.row_id(case_id, organ)`.
        prompt: the row's `prompt` (user text; it does not reference the frames itself).
        frames_png: the row's frames as 8-bit grayscale PNG bytes, frame 1 (most inferior) first.
    """

    request_id: str
    prompt: str
    frames_png: list[bytes]

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string; got {self.request_id!r}.")


@dataclass(frozen=True, slots=True)
class InferenceResult:
    """The outcome of one request.

    Attributes:
        request_id: the request's id.
        text: the generated text (special tokens removed), or None on failure.
        error: None on success, else a short reason that starts with its kind ("timeout: ...", "HTTP 400: ...",
            "malformed response: ...", "bad frames: ...").
        seconds: wall time spent on the request (for a batched local call: the wall time of its batch).
        attempts: HTTP attempts made (1 + retries used); 1 for a local call (2 when a failed batch was redone alone).
        model: the model name the answer reported (an endpoint's `model` field), None when there is none.
    """

    request_id: str
    text: str | None
    error: str | None
    seconds: float
    attempts: int
    model: str | None = None

    @property
    def ok(self) -> bool:
        """True when the request produced text."""
        return self.error is None


def _frame_png(frame: Any) -> bytes:
    """Return PNG bytes of one frame: raw bytes, a Hub image struct `{"bytes", "path"}` or a PIL image."""
    if isinstance(frame, bytes | bytearray | memoryview):
        return bytes(frame)
    if isinstance(frame, Mapping):
        if frame.get("bytes") is None:
            raise ValueError(f"image struct without bytes (path={frame.get('path')!r}).")
        return bytes(frame["bytes"])

    if isinstance(frame, Image.Image):
        buf = io.BytesIO()
        frame.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"Unsupported frame type {type(frame).__name__}; expected bytes, an image struct or a PIL image.")


def request_from_row(row: Mapping[str, Any]) -> InferenceRequest:
    """Return the request of one `sft` row: id `row_id(case_id, organ)`, its prompt and its frames.

    Args:
        row: a row with `case_id`, `organ`, `prompt` and `frames` (Hub image structs as read by pyarrow, or PIL images
            as decoded by `datasets`), frames in order 1..N (inferior -> superior).
    """
    return InferenceRequest(
        request_id=row_id(row["case_id"], row["organ"]),
        prompt=row["prompt"],
        frames_png=[_frame_png(f) for f in row["frames"]],
    )
