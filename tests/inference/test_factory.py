"""The mining backend a run names, built from its settings, and the wrapper that stops a run on a refused key."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from inference import Deadlines, EndpointAuthError, InferenceRequest, InferenceResult, ResultStore, run_inference
from inference.factory import FailFastOnAuth, make_backend
from inference.openai_client import OpenAIBackend
from tests.inference.helpers import EchoBackend, text_requests


SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "rows_per_call": 4,
    "max_new_tokens": 96,
    "max_concurrency": 3,
    "dialect": "openai",
    "max_tokens_field": "max_completion_tokens",
    "connect_timeout_s": 2.0,
    "first_byte_timeout_s": 30.0,
    "answer_timeout_s": 45.0,
}


def test_openai_backend_carries_the_run_settings_inside_the_auth_wrapper() -> None:
    made = make_backend("openai", None, "http://127.0.0.1:9/v1/", "served-sft", **SETTINGS)
    assert isinstance(made, FailFastOnAuth) and isinstance(made.backend, OpenAIBackend)
    endpoint = made.backend
    assert endpoint.url == "http://127.0.0.1:9/v1/chat/completions"
    assert (endpoint.model, endpoint.dialect, endpoint.max_tokens_field) == (
        "served-sft",
        "openai",
        "max_completion_tokens",
    )
    assert (endpoint.max_concurrency, endpoint.max_tokens) == (3, 96)
    assert endpoint.deadlines == Deadlines(2.0, 30.0, 45.0)
    assert made.model == "served-sft"  # every other attribute is the endpoint's
    endpoint.close()


@pytest.mark.parametrize(
    ("backend", "model_path", "endpoint_url", "endpoint_model", "message"),
    [
        ("transformers", None, None, None, r"^backend='transformers' needs model_path \(a local checkpoint"),
        ("transformers", "", "http://x/v1", "m", r"^backend='transformers' needs model_path"),
        ("openai", "ckpt", None, "m", r"^backend='openai' needs endpoint_url \(…/v1\) and endpoint_model\.$"),
        ("openai", None, "http://x/v1", "", r"^backend='openai' needs endpoint_url"),
        ("vllm", "ckpt", "http://x/v1", "m", r"^backend='vllm'; expected 'transformers' or 'openai'\.$"),
    ],
)
def test_a_backend_without_what_it_needs_is_refused(
    backend: str, model_path: str | None, endpoint_url: str | None, endpoint_model: str | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_backend(backend, model_path, endpoint_url, endpoint_model, **SETTINGS)


class RefusingBackend:
    """Answers the requests before `refuse_from` (by position over all calls), then `error` for every later one."""

    name = "refusing"

    def __init__(self, refuse_from: int, error: str) -> None:
        self.refuse_from, self.error = refuse_from, error
        self.seen: list[str] = []

    def generate(self, requests: Sequence[InferenceRequest]) -> list[InferenceResult]:
        out = []
        for r in requests:
            refused = len(self.seen) >= self.refuse_from
            self.seen.append(r.request_id)
            out.append(
                InferenceResult(r.request_id, None if refused else "ok", self.error if refused else None, 0.0, 1)
            )
        return out


@pytest.mark.parametrize("error", ["HTTP 401: unauthorized", "HTTP 403: forbidden", "AuthenticationError: bad key"])
def test_a_refused_key_stops_the_run_and_its_batch_is_not_stored(tmp_path: Path, error: str) -> None:
    requests = text_requests(6)
    wrapped = FailFastOnAuth(RefusingBackend(refuse_from=3, error=error))
    with ResultStore(tmp_path / "r.jsonl") as store, pytest.raises(EndpointAuthError) as refused:
        run_inference(wrapped, requests, store, batch_size=2)
    assert str(refused.value) == f"the endpoint refused the API key: {error}"
    assert wrapped.backend.seen == ["r000", "r001", "r002", "r003"]  # the second batch held the first refusal
    rerun = EchoBackend()
    with ResultStore(tmp_path / "r.jsonl") as store:
        run_inference(FailFastOnAuth(rerun), requests, store, batch_size=2)
    assert rerun.seen == ["r002", "r003", "r004", "r005"]  # the refused batch is sent again, nothing before it


@pytest.mark.parametrize("error", ["HTTP 400: bad frames", "timeout: no answer within 45 s", "HTTP 4010: odd"])
def test_other_row_errors_pass_through_as_results(tmp_path: Path, error: str) -> None:
    wrapped = FailFastOnAuth(RefusingBackend(refuse_from=1, error=error))
    results = wrapped.generate(text_requests(3))
    assert [(r.text, r.error) for r in results] == [("ok", None), (None, error), (None, error)]
