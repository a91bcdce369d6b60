"""Inference backends for hard-case mining: one interface, a local `transformers` checkpoint or an OpenAI endpoint.

Both backends take `InferenceRequest`s (a row's prompt and its frames as PNG bytes, frame 1 = most inferior) and return
one `InferenceResult` per request, in request order. A failure of one request never fails the batch: it becomes a
result with `text=None` and `error` set, so the caller (`inference.store.run_inference`) records it and moves on.

* `TransformersBackend`: a local checkpoint directory (written by `train.tiny`, `train.sft` or `train.grpo`), loaded
  with `train.data.load_model_and_processor`. The frames reach Qwen3-VL as one video through `train.data`'s CT encoder
  and chat layout (`render_prompt_text`), exactly as in training. Decoding is greedy, batched with left padding, and
  the four vision tokens are suppressed (`training.md` §6.5); the text is decoded with `skip_special_tokens=True`.
* `OpenAIBackend`: an OpenAI-compatible `/v1/chat/completions` endpoint such as `vllm serve`. Requests run on a bounded
  thread pool; each has a timeout and is retried with exponential backoff on connection errors, HTTP 5xx and 429 only.
  HTTP 401/403 (a missing or wrong API key) is the exception to "one failure never fails the batch": it raises
  `EndpointAuthError` with a one-line message on the first occurrence, and the requests not yet sent are cancelled,
  since every other row would fail the same way. (Why a hand-written client and not the `openai` SDK:
  `docs/decisions.md`, "OpenAI-compatible client".)

How the frames are sent to an OpenAI-compatible server (`frames_as`):

* `"video"` (default): one `video_url` part whose URL is `data:video/jpeg;base64,<frame 1>,<frame 2>,...` (each frame
  base64 PNG bytes, comma separated), then the prompt text: the same user turn as training (video first, then text).
  This is vLLM's frame-sequence video format (`VideoMediaIO.load_base64` splits on commas when the media type is
  `video/jpeg` and opens every frame with PIL, so lossless PNG frames are accepted; metadata `fps=1`,
  `frames_indices=range(N)`, `do_sample_frames=False`), which gives the timestamps `(2j + 0.5)` seconds of our encoder.
  For Qwen3-VL, vLLM needs: `--limit-mm-per-prompt '{"video": 1}'`, `--media-io-kwargs '{"video": {"num_frames": -1}}'`
  (else only the first 32 frames are kept), and no frame resampling or pixel-budget shrinking, which
  `VLLM_VIDEO_EXTRA_BODY` asks for per request (`mm_processor_kwargs`, `media_io_kwargs`). vLLM expands the chat
  template's `<|vision_start|><|video_pad|><|vision_end|>` triple the way `train.data` does (the reference layout;
  `training.md` §4). Token-id equality with training is still a GPU check (`training.md` §7 (a)).
* `"images"`: one `image_url` part (`data:image/png;base64,...`) per frame, then the text. Any vision server accepts
  this, but Qwen3-VL then sees N separate images (each frame duplicated in time), not the video it was trained on.
"""

from __future__ import annotations

import base64
import copy
import io
import logging
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import httpx

from emrl_data.types import row_id


logger = logging.getLogger(__name__)

# Per-request fields that make vLLM keep every CT frame at its own size (see the module docstring); other
# OpenAI-compatible servers ignore unknown fields or need `extra_body={}`.
VLLM_VIDEO_EXTRA_BODY: dict[str, Any] = {
    "mm_processor_kwargs": {
        "do_sample_frames": False,
        "size": {"shortest_edge": 32 * 32, "longest_edge": 1 << 30},  # a pixel budget that never resizes a frame
    },
    "media_io_kwargs": {"video": {"num_frames": -1, "fps": 1}},
}
_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One model call: a row's prompt and its frames.

    Attributes:
        request_id: unique key of the request in a run, e.g. `emrl_data.types.row_id(case_id, organ)`.
        prompt: the row's `prompt` (user text; it does not reference the frames itself).
        frames_png: the row's frames as 8-bit grayscale PNG bytes, frame 1 (most inferior) first.
    """

    request_id: str
    prompt: str
    frames_png: list[bytes]

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string; got {self.request_id!r}.")


@dataclass(frozen=True, slots=True)
class InferenceResult:
    """The outcome of one request.

    Attributes:
        request_id: the request's id.
        text: the generated text (special tokens removed), or None on failure.
        error: None on success, else a short reason ("timeout after 120.0 s", "HTTP 400: ...", "bad frames: ...").
        seconds: wall time spent on the request (for a batched local call: the wall time of its batch).
        attempts: HTTP attempts made (1 + retries used); 1 for a local call (2 when a failed batch was redone alone).
    """

    request_id: str
    text: str | None
    error: str | None
    seconds: float
    attempts: int

    @property
    def ok(self) -> bool:
        """True when the request produced text."""
        return self.error is None


@runtime_checkable
class InferenceBackend(Protocol):
    """What `run_inference` needs: a name and a batched `generate` that keeps the order of its requests."""

    name: str

    def generate(self, requests: Sequence[InferenceRequest]) -> list[InferenceResult]:
        """Return one result per request, in the order of `requests`; never raise for a single bad request."""
        ...


def _frame_png(frame: Any) -> bytes:
    """Return PNG bytes of one frame: raw bytes, a Hub image struct `{"bytes", "path"}` or a PIL image."""
    if isinstance(frame, bytes | bytearray | memoryview):
        return bytes(frame)
    if isinstance(frame, Mapping):
        if frame.get("bytes") is None:
            raise ValueError(f"image struct without bytes (path={frame.get('path')!r}).")
        return bytes(frame["bytes"])
    from PIL import Image  # noqa: PLC0415 (only rows decoded by `datasets` need it)

    if isinstance(frame, Image.Image):
        buf = io.BytesIO()
        frame.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"Unsupported frame type {type(frame).__name__}; expected bytes, an image struct or a PIL image.")


def request_from_row(row: Mapping[str, Any]) -> InferenceRequest:
    """Return the request of one `sft` row: id `row_id(case_id, organ)`, its prompt and its frames.

    Args:
        row: a row with `case_id`, `organ`, `prompt` and `frames` (Hub image structs as read by pyarrow, or PIL images
            as decoded by `datasets`), frames in order 1..N (inferior -> superior).
    """
    return InferenceRequest(
        request_id=row_id(row["case_id"], row["organ"]),
        prompt=row["prompt"],
        frames_png=[_frame_png(f) for f in row["frames"]],
    )


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class TransformersBackend:
    """Greedy Qwen3-VL generation from a local checkpoint directory, the frames fed as one video (as in training).

    Args:
        model_path: a local directory with the model and `CTQwen3VLProcessor` files. Hub ids are refused on purpose:
            mining must run a checkpoint that exists on disk (and tests must never download).
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
        batch_size: requests per `model.generate` call (left padding; results do not depend on it).
        max_new_tokens: generation length cap.
        dtype: "auto" (the checkpoint's dtype), "float32", "bfloat16" or "float16".

    Raises:
        FileNotFoundError: when `model_path` is not a local directory.
        ValueError: on a bad `batch_size`, `max_new_tokens` or `dtype`.
    """

    name = "transformers"

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "auto",
        batch_size: int = 4,
        max_new_tokens: int = 256,
        dtype: str = "auto",
    ) -> None:
        import torch  # noqa: PLC0415 (the OpenAI backend and the store must not need torch)

        from train.data import load_model_and_processor  # noqa: PLC0415

        if not Path(model_path).is_dir():
            raise FileNotFoundError(f"model_path must be a local checkpoint directory; {model_path!r} is not one.")
        if batch_size < 1 or max_new_tokens < 1:
            raise ValueError(f"batch_size and max_new_tokens must be >= 1; got {batch_size=}, {max_new_tokens=}.")
        if dtype not in _DTYPES:
            raise ValueError(f"Unknown {dtype=}; valid values are {_DTYPES}.")
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        self.model_path = str(model_path)
        model, processor = load_model_and_processor(
            model_path, dtype=dtype if dtype == "auto" else getattr(torch, dtype)
        )
        self.model = model.to(self.device).eval()
        self.processor = processor
        self.processor.tokenizer.padding_side = "left"
        gen = copy.deepcopy(self.model.generation_config)
        # Greedy; sampling knobs of an instruct checkpoint's generation_config are cleared so they cannot leak in.
        gen.update(do_sample=False, num_beams=1, temperature=None, top_p=None, top_k=None)
        gen.suppress_tokens = sorted(set(gen.suppress_tokens or []) | set(processor.vision_token_ids))
        if gen.pad_token_id is None:
            gen.pad_token_id = processor.tokenizer.pad_token_id
        gen.max_new_tokens = self.max_new_tokens
        self.generation_config = gen
        self._lock = threading.Lock()  # one generate at a time on the shared model
        logger.info("TransformersBackend: %s on %s (dtype %s)", model_path, self.device, self.model.dtype)

    def generate(
        self, requests: Sequence[InferenceRequest], *, max_new_tokens: int | None = None
    ) -> list[InferenceResult]:
        """Generate one greedy report per request, `batch_size` requests per model call, order kept.

        Args:
            requests: the requests.
            max_new_tokens: overrides the backend's cap for this call (the test server passes `max_tokens`).

        Returns:
            One result per request. A request whose frames do not decode, or that fails alone, gets `error` set; when a
            whole batch fails (e.g. out of memory) its requests are redone one by one (`attempts=2`).
        """
        cap = max_new_tokens or self.max_new_tokens
        out: list[InferenceResult] = []
        with self._lock:
            for chunk in _chunks(requests, self.batch_size):
                out.extend(self._generate_chunk(chunk, cap))
        return out

    def _generate_chunk(self, chunk: Sequence[InferenceRequest], cap: int) -> list[InferenceResult]:
        from train.data import frames_to_array  # noqa: PLC0415

        start = time.perf_counter()
        errors: dict[int, str] = {}
        videos: dict[int, Any] = {}
        for i, req in enumerate(chunk):
            try:
                videos[i] = frames_to_array([{"bytes": b} for b in req.frames_png])
            except Exception as exc:  # noqa: BLE001 (PIL raises several types; one bad row must not fail the batch)
                errors[i] = f"bad frames: {type(exc).__name__}: {exc}"
        texts: dict[int, str] = {}
        attempts = 1
        ok = sorted(videos)
        if ok:
            try:
                texts = dict(
                    zip(ok, self._run([chunk[i].prompt for i in ok], [videos[i] for i in ok], cap), strict=True)
                )
            except Exception as exc:  # noqa: BLE001 (OOM, shape errors: isolate the failing request)
                if len(ok) == 1:
                    errors[ok[0]] = f"generation failed: {type(exc).__name__}: {exc}"
                else:
                    logger.warning("A batch of %d failed (%s); redoing its requests one by one.", len(ok), exc)
                    attempts = 2
                    for i in ok:
                        try:
                            texts[i] = self._run([chunk[i].prompt], [videos[i]], cap)[0]
                        except Exception as exc_one:  # noqa: BLE001
                            errors[i] = f"generation failed: {type(exc_one).__name__}: {exc_one}"
        seconds = time.perf_counter() - start
        return [
            InferenceResult(req.request_id, texts.get(i), errors.get(i), seconds, attempts if i in ok else 1)
            for i, req in enumerate(chunk)
        ]

    def _run(self, prompts: list[str], videos: list[Any], cap: int) -> list[str]:
        """Return the greedy texts of one left-padded batch (prompts rendered exactly as in training)."""
        import torch  # noqa: PLC0415

        from train.data import render_prompt_text  # noqa: PLC0415

        texts = [render_prompt_text(self.processor, p) for p in prompts]
        batch = self.processor(text=texts, videos=videos, padding=True, return_tensors="pt").to(self.device)
        with torch.inference_mode():
            config = self.generation_config
            if cap != config.max_new_tokens:  # one config object, not config + kwargs (deprecated in transformers 5)
                config = copy.deepcopy(config)
                config.max_new_tokens = cap
            out = self.model.generate(**batch, generation_config=config)
        new_tokens = out[:, batch["input_ids"].shape[1] :]
        return self.processor.batch_decode(new_tokens, skip_special_tokens=True)


class EndpointAuthError(RuntimeError):
    """The endpoint refused the API key (HTTP 401 or 403). `str(err)` is one line naming the fix."""


AUTH_STATUSES = frozenset({401, 403})


def _is_retryable_status(status: int) -> bool:
    return status == 429 or 500 <= status <= 599


def _error_message(resp: httpx.Response) -> str:
    """Return the server's error message (OpenAI `{"error": {"message"}}` or vLLM `{"message"}`), shortened."""
    try:
        body = resp.json()
        msg = body.get("error", body)
        msg = msg.get("message", msg) if isinstance(msg, Mapping) else msg
    except Exception:  # noqa: BLE001 (any non-JSON body)
        msg = resp.text
    return str(msg)[:300]


class OpenAIBackend:
    """Chat completions on an OpenAI-compatible server (`vllm serve`), bounded concurrency, timeouts and retries.

    Args:
        base_url: the API root including `/v1`, e.g. "http://127.0.0.1:8000/v1".
        model: the served model name.
        max_concurrency: requests in flight at most (thread pool size and connection limit).
        timeout_s: per-attempt timeout (connect, write, and the wait for the non-streamed answer). A timed-out
            request is not retried (the same request would time out again); a connect timeout is.
        retries: retries after the first attempt, on connection errors, HTTP 429 and 5xx only.
        max_tokens: generation length cap sent as `max_tokens`.
        api_key_env: environment variable holding the API key, sent as a bearer token when set; never logged.
        frames_as: "video" (one `video_url` data URI of comma-separated frames) or "images" (one `image_url` per
            frame); see the module docstring.
        extra_body: extra top-level request fields; default `VLLM_VIDEO_EXTRA_BODY` when `frames_as="video"`, else
            none. Pass `{}` to send none.
        backoff_s: first retry delay; doubles per retry, with jitter, capped at `max_backoff_s`. A `Retry-After`
            header (seconds) is honoured up to `max_backoff_s`.
        max_backoff_s: longest delay between attempts.
    """

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        max_concurrency: int = 8,
        timeout_s: float = 120,
        retries: int = 3,
        max_tokens: int = 256,
        api_key_env: str = "OPENAI_API_KEY",
        frames_as: Literal["video", "images"] = "video",
        extra_body: Mapping[str, Any] | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ) -> None:
        if max_concurrency < 1 or retries < 0 or max_tokens < 1 or timeout_s <= 0:
            raise ValueError(f"Bad limits: {max_concurrency=}, {retries=}, {max_tokens=}, {timeout_s=}.")
        if frames_as not in ("video", "images"):
            raise ValueError(f"frames_as must be 'video' or 'images'; got {frames_as!r}.")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.max_concurrency = max_concurrency
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.max_tokens = max_tokens
        self.frames_as = frames_as
        default_extra = VLLM_VIDEO_EXTRA_BODY if frames_as == "video" else {}
        self.extra_body = dict(default_extra if extra_body is None else extra_body)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.api_key_env = api_key_env
        self._api_key = os.environ.get(api_key_env) or None
        self._auth_failure: str | None = None  # set on the first 401/403: later requests are not sent
        self._client = httpx.Client(
            timeout=httpx.Timeout(self.timeout_s),
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency),
        )
        logger.info(
            "OpenAIBackend: %s model=%s, concurrency %d, API key from $%s: %s",
            self.url,
            model,
            max_concurrency,
            api_key_env,
            "set" if self._api_key else "not set",
        )

    def __repr__(self) -> str:
        return f"OpenAIBackend(url={self.url!r}, model={self.model!r}, max_concurrency={self.max_concurrency})"

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()

    def __enter__(self) -> OpenAIBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def payload(self, request: InferenceRequest) -> dict[str, Any]:
        """Return the JSON body of one chat-completions call: the frames, then the prompt; greedy (`temperature=0`)."""
        b64 = [base64.b64encode(png).decode("ascii") for png in request.frames_png]
        if self.frames_as == "video":
            parts: list[dict[str, Any]] = [
                {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(b64)}}
            ]
        else:
            parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b}"}} for b in b64]
        parts.append({"type": "text", "text": request.prompt})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": parts}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "n": 1,
            "stream": False,
        }
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
        futures = [pool.submit(self._one, request) for request in requests]
        try:
            return [future.result() for future in futures]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # after an auth error: drop the queued requests

    def _delay(self, attempt: int, resp: httpx.Response | None) -> float:
        if resp is not None and (after := resp.headers.get("retry-after")):
            try:
                return min(self.max_backoff_s, max(0.0, float(after)))
            except ValueError:
                pass  # an HTTP date: fall back to exponential backoff
        base = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return base * random.uniform(0.5, 1.0)

    def _one(self, request: InferenceRequest) -> InferenceResult:
        if self._auth_failure is not None:  # the key was refused already: do not send more
            raise EndpointAuthError(self._auth_failure)
        start = time.perf_counter()
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        body = self.payload(request)
        error = "not attempted"
        attempt = 0
        for attempt in range(1, self.retries + 2):
            resp: httpx.Response | None = None
            try:
                resp = self._client.post(self.url, json=body, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                error = f"connection error: {type(exc).__name__}: {exc}"
            except httpx.TimeoutException:
                return self._result(request, None, f"timeout after {self.timeout_s:.1f} s", start, attempt)
            except httpx.TransportError as exc:  # the connection broke (reset, closed mid-response)
                error = f"connection error: {type(exc).__name__}: {exc}"
            else:
                if resp.status_code == 200:
                    return self._parse(request, resp, start, attempt)
                error = f"HTTP {resp.status_code}: {_error_message(resp)}"
                if resp.status_code in AUTH_STATUSES:
                    self._auth_failure = self._auth_message(error)
                    raise EndpointAuthError(self._auth_failure)
                if not _is_retryable_status(resp.status_code):
                    return self._result(request, None, error, start, attempt)
            if attempt <= self.retries:
                delay = self._delay(attempt, resp)
                logger.warning(
                    "%s: attempt %d failed (%s); retrying in %.2f s", request.request_id, attempt, error, delay
                )
                time.sleep(delay)
        return self._result(request, None, error, start, attempt)

    def _auth_message(self, error: str) -> str:
        """Return the one-line message of an auth failure (the key itself never appears)."""
        if self._api_key is None:
            fix = f"${self.api_key_env} is not set: set it to the endpoint's API key"
        else:
            fix = f"the key in ${self.api_key_env} was refused: set it to a valid key for this endpoint"
        text = f"{self.url} refused the request ({error}); {fix}."
        if self._api_key:
            text = text.replace(self._api_key, "***")  # a server may echo the key back
        return " ".join(text.split())[:400]

    def _parse(self, request: InferenceRequest, resp: httpx.Response, start: float, attempt: int) -> InferenceResult:
        try:
            text = resp.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return self._result(request, None, f"malformed response: {type(exc).__name__}: {exc}", start, attempt)
        if not isinstance(text, str):
            return self._result(request, None, f"malformed response: content is {type(text).__name__}", start, attempt)
        return self._result(request, text, None, start, attempt)

    @staticmethod
    def _result(
        request: InferenceRequest, text: str | None, error: str | None, start: float, attempt: int
    ) -> InferenceResult:
        return InferenceResult(request.request_id, text, error, time.perf_counter() - start, attempt)
