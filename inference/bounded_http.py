"""One HTTP exchange that always ends, and whose answer can never raise: deadlines, a size cap, safe JSON, masking.

A server can fail in ways an ordinary client call does not survive: it can send its answer one byte every half
second (httpx's timeouts are per read, so that never times out), send gigabytes, a `Content-Encoding` that does not
decode, JSON nested deeper than Python's recursion limit, text that is not valid Unicode, or echo the API key back.
`exchange` turns each of these into a value: an `Answer` with the status, headers and body bytes, or an error string
that starts with its kind and says whether another attempt can help.

Deadlines (`Deadlines`, the `--connect-timeout`, `--first-byte-timeout` and `--answer-timeout` options):

* connect: opening the TCP (and TLS) connection;
* first byte: the longest wait for any byte of the answer, the first one included (httpx's read timeout; for a
  non-streamed chat completion the first byte comes when the whole text is generated);
* answer: the whole exchange, from the first byte sent to the last byte of the answer. It is enforced on every socket
  read and write (`_DeadlineBackend` clamps each one to the time left), so a trickled status line, headers or body
  all end at the deadline.

`mask` replaces each secret by `***`; `clean` makes any text writable as UTF-8 (a lone surrogate becomes its
`\\udXXX` escape). Every string an endpoint client builds from an answer goes through both.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx


# The largest answer kept (after Content-Encoding is undone): a chat completion of a few hundred tokens is a few KB, and
# vLLM's `return_token_ids` for a 32-frame prompt some 30 KB; more is a broken or hostile server.
MAX_ANSWER_BYTES = 4 * 2**20
MASK = "***"
_ERROR_CHARS = 300  # a server's error text is cut to this many characters


@dataclass(frozen=True, slots=True)
class Deadlines:
    """How long one exchange may take, in seconds (module docstring).

    Raises:
        ValueError: when a deadline is not positive.
    """

    connect_s: float = 10.0
    first_byte_s: float = 120.0
    answer_s: float = 300.0

    def __post_init__(self) -> None:
        if min(self.connect_s, self.first_byte_s, self.answer_s) <= 0:
            raise ValueError(f"deadlines must be > 0 s; got {self}.")

    def capped(self, seconds: float) -> Deadlines:
        """The same deadlines, none longer than `seconds` (short side requests such as `GET /version`)."""
        return Deadlines(min(self.connect_s, seconds), min(self.first_byte_s, seconds), min(self.answer_s, seconds))

    def timeout(self) -> httpx.Timeout:
        """httpx's per-operation timeouts: connect, and the first-byte deadline for every read and write."""
        return httpx.Timeout(
            connect=self.connect_s, read=self.first_byte_s, write=self.first_byte_s, pool=self.answer_s
        )


@dataclass(frozen=True, slots=True)
class Answer:
    """What one exchange got.

    Attributes:
        status: the HTTP status, or None when no complete answer came (`error` says why).
        headers: the answer's headers (empty without an answer).
        body: the body, decoded from its Content-Encoding, at most `MAX_ANSWER_BYTES`.
        error: None for a complete answer (whatever its status), else "<kind>: <detail>", kind one of `timeout`,
            `connection error`, `undecodable response`, `oversize response`, `client error`.
        retryable: whether another attempt can help (a connection that failed or broke); never for a timeout (the same
            request would take as long again) or an answer that is broken as it is.
    """

    status: int | None
    headers: httpx.Headers
    body: bytes
    error: str | None = None
    retryable: bool = False


# Per thread: `end`, the monotonic time this thread's exchange must end by (None outside one); `cut`, whether the last
# socket operation's timeout was shortened to it.
_deadline = threading.local()


def _clamp(timeout: float | None, expired: type[Exception]) -> float | None:
    """The socket timeout for one operation: `timeout`, shortened to the time left before this thread's deadline."""
    end = getattr(_deadline, "end", None)
    if end is None:
        return timeout
    left = end - time.monotonic()
    _deadline.cut = timeout is None or left < timeout  # a timeout of this operation is the answer deadline's
    if left <= 0:
        raise expired("the answer deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A network stream whose every read and write ends by the deadline of the exchange using it."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _clamp(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _clamp(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None) -> Any:
        return _DeadlineStream(
            self._inner.start_tls(ssl_context, server_hostname, _clamp(timeout, httpcore.ConnectTimeout))
        )

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's synchronous sockets, wrapped in `_DeadlineStream`."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        timeout = _clamp(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        timeout = _clamp(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def make_client(max_connections: int, deadlines: Deadlines) -> httpx.Client:
    """An httpx client whose connections (direct ones; a proxy's are httpx's own) honour the answer deadline.

    httpx builds its connection pool without a way to pass httpcore's `network_backend`, so the transport's pool is
    replaced by an equal one that has it (the attribute `HTTPTransport.handle_request` uses, httpx 0.28).
    """
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    transport = httpx.HTTPTransport(limits=limits)
    transport._pool = httpcore.ConnectionPool(  # noqa: SLF001 (see the docstring)
        ssl_context=httpx.create_ssl_context(),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=_DeadlineBackend(),
    )
    return httpx.Client(timeout=deadlines.timeout(), transport=transport)


def exchange(
    client: httpx.Client,
    method: str,
    url: str,
    *,
    deadlines: Deadlines,
    json_body: Any = None,
    headers: Mapping[str, str] | None = None,
    max_bytes: int = MAX_ANSWER_BYTES,
) -> Answer:
    """Send one request and read its whole answer within `deadlines`; never raise for anything the server does.

    Args:
        client: a client from `make_client` (another client gets per-read timeouts and the body's deadline only).
        method: "GET" or "POST".
        url: the full URL.
        deadlines: the deadlines of this exchange.
        json_body: the JSON body to send, if any.
        headers: extra request headers.
        max_bytes: the largest body kept; a longer one is an `oversize response` error.
    """
    end = time.monotonic() + deadlines.answer_s
    _deadline.end = end
    try:
        with client.stream(method, url, json=json_body, headers=headers, timeout=deadlines.timeout()) as resp:
            body = bytearray()
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    return _failed(f"oversize response: more than {max_bytes} bytes")
                if time.monotonic() > end:  # a proxied connection: the deadline is checked per chunk
                    return _failed(_answer_timeout(deadlines))
            return Answer(resp.status_code, resp.headers, bytes(body))
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        return _failed(f"connection error: {_describe(exc)}", retryable=True)
    except httpx.TimeoutException:
        late = getattr(_deadline, "cut", False) or time.monotonic() >= end
        return _failed(
            _answer_timeout(deadlines)
            if late
            else f"timeout: no byte for {deadlines.first_byte_s:g} s (first-byte deadline)"
        )
    except httpx.DecodingError as exc:
        return _failed(f"undecodable response: {_describe(exc)}")
    except httpx.TransportError as exc:  # the connection broke (reset, closed mid-answer, a protocol violation)
        return _failed(f"connection error: {_describe(exc)}", retryable=True)
    except httpx.HTTPError as exc:  # anything else httpx refuses in an answer (e.g. too many redirects)
        return _failed(f"client error: {_describe(exc)}")
    finally:
        _deadline.end, _deadline.cut = None, False


def _answer_timeout(deadlines: Deadlines) -> str:
    return f"timeout: the answer took longer than {deadlines.answer_s:g} s (answer deadline)"


def _failed(error: str, *, retryable: bool = False) -> Answer:
    return Answer(None, httpx.Headers(), b"", error, retryable)


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def parse_json(body: bytes) -> tuple[Any, str | None]:
    """Return (the decoded JSON, None) or (None, why it is not JSON); never raises.

    Deep nesting is refused here as `JSON nested too deeply` (Python's decoder recurses per level).
    """
    try:
        return json.loads(body), None
    except RecursionError:
        return None, "JSON nested too deeply"
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8/16/32
        return None, f"not JSON ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"


def error_text(body: bytes, secrets: Iterable[str] = ()) -> str:
    """The server's error message in an error answer: OpenAI `{"error": {"message"}}`, vLLM `{"message"}`, FastAPI's
    `{"detail"}` (`transformers serve`), or the body itself (whitespace collapsed); cleaned, `secrets` masked, then
    cut to 300 characters (masked first: a cut never leaves part of a key)."""
    data, _ = parse_json(body)
    msg: Any = None
    if isinstance(data, Mapping):
        msg = data.get("error", data.get("detail", data.get("message")))
        if isinstance(msg, Mapping):
            msg = msg.get("message")
    if not isinstance(msg, str):  # never the repr of arbitrary JSON (it can be nested past the recursion limit)
        msg = body[: _ERROR_CHARS * 4].decode("utf-8", "replace")
    return " ".join(mask(clean(msg), secrets).split())[:_ERROR_CHARS]


def clean(text: str) -> str:
    """`text` made writable as UTF-8: a lone surrogate (JSON's `"\\ud800"`) becomes its backslash escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def mask(text: str, secrets: Iterable[str]) -> str:
    """`text` with every secret replaced by `***` (longest first, so a key inside a longer secret is masked too)."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


class _MaskSecrets(logging.Filter):
    """Masks the registered secrets in httpx's and httpcore's own log records (they log reason phrases and headers)."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            message = record.getMessage()
            masked = mask(message, self.secrets)
            if masked != message:
                record.msg, record.args = masked, None
        return True


_LIBRARY_FILTER = _MaskSecrets()
for _name in ("httpx", "httpcore.connection", "httpcore.http11", "httpcore.http2", "httpcore.proxy"):
    logging.getLogger(_name).addFilter(_LIBRARY_FILTER)


def register_secrets(secrets: Iterable[str]) -> None:
    """Mask `secrets` in the HTTP libraries' log records too (for the life of the process)."""
    _LIBRARY_FILTER.secrets.update(s for s in secrets if s)
