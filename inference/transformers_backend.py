"""The local backend: greedy Qwen3-VL generation from a checkpoint directory, the frames fed as one video.

`TransformersBackend` loads a checkpoint written by `train.tiny.model`, `train.sft` or `train.grpo` with
`model_io.processor.load_model_and_processor`. The frames reach Qwen3-VL as one video through `model_io`'s CT encoder
(`model_io.video`) and chat layout (`model_io.processor.render_prompt_text`), exactly as in training. Decoding is greedy, batched with left padding, and the four
vision tokens are suppressed (docs/training.md#qwen3-vl-facts-the-code-relies-on); the text is decoded with
`skip_special_tokens=True`. torch and transformers are imported only when a backend is built, so the HTTP client and
the store stay light.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inference.requests import InferenceRequest, InferenceResult


logger = logging.getLogger(__name__)

_DTYPES = ("auto", "float32", "bfloat16", "float16")


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
        # lazy: torch adds 3 s to importing `inference`, whose OpenAI backend and store do not need it (measured)
        import torch

        # lazy: model_io.processor loads transformers: +5.7 s (measured)
        from model_io.processor import load_model_and_processor

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
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' decorated `to`
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
        from model_io.processor import render_prompt_text  # lazy: transformers (see __init__)
        from model_io.video import frames_to_array  # lazy: model_io.video loads torch: +2 s (measured)

        if not with_frames:
            msgs: list[Any] = [{"role": "user", "content": [{"type": "text", "text": request.prompt}]}]
            text = self.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            return len(self.processor.tokenizer(text)["input_ids"])
        video = frames_to_array([{"bytes": b} for b in request.frames_png])
        batch = self.processor(text=[render_prompt_text(self.processor, request.prompt)], videos=[video])
        return len(batch["input_ids"][0])

    def count_text_tokens(self, text: str | None) -> int:
        """Return the number of tokens of a generated text (0 for None)."""
        return 0 if text is None else len(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _generate_chunk(self, chunk: Sequence[InferenceRequest], cap: int) -> list[InferenceResult]:
        from model_io.video import frames_to_array  # lazy: torch (see count_prompt_tokens)

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
        import torch  # lazy: torch (see __init__)

        from model_io.processor import render_prompt_text  # lazy: transformers (see __init__)

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
