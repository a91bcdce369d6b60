"""The arithmetic of `bench/fingerprint.py`'s summary, on constructed samples with exact expected values."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest


def _bench() -> Any:
    path = Path(__file__).parent.parent / "bench" / "fingerprint.py"
    spec = importlib.util.spec_from_file_location("bench_fingerprint", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ratio_is_taken_per_round_then_the_median() -> None:
    # rounds (curation, fingerprint): ratios 0.1, 0.25, 0.2 -> median 0.2 (not 0.35 / 2.1 of the medians' ratio)
    summary = _bench().summarise([(1.0, 0.1), (0.4, 0.1), (0.7, 0.14)])
    assert summary["fingerprint/curation"] == pytest.approx(0.2)
    assert summary["fingerprint_cpu_s"] == pytest.approx(0.1)
    assert summary["curation_cpu_s"] == pytest.approx(0.7)
