"""The study's paired bootstrap, its metrics and its guards, on constructed per-row scores with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from train.checks import TrainConfigError
from train.miniature.power import average_bacc, check_power, k_hit, paired_bootstrap


def _mean(rows):
    return sum(rows) / len(rows)


def test_a_constant_difference_has_a_zero_width_interval():
    a, b = [0.9, 0.4, 0.7, 0.2], [0.8, 0.3, 0.6, 0.1]  # a - b = 0.1 on every row: every resample gives 0.1
    got = paired_bootstrap([(a, b)], _mean, n_bootstrap=200, seed=0)
    assert got["diff"] == pytest.approx(0.1)
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((0.1, 0.1))
    assert (got["n_rows"], got["n_groups"]) == (4, 1)


def test_one_row_of_four_differing_gives_the_binomial_percentiles():
    # a - b = [1, 0, 0, 0]: a resample's mean is k/4, k ~ Binomial(4, 1/4): P(k = 0) = 0.316 > 0.025, so the 2.5 %
    # percentile is 0; P(k <= 2) = 0.949 < 0.975 <= P(k <= 3) = 0.996, so the 97.5 % percentile is 3/4.
    a, b = [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]
    got = paired_bootstrap([(a, b)], _mean, n_bootstrap=20000, seed=1)
    assert (got["diff"], got["ci_low"], got["ci_high"]) == (0.25, 0.0, 0.75)


def test_pooling_averages_the_seeds_and_resamples_within_each():
    seed0 = ([1.0, 1.0], [0.0, 0.0])  # difference 1 on every row
    seed1 = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])  # difference 0
    got = paired_bootstrap([seed0, seed1], _mean, n_bootstrap=100, seed=0)
    assert (got["diff"], got["ci_low"], got["ci_high"]) == (0.5, 0.5, 0.5)  # rows never move between seeds
    assert (got["n_rows"], got["n_groups"]) == (5, 2)


def test_pairing_cancels_the_rows_shared_variance():
    # Row difficulty varies widely, the difference never does: unpaired intervals would be wide, paired ones are not.
    b = [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    a = [x + 0.5 for x in b]
    got = paired_bootstrap([(a, b)], _mean, n_bootstrap=500, seed=3)
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((0.5, 0.5))


def test_unpaired_groups_and_too_few_resamples_are_errors():
    with pytest.raises(ValueError, match="pair rows one to one"):
        paired_bootstrap([([1.0, 2.0], [1.0])], _mean, n_bootstrap=100, seed=0)
    with pytest.raises(ValueError, match="n_bootstrap=20 is too few"):
        paired_bootstrap([([1.0], [1.0])], _mean, n_bootstrap=20, seed=0)


def _row(organ, positive, existence, khit=None):
    return {"organ": organ, "has_lesion": positive, "score_existence": existence, "score_k_hit": khit}


def test_metrics_from_per_row_scores():
    rows = [
        _row("liver", True, 1.0, 1.0),
        _row("liver", True, 0.0, 0.0),
        _row("liver", False, 1.0),
        _row("kidney", True, 1.0, 1.0),
        _row("kidney", False, 0.0),
        _row("kidney", False, 1.0),
        _row("pancreas", True, 1.0, None),
    ]
    # liver (0.5 + 1) / 2 = 0.75, kidney (1 + 0.5) / 2 = 0.75, pancreas has no negative row: left out
    assert average_bacc(rows) == 0.75
    assert k_hit(rows) == 0.75  # liver 0.5, kidney 1.0; pancreas has no K-Hit
    assert str(average_bacc([_row("liver", True, 1.0)])) == "nan"


def test_a_split_too_small_for_its_intervals_is_one_line_before_training():
    with pytest.raises(TrainConfigError) as err:
        check_power(n_test=50, n_organs=3, min_rows_per_class=10, n_bootstrap=1000)
    assert "\n" not in str(err.value) and "needs n_test >= 60" in str(err.value)
    with pytest.raises(TrainConfigError, match="n_bootstrap=30 is too few"):
        check_power(n_test=60, n_organs=3, min_rows_per_class=10, n_bootstrap=30)
    check_power(n_test=60, n_organs=3, min_rows_per_class=10, n_bootstrap=40)


def test_exact_key_counts_only_the_true_key_frame_itself_per_organ():
    from train.miniature.power import exact_key, k_hit

    def row(organ, pred, key, hit):
        return {"organ": organ, "has_lesion": True, "pred_key_slice": pred, "key_slice_frame": key, "score_k_hit": hit}

    rows = [
        row("liver", 5, 5, 1.0),
        row("liver", 6, 5, 1.0),
        row("kidney", 3, 4, 1.0),
        row("kidney", 9, 4, 0.0),
        {"organ": "kidney", "has_lesion": False, "pred_key_slice": None, "key_slice_frame": None, "score_k_hit": None},
    ]
    assert exact_key(rows) == (0.5 + 0.0) / 2 and k_hit(rows) == (1.0 + 0.5) / 2
    assert math.isnan(exact_key(rows[-1:]))


def test_the_metrics_column_sums_give_the_bootstrap_of_the_drawn_rows_bit_for_bit():
    from train.miniature.power import exact_key, hierarchical_paired_bootstrap

    rng = np.random.default_rng(3)

    def rows(n):
        return [
            {
                "organ": ("liver", "kidney", "pancreas")[int(rng.integers(3))],
                "has_lesion": bool(rng.integers(2)),
                "score_existence": float(rng.integers(2)),
                "score_k_hit": (None, 0.0, 1.0)[int(rng.integers(3))],
                "pred_key_slice": int(rng.integers(1, 4)),
                "key_slice_frame": 2,
            }
            for _ in range(n)
        ]

    groups = [(rows(n), rows(n)) for n in (30, 17, 9)]
    for metric in (average_bacc, k_hit, exact_key):
        assert metric.counts(groups[0][0]) is not None  # the column-sum path is the one taken

        def plain(rs, metric=metric):  # the same statistic without `counts`: the bootstrap calls it on drawn rows
            return metric(rs)

        for boot in (paired_bootstrap, hierarchical_paired_bootstrap):
            assert boot(groups, metric, n_bootstrap=200, seed=5) == boot(groups, plain, n_bootstrap=200, seed=5)
    fractional = [{"organ": "liver", "has_lesion": True, "score_existence": 0.5, "score_k_hit": 1.0}]
    assert average_bacc.counts(fractional) is None and k_hit.counts(fractional) is not None  # not exact: drawn rows


def test_holm_and_benjamini_hochberg_adjust_given_p_values():
    from train.miniature.power import benjamini_hochberg, holm

    p = [0.04, 0.01, 0.2, 0.03, 0.02]
    # Holm, sorted 0.01 0.02 0.03 0.04 0.2: x5 0.05, x4 0.08, x3 0.09, x2 0.08 -> 0.09 (monotone), x1 0.2
    assert holm(p) == pytest.approx([0.09, 0.05, 0.2, 0.09, 0.08])
    # BH, from the largest: 0.2 x 5/5 = 0.2, 0.04 x 5/4 = 0.05, 0.03 x 5/3 = 0.05, 0.02 x 5/2 = 0.05, 0.01 x 5 = 0.05
    assert benjamini_hochberg(p) == pytest.approx([0.05, 0.05, 0.2, 0.05, 0.05])
    assert holm([0.6, 0.5]) == [1.0, 1.0] and benjamini_hochberg([0.6, 0.5]) == [0.6, 0.6]
    assert holm([]) == [] and benjamini_hochberg([]) == []


def _pos(organ, pred, key=10, claims=True):
    hit = None if key is None else float(claims and pred is not None and abs(pred - key) <= 1)
    return {
        "organ": organ,
        "has_lesion": True,
        "pred_has_lesion": claims,
        "pred_key_slice": pred,
        "key_slice_frame": key,
        "score_k_hit": hit,
        "score_existence": float(claims),
    }


def test_k_hit_taken_apart_on_constructed_rows():
    from train.miniature.power import lesion_metrics, names_lesion_frame, random_lesion_frame

    # liver: exact, d = 1, d = 3 (a lesion frame, no K-Hit), d = 4 (outside), no frame named, a frame but no lesion
    # claimed; kidney: exact, d = 2; a negative row, which no rate counts
    rows = [
        _pos("liver", 10),
        _pos("liver", 11),
        _pos("liver", 7),
        _pos("liver", 14),
        _pos("liver", None),
        _pos("liver", 10, claims=False),
        _pos("kidney", 5, key=5),
        _pos("kidney", 3, key=5),
        {
            "organ": "kidney",
            "has_lesion": False,
            "pred_has_lesion": False,
            "pred_key_slice": None,
            "key_slice_frame": None,
            "score_k_hit": None,
            "score_existence": 1.0,
        },
    ]
    assert [names_lesion_frame(r, 3) for r in rows] == [True, True, True, False, False, False, True, True, False]
    got = {name: rate(rows) for name, rate in lesion_metrics(3).items()}
    assert got["lesion_frame"] == pytest.approx((3 / 6 + 2 / 2) / 2)
    assert got["k_hit_in_lesion"] == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert got["exact_in_lesion"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert got["exact_of_hits"] == pytest.approx((1 / 2 + 1 / 1) / 2)
    assert lesion_metrics(1)["lesion_frame"](rows) == pytest.approx((2 / 6 + 1 / 2) / 2)  # d = 2, 3 fall outside
    # a random visible frame: key 10 of 20 shows 7 frames (3 within 1 of the key), key 2 of 20 shows frames 1-5
    chance = random_lesion_frame([_pos("liver", None, key=10), _pos("kidney", None, key=2), rows[-1]], 3, 20)
    assert chance == pytest.approx(
        {
            "k_hit": (3 / 7 + 3 / 5) / 2,
            "exact_key": (1 / 7 + 1 / 5) / 2,
            "lesion_frame": 1.0,
            "k_hit_in_lesion": (3 / 7 + 3 / 5) / 2,
            "exact_in_lesion": (1 / 7 + 1 / 5) / 2,
            "exact_of_hits": 1 / 3,
        }
    )


def test_the_many_draw_columns_give_each_metric_of_the_drawn_rows():
    from train.miniature.power import exact_key, lesion_metrics

    rng = np.random.default_rng(7)
    rows = [
        _pos(
            ("liver", "kidney", "pancreas")[i % 3],
            int(rng.integers(1, 21)),
            key=int(rng.integers(2, 20)),
            claims=bool(rng.integers(4)),
        )
        for i in range(40)
    ]
    rows += [
        {
            "organ": "liver",
            "has_lesion": False,
            "pred_has_lesion": False,
            "pred_key_slice": None,
            "key_slice_frame": None,
            "score_k_hit": None,
            "score_existence": 1.0,
        }
    ] * 5
    draws = [rng.integers(len(rows), size=len(rows)) for _ in range(20)]
    for metric in (average_bacc, k_hit, exact_key, *lesion_metrics(3).values()):
        columns, of_sums = metric.columns(rows)
        weights = np.stack([np.bincount(idx, minlength=len(rows)) for idx in draws]).astype(float)
        got = of_sums(weights @ columns)
        want = [metric([rows[i] for i in idx]) for idx in draws]
        assert got == pytest.approx(want, nan_ok=True), metric


def test_a_contrast_bootstrap_gives_its_interval_p_value_and_detectable_difference():
    from train.miniature.power import bound_mc_error, contrast_bootstrap

    a = [_pos("liver", 10), _pos("liver", 10), _pos("liver", 20), _pos("liver", 20)]
    b = [_pos("liver", 20)] * 4  # K-Hit: a 0.5, b 0; per row a - b = 1, 1, 0, 0
    got = contrast_bootstrap([[(1.0, k_hit, a), (-1.0, k_hit, b)]], n_bootstrap=4000, seed=0, hierarchical=False)
    # a draw's difference is k / 4, k ~ Binomial(4, 1/2): P(k = 0) = 1/16, so p = 2 x P(draw <= 0) ~ 0.125
    assert got["diff"] == 0.5 and (got["ci_low"], got["ci_high"]) == (0.0, 1.0)
    assert got["p"] == pytest.approx(0.125, abs=0.02) and got["se"] == pytest.approx(0.25, abs=0.01)
    assert got["mdd"] == pytest.approx(2.8016 * got["se"], rel=1e-4)
    same = contrast_bootstrap([[(1.0, k_hit, a), (-1.0, k_hit, a)]], n_bootstrap=100, seed=0, hierarchical=True)
    assert (same["diff"], same["ci_low"], same["ci_high"], same["p"]) == (0.0, 0.0, 0.0, 1.0)
    # two seeds, one gaining 1 on every row, one 0: seeds and rows draws 0, 0.5 or 1; rows only always 0.5
    up = [[(1.0, k_hit, [_pos("liver", 10)] * 3), (-1.0, k_hit, [_pos("liver", 20)] * 3)]]
    flat = [[(1.0, k_hit, [_pos("liver", 10)] * 2), (-1.0, k_hit, [_pos("liver", 10)] * 2)]]
    rows_only = contrast_bootstrap(up + flat, n_bootstrap=400, seed=1, hierarchical=False)
    seeds_rows = contrast_bootstrap(up + flat, n_bootstrap=400, seed=1, hierarchical=True)
    assert (rows_only["ci_low"], rows_only["ci_high"], rows_only["p"]) == (0.5, 0.5, 0.0)
    assert (seeds_rows["diff"], seeds_rows["ci_low"], seeds_rows["ci_high"]) == (0.5, 0.0, 1.0)
    assert seeds_rows["p"] == pytest.approx(0.5, abs=0.1)  # 2 x P(both draws the flat seed) = 2 x 1/4
    assert bound_mc_error(1.0, 10_000) == pytest.approx(0.02671, rel=1e-3)
    with pytest.raises(ValueError, match="pair rows one to one"):
        contrast_bootstrap([[(1.0, k_hit, a), (-1.0, k_hit, a[:2])]], n_bootstrap=100, seed=0, hierarchical=False)
