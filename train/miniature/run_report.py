"""The report of one miniature run: the claim check ((a) against SFT, (c), (b), (d), (e), by the intervals' half-widths),
the paired intervals of (a) minus each other model, the summary table with the verifier lines (`results.md`), and
the reward curves (`reward_curves.png`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from train.miniature.power import METRICS, paired_bootstrap
from train.miniature.runs import GRPO_RUNS, MODELS, MORE_SFT_RUNS


def pct(value: float | None) -> str:
    """Return a rate as a whole percentage (`"85%"`), "n/a" for None."""
    return "n/a" if value is None else f"{value:.0%}"


PAIRED = {
    "more_sft_llm": "(a) - (e)",
    "grpo_f": "(a) - (f)",
    "grpo_b": "(a) - (b)",
    "grpo_g": "(a) - (g)",
    "grpo_h": "(a) - (h)",
    "sft": "(a) - SFT",
    "grpo_c": "(a) - (c)",
    "more_sft": "(a) - (d)",
}


def paired_against_a(records: dict[str, list[dict[str, Any]]], n_bootstrap: int, seed: int) -> dict[str, Any]:
    """Return the paired bootstrap interval of (a) minus each other finished model, per metric (train.miniature.power);
    {} where (a) did not run."""
    out: dict[str, Any] = {}
    if "grpo_a" not in records:
        return out
    for name, key in PAIRED.items():
        if name not in records:
            continue
        for metric, statistic in METRICS.items():
            got = paired_bootstrap([(records["grpo_a"], records[name])], statistic, n_bootstrap=n_bootstrap, seed=seed)
            out[f"{metric}: {key}"] = {
                k: None if isinstance(v, float) and math.isnan(v) else v for k, v in got.items()
            }
    return out


def _half_width(metric: dict[str, Any]) -> float:
    low, high = metric.get("ci_low"), metric.get("ci_high")
    return math.nan if low is None or high is None else (high - low) / 2


def claim_check(results: dict[str, Any]) -> dict[str, Any]:
    """Does (a) beat SFT and (c) on average B-Acc or K-Hit by more than the intervals' half-width? And (a) vs (b)?

    The margin compared against is the larger half-width of the two models' 95 % intervals. `beats_more_sft`: does
    (a) also beat (d) and (e), SFT continued on as many rows (None when neither ran)? Without (a), both are None.
    """
    out: dict[str, Any] = {}
    if "grpo_a" not in results:
        return {"claim_holds": None, "beats_more_sft": None}
    a = results["grpo_a"]
    for metric in ("average_bacc", "k_hit"):
        for other in [m for m in ("sft", "grpo_c", "grpo_b", *MORE_SFT_RUNS) if m in results]:  # any may be missing
            b = results[other]
            half = max(_half_width(a[metric]), _half_width(b[metric]))
            if math.isnan(half):  # a metric without an interval (say K-Hit of a model that reports no lesion)
                out[f"{metric}: (a) - {other}"] = {"gap": None, "half_width": None, "beyond_interval": False}
                continue
            gap = (a[metric]["value"] or 0.0) - (b[metric]["value"] or 0.0)
            out[f"{metric}: (a) - {other}"] = {"gap": gap, "half_width": half, "beyond_interval": gap > half}
    beats = [  # without a (c) run, against SFT alone (lr 0 reproduces SFT's weights, so its tables too)
        out[f"{m}: (a) - sft"]["beyond_interval"]
        and out.get(f"{m}: (a) - grpo_c", {"beyond_interval": True})["beyond_interval"]
        for m in ("average_bacc", "k_hit")
    ]
    out["claim_holds"] = any(beats)
    more = [m for m in MORE_SFT_RUNS if m in results]  # beyond the claim: does (a) beat supervised training too?
    out["beats_more_sft"] = (
        any(all(out[f"{metric}: (a) - {m}"]["beyond_interval"] for m in more) for metric in ("average_bacc", "k_hit"))
        if more
        else None
    )
    return out


def _verdict(value: dict[str, Any]) -> str:
    """Return "above the interval", "below the interval" or "within the interval" for a claim-check entry."""
    if value["gap"] is None:
        return "no interval to compare"
    if value["gap"] > value["half_width"]:
        return "above the interval"
    return "below the interval" if value["gap"] < -value["half_width"] else "within the interval"


def results_markdown(results: dict[str, Any], claim: dict[str, Any], paired: dict[str, Any] | None = None) -> str:
    """Return the summary table (value and 95 % interval per model) and the claim lines."""

    def cell(m: dict[str, Any]) -> str:
        if m["value"] is None:
            return "n/a"
        low, high = m.get("ci_low"), m.get("ci_high")
        return f"{100 * m['value']:.1f} [{100 * (low or 0):.1f}, {100 * (high or 0):.1f}]"

    lines = [
        "| model | parse | average B-Acc (95 % CI) | K-Hit (95 % CI) | Table 2 overall (95 % CI) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results.values():
        lines.append(
            f"| {r['label']} | {r['parse_rate']:.0%} | {cell(r['average_bacc'])} | {cell(r['k_hit'])} | "
            f"{cell(r['table2_overall'])} |"
        )
    lines.append("")
    for key, value in claim.items():
        if isinstance(value, dict) and value["gap"] is None:
            lines.append(f"- {key}: n/a: {_verdict(value)}")
        elif isinstance(value, dict):
            lines.append(
                f"- {key}: {100 * value['gap']:+.1f} points (half-width {100 * value['half_width']:.1f}): "
                f"{_verdict(value)}"
            )
    if claim["claim_holds"] is None:
        lines.append("- claim ((a) beats SFT and (c)): not checked, (a) did not run")
    else:
        lines.append(f"- claim ((a) beats SFT and (c) beyond the intervals on B-Acc or K-Hit): {claim['claim_holds']}")
        lines.append(
            f"- verdict: the claim held in {int(claim['claim_holds'])} of 1 seeds (this run; across seeds: "
            "`--seeds`, `make miniature-seeds`, `make miniature-study`)"
        )
    if claim.get("beats_more_sft") is not None:
        lines.append(
            "- beyond the claim ((a) beats more SFT on the same rows, (d) and (e), beyond the intervals on "
            f"B-Acc or K-Hit): {claim['beats_more_sft']}"
        )
    lines += _paired_lines(paired or {}) + _verifier_lines(results)
    return "\n".join(lines) + "\n"


def _paired_lines(paired: dict[str, Any]) -> list[str]:
    """Return the paired-interval table lines (in points), [] without any."""
    if not paired:
        return []
    lines = ["", "| paired difference (same test rows) | points | 95 % interval |", "| --- | --- | --- |"]
    for key, value in paired.items():
        low, high, diff = value["ci_low"], value["ci_high"], value["diff"]
        interval = "n/a" if low is None else f"[{100 * low:+.1f}, {100 * high:+.1f}]"
        lines.append(f"| {key} | {'n/a' if diff is None else f'{100 * diff:+.1f}'} | {interval} |")
    return lines


def _verifier_lines(results: dict[str, Any]) -> list[str]:
    """Return the verifier-accuracy lines (the models that have one)."""
    from train.tiny.warmup_checks import format_verifier  # lazy: train.tiny.warmup_checks loads torch: +5 s (measured)

    lines = [
        f"- verifier of {r['label']}: {format_verifier(r['verifier']['seen'])}; blind control "
        f"{format_verifier(r['verifier']['blind'])}"
        for r in results.values()
        if r.get("verifier")
    ]
    return ["", *lines] if lines else []


def save_curves_png(curves: dict[str, dict[str, list]], path: Path) -> Path:
    """Plot R and r_c per step for each GRPO run."""
    import matplotlib  # lazy: matplotlib.use("Agg") below sets the process's backend: only where a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use("Agg")

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    colors = {name: f"C{i}" for i, name in enumerate(GRPO_RUNS)}  # one colour per run, both panels
    for name, curve in curves.items():
        for ax, key in zip(axes, ("reward", "rewards/r_c/mean"), strict=True):
            points = curve.get(key, [])
            if points:
                ax.plot(
                    [s for s, _ in points],
                    [v for _, v in points],
                    marker="o",
                    ms=2,
                    label=MODELS[name],
                    color=colors.get(name),
                )
    for ax, title in zip(axes, ("R (weighted reward)", "r_c (verifier consistency)"), strict=True):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
