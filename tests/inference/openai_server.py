"""A minimal OpenAI-compatible chat-completions server for fault injection in the `OpenAIBackend` tests (loopback only).

A real server (`transformers serve`, `tests/inference/test_real_server.py`) checks the "openai" dialect end to end, but
it cannot misbehave on demand (429, 5xx, timeouts, a server that drops images) and it cannot take vLLM's frame-sequence
`video_url`. This server speaks the real protocol over HTTP and runs the tiny checkpoint through the real
`TransformersBackend` (every request's frames, video or images, are fed as one CT video, as in training):

* `POST /v1/chat/completions`: one user message whose content holds a `video_url` (`data:video/jpeg;base64,` then
  comma-separated base64 frames, vLLM's format) or `image_url` data URIs, and text parts; greedy; `max_tokens` or
  `max_completion_tokens`. Errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 invalid
  request (bad JSON, unsupported part, undecodable image, `n != 1`, streaming), 401 missing/wrong bearer key (only
  when `EMRL_TEST_SERVER_API_KEY` is set), 404 unknown model, 500 generation failure. The answer reports
  `usage.prompt_tokens` (the prompt's length as the model sees it, frames included) and `completion_tokens`.
* `GET /v1/models`, `GET /health`.
* Test controls (not OpenAI): `POST /_test/control {"faults": [503, 400, ...], "hold": true, "hold_until_in_flight": 3,
  "strict": true, "drop_frames": true, "usage": false}` makes the next requests answer those status codes (one
  each), every request wait until that many requests have been in flight at once (a barrier, 60 s at most); `hold`
  keeps every request unanswered until the next `/_test/reset` (so a client's timeout is certain on any machine,
  not a race against a sleep). `strict` refuses what a strict OpenAI-compatible server refuses (`transformers serve`, hosted APIs): a
  top-level field outside the `openai` SDK's chat-completions parameters (HTTP 422 "Unexpected fields in the request",
  `transformers serve`'s words) and a `video_url` part (HTTP 400). `drop_frames` answers as a server that ignores the
  images (a text-only processor): the prompt tokens count the text only. `usage: false` leaves `usage` out.
  `GET /_test/stats` returns `{"requests", "in_flight", "max_in_flight"}`; `GET /_test/last_request` the last chat
  request's JSON body; `POST /_test/reset` clears all of it.

    python -m tests.inference.openai_server --model-path DIR --port-file FILE [--served-model-name tiny]

binds 127.0.0.1 on a free port and writes the port to FILE once listening.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import io
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from PIL import Image

from inference.backends import InferenceBackend
from inference.requests import InferenceRequest


logger = logging.getLogger(__name__)

API_KEY_ENV = "EMRL_TEST_SERVER_API_KEY"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error"}
_DEFAULTS: dict[str, Any] = {
    "faults": [],
    "hold": False,
    "hold_until": 0,
    "strict": False,
    "drop_frames": False,
    "usage": True,
    "last_request": None,
}


def standard_fields() -> frozenset[str]:
    """The top-level fields of a standard chat-completions request, as the `openai` SDK types them."""
    from openai.types.chat import completion_create_params as params  # only strict mode needs it

    typed = params.CompletionCreateParamsNonStreaming
    return frozenset(typed.__required_keys__ | typed.__optional_keys__)


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None) -> JSONResponse:
    """Return an OpenAI-shaped error; 429/503 carry `Retry-After: 0` so test retries stay fast."""
    kind = _ERROR_TYPES.get(status, "rate_limit_error" if status == 429 else "server_error")
    headers = {"Retry-After": "0"} if status in (429, 503) else None
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(status_code=status, content=body, headers=headers)


class BadRequest(Exception):
    """An invalid chat-completions request (answered with HTTP 400)."""


def _decode_data_uri(url: str, part_type: str) -> list[bytes]:
    """Return the frame bytes of an `image_url` (one) or `video_url` (comma-separated frames) data URI."""
    prefix = "data:video/jpeg;base64," if part_type == "video_url" else "data:image/"
    if not url.startswith(prefix) or (part_type == "image_url" and ";base64," not in url):
        raise BadRequest(f"{part_type}: only base64 data URIs are supported ({prefix}...).")
    payload = url[len(prefix) :] if part_type == "video_url" else url.split(";base64,", 1)[1]
    frames = []
    for chunk in payload.split(","):
        try:
            data = base64.b64decode(chunk, validate=True)
            Image.open(io.BytesIO(data)).verify()
        except (binascii.Error, ValueError, OSError) as exc:
            raise BadRequest(f"{part_type}: a frame is not a decodable base64 image ({exc}).") from exc
        frames.append(data)
    return frames


def parse_messages(messages: Any, *, strict: bool = False) -> tuple[str, list[bytes]]:
    """Return the prompt text and the frames of the (single) user message.

    Raises:
        BadRequest: on a shape this server does not support (in strict mode also a `video_url` part, which is not an
            OpenAI content part).
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list.")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if len(users) != 1:
        raise BadRequest("exactly one user message is supported.")
    content = users[0].get("content")
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise BadRequest("content must be a string or a list of parts.")
    texts, frames = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if strict and kind == "video_url":
            raise BadRequest("unsupported content part type 'video_url' (not an OpenAI content part).")
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind in ("image_url", "video_url"):
            url = (part.get(kind) or {}).get("url") if isinstance(part.get(kind), dict) else None
            if not isinstance(url, str):
                raise BadRequest(f"{kind}.url is missing.")
            frames.extend(_decode_data_uri(url, kind))
        else:
            raise BadRequest(f"unsupported content part type {kind!r}.")
    return "".join(texts), frames


def create_app(backend: InferenceBackend, served_model_name: str) -> FastAPI:
    """Return the FastAPI app serving `backend` (a `TransformersBackend`) as `served_model_name`."""
    app = FastAPI()
    state: dict[str, Any] = {"requests": 0, "in_flight": 0, "max_in_flight": 0, **_DEFAULTS}
    lock = threading.Lock()
    released = threading.Event()  # cleared while `hold` is on; reset sets it, answering every held request
    released.set()
    api_key = os.environ.get(API_KEY_ENV) or None

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, f"invalid request body: {exc.errors()[:1]}")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "owned_by": "emrl-tests"}]}

    @app.post("/_test/control")
    def control(body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008 (FastAPI's idiom)
        with lock:
            state["faults"] = [int(c) for c in body.get("faults", [])]
            state["hold"] = bool(body.get("hold", False))
            if state["hold"]:
                released.clear()
            state["hold_until"] = int(body.get("hold_until_in_flight", 0))
            state.update({k: bool(body[k]) for k in ("strict", "drop_frames", "usage") if k in body})
        return {"ok": True}

    @app.post("/_test/reset")
    def reset() -> dict[str, Any]:
        with lock:
            state.update(requests=0, in_flight=0, max_in_flight=0, **{**_DEFAULTS, "faults": []})
            released.set()
        return {"ok": True}

    @app.get("/_test/stats")
    def stats() -> dict[str, Any]:
        with lock:
            return {k: state[k] for k in ("requests", "in_flight", "max_in_flight")}

    @app.get("/_test/last_request")
    def last_request() -> Any:
        with lock:
            return state["last_request"]

    @app.post("/v1/chat/completions")
    def chat(request: Request, body: dict[str, Any] = Body(...)) -> JSONResponse:  # noqa: B008
        with lock:
            state["requests"] += 1
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            fault = state["faults"].pop(0) if state["faults"] else None
            hold = state["hold"]
            state["last_request"] = body
            mode = {k: state[k] for k in ("strict", "drop_frames", "usage")}
        try:
            _hold(state["hold_until"])
            if hold:
                released.wait(timeout=120.0)  # the test resets long before; the bound only keeps a thread from leaking
            if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
                return error_response(401, "Incorrect API key provided.", code="invalid_api_key")
            if fault is not None:
                return error_response(fault, f"injected fault {fault}")
            return complete(backend, served_model_name, body, **mode)
        finally:
            with lock:
                state["in_flight"] -= 1

    def _hold(until: int, timeout_s: float = 60.0) -> None:
        """Wait until `until` requests have been in flight at once (a barrier: concurrency shown, not timed)."""
        deadline = time.monotonic() + timeout_s
        while until and time.monotonic() < deadline:
            with lock:
                if state["max_in_flight"] >= until:
                    return
            time.sleep(0.005)

    return app


def complete(
    backend: Any, served_model_name: str, body: dict[str, Any], *, strict: bool, drop_frames: bool, usage: bool
) -> JSONResponse:
    """Answer one chat-completions request with `backend` (a `TransformersBackend`), or an OpenAI-shaped error."""
    if strict and (unexpected := set(body) - standard_fields()):
        return error_response(422, f"Unexpected fields in the request: {sorted(unexpected)}")
    if body.get("model") != served_model_name:
        msg = f"The model `{body.get('model')}` does not exist."
        return error_response(404, msg, code="model_not_found", param="model")
    if body.get("stream"):
        return error_response(400, "streaming is not supported by this server.", param="stream")
    if body.get("n", 1) != 1:
        return error_response(400, "only n=1 is supported.", param="n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return error_response(400, "max_tokens must be a positive integer.", param="max_tokens")
    try:
        prompt, frames = parse_messages(body.get("messages"), strict=strict)
    except BadRequest as exc:
        return error_response(400, str(exc), param="messages")
    if not frames:
        return error_response(400, "at least one image or video frame is required.", param="messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    request = InferenceRequest(rid, prompt, frames)
    result = backend.generate([request], max_new_tokens=max_tokens)[0]  # type: ignore[call-arg]
    if result.error is not None:
        return error_response(500, result.error)
    choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "finish_reason": "stop"}
    content: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served_model_name,
        "choices": [choice],
    }
    if usage:
        prompt_tokens = backend.count_prompt_tokens(request, with_frames=not drop_frames)  # type: ignore[attr-defined]
        completion_tokens = backend.count_text_tokens(result.text)  # type: ignore[attr-defined]
        content["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
    return JSONResponse(content=content)


def main(argv: list[str] | None = None) -> None:
    """Serve a local checkpoint on 127.0.0.1 (free port written to `--port-file` once listening)."""
    from inference.transformers_backend import TransformersBackend

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--served-model-name", default="tiny")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    backend = TransformersBackend(args.model_path, device="cpu", batch_size=1)
    app = create_app(backend, args.served_model_name)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    port_file = Path(args.port_file)

    def announce() -> None:  # write the port only once uvicorn is serving
        while not server.started:
            time.sleep(0.02)
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(sock.getsockname()[1]))
        tmp.replace(port_file)

    threading.Thread(target=announce, daemon=True).start()
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
