"""The miniature over several seeds: one run per seed (its own data, warm-up, SFT and GRPO), then one table.

`python -m train.miniature --config train/configs/miniature.yaml --output_dir DIR --seeds 0 1 2` runs
`DIR/seed-<s>` for each seed (each resumable on its own) and writes `DIR/seeds.json` and `DIR/seeds.md`:
each seed's B-Acc and K-Hit per model, each comparison's gap per seed with its mean, and in how many seeds the gap
was beyond the intervals' half-width (the claim check of `train.miniature.run_report.claim_check`, seed by seed).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


METRICS = {"average_bacc": "average B-Acc", "k_hit": "K-Hit"}


def seed_dir(output_dir: str | Path, seed: int) -> Path:
    """Return the folder of one seed's run."""
    return Path(output_dir) / f"seed-{seed}"


def summarize_seeds(results: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Return the per-seed values, the per-comparison gaps (mean, min, max, beyond the interval in k of n seeds).

    Args:
        results: seed -> that run's `results.json` (its "models" and "claim").
    """
    seeds = sorted(results)
    labels: dict[str, str] = {}
    values: dict[str, dict[str, dict[int, float | None]]] = {}
    for seed in seeds:
        for name, model in results[seed]["models"].items():
            labels.setdefault(name, model["label"])
            for metric in METRICS:
                values.setdefault(name, {}).setdefault(metric, {})[seed] = model[metric]["value"]
    comparisons: dict[str, Any] = {}
    for seed in seeds:
        for key, entry in results[seed]["claim"].items():
            if isinstance(entry, dict) and entry["gap"] is not None:  # no interval in that seed: not counted
                comparisons.setdefault(key, {"gaps": {}, "beyond": {}})
                comparisons[key]["gaps"][seed] = entry["gap"]
                comparisons[key]["beyond"][seed] = entry["beyond_interval"]
    for entry in comparisons.values():
        gaps = list(entry["gaps"].values())
        entry.update(
            n_seeds=len(gaps),
            mean_gap=statistics.fmean(gaps),
            min_gap=min(gaps),
            max_gap=max(gaps),
            n_beyond=sum(entry["beyond"].values()),
        )
    flags = {
        flag: {seed: results[seed]["claim"].get(flag) for seed in seeds} for flag in ("claim_holds", "beats_more_sft")
    }
    return {"seeds": seeds, "labels": labels, "values": values, "comparisons": comparisons, "flags": flags}


def seeds_markdown(summary: dict[str, Any], claims: bool = True) -> str:
    """Return the tables: value per model and seed, then each comparison's gaps across the seeds (in points), then
    (with `claims`) in how many seeds the miniature's claim held."""
    seeds = summary["seeds"]
    head = " | ".join(f"seed {s}" for s in seeds)
    lines = [f"| model | metric | {head} | mean |", "| --- | --- |" + " --- |" * (len(seeds) + 1)]
    for name, per_metric in summary["values"].items():
        for metric, label in METRICS.items():
            got = [per_metric[metric].get(s) for s in seeds]
            cells = " | ".join("n/a" if v is None else f"{100 * v:.1f}" for v in got)
            known = [v for v in got if v is not None]
            mean = f"{100 * statistics.fmean(known):.1f}" if known else "n/a"
            lines.append(f"| {summary['labels'][name]} | {label} | {cells} | {mean} |")
    lines += ["", f"| comparison | {head} | mean | beyond the interval |", "| --- |" + " --- |" * (len(seeds) + 2)]
    for key, entry in summary["comparisons"].items():
        cells = " | ".join(f"{100 * entry['gaps'][s]:+.1f}" if s in entry["gaps"] else "n/a" for s in seeds)
        lines.append(
            f"| {key} | {cells} | {100 * entry['mean_gap']:+.1f} | {entry['n_beyond']} of {entry['n_seeds']} |"
        )
    lines.append("")
    flags = (("claim_holds", "claim ((a) beats SFT and (c))"), ("beats_more_sft", "(a) beats (d) and (e)"))
    for flag, text in flags if claims else ():
        got = [v for v in summary["flags"][flag].values() if v is not None]
        if got:
            lines.append(f"- {text}: {sum(got)} of {len(got)} seeds")
    return "\n".join(lines) + "\n"


def save_seeds_png(results: dict[int, dict[str, Any]], path: Path) -> Path:
    """Plot each model's B-Acc and K-Hit per seed with its 95 % interval (one colour per seed)."""
    import matplotlib  # lazy: matplotlib.use("Agg") below sets the process's backend: only where a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use("Agg")

    seeds = sorted(results)
    names = list(dict.fromkeys(n for s in seeds for n in results[s]["models"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (metric, title) in zip(axes, METRICS.items(), strict=True):
        for j, seed in enumerate(seeds):
            xs: list[float] = []
            ys: list[float] = []
            err: list[list[float]] = [[], []]
            for i, name in enumerate(names):
                m = results[seed]["models"].get(name, {}).get(metric, {})
                if m.get("value") is None:
                    continue
                x, y = i + (j - (len(seeds) - 1) / 2) * 0.2, 100 * m["value"]
                xs.append(x)
                ys.append(y)
                err[0].append(y - 100 * (m.get("ci_low") if m.get("ci_low") is not None else m["value"]))
                err[1].append(100 * (m.get("ci_high") if m.get("ci_high") is not None else m["value"]) - y)
            ax.errorbar(xs, ys, yerr=err, fmt="o", ms=4, capsize=2, label=f"seed {seed}")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([results[seeds[0]]["models"].get(n, {}).get("label", n).split(" ")[0] for n in names])
        ax.set_title(f"{title} (%), 95 % intervals", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.text(
        0.5,
        0.01,
        "  ".join(results[seeds[0]]["models"][n]["label"] for n in names if n in results[seeds[0]]["models"]),
        ha="center",
        fontsize=7,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_seeds_summary(output_dir: str | Path, seeds: list[int]) -> dict[str, Any]:
    """Read each seed's `results.json` under `output_dir`; write `seeds.json`, `seeds.md` and `seeds.png`; return the
    summary."""
    results = {s: json.loads((seed_dir(output_dir, s) / "results.json").read_text()) for s in seeds}
    summary = summarize_seeds(results)
    out = Path(output_dir)
    (out / "seeds.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    (out / "seeds.md").write_text(seeds_markdown(summary))
    save_seeds_png(results, out / "seeds.png")
    return summary
