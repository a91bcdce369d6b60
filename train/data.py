"""Shards -> training batches: the SFT collator and the shards as TRL datasets.

How a CT reaches Qwen3-VL (the video encoder, the processor, the chat layout) is `model_io`'s; this module applies it
to table rows:
* `SFTCollator`: a row's prompt in the chat layout (`model_io.processor.render_prompt_text`: the video first, then the
  prompt text), then `report + "<|im_end|>"` as the only supervised tokens.
* Reading the shards (`load_split`) and turning rows into TRL conversational rows (`to_grpo_dataset`).

`frames_to_array` and `verifier_messages` are importable from here too (the reward functions, `train.rewards`, take
them from this module).

Called by `train.sft`, `train.grpo`, `train.tiny`, `train.miniature` and the device check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from PIL import Image
from transformers import BatchFeature

from emrl_data.tables.shards import DATA_DIR, split_pattern, split_shards
from model_io.processor import CTQwen3VLProcessor, render_prompt_text
from model_io.processor import verifier_messages as verifier_messages
from model_io.video import frames_to_array


def resize_frames(frames: NDArray[np.uint8], size_px: int | None) -> NDArray[np.uint8]:
    """Return `(N, size_px, size_px)` frames (bilinear), or `frames` unchanged when `size_px` is None or already so."""
    if size_px is None or frames.shape[1:] == (size_px, size_px):
        return frames
    return np.stack(
        [np.asarray(Image.fromarray(f).resize((size_px, size_px), Image.Resampling.BILINEAR)) for f in frames]
    )


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
    import datasets  # lazy: datasets adds 0.8 s (measured); only load_split needs it

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
