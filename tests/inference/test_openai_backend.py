"""OpenAIBackend against a real OpenAI-compatible HTTP server on loopback (tiny checkpoint, TransformersBackend).

`transformers serve` is not usable here (see `openai_server.py`), so the test starts `tests/inference/openai_server.py`
in a subprocess and stops it by PID, even when a test fails.
"""

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from inference.backends import EndpointAuthError, InferenceRequest, OpenAIBackend, TransformersBackend
from inference.store import ResultStore, run_inference
from tests.inference.openai_server import API_KEY_ENV


ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-7f3a9c"  # a throw-away key for the loopback server; checked never to appear in the logs


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("server")
    port_file, log = workdir / "port", workdir / "server.log"  # a file, not a pipe: a full pipe would block it
    env = {**os.environ, "PYTHONPATH": str(ROOT), API_KEY_ENV: API_KEY, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "tests.inference.openai_server", "--model-path", str(tiny_dir),
           "--port-file", str(port_file)]  # fmt: skip
    with log.open("wb") as err:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"test server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture
def control(server):
    httpx.post(f"{server}/_test/reset", timeout=10)

    def set_(faults=(), delay_s=0.0, hold_until_in_flight=0):
        body = {"faults": list(faults), "delay_s": delay_s, "hold_until_in_flight": hold_until_in_flight}
        httpx.post(f"{server}/_test/control", json=body, timeout=10)

    yield set_
    httpx.post(f"{server}/_test/reset", timeout=10)


def _stats(server) -> dict:
    return httpx.get(f"{server}/_test/stats", timeout=10).json()


@pytest.fixture
def make_backend(server, monkeypatch):
    """Return a factory of backends on the test server (right key, fast backoff); all are closed afterwards."""
    monkeypatch.setenv("EMRL_KEY_FOR_TESTS", API_KEY)
    made: list[OpenAIBackend] = []

    def make(base_url: str | None = None, **kw) -> OpenAIBackend:
        kw = {"max_tokens": 8, "retries": 3, "backoff_s": 0.01, "api_key_env": "EMRL_KEY_FOR_TESTS", **kw}
        made.append(OpenAIBackend(base_url or f"{server}/v1", "tiny", **kw))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


@pytest.mark.parametrize(
    "frames_as",
    [
        "video",  # one video_url data URI of comma-separated frames (vLLM's format): the training layout
        "images",  # one image_url per frame: the server still feeds them as one CT video here
    ],
)
def test_http_text_equals_local_greedy_text(server, control, tiny_dir, requests3, make_backend, caplog, frames_as):
    caplog.set_level(logging.DEBUG)
    backend = make_backend(frames_as=frames_as)
    remote = backend.generate(requests3)
    local = TransformersBackend(str(tiny_dir), device="cpu", max_new_tokens=8).generate(requests3)
    assert [r.request_id for r in remote] == [r.request_id for r in requests3]  # order kept
    assert all(r.ok and r.attempts == 1 for r in remote), remote
    assert [r.text for r in remote] == [r.text for r in local]  # same model, same greedy text, over HTTP
    assert API_KEY not in caplog.text and API_KEY not in repr(backend)


def test_payload_shape(server, make_backend, requests3):
    backend = make_backend()
    body = backend.payload(requests3[1])
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["video_url", "text"]  # video first, then the prompt (as in training)
    assert parts[0]["video_url"]["url"].startswith("data:video/jpeg;base64,")
    assert parts[0]["video_url"]["url"].count(",") == 5  # the prefix's comma + 4 separators between 5 frames
    assert body["temperature"] == 0.0 and body["max_tokens"] == 8
    assert body["media_io_kwargs"] == {"video": {"num_frames": -1, "fps": 1}}
    images = make_backend(frames_as="images").payload(requests3[1])
    assert [p["type"] for p in images["messages"][0]["content"]] == ["image_url"] * 5 + ["text"]
    assert "media_io_kwargs" not in images


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (
            "sk-wrong",
            "{url} refused the request (HTTP 401: Incorrect API key provided.); the key in $EMRL_AUTH_KEY was "
            "refused: set it to a valid key for this endpoint.",
        ),
        (
            None,
            "{url} refused the request (HTTP 401: Incorrect API key provided.); $EMRL_AUTH_KEY is not set: set it "
            "to the endpoint's API key.",
        ),
    ],
)
def test_auth_error_fails_fast_on_the_first_401(server, control, make_backend, requests3, monkeypatch, key, message):
    if key is None:
        monkeypatch.delenv("EMRL_AUTH_KEY", raising=False)
    else:
        monkeypatch.setenv("EMRL_AUTH_KEY", key)
    backend = make_backend(api_key_env="EMRL_AUTH_KEY", max_concurrency=1)
    with pytest.raises(EndpointAuthError) as caught:
        backend.generate(requests3)  # three rows: only the first is sent, the others are cancelled
    assert str(caught.value) == message.format(url=f"{server}/v1/chat/completions")
    assert _stats(server)["requests"] == 1


def test_403_is_an_auth_error_too(server, control, make_backend, requests3):
    control(faults=[403])
    with pytest.raises(EndpointAuthError, match=r"\(HTTP 403: injected fault 403\); the key in \$EMRL_KEY_FOR_TESTS"):
        make_backend(max_concurrency=1).generate(requests3)
    assert _stats(server)["requests"] == 1


@pytest.mark.parametrize(
    ("faults", "retries", "ok", "attempts", "error"),
    [
        ([503, 503], 3, True, 3, None),  # two 503s, then success on the third attempt
        ([429], 3, True, 2, None),  # rate limited once (Retry-After: 0), then success
        ([500, 502, 503, 504], 2, False, 3, "HTTP 503"),  # retries exhausted after 3 attempts: the last error is kept
        ([400], 3, False, 1, "HTTP 400"),  # client error: never retried
        ([404, 503], 3, False, 1, "HTTP 404"),  # not found: never retried (the queued 503 is never reached)
    ],
)
def test_retries_only_on_5xx_and_429(server, control, make_backend, requests3, faults, retries, ok, attempts, error):
    control(faults=faults)
    result = make_backend(retries=retries).generate(requests3[:1])[0]
    assert result.ok is ok and result.attempts == attempts
    assert _stats(server)["requests"] == attempts
    if error:
        assert result.text is None and result.error.startswith(error)


def test_real_400_for_an_invalid_request(server, control, make_backend):
    bad = InferenceRequest("bad/liver", "Describe the liver.", [b"not a png"])
    result = make_backend().generate([bad])[0]
    assert result.error.startswith("HTTP 400: video_url: a frame is not a decodable base64 image")
    assert result.attempts == 1


def test_unknown_model_is_404(server, control, make_backend, requests3):
    backend = make_backend()
    backend.model = "no-such-model"
    result = backend.generate(requests3[:1])[0]
    assert result.error == "HTTP 404: The model `no-such-model` does not exist." and result.attempts == 1


def test_timeout_is_reported_and_not_retried(server, control, make_backend, requests3):
    control(delay_s=3.0)  # 10x the client's timeout: the answer can only be the timeout
    result = make_backend(timeout_s=0.3).generate(requests3[:1])[0]
    assert result.error == "timeout after 0.3 s" and result.attempts == 1 and result.text is None
    assert _stats(server)["requests"] == 1


def test_connection_errors_are_retried(make_backend, requests3):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = make_backend(f"http://127.0.0.1:{port}/v1", retries=2)
    result = backend.generate(requests3[:1])[0]
    assert result.error.startswith("connection error: ConnectError") and result.attempts == 3


def test_bounded_concurrency(server, control, make_backend, requests3):
    control(hold_until_in_flight=3)  # each request waits until 3 were in flight at once: concurrency, not timing
    reqs = [InferenceRequest(f"c{i}", r.prompt, r.frames_png) for i in range(3) for r in requests3]  # 9 requests
    results = make_backend(max_concurrency=3, max_tokens=2).generate(reqs)
    assert [r.request_id for r in results] == [r.request_id for r in reqs] and all(r.ok for r in results)
    stats = _stats(server)
    assert stats["requests"] == 9 and stats["max_in_flight"] == 3  # never more than 3, and really concurrent


def test_run_inference_over_http_resumes(server, control, make_backend, requests3, tmp_path):
    backend = make_backend(max_concurrency=2)
    with ResultStore(tmp_path / "r.jsonl") as store:
        run_inference(backend, requests3[:2], store, batch_size=2)
    with ResultStore(tmp_path / "r.jsonl") as store:
        out = run_inference(backend, requests3, store, batch_size=2)
    assert _stats(server)["requests"] == 3  # the rerun sent only the missing row
    assert list(out) == [r.request_id for r in requests3] and all(r.ok for r in out.values())
