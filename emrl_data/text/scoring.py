"""Scores of a report against the truth of its organ row: one module for mining, GRPO rewards and evaluation (docs/contract.md#scoring).

Rules (defaults; every threshold and weight is a `ScoringConfig` value, stated only there):

| score | rule |
| --- | --- |
| existence | predicted `has_lesion` == truth |
| size | \\|pred - true long axis\\| <= max(0.5 cm, 20 % of true) |
| location | predicted set == true set |
| enhancement | predicted attenuation category == true |
| K-Hit | \\|k - k_true\\| <= 1 frame |
| r_e | existence (0/1) |
| r_f | sum of w_att * S_att(report) over size, location, enhancement; on a true negative: 1 if the report claims no lesion |
| r_c | `consistency_reward`: sum of w_att * S_att(verifier text) - lambda * (1 - IoU(window(k), window(k_true))) |
| R | w_e r_e + w_f r_f + w_c r_c (`ScoringConfig.reward_weights`) |

Decisions:

* Not applicable is None, never 0: attribute scores and K-Hit on a true negative (and on a truth without that label).
* A parse failure scores 0 on existence, attributes, K-Hit, r_e and r_f, and r_c = -lambda (the lowest r_c of a
  parsed report without the box term), so GRPO never ranks a parse failure above a parsed report that is wrong; its
  reason is kept.
* A report claiming no lesion on a positive row scores 0 on every attribute and on K-Hit.
* Weights over attributes that do not apply (a positive truth without an attenuation label, say) are renormalised over
  the ones that do.
* The r_c window: the frames `{k-1, k, k+1}` as an **integer frame set** (frames are discrete; Qwen3-VL fuses frame
  pairs, docs/contract.md#frames), so IoU = 1 at distance 0, 2/4 at distance 1, 1/5 at distance 2, 0 from distance 3. Frames are
  not clipped at 1 or N (N is not known here; clipping would favour edge frames). A missing key slice -> IoU 0.
* r_c is one function, `consistency_reward`, for training (`train.rewards.ConsistencyReward`), mining and
  evaluation (`score_report`); `verifier_frame` says which frame the verifier must describe (None: no query). A key
  frame is usable when the report claims a lesion and 1 <= k <= N; without one r_c has no verifier text.
* True negatives (`ScoringConfig.negative_rows`): `skip` -> r_c None. `query_named_slice` -> the gold negative's
  window is empty and its description is "no lesion": a report claiming no lesion scores 1; a report claiming a lesion
  scores 1 - lambda when the verifier, shown the frame it names, answers "no lesion", and -lambda otherwise (a lesion
  described, an unreadable answer, or no usable frame).
* `ScoringConfig.cross_view`: `full`; `distance_only` -> r_c = -lambda * (1 - IoU) alone, no verifier answer;
  `random_frame` -> scored as `full` (the frame shown comes from another row: `train.rewards`).
* `total_reward` with `r_c=None` (a true negative, or no verifier text) renormalises over r_e and r_f:
  R = (w_e r_e + w_f r_f) / (w_e + w_f), so R stays in the same [0, 1] range on negatives and positives (hard-set
  mining ranks rows of both kinds by R).
* Sizes compare in cm; the truth is `round(long_axis_mm / 10, 1)` (the reported precision). A tolerance of 1e-9 cm
  absorbs float noise (3.6 - 3.1 = 0.5000000000000004).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from emrl_data.text.parser import ParsedReport, ParseFailure, parse_free_text, parse_report
from emrl_data.types import Organ, column, row_values


__all__ = [
    "REWARD_NAMES",
    "ReportScore",
    "CROSS_VIEWS",
    "NEGATIVE_ROWS",
    "TRUTH_COLUMNS",
    "ScoringConfig",
    "Truth",
    "box_iou",
    "consistency_reward",
    "enhancement_score",
    "existence_score",
    "is_hard",
    "k_hit",
    "location_score",
    "r_c",
    "r_e",
    "r_f",
    "score_report",
    "size_score",
    "total_reward",
    "truth_from_row",
    "verifier_frame",
    "window_iou",
]

_EPS = 1e-9
REWARD_NAMES = ("r_e", "r_f", "r_c")  # the order of ScoringConfig.reward_weights
NEGATIVE_ROWS = ("skip", "query_named_slice")  # ScoringConfig.negative_rows
CROSS_VIEWS = ("full", "distance_only", "random_frame")  # ScoringConfig.cross_view


@dataclass(frozen=True, slots=True)
class ScoringConfig:
    """Thresholds and weights of the scores (the defaults of docs/contract.md#scoring).

    Attributes:
        size_abs_tol_cm: absolute size tolerance in cm.
        size_rel_tol: relative size tolerance (fraction of the true long axis).
        k_hit_window: K-Hit accepts |k - k_true| <= this many frames.
        attribute_weights: weights of (size, location, enhancement) in r_f and r_c.
        iou_penalty: lambda of r_c's distance penalty.
        reward_weights: weights of (r_e, r_f, r_c) in R: the one table every trainer and miner reads.
        box_weight: optional r_c box term (IoU of the report's box with the truth box when k is within
            `k_hit_window` of k_true); 0 = off, the paper's r_c (an ablation knob).
        negative_rows: r_c on a true negative: "skip" (None, the paper) or "query_named_slice" (the verifier is shown
            the frame a false positive names; `consistency_reward`).
        cross_view: "full" (the paper), "distance_only" (r_c = the window term alone, no verifier) or "random_frame"
            (the verifier is shown a frame of another row: a blind control, `train.rewards.ConsistencyReward`).
    """

    size_abs_tol_cm: float = 0.5
    size_rel_tol: float = 0.2
    k_hit_window: int = 1
    attribute_weights: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3)
    iou_penalty: float = 0.3
    reward_weights: tuple[float, float, float] = (0.3, 0.5, 0.2)
    box_weight: float = 0.0
    negative_rows: str = "skip"
    cross_view: str = "full"

    def reward_weight_table(self) -> dict[str, float]:
        """Return `{"r_e": w_e, "r_f": w_f, "r_c": w_c}` (docs/contract.md#scoring).

        >>> ScoringConfig().reward_weight_table()
        {'r_e': 0.3, 'r_f': 0.5, 'r_c': 0.2}
        """
        return dict(zip(REWARD_NAMES, self.reward_weights, strict=True))

    def __post_init__(self) -> None:
        if self.size_abs_tol_cm < 0 or self.size_rel_tol < 0:
            raise ValueError(f"size tolerances must be >= 0, got {self.size_abs_tol_cm=}, {self.size_rel_tol=}.")
        if self.k_hit_window < 0:
            raise ValueError(f"k_hit_window={self.k_hit_window} must be >= 0.")
        if len(self.attribute_weights) != 3 or min(self.attribute_weights) < 0 or sum(self.attribute_weights) <= 0:
            raise ValueError(f"attribute_weights={self.attribute_weights} must be 3 weights >= 0 with a positive sum.")
        if len(self.reward_weights) != 3 or min(self.reward_weights) < 0 or sum(self.reward_weights[:2]) <= 0:
            raise ValueError(f"reward_weights={self.reward_weights} must be 3 weights >= 0 (r_e + r_f > 0).")
        if self.box_weight < 0:
            raise ValueError(f"box_weight={self.box_weight} must be >= 0.")
        if self.iou_penalty < 0:
            raise ValueError(f"iou_penalty={self.iou_penalty} must be >= 0.")
        if self.negative_rows not in NEGATIVE_ROWS:
            raise ValueError(f"negative_rows={self.negative_rows!r} must be one of {' | '.join(NEGATIVE_ROWS)}.")
        if self.cross_view not in CROSS_VIEWS:
            raise ValueError(f"cross_view={self.cross_view!r} must be one of {' | '.join(CROSS_VIEWS)}.")


DEFAULT_CONFIG = ScoringConfig()


@dataclass(frozen=True, slots=True)
class Truth:
    """The labels of one organ row that the scores compare against.

    Attributes:
        organ: the organ of the row.
        has_lesion: whether the organ has a lesion.
        long_axis_cm: long axis of the largest lesion in cm (one decimal); None on a negative.
        location: sorted location names; `()` on a negative.
        attenuation: "hypo" | "iso" | "hyper"; None on a negative.
        key_slice: the key frame, 1-based (the row's `key_slice_frame`); None on a negative.
    """

    organ: Organ
    has_lesion: bool
    long_axis_cm: float | None
    location: tuple[str, ...]
    attenuation: str | None
    key_slice: int | None


# The columns of a dataset row that `truth_from_row` reads: the truth every score and reward compares against.
TRUTH_COLUMNS: tuple[str, ...] = ("organ", "has_lesion", "long_axis_mm", "location", "attenuation", "key_slice_frame")


def truth_from_row(row: Mapping[str, Any]) -> Truth:
    """Return the `Truth` of a dataset row (`sft`/`findings` column names).

    Args:
        row: with keys organ, has_lesion, long_axis_mm (cm = round(mm / 10, 1)), location (list), attenuation,
            key_slice_frame.

    >>> truth_from_row({"organ": "liver", "has_lesion": True, "long_axis_mm": 31.04, "location": ["5", "8"],
    ...                 "attenuation": "hypo", "key_slice_frame": 12})
    Truth(organ=<Organ.LIVER: 'liver'>, has_lesion=True, long_axis_cm=3.1, location=('5', '8'), attenuation='hypo', key_slice=12)
    """
    long_mm = row.get("long_axis_mm")
    key = row.get("key_slice_frame")
    location = row.get("location")
    return Truth(
        organ=Organ(row["organ"]),
        has_lesion=bool(row["has_lesion"]),
        long_axis_cm=None if long_mm is None or _isnan(long_mm) else round(float(long_mm) / 10.0, 1),
        location=tuple(str(v) for v in location) if location is not None else (),
        attenuation=row.get("attenuation") or None,
        key_slice=None if key is None or _isnan(key) else int(key),
    )


def _isnan(value: Any) -> bool:
    """Return True for a float NaN (pandas/polars nulls)."""
    return isinstance(value, float) and math.isnan(value)


# ---------------------------------------------------------------------------------------------------------------
# Per-field scores of a parsed report
# ---------------------------------------------------------------------------------------------------------------


def existence_score(pred: ParsedReport | ParseFailure, truth: Truth) -> float:
    """Return 1.0 when the report's lesion claim matches the truth, else 0.0 (a parse failure scores 0).

    >>> t = Truth(Organ.LIVER, False, None, (), None, None)
    >>> existence_score(ParsedReport(False, None, None, None, None, None, None, 0), t)
    1.0
    >>> existence_score(ParseFailure("empty"), t)
    0.0
    """
    if isinstance(pred, ParseFailure):
        return 0.0
    return 1.0 if pred.has_lesion == truth.has_lesion else 0.0


def _claims_lesion(pred: ParsedReport | ParseFailure) -> bool:
    """Return True for a parsed report that claims a lesion."""
    return isinstance(pred, ParsedReport) and pred.has_lesion


def size_score(pred: ParsedReport | ParseFailure, truth: Truth, cfg: ScoringConfig = DEFAULT_CONFIG) -> float | None:
    """Return 1.0 when |pred - true long axis| <= max(abs tol, rel tol * true); None when the truth has no lesion.

    >>> t = Truth(Organ.LIVER, True, 3.0, ("7",), "hypo", 10)
    >>> p = ParsedReport(True, 3.6, None, ("7",), "hypo", 10, None, 1)
    >>> size_score(p, t), size_score(ParsedReport(True, 3.7, None, None, None, None, None, 1), t)
    (1.0, 0.0)
    """
    if not truth.has_lesion or truth.long_axis_cm is None:
        return None
    if not _claims_lesion(pred) or pred.long_axis_cm is None:  # type: ignore[union-attr]
        return 0.0
    tolerance = max(cfg.size_abs_tol_cm, cfg.size_rel_tol * truth.long_axis_cm)
    return 1.0 if abs(pred.long_axis_cm - truth.long_axis_cm) <= tolerance + _EPS else 0.0  # type: ignore[union-attr]


def location_score(pred: ParsedReport | ParseFailure, truth: Truth) -> float | None:
    """Return 1.0 when the predicted location set equals the true set; None when the truth has no lesion.

    >>> t = Truth(Organ.LIVER, True, 3.0, ("5", "8"), "hypo", 10)
    >>> location_score(ParsedReport(True, 3.0, None, ("5", "8"), "hypo", 10, None, 1), t)
    1.0
    >>> location_score(ParsedReport(True, 3.0, None, ("5",), "hypo", 10, None, 1), t)
    0.0
    """
    if not truth.has_lesion:
        return None
    if not _claims_lesion(pred) or pred.location is None:  # type: ignore[union-attr]
        return 0.0
    return 1.0 if set(pred.location) == set(truth.location) else 0.0  # type: ignore[union-attr]


def enhancement_score(pred: ParsedReport | ParseFailure, truth: Truth) -> float | None:
    """Return 1.0 when the predicted attenuation category equals the truth; None when the truth has none.

    >>> t = Truth(Organ.KIDNEY, True, 3.0, ("left",), "hyper", 10)
    >>> enhancement_score(ParsedReport(True, 3.0, None, ("left",), "hyper", 10, None, 1), t)
    1.0
    """
    if not truth.has_lesion or truth.attenuation is None:
        return None
    if not _claims_lesion(pred) or pred.attenuation is None:  # type: ignore[union-attr]
        return 0.0
    return 1.0 if pred.attenuation == truth.attenuation else 0.0  # type: ignore[union-attr]


def k_hit(pred: ParsedReport | ParseFailure, truth: Truth, cfg: ScoringConfig = DEFAULT_CONFIG) -> float | None:
    """Return 1.0 when |k - k_true| <= `cfg.k_hit_window`; None when the truth has no key slice.

    >>> t = Truth(Organ.PANCREAS, True, 3.0, ("head",), "hypo", 10)
    >>> [k_hit(ParsedReport(True, 3.0, None, None, None, k, None, 1), t) for k in (9, 11, 12, None)]
    [1.0, 1.0, 0.0, 0.0]
    """
    if not truth.has_lesion or truth.key_slice is None:
        return None
    if not _claims_lesion(pred) or pred.key_slice is None:  # type: ignore[union-attr]
        return 0.0
    return 1.0 if abs(pred.key_slice - truth.key_slice) <= cfg.k_hit_window else 0.0  # type: ignore[union-attr]


def window_iou(k: int | None, k_true: int | None) -> float:
    """Return the IoU of the integer frame sets {k-1, k, k+1} and {k_true-1, k_true, k_true+1}; 0 when k is missing.

    >>> [window_iou(10, 10 + d) for d in (0, 1, -2, 3)], window_iou(None, 10)
    ([1.0, 0.5, 0.2, 0.0], 0.0)
    """
    if k is None or k_true is None:
        return 0.0
    overlap = max(0, 3 - abs(k - k_true))
    return overlap / (6 - overlap)


def _attribute_sum(pred: ParsedReport | ParseFailure, truth: Truth, cfg: ScoringConfig) -> float:
    """Return sum of w * S over (size, location, enhancement), weights renormalised over the applicable ones."""
    return _weighted(size_score(pred, truth, cfg), location_score(pred, truth), enhancement_score(pred, truth), cfg)


def _weighted(size: float | None, location: float | None, enhancement: float | None, cfg: ScoringConfig) -> float:
    """Return the weighted attribute sum; weights of None scores are left out and the rest renormalised."""
    w_size, w_location, w_enhancement = cfg.attribute_weights
    total = weight = 0.0
    if size is not None:
        total += w_size * size
        weight += w_size
    if location is not None:
        total += w_location * location
        weight += w_location
    if enhancement is not None:
        total += w_enhancement * enhancement
        weight += w_enhancement
    return total / weight if weight > 0 else 0.0


# ---------------------------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------------------------


def r_e(report: str, truth: Truth, cfg: ScoringConfig = DEFAULT_CONFIG) -> float:
    """Return the existence reward: 1.0 when the report's lesion claim is right, else 0.0.

    >>> t = Truth(Organ.LIVER, False, None, (), None, None)
    >>> r_e("<findings>No focal liver lesion is identified.</findings> || <impression>No liver tumor.</impression>", t)
    1.0
    """
    return existence_score(parse_report(report, truth.organ), truth)


def r_f(report: str, truth: Truth, cfg: ScoringConfig = DEFAULT_CONFIG) -> float:
    """Return the findings reward: sum of w * S over size, location, enhancement of the report (docs/contract.md#scoring).

    On a true negative: 1.0 when the report claims no lesion, else 0.0.

    >>> t = Truth(Organ.LIVER, True, 3.1, ("5", "8"), "hypo", 12)
    >>> round(r_f("<findings>A hypoattenuating lesion in hepatic segment 5 measures 3.1 x 2.2 cm.</findings>", t), 4)
    0.6667
    """
    return _r_f_parsed(parse_report(report, truth.organ), truth, cfg)


def _r_f_parsed(pred: ParsedReport | ParseFailure, truth: Truth, cfg: ScoringConfig) -> float:
    """Return r_f of a parsed report."""
    if isinstance(pred, ParseFailure):
        return 0.0
    if not truth.has_lesion:
        return 0.0 if pred.has_lesion else 1.0
    return _attribute_sum(pred, truth, cfg)


def r_c(verifier_text: str, key_slice: int | None, truth: Truth, cfg: ScoringConfig = DEFAULT_CONFIG) -> float | None:
    """Return the paper's r_c formula for the verifier's answer on frame `key_slice`; None on a true negative.

    r_c = sum of w * S(verifier text) - lambda * (1 - IoU({k-1, k, k+1}, {k_true-1, k_true, k_true+1})).
    The verifier text is read with `parse_free_text`; an unreadable answer scores 0 on the attributes. This is the
    formula on a positive row; the reward (parse failures, true negatives, `cross_view`, box term) is
    `consistency_reward`, which training, mining and evaluation call.

    Args:
        verifier_text: the model's answer to `VERIFIER_PROMPT` on the key frame alone.
        key_slice: the key frame the report named (1-based); None when it named none (IoU 0).
        truth: the row's truth.
        cfg: thresholds and weights.

    >>> t = Truth(Organ.LIVER, True, 3.0, ("7",), "hypo", 10)
    >>> r_c("A 3 cm hypodense mass in segment 7.", 10, t), round(r_c("A 3 cm hypodense mass in segment 7.", 11, t), 4)
    (1.0, 0.85)
    >>> r_c("anything", 10, Truth(Organ.LIVER, False, None, (), None, None)) is None
    True
    """
    if not truth.has_lesion:
        return None
    return _paper_r_c(verifier_text, key_slice, truth, cfg)


def _paper_r_c(verifier_text: str, key_slice: int | None, truth: Truth, cfg: ScoringConfig) -> float:
    """Return sum of w * S(verifier text) - lambda * (1 - IoU(window(k), window(k_true))) on a positive row."""
    attributes = _attribute_sum(parse_free_text(verifier_text, truth.organ), truth, cfg)
    return attributes - _window_term(key_slice, truth, cfg)


def _window_term(key_slice: int | None, truth: Truth, cfg: ScoringConfig) -> float:
    """Return lambda * (1 - IoU(window(k), window(k_true))) on a positive row."""
    return cfg.iou_penalty * (1.0 - window_iou(key_slice, truth.key_slice))


def box_iou(a: Sequence[float] | None, b: Sequence[float] | None) -> float:
    """Return the IoU of two `[x1, y1, x2, y2]` boxes (0 when either is missing or empty).

    >>> box_iou([0, 0, 10, 10], [5, 0, 15, 10]), box_iou(None, [0, 0, 1, 1])
    (0.3333333333333333, 0.0)
    """
    if a is None or b is None or len(a) != 4 or len(b) != 4:
        return 0.0
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _usable_key(pred: ParsedReport | ParseFailure, n_frames: int | None) -> int | None:
    """Return the report's key frame when it claims a lesion and 1 <= k <= n_frames (no upper bound when None)."""
    if not isinstance(pred, ParsedReport) or not pred.has_lesion or pred.key_slice is None:
        return None
    k = pred.key_slice
    return k if k >= 1 and (n_frames is None or k <= n_frames) else None


def _r_c_applies(truth: Truth, cfg: ScoringConfig) -> bool:
    """Return True when r_c has a value on this row (positives always; negatives under `query_named_slice`)."""
    return truth.has_lesion or cfg.negative_rows == "query_named_slice"


def verifier_frame(
    report: str | ParsedReport | ParseFailure,
    truth: Truth,
    cfg: ScoringConfig = DEFAULT_CONFIG,
    n_frames: int | None = None,
) -> int | None:
    """Return the frame (1-based) whose description `consistency_reward` reads, or None when it reads none.

    None: r_c does not apply (a true negative under `negative_rows="skip"`), `cross_view="distance_only"`, or the
    report has no usable key frame (a parse failure, no lesion claimed, no k, k outside 1..`n_frames`).

    >>> t = Truth(Organ.LIVER, True, 3.0, ("7",), "hypo", 10)
    >>> p = ParsedReport(True, 3.0, None, ("7",), "hypo", 12, None, 1)
    >>> verifier_frame(p, t, n_frames=20), verifier_frame(p, t, n_frames=8)
    (12, None)
    """
    pred = parse_report(report, truth.organ) if isinstance(report, str) else report
    if cfg.cross_view == "distance_only" or not _r_c_applies(truth, cfg):
        return None
    return _usable_key(pred, n_frames)


def consistency_reward(
    report: str | ParsedReport | ParseFailure,
    truth: Truth,
    verifier_text: str | None,
    cfg: ScoringConfig = DEFAULT_CONFIG,
    *,
    n_frames: int | None = None,
    truth_bbox: Sequence[float] | None = None,
) -> float | None:
    """Return r_c, the one definition training, mining and evaluation use (docs/contract.md#scoring).

    r_c = sum of w * S(verifier text) - lambda * (1 - IoU(window(k), window(k_true))). Rules:

    * None where r_c does not apply: a true negative under `negative_rows="skip"`.
    * A parse failure: -lambda (no parsed report scores lower without the box term).
    * No usable key frame (`verifier_frame` None): no verifier text is read (attributes 0 on a positive row).
    * A true negative under `query_named_slice`: the gold's window is empty and its description "no lesion". A report
      claiming no lesion: 1 (IoU of two empty windows = 1, nothing to describe). A report claiming a lesion: distance
      term -lambda, plus 1 when the verifier's answer on its frame claims no lesion (0 for a lesion described, an
      unreadable answer or no usable frame).
    * `cross_view="distance_only"`: the distance term alone; the verifier text is ignored.
    * `box_weight` > 0 (not with distance_only): + box_weight * IoU(report box, `truth_bbox`) on a positive row when
      |k - k_true| <= `k_hit_window`.

    Args:
        report: the report text, or its parse (`parse_report`).
        truth: the row's truth.
        verifier_text: the verifier's answer on frame `verifier_frame(...)`; None = no answer (no query made).
        cfg: thresholds, weights and the r_c options.
        n_frames: the row's frame count; a key frame above it is not usable (None: no upper bound).
        truth_bbox: the truth box on the key frame (Qwen's 0-1000 grid), read by the box term only.

    >>> t = Truth(Organ.LIVER, True, 3.0, ("7",), "hypo", 10)
    >>> p = ParsedReport(True, 3.0, None, ("7",), "hypo", 11, None, 1)
    >>> round(consistency_reward(p, t, "A 3 cm hypodense mass in segment 7."), 4), consistency_reward("", t, None)
    (0.85, -0.3)
    """
    pred = parse_report(report, truth.organ) if isinstance(report, str) else report
    if not _r_c_applies(truth, cfg):
        return None
    if isinstance(pred, ParseFailure):
        return -cfg.iou_penalty
    k = _usable_key(pred, n_frames)
    text = verifier_text if k is not None else None
    if not truth.has_lesion:
        distance = cfg.iou_penalty if pred.has_lesion else 0.0
        if cfg.cross_view == "distance_only":
            return -distance
        if not pred.has_lesion:
            return 1.0
        answer = parse_free_text(text, truth.organ) if text is not None else None
        return (1.0 if isinstance(answer, ParsedReport) and not answer.has_lesion else 0.0) - distance
    if cfg.cross_view == "distance_only":
        return -_window_term(k, truth, cfg)
    value = _paper_r_c(text or "", k, truth, cfg)
    if cfg.box_weight > 0 and k is not None and truth.key_slice is not None:
        if abs(k - truth.key_slice) <= cfg.k_hit_window:
            value += cfg.box_weight * box_iou(pred.bbox, truth_bbox)
    return value


def total_reward(r_e: float, r_f: float, r_c: float | None, cfg: ScoringConfig = DEFAULT_CONFIG) -> float:
    """Return R = w_e r_e + w_f r_f + w_c r_c; with `r_c` None, renormalised over r_e and r_f.

    >>> total_reward(1.0, 1.0, 1.0), round(total_reward(1.0, 0.5, None), 4)
    (1.0, 0.6875)
    """
    w_e, w_f, w_c = cfg.reward_weights
    if r_c is None:
        return (w_e * r_e + w_f * r_f) / (w_e + w_f)
    return w_e * r_e + w_f * r_f + w_c * r_c


# ---------------------------------------------------------------------------------------------------------------
# One report, all scores
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReportScore:
    """Every score of one report, and what it was parsed into: these fields are columns of the `predictions` table,
    under the same names (`score_*` scores, `pred_*` parsed claims), and the rows `evaluation.evaluate` reads.

    Attributes:
        parse_failure: the parse-failure reason, or None.
        score_existence: 0/1.
        score_size, score_location, score_enhancement, score_k_hit: 0/1, or None when not applicable (true negative).
        r_e, r_f: rewards in [0, 1].
        r_c: `consistency_reward`, in [-lambda, 1] (+ the box term); None where it does not apply (a true negative
            under `negative_rows="skip"`) or when no verifier text was given.
        reward: R (`total_reward`).
        pred_has_lesion: the claim, None on a parse failure.
        pred_long_axis_cm, pred_location, pred_attenuation, pred_key_slice, pred_bbox: the parsed fields.
    """

    parse_failure: str | None = field(
        metadata=column(pa.string(), "parser failure reason (empty, no_findings, contradiction, ...)")
    )
    score_existence: float = field(metadata=column(pa.float64(), "existence correct (0/1)"))
    score_size: float | None = field(metadata=column(pa.float64(), "size correct (0/1), null on true negatives"))
    score_location: float | None = field(
        metadata=column(pa.float64(), "location correct (0/1), null on true negatives")
    )
    score_enhancement: float | None = field(
        metadata=column(pa.float64(), "enhancement correct (0/1), null on true negatives")
    )
    score_k_hit: float | None = field(
        metadata=column(pa.float64(), "key slice within +-1 frame (0/1), null on true negatives")
    )
    r_e: float = field(metadata=column(pa.float64(), "existence reward"))
    r_f: float = field(metadata=column(pa.float64(), "findings reward"))
    r_c: float | None = field(
        metadata=column(pa.float64(), "consistency reward; null without a verifier answer (mining)")
    )
    reward: float = field(metadata=column(pa.float64(), "R (renormalised over r_e and r_f when r_c is null)"))
    pred_has_lesion: bool | None = field(metadata=column(pa.bool_(), "parsed claim"))
    pred_long_axis_cm: float | None = field(metadata=column(pa.float64(), "parsed long axis (cm)"))
    pred_location: tuple[str, ...] | None = field(metadata=column(pa.list_(pa.string()), "parsed location"))
    pred_attenuation: str | None = field(metadata=column(pa.string(), "parsed attenuation"))
    pred_key_slice: int | None = field(metadata=column(pa.int32(), "parsed key frame"))
    pred_bbox: tuple[int, int, int, int] | None = field(
        metadata=column(pa.list_(pa.int32()), "parsed box (0-1000 grid)")
    )

    def to_row(self) -> dict[str, Any]:
        """Return the scores as a plain dict (tuples as lists): the score columns of a `predictions` row."""
        return row_values(self)


def _failure_score(pred: ParseFailure, truth: Truth, reward_c: float | None, cfg: ScoringConfig) -> ReportScore:
    """Return the `ReportScore` of a parse failure: 0 wherever a score applies, r_c as given (-lambda or None)."""
    zero_if = 0.0 if truth.has_lesion else None
    return ReportScore(
        parse_failure=pred.reason,
        score_existence=0.0,
        score_size=zero_if if truth.long_axis_cm is not None else None,
        score_location=zero_if,
        score_enhancement=zero_if if truth.attenuation is not None else None,
        score_k_hit=zero_if if truth.key_slice is not None else None,
        r_e=0.0,
        r_f=0.0,
        r_c=reward_c,
        reward=total_reward(0.0, 0.0, reward_c, cfg),
        pred_has_lesion=None,
        pred_long_axis_cm=None,
        pred_location=None,
        pred_attenuation=None,
        pred_key_slice=None,
        pred_bbox=None,
    )


def score_report(
    report: str,
    truth: Truth,
    *,
    verifier_text: str | None = None,
    cfg: ScoringConfig = DEFAULT_CONFIG,
    n_frames: int | None = None,
    truth_bbox: Sequence[float] | None = None,
) -> ReportScore:
    """Parse `report` once and return every score against `truth`.

    Args:
        report: the model's report.
        truth: the row's truth.
        verifier_text: the verifier's answer on `verifier_frame(report, ...)` ("" when that is None); None -> r_c None
            (not computed: mining). r_c is `consistency_reward`, which ignores the text where no frame is queried.
        cfg: thresholds, weights and the r_c options.
        n_frames: the row's frame count (a key frame above it is not usable for r_c); None: no bound.
        truth_bbox: the truth box, for r_c's optional box term.

    >>> t = Truth(Organ.LIVER, True, 3.1, ("5", "8"), "hypo", 12)
    >>> s = score_report("<findings>A hypoattenuating lesion in hepatic segment 5/8 measures 3.1 x 2.2 cm "
    ...                  "(volume 5.4 cc).</findings> || <impression>Hypoattenuating liver mass in hepatic segment 5/8,"
    ...                  " measuring 3.1 cm.</impression> || The key lesion is in image <key_slice>14</key_slice>, "
    ...                  "<bbox>[1, 2, 3, 4]</bbox>", t)
    >>> (s.score_existence, s.score_size, s.score_location, s.score_enhancement, s.score_k_hit, s.r_c, s.reward)
    (1.0, 1.0, 1.0, 1.0, 0.0, None, 1.0)
    """
    pred = parse_report(report, truth.organ)
    positive = truth.has_lesion
    reward_c = None
    if verifier_text is not None:
        reward_c = consistency_reward(pred, truth, verifier_text, cfg, n_frames=n_frames, truth_bbox=truth_bbox)
    if isinstance(pred, ParseFailure):
        return _failure_score(pred, truth, reward_c, cfg)
    existence = 1.0 if pred.has_lesion == positive else 0.0
    if positive:
        size, location, enhancement = (
            size_score(pred, truth, cfg),
            location_score(pred, truth),
            enhancement_score(pred, truth),
        )
        reward_f = _weighted(size, location, enhancement, cfg)
        hit = k_hit(pred, truth, cfg)
    else:
        size = location = enhancement = hit = None
        reward_f = existence
    return ReportScore(
        parse_failure=None,
        score_existence=existence,
        score_size=size,
        score_location=location,
        score_enhancement=enhancement,
        score_k_hit=hit,
        r_e=existence,
        r_f=reward_f,
        r_c=reward_c,
        reward=total_reward(existence, reward_f, reward_c, cfg),
        pred_has_lesion=pred.has_lesion,
        pred_long_axis_cm=pred.long_axis_cm,
        pred_location=pred.location,
        pred_attenuation=pred.attenuation,
        pred_key_slice=pred.key_slice,
        pred_bbox=pred.bbox,
    )


HARD_REASONS = ("parse_failure", "existence", "size", "location", "enhancement", "k_hit")


def is_hard(score: ReportScore) -> tuple[bool, tuple[str, ...]]:
    """Return (hard, reasons): hard = wrong existence, any wrong attribute, or a K-Hit miss (the paper's rule).

    Reasons are listed in `HARD_REASONS` order; a parse failure also lists "parse_failure". Scores that do not
    apply (None) are never reasons.

    >>> t = Truth(Organ.LIVER, True, 3.1, ("5",), "hypo", 12)
    >>> is_hard(score_report("<findings>A hypoattenuating lesion in hepatic segment 5 measures 9.0 x 2.2 cm."
    ...                      "</findings> || The key lesion is in image <key_slice>20</key_slice>", t))
    (True, ('size', 'k_hit'))
    """
    reasons: list[str] = []
    if score.parse_failure is not None:
        reasons.append("parse_failure")
    if score.score_existence < 1.0:
        reasons.append("existence")
    for name in ("size", "location", "enhancement", "k_hit"):
        value = getattr(score, f"score_{name}")
        if value is not None and value < 1.0:
            reasons.append(name)
    return bool(reasons), tuple(reasons)
