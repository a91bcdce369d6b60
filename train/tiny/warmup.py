"""The demo's and the miniature's LM warm-up (not the paper's recipe): a random tiny LLM learns both languages it needs.

Qwen3-VL-8B-Instruct already writes reports and describes a single image; a randomly initialised tiny Qwen3-VL does
neither. The warm-up trains every part of it on two tasks at once, each step one batch of each:

* the report task: the row's frames as a video + its prompt -> its report (what SFT and GRPO use);
* the verifier task: one frame as an image + `VERIFIER_PROMPT` -> a description of that frame. On rows of
  `train.tiny.synthetic.make_visible_rows` (`lesion_span` given) EVERY frame is an example (`frame_targets`): a
  frame whose slice shows the lesion gets the lesion as that slice shows it (side, attenuation, the long axis there),
  every other frame the organ's negative sentence; each step's verifier batch is half of each (`BalancedPairs`).
  Without a span (rows whose per-slice truth is unknown) a positive row's key frame gets the report's findings
  sentence and one frame at least 3 away the negative sentence. Without the task the verifier (r_c) writes nothing
  `parse_free_text` can score and r_c is -λ for every completion.

It stops on a criterion, not a step count: every `eval_every` steps the greedy reports of held-out rows (never trained
on) are parsed, and, with a span, the verifier is asked about held-out frames (`verifier_accuracy`: presence
sensitivity and specificity, location and attenuation on lesion frames). The warm-up ends once the parse rates reach
their targets and every verifier accuracy reaches `target_verifier_accuracy` (with `gate_checks` k > 1, its mean over the
last k checks: a study's gate does not pass on a first lucky check). Reaching the step cap first is a
`TrainConfigError` (one line: what was reached, the cap, the fix).

The verifier task's data: `train.tiny.verifier_data`; the held-out checks: `train.tiny.warmup_checks`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from emrl_data.text.parser import parse_report
from model_io.processor import CTQwen3VLProcessor
from train.checks import SeedMissed, TrainConfigError
from train.data import SFTCollator
from train.freeze import set_stage_trainable
from train.tiny.verifier_data import BalancedPairs, VerifierCollator
from train.tiny.warmup_checks import (
    VERIFIER_GATES,
    VERIFIER_RATES,
    fails_to_parse,
    format_verifier,
    report_parse_rate,
    reports_claim_both_classes,
    verifier_accuracy,
    verifier_claim_rate,
    verifier_gaps,
)


logger = logging.getLogger(__name__)


class WarmupMissed(SeedMissed):
    """The warm-up reached its step cap before its targets (parse rates, both classes, the verifier's gates)."""


@dataclass
class WarmupResult:
    """What the warm-up did: steps, the parse rate per check `(step, rate)`, the last losses, seconds."""

    steps: int
    parse_rates: list[tuple[int, float]] = field(default_factory=list)
    sampled_parse_rates: list[tuple[int, float]] = field(default_factory=list)
    verifier_rates: list[tuple[int, float]] = field(default_factory=list)
    verifier_accuracy: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    report_loss: float = float("nan")
    verifier_loss: float = float("nan")
    both_classes: bool = False
    seconds: float = 0.0

    @property
    def parse_rate(self) -> float:
        """The last checked held-out parse rate (nan before any check)."""
        return self.parse_rates[-1][1] if self.parse_rates else float("nan")

    @property
    def sampled_parse_rate(self) -> float:
        """The last checked held-out parse rate of sampled reports (nan when not checked)."""
        return self.sampled_parse_rates[-1][1] if self.sampled_parse_rates else float("nan")


def held_out_indices(n_rows: int, n_val: int) -> list[int]:
    """Return `n_val` evenly spaced row indices of `n_rows` (validation rows that span a table sorted by organ).

    >>> held_out_indices(56, 8)
    [3, 10, 17, 24, 31, 38, 45, 52]
    """
    return [int((i + 0.5) * n_rows / n_val) for i in range(n_val)]


# The demo's configuration keys (`train.tiny.demo_sft`) for `WarmupPlan.keys`; the miniature passes its own.
DEMO_WARMUP_KEYS = {
    "max_steps": "lm_warmup_steps",
    "eval_every": "lm_warmup_eval_every",
    "learning_rate": "lm_warmup_learning_rate",
}


@dataclass
class WarmupPlan:
    """The warm-up's knobs (see `lm_warmup`)."""

    max_steps: int
    learning_rate: float
    batch_size: int = 2
    verifier_batch_size: int = 2
    eval_every: int = 50
    target_parse_rate: float = 0.95
    target_sampled_parse_rate: float = 0.0
    max_new_tokens: int = 128
    seed: int = 0
    verifier_task: bool = True
    lesion_span: int | None = None
    target_verifier_accuracy: float = 0.0
    verifier_gates: tuple[str, ...] = VERIFIER_GATES
    gate_checks: int = 1  # the gates hold on each rate's mean over this many last checks
    verifier_eval_frames: int = 48
    verifier_max_new_tokens: int = 48
    require_both_classes: bool = False
    balanced: bool = True
    # The caller's configuration keys for the step cap, the check interval and the rate, as the error lines name them.
    keys: Mapping[str, str] = field(default_factory=lambda: dict(DEMO_WARMUP_KEYS))


def balanced_rows(rows: Sequence[Mapping[str, Any]], rng: np.random.Generator, n: int) -> list[Mapping[str, Any]]:
    """Draw `n` report rows, `n // 2` positive and the rest negative when both kinds exist (else `n` of any): a
    majority class does not become the warm-up's one answer."""
    pos = [r for r in rows if r["has_lesion"]]
    neg = [r for r in rows if not r["has_lesion"]]
    if not pos or not neg:
        return [rows[int(i)] for i in rng.integers(len(rows), size=n)]
    n_pos = n // 2 if n > 1 else int(rng.integers(2))
    return [pos[int(i)] for i in rng.integers(len(pos), size=n_pos)] + [
        neg[int(i)] for i in rng.integers(len(neg), size=n - n_pos)
    ]


def _check_plan(rows: Sequence[Any], val_rows: Sequence[Any], plan: WarmupPlan) -> None:
    if not rows or not val_rows:
        raise TrainConfigError(f"LM warm-up needs training and validation rows (got {len(rows)} and {len(val_rows)}).")
    if plan.eval_every <= 0 or plan.max_steps < plan.eval_every:
        raise TrainConfigError(
            f"{plan.keys['eval_every']}={plan.eval_every} must be in 1..{plan.keys['max_steps']} ({plan.max_steps})."
        )
    unknown = sorted(set(plan.verifier_gates) - set(VERIFIER_RATES))
    if unknown:
        raise TrainConfigError(f"LM warm-up: unknown verifier gates {unknown}; the gates are {list(VERIFIER_RATES)}")
    if plan.target_verifier_accuracy > 0 and (plan.lesion_span is None or not plan.verifier_task):
        raise TrainConfigError(
            "LM warm-up: target_verifier_accuracy needs the verifier task and a lesion_span (per-slice truth)"
        )


def _train_step(model: Any, opt: Any, params: list, batch: Any, vbatch: Any, result: WarmupResult) -> None:
    """One optimizer step on a report batch plus (when given) a verifier batch."""
    opt.zero_grad()
    loss = model(**batch).loss
    result.report_loss = float(loss.detach())
    if vbatch is not None:
        vloss = model(**vbatch).loss
        result.verifier_loss = float(vloss.detach())
        loss = loss + vloss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def _check(
    model: Any,
    processor: Any,
    val_rows: Sequence[Mapping[str, Any]],
    plan: WarmupPlan,
    result: WarmupResult,
    step: int,
    class_rows: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[bool, str]:
    """Measure the criterion at `step`; return (met, the progress line)."""
    rate, reports = report_parse_rate(model, processor, val_rows, plan.max_new_tokens)
    result.parse_rates.append((step, rate))
    line = f"  warm-up step {step}: report loss {result.report_loss:.3f}"
    sampled_ok = True
    if plan.target_sampled_parse_rate > 0:
        sampled, _ = report_parse_rate(model, processor, val_rows, plan.max_new_tokens, sample_seed=plan.seed)
        result.sampled_parse_rates.append((step, sampled))
        sampled_ok = sampled >= plan.target_sampled_parse_rate
    verifier_ok = True
    if plan.verifier_task:
        line += f", verifier loss {result.verifier_loss:.3f}"
        if plan.lesion_span is not None:
            acc = verifier_accuracy(
                model,
                processor,
                val_rows,
                plan.lesion_span,
                max_frames=plan.verifier_eval_frames,
                max_new_tokens=plan.verifier_max_new_tokens,
            )
            result.verifier_accuracy.append((step, acc))
            verifier_ok = not _verifier_gaps(result, plan)
            line += f", verifier {format_verifier(acc)}"
            if plan.gate_checks > 1:
                line += f" (gated on the mean of the last {plan.gate_checks} checks: {_window_line(result, plan)})"
        else:
            vrate = verifier_claim_rate(model, processor, val_rows)
            if vrate is not None:
                result.verifier_rates.append((step, vrate))
            line += (
                ", no positive held-out row for the verifier"
                if vrate is None
                else (f", verifier names the lesion on {vrate:.0%} of key frames")
            )
    line += f"; held-out parse rate {rate:.0%} (target {plan.target_parse_rate:.0%})"
    if plan.target_sampled_parse_rate > 0:
        line += f", sampled {result.sampled_parse_rate:.0%} (target {plan.target_sampled_parse_rate:.0%})"
    failed = [(r, t) for r, t in zip(val_rows, reports, strict=True) if fails_to_parse(t, r["organ"])]
    if failed:
        why = parse_report(failed[0][1], failed[0][0]["organ"])
        line += f"; e.g. {why.reason} on {failed[0][0]['organ']}: {failed[0][1][:90]!r}"  # type: ignore[union-attr]
    others_ok = rate >= plan.target_parse_rate and sampled_ok and verifier_ok
    if class_rows is None:
        result.both_classes = reports_claim_both_classes(val_rows, reports)
    elif others_ok:  # generating the class rows' reports costs a check's time: only once the rest is met
        _, class_reports = report_parse_rate(model, processor, class_rows, plan.max_new_tokens)
        result.both_classes = reports_claim_both_classes(class_rows, class_reports)
    else:
        result.both_classes = False
    classes_ok = not plan.require_both_classes or result.both_classes
    if plan.require_both_classes:
        where = "" if class_rows is None else f" on the {len(class_rows)} class rows"
        line += f"; {'both' if classes_ok else 'not both'} classes claimed{where}"
    return others_ok and classes_ok, f"{line}, {len(val_rows)} rows"


def gate_window(result: WarmupResult, checks: int, gates: Sequence[str]) -> dict[str, float | None] | None:
    """Return each gated rate's mean over the last `checks` verifier checks (None where one of them has no value), or
    None before `checks` checks: one lucky check does not pass the gates."""
    if len(result.verifier_accuracy) < checks:
        return None
    last = [acc for _, acc in result.verifier_accuracy[-checks:]]
    return {g: None if any(a.get(g) is None for a in last) else float(np.mean([a[g] for a in last])) for g in gates}


def _verifier_gaps(result: WarmupResult, plan: WarmupPlan) -> list[str]:
    """The gates the last `plan.gate_checks` checks miss on average (`verifier_gaps` of `gate_window`)."""
    window = gate_window(result, plan.gate_checks, plan.verifier_gates)
    if window is None:
        return [] if plan.target_verifier_accuracy <= 0 else [f"fewer than {plan.gate_checks} checks"]
    return verifier_gaps(window, plan.target_verifier_accuracy, plan.verifier_gates)


def _window_line(result: WarmupResult, plan: WarmupPlan) -> str:
    window = gate_window(result, plan.gate_checks, plan.verifier_gates)
    if window is None:
        return f"{len(result.verifier_accuracy)} so far"
    return ", ".join(f"{g} {'n/a' if v is None else f'{v:.0%}'}" for g, v in window.items())


def _raise_if_missed(result: WarmupResult, plan: WarmupPlan) -> None:
    """Raise the one-line `WarmupMissed` when the last check missed a target."""
    cap = plan.keys["max_steps"]
    sampled_ok = plan.target_sampled_parse_rate <= 0 or result.sampled_parse_rate >= plan.target_sampled_parse_rate
    if result.parse_rate < plan.target_parse_rate or not sampled_ok:
        sampled_text = f", sampled {result.sampled_parse_rate:.0%}" if plan.target_sampled_parse_rate > 0 else ""
        raise WarmupMissed(
            f"LM warm-up: held-out parse rate {result.parse_rate:.0%}{sampled_text} below its target after the "
            f"step cap {cap}={plan.max_steps}; raise {cap} or lower {plan.keys['learning_rate']}"
        )
    if plan.require_both_classes and not result.both_classes:
        raise WarmupMissed(
            "LM warm-up: the greedy reports (held-out or class rows) never claimed a lesion on a positive row and "
            f"none on a negative one by the step cap {cap}={plan.max_steps}; raise {cap}"
        )
    gaps = _verifier_gaps(result, plan) if result.verifier_accuracy else []
    if gaps:
        raise WarmupMissed(
            f"LM warm-up: held-out verifier accuracy below its gates ({'; '.join(gaps)}) after the step cap "
            f"{cap}={plan.max_steps}; raise {cap}, or the warm-up cannot teach the verifier "
            "to read one slice and r_c would score a blind verifier"
        )


def lm_warmup(
    model: Any,
    processor: CTQwen3VLProcessor,
    rows: Sequence[Mapping[str, Any]],
    val_rows: Sequence[Mapping[str, Any]],
    *,
    log: Any = None,
    class_rows: Sequence[Mapping[str, Any]] | None = None,
    report_rows: Sequence[Mapping[str, Any]] | None = None,
    **knobs: Any,
) -> WarmupResult:
    """Train every part of `model` on the report and verifier tasks until the held-out criterion is met.

    Args:
        model: the tiny Qwen3-VL (trained in place; every parameter trains, stage "lm_warmup").
        processor: its processor.
        rows: training rows (sft columns, frames decoded or not).
        val_rows: held-out rows for the criterion (greedy reports parsed; with `lesion_span`, verifier frames).
        log: where the one progress line per check goes (default: print, flushed).
        class_rows: the rows whose greedy reports `require_both_classes` looks at (default: `val_rows`), generated
            only at a check where every other target is met.
        report_rows: the report task's training rows (default: `rows`); the verifier task keeps reading `rows`, so
            report targets can name another key frame than the one each frame's verifier truth is measured from.
        **knobs: `WarmupPlan`'s fields. max_steps: the step cap (one report batch + one verifier batch a step);
            learning_rate: constant AdamW rate; batch_size / verifier_batch_size: report rows / verifier pairs a step
            (half with a lesion, half without); eval_every: steps between checks; target_parse_rate: greedy reports'
            held-out parse rate to reach; target_sampled_parse_rate: that of reports sampled at temperature 1 (0 = not
            checked); max_new_tokens: the report budget; seed: sampling and torch seed; verifier_task: train the
            verifier too; lesion_span: the rows' span (`make_visible_rows`): every frame becomes a verifier example
            (`frame_targets`), and the check measures `verifier_accuracy`; target_verifier_accuracy: its gates
            (0 = reported, not required) on the rates `verifier_gates` names (default `VERIFIER_GATES`: sensitivity,
            specificity, location, attenuation; `VERIFIER_RATES` adds size), each rate's mean over the last
            `gate_checks` checks (default 1: the last check alone); verifier_eval_frames,
            verifier_max_new_tokens: that measurement's frames and answer budget; keys: the caller's configuration
            keys of max_steps, eval_every and learning_rate, which the error lines name (default: the demo's).

    Raises:
        TrainConfigError: when the step cap is reached before the criterion, or with no training/validation rows.
    """
    plan = WarmupPlan(**knobs)
    _check_plan(rows, val_rows, plan)
    reports = rows if report_rows is None else report_rows
    if not reports:
        raise TrainConfigError("LM warm-up: no report rows to train on")
    log = log or (lambda line: print(line, flush=True))
    torch.manual_seed(plan.seed)
    rng = np.random.default_rng(plan.seed)
    set_stage_trainable(model, "lm_warmup")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=plan.learning_rate, weight_decay=0.0)
    report_collate, verifier_collate = SFTCollator(processor), VerifierCollator(processor)
    pairs = BalancedPairs(rows, rng, plan.lesion_span, plan.balanced) if plan.verifier_task else None
    result = WarmupResult(steps=0)
    start = time.perf_counter()
    for step in range(1, plan.max_steps + 1):
        drawn = (
            balanced_rows(reports, rng, plan.batch_size)
            if plan.balanced
            else [reports[int(i)] for i in rng.integers(len(reports), size=plan.batch_size)]
        )
        batch = report_collate(drawn)
        vbatch = verifier_collate(pairs.draw(plan.verifier_batch_size)) if pairs is not None and len(pairs) else None
        _train_step(model, opt, params, batch, vbatch, result)
        result.steps = step
        if step % plan.eval_every == 0 or step == plan.max_steps:
            met, line = _check(model, processor, val_rows, plan, result, step, class_rows)
            log(line)
            if met:
                break
    result.seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    _raise_if_missed(result, plan)
    return result
