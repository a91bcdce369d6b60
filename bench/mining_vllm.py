"""Mining throughput (rows/s): the local transformers backend vs vLLM (CPU build) on the same rows and checkpoint.

Starts `vllm serve` through `inference.vllm_server.VLLMServer` (the flags of `make vllm-serve`; needs `make vllm-env`),
then times the same requests through both backends in this run, greedy, same length cap:

* local: `TransformersBackend(batch_size=B).generate(rows)` (what `--model DIR` runs);
* vLLM: `OpenAIBackend(concurrency=C, dialect "vllm").generate(rows)` (what `--endpoint` runs; vLLM batches them).

After one warm-up pass of each, `--rounds` rounds (at least 5) time both backends one after the other, alternating
which goes first; while one is timed the other is idle (the server waits for requests, the local model is not
called). Prints rows/s of each (medians), the median of the per-round ratios with their range, and whether the texts
were equal. The rows are synthetic CT-like frames (random 8-bit, `--frames` of `--px`²), the checkpoint the
tiny Qwen3-VL of the tests unless `--checkpoint` names one.

    python bench/mining_vllm.py [--rows 16] [--frames 8] [--px 64] [--max-new-tokens 32] [--rounds 5] [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: `tests.inference.helpers`
from inference.bounded_http import Deadlines  # noqa: E402
from inference.openai_client import OpenAIBackend  # noqa: E402
from inference.transformers_backend import TransformersBackend  # noqa: E402
from inference.vllm_server import VLLMServer  # noqa: E402
from tests.inference.helpers import make_requests  # noqa: E402
from train.tiny.model import save_tiny


def _timed(fn) -> tuple[float, list]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def interleaved(fns: dict[str, object], rounds: int) -> tuple[dict[str, list[float]], dict[str, list]]:
    """Time each of `fns` once per round, alternating the order round by round (after one warm-up call of each);
    return the seconds per name and round, and each name's last output."""
    outs = {name: fn() for name, fn in fns.items()}  # warm-up (first-call compilation, caches)
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            s, outs[name] = _timed(fns[name])
            seconds[name].append(s)
    return seconds, outs


def ratio_summary(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the per-round ratios numerator / denominator."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--px", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="local backend: requests per generate call")
    parser.add_argument("--concurrency", type=int, default=8, help="vLLM: requests in flight")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (at least 5)")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint folder (default: the tiny test model)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1 (5 or more for a median worth reading)")

    rows = make_requests([args.frames] * args.rows, size_px=args.px, seed=1)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else None
        if ckpt is None:
            ckpt = save_tiny(Path(tmp) / "tiny")
        server = VLLMServer(ckpt, Path(tmp) / "serve", name="bench")
        try:
            local = TransformersBackend(
                str(ckpt),
                device="cpu",
                batch_size=args.batch_size,
                max_new_tokens=args.max_new_tokens,
                dtype="float32",
            )
            url = server.wait()
            with OpenAIBackend(
                url,
                "bench",
                max_concurrency=args.concurrency,
                max_tokens=args.max_new_tokens,
                deadlines=Deadlines(first_byte_s=600, answer_s=600),
            ) as remote:
                seconds, outs = interleaved(
                    {"local": lambda: local.generate(rows), "vllm": lambda: remote.generate(rows)}, args.rounds
                )
            version = server.version
        finally:
            server.stop()
    local_out, vllm_out = outs["local"], outs["vllm"]
    local_s, vllm_s = statistics.median(seconds["local"]), statistics.median(seconds["vllm"])
    ratio, low, high = ratio_summary(seconds["local"], seconds["vllm"])
    equal = sum(a.text == b.text for a, b in zip(local_out, vllm_out, strict=True))
    failed = sum(not r.ok for r in vllm_out)
    first_diff = []  # per differing row: the length of the common prefix of the two texts, in characters
    for a, b in zip(local_out, vllm_out, strict=True):
        if a.ok and b.ok and a.text != b.text:
            pairs = zip(a.text, b.text, strict=False)
            first_diff.append(next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a.text), len(b.text))))
    print(
        f"rows: {args.rows} x {args.frames} frames of {args.px}² px, greedy, max_new_tokens {args.max_new_tokens}, "
        f"checkpoint {args.checkpoint or 'tiny (tests)'}"
    )
    print(f"local transformers (batch {args.batch_size}): {args.rows / local_s:8.2f} rows/s (median {local_s:.2f} s)")
    print(
        f"vLLM {version} CPU (concurrency {args.concurrency}): {args.rows / vllm_s:8.2f} rows/s (median {vllm_s:.2f} s)"
    )
    print(
        f"speed-up vLLM over local, median of {args.rounds} interleaved rounds: {ratio:.2f}x (range {low:.2f}-"
        f"{high:.2f}x); equal texts: {equal}/{args.rows}; vLLM failures: {failed}"
    )
    if first_diff:
        print(f"differing rows: the texts agree on their first {sorted(first_diff)} characters (float32 greedy)")


if __name__ == "__main__":
    main()
