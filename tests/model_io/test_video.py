"""`video_grid` gives the grid `encode_ct_video` builds from the frame count and size alone (what the GRPO rollout
engine counts prompt tokens with, no frame encoded)."""

from __future__ import annotations

import numpy as np
import pytest

from model_io.video import MERGE_SIZE, encode_ct_video, video_grid, video_placeholder


@pytest.mark.parametrize(("n", "h", "w"), [(4, 64, 64), (5, 70, 100), (1, 20, 20), (2, 48, 33), (3, 96, 160)])
def test_video_grid_is_the_grid_the_encoder_builds(n: int, h: int, w: int) -> None:
    frames = np.random.default_rng(0).integers(0, 256, (n, h, w), dtype=np.uint8)
    pixels, grid, text = encode_ct_video(frames)
    t, gh, gw = video_grid(n, h, w)
    assert grid.tolist() == [[t, gh, gw]] and pixels.shape[0] == t * gh * gw
    assert text == video_placeholder(t, gh * gw // MERGE_SIZE**2, n_frames=n)
