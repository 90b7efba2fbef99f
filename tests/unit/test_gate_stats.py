"""The gate's statistics against hand-checked values and scipy's own Welch test."""

from __future__ import annotations

import math
import random

from scipy import stats as sps

from flywheel.serving.stats import mean_ci, two_proportions, welch


def test_welch_matches_scipy_one_sided() -> None:
    rng = random.Random(0)
    a = [rng.gauss(0.5, 0.2) for _ in range(40)]
    b = [rng.gauss(0.4, 0.3) for _ in range(55)]
    got = welch(a, b)
    want = sps.ttest_ind(b, a, equal_var=False, alternative="less")
    assert math.isclose(got.p_worse, want.pvalue, rel_tol=1e-9), (got.p_worse, want.pvalue)
    assert math.isclose(got.p_worse + got.p_better, 1.0, rel_tol=1e-12)


def test_welch_detects_clear_regression_and_not_noise() -> None:
    rng = random.Random(1)
    champion = [float(rng.random() < 0.6) for _ in range(200)]
    worse = [float(rng.random() < 0.3) for _ in range(200)]
    same = [float(rng.random() < 0.6) for _ in range(200)]
    assert welch(champion, worse).p_worse < 0.001
    assert welch(champion, same).p_worse > 0.01


def test_welch_constant_samples() -> None:
    assert welch([1.0, 1.0], [1.0, 1.0]).p_worse == 0.5
    assert welch([1.0, 1.0], [0.0, 0.0]).p_worse == 0.0


def test_two_proportions_hand_checked() -> None:
    # 60/100 vs 45/100: pooled 0.525, se = sqrt(.525*.475*.02) = 0.07062, z = -2.124, p = 0.0168
    c = two_proportions(60, 100, 45, 100)
    assert math.isclose(c.statistic, -2.124, abs_tol=1e-3), c
    assert math.isclose(c.p_worse, 0.0168, abs_tol=5e-4), c
    assert two_proportions(10, 10, 10, 10).p_worse == 0.5


def test_mean_ci_covers_mean() -> None:
    mean, low, high = mean_ci([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and low < 2.5 < high
    assert math.isclose(high - mean, sps.t.ppf(0.975, 3) * math.sqrt(1.6666666 / 4), rel_tol=1e-6)
    assert math.isnan(mean_ci([1.0])[1])
