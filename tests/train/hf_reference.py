"""The stock Hugging Face path, run in a subprocess where torchvision is importable (`test_standard_checkpoint.py`).

    python tests/train/hf_reference.py CKPT FRAMES_NPY OUT_DIR

Loads CKPT with `AutoProcessor` as a server does (no project code is imported), encodes the frame stack as a video
(with and without `video_metadata` fps=1) and as images, re-saves the processor with stock `save_pretrained`, and
writes `OUT_DIR/reference.npz` (token ids, pixels, grids) and `OUT_DIR/reference.json` (classes, dict forms).

torchvision comes from the side folder of `tests/torchvision_side.py` (on this process's PYTHONPATH only), with the
two operator schemas it checks at import defined first; it is never installed into the venv.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the torchvision side folder's helper
from torchvision_side import define_operator_schemas  # noqa: E402


PROMPT = "Describe the liver."


def main(ckpt: str, frames_npy: str, out_dir: str) -> None:
    """Write the stock processor's encodings of the frames in `frames_npy` to `out_dir`."""
    define_operator_schemas()
    import torchvision  # noqa: F401
    from PIL import Image
    from transformers import AutoProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    out = Path(out_dir)
    proc = AutoProcessor.from_pretrained(ckpt)
    frames = np.load(frames_npy)  # (N, H, W) uint8 grayscale
    n = len(frames)
    rgb = np.repeat(frames[..., None], 3, axis=-1)  # (N, H, W, 3): a decoded video as a server holds it
    video_msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPT}]}]
    video_text = proc.apply_chat_template(video_msgs, add_generation_prompt=True, tokenize=False)
    meta = {"total_num_frames": n, "fps": 1.0, "frames_indices": list(range(n))}
    video = proc(text=[video_text], videos=[rgb], video_metadata=[meta], return_tensors="pt")
    video_nometa = proc(text=[video_text], videos=[rgb], return_tensors="pt")
    image_content = [{"type": "image"} for _ in range(n)] + [{"type": "text", "text": PROMPT}]
    image_text = proc.apply_chat_template(
        [{"role": "user", "content": image_content}], add_generation_prompt=True, tokenize=False
    )
    images = [Image.fromarray(f).convert("RGB") for f in frames]
    image = proc(text=[image_text], images=images, return_tensors="pt")
    np.savez(
        out / "reference.npz",
        video_input_ids=video["input_ids"][0].numpy(),
        video_nometa_input_ids=video_nometa["input_ids"][0].numpy(),
        pixel_values_videos=video["pixel_values_videos"].numpy(),
        video_grid_thw=video["video_grid_thw"].numpy(),
        image_input_ids=image["input_ids"][0].numpy(),
        pixel_values=image["pixel_values"].numpy(),
        image_grid_thw=image["image_grid_thw"].numpy(),
    )
    proc.save_pretrained(out / "resaved")  # stock save of what was loaded: the exact 5.17 form
    info = {
        "processor": type(proc).__name__,
        "image_processor": type(proc.image_processor).__name__,
        "video_processor": type(proc.video_processor).__name__,
        "video_text": video_text,
        "image_text": image_text,
        "default_video_keys": sorted(Qwen3VLVideoProcessor().to_dict()),
        "default_image_keys": sorted(Qwen2VLImageProcessor().to_dict()),
    }
    (out / "reference.json").write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:4])
