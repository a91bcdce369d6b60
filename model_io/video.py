"""CT frames -> Qwen3-VL video inputs: the one encoder of training and mining (docs/contract.md#frames,
docs/training.md#qwen3-vl-facts-the-code-relies-on).

`encode_ct_video` is a deterministic, torch-only Qwen3-VL video encoder (no torchvision, no frame resampling, no pixel
budget: every frame is used at its own size, rounded to a multiple of 32 only when it is not one already).
`video_placeholder` is the text of one encoded video in the Qwen reference / vLLM layout, one
`<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>` block per frame pair, no outer wrapper; `video_grid` gives
its size from the frame count and size alone.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import NDArray
from PIL import Image


PATCH_SIZE = 16  # Qwen3-VL ViT patch (pixels)
TEMPORAL_PATCH = 2  # consecutive frames fused into one temporal patch
MERGE_SIZE = 2  # 2x2 patches merged into one LLM token
FACTOR = PATCH_SIZE * MERGE_SIZE  # frame sides are multiples of 32


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


def video_key(frames: NDArray[np.uint8]) -> tuple[tuple[int, ...], bytes]:
    """Return a content key of a frame stack (shape + 128-bit BLAKE2b of the bytes) for the per-rollout video cache."""
    return frames.shape, hashlib.blake2b(np.ascontiguousarray(frames).tobytes(), digest_size=16).digest()


def rounded_size(height: int, width: int) -> tuple[int, int]:
    """Return the frame size the encoder uses: each side rounded to the nearest multiple of 32 (at least 32)."""
    return max(FACTOR, round(height / FACTOR) * FACTOR), max(FACTOR, round(width / FACTOR) * FACTOR)


def video_grid(n_frames: int, height: int, width: int) -> tuple[int, int, int]:
    """Return `video_grid_thw` of `n_frames` frames of `height` x `width` px: frame pairs, patch rows, patch columns.

    The placeholder of such a video has `t` blocks of `gh * gw // MERGE_SIZE**2` video tokens each.
    """
    h2, w2 = rounded_size(height, width)
    return -(-n_frames // TEMPORAL_PATCH), h2 // PATCH_SIZE, w2 // PATCH_SIZE


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

    Equivalent to the stock `Qwen3VLVideoProcessor` with the settings our checkpoints save (`model_io.checkpoint`:
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
    h2, w2 = rounded_size(h, w)
    if (h2, w2) != (h, w):  # as the stock processor resizes (torchvision: uint8, bicubic, antialiased): bit-equal
        u8 = F.interpolate(u8, size=(h2, w2), mode="bicubic", align_corners=False, antialias=True)
    x = u8.float().div_(255.0).expand(-1, 3, -1, -1)  # (N, 3, H', W') in [0, 1], grayscale replicated
    x = (x - 0.5) / 0.5
    if n % TEMPORAL_PATCH:
        x = torch.cat([x, x[-1:].expand(TEMPORAL_PATCH - n % TEMPORAL_PATCH, -1, -1, -1)], 0)
    gt, gh, gw = video_grid(n, h, w)
    p = x.reshape(
        1, gt, TEMPORAL_PATCH, 3, gh // MERGE_SIZE, MERGE_SIZE, PATCH_SIZE, gw // MERGE_SIZE, MERGE_SIZE, PATCH_SIZE
    )
    p = p.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(gt * gh * gw, 3 * TEMPORAL_PATCH * PATCH_SIZE * PATCH_SIZE)
    grid = torch.tensor([[gt, gh, gw]], dtype=torch.long)
    return p.contiguous(), grid, video_placeholder(gt, gh * gw // (MERGE_SIZE**2), fps, n_frames=n)
