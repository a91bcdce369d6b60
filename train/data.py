"""Shards -> model inputs: the one place that decides how CT frames reach Qwen3-VL (docs/contract.md#frames, docs/training.md#qwen3-vl-facts-the-code-relies-on).

Owns:
* `encode_ct_video`: a deterministic, torch-only Qwen3-VL video encoder (no torchvision, no frame resampling, no
  pixel budget: every frame is used at its own size, rounded to a multiple of 32 only when it is not one already).
* `CTQwen3VLProcessor`: `Qwen3VLProcessor` without a video processor (in memory only: `save_pretrained` writes a
  standard Qwen3-VL processor, `train.checkpoint`); it expands every
  `<|vision_start|><|video_pad|><|vision_end|>` triple with `encode_ct_video` (the Qwen reference / vLLM layout, one
  `<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>` block per frame pair, no outer wrapper) and lets the base
  class handle text and images (the verifier's single key frame is an image).
* The token layout of a training sample: `user_messages` (video first, then the prompt text) rendered with Qwen3-VL's
  chat template, then `report + "<|im_end|>"` as the only supervised tokens (`SFTCollator`).
* Reading the shards (`load_split`) and turning rows into TRL conversational rows (`to_grpo_dataset`).

Called by `train.sft`, `train.grpo`, `train.tiny.model`, the device check and the mining backend (`load_model_and_processor`).
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import NDArray
from PIL import Image
from transformers import AutoTokenizer, BatchFeature, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

from emrl_data.tables.shards import DATA_DIR, split_pattern, split_shards
from train.checkpoint import (
    STANDARD_PROCESSOR_CLASS,
    VIDEO_TRIPLE,
    qwen3_vl_chat_template,
    write_standard_processor_files,
)


logger = logging.getLogger(__name__)

PATCH_SIZE = 16  # Qwen3-VL ViT patch (pixels)
TEMPORAL_PATCH = 2  # consecutive frames fused into one temporal patch
MERGE_SIZE = 2  # 2x2 patches merged into one LLM token
FACTOR = PATCH_SIZE * MERGE_SIZE  # frame sides are multiples of 32
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


def frames_to_array(frames: Any) -> NDArray[np.uint8]:
    """Return CT frames as one uint8 array.

    Args:
        frames: an array `(N, H, W)` uint8 (grayscale, frame 1 = inferior first), or a sequence of PIL images,
            Hub image structs `{"bytes": ..., "path": ...}` or 2-D arrays, in frame order.

    Returns:
        `(N, H, W)` uint8, C-contiguous.

    Raises:
        ValueError: on an empty sequence or frames of different sizes.
    """
    if isinstance(frames, np.ndarray):
        arr = frames
    else:
        if len(frames) == 0:
            raise ValueError("frames is empty; an organ row has at least one frame.")
        planes = []
        for f in frames:
            if isinstance(f, Mapping):
                f = Image.open(io.BytesIO(f["bytes"]))
            if isinstance(f, Image.Image):
                f = np.asarray(f.convert("L"))
            planes.append(np.asarray(f))
        if len({p.shape for p in planes}) != 1:
            raise ValueError(f"frames differ in size: {sorted({p.shape for p in planes})}.")
        arr = np.stack(planes)
    if arr.ndim != 3:
        raise ValueError(f"frames must be (N, H, W); got shape {arr.shape}.")
    return np.ascontiguousarray(arr.astype(np.uint8, copy=False))


def resize_frames(frames: NDArray[np.uint8], size_px: int | None) -> NDArray[np.uint8]:
    """Return `(N, size_px, size_px)` frames (bilinear), or `frames` unchanged when `size_px` is None or already so."""
    if size_px is None or frames.shape[1:] == (size_px, size_px):
        return frames
    return np.stack(
        [np.asarray(Image.fromarray(f).resize((size_px, size_px), Image.Resampling.BILINEAR)) for f in frames]
    )


def video_key(frames: NDArray[np.uint8]) -> tuple[tuple[int, ...], bytes]:
    """Return a content key of a frame stack (shape + 128-bit BLAKE2b of the bytes) for the per-rollout video cache."""
    return frames.shape, hashlib.blake2b(np.ascontiguousarray(frames).tobytes(), digest_size=16).digest()


def video_placeholder(n_groups: int, tokens_per_group: int, fps: float = 1.0, *, n_frames: int | None = None) -> str:
    """Return the placeholder text of one video: one timestamped block per frame pair (reference layout).

    Frame pair j (frames 2j, 2j+1, 0-based) gets `<{(2j + 0.5) / fps:.1f} seconds>`, as HF/Qwen and vLLM compute it
    from `frames_indices / fps` averaged over the pair. With an odd `n_frames` the last pair is the last frame twice
    (its index repeated, as HF and vLLM pad it), so its timestamp is `(n_frames - 1) / fps`.

    Args:
        n_groups: frame pairs (`ceil(n_frames / 2)`).
        tokens_per_group: video tokens per pair.
        fps: frames per second of the timestamps.
        n_frames: frames before padding; `2 * n_groups` when None.
    """
    last = 2 * n_groups - 1 if n_frames is None else n_frames - 1
    return "".join(
        f"<{(2 * j + min(2 * j + 1, last)) / 2 / fps:.1f} seconds><|vision_start|>"
        + "<|video_pad|>" * tokens_per_group
        + "<|vision_end|>"
        for j in range(n_groups)
    )


def encode_ct_video(frames: Any, fps: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Encode CT frames as Qwen3-VL video inputs, deterministically and without torchvision.

    Equivalent to the stock `Qwen3VLVideoProcessor` with the settings our checkpoints save (`train.checkpoint`:
    `do_sample_frames=False`, a size budget that keeps each frame) and `video_metadata` fps = 1: max |Δ| 5.9e-8 and
    the same grid, also for sides that are not multiples of 32 (the resize is torchvision's: uint8, bicubic,
    antialiased), tested in `tests/train/test_standard_checkpoint.py`. Grayscale is replicated to 3 channels, scaled to [0, 1] and
    normalised with mean = std = 0.5. An odd frame count repeats the last frame (as HF does).

    Args:
        frames: `(N, H, W)` uint8 grayscale frames in frame order (see `frames_to_array` for accepted forms).
        fps: frames per second used only for the timestamps in the placeholder text (1.0: frame index = seconds).

    Returns:
        `pixel_values_videos` `(T * gh * gw, 3 * 2 * 16 * 16)` float32 with `T = ceil(N / 2)`, `gh = H' / 16`,
        `gw = W' / 16` (`H'`, `W'` = H, W rounded to multiples of 32); `video_grid_thw` `(1, 3)` int64 `[[T, gh, gw]]`;
        and the placeholder text (`video_placeholder`).
    """
    arr = frames_to_array(frames)
    u8 = torch.from_numpy(arr).unsqueeze(1)  # (N, 1, H, W) uint8
    n, _, h, w = u8.shape
    h2, w2 = max(FACTOR, round(h / FACTOR) * FACTOR), max(FACTOR, round(w / FACTOR) * FACTOR)
    if (h2, w2) != (h, w):  # as the stock processor resizes (torchvision: uint8, bicubic, antialiased): bit-equal
        u8 = F.interpolate(u8, size=(h2, w2), mode="bicubic", align_corners=False, antialias=True)
    x = u8.float().div_(255.0).expand(-1, 3, -1, -1)  # (N, 3, H', W') in [0, 1], grayscale replicated
    x = (x - 0.5) / 0.5
    if n % TEMPORAL_PATCH:
        x = torch.cat([x, x[-1:].expand(TEMPORAL_PATCH - n % TEMPORAL_PATCH, -1, -1, -1)], 0)
    gt, gh, gw = x.shape[0] // TEMPORAL_PATCH, h2 // PATCH_SIZE, w2 // PATCH_SIZE
    p = x.reshape(1, gt, TEMPORAL_PATCH, 3, gh // MERGE_SIZE, MERGE_SIZE, PATCH_SIZE, gw // MERGE_SIZE, MERGE_SIZE,
                  PATCH_SIZE)  # fmt: skip
    p = p.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(gt * gh * gw, 3 * TEMPORAL_PATCH * PATCH_SIZE * PATCH_SIZE)
    grid = torch.tensor([[gt, gh, gw]], dtype=torch.long)
    return p.contiguous(), grid, video_placeholder(gt, gh * gw // (MERGE_SIZE**2), fps, n_frames=n)


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

        The base class writes our class name and no video processor; `train.checkpoint` then rewrites the processor
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


class SFTCollator:
    """Batch `sft` rows into Qwen3-VL inputs with labels on the assistant report only.

    Each sample is `render_full_text(prompt, report)` with its video expanded; labels are -100 on the prompt
    (including the vision tokens) and on padding, the token ids elsewhere (the report and `<|im_end|>`).
    Padding is on the left, as in generation.
    """

    def __init__(self, processor: CTQwen3VLProcessor, max_length: int | None = None, frame_px: int | None = None):
        self.processor = processor
        self.max_length = max_length
        self.frame_px = frame_px  # resize frames to frame_px² (the demo's cheap LM warm-up); None keeps them

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> BatchFeature:
        """Return `input_ids`, `attention_mask`, `mm_token_type_ids`, `labels`, `pixel_values_videos`, `video_grid_thw`."""
        proc = self.processor
        videos = [resize_frames(frames_to_array(r["frames"]), self.frame_px) for r in rows]
        prompts = [render_prompt_text(proc, r["prompt"]) for r in rows]
        fulls = [p + r["report"] + proc.tokenizer.eos_token for p, r in zip(prompts, rows, strict=True)]
        batch = proc(text=fulls, videos=videos, padding=True, return_tensors="pt")
        expanded_prompts, _, _ = proc.expand_videos(prompts, videos)
        prompt_lens = [len(ids) for ids in proc.tokenizer(expanded_prompts, add_special_tokens=False)["input_ids"]]
        ids, mask = batch["input_ids"], batch["attention_mask"]
        labels = ids.masked_fill(mask == 0, -100)
        for i, n_prompt in enumerate(prompt_lens):
            n_pad = int((mask[i] == 0).sum())
            labels[i, : n_pad + n_prompt] = -100
        if self.max_length is not None and ids.shape[1] > self.max_length:
            raise ValueError(f"Sequence length {ids.shape[1]} exceeds max_length={self.max_length}.")
        batch["labels"] = labels
        return batch


def shard_files(dataset_dir: str | Path, split: str) -> list[str]:
    """Return the Parquet shards of `split` in a table folder, in shard order
    (`<dataset_dir>/data/{split}-{i:05d}-of-{n:05d}.parquet`, `emrl_data.tables.shards.split_shards`).

    Raises:
        FileNotFoundError: when none exist.
    """
    files = [str(p) for p in split_shards(Path(dataset_dir, DATA_DIR), split)]
    if not files:
        raise FileNotFoundError(f"No shards {split_pattern(split)} under {Path(dataset_dir)}.")
    return files


def load_split(dataset_dir: str | Path, split: str = "train", limit: int | None = None) -> Any:
    """Load one split of a table in the Hub layout as a `datasets.Dataset` (frames decode to PIL images).

    Args:
        dataset_dir: the table folder (e.g. `<out>/sft` or `<out>/rl_hardset`).
        split: "train" or "test".
        limit: keep only the first `limit` rows.
    """
    import datasets  # heavy; only the trainers need it

    ds = datasets.load_dataset("parquet", data_files={split: shard_files(dataset_dir, split)}, split=split)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return ds


def to_grpo_dataset(ds: Any) -> Any:
    """Return a GRPO dataset: `prompt` becomes a conversational user turn; every other column is kept.

    The frames are not put into the prompt (Arrow cannot hold them inside messages, docs/training.md#qwen3-vl-facts-the-code-relies-on):
    `VideoGRPOTrainer` injects the video block at rollout time. Every other column reaches the reward functions.
    """
    return ds.map(lambda r: {"prompt": [{"role": "user", "content": r["prompt"]}]})
