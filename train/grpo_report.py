"""What a GRPO run reports: its reward curves from TRL's log history, their picture, the gap to a learning-rate-0
control, and the summary `python -m train.grpo` prints."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


Curve = dict[str, list[tuple[int, float]]]

_TERM_COLORS = tuple(f"C{i}" for i in range(10))  # matplotlib's cycle: tab:blue, tab:orange, tab:green, ...


def term_name(key: str) -> str | None:
    """Return the reward term of a TRL log key `rewards/<name>/mean`, else None.

    >>> term_name("rewards/r_c/mean"), term_name("reward")
    ('r_c', None)
    """
    if key.startswith("rewards/") and key.endswith("/mean"):
        return key[len("rewards/") : -len("/mean")]
    return None


def curve_styles(curve: Curve, control: Curve | None = None) -> dict[str, tuple[str, str]]:
    """Return `{metric: (label, color)}` for every curve of the run and the control: R in black, each term that ran
    named as it is registered, colored in the order TRL logged the terms (the config's order: r_e, r_f, r_c are
    blue, orange, green)."""
    styles = {}
    keys = [*curve, *(k for k in control or {} if k not in curve)]
    terms = [k for k in keys if term_name(k) is not None]
    for key in keys:
        name = term_name(key)
        if key == "reward":
            styles[key] = ("R", "black")
        elif name is not None:
            styles[key] = (name, _TERM_COLORS[terms.index(key) % len(_TERM_COLORS)])
        else:
            styles[key] = (key, "gray")
    return styles


def reward_curve(log_history: list[dict[str, Any]]) -> Curve:
    """Return `{metric: [(step, value), ...]}` for `reward` and every `rewards/<name>/mean` logged by TRL, in the order
    TRL first logged them (its reward functions' order)."""
    curve: Curve = {}
    for entry in log_history:
        for key, value in entry.items():
            if (key == "reward" or term_name(key) is not None) and "step" in entry:
                if isinstance(value, int | float) and not math.isnan(value):
                    curve.setdefault(key, []).append((int(entry["step"]), float(value)))
    return curve


def save_reward_curve_png(curve: Curve, path: str | Path, control: Curve | None = None) -> Path:
    """Plot R and every reward term that ran, per step (solid: the run; dashed: the lr-0 control) to a PNG; return its
    path."""
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    styles = curve_styles(curve, control)
    for source, style, suffix in ((curve, "-", "GRPO"), (control or {}, "--", "lr-0 control")):
        for key, points in sorted(source.items()):
            label, color = styles[key]
            ax.plot(
                [s for s, _ in points],
                [v for _, v in points],
                style,
                marker="o",
                ms=3,
                color=color,
                lw=2.2 if key == "reward" else 1.4,
                label=f"{label} ({suffix})",
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward over the step's completions")
    ax.set_title("E-MRL GRPO reward: run (solid) vs learning-rate-0 control (dashed), same prompts")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def _mean(points: list[tuple[int, float]]) -> float:
    return sum(v for _, v in points) / max(1, len(points))


def run_minus_control(run: list[tuple[int, float]], control: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Mean per-step value of the run minus the control's, and its standard error (Welch: sample variances over
    counts); None with fewer than 2 steps on either side. Steps are treated as independent draws, which a short run's
    reward mostly is (each step samples new completions), so the error says how much of the gap is noise."""
    if len(run) < 2 or len(control) < 2:
        return None
    a, b = [v for _, v in run], [v for _, v in control]
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    var_a = sum((v - mean_a) ** 2 for v in a) / (len(a) - 1)
    var_b = sum((v - mean_b) ** 2 for v in b) / (len(b) - 1)
    return mean_a - mean_b, math.sqrt(var_a / len(a) + var_b / len(b))


def summary_lines(curve: Curve, control: Curve | None, step_logs: list[dict[str, Any]]) -> list[str]:
    """The lines printed after a run: each curve with its mean (and the control's), the run-minus-control reward gap
    with its standard error, and per step `frac_reward_zero_std` and `grad_norm` (`step_logs`: TRL's logged steps)."""
    lines = []
    for key, points in sorted(curve.items()):
        ctrl = f"   (lr-0 control mean {_mean(control[key]):.3f})" if control and key in control else ""
        lines.append(f"  {key:>22}: " + " ".join(f"{v:.3f}" for _, v in points) + f"   mean {_mean(points):.3f}{ctrl}")
    gap = None
    if control and "reward" in curve and "reward" in control:
        gap = run_minus_control(curve["reward"], control["reward"])
    if gap is not None and control is not None:
        lines.append(
            f"  reward, run - lr-0 control: {gap[0]:+.3f} ± {gap[1]:.3f} (1 standard error over {len(curve['reward'])} "
            f"and {len(control['reward'])} steps; a gap inside ~2 errors is noise)"
        )
    zero_std = [h["frac_reward_zero_std"] for h in step_logs]
    grad = [h.get("grad_norm", float("nan")) for h in step_logs]
    lines.append(f"  frac_reward_zero_std per step: {zero_std}; grad_norm per step: {[round(g, 4) for g in grad]}")
    return lines
