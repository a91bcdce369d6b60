"""Inference backends for hard-case mining: one interface, a local `transformers` checkpoint or an OpenAI endpoint.

Both backends take `InferenceRequest`s (a row's prompt and its frames as PNG bytes, frame 1 = most inferior) and return
one `InferenceResult` per request, in request order. A failure of one request never fails the batch: it becomes a
result with `text=None` and `error` set, so the caller (`inference.store.run_inference`) records it and moves on.

* `TransformersBackend`: a local checkpoint directory (written by `train.tooling.tiny`, `train.sft` or `train.grpo`), loaded
  with `train.data.load_model_and_processor`. The frames reach Qwen3-VL as one video through `train.data`'s CT encoder
  and chat layout (`render_prompt_text`), exactly as in training. Decoding is greedy, batched with left padding, and
  the four vision tokens are suppressed (`training.md` §6.5); the text is decoded with `skip_special_tokens=True`.
* `OpenAIBackend`: an OpenAI-compatible `/v1/chat/completions` endpoint such as `vllm serve`. Requests run on a bounded
  thread pool; each has a timeout and is retried with exponential backoff on connection errors, HTTP 5xx and 429 only.
  HTTP 401/403 (a missing or wrong API key) is the exception to "one failure never fails the batch": it raises
  `EndpointAuthError` with a one-line message on the first occurrence, and the requests not yet sent are cancelled,
  since every other row would fail the same way. (Why a hand-written client and not the `openai` SDK:
  `docs/decisions.md`, "OpenAI-compatible client".)

How the frames are sent to an OpenAI-compatible server (`dialect`; `docs/serving.md` says which to use where):

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

`OpenAIBackend.probe` sends one row twice before a run (with fewer and with more frames): it checks the endpoint, the
model name, the key and, when the server reports `usage.prompt_tokens`, that the frames reach the model (the prompt
grows with the frame count). A failure raises `EndpointProbeError` with a one-line problem and a one-line fix.
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

# Extra per-request fields of the "vllm" dialect: none. The video settings are the server's, fixed at launch
# (`inference.vllm_server`): per-request `mm_processor_kwargs` / `media_io_kwargs` would need the server to trust every
# client (`--trust-request-mm-kwargs`), and would make what the model sees depend on each client (docs/serving.md).
VLLM_VIDEO_EXTRA_BODY: dict[str, Any] = {}
# The vLLM releases the "vllm" dialect and the served layout were verified with (`inference.vllm_server`).
SUPPORTED_VLLM = ((0, 32), (0, 33))
SUPPORTED_VLLM_TEXT = ">=0.32,<0.33"
SERVE_HINT = "make vllm-serve CKPT=DIR (python -m inference.vllm_server DIR; docs/serving.md)"
_DTYPES = ("auto", "float32", "bfloat16", "float16")
DIALECTS: tuple[str, ...] = ("vllm", "openai")
MAX_TOKENS_FIELDS: tuple[str, ...] = ("max_tokens", "max_completion_tokens")
# Frame counts of the probe's two requests, 2 then 4 in both dialects: Qwen3-VL groups video frames in pairs (temporal
# patch 2), so 1 and 2 frames make the same number of video tokens, and a server may feed N images as one video.
PROBE_FRAME_COUNTS: dict[str, tuple[int, int]] = {"openai": (2, 4), "vllm": (2, 4)}
PROBE_MAX_TOKENS = 16


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

    def count_prompt_tokens(self, request: InferenceRequest, *, with_frames: bool = True) -> int:
        """Return the length in tokens of the request's prompt as the model sees it (chat layout, video expanded).

        Args:
            request: the request.
            with_frames: False counts the prompt a text-only server would build (the frames dropped).
        """
        from train.data import frames_to_array, render_prompt_text  # noqa: PLC0415

        if not with_frames:
            msgs = [{"role": "user", "content": [{"type": "text", "text": request.prompt}]}]
            text = self.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            return len(self.processor.tokenizer(text)["input_ids"])
        video = frames_to_array([{"bytes": b} for b in request.frames_png])
        batch = self.processor(text=[render_prompt_text(self.processor, request.prompt)], videos=[video])
        return len(batch["input_ids"][0])

    def count_text_tokens(self, text: str | None) -> int:
        """Return the number of tokens of a generated text (0 for None)."""
        return 0 if text is None else len(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])

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


class EndpointProbeError(RuntimeError):
    """The probe before a run failed. `str(err)` is one line naming the problem; `fix` is one line naming the fix."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(" ".join(problem.split())[:400])
        self.fix = " ".join(fix.split())[:300]


@dataclass(frozen=True, slots=True)
class ProbeReport:
    """What the probe saw.

    Attributes:
        frame_counts: the frame counts of its two requests.
        prompt_tokens: `usage.prompt_tokens` of each request, None where the server reported no usage.
        text: the answer to the second request.
        seconds: wall time of both requests.
    """

    frame_counts: tuple[int, int]
    prompt_tokens: tuple[int | None, int | None]
    text: str
    seconds: float

    @property
    def usage_reported(self) -> bool:
        """True when the server reported the prompt tokens of both requests."""
        return None not in self.prompt_tokens


AUTH_STATUSES = frozenset({401, 403})


def _is_retryable_status(status: int) -> bool:
    return status == 429 or 500 <= status <= 599


def _error_message(resp: httpx.Response) -> str:
    """Return the server's error message, shortened: OpenAI `{"error": {"message"}}`, vLLM `{"message"}` or FastAPI's
    `{"detail"}` (`transformers serve`)."""
    try:
        body = resp.json()
        msg = body.get("error", body.get("detail", body))
        msg = msg.get("message", msg) if isinstance(msg, Mapping) else msg
    except Exception:  # noqa: BLE001 (any non-JSON body)
        msg = resp.text
    return str(msg)[:300]


class OpenAIBackend:
    """Chat completions on an OpenAI-compatible server, bounded concurrency, timeouts and retries.

    Args:
        base_url: the API root including `/v1`, e.g. "http://127.0.0.1:8000/v1".
        model: the served model name.
        max_concurrency: requests in flight at most (thread pool size and connection limit).
        timeout_s: per-attempt timeout (connect, write, and the wait for the non-streamed answer). A timed-out
            request is not retried (the same request would time out again); a connect timeout is.
        retries: retries after the first attempt, on connection errors, HTTP 429 and 5xx only.
        max_tokens: generation length cap, sent as the field `max_tokens_field` names.
        api_key_env: environment variable holding the API key, sent as a bearer token when set; never logged.
        dialect: "vllm" (one `video_url` data URI of comma-separated frames plus vLLM's per-request fields) or
            "openai" (one `image_url` per frame, standard fields only); see the module docstring.
        max_tokens_field: "max_tokens" (default) or "max_completion_tokens" (OpenAI's newer models).
        extra_body: extra top-level request fields; default `VLLM_VIDEO_EXTRA_BODY` for the "vllm" dialect, none for
            "openai". Pass `{}` to send none.
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
        dialect: Literal["vllm", "openai"] = "vllm",
        max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens",
        extra_body: Mapping[str, Any] | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ) -> None:
        if max_concurrency < 1 or retries < 0 or max_tokens < 1 or timeout_s <= 0:
            raise ValueError(f"Bad limits: {max_concurrency=}, {retries=}, {max_tokens=}, {timeout_s=}.")
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}; got {dialect!r}.")
        if max_tokens_field not in MAX_TOKENS_FIELDS:
            raise ValueError(f"max_tokens_field must be one of {MAX_TOKENS_FIELDS}; got {max_tokens_field!r}.")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.max_concurrency = max_concurrency
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.max_tokens = max_tokens
        self.dialect = dialect
        self.max_tokens_field = max_tokens_field
        default_extra = VLLM_VIDEO_EXTRA_BODY if dialect == "vllm" else {}
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
            "OpenAIBackend: %s model=%s, dialect %s, concurrency %d, API key from $%s: %s",
            self.url,
            model,
            dialect,
            max_concurrency,
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

        "vllm": `{model, messages: [user: video_url, text], max_tokens, temperature, n, stream}`. "openai": `{model, messages: [user: image_url x N, text], max_tokens, temperature, stream}`.
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
        """Send one row twice, with fewer then more frames (`PROBE_FRAME_COUNTS`), before a run sends every row.

        Checks, in one or two requests: that the endpoint answers, that it serves `model` under that name, that it
        accepts the key and the dialect's request, that the answer has a text, and, when the server reports
        `usage.prompt_tokens` for both, that the prompt grows with the frame count (the frames reach the model).
        When usage is absent it logs a warning and passes. Frames are reused in order when the row has fewer.

        Raises:
            EndpointAuthError: HTTP 401/403 (one line naming the key's variable).
            EndpointProbeError: any other failure (one line; `fix` names what to change).
        """
        start = time.perf_counter()
        counts = PROBE_FRAME_COUNTS[self.dialect]
        tokens: list[int | None] = []
        text = ""
        is_vllm = self.dialect == "vllm" and self._check_vllm_version()
        for n in counts:
            frames = [request.frames_png[i % len(request.frames_png)] for i in range(n)]
            body = self.payload(InferenceRequest(f"{request.request_id}#probe{n}", request.prompt, frames))
            body[self.max_tokens_field] = min(self.max_tokens, PROBE_MAX_TOKENS)
            if is_vllm:
                body["return_token_ids"] = True  # vLLM answers with the prompt's token ids: the layout is checked
            resp, error, _ = self._send(f"probe ({n} frames)", body)
            if resp is None:
                raise EndpointProbeError(f"{self._what()} failed: {error}", self._probe_fix(error))
            text, prompt_tokens = self._probe_answer(resp)
            tokens.append(prompt_tokens)
            if is_vllm:
                self._check_video_layout(resp)
        report = ProbeReport(counts, (tokens[0], tokens[1]), text, time.perf_counter() - start)
        if not report.usage_reported:
            logger.warning(
                "%s: the server reports no usage.prompt_tokens, so the probe cannot check that the frames reach the "
                "model; going on.",
                self._what(),
            )
        elif tokens[1] <= tokens[0]:  # type: ignore[operator]
            raise EndpointProbeError(
                f"{self._what()}: the frames do not reach the model: {tokens[0]} prompt tokens with {counts[0]} "
                f"frame(s) and {tokens[1]} with {counts[1]} (the server dropped the {self._media()})",
                "serve a vision checkpoint whose processor the server loads (transformers serve: processor_class "
                "Qwen3VLProcessor, see docs/serving.md), and check --dialect",
            )
        return report

    def _check_vllm_version(self) -> bool:
        """Refuse a vLLM outside `SUPPORTED_VLLM`; return whether the server reported a vLLM version (`GET /version`).

        Raises:
            EndpointProbeError: a reported version outside the supported range.
        """
        root = self.url.removesuffix("/chat/completions").removesuffix("/v1")
        try:
            resp = self._client.get(root + "/version", timeout=min(self.timeout_s, 10.0))
            version = resp.json().get("version") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return False  # not vLLM, or no version endpoint: the requests will tell
        if not isinstance(version, str):
            return False
        parts = version.split(".")
        try:
            major_minor = (int(parts[0]), int(parts[1]))
        except (IndexError, ValueError):
            return False
        if not SUPPORTED_VLLM[0] <= major_minor < SUPPORTED_VLLM[1]:
            raise EndpointProbeError(
                f"{self._what()}: the server runs vLLM {version}, outside the supported range {SUPPORTED_VLLM_TEXT}",
                f"serve with vLLM{SUPPORTED_VLLM_TEXT} (GPU: pip install 'vllm{SUPPORTED_VLLM_TEXT}'; CPU: {SERVE_HINT})",
            )
        return True

    def _check_video_layout(self, resp: httpx.Response) -> None:
        """When vLLM returns the prompt's token ids: every `<|vision_start|>` must open a run of video tokens.

        A server started without the serving chat template wraps the whole video in one more start/end pair than
        training (`inference.vllm_server.serving_chat_template`): that start is followed by a timestamp, not by
        video tokens. The vision tokens are found without a tokenizer: the video tokens are the longest run of one
        id, the start token the id before it.
        """
        try:
            ids = resp.json().get("prompt_token_ids")
        except (ValueError, AttributeError):
            return
        if not isinstance(ids, list) or len(ids) < 3:
            return
        best, best_len, i = 0, 0, 0
        while i < len(ids):
            j = i
            while j < len(ids) and ids[j] == ids[i]:
                j += 1
            if j - i > best_len:
                best, best_len = i, j - i
            i = j
        if best_len < 2 or best == 0:
            return  # no recognisable run of video tokens (e.g. frames of one token): nothing to check
        video, start = ids[best], ids[best - 1]
        opened = [ids[k + 1] if k + 1 < len(ids) else None for k, t in enumerate(ids) if t == start]
        if any(nxt != video for nxt in opened):
            raise EndpointProbeError(
                f"{self._what()}: the server wraps the video in an extra <|vision_start|>…<|vision_end|> pair "
                f"({len(opened)} vision starts for {sum(1 for nxt in opened if nxt == video)} frame pair(s)), "
                "so the model does not see the training layout",
                f"start vLLM with the chat template inference.vllm_server writes (--chat-template): {SERVE_HINT}",
            )

    def _what(self) -> str:
        return f"probe of {self.url} (model {self.model!r}, dialect {self.dialect})"

    def _media(self) -> str:
        return "video" if self.dialect == "vllm" else "images"

    def _probe_answer(self, resp: httpx.Response) -> tuple[str, int | None]:
        """Return the answer's text and `usage.prompt_tokens` (None when absent); raise on a malformed answer."""
        try:
            body = resp.json()
            text = body["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            problem = f"{self._what()}: malformed answer ({type(exc).__name__}: {exc})"
            raise EndpointProbeError(problem, "point --endpoint at an OpenAI-compatible /v1 base URL") from None
        if not isinstance(text, str):
            problem = f"{self._what()}: the answer's content is {type(text).__name__}, not text"
            raise EndpointProbeError(problem, "point --endpoint at an OpenAI-compatible /v1 base URL")
        usage = body.get("usage") if isinstance(body, Mapping) else None
        tokens = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
        return text, tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None

    def _probe_fix(self, error: str) -> str:
        """The fix line for a failed probe request, from its error."""
        low = error.lower()
        if error.startswith(("connection error", "timeout")):
            return "start the server or fix --endpoint (the base URL including /v1)"
        client_error = error.startswith(("HTTP 400", "HTTP 404", "HTTP 422"))
        if error.startswith("HTTP 404") or (client_error and ("model" in low or "pinned" in low)):
            return "pass the name the server serves as --endpoint-model (transformers serve: the path it was given)"
        if self.dialect == "vllm" and (client_error or error.startswith("HTTP 5")):
            return self._vllm_refusal_fix(low)
        if client_error and "max_tokens" in low:
            return "this model wants the length cap as max_completion_tokens: --max-tokens-field max_completion_tokens"
        return "check the server's log, --endpoint, --endpoint-model and --dialect, then rerun"

    def _vllm_refusal_fix(self, low: str) -> str:
        """The fix for a refused "vllm"-dialect request: always a way to send the video, never the "openai" dialect
        (N images: not the input our checkpoints were trained on)."""
        if "trust-request-mm-kwargs" in low or "per-request" in low:
            return (
                "send no per-request mm_processor_kwargs/media_io_kwargs (the default); the server's launch flags "
                f"carry them: {SERVE_HINT}"
            )
        if "at most" in low or "limit" in low or "video" in low and "not supported" in low:
            return f"start vLLM with --limit-mm-per-prompt '{{\"video\": 1}}' (and the other flags of {SERVE_HINT})"
        return (
            "this server does not take the frames as one video (its log says why), the input our checkpoints were "
            f"trained on: serve the checkpoint with vLLM, {SERVE_HINT} (--dialect openai would send N images, a "
            "different input)"
        )

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
        resp, error, attempt = self._send(request.request_id, self.payload(request))
        if resp is None:
            return self._result(request, None, error, start, attempt)
        return self._parse(request, resp, start, attempt)

    def _send(self, label: str, body: Mapping[str, Any]) -> tuple[httpx.Response | None, str, int]:
        """POST `body` with retries; return (the HTTP 200 response or None, the last error, attempts made).

        Raises:
            EndpointAuthError: on HTTP 401/403 (and remembers it: later requests are not sent).
        """
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        error = "not attempted"
        attempt = 0
        for attempt in range(1, self.retries + 2):
            resp: httpx.Response | None = None
            try:
                resp = self._client.post(self.url, json=body, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                error = f"connection error: {type(exc).__name__}: {exc}"
            except httpx.TimeoutException:
                return None, f"timeout after {self.timeout_s:.1f} s", attempt
            except httpx.TransportError as exc:  # the connection broke (reset, closed mid-response)
                error = f"connection error: {type(exc).__name__}: {exc}"
            else:
                if resp.status_code == 200:
                    return resp, "", attempt
                error = f"HTTP {resp.status_code}: {_error_message(resp)}"
                if resp.status_code in AUTH_STATUSES:
                    self._auth_failure = self._auth_message(error)
                    raise EndpointAuthError(self._auth_failure)
                if not _is_retryable_status(resp.status_code):
                    return None, error, attempt
            if attempt <= self.retries:
                delay = self._delay(attempt, resp)
                logger.warning("%s: attempt %d failed (%s); retrying in %.2f s", label, attempt, error, delay)
                time.sleep(delay)
        return None, error, attempt

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
