import numpy as np
import pytest
import torch

from model_io.processor import render_full_text, render_prompt_text, user_messages
from model_io.video import encode_ct_video, frames_to_array, video_placeholder
from train.data import SFTCollator, load_split


def _frames(n: int, size: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size), dtype=np.uint8)


@pytest.mark.parametrize(
    ("n", "size", "grid", "rows"),
    [
        (4, 64, [2, 4, 4], 32),  # even count: 2 frame pairs of 4x4 patches
        (5, 64, [3, 4, 4], 48),  # odd count: last frame repeated -> 3 pairs
        (2, 448, [1, 28, 28], 784),  # real frame size: 196 tokens per pair after the 2x2 merge
        (2, 70, [1, 4, 4], 16),  # 70 px is rounded to 64 (multiple of 32)
    ],
)
def test_encode_ct_video_grid(n, size, grid, rows):
    pixels, thw, _ = encode_ct_video(_frames(n, size))
    assert thw.tolist() == [grid]
    assert tuple(pixels.shape) == (rows, 3 * 2 * 16 * 16)
    assert pixels.dtype == torch.float32


def test_encode_ct_video_values_and_determinism():
    frames = np.zeros((2, 32, 32), np.uint8)
    frames[1] = 255
    p1, _, _ = encode_ct_video(frames)
    p2, _, _ = encode_ct_video(frames)
    assert torch.equal(p1, p2)
    # patch layout (channel, temporal, y, x): frame 0 -> -1.0, frame 1 -> +1.0 after mean/std 0.5
    patch = p1[0].view(3, 2, 16, 16)
    assert torch.all(patch[:, 0] == -1.0) and torch.all(patch[:, 1] == 1.0)


def test_video_placeholder_layout_is_pinned():
    # Reference / vLLM layout: one timestamped block per frame pair, no outer <|vision_start|> wrapper.
    expected = (
        "<0.5 seconds><|vision_start|><|video_pad|><|video_pad|><|vision_end|>"
        "<2.5 seconds><|vision_start|><|video_pad|><|video_pad|><|vision_end|>"
    )
    assert video_placeholder(2, 2) == expected
    # Three frames: the last pair is frame 2 twice (its index repeated, as transformers and vLLM pad an odd count),
    # so its timestamp is (2 + 2) / 2 = 2.0 s, the stamp vLLM 0.32 builds (tests/inference/test_vllm_server.py).
    _, _, text = encode_ct_video(_frames(3, 32))
    assert text == "<0.5 seconds><|vision_start|><|video_pad|><|vision_end|>" * 1 + (
        "<2.0 seconds><|vision_start|><|video_pad|><|vision_end|>"
    )
    assert video_placeholder(3, 1, n_frames=5).startswith("<0.5 seconds>") and "<4.0 seconds>" in video_placeholder(
        3, 1, n_frames=5
    )


def test_chat_template_and_processor_agree(processor):
    frames = _frames(4)
    via_template = processor.apply_chat_template(
        [user_messages("Describe.", frames)], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    text = render_prompt_text(processor, "Describe.")
    direct = processor(text=[text], videos=[frames])
    assert via_template["input_ids"][0] == direct["input_ids"][0]
    assert torch.equal(via_template["pixel_values_videos"], direct["pixel_values_videos"])
    decoded = processor.tokenizer.decode(direct["input_ids"][0])
    assert decoded.startswith("<|im_start|>user\n<0.5 seconds><|vision_start|><|video_pad|>")
    assert decoded.endswith("<|vision_end|>Describe.<|im_end|>\n<|im_start|>assistant\n")
    assert direct["mm_token_type_ids"][0].count(2) == 2 * 4  # 2 pairs x (64/32)^2 video tokens


def test_full_text_is_chat_template_with_assistant(processor):
    report = "<findings>No focal liver lesion is identified.</findings>"
    msgs = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "p"}]},
        {"role": "assistant", "content": report},
    ]
    templated = processor.apply_chat_template(msgs, tokenize=False)
    assert render_full_text(processor, "p", report) + "\n" == templated


def test_sft_collator_labels_only_the_report(processor):
    rows = [
        {"frames": _frames(8), "prompt": "a longer prompt text here", "report": "<findings>A</findings>"},
        {"frames": _frames(6, seed=1), "prompt": "p", "report": "<findings>No focal kidney lesion.</findings>"},
    ]
    batch = SFTCollator(processor)(rows)
    for i, row in enumerate(rows):
        labels = batch["labels"][i]
        assert processor.tokenizer.decode(labels[labels != -100]) == row["report"] + "<|im_end|>"
    assert batch["attention_mask"][1, 0] == 0  # left padding
    assert batch["video_grid_thw"].tolist() == [[4, 4, 4], [3, 4, 4]]


def test_load_split_decodes_frames(sft_table):
    ds = load_split(sft_table, "train")
    assert len(ds) == 6
    arr = frames_to_array(ds[0]["frames"])
    assert arr.shape == (8, 64, 64) and arr.dtype == np.uint8
    with pytest.raises(FileNotFoundError, match="validation"):
        load_split(sft_table, "validation")
