"""The one interface every mining backend implements, and where each backend lives.

A backend takes `InferenceRequest`s (a row's prompt and its frames as PNG bytes, frame 1 = most inferior;
`inference.requests`) and returns one `InferenceResult` per request, in request order. A failure of one request never
fails the batch: it becomes a result with `text=None` and `error` set, so the caller (`inference.store.run_inference`)
records it and moves on. The backends:

* `inference.transformers_backend.TransformersBackend`: a local checkpoint directory, the frames fed as one video
  exactly as in training;
* `inference.openai_client.OpenAIBackend`: an OpenAI-compatible `/v1/chat/completions` endpoint (`vllm serve`,
  `transformers serve`, a hosted API), with deadlines, retries and the probe (`inference.probe`). It raises
  `EndpointAuthError` on the first refused key, the one failure every other row would share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from inference.requests import InferenceRequest, InferenceResult


@runtime_checkable
class InferenceBackend(Protocol):
    """What `run_inference` needs: a name and a batched `generate` that keeps the order of its requests."""

    name: str

    def generate(self, requests: Sequence[InferenceRequest]) -> list[InferenceResult]:
        """Return one result per request, in the order of `requests`; never raise for a single bad request."""
        ...
