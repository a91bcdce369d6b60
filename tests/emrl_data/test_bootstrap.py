"""The paired bootstraps, rows only and seeds-then-rows, on constructed groups with known answers."""

from __future__ import annotations

import pytest

from emrl_data.text.bootstrap import hierarchical_paired_bootstrap, paired_bootstrap


def _mean(rows):
    return sum(rows) / len(rows)


def _seed(diff: float, n: int) -> tuple[list[float], list[float]]:
    return [diff] * n, [0.0] * n


def test_one_seed_carrying_the_effect_excludes_zero_by_rows_but_not_by_seeds():
    # Seed 0: a beats b by 1 on each of its 50 rows; seeds 1 and 2: no difference. Within each seed the difference is
    # constant, so the rows-only interval is the point 1/3 and excludes 0. Drawing the seeds: the pooled value is k/3
    # with k ~ Binomial(3, 1/3) copies of seed 0; P(k = 0) = 8/27 > 0.025, so the low end is 0; P(k <= 2) = 26/27 <
    # 0.975 <= P(k <= 3), so the high end is 1.
    groups = [_seed(1.0, 50), _seed(0.0, 50), _seed(0.0, 50)]
    rows = paired_bootstrap(groups, _mean, n_bootstrap=4000, seed=0)
    seeds = hierarchical_paired_bootstrap(groups, _mean, n_bootstrap=4000, seed=0)
    assert rows["diff"] == seeds["diff"] == pytest.approx(1 / 3)
    assert (rows["ci_low"], rows["ci_high"]) == pytest.approx((1 / 3, 1 / 3))
    assert (seeds["ci_low"], seeds["ci_high"]) == pytest.approx((0.0, 1.0))
    assert (seeds["n_rows"], seeds["n_groups"]) == (150, 3)


def test_seeds_that_agree_give_the_same_interval_as_rows_alone():
    # Every seed's difference is 0.2 on every row: whatever is drawn, the pooled value is 0.2.
    groups = [_seed(0.2, 7), _seed(0.2, 3), _seed(0.2, 11)]
    got = hierarchical_paired_bootstrap(groups, _mean, n_bootstrap=200, seed=5)
    assert (got["diff"], got["ci_low"], got["ci_high"]) == pytest.approx((0.2, 0.2, 0.2))


def test_one_seed_resamples_its_rows_as_the_rows_only_interval_does():
    # One group: a - b = [1, 0, 0, 0], the binomial percentiles 0 and 3/4 (as the rows-only bootstrap gives).
    got = hierarchical_paired_bootstrap([([1.0, 0.0, 0.0, 0.0], [0.0] * 4)], _mean, n_bootstrap=20000, seed=1)
    assert (got["diff"], got["ci_low"], got["ci_high"]) == (0.25, 0.0, 0.75)


def test_the_hierarchical_bootstrap_refuses_what_the_rows_only_one_refuses():
    with pytest.raises(ValueError, match="hierarchical_paired_bootstrap: groups must pair rows one to one"):
        hierarchical_paired_bootstrap([([1.0, 2.0], [1.0])], _mean, n_bootstrap=100, seed=0)
    with pytest.raises(ValueError, match="n_bootstrap=20 is too few"):
        hierarchical_paired_bootstrap([([1.0], [1.0])], _mean, n_bootstrap=20, seed=0)
    with pytest.raises(ValueError, match="no group"):
        hierarchical_paired_bootstrap([], _mean, n_bootstrap=100, seed=0)


def test_resamples_where_the_statistic_is_undefined_are_left_out():
    def first_or_nan(rows):  # undefined (nan) on a draw whose first row is 0
        return float("nan") if rows[0] == 0 else 1.0

    got = hierarchical_paired_bootstrap([([1.0, 0.0], [1.0, 0.0])], first_or_nan, n_bootstrap=400, seed=0)
    assert (got["ci_low"], got["ci_high"]) == (0.0, 0.0)
