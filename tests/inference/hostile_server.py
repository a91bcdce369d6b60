"""An OpenAI-compatible stub on loopback that fails on demand, byte for byte: the hostile-server suite's one server.

It answers `POST /v1/chat/completions` in either dialect (a `video_url` or `image_url` parts) with a fixed text, and
`GET /version`. `faults` is a queue: each chat request takes the next fault (none left: a healthy answer); `always`
applies one fault to every request. Fault modes (`name` or `name:arg`):

* `status:CODE`: an OpenAI-shaped error (`Retry-After: 0` on 429/503); `echo:CODE`: the same, echoing the request's
  `Authorization` value in the message, a header and the reason phrase;
* `hold`: no byte until the server stops; `trickle`: a healthy answer, one byte every 0.2 s; `trickle_headers`: the
  status line and headers one byte every 0.2 s;
* `truncated`: half the declared Content-Length, then the connection closes; `reset`: the connection closes unanswered;
* `not_json`, `truncated_json`, `no_choices`, `content_int`, `deep` (JSON nested 100,000 deep), `gzip_bad` (a
  `Content-Encoding: gzip` body that is not gzip), `surrogate` (content `"\\ud800"`), `oversize:N` (N bytes of body);
* `content_echo` / `model_echo`: the key as the answer's text / model name; `model:NAME`: the answer names NAME.

`dies_after=k`: after k healthy answers the server stops listening and closes every connection unanswered.
`answered` lists (sha256 of the messages, the length cap) of every healthy answer.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


TEXT = "No focal liver lesion is identified."


class HostileServer:
    """Serve on 127.0.0.1 (`port=0`: a free port) until `stop`."""

    def __init__(self, *, model: str = "tiny", port: int = 0, dies_after: int | None = None) -> None:
        self.model = model
        self.faults: deque[str] = deque()
        self.always: str | None = None
        self.dies_after = dies_after
        self.answered: list[tuple[str, int]] = []
        self.requests = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.dead = False
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        """Stop listening and release every waiting handler."""
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> HostileServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def take(self) -> tuple[str | None, bool]:
        """The fault of the next chat request, and whether it may be answered at all (not dead)."""
        with self.lock:
            self.requests += 1
            if self.dead:
                return None, False
            fault = self.faults.popleft() if self.faults else self.always
            return fault, True

    def count_answer(self, body: dict[str, Any]) -> None:
        digest = hashlib.sha256(json.dumps(body.get("messages"), sort_keys=True).encode()).hexdigest()
        cap = body.get("max_tokens", body.get("max_completion_tokens"))
        with self.lock:
            self.answered.append((digest, cap))
            if self.dies_after is not None and len(self.answered) >= self.dies_after and not self.dead:
                self.dead = True
                threading.Thread(target=self.stop, daemon=True).start()


class _Handler(BaseHTTPRequestHandler):
    """The stub's request handler; `srv` is the `HostileServer` it serves."""

    srv: HostileServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's API)
        self._send(200, json.dumps({"version": "0.32.0"}).encode())

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        fault, alive = self.srv.take()
        if not alive:
            self.close_connection = True
            return
        auth = self.headers.get("authorization", "")
        key = auth.removeprefix("Bearer ")
        kind, _, arg = (fault or "").partition(":")
        answer: dict[str, Any] = {
            "id": "x",
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": TEXT}}],
            "usage": {"prompt_tokens": 10 + len(json.dumps(body)) // 1000},
        }
        if kind == "status" or kind == "echo":
            return self._error(int(arg), auth if kind == "echo" else None)
        if kind == "hold":
            self.srv.stopping.wait(60)
            self.close_connection = True
            return
        if kind == "reset":
            self.close_connection = True
            return
        if kind == "content_echo":
            answer["choices"][0]["message"]["content"] = f"{TEXT} {key}"
        if kind == "model_echo":
            answer["model"] = key
        if kind == "model":
            answer["model"] = arg
        raw = _raw(kind, arg, answer)
        if raw is None:
            return self._send(200, b"x" * int(arg))  # oversize
        if kind == "trickle_headers":
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
            return self._trickle(head + raw)
        if kind == "trickle":
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            return self._trickle(raw)
        if kind == "truncated":
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw[: len(raw) // 2])
            self.close_connection = True
            return
        headers = {"Content-Encoding": "gzip"} if kind == "gzip_bad" else {}
        self._send(200, raw, headers)
        if fault is None or kind in ("content_echo", "model_echo", "model"):
            self.srv.count_answer(body)

    def _error(self, code: int, auth: str | None) -> None:
        """An OpenAI-shaped error; with `auth`, echoed in the message, a header and the reason phrase."""
        msg = f"injected fault {code}" + (f" for {auth}" if auth else "")
        headers = {"Retry-After": "0"} if code in (429, 503) else {}
        if auth:
            headers |= {"X-Echo": auth}
        reason = auth.removeprefix("Bearer ") if auth else None
        self._send(code, json.dumps({"error": {"message": msg}}).encode(), headers, reason=reason)

    def _trickle(self, data: bytes) -> None:
        for i in range(len(data)):
            if self.srv.stopping.wait(0.2):
                break
            try:
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
            except OSError:
                break
        self.close_connection = True

    def _send(self, code: int, data: bytes, headers: dict[str, str] | None = None, reason: str | None = None):
        self.send_response(code, reason)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)


def _handler(srv: HostileServer) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_Handler,), {"srv": srv})


def _raw(kind: str, arg: str, answer: dict[str, Any]) -> bytes | None:
    """The body of a 200 answer for one fault (None: an oversize body, sent by the caller)."""
    if kind == "oversize":
        return None
    if kind == "not_json":
        return b"<html>502 Bad Gateway</html>"
    if kind == "truncated_json":
        whole = json.dumps(answer).encode()
        return whole[: len(whole) // 2]
    if kind == "no_choices":
        answer["choices"] = []
    if kind == "content_int":
        answer["choices"][0]["message"]["content"] = 5
    if kind == "deep":
        return b"[" * 100_000 + b"]" * 100_000
    if kind == "gzip_bad":
        return b"this is not gzip"
    if kind == "surrogate":
        return json.dumps(answer).replace(json.dumps(TEXT), '"\\ud800 report"').encode()
    return json.dumps(answer).encode()


def wait_for(predicate: Any, timeout_s: float = 10.0) -> None:
    """Wait until `predicate()` is true (a hang guard for tests)."""
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
