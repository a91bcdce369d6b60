"""The Qwen3-VL processor for CT videos and the chat layout of a sample (docs/training.md#qwen3-vl-facts-the-code-relies-on).

* `CTQwen3VLProcessor`: `Qwen3VLProcessor` without a video processor (in memory only: `save_pretrained` writes a
  standard Qwen3-VL processor, `model_io.checkpoint`); it expands every
  `<|vision_start|><|video_pad|><|vision_end|>` triple with `model_io.video.encode_ct_video` and lets the base class
  handle text and images (the verifier's single key frame is an image).
* `load_model_and_processor`: a checkpoint written by `train/` (what the mining backend and the trainers load).
* The chat layout of a sample: `user_messages` (video first, then the prompt text) rendered with Qwen3-VL's chat
  template (`render_prompt_text`), then `report + "<|im_end|>"` (`render_full_text`); the verifier's turn is the key
  frame alone as an image (`verifier_messages`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, BatchFeature, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

from model_io.checkpoint import (
    STANDARD_PROCESSOR_CLASS,
    VIDEO_TRIPLE,
    qwen3_vl_chat_template,
    write_standard_processor_files,
)
from model_io.video import (
    MERGE_SIZE,
    PATCH_SIZE,
    TEMPORAL_PATCH,
    encode_ct_video,
    frames_to_array,
    video_key,
    video_placeholder,
)


# Video keyword arguments callers (TRL, apply_chat_template) may pass; the CT encoder has none of these knobs.
_IGNORED_VIDEO_KWARGS = ("do_sample_frames", "fps", "num_frames", "video_metadata", "return_metadata", "size")


def make_image_processor(min_pixels: int = 65536, max_pixels: int = 16777216) -> Qwen2VLImageProcessorPil:
    """Return the PIL (torchvision-free) image processor with Qwen3-VL's settings: patch 16, merge 2, mean/std 0.5.

    Args:
        min_pixels: `shortest_edge` pixel budget (Qwen3-VL: 65536); smaller images are upscaled to reach it.
        max_pixels: `longest_edge` pixel budget (Qwen3-VL: 16777216).
    """
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH,
        merge_size=MERGE_SIZE,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )


class CTQwen3VLProcessor(Qwen3VLProcessor):
    """Qwen3-VL processor whose videos are CT frame stacks encoded by `encode_ct_video` (no video processor).

    Text may hold `<|vision_start|><|video_pad|><|vision_end|>` triples (as the chat template renders a video block);
    each is replaced, in order over the batch, by the placeholder of the next video. Images go through the base
    class. The output adds `pixel_values_videos` (all videos concatenated) and `video_grid_thw` `(n_videos, 3)`.
    """

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs):
        # Same token attributes as Qwen3VLProcessor.__init__, without its video_processor argument.
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        self.vision_start_token = "<|vision_start|>"
        self.vision_end_token = "<|vision_end|>"
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
        self.video_fps = 1.0

    @property
    def vision_token_ids(self) -> list[int]:
        """Ids of the four vision tokens; a policy must never sample them (docs/training.md#qwen3-vl-facts-the-code-relies-on)."""
        return [self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id]

    def expand_videos(self, text: Sequence[str], videos: Sequence[Any]) -> tuple[list[str], list[torch.Tensor], list]:
        """Replace each video triple in `text` by the placeholder of the next video in `videos`.

        Args:
            text: texts in batch order.
            videos: one entry per triple, in order (each `(N, H, W)` uint8 frames or a list of frames).

        Returns:
            The expanded texts, per-video `pixel_values_videos` and per-video `video_grid_thw` `(1, 3)`.

        Raises:
            ValueError: when the number of triples and videos differ.
        """
        n_triples = sum(t.count(VIDEO_TRIPLE) for t in text)
        if n_triples != len(videos):
            raise ValueError(f"{n_triples} video placeholders in the text but {len(videos)} videos were given.")
        pixels, grids, out, it = [], [], [], iter(videos)
        for t in text:
            parts = t.split(VIDEO_TRIPLE)
            pieces = [parts[0]]
            for rest in parts[1:]:
                p, g, placeholder = self._encode(next(it))
                pixels.append(p)
                grids.append(g)
                pieces += [placeholder, rest]
            out.append("".join(pieces))
        return out, pixels, grids

    video_cache: dict[Any, tuple[torch.Tensor, torch.Tensor]] | None = None  # video_key(frames) -> (pixels, grid)

    def _encode(self, video: Any) -> tuple[torch.Tensor, torch.Tensor, str]:
        """Encode one video, reusing `video_cache` (set by `VideoGRPOTrainer` for one rollout batch) when it holds it."""
        if self.video_cache is None:
            return encode_ct_video(video, fps=self.video_fps)
        arr = frames_to_array(video)
        cached = self.video_cache.get(video_key(arr))
        if cached is None:
            pixels, grid, text = encode_ct_video(arr, fps=self.video_fps)
            self.video_cache[video_key(arr)] = (pixels, grid)
            return pixels, grid, text
        pixels, grid = cached
        t, h, w = (int(v) for v in grid[0])
        return pixels, grid, video_placeholder(t, h * w // (MERGE_SIZE**2), self.video_fps, n_frames=arr.shape[0])

    def validate_inputs(self, images: Any = None, text: Any = None, videos: Any = None, **kwargs) -> None:  # type: ignore[override]
        """Accept already-expanded video tokens; the base checks only that something was given."""
        return ProcessorMixin.validate_inputs(self, images=images, text=text, videos=videos, **kwargs)

    def __call__(self, images: Any = None, text: Any = None, videos: Any = None, **kwargs) -> BatchFeature:
        """Tokenize text with images (base class) and CT videos (`encode_ct_video`).

        Args:
            images: as for `Qwen3VLProcessor`.
            text: a string or a list of strings holding video triples and/or image placeholders.
            videos: a list (per text, or flat) of CT frame stacks, one per video triple, in order.
            **kwargs: text/image keyword arguments; video sampling arguments are ignored (the encoder has none).
        """
        for key in _IGNORED_VIDEO_KWARGS:
            kwargs.pop(key, None)
        kwargs.pop("videos_kwargs", None)
        pixels: list[torch.Tensor] = []
        grids: list[torch.Tensor] = []
        if videos is not None:
            texts = [text] if isinstance(text, str) else list(text)
            flat = []
            for v in videos:  # apply_chat_template passes one list of videos per conversation
                if isinstance(v, list) and v and not isinstance(v[0], Image.Image | Mapping | np.ndarray):
                    flat.extend(v)
                elif isinstance(v, list) and v and isinstance(v[0], np.ndarray) and v[0].ndim == 3:
                    flat.extend(v)
                else:
                    flat.append(v)
            text, pixels, grids = self.expand_videos(texts, flat)
        out = super().__call__(images=images, text=text, **kwargs)
        if videos is not None:
            out["pixel_values_videos"] = torch.cat(pixels)
            out["video_grid_thw"] = torch.cat(grids)
        return out

    def save_pretrained(self, save_directory: str | Path, push_to_hub: bool = False, **kwargs: Any) -> list[str]:
        """Save as a standard Qwen3-VL processor: `processor_class` `Qwen3VLProcessor`, image + video processor configs.

        The base class writes our class name and no video processor; `model_io.checkpoint` then rewrites the processor
        files to the form transformers writes for a real `Qwen3VLProcessor`, so `AutoProcessor`, vLLM and
        `transformers serve` see Qwen3-VL. Every save path (`train.sft`, `train.grpo`, `train.tiny.model`, the trainers'
        intermediate checkpoints) goes through here.
        """
        if push_to_hub:
            raise ValueError("push_to_hub is not supported here; save locally, then publish the folder.")
        files = super().save_pretrained(str(save_directory), **kwargs)
        self.tokenizer._set_processor_class(STANDARD_PROCESSOR_CLASS)  # the in-memory tokenizer names it too
        write_standard_processor_files(save_directory, self.image_processor.to_dict())
        return files

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> CTQwen3VLProcessor:  # type: ignore[override]
        """Load a processor saved by `save_pretrained` (tokenizer, image processor config and chat template).

        Works on standard Qwen3-VL checkpoints (ours and the base model) and on ones saved with the
        old custom class name; only the tokenizer, the image processor settings and the template are read.
        """
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        template = getattr(tokenizer, "chat_template", None) or qwen3_vl_chat_template()
        return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def load_model_and_processor(
    path: str | Path, *, dtype: torch.dtype | str = "auto", device_map: str | None = None
) -> tuple[Qwen3VLForConditionalGeneration, CTQwen3VLProcessor]:
    """Load a checkpoint written by `train.sft`, `train.grpo` or `train.tiny.model` (what the mining backend calls).

    Args:
        path: a local directory (or a Hub id where the machine has access) with the model and processor files.
        dtype: parameter dtype passed to `from_pretrained`.
        device_map: passed to `from_pretrained` (e.g. "auto" on GPUs).
    """
    model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=dtype, device_map=device_map)
    processor = CTQwen3VLProcessor.from_pretrained(path)
    return model, processor


def user_messages(prompt: str, frames: Any) -> list[dict[str, Any]]:
    """Return the one user turn of a sample: the CT video block first, then the prompt text.

    Args:
        prompt: the `prompt` column (it does not reference the frames itself).
        frames: the row's frames, `(N, H, W)` uint8 or a list of frames (see `frames_to_array`).
    """
    return [
        {
            "role": "user",
            "content": [{"type": "video", "video": frames_to_array(frames)}, {"type": "text", "text": prompt}],
        }
    ]


def verifier_messages(frame: Any, prompt: str) -> list[dict[str, Any]]:
    """Return the verifier's user turn: the key frame alone as an RGB image, then the verifier prompt.

    Args:
        frame: one frame, `(H, W)` uint8 or a PIL image.
        prompt: the verifier prompt (`emrl_data.text.report.VERIFIER_PROMPT`).
    """
    img = frame if isinstance(frame, Image.Image) else Image.fromarray(np.asarray(frame, dtype=np.uint8))
    return [
        {"role": "user", "content": [{"type": "image", "image": img.convert("RGB")}, {"type": "text", "text": prompt}]}
    ]


def render_prompt_text(processor: CTQwen3VLProcessor, prompt: str) -> str:
    """Return the chat-template text of a sample's prompt, up to and including `<|im_start|>assistant\\n`."""
    msgs: list[Any] = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}]
    return processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def render_full_text(processor: CTQwen3VLProcessor, prompt: str, report: str) -> str:
    """Return prompt text + report + `<|im_end|>`: the full SFT sequence (the template's trailing newline is dropped)."""
    return render_prompt_text(processor, prompt) + report + processor.tokenizer.eos_token
