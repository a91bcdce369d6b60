"""Why GRPO does or does not move the miniature's scored findings: the reward signal at a checkpoint, measured.

For a checkpoint (the SFT model by default) and a few train prompts, sample `num_generations` completions per prompt
at each temperature, score them exactly as GRPO does (r_e, r_f; r_c with the verifier: the same model, greedy, on the
report's key frame alone) and measure:

1. **spread**: the fraction of groups whose r_e, r_f, r_c, R_a (r_e + r_f + r_c) or R_b (r_e + r_f) is not constant.
   GRPO's advantage is the reward minus its group mean: a group without spread teaches nothing.
2. **does a higher reward mean a better scored finding?** The pooled within-group Pearson correlation of the reward
   with each finding the tables count (existence right: B-Acc; attributes right: Table 2; key slice within +-1: K-Hit)
   and with "parses" (the format). Both are centred per group first (what the advantage sees); only groups where the
   finding applies to every completion (K-Hit, attributes: positive rows) count.
3. **the verifier**: of the key frames it was shown, how often its answer is unreadable, says "no lesion", or
   differs from the report's own size / location / attenuation; how often the frame shows the lesion at all.

It also gives the sampled and the greedy rates of each finding on the same prompts (the eval is greedy: GRPO helps
the tables only when it moves the greedy report).

    python -m train.miniature --config train/configs/miniature.yaml --output_dir miniature-output --stages diagnose
    python -m train.miniature.diagnose --run_dir miniature-output --model grpo_a --split test  # any stage's model

During GRPO itself, `record_rewards` keeps the weighted reward R of every completion the trainer scores, and
`spread_per_step` counts the groups without signal with our own tolerance: a group carries a signal only where the
float64 standard deviation of its R exceeds `SPREAD_TOL` (TRL's `frac_reward_zero_std` counts eight equal rewards of
0.8, float32 std 6.4e-8, as spread).

The computation (`group_summary`, `verifier_summary`, `group_spread`) is pure and tested on constructed groups
(`tests/train/test_miniature_diagnose.py`); `sample_groups` does the sampling.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from emrl_data.text import scoring as sc
from emrl_data.text.parser import ParsedReport, parse_free_text, parse_report
from emrl_data.text.report import VERIFIER_PROMPT
from emrl_data.types import Organ
from train.checks import TrainConfigError
from train.miniature.config import load_config
from train.tiny.synthetic import visible_lesion_radii_px, visible_slice_long_mm


SPREAD_TOL = 1e-6


def group_spread(rewards: Sequence[float], group_size: int, tol: float = SPREAD_TOL) -> dict[str, int]:
    """Return {"groups", "without_signal"} of consecutive groups of `group_size` rewards: a group without signal has a
    population standard deviation of at most `tol` (nan rewards are left out; a group with fewer than two left has
    none).

    >>> group_spread([0.8] * 4 + [0.8, 0.8, 0.8, 0.9], 4)
    {'groups': 2, 'without_signal': 1}
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"group_spread: {len(rewards)} rewards do not make groups of {group_size}")
    flat = 0
    for start in range(0, len(rewards), group_size):
        kept = [float(r) for r in rewards[start : start + group_size] if not math.isnan(float(r))]
        if len(kept) < 2 or statistics.pstdev(kept) <= tol:
            flat += 1
    return {"groups": len(rewards) // group_size, "without_signal": flat}


def weighted_rewards(per_func: Sequence[Sequence[float | None]], weights: Sequence[float]) -> list[float]:
    """Return R per completion as TRL sums it: the weighted rewards, a None (or nan) reward left out."""
    out = []
    for values in zip(*per_func, strict=True):
        terms = [w * float(v) for w, v in zip(weights, values, strict=True) if v is not None and not math.isnan(v)]
        out.append(math.fsum(terms))
    return out


class _Recorded:
    """A reward function that also hands what it returns to `sink` (its other attributes are the wrapped one's)."""

    def __init__(self, inner: Any, sink: list[Any]):
        self._inner, self._sink = inner, sink

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._inner(*args, **kwargs)
        self._sink.append(list(out))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def record_rewards(trainer: Any) -> list[list[list[Any]]]:
    """Wrap `trainer.reward_funcs` (after the trainer is built) so every call's rewards are kept; return the calls:
    one list per reward function, each call's values in order."""
    calls: list[list[list[Any]]] = [[] for _ in trainer.reward_funcs]
    trainer.reward_funcs = [_Recorded(f, calls[i]) for i, f in enumerate(trainer.reward_funcs)]
    return calls


def spread_per_step(calls: list[list[list[Any]]], weights: Sequence[float], group_size: int) -> dict[str, Any]:
    """Return, per recorded generation batch, the groups and the groups without signal, and their totals."""
    steps = [group_spread(weighted_rewards([c[j] for c in calls], weights), group_size) for j in range(len(calls[0]))]
    return {
        "tol": SPREAD_TOL,
        "groups": [s["groups"] for s in steps],
        "without_signal": [s["without_signal"] for s in steps],
        "total_groups": sum(s["groups"] for s in steps),
        "total_without_signal": sum(s["without_signal"] for s in steps),
    }


FINDINGS = ("existence", "attributes", "k_hit", "parse_ok")
REWARDS = ("r_e", "r_f", "r_c", "reward_a", "reward_b")
_TOL = 1e-9


def completion_record(
    report: str, truth: sc.Truth, verifier_text: str | None, cfg: sc.ScoringConfig = sc.DEFAULT_CONFIG
) -> dict[str, Any]:
    """Return one completion's rewards (as GRPO computes them) and scored findings.

    `verifier_text` is the verifier's answer on the report's key frame, or None when no query was made (a negative
    row, or a report without a usable key frame: r_c = -lambda there, as `train.rewards.ConsistencyReward` gives).
    R_a and R_b are TRL's weighted sums (0.3 r_e + 0.5 r_f + 0.2 r_c, None counted as 0; and without r_c).
    """
    s = sc.score_report(report, truth, cfg=cfg)
    r_c = None
    if truth.has_lesion:
        r_c = sc.r_c(verifier_text or "", s.pred_key_slice if verifier_text is not None else None, truth, cfg)
    w_e, w_f, w_c = cfg.reward_weights
    attrs = [v for v in (s.score_size, s.score_location, s.score_enhancement) if v is not None]
    return {
        "r_e": s.r_e,
        "r_f": s.r_f,
        "r_c": r_c,
        "reward_a": w_e * s.r_e + w_f * s.r_f + w_c * (r_c or 0.0),
        "reward_b": w_e * s.r_e + w_f * s.r_f,
        "existence": s.score_existence,
        "attributes": sum(attrs) / len(attrs) if truth.has_lesion and attrs else None,
        "k_hit": s.score_k_hit,
        "parse_ok": 1.0 if s.parse_failure is None else 0.0,
    }


def _has_spread(values: Sequence[float]) -> bool:
    return max(values) - min(values) > _TOL


def _pooled_within_corr(groups: Sequence[Sequence[Mapping[str, Any]]], x: str, y: str) -> tuple[float | None, int]:
    """Pearson correlation of x and y after centring both per group, pooled over the groups where both apply to
    every member; None when either has no within-group variance. Returns (r, groups used)."""
    sxy = sxx = syy = 0.0
    used = 0
    for group in groups:
        if any(c[x] is None or c[y] is None for c in group):
            continue
        used += 1
        mx = sum(c[x] for c in group) / len(group)
        my = sum(c[y] for c in group) / len(group)
        for c in group:
            sxy += (c[x] - mx) * (c[y] - my)
            sxx += (c[x] - mx) ** 2
            syy += (c[y] - my) ** 2
    if sxx <= _TOL or syy <= _TOL:
        return None, used
    return sxy / math.sqrt(sxx * syy), used


def group_summary(groups: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Return the spread, the within-group reward-finding correlations and the sampled rates of `groups`.

    Args:
        groups: one list per prompt of `completion_record` dicts (keys `REWARDS` and `FINDINGS`; None where a score
            does not apply: r_c, attributes and k_hit on a negative row).

    Returns:
        `spread[reward]`: fraction of the groups where the reward applies whose values are not all equal, and
        `spread_groups[reward]` their count; `corr[reward][finding]` (pooled within-group Pearson r, None without
        variance) and `corr_groups[reward][finding]`; `sampled_rate[finding]`: the mean over completions where it
        applies.
    """
    spread: dict[str, float | None] = {}
    spread_groups: dict[str, int] = {}
    for key in REWARDS:
        applicable = [g for g in groups if g and all(c[key] is not None for c in g)]
        spread_groups[key] = len(applicable)
        spread[key] = (
            sum(_has_spread([c[key] for c in g]) for g in applicable) / len(applicable) if applicable else None
        )
    corr: dict[str, dict[str, float | None]] = {}
    corr_groups: dict[str, dict[str, int]] = {}
    for reward in ("reward_a", "reward_b"):
        corr[reward], corr_groups[reward] = {}, {}
        for finding in FINDINGS:
            corr[reward][finding], corr_groups[reward][finding] = _pooled_within_corr(groups, reward, finding)
    rates: dict[str, float | None] = {}
    for finding in FINDINGS:
        values = [c[finding] for g in groups for c in g if c[finding] is not None]
        rates[finding] = sum(values) / len(values) if values else None
    return {
        "n_groups": len(groups),
        "group_size": max((len(g) for g in groups), default=0),
        "spread": spread,
        "spread_groups": spread_groups,
        "corr": corr,
        "corr_groups": corr_groups,
        "sampled_rate": rates,
    }


def verifier_record(
    report: str,
    verifier_text: str,
    truth: sc.Truth,
    frame_shows_lesion: bool,
    cfg: sc.ScoringConfig = sc.DEFAULT_CONFIG,
) -> dict[str, Any]:
    """Compare the verifier's answer on the report's key frame with the report (and the truth).

    Returns `unreadable` (the answer does not parse), `says_no_lesion`, `differs_from_report` (it parses, claims a
    lesion, and its size (within the scoring tolerance of the report's), location or attenuation differs from the
    report's), `attributes_vs_truth` (the r_c attribute sum of the answer) and `frame_shows_lesion`.
    """
    pred = parse_report(report, truth.organ)
    answer = parse_free_text(verifier_text, truth.organ)
    out: dict[str, Any] = {
        "unreadable": not isinstance(answer, ParsedReport),
        "says_no_lesion": False,
        "differs_from_report": None,
        "frame_shows_lesion": frame_shows_lesion,
        "attributes_vs_truth": sc.r_c(verifier_text, truth.key_slice, truth, cfg),
    }
    if isinstance(answer, ParsedReport):
        out["says_no_lesion"] = not answer.has_lesion
        if answer.has_lesion and isinstance(pred, ParsedReport):
            size_same = (
                answer.long_axis_cm is not None
                and pred.long_axis_cm is not None
                and abs(answer.long_axis_cm - pred.long_axis_cm)
                <= max(cfg.size_abs_tol_cm, cfg.size_rel_tol * pred.long_axis_cm) + _TOL
            )
            same = size_same and answer.location == pred.location and answer.attenuation == pred.attenuation
            out["differs_from_report"] = not same
    return out


def verifier_summary(records: Sequence[Mapping[str, Any]], n_positive_completions: int) -> dict[str, Any]:
    """Return the rates over the verifier's queries (`verifier_record` dicts) and how many positive-row completions
    had no query (no usable key frame: r_c = -lambda without one)."""
    n = len(records)

    def rate(key: str) -> float | None:
        values = [bool(r[key]) for r in records if r[key] is not None]
        return sum(values) / len(values) if values else None

    return {
        "n_queries": n,
        "n_positive_completions": n_positive_completions,
        "no_query_rate": (n_positive_completions - n) / n_positive_completions if n_positive_completions else None,
        "unreadable": rate("unreadable"),
        "says_no_lesion": rate("says_no_lesion"),
        "differs_from_report": rate("differs_from_report"),
        "frame_shows_lesion": rate("frame_shows_lesion"),
    }


# -- sampling (torch) ----------------------------------------------------------------------------------------------


def sample_groups(
    model: Any,
    processor: Any,
    rows: Sequence[Mapping[str, Any]],
    *,
    num_generations: int,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    verifier_max_new_tokens: int,
    lesion_span: int,
    cfg: sc.ScoringConfig = sc.DEFAULT_CONFIG,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Sample `num_generations` completions per row at `temperature`, query the verifier, and summarise.

    Sampling is seeded per row (`seed + row index`), top-k and top-p off (TRL's GRPO defaults); the verifier and the
    greedy report are greedy. Returns `group_summary`'s dict plus `verifier` (`verifier_summary`), `greedy_rate`
    (per finding, the greedy report's rate on the same rows) and `examples` (a few sampled reports per row).
    """
    import torch  # lazy: +2-3 s to every process importing this module (measured); only model stages need it

    from model_io.processor import user_messages, verifier_messages  # lazy: transformers: +5.7 s (measured)
    from model_io.video import frames_to_array  # lazy: model_io.video loads torch: +2 s (measured)
    from train.tiny.warmup_checks import generate_texts  # lazy: train.tiny.warmup_checks loads torch: +5 s (measured)

    model.eval()
    groups, verifier_records, greedy, examples = [], [], [], []
    n_positive = 0
    for i, row in enumerate(rows):
        truth = sc.truth_from_row(row)
        msg = user_messages(row["prompt"], row["frames"])
        inputs = processor.apply_chat_template(
            [msg], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        torch.manual_seed(seed + i)
        with torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                num_return_sequences=num_generations,
                suppress_tokens=processor.vision_token_ids,
            )
        reports = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        frames = frames_to_array(row["frames"])
        answers: dict[int, str] = {}
        group = []
        for report in reports:
            s = sc.score_report(report, truth, cfg=cfg)
            k = s.pred_key_slice if truth.has_lesion and s.pred_has_lesion else None
            k = k if k is not None and 1 <= k <= len(frames) else None
            text = None
            if k is not None:
                if k not in answers:
                    answers[k] = generate_texts(
                        model, processor, [verifier_messages(frames[k - 1], VERIFIER_PROMPT)], verifier_max_new_tokens
                    )[0]
                text = answers[k]
                shows = truth.key_slice is not None and abs(k - truth.key_slice) <= lesion_span
                verifier_records.append(verifier_record(report, text, truth, shows, cfg))
            n_positive += int(truth.has_lesion)
            group.append(completion_record(report, truth, text, cfg))
        groups.append(group)
        examples.append(_example(i, row, truth, reports, answers))
        greedy_text = generate_texts(model, processor, [msg], max_new_tokens)[0]
        greedy.append(completion_record(greedy_text, truth, None, cfg))
        if log:
            rewards = " ".join(f"{c['reward_a']:.2f}" for c in group)
            log(f"   T={temperature} row {i} ({row['organ']}, lesion {truth.has_lesion}): R_a {rewards}")
    summary = group_summary(groups)
    summary["verifier"] = verifier_summary(verifier_records, n_positive)
    summary["greedy_rate"] = {f: _mean([g[f] for g in greedy if g[f] is not None]) for f in FINDINGS}
    summary["temperature"] = temperature
    summary["examples"] = examples
    return summary


def _example(
    i: int, row: Mapping[str, Any], truth: Any, reports: Sequence[str], answers: Mapping[int, str]
) -> dict[str, Any]:
    """A few sampled reports of row `i` and the verifier's answer for each frame they named."""
    verifier = {str(k): v for k, v in sorted(answers.items())}
    example = {"row": i, "organ": row["organ"], "has_lesion": truth.has_lesion, "key_slice": truth.key_slice}
    return {**example, "reports": list(reports[:3]), "verifier": verifier}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summary_markdown(summaries: Sequence[Mapping[str, Any]]) -> str:
    """Return one table row per temperature: spread per reward, the correlations of R_a and R_b, the rates."""

    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.0f} %"

    def num(v: float | None) -> str:
        return "n/a" if v is None else f"{v:+.2f}"

    lines = [
        "| T | groups | spread r_e / r_f / r_c / R_a | corr(R_a, existence / attributes / K-Hit / parses) | "
        "corr(R_b, same) | sampled existence / K-Hit | greedy existence / K-Hit | verifier: no query / "
        "unreadable / no lesion / differs from report / frame shows lesion |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in summaries:
        sp, ca, cb, v = s["spread"], s["corr"]["reward_a"], s["corr"]["reward_b"], s["verifier"]
        lines.append(
            f"| {s['temperature']} | {s['n_groups']} x {s['group_size']} | "
            + " / ".join(pct(sp[k]) for k in ("r_e", "r_f", "r_c", "reward_a"))
            + " | "
            + " / ".join(num(ca[f]) for f in FINDINGS)
            + " | "
            + " / ".join(num(cb[f]) for f in FINDINGS)
            + f" | {pct(s['sampled_rate']['existence'])} / {pct(s['sampled_rate']['k_hit'])}"
            + f" | {pct(s['greedy_rate']['existence'])} / {pct(s['greedy_rate']['k_hit'])}"
            + " | "
            + " / ".join(
                pct(v[k])
                for k in ("no_query_rate", "unreadable", "says_no_lesion", "differs_from_report", "frame_shows_lesion")
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def trainer_rollout_groups(
    model_dir: str | Path,
    rows: Sequence[Mapping[str, Any]],
    *,
    num_generations: int,
    temperature: float,
    max_new_tokens: int,
    prompts_per_call: int,
    seed: int,
    cfg: sc.ScoringConfig = sc.DEFAULT_CONFIG,
) -> tuple[list[list[dict[str, Any]]], list[str]]:
    """Sample `num_generations` completions per row through GRPO's own rollout path and score them (no verifier).

    The rows go through `VideoGRPOTrainer._generate_and_score_completions`, `prompts_per_call` prompts at a time (a
    GRPO step's batch: TRL's left-padded, batched `generate` with the trainer's sampling settings), at learning rate 0.
    Returns the groups (`completion_record`s, r_c left out) and the completion texts in row order.
    """
    import torch  # lazy: torch (see sample_groups)
    from datasets import Dataset  # lazy: datasets adds 0.8 s (measured); only this stage builds a Dataset
    from trl import GRPOConfig  # lazy: trl: the torch stack (see sample_groups)

    from train.grpo import build_grpo_trainer  # lazy: the torch stack (see sample_groups)

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            num_generations=num_generations,
            max_completion_length=max_new_tokens,
            per_device_train_batch_size=prompts_per_call * num_generations,
            max_steps=1,
            learning_rate=0.0,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            loss_type="grpo",
            seed=seed,
            temperature=temperature,
            disable_tqdm=True,
        )
        trainer = build_grpo_trainer(
            str(model_dir), Dataset.from_list([dict(r) for r in rows]), args, rewards=["r_e", "r_f"]
        )
        proc = trainer.processing_class
        texts: list[str] = []
        for start in range(0, len(rows), prompts_per_call):
            stop = min(start + prompts_per_call, len(rows))
            dataset: Any = trainer.train_dataset
            batch = [dict(dataset[i]) for i in range(start, stop) for _ in range(num_generations)]
            out = trainer._generate_and_score_completions(batch)
            ids = [c[m.bool()].tolist() for c, m in zip(out["completion_ids"], out["completion_mask"], strict=True)]
            texts += proc.batch_decode(ids, skip_special_tokens=True)
    groups = [
        [
            completion_record(t, sc.truth_from_row(row), None, cfg)
            for t in texts[i * num_generations : (i + 1) * num_generations]
        ]
        for i, row in enumerate(rows)
    ]
    return groups, texts


def compare_rollouts(
    model_dir: str | Path,
    rows: Sequence[Mapping[str, Any]],
    cfg: Any,
    temperature: float,
    out_dir: str | Path,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Do GRPO's batched rollouts sample what the policy samples on its own? The same rows both ways, one table.

    Writes `rollouts_T<temperature>.json` to `out_dir`: `group_summary` of the trainer's rollouts
    (`trainer_rollout_groups`) and of per-prompt sampling (`sample_groups`), r_c aside (the verifier is not queried
    in the first). Returns that dict.
    """
    import torch  # lazy: torch (see sample_groups)

    from model_io.processor import load_model_and_processor  # lazy: transformers (see sample_groups)

    trainer_groups, _ = trainer_rollout_groups(
        model_dir,
        rows,
        num_generations=cfg.num_generations,
        temperature=temperature,
        max_new_tokens=cfg.max_completion_length,
        prompts_per_call=cfg.grpo_prompts_per_step,
        seed=cfg.seed,
    )
    model, processor = load_model_and_processor(model_dir, dtype=torch.float32)
    own = sample_groups(
        model,
        processor,
        rows,
        num_generations=cfg.num_generations,
        temperature=temperature,
        seed=cfg.seed,
        max_new_tokens=cfg.max_completion_length,
        verifier_max_new_tokens=cfg.verifier_max_new_tokens,
        lesion_span=cfg.lesion_span,
    )
    result = {
        "temperature": temperature,
        "trainer": group_summary(trainer_groups),
        "own": {k: v for k, v in own.items() if k != "examples"},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rollouts_T{temperature}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    if log:
        for name in ("trainer", "own"):
            s: Any = result[name]
            log(
                f"   {name} sampling at T {temperature}, {s['n_groups']} x {s['group_size']}: existence "
                f"{s['sampled_rate']['existence']:.3f}, K-Hit {s['sampled_rate']['k_hit'] or 0:.3f}, parses "
                f"{s['sampled_rate']['parse_ok']:.3f}; groups with spread r_e {s['spread']['r_e'] or 0:.2f}, "
                f"r_f {s['spread']['r_f'] or 0:.2f}, R_b {s['spread']['reward_b'] or 0:.2f}"
            )
    return result


def diagnose_checkpoint(
    model_dir: str | Path,
    rows: Sequence[Mapping[str, Any]],
    cfg: Any,
    out_dir: str | Path,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run `sample_groups` at each of `cfg.diagnose_temperatures` (a `MiniatureConfig`) on the checkpoint in
    `model_dir`; write `diagnose.json` (with example reports) and `diagnose.md` to `out_dir`; return the summaries."""
    import torch  # lazy: torch (see sample_groups)

    from model_io.processor import load_model_and_processor  # lazy: transformers (see sample_groups)

    model, processor = load_model_and_processor(model_dir, dtype=torch.float32)
    summaries = [
        sample_groups(
            model,
            processor,
            rows,
            num_generations=cfg.num_generations,
            temperature=float(t),
            seed=cfg.seed,
            max_new_tokens=cfg.max_completion_length,
            verifier_max_new_tokens=cfg.verifier_max_new_tokens,
            lesion_span=cfg.lesion_span,
            log=log,
        )
        for t in cfg.diagnose_temperatures
    ]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnose.json").write_text(json.dumps(summaries, indent=2, default=str) + "\n")
    table = summary_markdown(summaries)
    (out / "diagnose.md").write_text(table)
    if log:
        log(table)
    return summaries


def main(argv: list[str] | None = None) -> None:
    """CLI: diagnose any finished stage's model of a miniature run (written to `<run_dir>/diagnose_<model>_<split>`)."""
    # lazy: train.data loads transformers: +6.7 s (measured), only once rows are read
    from train.data import load_split

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run_dir", required=True, help="a miniature output folder (its config.json is read)")
    parser.add_argument("--model", default="sft", help="the stage whose model to sample: sft, grpo_a, grpo_b, ...")
    parser.add_argument("--split", default="train", choices=("train", "test"))
    parser.add_argument("--prompts", type=int, default=None, help="default: the run's diagnose_prompts")
    parser.add_argument("--temperatures", type=float, nargs="+", default=None)
    parser.add_argument(
        "--rollouts",
        action="store_true",
        help="instead: compare GRPO's batched rollouts with per-prompt sampling on the same prompts",
    )
    args = parser.parse_args(argv)
    run = Path(args.run_dir)
    if not (run / "config.json").exists():
        raise TrainConfigError(f"--run_dir {run}: no config.json there; pass a miniature output folder")
    if not (run / args.model / "done.json").exists():
        raise TrainConfigError(f"--model {args.model}: that stage has not finished in {run}; run it first")
    overrides = {
        k: v
        for k, v in (("diagnose_prompts", args.prompts), ("diagnose_temperatures", args.temperatures))
        if v is not None
    }
    cfg = load_config(None, json.loads((run / "config.json").read_text()) | overrides)
    rows = [dict(r) for r in load_split(run / "data", args.split)][: cfg.diagnose_prompts]
    if args.rollouts:
        for t in cfg.diagnose_temperatures:
            compare_rollouts(
                run / args.model,
                rows,
                cfg,
                float(t),
                run / f"diagnose_{args.model}_{args.split}",
                log=lambda line: print(line, flush=True),
            )
        return
    diagnose_checkpoint(
        run / args.model,
        rows,
        cfg,
        run / f"diagnose_{args.model}_{args.split}",
        log=lambda line: print(line, flush=True),
    )


if __name__ == "__main__":
    from train.checks import run_cli

    run_cli(main)


# -- the verifier by distance from the key frame ----------------------------------------------------------------------


def distance_frames(row: Mapping[str, Any], span: int) -> list[tuple[int, int, float | None]]:
    """Return `(d, frame index (0-based), slice long axis in mm or None)` for d = 0 .. span + 1 on a positive row.

    The frame at distance d is key + d where it exists, else key - d; a d with neither is left out. The slice's long
    axis is what the frame shows (`visible_slice_long_mm`), None beyond the lesion (d > span: the frame shows none).
    """
    from model_io.video import frames_to_array  # lazy: torch (see sample_groups)

    key, n = int(row["key_slice_frame"]), int(row["n_frames"])
    size_px = frames_to_array(row["frames"][:1]).shape[-1]
    radii = visible_lesion_radii_px(n, size_px, key, float(row["long_axis_mm"]), span)
    out = []
    for d in range(span + 2):
        frame = key + d if key + d <= n else key - d
        if frame < 1:
            continue
        r = radii[frame - 1]
        out.append((d, frame - 1, visible_slice_long_mm(float(row["long_axis_mm"]), r, radii[key - 1]) if r else None))
    return out


BY_DISTANCE = ("presence", "location", "attenuation", "size_slice", "size_key")


def score_by_distance(
    asked: Sequence[tuple[Mapping[str, Any], int, float | None]], texts: Sequence[str]
) -> dict[str, dict[str, float | int | None]]:
    """Return, per distance d from the key frame, the verifier's rates on the frames `asked` (`(row, d, slice long
    axis mm or None)` each, answers `texts`):

    * presence: the answer claims a lesion where the frame shows one, none where it does not (unreadable: wrong);
    * location, attenuation: the answer names the row's (frames showing the lesion only);
    * size_slice: the answer's long axis matches the slice's within the size tolerance (it reads the slice);
    * size_key: it matches the key frame's, what r_c credits: where the two differ beyond the tolerance, only this
      term of r_c tells the key frame from that neighbour.
    """
    hits: dict[int, dict[str, list[bool]]] = {}
    for (row, d, slice_mm), text in zip(asked, texts, strict=True):
        organ = Organ(row["organ"])
        parsed = parse_free_text(text, organ)
        claims = isinstance(parsed, ParsedReport) and parsed.has_lesion
        got = hits.setdefault(d, {k: [] for k in BY_DISTANCE})
        got["presence"].append(claims == (slice_mm is not None) and isinstance(parsed, ParsedReport))
        if slice_mm is None:
            continue
        location, attenuation = tuple(sorted(row["location"])), str(row["attenuation"])
        got["location"].append(claims and set(parsed.location or ()) == set(location))  # type: ignore[union-attr]
        got["attenuation"].append(claims and parsed.attenuation == attenuation)  # type: ignore[union-attr]
        for key, mm in (("size_slice", slice_mm), ("size_key", float(row["long_axis_mm"]))):
            truth = sc.Truth(organ, True, round(mm / 10, 1), location, attenuation, int(row["key_slice_frame"]))
            got[key].append(claims and sc.size_score(parsed, truth) == 1.0)  # type: ignore[arg-type]
    return {
        str(d): {k: (sum(v) / len(v) if v else None) for k, v in got.items()} | {"n": len(got["presence"])}
        for d, got in sorted(hits.items())
    }


def verifier_by_distance(
    model: Any, processor: Any, rows: Sequence[Mapping[str, Any]], span: int, max_rows: int, max_new_tokens: int
) -> dict[str, dict[str, float | int | None]]:
    """Ask the greedy verifier about the frames at each distance from the key frame of the first `max_rows` positive
    `rows`; return `score_by_distance`'s rates."""
    from model_io.processor import verifier_messages  # lazy: transformers (see sample_groups)
    from model_io.video import frames_to_array  # lazy: torch (see sample_groups)
    from train.tiny.warmup_checks import generate_texts  # lazy: torch (see sample_groups)

    asked, msgs = [], []
    for row in [r for r in rows if r["has_lesion"] and r.get("key_slice_frame")][:max_rows]:
        frames = frames_to_array(row["frames"])
        for d, index, slice_mm in distance_frames(row, span):
            asked.append((row, d, slice_mm))
            msgs.append(verifier_messages(frames[index], VERIFIER_PROMPT))
    return score_by_distance(asked, generate_texts(model, processor, msgs, max_new_tokens) if msgs else [])
