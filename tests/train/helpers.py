"""Helpers of the `train` tests, also imported by `grpo_vllm_probe.py` in the vLLM side environment (stdlib only)."""

from __future__ import annotations

from collections.abc import Collection, Iterable


def until_eos(ids: Iterable[int], eos_ids: Collection[int]) -> list[int]:
    """Cut a token list after its first EOS (kept), as TRL masks completions."""
    out = []
    for t in ids:
        out.append(int(t))
        if int(t) in eos_ids:
            break
    return out
