"""The warm-up's verifier task data: what the verifier should say about each frame of a row (`frame_targets`), a
row's `(frame, answer)` examples, draws of them balanced between frames with and without a lesion, and their batches
as Qwen3-VL inputs (image + `VERIFIER_PROMPT` -> answer)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import BatchFeature

from emrl_data.text.report import NEGATIVE_FINDINGS, VERIFIER_PROMPT, render_findings
from emrl_data.types import Organ
from model_io.processor import CTQwen3VLProcessor, verifier_messages
from model_io.video import frames_to_array
from train.tiny.synthetic import visible_lesion_radii_px, visible_slice_long_mm


_FINDINGS_RE = re.compile(r"<findings>(.*?)</findings>", re.S)


def findings_sentence(report: str, organ: str) -> str:
    """Return the findings text of a report (`<findings>F</findings>` -> F); the organ's negative sentence if none."""
    found = _FINDINGS_RE.search(report)
    return found.group(1).strip() if found else NEGATIVE_FINDINGS[Organ(organ)]


@dataclass(frozen=True)
class FrameTarget:
    """One frame of a row and what the verifier should say about it.

    `frame` is 0-based; `present` whether the lesion shows on that slice; `answer` the description of that slice
    (the lesion as it appears there, or the organ's negative sentence); `location` and `attenuation` the lesion's
    and `long_axis_mm` its long axis as that slice shows it (None on a frame without it); `distance` the frame's
    distance from the row's key frame (None on a negative row).
    """

    frame: int
    answer: str
    present: bool
    location: tuple[str, ...] | None = None
    attenuation: str | None = None
    long_axis_mm: float | None = None
    distance: int | None = None


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
        distance = abs(i - (int(key) - 1))
        if radius == 0:
            out.append(FrameTarget(i, negative, False, distance=distance))
            continue
        long_mm = visible_slice_long_mm(float(row["long_axis_mm"]), radius, radii[int(key) - 1])
        answer = render_findings(
            organ,
            has_lesion=True,
            lesion_count=1,
            long_axis_mm=long_mm,
            short_axis_mm=round(long_mm * 0.7, 1),
            volume_mm3=round(long_mm**3 * 0.3),
            location=location,
            attenuation=attenuation,
        )
        out.append(FrameTarget(i, answer, True, location, attenuation, long_mm, distance))
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

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        rng: np.random.Generator,
        lesion_span: int | None,
        balanced: bool = True,
    ):
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
