"""The endpoint backend: chat completions on an OpenAI-compatible server (`vllm serve`, `transformers serve`, a hosted
API), with bounded concurrency, deadlines, retries, and no answer that can stop a run or leak the key.

Requests run on a bounded thread pool; each attempt is one `inference.bounded_http.exchange` (connect, first-byte and
answer deadlines, a size cap) and is retried with exponential backoff (`Retry-After` honoured) on a connection that
failed or broke, HTTP 5xx and 429 only. Everything else a server can answer becomes that row's `InferenceResult`
with `text=None` and an `error` that starts with its kind: `timeout`, `connection error`, `HTTP <status>`,
`malformed response`, `undecodable response`, `oversize response`, `client error`. HTTP 401/403 (a missing or wrong
API key) is the one exception: it raises `EndpointAuthError` on the first occurrence and the requests not yet sent are
cancelled, since every other row would fail the same way. (Why a hand-written client and not the `openai` SDK:
`docs/decisions.md`, "OpenAI-compatible client".)

The API key (and so the `Authorization` value) never leaves memory: every text built from an answer (errors, the
report, the model name, log lines, exception messages) has it replaced by `***` (`bounded_http.mask`), whatever the
server echoes.

How the frames are sent (`dialect`; `docs/serving.md` says which to use where):

* `"vllm"` (default, for our own checkpoints on `vllm serve`): one `video_url` part whose URL is
  `data:video/jpeg;base64,<frame 1>,<frame 2>,...` (each frame base64 PNG bytes, comma separated), then the prompt
  text: the same user turn as training (video first, then text). This is vLLM's frame-sequence video format
  (`VideoMediaIO.load_base64` splits on commas when the media type is `video/jpeg` and opens every frame with PIL, so
  lossless PNG frames are accepted; metadata `fps=1`, `frames_indices=range(N)`, `do_sample_frames=False`), which
  gives the timestamps of our encoder. The request carries no per-request processor settings: vLLM 0.32 refuses
  `mm_processor_kwargs` and `media_io_kwargs` unless started with `--trust-request-mm-kwargs`, and the settings that
  make vLLM encode a row exactly as training does are the server's, fixed at launch by `inference.vllm_server`
  (`make vllm-serve`: `--mm-processor-kwargs`, `--media-io-kwargs`, `--limit-mm-per-prompt` and a chat template whose
  video is `<|video_pad|>` alone). Served so, vLLM builds the training prompt token for token
  (`tests/inference/test_vllm_server.py`); the probe checks the layout (`return_token_ids`) and the vLLM version.
* `"openai"` (`transformers serve`, hosted APIs, any strict OpenAI-compatible server): one `image_url` part
  (`data:image/png;base64,...`) per frame in frame order, then the text, and only standard chat-completions fields
  (`model`, `messages`, the length cap, `temperature`, `stream`). The model then sees N separate images (for Qwen3-VL
  each frame duplicated in time), not the video it was trained on.

The length cap is sent as `max_tokens` (default; vLLM and `transformers serve` read it, and `transformers serve`
ignores `max_completion_tokens` with a warning) or as `max_completion_tokens` (`max_tokens_field`; OpenAI's newer
models, e.g. the o-series and GPT-5, refuse `max_tokens`).

An answer whose `model` names another model than the one asked for is kept (hosted APIs answer with a dated name,
e.g. `gpt-4o-mini-2024-07-18`); the name is in `InferenceResult.model` and the run's summary counts such answers.
`OpenAIBackend.probe` checks the endpoint before a run (`inference.probe`).
"""

from __future__ import annotations

import base64
import copy
import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from inference.bounded_http import (
    MAX_ANSWER_BYTES,
    Answer,
    Deadlines,
    clean,
    error_text,
    exchange,
    make_client,
    mask,
    parse_json,
    register_secrets,
)
from inference.probe import ProbeReport, run_probe
from inference.requests import InferenceRequest, InferenceResult


logger = logging.getLogger(__name__)

# Extra per-request fields of the "vllm" dialect: none. The video settings are the server's, fixed at launch
# (`inference.vllm_server`): per-request `mm_processor_kwargs` / `media_io_kwargs` would need the server to trust every
# client (`--trust-request-mm-kwargs`), and would make what the model sees depend on each client (docs/serving.md).
VLLM_VIDEO_EXTRA_BODY: dict[str, Any] = {}
DIALECTS: tuple[str, ...] = ("vllm", "openai")
MAX_TOKENS_FIELDS: tuple[str, ...] = ("max_tokens", "max_completion_tokens")
AUTH_STATUSES = frozenset({401, 403})
_MODEL_NAME_CHARS = 200


class EndpointAuthError(RuntimeError):
    """The endpoint refused the API key (HTTP 401 or 403). `str(err)` is one line naming the fix."""


def _is_retryable_status(status: int) -> bool:
    return status == 429 or 500 <= status <= 599


def _lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text` (a JSON `"\\ud800"` escape), or None."""
    return next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)


class OpenAIBackend:
    """Chat completions on an OpenAI-compatible server, bounded concurrency, deadlines and retries.

    Args:
        base_url: the API root including `/v1`, e.g. "http://127.0.0.1:8000/v1".
        model: the served model name.
        max_concurrency: requests in flight at most (thread pool size and connection limit).
        deadlines: connect, first-byte and answer deadlines of each attempt (`inference.bounded_http.Deadlines`). A
            request past its first-byte or answer deadline is not retried (the same request would take as long
            again); a connect timeout is.
        retries: retries after the first attempt, on connection errors, HTTP 429 and 5xx only.
        max_tokens: generation length cap, sent as the field `max_tokens_field` names.
        api_key_env: environment variable holding the API key, sent as a bearer token when set; never logged.
        dialect: "vllm" (one `video_url` data URI of comma-separated frames) or "openai" (one `image_url` per frame,
            standard fields only); see the module docstring.
        max_tokens_field: "max_tokens" (default) or "max_completion_tokens" (OpenAI's newer models).
        extra_body: extra top-level request fields; default `VLLM_VIDEO_EXTRA_BODY` for the "vllm" dialect, none for
            "openai". Pass `{}` to send none.
        backoff_s: first retry delay; doubles per retry, with jitter, capped at `max_backoff_s`. A `Retry-After`
            header (seconds) is honoured up to `max_backoff_s`.
        max_backoff_s: longest delay between attempts.
        max_answer_bytes: the largest answer body read; a longer one is that row's `oversize response` error.

    Raises:
        ValueError: on bad limits, an unknown dialect or length field, or a key an HTTP header cannot carry.
    """

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        max_concurrency: int = 8,
        deadlines: Deadlines | None = None,
        retries: int = 3,
        max_tokens: int = 256,
        api_key_env: str = "OPENAI_API_KEY",
        dialect: Literal["vllm", "openai"] = "vllm",
        max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens",
        extra_body: Mapping[str, Any] | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        if max_concurrency < 1 or retries < 0 or max_tokens < 1 or max_answer_bytes < 1:
            raise ValueError(f"Bad limits: {max_concurrency=}, {retries=}, {max_tokens=}, {max_answer_bytes=}.")
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}; got {dialect!r}.")
        if max_tokens_field not in MAX_TOKENS_FIELDS:
            raise ValueError(f"max_tokens_field must be one of {MAX_TOKENS_FIELDS}; got {max_tokens_field!r}.")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.max_concurrency = max_concurrency
        self.deadlines = deadlines or Deadlines()
        self.retries = retries
        self.max_tokens = max_tokens
        self.dialect = dialect
        self.max_tokens_field = max_tokens_field
        default_extra = VLLM_VIDEO_EXTRA_BODY if dialect == "vllm" else {}
        self.extra_body = dict(default_extra if extra_body is None else extra_body)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_answer_bytes = max_answer_bytes
        self.api_key_env = api_key_env
        self._api_key = os.environ.get(api_key_env) or None
        if self._api_key is not None and not all(33 <= ord(ch) <= 126 for ch in self._api_key):
            raise ValueError(
                f"${api_key_env} holds a character an HTTP header cannot carry (a space, a line break or a non-ASCII "
                "character): set it to the key alone."
            )
        self._secrets = (self._api_key, f"Bearer {self._api_key}") if self._api_key else ()
        register_secrets(self._secrets)
        self._auth_failure: str | None = None  # set on the first 401/403: later requests are not sent
        self._client = make_client(max_concurrency, self.deadlines)
        logger.info(
            "OpenAIBackend: %s model=%s, dialect %s, concurrency %d, deadlines %s, API key from $%s: %s",
            self.url,
            model,
            dialect,
            max_concurrency,
            self.deadlines,
            api_key_env,
            "set" if self._api_key else "not set",
        )

    def __repr__(self) -> str:
        return (
            f"OpenAIBackend(url={self.url!r}, model={self.model!r}, dialect={self.dialect!r}, "
            f"max_concurrency={self.max_concurrency})"
        )

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()

    def __enter__(self) -> OpenAIBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def payload(self, request: InferenceRequest) -> dict[str, Any]:
        """Return the JSON body of one chat-completions call in the backend's dialect: the frames, then the prompt;
        greedy (`temperature=0`).

        "vllm": `{model, messages: [user: video_url, text], max_tokens, temperature, n, stream}`. "openai": `{model,
        messages: [user: image_url x N, text], max_tokens, temperature, stream}`.
        """
        b64 = [base64.b64encode(png).decode("ascii") for png in request.frames_png]
        if self.dialect == "vllm":
            parts: list[dict[str, Any]] = [
                {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(b64)}}
            ]
        else:
            parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b}"}} for b in b64]
        parts.append({"type": "text", "text": request.prompt})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": parts}],
            self.max_tokens_field: self.max_tokens,
            "temperature": 0.0,
        }
        if self.dialect == "vllm":
            body["n"] = 1
        body["stream"] = False
        body.update(copy.deepcopy(self.extra_body))
        return body

    def generate(self, requests: Sequence[InferenceRequest]) -> list[InferenceResult]:
        """Send the requests with at most `max_concurrency` in flight; return the results in request order.

        Raises:
            EndpointAuthError: on the first HTTP 401/403; requests not yet sent are cancelled, not tried.
        """
        if not requests:
            return []
        pool = ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(requests)))
        try:
            # Submitting inside the try: Ctrl-C can land in `submit` while it waits for a new worker to start, after
            # the thread runs but before the pool records it. Only the shutdown's wake-up on the shared queue ends
            # such a worker; without it, it waits for work forever and interpreter shutdown waits on it.
            futures = [pool.submit(self._one, request) for request in requests]
            return [future.result() for future in futures]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # after an auth error or Ctrl-C: drop the queued requests

    def probe(self, request: InferenceRequest) -> ProbeReport:
        """Check the endpoint with one row before a run (`inference.probe.run_probe`).

        Raises:
            EndpointAuthError: HTTP 401/403 (one line naming the key's variable).
            EndpointProbeError: any other failure (one line; `fix` names what to change).
        """
        return run_probe(self, request)

    def safe_text(self, text: str) -> str:
        """`text` writable as UTF-8 and with the key masked: what every message built from an answer goes through."""
        return mask(clean(text), self._secrets)

    def get(self, path: str, max_seconds: float = 10.0) -> Answer:
        """One GET of `path` under the server root (e.g. "/version"), no retries, deadlines capped at `max_seconds`."""
        root = self.url.removesuffix("/chat/completions").removesuffix("/v1")
        return exchange(
            self._client,
            "GET",
            root + path,
            deadlines=self.deadlines.capped(max_seconds),
            headers=self._headers(),
            max_bytes=self.max_answer_bytes,
        )

    def send(self, label: str, body: Mapping[str, Any]) -> tuple[Answer | None, str, int]:
        """POST `body` with retries; return (the HTTP 200 answer or None, the last error (masked), attempts made).

        Raises:
            EndpointAuthError: on HTTP 401/403 (and remembers it: later requests are not sent).
        """
        error = "not attempted"
        attempt = 0
        for attempt in range(1, self.retries + 2):
            answer = exchange(
                self._client,
                "POST",
                self.url,
                deadlines=self.deadlines,
                json_body=body,
                headers=self._headers(),
                max_bytes=self.max_answer_bytes,
            )
            if answer.error is not None:
                error, retry = self.safe_text(answer.error), answer.retryable
            elif answer.status == 200:
                return answer, "", attempt
            else:
                status = answer.status or 0
                error = f"HTTP {status}: {error_text(answer.body, self._secrets)}"
                if status in AUTH_STATUSES:
                    self._auth_failure = self._auth_message(error)
                    raise EndpointAuthError(self._auth_failure)
                retry = _is_retryable_status(status)
            if not retry:
                return None, error, attempt
            if attempt <= self.retries:
                delay = self._delay(attempt, answer)
                logger.warning("%s: attempt %d failed (%s); retrying in %.2f s", label, attempt, error, delay)
                time.sleep(delay)
        return None, error, attempt

    def answer_json(self, answer: Answer) -> tuple[Any, str | None]:
        """The answer's JSON, or (None, "malformed response: ...")."""
        data, problem = parse_json(answer.body)
        return (data, None) if problem is None else (None, f"malformed response: {problem}")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def _delay(self, attempt: int, answer: Answer) -> float:
        if after := answer.headers.get("retry-after"):
            try:
                return min(self.max_backoff_s, max(0.0, float(after)))
            except ValueError:
                pass  # an HTTP date (or junk): fall back to exponential backoff
        base = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return base * random.uniform(0.5, 1.0)

    def _one(self, request: InferenceRequest) -> InferenceResult:
        if self._auth_failure is not None:  # the key was refused already: do not send more
            raise EndpointAuthError(self._auth_failure)
        start = time.perf_counter()
        try:
            answer, error, attempt = self.send(request.request_id, self.payload(request))
            if answer is None:
                return self._result(request, None, error, start, attempt)
            text, model, problem = self.parse_answer(answer)
        except EndpointAuthError:
            raise
        except Exception as exc:  # noqa: BLE001 (a bug met on one answer is that row's error, never the run's end)
            error = f"unexpected error: {type(exc).__name__}: {self.safe_text(str(exc))[:200]}"
            logger.warning("%s: %s", request.request_id, error)
            return self._result(request, None, error, start, 1)
        return self._result(request, text, problem, start, attempt, model)

    def parse_answer(self, answer: Answer) -> tuple[str | None, str | None, str | None]:
        """Return (the answer's text, the model it names, None) or (None, None, "malformed response: ..."); masked."""
        data, error = self.answer_json(answer)
        if error is not None:
            return None, None, error
        try:
            text = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as exc:
            return None, None, f"malformed response: {type(exc).__name__}: {self.safe_text(str(exc))[:200]}"
        if not isinstance(text, str):
            return None, None, f"malformed response: content is {type(text).__name__}"
        if (at := _lone_surrogate(text)) is not None:
            where = f"U+{ord(text[at]):04X} at character {at}"
            return None, None, f"malformed response: content is not valid Unicode (a lone surrogate {where})"
        model = data.get("model") if isinstance(data, Mapping) else None
        model = self.safe_text(model)[:_MODEL_NAME_CHARS] if isinstance(model, str) else None
        return self.safe_text(text), model, None

    def _auth_message(self, error: str) -> str:
        """Return the one-line message of an auth failure (the key itself never appears)."""
        if self._api_key is None:
            fix = f"${self.api_key_env} is not set: set it to the endpoint's API key"
        else:
            fix = f"the key in ${self.api_key_env} was refused: set it to a valid key for this endpoint"
        text = self.safe_text(f"{self.url} refused the request ({error}); {fix}.")
        return " ".join(text.split())[:400]

    @staticmethod
    def _result(
        request: InferenceRequest,
        text: str | None,
        error: str | None,
        start: float,
        attempt: int,
        model: str | None = None,
    ) -> InferenceResult:
        return InferenceResult(request.request_id, text, error, time.perf_counter() - start, attempt, model)
