"""Standard Qwen3-VL checkpoint files: what every checkpoint `train/` saves declares, so stock tools load it.

A checkpoint written here is a plain Qwen3-VL checkpoint: `processor_class` is `Qwen3VLProcessor` in
`processor_config.json` and `tokenizer_config.json`, and the image and video processor configs are present in both
forms transformers reads:

* `processor_config.json`: the nested form transformers 5.17's `ProcessorMixin.save_pretrained` writes for a real
  `Qwen3VLProcessor` (`{"image_processor": {...}, "processor_class": ..., "video_processor": {...}}`); 5.x loaders
  read the nested dicts first;
* `preprocessor_config.json` / `video_preprocessor_config.json`: the standalone files the base model
  `Qwen/Qwen3-VL-8B-Instruct` ships (with `processor_class`), read by older transformers (4.57, vLLM's pin) and by
  5.x when the nested entry is missing.

The CT encoding itself (`model_io.video.encode_ct_video`) stays in our code: `CTQwen3VLProcessor` exists in memory for
training but its name is never written. Both JSON forms are byte-compared in the tests with what 5.17 writes for a
real `Qwen3VLProcessor` (`json.dumps(indent=2, sort_keys=True) + "\\n"`).

Also here: the video block the chat template renders (`VIDEO_TRIPLE`), the CT pixel budget (`CT_VIDEO_SIZE`) and the
official chat template. Standard library only: the vLLM launcher (`inference.vllm_server`) imports it without torch.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import Any


STANDARD_PROCESSOR_CLASS = "Qwen3VLProcessor"
IMAGE_PROCESSOR_TYPE = "Qwen2VLImageProcessor"  # 5.17's name of the torchvision class ("...Fast" in 4.x: same class)
VIDEO_PROCESSOR_TYPE = "Qwen3VLVideoProcessor"
PROCESSOR_FILE = "processor_config.json"
IMAGE_FILE = "preprocessor_config.json"
VIDEO_FILE = "video_preprocessor_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Keys a tokenizer loaded by `from_pretrained` keeps from its load call; transformers does not write them for a
# tokenizer re-saved by stock `AutoProcessor`, so a checkpoint saved from a loaded model drops them too.
TOKENIZER_LOAD_KEYS = ("is_local", "local_files_only")
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# Qwen3-VL's image processor as the base checkpoint has it (the key set `Qwen2VLImageProcessor.to_dict()` writes in
# 5.17). Values not given by a checkpoint's own image processor come from here.
BASE_IMAGE_PROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": IMAGE_PROCESSOR_TYPE,
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "temporal_patch_size": 2,
}

# The video processor dict, written by hand: `Qwen3VLVideoProcessor` cannot be instantiated on the CPU machine (it
# requires torchvision, which cannot be imported next to the CPU torch; `docs/training.md`). The key set is what
# `Qwen3VLVideoProcessor().to_dict()` writes in 5.17 (class defaults: resample 3 = bicubic, min_frames 4, max_frames
# 768, max_video_tokens 768, return_metadata false); the test `test_video_processor_dict_equals_transformers`
# checks it against the real class in a torchvision subprocess. The CT-safe settings a server honours:
# * `do_sample_frames: false`: every frame is used, none resampled by fps;
# * `fps: 1.0`: one frame (slice) per second, the rate of our timestamps, should a client turn sampling back on;
# * `size`: an explicit total pixel budget over all frames that never rescales a stack `train/` accepts:
#   `shortest_edge` 2048 = 2 frames x 32^2 (the smallest stack, so nothing is upscaled) and `longest_edge`
#   256 x 512^2 (4x the default max_frames=64 at 448^2; the 5.17 class default 786432 would shrink every CT stack).
# `cap_pixels_per_frame` is left unset (the base form): with this size both of its values give the same frame sizes
# for frames between 46^2 and 886^2 px.
CT_VIDEO_SIZE: dict[str, int] = {"longest_edge": 256 * 512 * 512, "shortest_edge": 2 * 32 * 32}
# What the Qwen3-VL chat template renders for a video block (training expands it; a vLLM server is given the
# template with `<|video_pad|>` alone in its place, `model_io.vllm_support.served_template`).
VIDEO_TRIPLE = "<|vision_start|><|video_pad|><|vision_end|>"
BASE_VIDEO_PROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "do_sample_frames": False,
    "fps": 1.0,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "max_frames": 768,
    "max_video_tokens": 768,
    "merge_size": 2,
    "min_frames": 4,
    "patch_size": 16,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "return_metadata": False,
    "size": CT_VIDEO_SIZE,
    "temporal_patch_size": 2,
    "video_processor_type": VIDEO_PROCESSOR_TYPE,
}
# Settings the video processor shares with the image processor (taken from the checkpoint's image processor).
_SHARED_KEYS = ("image_mean", "image_std", "merge_size", "patch_size", "temporal_patch_size", "rescale_factor")


class NotACheckpointError(ValueError):
    """The directory holds no Qwen3-VL checkpoint (no `config.json` of model_type qwen3_vl, or no tokenizer)."""


def _dumps(obj: dict[str, Any]) -> str:
    """JSON exactly as transformers writes processor configs (`to_json_string`): indent 2, sorted keys, newline."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def image_processor_dict(current: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the standard image processor dict: the base key set, values from `current` where it has them.

    Args:
        current: an image processor dict (e.g. `Qwen2VLImageProcessorPil.to_dict()` or an old checkpoint's nested
            `image_processor`); keys outside the base form (e.g. `processor_class`) are dropped.
    """
    out = {k: (current or {}).get(k, v) for k, v in BASE_IMAGE_PROCESSOR.items()}
    out["image_processor_type"] = IMAGE_PROCESSOR_TYPE
    return out


def video_processor_dict(image: dict[str, Any]) -> dict[str, Any]:
    """Return the standard, CT-safe video processor dict, sharing patch/merge/normalisation with `image`."""
    out = dict(BASE_VIDEO_PROCESSOR, size=dict(CT_VIDEO_SIZE))
    out.update({k: image[k] for k in _SHARED_KEYS if k in image})
    return out


def write_standard_processor_files(directory: str | Path, image: dict[str, Any] | None = None) -> list[str]:
    """Write the standard processor files into `directory` (after a save); return the names of files changed.

    Rewrites `processor_config.json` (nested form), writes `preprocessor_config.json` and
    `video_preprocessor_config.json` (standalone form, with `processor_class`), and sets `processor_class` in
    `tokenizer_config.json` when that file exists (dropping `TOKENIZER_LOAD_KEYS`). Idempotent: a standard directory
    is left byte-identical.

    Args:
        directory: a checkpoint or processor directory.
        image: the image processor dict to keep; None reads it from the directory's existing files (nested
            `processor_config.json` first, then `preprocessor_config.json`), else the base settings.
    """
    d = Path(directory)
    if image is None:
        nested = (_read(d / PROCESSOR_FILE) or {}).get("image_processor")
        image = nested if isinstance(nested, dict) else _read(d / IMAGE_FILE)
    img = image_processor_dict(image)
    vid = video_processor_dict(img)
    texts = {
        PROCESSOR_FILE: _dumps(
            {"image_processor": img, "processor_class": STANDARD_PROCESSOR_CLASS, "video_processor": vid}
        ),
        IMAGE_FILE: _dumps({**img, "processor_class": STANDARD_PROCESSOR_CLASS}),
        VIDEO_FILE: _dumps({**vid, "processor_class": STANDARD_PROCESSOR_CLASS}),
    }
    tok = _read(d / TOKENIZER_CONFIG_FILE)
    if tok is not None:
        tok["processor_class"] = STANDARD_PROCESSOR_CLASS
        for key in TOKENIZER_LOAD_KEYS:  # how this copy was loaded, not what the tokenizer is
            tok.pop(key, None)
        texts[TOKENIZER_CONFIG_FILE] = json.dumps(tok, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    changed = []
    for name, text in texts.items():
        path = d / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(name)
    return changed


def check_checkpoint_dir(directory: str | Path) -> Path:
    """Return `directory` as a Path when it holds a Qwen3-VL checkpoint (config + tokenizer).

    Raises:
        NotACheckpointError: with a one-line reason otherwise.
    """
    d = Path(directory)
    if not d.is_dir():
        raise NotACheckpointError(f"{d} is not a directory.")
    try:
        config = _read(d / "config.json")
    except ValueError as exc:  # json.JSONDecodeError
        raise NotACheckpointError(f"{d / 'config.json'} is not valid JSON ({exc}).") from None
    if config is None:
        raise NotACheckpointError(f"{d} is not a checkpoint: no config.json.")
    if config.get("model_type") != "qwen3_vl":
        raise NotACheckpointError(
            f"{d} is not a Qwen3-VL checkpoint: config.json model_type={config.get('model_type')!r}."
        )
    if not (d / TOKENIZER_CONFIG_FILE).is_file():
        raise NotACheckpointError(f"{d} is not a checkpoint: no {TOKENIZER_CONFIG_FILE}.")
    return d


def upgrade_checkpoint(directory: str | Path) -> list[str]:
    """Rewrite a checkpoint saved with the custom processor class to the standard Qwen3-VL form, in place.

    Keeps the checkpoint's image processor settings, adds the video processor configs, sets `processor_class` to
    `Qwen3VLProcessor` everywhere and writes the official chat template when the checkpoint has none. Idempotent.

    Returns:
        The names of the files written (empty when the checkpoint was already standard).

    Raises:
        NotACheckpointError: when `directory` holds no Qwen3-VL checkpoint.
    """
    d = check_checkpoint_dir(directory)
    changed = write_standard_processor_files(d)
    tok = _read(d / TOKENIZER_CONFIG_FILE) or {}
    if (
        not (d / CHAT_TEMPLATE_FILE).is_file()
        and not (d / "chat_template.json").is_file()
        and not tok.get("chat_template")
    ):
        (d / CHAT_TEMPLATE_FILE).write_text(qwen3_vl_chat_template(), encoding="utf-8")
        changed.append(CHAT_TEMPLATE_FILE)
    return changed


def qwen3_vl_chat_template() -> str:
    """Return the official Qwen3-VL chat template (TRL's shipped copy, `trl/chat_templates/qwen3_vl.jinja`)."""
    return importlib.resources.files("trl").joinpath("chat_templates/qwen3_vl.jinja").read_text()
