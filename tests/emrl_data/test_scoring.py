"""Tests of emrl_data.text.scoring: every rule of docs/contract.md#scoring on constructed reports, incl. negatives and the IoU penalty."""

from __future__ import annotations

import doctest

import pytest

from emrl_data.text import scoring
from emrl_data.text.parser import ParsedReport, ParseFailure
from emrl_data.text.report import render_evidence, render_findings, render_impression, render_report
from emrl_data.text.scoring import (
    ReportScore,
    ScoringConfig,
    Truth,
    consistency_reward,
    enhancement_score,
    existence_score,
    is_hard,
    k_hit,
    location_score,
    r_c,
    r_e,
    r_f,
    score_report,
    size_score,
    total_reward,
    truth_from_row,
    verifier_frame,
    window_iou,
)
from emrl_data.types import Organ


POS = Truth(Organ.LIVER, True, 3.0, ("5", "8"), "hypo", 10)
NEG = Truth(Organ.LIVER, False, None, (), None, None)


def pred(
    long_cm: float | None = 3.0,
    location: tuple[str, ...] | None = ("5", "8"),
    attenuation: str | None = "hypo",
    key_slice: int | None = 10,
    has_lesion: bool = True,
) -> ParsedReport:
    return ParsedReport(has_lesion, long_cm, None, location, attenuation, key_slice, None, 1)


PRED_NEG = ParsedReport(False, None, None, None, None, None, None, 0)


def report(
    long_mm: float = 30.0,
    location: tuple[str, ...] = ("5", "8"),
    attenuation: str = "hypo",
    key_slice: int | None = 10,
    organ: Organ = Organ.LIVER,
) -> str:
    findings = render_findings(
        organ,
        has_lesion=True,
        lesion_count=1,
        long_axis_mm=long_mm,
        short_axis_mm=10.0,
        volume_mm3=1000.0,
        location=location,
        attenuation=attenuation,
    )
    impression = render_impression(
        organ, has_lesion=True, lesion_count=1, long_axis_mm=long_mm, location=location, attenuation=attenuation
    )
    evidence = render_evidence(key_slice, (10, 20, 30, 40)) if key_slice is not None else None
    return render_report(findings, impression, evidence)


NEG_REPORT = render_report(
    render_findings(Organ.LIVER, has_lesion=False), render_impression(Organ.LIVER, has_lesion=False), None
)


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        # a positive row: mm -> cm rounded to one decimal, list -> tuple
        (
            {
                "organ": "liver",
                "has_lesion": True,
                "long_axis_mm": 31.04,
                "location": ["5", "8"],
                "attenuation": "hypo",
                "key_slice_frame": 12,
            },
            Truth(Organ.LIVER, True, 3.1, ("5", "8"), "hypo", 12),
        ),
        # a negative row with nulls
        (
            {
                "organ": "kidney",
                "has_lesion": False,
                "long_axis_mm": None,
                "location": [],
                "attenuation": None,
                "key_slice_frame": None,
            },
            Truth(Organ.KIDNEY, False, None, (), None, None),
        ),
        # NaN nulls (pandas) and numpy-like ints
        (
            {
                "organ": "pancreas",
                "has_lesion": 0,
                "long_axis_mm": float("nan"),
                "location": None,
                "attenuation": None,
                "key_slice_frame": float("nan"),
            },
            Truth(Organ.PANCREAS, False, None, (), None, None),
        ),
    ],
)
def test_truth_from_row(row: dict, expected: Truth) -> None:
    assert truth_from_row(row) == expected


@pytest.mark.parametrize(
    ("p", "truth", "expected"),
    [
        (pred(), POS, 1.0),  # lesion claimed, lesion present
        (PRED_NEG, POS, 0.0),  # missed lesion
        (PRED_NEG, NEG, 1.0),  # true negative
        (pred(), NEG, 0.0),  # false positive
        (ParseFailure("empty"), NEG, 0.0),  # a parse failure scores 0 even on a negative
    ],
)
def test_existence(p: ParsedReport | ParseFailure, truth: Truth, expected: float) -> None:
    assert existence_score(p, truth) == expected


@pytest.mark.parametrize(
    ("long_cm", "true_cm", "expected"),
    [
        (3.5, 3.0, 1.0),  # |0.5| == max(0.5, 0.6)?  0.5 <= 0.6
        (3.6, 3.0, 1.0),  # 0.6 <= 0.6 (20 % of 3.0), exactly at the limit
        (3.7, 3.0, 0.0),  # 0.7 > 0.6
        (1.5, 1.0, 1.0),  # 0.5 <= max(0.5, 0.2): the absolute floor, exactly at the limit
        (1.6, 1.0, 0.0),  # 0.6 > 0.5
        (8.0, 10.0, 1.0),  # 2.0 <= 20 % of 10
        (7.9, 10.0, 0.0),  # 2.1 > 2.0
        (None, 3.0, 0.0),  # size not stated
    ],
)
def test_size_rule(long_cm: float | None, true_cm: float, expected: float) -> None:
    truth = Truth(Organ.LIVER, True, true_cm, ("5",), "hypo", 10)
    assert size_score(pred(long_cm=long_cm), truth) == expected


def test_size_thresholds_come_from_the_config() -> None:
    truth = Truth(Organ.LIVER, True, 3.0, ("5",), "hypo", 10)
    assert size_score(pred(long_cm=3.7), truth, ScoringConfig(size_rel_tol=0.25)) == 1.0  # 0.7 <= 0.75
    assert size_score(pred(long_cm=3.4), truth, ScoringConfig(size_abs_tol_cm=0.3, size_rel_tol=0.1)) == 0.0


@pytest.mark.parametrize(
    ("location", "expected"),
    [
        (("5", "8"), 1.0),  # same set
        (("8", "5"), 1.0),  # order does not matter
        (("5",), 0.0),  # subset
        (("5", "8", "7"), 0.0),  # superset
        (("1", "2", "3", "4", "5", "6", "7", "8"), 0.0),  # every segment: no credit
        (None, 0.0),  # not stated / hedged
    ],
)
def test_location_rule(location: tuple[str, ...] | None, expected: float) -> None:
    assert location_score(pred(location=location), POS) == expected


def test_empty_true_location_matches_an_organ_only_claim() -> None:
    truth = Truth(Organ.LIVER, True, 3.0, (), "hypo", 10)
    assert location_score(pred(location=()), truth) == 1.0
    assert location_score(pred(location=None), truth) == 0.0


@pytest.mark.parametrize(
    ("attenuation", "expected"),
    [("hypo", 1.0), ("hyper", 0.0), ("iso", 0.0), (None, 0.0)],  # equal / different / different / unstated
)
def test_enhancement_rule(attenuation: str | None, expected: float) -> None:
    assert enhancement_score(pred(attenuation=attenuation), POS) == expected


@pytest.mark.parametrize(
    ("k", "expected"),
    [(10, 1.0), (9, 1.0), (11, 1.0), (8, 0.0), (12, 0.0), (None, 0.0)],  # hit, +-1 hit, +-2 miss, missing
)
def test_k_hit_rule(k: int | None, expected: float) -> None:
    assert k_hit(pred(key_slice=k), POS) == expected


def test_k_hit_window_comes_from_the_config() -> None:
    assert k_hit(pred(key_slice=12), POS, ScoringConfig(k_hit_window=2)) == 1.0
    assert k_hit(pred(key_slice=11), POS, ScoringConfig(k_hit_window=0)) == 0.0


@pytest.mark.parametrize(
    "scorer",
    [
        lambda p, t: size_score(p, t),
        lambda p, t: location_score(p, t),
        lambda p, t: enhancement_score(p, t),
        lambda p, t: k_hit(p, t),
    ],
)
def test_attributes_on_negatives_are_none_and_on_missed_lesions_zero(scorer) -> None:
    assert scorer(pred(), NEG) is None  # not applicable on a true negative
    assert scorer(PRED_NEG, NEG) is None
    assert scorer(PRED_NEG, POS) == 0.0  # "no lesion" on a positive: wrong on every attribute
    assert scorer(ParseFailure("contradiction"), POS) == 0.0  # parse failure: 0


@pytest.mark.parametrize(
    ("k", "k_true", "expected"),
    [
        (10, 10, 1.0),  # same window
        (11, 10, 0.5),  # {10,11,12} vs {9,10,11}: 2 / 4
        (8, 10, 0.2),  # {7,8,9} vs {9,10,11}: 1 / 5
        (13, 10, 0.0),  # disjoint
        (1, 1, 1.0),  # no clipping at frame 1
        (None, 10, 0.0),  # missing k
    ],
)
def test_window_iou_on_integer_frame_sets(k: int | None, k_true: int, expected: float) -> None:
    assert window_iou(k, k_true) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "truth", "expected"),
    [
        (report(), POS, 1.0),  # positive claimed on a positive
        (NEG_REPORT, NEG, 1.0),  # negative claimed on a negative
        (NEG_REPORT, POS, 0.0),  # missed lesion
        (report(), NEG, 0.0),  # false positive
        ("garbage", NEG, 0.0),  # parse failure
    ],
)
def test_r_e(text: str, truth: Truth, expected: float) -> None:
    assert r_e(text, truth) == expected


@pytest.mark.parametrize(
    ("text", "truth", "expected"),
    [
        (report(), POS, 1.0),  # all three attributes right
        (report(long_mm=45.0), POS, 2 / 3),  # size wrong
        (report(location=("5",)), POS, 2 / 3),  # location wrong
        (report(long_mm=45.0, attenuation="iso"), POS, 1 / 3),  # size and enhancement wrong
        (report(long_mm=45.0, location=("1",), attenuation="iso"), POS, 0.0),  # all wrong
        (report(key_slice=30), POS, 1.0),  # the key slice does not enter r_f
        (NEG_REPORT, POS, 0.0),  # missed lesion
        (NEG_REPORT, NEG, 1.0),  # true negative: 1 when the report claims no lesion
        (report(), NEG, 0.0),  # false positive on a negative
        ("<findings>No lesion. A 3 cm mass.</findings>", NEG, 0.0),  # contradiction: parse failure
    ],
)
def test_r_f(text: str, truth: Truth, expected: float) -> None:
    assert r_f(text, truth) == pytest.approx(expected)


def test_r_f_weights_come_from_the_config() -> None:
    cfg = ScoringConfig(attribute_weights=(0.5, 0.25, 0.25))
    assert r_f(report(long_mm=45.0), POS, cfg) == pytest.approx(0.5)


def test_r_f_renormalises_over_applicable_attributes() -> None:
    truth = Truth(Organ.LIVER, True, 3.0, ("5", "8"), None, 10)  # no attenuation label
    assert r_f(report(attenuation="iso"), truth) == pytest.approx(1.0)


VERIFIER_OK = "There is a 3 cm hypodense mass in hepatic segments 5 and 8."


@pytest.mark.parametrize(
    ("text", "k", "expected"),
    [
        (VERIFIER_OK, 10, 1.0),  # all attributes, k on target: no penalty
        (VERIFIER_OK, 11, 1.0 - 0.3 * 0.5),  # distance 1: IoU 1/2
        (VERIFIER_OK, 8, 1.0 - 0.3 * 0.8),  # distance 2: IoU 1/5
        (VERIFIER_OK, 20, 1.0 - 0.3),  # far away: full penalty
        (VERIFIER_OK, None, 1.0 - 0.3),  # no key slice: IoU 0
        ("A 3 cm hypodense mass in segment 5.", 10, 2 / 3),  # location wrong
        ("No abnormality is seen.", 10, 0.0),  # verifier denies: no attribute credit
        ("No abnormality is seen.", 13, -0.3),  # ... and the key slice is off: negative reward
        ("", 10, 0.0),  # empty answer
    ],
)
def test_r_c(text: str, k: int | None, expected: float) -> None:
    assert r_c(text, k, POS) == pytest.approx(expected)


QUERY = ScoringConfig(negative_rows="query_named_slice")
DISTANCE = ScoringConfig(cross_view="distance_only")
QUERY_DISTANCE = ScoringConfig(negative_rows="query_named_slice", cross_view="distance_only")


@pytest.mark.parametrize(
    ("pred_", "truth", "text", "cfg", "expected"),
    [
        (pred(key_slice=11), POS, VERIFIER_OK, ScoringConfig(), 0.85),  # the paper's formula on a positive row
        (pred(key_slice=11), POS, None, ScoringConfig(), -0.15),  # no answer: attributes 0, window term only
        (pred(has_lesion=False, key_slice=None), POS, VERIFIER_OK, ScoringConfig(), -0.3),  # a miss: text unread
        (ParseFailure("empty"), POS, VERIFIER_OK, ScoringConfig(), -0.3),  # parse failure: -lambda
        (ParseFailure("empty"), NEG, None, ScoringConfig(), None),  # skip: None on a negative, parsed or not
        (PRED_NEG, NEG, None, ScoringConfig(), None),
        (PRED_NEG, NEG, None, QUERY, 1.0),  # the gold negative's own score
        (pred(key_slice=4), NEG, "No liver lesion.", QUERY, 0.7),  # the verifier rejects the claimed lesion
        (pred(key_slice=4), NEG, VERIFIER_OK, QUERY, -0.3),  # ... or describes one: inconsistent
        (pred(key_slice=4), NEG, "undecided", QUERY, -0.3),  # an unreadable answer is no "no lesion"
        (pred(key_slice=None), NEG, "No liver lesion.", QUERY, -0.3),  # no named frame: the text is not read
        (ParseFailure("empty"), NEG, None, QUERY, -0.3),
        (pred(key_slice=12), POS, VERIFIER_OK, DISTANCE, -0.24),  # the window term alone
        (pred(key_slice=10), POS, "No liver lesion.", DISTANCE, 0.0),  # the text is ignored
        (pred(key_slice=4), NEG, "No liver lesion.", QUERY_DISTANCE, -0.3),  # a claimed lesion: -lambda
        (PRED_NEG, NEG, None, QUERY_DISTANCE, 0.0),  # two empty windows: no penalty
    ],
)
def test_consistency_reward(pred_, truth: Truth, text: str | None, cfg: ScoringConfig, expected: float | None) -> None:
    value = consistency_reward(pred_, truth, text, cfg)
    assert value == (None if expected is None else pytest.approx(expected))


def test_consistency_reward_box_term_and_frame_bound() -> None:
    boxed = ScoringConfig(box_weight=0.5)
    near = ParsedReport(True, 3.0, None, ("5", "8"), "hypo", 11, (0, 0, 10, 10), 1)
    assert consistency_reward(near, POS, VERIFIER_OK, boxed, truth_bbox=(5, 0, 15, 10)) == pytest.approx(
        0.85 + 0.5 / 3
    )
    far = ParsedReport(True, 3.0, None, ("5", "8"), "hypo", 12, (0, 0, 10, 10), 1)  # |k - k_true| = 2: no box term
    assert consistency_reward(far, POS, VERIFIER_OK, boxed, truth_bbox=(0, 0, 10, 10)) == pytest.approx(0.76)
    distance = ScoringConfig(box_weight=0.5, cross_view="distance_only")
    assert consistency_reward(near, POS, None, distance, truth_bbox=(0, 0, 10, 10)) == pytest.approx(-0.15)
    # k = 11 beyond the row's 10 frames is not usable: no query, no text read, IoU 0
    assert verifier_frame(near, POS, n_frames=11) == 11 and verifier_frame(near, POS, n_frames=10) is None
    assert consistency_reward(near, POS, VERIFIER_OK, n_frames=10) == pytest.approx(-0.3)


def test_verifier_frame_names_a_frame_only_where_r_c_reads_an_answer() -> None:
    assert verifier_frame(pred(key_slice=4), NEG) is None and verifier_frame(pred(key_slice=4), NEG, QUERY) == 4
    assert verifier_frame(pred(key_slice=4), POS, DISTANCE) is None
    assert verifier_frame(PRED_NEG, NEG, QUERY) is None and verifier_frame(ParseFailure("empty"), POS) is None
    assert verifier_frame(report(key_slice=9), POS) == 9  # report text is parsed


def test_r_c_is_none_on_true_negatives_and_lambda_comes_from_the_config() -> None:
    assert r_c(VERIFIER_OK, 10, NEG) is None
    assert r_c(VERIFIER_OK, 20, POS, ScoringConfig(iou_penalty=0.5)) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("re_", "rf", "rc", "expected"),
    [
        (1.0, 1.0, 1.0, 1.0),  # perfect
        (1.0, 0.5, 0.25, 0.3 + 0.25 + 0.05),  # weighted sum
        (1.0, 0.0, -0.3, 0.3 - 0.06),  # r_c may be negative
        (1.0, 1.0, None, 1.0),  # r_c None: renormalised over r_e and r_f
        (1.0, 0.0, None, 0.3 / 0.8),  # ... (0.3 r_e + 0.5 r_f) / 0.8
        (0.0, 0.0, None, 0.0),  # nothing right
    ],
)
def test_total_reward(re_: float, rf: float, rc: float | None, expected: float) -> None:
    assert total_reward(re_, rf, rc) == pytest.approx(expected)


def test_score_report_positive_with_verifier() -> None:
    s = score_report(report(key_slice=11), POS, verifier_text=VERIFIER_OK)
    assert (
        s.parse_failure,
        s.score_existence,
        s.score_size,
        s.score_location,
        s.score_enhancement,
        s.score_k_hit,
    ) == (None, 1.0, 1, 1, 1, 1)
    assert s.r_c == pytest.approx(0.85)
    assert s.reward == pytest.approx(0.3 + 0.5 + 0.2 * 0.85)
    assert (s.pred_has_lesion, s.pred_long_axis_cm, s.pred_location) == (True, 3.0, ("5", "8"))
    assert (s.pred_attenuation, s.pred_key_slice, s.pred_bbox) == ("hypo", 11, (10, 20, 30, 40))


def test_score_report_true_negative() -> None:
    s = score_report(NEG_REPORT, NEG, verifier_text="anything")
    assert (s.score_existence, s.score_size, s.score_location, s.score_enhancement, s.score_k_hit, s.r_c) == (
        1.0,
        None,
        None,
        None,
        None,
        None,
    )
    assert (s.r_e, s.r_f, s.reward) == (1.0, 1.0, 1.0)


def test_score_report_parse_failure_scores_zero_everywhere() -> None:
    s = score_report(
        "<findings>No liver lesion.</findings> || <impression>Liver mass.</impression>", POS, verifier_text=VERIFIER_OK
    )
    assert s.parse_failure == "contradiction"
    assert (s.score_existence, s.score_size, s.score_location, s.score_enhancement, s.score_k_hit) == (
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
    )
    # r_c = -lambda (the lowest a parsed report scores), so R = 0.2 * -0.3, as a missed lesion with a verifier
    assert (s.r_e, s.r_f, s.pred_has_lesion) == (0.0, 0.0, None)
    assert (s.r_c, s.reward) == (pytest.approx(-0.3), pytest.approx(0.2 * -0.3))
    assert score_report("garbage", POS).reward == 0.0  # without a verifier (mining): r_c None, R renormalised
    neg = score_report("", NEG)
    assert (neg.parse_failure, neg.score_existence, neg.score_size, neg.r_c, neg.reward) == (
        "empty",
        0.0,
        None,
        None,
        0.0,
    )


def test_score_report_missed_lesion() -> None:
    s = score_report(NEG_REPORT, POS, verifier_text="")
    assert (s.score_existence, s.score_size, s.score_location, s.score_enhancement, s.score_k_hit) == (
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
    )
    assert s.r_c == pytest.approx(-0.3)
    assert s.reward == pytest.approx(0.2 * -0.3)


def test_score_report_without_verifier_renormalises() -> None:
    s = score_report(report(long_mm=45.0), POS)
    assert s.r_c is None
    assert s.reward == pytest.approx((0.3 + 0.5 * 2 / 3) / 0.8)


def test_to_row_uses_lists() -> None:
    row = score_report(report(), POS).to_row()
    assert row["pred_location"] == ["5", "8"] and row["pred_bbox"] == [10, 20, 30, 40]
    assert set(row) == set(ReportScore.__slots__)


@pytest.mark.parametrize(
    ("text", "truth", "expected"),
    [
        (report(), POS, (False, ())),  # everything right: not hard
        (NEG_REPORT, NEG, (False, ())),  # true negative: not hard
        (report(), NEG, (True, ("existence",))),  # false positive
        (NEG_REPORT, POS, (True, ("existence", "size", "location", "enhancement", "k_hit"))),  # missed lesion
        (report(long_mm=45.0, key_slice=13), POS, (True, ("size", "k_hit"))),  # wrong size, K-Hit miss
        (report(attenuation="iso"), POS, (True, ("enhancement",))),  # one wrong attribute
        (report(key_slice=None), POS, (True, ("k_hit",))),  # no key slice
        ("", NEG, (True, ("parse_failure", "existence"))),  # parse failure on a negative
    ],
)
def test_is_hard(text: str, truth: Truth, expected: tuple[bool, tuple[str, ...]]) -> None:
    assert is_hard(score_report(text, truth)) == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"size_abs_tol_cm": -1.0},  # negative tolerance
        {"k_hit_window": -1},  # negative window
        {"attribute_weights": (0.0, 0.0, 0.0)},  # no weight
        {"reward_weights": (0.0, 0.0, 1.0)},  # r_e + r_f must weigh something
        {"iou_penalty": -0.1},  # negative lambda
    ],
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ScoringConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"negative_rows": "query"}, "negative_rows='query' must be one of skip | query_named_slice."),
        ({"cross_view": "blind"}, "cross_view='blind' must be one of full | distance_only | random_frame."),
    ],
)
def test_r_c_options_are_validated_with_one_line_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        ScoringConfig(**kwargs)
    assert str(exc.value) == message


def test_docstring_examples() -> None:
    assert doctest.testmod(scoring).failed == 0
