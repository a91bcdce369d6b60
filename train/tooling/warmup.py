"""The demo's and the miniature's LM warm-up (not the paper's recipe): a random tiny LLM learns both languages it needs.

Qwen3-VL-8B-Instruct already writes reports and describes a single image; a randomly initialised tiny Qwen3-VL does
neither. The warm-up trains every part of it on two tasks at once, each step one batch of each:

* the report task: the row's frames as a video + its prompt -> its report (what SFT and GRPO use);
* the verifier task: one frame as an image + `VERIFIER_PROMPT` -> a description of that frame. A positive row's key
  frame gets the report's findings sentence, a frame away from the lesion (or any frame of a negative row) the organ's
  negative findings sentence. Without it the verifier (r_c) writes nothing `parse_free_text` can score and r_c is
  -λ for every completion (the demo's old constant r_c = -0.300).

It stops on a criterion, not a step count: every `eval_every` steps the greedy reports of held-out rows (validation
rows, never trained on) are parsed, and the warm-up ends once the parse rate reaches `target_parse_rate`. Reaching the
step cap first is a `TrainConfigError` (one line: the rate reached, the cap, the fix).
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import BatchFeature

from emrl_data.text.parser import ParseFailure, parse_free_text, parse_report
from emrl_data.text.report import NEGATIVE_FINDINGS, VERIFIER_PROMPT
from emrl_data.types import Organ
from train.checks import TrainConfigError
from train.data import CTQwen3VLProcessor, SFTCollator, frames_to_array, verifier_messages
from train.freeze import set_stage_trainable


logger = logging.getLogger(__name__)

_FINDINGS_RE = re.compile(r"<findings>(.*?)</findings>", re.S)


@dataclass
class WarmupResult:
    """What the warm-up did: steps, the parse rate per check `(step, rate)`, the last losses, seconds."""

    steps: int
    parse_rates: list[tuple[int, float]] = field(default_factory=list)
    sampled_parse_rates: list[tuple[int, float]] = field(default_factory=list)
    verifier_rates: list[tuple[int, float]] = field(default_factory=list)
    report_loss: float = float("nan")
    verifier_loss: float = float("nan")
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


def findings_sentence(report: str, organ: str) -> str:
    """Return the findings text of a report (`<findings>F</findings>` -> F); the organ's negative sentence if none."""
    found = _FINDINGS_RE.search(report)
    return found.group(1).strip() if found else NEGATIVE_FINDINGS[Organ(organ)]


def verifier_examples(row: Mapping[str, Any], rng: np.random.Generator) -> list[tuple[np.ndarray, str]]:
    """Return the verifier-task examples of one row: `[(frame (H, W) uint8, answer), ...]`.

    A positive row gives its key frame with its findings sentence and, when it has a frame at least 3 away from the
    key frame, one such frame with the negative sentence; a negative row gives one random frame with the negative
    sentence.
    """
    frames = frames_to_array(row["frames"])
    negative = NEGATIVE_FINDINGS[Organ(row["organ"])]
    key = row.get("key_slice_frame")
    if not row["has_lesion"] or key is None:
        return [(frames[int(rng.integers(len(frames)))], negative)]
    out = [(frames[int(key) - 1], findings_sentence(row["report"], row["organ"]))]
    far = [i for i in range(len(frames)) if abs(i + 1 - int(key)) >= 3]
    if far:
        out.append((frames[int(rng.choice(far))], negative))
    return out


class VerifierCollator:
    """Batch `(frame, answer)` pairs into Qwen3-VL inputs: image + `VERIFIER_PROMPT` -> answer, loss on the answer."""

    def __init__(self, processor: CTQwen3VLProcessor, prompt: str = VERIFIER_PROMPT):
        self.processor = processor
        self.prompt = prompt

    def __call__(self, pairs: Sequence[tuple[np.ndarray, str]]) -> BatchFeature:
        """Return `input_ids`, `attention_mask`, `pixel_values`, `image_grid_thw`, `mm_token_type_ids`, `labels`."""
        proc = self.processor
        msgs = [verifier_messages(frame, self.prompt) for frame, _ in pairs]
        images = [m[0]["content"][0]["image"] for m in msgs]
        prompts = [proc.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
        fulls = [p + answer + proc.tokenizer.eos_token for p, (_, answer) in zip(prompts, pairs, strict=True)]
        batch = proc(text=fulls, images=images, padding=True, return_tensors="pt")
        ids, mask = batch["input_ids"], batch["attention_mask"]
        labels = ids.masked_fill(mask == 0, -100)
        for i, (prompt, image) in enumerate(zip(prompts, images, strict=True)):
            n_prompt = len(proc(text=[prompt], images=[image])["input_ids"][0])
            labels[i, : int((mask[i] == 0).sum()) + n_prompt] = -100
        batch["labels"] = labels
        return batch


def generate_texts(
    model: Any,
    processor: CTQwen3VLProcessor,
    messages: list[list[dict]],
    max_new_tokens: int,
    sample_seed: int | None = None,
) -> list:
    """Return the answer to each conversation (vision tokens suppressed), one at a time (no padding effects).

    Greedy when `sample_seed` is None, else sampled at temperature 1 from a generator seeded per conversation.
    """
    texts = []
    was_training = model.training
    model.eval()
    for i, msg in enumerate(messages):
        inputs = processor.apply_chat_template([msg], add_generation_prompt=True, tokenize=True, return_dict=True,
                                               return_tensors="pt")  # fmt: skip
        sampling: dict[str, Any] = {"do_sample": False}
        if sample_seed is not None:
            torch.manual_seed(sample_seed + i)
            sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, suppress_tokens=processor.vision_token_ids,
                                 **sampling)  # fmt: skip
        texts.append(processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0])
    model.train(was_training)
    return texts


def report_parse_rate(model: Any, processor: CTQwen3VLProcessor, rows: Sequence[Mapping[str, Any]],
                      max_new_tokens: int = 128, sample_seed: int | None = None) -> tuple[float, list[str]]:  # fmt: skip
    """Return (fraction of rows whose report parses, the reports): greedy, or sampled with `sample_seed`."""
    from train.data import user_messages  # noqa: PLC0415

    msgs = [user_messages(r["prompt"], r["frames"]) for r in rows]
    reports = generate_texts(model, processor, msgs, max_new_tokens, sample_seed)
    ok = [not isinstance(parse_report(t, r["organ"]), ParseFailure) for t, r in zip(reports, rows, strict=True)]
    return sum(ok) / max(1, len(ok)), reports


def _fails(text: str, organ: str) -> bool:
    return isinstance(parse_report(text, organ), ParseFailure)


def verifier_claim_rate(model: Any, processor: CTQwen3VLProcessor, rows: Sequence[Mapping[str, Any]],
                        max_new_tokens: int = 48) -> float | None:  # fmt: skip
    """Return the fraction of positive rows' key frames on which the greedy verifier answer claims a lesion (None
    without a positive row: no rate, rather than a NaN that strict JSON refuses)."""
    pos = [r for r in rows if r["has_lesion"] and r.get("key_slice_frame")]
    if not pos:
        return None
    msgs = [
        verifier_messages(frames_to_array(r["frames"])[int(r["key_slice_frame"]) - 1], VERIFIER_PROMPT) for r in pos
    ]
    texts = generate_texts(model, processor, msgs, max_new_tokens)
    claims = [parse_free_text(t, r["organ"]) for t, r in zip(texts, pos, strict=True)]
    return sum(isinstance(c, ParseFailure) is False and c.has_lesion for c in claims) / len(pos)


def lm_warmup(
    model: Any,
    processor: CTQwen3VLProcessor,
    rows: Sequence[Mapping[str, Any]],
    val_rows: Sequence[Mapping[str, Any]],
    *,
    max_steps: int,
    learning_rate: float,
    batch_size: int = 2,
    verifier_batch_size: int = 2,
    eval_every: int = 50,
    target_parse_rate: float = 0.95,
    target_sampled_parse_rate: float = 0.0,
    max_new_tokens: int = 128,
    seed: int = 0,
    verifier_task: bool = True,
    log: Any = None,
) -> WarmupResult:
    """Train every part of `model` on the report and verifier tasks until the held-out parse rate reaches the target.

    Args:
        model: the tiny Qwen3-VL (trained in place; every parameter trains, stage "lm_warmup").
        processor: its processor.
        rows: training rows (sft columns, frames decoded or not).
        val_rows: held-out rows for the criterion (greedy reports, parsed).
        max_steps: step cap (each step = one report batch + one verifier batch).
        learning_rate: constant AdamW learning rate.
        batch_size: report rows per step.
        verifier_batch_size: verifier (frame, answer) pairs per step.
        eval_every: steps between checks of the criterion.
        target_parse_rate: stop once the held-out parse rate of greedy reports is at least this...
        target_sampled_parse_rate: ...and that of reports sampled at temperature 1 (what GRPO's rollouts are) at
            least this (0 = not checked). Greedy reports can all parse while samples are still broken.
        max_new_tokens: greedy report budget of the check.
        seed: row sampling and torch seed.
        verifier_task: train the verifier task too (off = reports only).
        log: where the one progress line per check goes (default: print, flushed).

    Raises:
        TrainConfigError: when the step cap is reached before the criterion, or with no training/validation rows.
    """
    if not rows or not val_rows:
        raise TrainConfigError(f"LM warm-up needs training and validation rows (got {len(rows)} and {len(val_rows)}).")
    if eval_every <= 0 or max_steps < eval_every:
        raise TrainConfigError(f"lm_warmup_eval_every={eval_every} must be in 1..lm_warmup_steps ({max_steps}).")
    log = log or (lambda line: print(line, flush=True))
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    set_stage_trainable(model, "lm_warmup")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    report_collate = SFTCollator(processor)
    verifier_collate = VerifierCollator(processor)
    pairs = [pair for r in rows for pair in verifier_examples(r, rng)] if verifier_task else []
    result = WarmupResult(steps=0)
    start = time.perf_counter()
    for step in range(1, max_steps + 1):
        opt.zero_grad()
        batch = report_collate([rows[int(i)] for i in rng.integers(len(rows), size=batch_size)])
        loss = model(**batch).loss
        result.report_loss = float(loss.detach())
        if pairs:
            vbatch = verifier_collate([pairs[int(i)] for i in rng.integers(len(pairs), size=verifier_batch_size)])
            vloss = model(**vbatch).loss
            result.verifier_loss = float(vloss.detach())
            loss = loss + vloss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        result.steps = step
        if step % eval_every == 0 or step == max_steps:
            rate, reports = report_parse_rate(model, processor, val_rows, max_new_tokens)
            result.parse_rates.append((step, rate))
            sampled = math.nan
            if target_sampled_parse_rate > 0:
                sampled, _ = report_parse_rate(model, processor, val_rows, max_new_tokens, sample_seed=seed)
                result.sampled_parse_rates.append((step, sampled))
            line = f"  warm-up step {step}: report loss {result.report_loss:.3f}"
            if pairs:
                vrate = verifier_claim_rate(model, processor, val_rows)
                line += f", verifier loss {result.verifier_loss:.3f}"
                if vrate is None:
                    line += ", no positive held-out row for the verifier"
                else:
                    result.verifier_rates.append((step, vrate))
                    line += f", verifier names the lesion on {vrate:.0%} of key frames"
            line += f"; held-out parse rate {rate:.0%} (target {target_parse_rate:.0%})"
            if target_sampled_parse_rate > 0:
                line += f", sampled {sampled:.0%} (target {target_sampled_parse_rate:.0%})"
            failed = [(r, t) for r, t in zip(val_rows, reports, strict=True) if _fails(t, r["organ"])]
            if failed:
                why = parse_report(failed[0][1], failed[0][0]["organ"])
                line += f"; e.g. {why.reason} on {failed[0][0]['organ']}: {failed[0][1][:90]!r}"  # type: ignore[union-attr]
            log(f"{line}, {len(val_rows)} rows")
            if rate >= target_parse_rate and (target_sampled_parse_rate <= 0 or sampled >= target_sampled_parse_rate):
                break
    result.seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    sampled_ok = target_sampled_parse_rate <= 0 or result.sampled_parse_rate >= target_sampled_parse_rate
    if result.parse_rate < target_parse_rate or not sampled_ok:
        sampled_text = f", sampled {result.sampled_parse_rate:.0%}" if target_sampled_parse_rate > 0 else ""
        raise TrainConfigError(
            f"LM warm-up: held-out parse rate {result.parse_rate:.0%}{sampled_text} below its target after the "
            f"step cap lm_warmup_steps={max_steps}; raise lm_warmup_steps or lower lm_warmup_learning_rate"
        )
    return result
