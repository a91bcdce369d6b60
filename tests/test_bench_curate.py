"""The arithmetic of `bench/curate.py`'s summary, on constructed samples with exact expected ratios."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_curate", Path(__file__).parent.parent / "bench" / "curate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _floor(cpu: float, png: float, sha: float, scan: float) -> dict[str, float]:
    return {
        "cpu_s": cpu,
        "seconds": cpu,
        "png_cpu_s": png,
        "png_s": png,
        "sha256_cpu_s": sha,
        "scan_cpu_s": scan,
        "peak_rss_mb": 100.0,
    }


def _ours(cpu: float, rss: float = 400.0) -> dict[str, float]:
    return {"cpu_s": cpu, "seconds": cpu, "peak_rss_mb": rss}


def test_summary_ratios_are_per_round_totals_over_both_cases_then_the_median() -> None:
    bench = _bench()
    samples = {
        "ours": {"lesions": [_ours(1.0), _ours(1.2), _ours(0.9, 450.0)], "no_lesions": [_ours(0.5)] * 3},
        "floor": {
            "lesions": [_floor(0.6, 0.1, 0.05, 0.05)] * 3,
            "no_lesions": [_floor(0.4, 0.1, 0.03, 0.02)] * 3,
        },
        "naive": {"lesions": [_ours(30.0)], "no_lesions": []},
    }
    summary = bench.summarise(samples, "cpu_s")
    # rounds: (1.0 + 0.5) / 1.0 = 1.5, (1.2 + 0.5) / 1.0 = 1.7, (0.9 + 0.5) / 1.0 = 1.4 -> median 1.5
    assert summary["ours/fair_floor"] == pytest.approx(1.5)
    # PNG 0.2 of a 1.0 floor; required work 0.2 + 0.08 + 0.07 = 0.35
    assert summary["png_encode/fair_floor"] == pytest.approx(0.2)
    assert summary["required/fair_floor"] == pytest.approx(0.35)
    assert summary["ours/(fair_floor+png_encode)"] == pytest.approx(1.5 / 1.2)
    assert summary["ours/(fair_floor+required)"] == pytest.approx(1.5 / 1.35)
    assert summary["naive/ours"] == pytest.approx(30.0 / 1.0)  # median of ours on the lesion case: 1.0
    assert summary["peak_rss_mb"] == 450.0


def test_wall_clock_summary_leaves_out_the_cpu_only_shares() -> None:
    bench = _bench()
    samples = {
        "ours": {"lesions": [_ours(1.0)], "no_lesions": [_ours(0.5)]},
        "floor": {"lesions": [_floor(0.6, 0.1, 0.05, 0.05)], "no_lesions": [_floor(0.4, 0.1, 0.03, 0.02)]},
        "naive": {"lesions": [_ours(30.0)], "no_lesions": []},
    }
    summary = bench.summarise(samples, "seconds")
    assert summary["ours/(fair_floor+png_encode)"] == pytest.approx(1.25)
    assert "required/fair_floor" not in summary and "ours/(fair_floor+required)" not in summary
