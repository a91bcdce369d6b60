"""Run the real `transformers serve` CLI (transformers 5.17) on the CPU torch, where torchvision's C++ ops cannot load.

    PYTHONPATH=.cache/torchvision python tests/inference/serve_launcher.py serve MODEL_DIR --host 127.0.0.1 --port N

The arguments are those of `transformers ...`; the server is transformers' own (`transformers.cli.transformers.main`).
Two adjustments are made before it starts, none inside the server's code (why: `docs/decisions.md`, "A real
OpenAI-compatible server in make test"):

1. torchvision. `AutoProcessor` builds `Qwen3VLProcessor` only with its video processor, and every transformers video
   processor requires torchvision. The only torchvision on PyPI for torch 2.13 (0.28.0) is CUDA-linked: its `_C.so` and
   `image.so` need `libtorch_cuda.so`, which the CPU torch lacks, and `import torchvision` then fails on the missing
   `torchvision::nms` operator (docs/training.md#qwen3-vl-facts-the-code-relies-on). `make test` installs it into a
   side folder (`tests/torchvision_side.py`, never into the venv), which the test puts on this process's PYTHONPATH
   only, and the `nms`/`qnms` operator schemas are defined here with `torch.library` so that the import succeeds.
   Only torchvision's Python code is used; no video is sent in the "openai" dialect.
2. The PIL image backend. With torchvision importable, transformers picks its torchvision image processors, which
   decode every image with `torchvision.io.decode_image` (the C++ `image.so`: unloadable here). The image processors
   are resolved with `backend="pil"` instead: the backend transformers picks when torchvision is absent, and the one
   `model_io.processor.make_image_processor` uses in training.
"""

from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the torchvision side folder's helper
from torchvision_side import define_operator_schemas  # noqa: E402


def prefer_pil_image_processors() -> None:
    """Make `AutoImageProcessor` resolve to the PIL backend unless a caller asks for a backend."""
    from transformers.models.auto import image_processing_auto

    resolve = image_processing_auto._resolve_backend

    def resolve_pil(backend: str | None, use_fast: bool | None, base_class_name: str | None) -> str:
        return resolve("pil" if backend is None and use_fast is None else backend, use_fast, base_class_name)

    image_processing_auto._resolve_backend = resolve_pil


def main(argv: list[str]) -> None:
    """Adjust the environment (module docstring), then run `transformers ARGV`."""
    define_operator_schemas()
    import torchvision  # noqa: F401 (fail here, clearly, when the side folder is not on PYTHONPATH)

    prefer_pil_image_processors()
    from transformers.cli.transformers import main as transformers_main

    sys.argv = ["transformers", *argv]
    transformers_main()


if __name__ == "__main__":
    main(sys.argv[1:])
