"""Test helpers: constructed requests, a scripted echo backend, and a slow run to be killed mid-way."""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from inference.requests import InferenceRequest, InferenceResult
from inference.store import ResultStore, run_inference


PROMPTS = ("Describe the liver.", "Write the pancreas report for these CT frames, please.", "Kidney?")


def png(arr: np.ndarray) -> bytes:
    """Return PNG bytes of a 2-D uint8 array."""
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def make_requests(frame_counts: Sequence[int], size_px: int = 64, seed: int = 0) -> list[InferenceRequest]:
    """Return one request per frame count: random 8-bit frames, prompts cycling through `PROMPTS`."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(frame_counts):
        frames = [png(rng.integers(0, 256, (size_px, size_px), dtype=np.uint8)) for _ in range(n)]
        out.append(InferenceRequest(f"BDMAP_{i + 1:08d}/liver", PROMPTS[i % len(PROMPTS)], frames))
    return out


class EchoBackend:
    """A backend whose text is `"echo:<id>"`; records every request it was given.

    With `block_after=k` it answers k requests, then blocks forever on the next one (a run to kill at a known point).
    """

    name = "echo"

    def __init__(self, block_after: int | None = None) -> None:
        self.block_after = block_after
        self.seen: list[str] = []

    def generate(self, requests: Sequence[InferenceRequest]) -> list[InferenceResult]:
        out = []
        for r in requests:
            if self.block_after is not None and len(self.seen) >= self.block_after:
                threading.Event().wait()  # never set: the test kills this process here
            self.seen.append(r.request_id)
            out.append(InferenceResult(r.request_id, f"echo:{r.request_id}", None, 0.0, 1))
        return out


def build_small_sft_set(tmp_path_factory: Any, frame_px: int = 64) -> Path:
    """OUT of build-sft-set over two synthetic cases (one train, one test; a liver lesion each): `frame_px`² frames,
    at most 6 a row. Needs the Prefect harness (the flow runs through the engine)."""
    from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
    from emrl_data.types import Organ, Split
    from flows.build_sft_set import build_sft_set_flow

    root = tmp_path_factory.mktemp("atlas")
    lesion = (LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 10.0), "hypo"),)
    specs = [
        CaseSpec(f"BDMAP_0000000{i}", shape=(96, 80, 32), lesions=lesion, seed=i, split=split)
        for i, split in ((1, Split.TRAIN), (2, Split.TEST))
    ]
    write_atlas(root, specs)
    out = tmp_path_factory.mktemp("out")
    frames = {"frames": {"frame_size_px": frame_px, "max_frames": 6}}
    build_sft_set_flow(atlas_root=str(root), output_dir=str(out), config=frames)
    return out


def first_train_row(sft_out: Path) -> dict:
    """The first train row of OUT/sft (`case_id`, `organ`, `prompt`, `frames`)."""
    import pyarrow.parquet as pq

    path = sorted((sft_out / "sft" / "data").glob("train-*.parquet"))[0]
    return pq.read_table(path, columns=["case_id", "organ", "prompt", "frames"]).slice(0, 1).to_pylist()[0]


def text_requests(n: int) -> list[InferenceRequest]:
    """Return `n` requests with one tiny frame each (for store tests: the echo backend never decodes them)."""
    return [InferenceRequest(f"r{i:03d}", "p", [b"\x89PNG"]) for i in range(n)]


def stalled_run(store_path: str, n: int, k: int) -> None:
    """Run `n` echo requests one per batch into the store; after `k` rows the backend blocks (the test kills it)."""
    with ResultStore(store_path) as store:
        run_inference(EchoBackend(block_after=k), text_requests(n), store, batch_size=1)


if __name__ == "__main__":
    stalled_run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))


def serve_beside_sft_set(server: Any, tmp_path_factory: Any, frame_px: int) -> Iterator[tuple[str, Path]]:
    """Body of a module's `served` fixture: yield (base URL, OUT with an sft set), the set built while `server`
    (a started `VLLMServer` or `ServerProcess`) comes up; the server is stopped afterwards, whatever happened."""
    try:
        sft_out = build_small_sft_set(tmp_path_factory, frame_px)
        yield server.wait(), sft_out
    finally:
        server.stop()
