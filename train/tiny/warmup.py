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
their targets and every verifier accuracy reaches `target_verifier_accuracy`. Reaching the step cap first is a
`TrainConfigError` (one line: what was reached, the cap, the fix).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import BatchFeature

from emrl_data.text.parser import ParseFailure, parse_free_text, parse_report
from emrl_data.text.report import NEGATIVE_FINDINGS, VERIFIER_PROMPT, render_findings
from emrl_data.types import Organ
from train.checks import TrainConfigError
from train.data import CTQwen3VLProcessor, SFTCollator, frames_to_array, user_messages, verifier_messages
from train.freeze import set_stage_trainable
from train.tiny.synthetic import visible_lesion_radii_px, visible_slice_long_mm


logger = logging.getLogger(__name__)

_FINDINGS_RE = re.compile(r"<findings>(.*?)</findings>", re.S)


class WarmupMissed(TrainConfigError):
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


def findings_sentence(report: str, organ: str) -> str:
    """Return the findings text of a report (`<findings>F</findings>` -> F); the organ's negative sentence if none."""
    found = _FINDINGS_RE.search(report)
    return found.group(1).strip() if found else NEGATIVE_FINDINGS[Organ(organ)]


@dataclass(frozen=True)
class FrameTarget:
    """One frame of a row and what the verifier should say about it.

    `frame` is 0-based; `present` whether the lesion shows on that slice; `answer` the description of that slice
    (the lesion as it appears there, or the organ's negative sentence); `location` and `attenuation` the lesion's
    (None on a frame without it).
    """

    frame: int
    answer: str
    present: bool
    location: tuple[str, ...] | None = None
    attenuation: str | None = None


def frame_targets(row: Mapping[str, Any], lesion_span: int) -> list[FrameTarget]:
    """Return the verifier target of EVERY frame of a `make_visible_rows` row (frames drawn with `lesion_span`).

    A frame shows the lesion when `train.tiny.synthetic.visible_lesion_radii_px` gives it a radius (the disc drawn
    there); its target is the lesion as that slice shows it: side (location), attenuation, and the long axis at that
    slice (`visible_slice_long_mm`). Every other frame, and each frame of a negative row, gets the organ's negative
    sentence.
    """
    organ = Organ(row["organ"])
    n_frames = int(row["n_frames"])
    negative = NEGATIVE_FINDINGS[organ]
    key = row.get("key_slice_frame")
    if not row["has_lesion"] or key is None:
        return [FrameTarget(i, negative, False) for i in range(n_frames)]
    size_px = frames_to_array(row["frames"][:1]).shape[-1]
    radii = visible_lesion_radii_px(n_frames, size_px, int(key), float(row["long_axis_mm"]), lesion_span)
    location, attenuation = tuple(row["location"]), str(row["attenuation"])
    out = []
    for i, radius in enumerate(radii):
        if radius == 0:
            out.append(FrameTarget(i, negative, False))
            continue
        long_mm = visible_slice_long_mm(float(row["long_axis_mm"]), radius, radii[int(key) - 1])
        answer = render_findings(organ, has_lesion=True, lesion_count=1, long_axis_mm=long_mm,
                                 short_axis_mm=round(long_mm * 0.7, 1), volume_mm3=round(long_mm**3 * 0.3),
                                 location=location, attenuation=attenuation)  # fmt: skip
        out.append(FrameTarget(i, answer, True, location, attenuation))
    return out


def verifier_examples(
    row: Mapping[str, Any], rng: np.random.Generator, lesion_span: int | None = None
) -> list[tuple[np.ndarray, str]]:
    """Return the verifier-task examples of one row: `[(frame (H, W) uint8, answer), ...]`.

    With `lesion_span` (rows of `make_visible_rows`, whose pixels the span fixes): every frame with its
    `frame_targets` answer. Without it (rows whose per-slice truth is unknown, such as the demo's): a positive row's
    key frame with its findings sentence and, when it has a frame at least 3 away from the key frame, one such frame
    with the negative sentence; a negative row one random frame with the negative sentence.
    """
    frames = frames_to_array(row["frames"])
    if lesion_span is not None:
        return [(frames[t.frame], t.answer) for t in frame_targets(row, lesion_span)]
    negative = NEGATIVE_FINDINGS[Organ(row["organ"])]
    key = row.get("key_slice_frame")
    if not row["has_lesion"] or key is None:
        return [(frames[int(rng.integers(len(frames)))], negative)]
    out = [(frames[int(key) - 1], findings_sentence(row["report"], row["organ"]))]
    far = [i for i in range(len(frames)) if abs(i + 1 - int(key)) >= 3]
    if far:
        out.append((frames[int(rng.choice(far))], negative))
    return out


class BalancedPairs:
    """Draw verifier pairs half from frames that show a lesion, half from frames that do not (seeded)."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], rng: np.random.Generator, lesion_span: int | None,
                 balanced: bool = True):  # fmt: skip
        self.rng, self.balanced = rng, balanced
        self.all: list[tuple[np.ndarray, str]] = []
        self.present: list[tuple[np.ndarray, str]] = []
        self.absent: list[tuple[np.ndarray, str]] = []
        negatives = set(NEGATIVE_FINDINGS.values())
        for row in rows:
            for pair in verifier_examples(row, rng, lesion_span):
                self.all.append(pair)
                (self.absent if pair[1] in negatives else self.present).append(pair)

    def __len__(self) -> int:
        return len(self.present) + len(self.absent)

    def draw(self, n: int) -> list[tuple[np.ndarray, str]]:
        """Return `n` pairs: `n // 2` with a lesion and the rest without (all from one pool when the other is empty)."""
        if not self.balanced:  # uniform over every pair, in row order
            return [self.all[int(i)] for i in self.rng.integers(len(self.all), size=n)]
        n_present = n // 2 if self.present and self.absent else (n if self.present else 0)
        pick = (
            [self.present[int(i)] for i in self.rng.integers(len(self.present), size=n_present)] if n_present else []
        )
        rest = n - n_present
        return pick + ([self.absent[int(i)] for i in self.rng.integers(len(self.absent), size=rest)] if rest else [])


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
        inputs: Any = processor.apply_chat_template([msg], add_generation_prompt=True, tokenize=True, return_dict=True,
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
    return sum(not isinstance(c, ParseFailure) and c.has_lesion for c in claims) / len(pos)


VERIFIER_GATES = ("sensitivity", "specificity", "location", "attenuation")


def _round_robin(lists: Sequence[Sequence[Any]]) -> list[Any]:
    """Return the items of `lists` taken one from each list in turn (the first of each, then the second, ...)."""
    depth = max((len(items) for items in lists), default=0)
    return [items[k] for k in range(depth) for items in lists if k < len(items)]


def _eval_frames(
    rows: Sequence[Mapping[str, Any]], lesion_span: int, max_frames: int
) -> list[tuple[int, FrameTarget]]:
    """Return `(row index, target)` of at most `max_frames` frames, half with the lesion, half without, in a fixed
    order (every check asks the same frames): round-robin over the rows (each row's first frame of a kind, then each
    row's second, ...), so the frames come from as many rows as they can and one row's answers do not decide a gate."""
    present_by_row: list[list[tuple[int, FrameTarget]]] = []
    absent_by_row: list[list[tuple[int, FrameTarget]]] = []
    for i, row in enumerate(rows):
        targets = frame_targets(row, lesion_span)
        present_by_row.append([(i, t) for t in targets if t.present])
        absent_by_row.append([(i, t) for t in targets if not t.present])
    present, absent = _round_robin(present_by_row), _round_robin(absent_by_row)
    half = max_frames // 2
    n_present = min(len(present), max(half, max_frames - len(absent)))
    return present[:n_present] + absent[: max_frames - n_present]


def _blind_partner(rows: Sequence[Mapping[str, Any]], i: int) -> int:
    """Return the next row after row i (cyclic) of row i's organ; the next row when no other row has that organ."""
    n = len(rows)
    same = [j % n for j in range(i + 1, i + n) if rows[j % n]["organ"] == rows[i]["organ"]]
    return same[0] if same else (i + 1) % n


def verifier_accuracy(
    model: Any,
    processor: CTQwen3VLProcessor,
    rows: Sequence[Mapping[str, Any]],
    lesion_span: int,
    *,
    max_frames: int = 48,
    max_new_tokens: int = 48,
    blind: bool = False,
) -> dict[str, float | int | None]:
    """Return the greedy verifier's accuracy on held-out frames, each scored against its `frame_targets` target.

    sensitivity: lesion frames whose answer claims a lesion; specificity: lesion-free frames whose answer claims none
    (an unreadable answer is wrong either way); location, attenuation: lesion frames whose answer names the target's
    (None without a lesion frame). `blind`: the verifier is shown the same frame of the next row of the same organ
    instead (`_blind_partner`), scored against row i's target: the control, expected at chance (the organ matches, so
    a wrong answer is about the lesion, not the organ).
    """
    asked = _eval_frames(rows, lesion_span, max_frames)
    shown = [_blind_partner(rows, i) if blind else i for i, _ in asked]
    msgs = [verifier_messages(frames_to_array(rows[j]["frames"])[t.frame], VERIFIER_PROMPT)
            for j, (_, t) in zip(shown, asked, strict=True)]  # fmt: skip
    return score_verifier(
        [(rows[i]["organ"], t) for i, t in asked], generate_texts(model, processor, msgs, max_new_tokens)
    )


def score_verifier(asked: Sequence[tuple[str, FrameTarget]], texts: Sequence[str]) -> dict[str, float | int | None]:
    """Return `verifier_accuracy`'s rates of answers `texts` to the frames `asked` (`(organ, target)` each)."""
    hits: dict[str, list[bool]] = {k: [] for k in VERIFIER_GATES}
    for (organ, target), text in zip(asked, texts, strict=True):
        parsed = parse_free_text(text, organ)
        claims = not isinstance(parsed, ParseFailure) and parsed.has_lesion
        if not target.present:
            hits["specificity"].append(not isinstance(parsed, ParseFailure) and not parsed.has_lesion)
            continue
        hits["sensitivity"].append(claims)
        ok = not isinstance(parsed, ParseFailure) and claims
        hits["location"].append(ok and set(parsed.location or ()) == set(target.location or ()))  # type: ignore[union-attr]
        hits["attenuation"].append(ok and parsed.attenuation == target.attenuation)  # type: ignore[union-attr]
    out: dict[str, float | int | None] = {k: (sum(v) / len(v) if v else None) for k, v in hits.items()}
    out["n_lesion_frames"], out["n_clear_frames"] = len(hits["sensitivity"]), len(hits["specificity"])
    return out


def verifier_gaps(accuracy: Mapping[str, Any], gate: float) -> list[str]:
    """Return the gates `accuracy` misses (`"specificity 75% < 90%"`); [] when the gate is 0 or all are met."""
    if gate <= 0:
        return []
    missed = []
    for key in VERIFIER_GATES:
        value = accuracy.get(key)
        if value is None or value < gate:
            missed.append(f"{key} {'n/a' if value is None else f'{value:.0%}'} < {gate:.0%}")
    return missed


def format_verifier(accuracy: Mapping[str, Any]) -> str:
    """Return one line: `sens 95%, spec 90%, location 88%, attenuation 92% (20 + 20 frames)`."""
    cells = [f"{k[:4] if k in VERIFIER_GATES[:2] else k} "
             f"{'n/a' if accuracy.get(k) is None else f'{accuracy[k]:.0%}'}" for k in VERIFIER_GATES]  # fmt: skip
    return f"{', '.join(cells)} ({accuracy['n_lesion_frames']} + {accuracy['n_clear_frames']} frames)"


# The demo's configuration keys (`train.tiny.demo_sft`) for `WarmupPlan.keys`; the miniature passes its own.
DEMO_WARMUP_KEYS = {"max_steps": "lm_warmup_steps", "eval_every": "lm_warmup_eval_every",
                    "learning_rate": "lm_warmup_learning_rate"}  # fmt: skip


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
    verifier_eval_frames: int = 48
    verifier_max_new_tokens: int = 48
    require_both_classes: bool = False
    balanced: bool = True
    # The caller's configuration keys for the step cap, the check interval and the rate, as the error lines name them.
    keys: Mapping[str, str] = field(default_factory=lambda: dict(DEMO_WARMUP_KEYS))


def reports_claim_both_classes(rows: Sequence[Mapping[str, Any]], reports: Sequence[str]) -> bool:
    """Whether the reports claim a lesion on some positive row and none on some negative row (unreadable: neither)."""
    claims = [parse_report(t, r["organ"]) for r, t in zip(rows, reports, strict=True)]
    said = [(bool(r["has_lesion"]), None if isinstance(c, ParseFailure) else c.has_lesion) for r, c in zip(rows, claims, strict=True)]  # fmt: skip
    return (True, True) in said and (False, False) in said


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


def _check(model: Any, processor: Any, val_rows: Sequence[Mapping[str, Any]], plan: WarmupPlan,
           result: WarmupResult, step: int,
           class_rows: Sequence[Mapping[str, Any]] | None = None) -> tuple[bool, str]:  # fmt: skip
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
            acc = verifier_accuracy(model, processor, val_rows, plan.lesion_span, max_frames=plan.verifier_eval_frames,
                                    max_new_tokens=plan.verifier_max_new_tokens)  # fmt: skip
            result.verifier_accuracy.append((step, acc))
            verifier_ok = not verifier_gaps(acc, plan.target_verifier_accuracy)
            line += f", verifier {format_verifier(acc)}"
        else:
            vrate = verifier_claim_rate(model, processor, val_rows)
            if vrate is not None:
                result.verifier_rates.append((step, vrate))
            line += ", no positive held-out row for the verifier" if vrate is None else (
                f", verifier names the lesion on {vrate:.0%} of key frames")  # fmt: skip
    line += f"; held-out parse rate {rate:.0%} (target {plan.target_parse_rate:.0%})"
    if plan.target_sampled_parse_rate > 0:
        line += f", sampled {result.sampled_parse_rate:.0%} (target {plan.target_sampled_parse_rate:.0%})"
    failed = [(r, t) for r, t in zip(val_rows, reports, strict=True) if _fails(t, r["organ"])]
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
    gaps = verifier_gaps(result.verifier_accuracy[-1][1], plan.target_verifier_accuracy) if (
        result.verifier_accuracy) else []  # fmt: skip
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
        **knobs: `WarmupPlan`'s fields. max_steps: the step cap (one report batch + one verifier batch a step);
            learning_rate: constant AdamW rate; batch_size / verifier_batch_size: report rows / verifier pairs a step
            (half with a lesion, half without); eval_every: steps between checks; target_parse_rate: greedy reports'
            held-out parse rate to reach; target_sampled_parse_rate: that of reports sampled at temperature 1 (0 = not
            checked); max_new_tokens: the report budget; seed: sampling and torch seed; verifier_task: train the
            verifier too; lesion_span: the rows' span (`make_visible_rows`): every frame becomes a verifier example
            (`frame_targets`), and the check measures `verifier_accuracy`; target_verifier_accuracy: its gates
            (sensitivity, specificity, location, attenuation; 0 = reported, not required); verifier_eval_frames,
            verifier_max_new_tokens: that measurement's frames and answer budget; keys: the caller's configuration
            keys of max_steps, eval_every and learning_rate, which the error lines name (default: the demo's).

    Raises:
        TrainConfigError: when the step cap is reached before the criterion, or with no training/validation rows.
    """
    plan = WarmupPlan(**knobs)
    _check_plan(rows, val_rows, plan)
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
        drawn = balanced_rows(rows, rng, plan.batch_size) if plan.balanced else [
            rows[int(i)] for i in rng.integers(len(rows), size=plan.batch_size)
        ]  # fmt: skip
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
