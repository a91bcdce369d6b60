"""PyPI torchvision for the stock-Hugging-Face subprocesses of the tests, never for the venv (one home for both users).

`transformers serve` (tests/inference/serve_launcher.py) and the stock `AutoProcessor` comparison
(tests/train/hf_reference.py) need Qwen3-VL's video processor, which requires torchvision. The only PyPI torchvision for
torch 2.13 (0.28.0) is CUDA-linked: on the CPU torch, `import torchvision` fails on the missing `torchvision::nms`
operator (docs/training.md#qwen3-vl-facts-the-code-relies-on). `make test` unpacks it into `DIR` (`--no-deps --target`); a subprocess puts `DIR`
on its PYTHONPATH and calls `define_operator_schemas()` before importing it. torchvision in the venv itself would break
transformers' imports on the CPU box.

Both subprocess scripts run with `tests/` as their import root (`sys.path[0]` is their own folder), so they import
this module as `torchvision_side` after adding its folder; the test modules import it as `tests.torchvision_side`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parents[1]
PIN = "torchvision==0.28.0"  # the release built against torch 2.13
DIR = Path(os.environ.get("EMRL_TEST_TORCHVISION", ROOT / ".cache" / "torchvision"))
INSTALL = f".venv/bin/python -m pip install --no-deps --target {DIR} '{PIN}'"
_LIBRARY: list[Any] = []  # the schema library stays alive as long as the process


def missing() -> str | None:
    """None when `DIR` holds torchvision, else a one-line message naming the command that installs it."""
    if (DIR / "torchvision" / "__init__.py").is_file():
        return None
    return f"no torchvision in {DIR}: run `make test` (it runs {INSTALL})"


def define_operator_schemas() -> None:
    """Define `torchvision::nms` and `torchvision::qnms` (schemas only) so that the CUDA-linked wheel imports on CPU."""
    import torch

    if _LIBRARY:
        return
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.append(library)
