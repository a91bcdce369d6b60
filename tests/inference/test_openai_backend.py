"""OpenAIBackend against the protocol test server on loopback (tiny checkpoint, TransformersBackend): both dialects'
exact request shapes, a strict server, the probe, and fault injection (429, 5xx, timeouts, auth).

The server (`tests/inference/openai_server.py`) runs in a subprocess, stopped by PID even when a test fails. The
"openai" dialect against a server nobody here wrote is `test_real_server.py`.
"""

import base64
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.bounded_http import Deadlines
from inference.openai_client import VLLM_VIDEO_EXTRA_BODY, EndpointAuthError, OpenAIBackend
from inference.probe import EndpointProbeError
from inference.requests import InferenceRequest
from inference.store import ResultStore, run_inference
from inference.transformers_backend import TransformersBackend
from tests.inference.openai_server import API_KEY_ENV
from tests.loopback import free_port


ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-7f3a9c"  # a throw-away key for the loopback server; checked never to appear in the logs


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("server")
    port_file, log = workdir / "port", workdir / "server.log"  # a file, not a pipe: a full pipe would block it
    env = {**os.environ, "PYTHONPATH": str(ROOT), API_KEY_ENV: API_KEY, "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "tests.inference.openai_server",
        "--model-path",
        str(tiny_dir),
        "--port-file",
        str(port_file),
    ]
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

    def set_(faults=(), hold=False, hold_until_in_flight=0, **modes):  # modes: strict, drop_frames, usage
        body = {"faults": list(faults), "hold": hold, "hold_until_in_flight": hold_until_in_flight, **modes}
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


@pytest.fixture(scope="module")
def local(tiny_dir) -> TransformersBackend:
    return TransformersBackend(str(tiny_dir), device="cpu", max_new_tokens=8)


def _last_request(server) -> dict:
    return httpx.get(f"{server}/_test/last_request", timeout=10).json()


def _b64(frames: list[bytes]) -> list[str]:
    return [base64.b64encode(f).decode("ascii") for f in frames]


@pytest.mark.parametrize(
    "dialect",
    [
        "vllm",  # one video_url data URI of comma-separated frames (vLLM's format): the training layout
        "openai",  # one image_url per frame: this server still feeds them as one CT video
    ],
)
@pytest.mark.slow
def test_http_text_equals_local_greedy_text(server, control, local, requests3, make_backend, caplog, dialect):
    caplog.set_level(logging.DEBUG)
    backend = make_backend(dialect=dialect)
    remote = backend.generate(requests3)
    assert [r.request_id for r in remote] == [r.request_id for r in requests3]  # order kept
    assert all(r.ok and r.attempts == 1 for r in remote), remote
    assert [r.text for r in remote] == [r.text for r in local.generate(requests3)]  # same greedy text, over HTTP
    assert API_KEY not in caplog.text and API_KEY not in repr(backend)


def test_vllm_dialect_request_shape(server, control, make_backend, requests3):
    request = requests3[1]
    assert make_backend().generate([request])[0].ok
    video = {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(_b64(request.frames_png))}}
    assert _last_request(server) == {
        "model": "tiny",
        "messages": [{"role": "user", "content": [video, {"type": "text", "text": request.prompt}]}],
        "max_tokens": 8,
        "temperature": 0.0,
        "n": 1,
        "stream": False,
    }  # no per-request processor settings: the server's launch flags carry them (inference.vllm_server)
    assert VLLM_VIDEO_EXTRA_BODY == {}


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_openai_dialect_request_shape_passes_a_strict_server(server, control, make_backend, requests3, field):
    control(strict=True)  # refuses any field outside the openai SDK's chat-completions parameters, and video_url
    request = requests3[1]
    assert make_backend(dialect="openai", max_tokens_field=field).generate([request])[0].ok
    images = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b}"}} for b in _b64(request.frames_png)
    ]
    assert _last_request(server) == {
        "model": "tiny",
        "messages": [{"role": "user", "content": [*images, {"type": "text", "text": request.prompt}]}],
        field: 8,
        "temperature": 0.0,
        "stream": False,
    }


@pytest.mark.parametrize(
    ("extra_body", "error"),
    [
        (None, "HTTP 400: unsupported content part type 'video_url' (not an OpenAI content part)."),
        ({"media_io_kwargs": {}}, "HTTP 422: Unexpected fields in the request: ['media_io_kwargs']"),
    ],
)
def test_a_strict_server_refuses_the_vllm_dialect(server, control, make_backend, requests3, extra_body, error):
    control(strict=True)
    result = make_backend(extra_body=extra_body).generate(requests3[:1])[0]
    assert result.error == error and result.attempts == 1


def test_unknown_dialect_or_length_field_is_refused():
    with pytest.raises(ValueError, match=r"dialect must be one of \('vllm', 'openai'\); got 'video'"):
        OpenAIBackend("http://127.0.0.1:9/v1", "m", dialect="video")
    with pytest.raises(ValueError, match="max_tokens_field must be one of"):
        OpenAIBackend("http://127.0.0.1:9/v1", "m", max_tokens_field="max_new_tokens")


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
    control(hold=True)  # the server answers nothing until the fixture's reset: the answer can only be the timeout
    result = make_backend(deadlines=Deadlines(first_byte_s=0.3)).generate(requests3[:1])[0]
    assert result.error == "timeout: no byte for 0.3 s (first-byte deadline)" and result.attempts == 1
    assert result.text is None
    assert _stats(server)["requests"] == 1


def test_connection_errors_are_retried(make_backend, requests3):
    port = free_port()  # a port with nothing listening
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


# The probe before a run --------------------------------------------------------------------------------------------


def _with_frames(request: InferenceRequest, n: int) -> InferenceRequest:
    return InferenceRequest(request.request_id, request.prompt, request.frames_png[:n])


@pytest.mark.parametrize("dialect", ["vllm", "openai"])
def test_probe_sees_the_prompt_grow_with_the_frames(server, control, local, make_backend, requests3, dialect):
    control(strict=dialect == "openai")
    report = make_backend(dialect=dialect).probe(requests3[0])
    expected = tuple(local.count_prompt_tokens(_with_frames(requests3[0], n)) for n in (2, 4))
    assert report.frame_counts == (2, 4) and report.prompt_tokens == expected and report.usage_reported
    assert expected[1] > expected[0]
    assert _stats(server)["requests"] == 2


def test_probe_reuses_frames_of_a_short_row(server, control, make_backend, requests3):
    one_frame = _with_frames(requests3[0], 1)
    make_backend(dialect="openai").probe(one_frame)
    parts = _last_request(server)["messages"][0]["content"]
    assert [p["image_url"]["url"] for p in parts[:-1]] == [
        f"data:image/png;base64,{_b64(one_frame.frames_png)[0]}"
    ] * 4


def _probe_fails(backend: OpenAIBackend, request: InferenceRequest) -> EndpointProbeError:
    with pytest.raises(EndpointProbeError) as caught:
        backend.probe(request)
    assert "\n" not in str(caught.value) and "\n" not in caught.value.fix  # one line each
    return caught.value


def test_probe_wrong_model_is_one_line(server, control, make_backend, requests3):
    backend = make_backend(dialect="openai")
    backend.model = "no-such-model"
    err = _probe_fails(backend, requests3[0])
    assert str(err) == (
        f"probe of {server}/v1/chat/completions (model 'no-such-model', dialect openai) failed: "
        "HTTP 404: The model `no-such-model` does not exist."
    )
    assert err.fix == "pass the name the server serves as --endpoint-model (transformers serve: the path it was given)"
    assert _stats(server)["requests"] == 1  # nothing after the first refusal


def test_probe_refused_key_is_one_line(server, control, make_backend, requests3, monkeypatch):
    monkeypatch.delenv("EMRL_AUTH_KEY", raising=False)
    with pytest.raises(EndpointAuthError) as caught:
        make_backend(dialect="openai", api_key_env="EMRL_AUTH_KEY").probe(requests3[0])
    assert str(caught.value) == (
        f"{server}/v1/chat/completions refused the request (HTTP 401: Incorrect API key provided.); "
        "$EMRL_AUTH_KEY is not set: set it to the endpoint's API key."
    )
    assert _stats(server)["requests"] == 1


def test_probe_catches_a_server_that_drops_the_images(server, control, local, make_backend, requests3):
    control(drop_frames=True)
    err = _probe_fails(make_backend(dialect="openai"), requests3[0])
    text_only = local.count_prompt_tokens(requests3[0], with_frames=False)
    assert str(err) == (
        f"probe of {server}/v1/chat/completions (model 'tiny', dialect openai): the frames do not reach the model: "
        f"{text_only} prompt tokens with 2 frame(s) and {text_only} with 4 (the server dropped the images)"
    )
    assert err.fix.startswith("serve a vision checkpoint whose processor the server loads")


def test_probe_strict_server_and_vllm_dialect(server, control, make_backend, requests3):
    control(strict=True)
    err = _probe_fails(make_backend(), requests3[0])
    assert str(err).endswith(
        "failed: HTTP 400: unsupported content part type 'video_url' (not an OpenAI content part)."
    )
    assert err.fix == (  # never "use --dialect openai": N images are not the input the checkpoint was trained on
        "this server does not take the frames as one video (its log says why), the input our checkpoints were "
        "trained on: serve the checkpoint with vLLM, make vllm-serve CKPT=DIR (python -m inference.vllm_server DIR; "
        "docs/serving.md) (--dialect openai would send N images, a different input)"
    )


def test_probe_unreachable_endpoint(make_backend, requests3):
    port = free_port()  # a port with nothing listening
    err = _probe_fails(make_backend(f"http://127.0.0.1:{port}/v1", retries=0), requests3[0])
    assert "failed: connection error: ConnectError" in str(err)
    assert err.fix == "start the server or fix --endpoint (the base URL including /v1)"


def test_probe_without_usage_warns_and_goes_on(server, control, make_backend, requests3, caplog):
    control(usage=False)
    report = make_backend(dialect="openai").probe(requests3[0])
    assert report.prompt_tokens == (None, None) and not report.usage_reported and report.text
    assert "the server reports no usage.prompt_tokens, so the probe cannot check that the frames reach the model" in (
        caplog.text
    )


def test_ctrl_c_while_a_request_thread_starts_leaves_no_thread_behind(server, control, make_backend, requests3):
    """Ctrl-C can land inside `submit` while it waits for a new worker thread to start: the thread runs but the pool
    has not recorded it. It must still end (it shares the pool's queue); before, it waited on that queue forever and
    interpreter shutdown waited on it (the `emrl` process hung after "interrupted", seen under load)."""
    original = threading.Thread.start
    started: list[tuple[threading.Thread, Any]] = []

    def start(self: threading.Thread) -> None:
        queue = self._args[1] if self.name.startswith("ThreadPoolExecutor") else None  # type: ignore[attr-defined]
        original(self)
        if queue is not None and not started:
            started.append((self, queue))
            raise KeyboardInterrupt  # the signal arrives while the new worker is starting

    backend = make_backend(max_concurrency=1)
    threading.Thread.start = start  # type: ignore[method-assign]
    try:
        # Kept, as the CLI's caller (Prefect's engine) keeps it: the traceback keeps the pool alive, so the pool's
        # own garbage collection cannot be what ends the worker.
        with pytest.raises(KeyboardInterrupt) as caught:
            backend.generate(requests3)
    finally:
        threading.Thread.start = original  # type: ignore[method-assign]
    ((worker, queue),) = started
    try:
        worker.join(timeout=20)  # a hang guard, not a timing assertion
        assert not worker.is_alive(), "the worker started under Ctrl-C is still waiting for work"
    finally:
        queue.put(None)  # release it if the assertion failed
    assert caught.type is KeyboardInterrupt
    assert _stats(server)["requests"] <= 1  # at most the request queued before the interrupt was sent
