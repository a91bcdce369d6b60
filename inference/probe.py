"""The probe before a mining run: one row sent twice to the endpoint, and a one-line problem and fix if it fails.

`run_probe` (behind `OpenAIBackend.probe`) sends the row with fewer then more frames (`PROBE_FRAME_COUNTS`) and checks
that the endpoint answers, that it serves the model under that name, that it accepts the key and the dialect's request,
that the answer has a text and, when the server reports `usage.prompt_tokens`, that the frames reach the model (the
prompt grows with the frame count). In the "vllm" dialect it also reads the server's version (`GET /version`) and the
prompt's token ids (`return_token_ids`) to check the video layout. A failure raises `EndpointProbeError`.

The backend is duck-typed (`inference.openai_client.OpenAIBackend`): this module needs its `payload`, `send`, `get`,
`answer_json`, `safe_text` and settings, and imports nothing of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inference.requests import InferenceRequest
from model_io import vllm_support  # the releases the served layout was verified with, and the version parser


logger = logging.getLogger(__name__)

SERVE_HINT = "make vllm-serve CKPT=DIR (python -m inference.vllm_server DIR; docs/serving.md)"
# Frame counts of the probe's two requests, 2 then 4 in both dialects: Qwen3-VL groups video frames in pairs (temporal
# patch 2), so 1 and 2 frames make the same number of video tokens, and a server may feed N images as one video.
PROBE_FRAME_COUNTS: dict[str, tuple[int, int]] = {"openai": (2, 4), "vllm": (2, 4)}
PROBE_MAX_TOKENS = 16
_ENDPOINT_FIX = "point --endpoint at an OpenAI-compatible /v1 base URL"


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


def run_probe(backend: Any, request: InferenceRequest) -> ProbeReport:
    """Send one row twice, with fewer then more frames, before a run sends every row (module docstring).

    When usage is absent it logs a warning and passes. Frames are reused in order when the row has fewer.

    Raises:
        EndpointAuthError: HTTP 401/403 (one line naming the key's variable).
        EndpointProbeError: any other failure (one line; `fix` names what to change).
    """
    start = time.perf_counter()
    counts = PROBE_FRAME_COUNTS[backend.dialect]
    tokens: list[int | None] = []
    text = ""
    is_vllm = backend.dialect == "vllm" and _check_vllm_version(backend)
    for n in counts:
        frames = [request.frames_png[i % len(request.frames_png)] for i in range(n)]
        body = backend.payload(InferenceRequest(f"{request.request_id}#probe{n}", request.prompt, frames))
        body[backend.max_tokens_field] = min(backend.max_tokens, PROBE_MAX_TOKENS)
        if is_vllm:
            body["return_token_ids"] = True  # vLLM answers with the prompt's token ids: the layout is checked
        answer, error, _ = backend.send(f"probe ({n} frames)", body)
        if answer is None:
            raise EndpointProbeError(f"{_what(backend)} failed: {error}", _probe_fix(backend, error))
        data = _probe_json(backend, answer)
        text, prompt_tokens = _probe_answer(backend, data)
        tokens.append(prompt_tokens)
        if is_vllm:
            _check_video_layout(backend, data)
    report = ProbeReport(counts, (tokens[0], tokens[1]), text, time.perf_counter() - start)
    if not report.usage_reported:
        logger.warning(
            "%s: the server reports no usage.prompt_tokens, so the probe cannot check that the frames reach the "
            "model; going on.",
            _what(backend),
        )
    elif tokens[1] <= tokens[0]:  # type: ignore[operator]
        raise EndpointProbeError(
            f"{_what(backend)}: the frames do not reach the model: {tokens[0]} prompt tokens with {counts[0]} "
            f"frame(s) and {tokens[1]} with {counts[1]} (the server dropped the {_media(backend)})",
            "serve a vision checkpoint whose processor the server loads (transformers serve: processor_class "
            "Qwen3VLProcessor, see docs/serving.md), and check --dialect",
        )
    return report


def _check_vllm_version(backend: Any) -> bool:
    """Refuse a vLLM outside `model_io.vllm_support.SUPPORTED_VLLM`; return whether the server reported a vLLM version
    (`GET /version`, read by `model_io.vllm_support.vllm_release`: a string that is no version is not vLLM).

    Raises:
        EndpointProbeError: a reported version outside the supported range.
    """
    answer = backend.get("/version")
    if answer.status != 200:
        return False  # not vLLM, or no version endpoint: the requests will tell
    data, _ = backend.answer_json(answer)
    version = data.get("version") if isinstance(data, Mapping) else None
    if not isinstance(version, str):
        return False
    if vllm_support.vllm_release(version) is None:
        return False
    if not vllm_support.is_supported_vllm(version):
        supported = vllm_support.SUPPORTED_VLLM_TEXT
        raise EndpointProbeError(
            f"{_what(backend)}: the server runs vLLM {backend.safe_text(version)[:40]}, outside the supported range "
            f"{supported}",
            f"serve with vLLM{supported} (GPU: pip install 'vllm{supported}'; CPU: {SERVE_HINT})",
        )
    return True


def _check_video_layout(backend: Any, data: Any) -> None:
    """When vLLM returns the prompt's token ids: every `<|vision_start|>` must open a run of video tokens.

    A server started without the serving chat template wraps the whole video in one more start/end pair than
    training (`model_io.vllm_support.served_template`): that start is followed by a timestamp, not by
    video tokens. The vision tokens are found without a tokenizer: the video tokens are the longest run of one
    id, the start token the id before it.
    """
    ids = data.get("prompt_token_ids") if isinstance(data, Mapping) else None
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
            f"{_what(backend)}: the server wraps the video in an extra <|vision_start|>…<|vision_end|> pair "
            f"({len(opened)} vision starts for {sum(1 for nxt in opened if nxt == video)} frame pair(s)), "
            "so the model does not see the training layout",
            f"start vLLM with the chat template inference.vllm_server writes (--chat-template): {SERVE_HINT}",
        )


def _what(backend: Any) -> str:
    return f"probe of {backend.url} (model {backend.model!r}, dialect {backend.dialect})"


def _media(backend: Any) -> str:
    return "video" if backend.dialect == "vllm" else "images"


def _probe_json(backend: Any, answer: Any) -> Any:
    """The JSON of a probe answer; raise on an answer that is not JSON."""
    data, problem = backend.answer_json(answer)
    if problem is not None:
        raise EndpointProbeError(f"{_what(backend)}: {problem.replace('response', 'answer', 1)}", _ENDPOINT_FIX)
    return data


def _probe_answer(backend: Any, data: Any) -> tuple[str, int | None]:
    """Return the answer's text and `usage.prompt_tokens` (None when absent); raise on a malformed answer."""
    try:
        text = data["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        detail = backend.safe_text(f"{type(exc).__name__}: {exc}")[:200]
        raise EndpointProbeError(f"{_what(backend)}: malformed answer ({detail})", _ENDPOINT_FIX) from None
    if not isinstance(text, str):
        problem = f"{_what(backend)}: the answer's content is {type(text).__name__}, not text"
        raise EndpointProbeError(problem, _ENDPOINT_FIX)
    usage = data.get("usage") if isinstance(data, Mapping) else None
    tokens = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
    return backend.safe_text(text), tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


def _probe_fix(backend: Any, error: str) -> str:
    """The fix line for a failed probe request, from its error."""
    low = error.lower()
    if error.startswith("connection error"):
        return "start the server or fix --endpoint (the base URL including /v1)"
    if error.startswith("timeout"):
        return "check that the server is up and answers; a slow one: raise --first-byte-timeout or --answer-timeout"
    client_error = error.startswith(("HTTP 400", "HTTP 404", "HTTP 422"))
    if error.startswith("HTTP 404") or (client_error and ("model" in low or "pinned" in low)):
        return "pass the name the server serves as --endpoint-model (transformers serve: the path it was given)"
    if backend.dialect == "vllm" and (client_error or error.startswith("HTTP 5")):
        return _vllm_refusal_fix(low)
    if client_error and "max_tokens" in low:
        return "this model wants the length cap as max_completion_tokens: --max-tokens-field max_completion_tokens"
    return "check the server's log, --endpoint, --endpoint-model and --dialect, then rerun"


def _vllm_refusal_fix(low: str) -> str:
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
