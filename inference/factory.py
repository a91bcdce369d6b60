"""The mining backend a run names, built from the run's settings (the `build-rl-hardset` flow's `backend` and its
options): `transformers` (a local checkpoint) or `openai` (an OpenAI-compatible endpoint), the latter wrapped so that a
refused API key stops the run at its first batch."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from inference.backends import InferenceBackend
from inference.bounded_http import Deadlines
from inference.openai_client import EndpointAuthError, OpenAIBackend
from inference.requests import InferenceRequest, InferenceResult
from inference.transformers_backend import TransformersBackend  # torch is imported when one is built


BACKENDS = ("transformers", "openai")
# A per-row error that means the endpoint refused the credentials: every other row would be refused too.
AUTH_ERROR = re.compile(r"^(HTTP (401|403)\b|AuthenticationError|PermissionDeniedError)")


class FailFastOnAuth:
    """Wrap an inference backend so that the first 401/403 result stops the run instead of trying every row.

    The refused batch is not stored (the exception leaves `run_inference` before it stores), so a rerun with a good
    key retries exactly those rows. Every other attribute is the wrapped backend's.
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def generate(self, requests: Sequence[InferenceRequest]) -> list[InferenceResult]:
        """The wrapped backend's results; raises `EndpointAuthError` on the first 401/403 among them."""
        results: list[InferenceResult] = self.backend.generate(requests)
        refused = next((r.error for r in results if r.error and AUTH_ERROR.match(r.error)), None)
        if refused is not None:
            raise EndpointAuthError(f"the endpoint refused the API key: {refused[:200]}")
        return results


def make_backend(
    backend: str,
    model_path: str | None,
    endpoint_url: str | None,
    endpoint_model: str | None,
    *,
    device: str,
    rows_per_call: int,
    max_new_tokens: int,
    max_concurrency: int,
    dialect: str,
    max_tokens_field: str,
    connect_timeout_s: float,
    first_byte_timeout_s: float,
    answer_timeout_s: float,
) -> InferenceBackend:
    """The backend `backend` names: a `TransformersBackend` on `model_path` (`device`, `rows_per_call` rows a batch)
    or an `OpenAIBackend` on `endpoint_url` serving `endpoint_model` (`max_concurrency` requests in flight, the
    `dialect`, the deadlines of each answer) inside `FailFastOnAuth`; both write at most `max_new_tokens`.

    Raises:
        ValueError: an unknown `backend`, or one without what it needs (a model path; an endpoint and its model).
    """
    if backend == "transformers":
        if not model_path:
            raise ValueError("backend='transformers' needs model_path (a local checkpoint directory).")
        return TransformersBackend(model_path, device=device, batch_size=rows_per_call, max_new_tokens=max_new_tokens)
    if backend == "openai":
        if not endpoint_url or not endpoint_model:
            raise ValueError("backend='openai' needs endpoint_url (…/v1) and endpoint_model.")
        endpoint = OpenAIBackend(
            endpoint_url,
            endpoint_model,
            max_concurrency=max_concurrency,
            max_tokens=max_new_tokens,
            dialect=dialect,  # type: ignore[arg-type]  # OpenAIBackend checks it against DIALECTS
            max_tokens_field=max_tokens_field,  # type: ignore[arg-type]  # checked against MAX_TOKENS_FIELDS
            deadlines=Deadlines(connect_timeout_s, first_byte_timeout_s, answer_timeout_s),
        )
        return FailFastOnAuth(endpoint)
    raise ValueError(f"backend={backend!r}; expected 'transformers' or 'openai'.")
