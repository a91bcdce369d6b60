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
    rows = [_row("liver", True, 1.0, 1.0), _row("liver", True, 0.0, 0.0), _row("liver", False, 1.0),
            _row("kidney", True, 1.0, 1.0), _row("kidney", False, 0.0), _row("kidney", False, 1.0),
            _row("pancreas", True, 1.0, None)]  # fmt: skip
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

    rows = [row("liver", 5, 5, 1.0), row("liver", 6, 5, 1.0), row("kidney", 3, 4, 1.0), row("kidney", 9, 4, 0.0),
            {"organ": "kidney", "has_lesion": False, "pred_key_slice": None, "key_slice_frame": None,
             "score_k_hit": None}]  # fmt: skip
    assert exact_key(rows) == (0.5 + 0.0) / 2 and k_hit(rows) == (1.0 + 0.5) / 2
    assert math.isnan(exact_key(rows[-1:]))


def test_the_metrics_column_sums_give_the_bootstrap_of_the_drawn_rows_bit_for_bit():
    from train.miniature.power import exact_key, hierarchical_paired_bootstrap

    rng = np.random.default_rng(3)

    def rows(n):
        return [{"organ": ("liver", "kidney", "pancreas")[int(rng.integers(3))], "has_lesion": bool(rng.integers(2)),
                 "score_existence": float(rng.integers(2)), "score_k_hit": (None, 0.0, 1.0)[int(rng.integers(3))],
                 "pred_key_slice": int(rng.integers(1, 4)), "key_slice_frame": 2} for _ in range(n)]  # fmt: skip

    groups = [(rows(n), rows(n)) for n in (30, 17, 9)]
    for metric in (average_bacc, k_hit, exact_key):
        assert metric.counts(groups[0][0]) is not None  # the column-sum path is the one taken

        def plain(rs, metric=metric):  # the same statistic without `counts`: the bootstrap calls it on drawn rows
            return metric(rs)

        for boot in (paired_bootstrap, hierarchical_paired_bootstrap):
            assert boot(groups, metric, n_bootstrap=200, seed=5) == boot(groups, plain, n_bootstrap=200, seed=5)
    fractional = [{"organ": "liver", "has_lesion": True, "score_existence": 0.5, "score_k_hit": 1.0}]
    assert average_bacc.counts(fractional) is None and k_hit.counts(fractional) is not None  # not exact: drawn rows
