"""The warm-up's held-out checks, also the miniature's eval: a model's greedy (or sampled) answers, the parse rate of
its reports and whether they claim both classes, the verifier's claim rate on key frames, and its accuracy on held-out
frames (sensitivity, specificity, location, attenuation, size) against the gates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from emrl_data.text import scoring as sc
from emrl_data.text.parser import ParseFailure, parse_free_text, parse_report
from emrl_data.text.report import VERIFIER_PROMPT
from emrl_data.types import Organ
from model_io.processor import CTQwen3VLProcessor, user_messages, verifier_messages
from model_io.video import frames_to_array
from train.tiny.verifier_data import FrameTarget, frame_targets


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
        inputs: Any = processor.apply_chat_template(
            [msg], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        sampling: dict[str, Any] = {"do_sample": False}
        if sample_seed is not None:
            torch.manual_seed(sample_seed + i)
            sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
        with torch.no_grad():
            out = model.generate(
                **inputs, max_new_tokens=max_new_tokens, suppress_tokens=processor.vision_token_ids, **sampling
            )
        texts.append(processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0])
    model.train(was_training)
    return texts


def report_parse_rate(
    model: Any,
    processor: CTQwen3VLProcessor,
    rows: Sequence[Mapping[str, Any]],
    max_new_tokens: int = 128,
    sample_seed: int | None = None,
) -> tuple[float, list[str]]:
    """Return (fraction of rows whose report parses, the reports): greedy, or sampled with `sample_seed`."""
    msgs = [user_messages(r["prompt"], r["frames"]) for r in rows]
    reports = generate_texts(model, processor, msgs, max_new_tokens, sample_seed)
    ok = [not isinstance(parse_report(t, r["organ"]), ParseFailure) for t, r in zip(reports, rows, strict=True)]
    return sum(ok) / max(1, len(ok)), reports


def fails_to_parse(text: str, organ: str) -> bool:
    """Whether a report does not parse for its organ."""
    return isinstance(parse_report(text, organ), ParseFailure)


def verifier_claim_rate(
    model: Any, processor: CTQwen3VLProcessor, rows: Sequence[Mapping[str, Any]], max_new_tokens: int = 48
) -> float | None:
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


# The rates `score_verifier` measures. The warm-up is gated on VERIFIER_GATES unless its plan names others; "size"
# (the answer's long axis within the size tolerance of the slice's) is the one that tells a key frame from its
# neighbours when only size differs between them.
VERIFIER_GATES = ("sensitivity", "specificity", "location", "attenuation")
VERIFIER_RATES = (*VERIFIER_GATES, "size")


def _round_robin(lists: Sequence[Sequence[Any]]) -> list[Any]:
    """Return the items of `lists` taken one from each list in turn (the first of each, then the second, ...)."""
    depth = max((len(items) for items in lists), default=0)
    return [items[k] for k in range(depth) for items in lists if k < len(items)]


def _eval_frames(
    rows: Sequence[Mapping[str, Any]], lesion_span: int, max_frames: int
) -> list[tuple[int, FrameTarget]]:
    """Return `(row index, target)` of at most `max_frames` frames, half with the lesion, half without, in a fixed
    order (every check asks the same frames): round-robin over the rows (each row's first frame of a kind, then each
    row's second, ...), so the frames come from as many rows as they can and one row's answers do not decide a gate.
    A row's lesion frames come key frame first, then its outermost ones, then inward (`_key_then_outer`): a gate
    measures the frame r_c asks about and the frames that show the lesion least."""
    present_by_row: list[list[tuple[int, FrameTarget]]] = []
    absent_by_row: list[list[tuple[int, FrameTarget]]] = []
    for i, row in enumerate(rows):
        targets = frame_targets(row, lesion_span)
        present_by_row.append([(i, t) for t in _key_then_outer([t for t in targets if t.present])])
        absent_by_row.append([(i, t) for t in targets if not t.present])
    present, absent = _round_robin(present_by_row), _round_robin(absent_by_row)
    half = max_frames // 2
    n_present = min(len(present), max(half, max_frames - len(absent)))
    return present[:n_present] + absent[: max_frames - n_present]


def _key_then_outer(targets: Sequence[FrameTarget]) -> list[FrameTarget]:
    """Order a row's lesion frames: the key frame (distance 0), then by distance from it, largest first (ties: the
    earlier frame first)."""
    return sorted(targets, key=lambda t: (t.distance != 0, -(t.distance or 0), t.frame))


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
    (an unreadable answer is wrong either way); location, attenuation: lesion frames whose answer names the target's;
    size: lesion frames whose answer's long axis is within the scorer's size tolerance of the slice's (None without a
    lesion frame); n_key_frames: the key frames among the lesion frames. `blind`: the verifier is shown the same
    frame of the next row of the same organ instead (`_blind_partner`), scored against row i's target: the control, expected at chance (the organ matches, so
    a wrong answer is about the lesion, not the organ).
    """
    asked = _eval_frames(rows, lesion_span, max_frames)
    shown = [_blind_partner(rows, i) if blind else i for i, _ in asked]
    msgs = [
        verifier_messages(frames_to_array(rows[j]["frames"])[t.frame], VERIFIER_PROMPT)
        for j, (_, t) in zip(shown, asked, strict=True)
    ]
    return score_verifier(
        [(rows[i]["organ"], t) for i, t in asked], generate_texts(model, processor, msgs, max_new_tokens)
    )


def score_verifier(asked: Sequence[tuple[str, FrameTarget]], texts: Sequence[str]) -> dict[str, float | int | None]:
    """Return `verifier_accuracy`'s rates of answers `texts` to the frames `asked` (`(organ, target)` each)."""
    hits: dict[str, list[bool]] = {k: [] for k in VERIFIER_RATES}
    n_key = 0
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
        hits["size"].append(ok and target.long_axis_mm is not None and _size_matches(parsed, organ, target))
        n_key += target.distance == 0
    out: dict[str, float | int | None] = {k: (sum(v) / len(v) if v else None) for k, v in hits.items()}
    out["n_lesion_frames"], out["n_clear_frames"] = len(hits["sensitivity"]), len(hits["specificity"])
    out["n_key_frames"] = n_key
    return out


def _size_matches(parsed: Any, organ: str, target: FrameTarget) -> bool:
    """Whether a parsed answer's long axis is within the scorer's size tolerance of the slice's (`target`)."""
    assert target.long_axis_mm is not None and target.distance is not None
    truth = sc.Truth(
        Organ(organ),
        True,
        round(target.long_axis_mm / 10, 1),
        tuple(sorted(target.location or ())),
        target.attenuation,
        1,
    )
    return sc.size_score(parsed, truth) == 1.0


def verifier_gaps(accuracy: Mapping[str, Any], gate: float, gates: Sequence[str] = VERIFIER_GATES) -> list[str]:
    """Return the `gates` (rates of `score_verifier`) `accuracy` misses (`"specificity 75% < 90%"`); [] when the gate
    is 0 or all are met."""
    if gate <= 0:
        return []
    missed = []
    for key in gates:
        value = accuracy.get(key)
        if value is None or value < gate:
            missed.append(f"{key} {'n/a' if value is None else f'{value:.0%}'} < {gate:.0%}")
    return missed


def format_verifier(accuracy: Mapping[str, Any]) -> str:
    """Return one line: `sens 95%, spec 90%, location 88%, attenuation 92%, size 80% (20 + 20 frames)` (size where
    measured)."""
    keys = [k for k in VERIFIER_RATES if k in VERIFIER_GATES or k in accuracy]
    cells = [
        f"{k[:4] if k in VERIFIER_GATES[:2] else k} {'n/a' if accuracy.get(k) is None else f'{accuracy[k]:.0%}'}"
        for k in keys
    ]
    return f"{', '.join(cells)} ({accuracy['n_lesion_frames']} + {accuracy['n_clear_frames']} frames)"


def reports_claim_both_classes(rows: Sequence[Mapping[str, Any]], reports: Sequence[str]) -> bool:
    """Whether the reports claim a lesion on some positive row and none on some negative row (unreadable: neither)."""
    claims = [parse_report(t, r["organ"]) for r, t in zip(rows, reports, strict=True)]
    said = [
        (bool(r["has_lesion"]), None if isinstance(c, ParseFailure) else c.has_lesion)
        for r, c in zip(rows, claims, strict=True)
    ]
    return (True, True) in said and (False, False) in said
