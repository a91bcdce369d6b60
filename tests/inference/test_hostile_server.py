"""OpenAIBackend against a hostile server (`hostile_server.py`, loopback, in this process): every fault mode has its
exact outcome, none stops the batch, no deadline is outrun, and the key never appears in any result or log line."""

from __future__ import annotations

import logging

import pytest

from inference.bounded_http import Deadlines
from inference.openai_client import OpenAIBackend
from inference.store import ResultStore, run_inference
from tests.inference.helpers import make_requests
from tests.inference.hostile_server import TEXT, HostileServer


KEY = "sk-hostile-5e1f0c9d"
FAST = Deadlines(connect_s=2.0, first_byte_s=5.0, answer_s=1.0)
CONN = "connection error: RemoteProtocolError: "

# fault -> (text, error, attempts) with retries=1: each row's exact outcome
CASES = {
    "status:503": (None, "HTTP 503: injected fault 503", 2),
    "status:400": (None, "HTTP 400: injected fault 400", 1),
    "echo:500": (None, "HTTP 500: injected fault 500 for ***", 2),
    "hold": (None, "timeout: the answer took longer than 1 s (answer deadline)", 1),
    "trickle": (None, "timeout: the answer took longer than 1 s (answer deadline)", 1),
    "trickle_headers": (None, "timeout: the answer took longer than 1 s (answer deadline)", 1),
    "truncated": (None, CONN + "peer closed connection without sending complete message body", 2),
    "reset": (None, CONN + "Server disconnected without sending a response.", 2),
    "not_json": (None, "malformed response: not JSON (JSONDecodeError: Expecting value: line 1 column 1 (char 0))", 1),
    "no_choices": (None, "malformed response: IndexError: list index out of range", 1),
    "content_int": (None, "malformed response: content is int", 1),
    "deep": (None, "malformed response: JSON nested too deeply", 1),
    "gzip_bad": (
        None,
        "undecodable response: DecodingError: Error -3 while decompressing data: incorrect header check",
        1,
    ),
    "surrogate": (
        None,
        "malformed response: content is not valid Unicode (a lone surrogate U+D800 at character 0)",
        1,
    ),
    "oversize:5000000": (None, "oversize response: more than 4194304 bytes", 1),
    "content_echo": (f"{TEXT} ***", None, 1),
}


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("EMRL_HOSTILE_KEY", KEY)
    with HostileServer() as srv:
        yield srv


def _backend(srv: HostileServer, dialect: str, **kw) -> OpenAIBackend:
    kw = {"retries": 1, "backoff_s": 0.01, "deadlines": FAST, "api_key_env": "EMRL_HOSTILE_KEY", **kw}
    return OpenAIBackend(srv.url, "tiny", dialect=dialect, max_tokens=8, **kw)


@pytest.mark.parametrize("dialect", ["vllm", "openai"])
@pytest.mark.parametrize("fault", list(CASES))
def test_each_fault_is_that_rows_named_outcome(server, dialect, fault, caplog):
    caplog.set_level(logging.DEBUG)
    server.always = fault
    requests = make_requests([2])
    with _backend(server, dialect) as backend:
        (result,) = backend.generate(requests)
    text, error, attempts = CASES[fault]
    got = result.error if error is None or not error.startswith(CONN) else result.error[: len(error)]
    assert (result.text, got, result.attempts) == (text, error, attempts)
    assert KEY not in repr(result) and KEY not in caplog.text
    assert result.seconds < 4.0  # every deadline held (answer deadline 1 s, per attempt)


def test_one_bad_answer_never_stops_the_batch(server):
    server.faults.extend(["deep", "surrogate", "gzip_bad"])
    with _backend(server, "openai", max_concurrency=1) as backend:
        results = backend.generate(make_requests([2, 2, 2, 2]))
    assert [r.ok for r in results] == [False, False, False, True] and results[3].text == TEXT


def test_an_answer_naming_another_model_is_kept_with_the_name(server):
    server.always = "model:tiny-2024-07-18"
    with _backend(server, "openai") as backend:
        (result,) = backend.generate(make_requests([2]))
    assert (result.text, result.error, result.model) == (TEXT, None, "tiny-2024-07-18")


def test_a_key_in_the_model_name_is_masked(server):
    server.always = "model_echo"
    with _backend(server, "vllm") as backend:
        (result,) = backend.generate(make_requests([2]))
    assert result.model == "***" and result.text == TEXT


def test_a_server_that_dies_then_a_healthy_one_predicts_every_row_once(monkeypatch, tmp_path):
    monkeypatch.setenv("EMRL_HOSTILE_KEY", KEY)
    requests = make_requests([2, 3, 2, 3, 2, 3])
    store_path = tmp_path / "store.jsonl"
    with HostileServer(dies_after=2) as dying:
        port = dying.port
        with _backend(dying, "openai", max_concurrency=1) as backend, ResultStore(store_path) as store:
            first = run_inference(backend, requests, store, batch_size=2)
    assert sum(r.ok for r in first.values()) == 2
    assert all(r.error.startswith("connection error") for r in first.values() if not r.ok)
    with HostileServer(port=port) as healthy:
        with _backend(healthy, "openai") as backend, ResultStore(store_path) as store:
            second = run_inference(backend, requests, store, batch_size=2, retry_errors=True)
        assert len(healthy.answered) == 4
    assert all(r.ok and r.text == TEXT for r in second.values())
    digests = [d for d, _ in dying.answered + healthy.answered]
    assert len(digests) == len(set(digests)) == 6  # every row answered exactly once
    assert KEY.encode() not in store_path.read_bytes()


def test_probe_survives_hostile_answers(server):
    from inference.probe import EndpointProbeError

    server.always = "deep"
    with _backend(server, "vllm") as backend, pytest.raises(EndpointProbeError) as caught:
        backend.probe(make_requests([4])[0])
    assert str(caught.value).endswith("malformed answer: JSON nested too deeply")
