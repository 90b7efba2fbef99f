"""The gate's statistics: the mSPRT against its integral and under the null, the stratified estimate, hand-checked z and intervals."""

from __future__ import annotations

import math
import random
from typing import Callable

import pytest
from scipy import stats as sps

from flywheel.serving.stats import mean_ci, two_proportions


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


def test_msprt_log_lr_is_the_half_normal_mixture_integral() -> None:
    import math

    from scipy import integrate

    from flywheel.serving.stats import msprt_log_lr

    for diff, var, theta0, tau in ((0.05, 0.001, 0.0, 0.1), (-0.02, 0.0004, -0.01, 0.05), (0.2, 0.01, 0.0, 0.3)):
        def integrand(delta: float) -> float:
            lr = math.exp((delta * (diff - theta0) - delta * delta / 2) / var)
            return lr * 2 / (tau * math.sqrt(2 * math.pi)) * math.exp(-delta * delta / (2 * tau * tau))

        numeric, _ = integrate.quad(integrand, 0, 10 * tau)
        assert abs(msprt_log_lr(diff, var, theta0, tau) - math.log(numeric)) < 1e-6


def _promoted(draw: Callable[[random.Random, int], tuple[str, float]], rng: random.Random, looks: int, per_look: int,
              alpha: float, margin: float = 0.0) -> bool:
    """One simulated challenger: per_look sessions a side (draw(rng, side) -> (task type, outcome); side 0 is the
    champion), the test run at every look; whether it ever said promote."""
    from flywheel.serving.stats import Moments, sequential_test

    arms: tuple[dict[str, Moments], dict[str, Moments]] = ({}, {})
    for _ in range(looks):
        for _ in range(per_look):
            for side, stats in enumerate(arms):
                k, value = draw(rng, side)
                stats[k] = stats.get(k, Moments()).add(value)
        test = sequential_test(arms[0], arms[1], alpha, 0.1, margin)
        if test is not None and test.better:
            return True
    return False


def _null_run(rng: random.Random, rate: float, looks: int, per_look: int, alpha: float) -> bool:
    def draw(rng: random.Random, side: int) -> tuple[str, float]:
        k = "x" if rng.random() < 0.5 else "y"
        return k, float(rng.random() < (rate if k == "x" else rate / 2))

    return _promoted(draw, rng, looks, per_look, alpha)


def test_sequential_test_keeps_its_error_rate_under_the_null_however_often_it_looks() -> None:
    # 600 equal-version streams, each looked at 40 times: a fixed-alpha test re-run at every look
    # would be fooled far more often than alpha; the mSPRT stays under it (plus 3 standard errors)
    rng = random.Random(1234)
    alpha, runs = 0.05, 600
    promoted = sum(_null_run(rng, 0.3, 40, 15, alpha) for _ in range(runs))
    assert promoted / runs <= alpha + 3 * (alpha * (1 - alpha) / runs) ** 0.5, promoted


def _graded_null_run(rng: random.Random, rate: float, looks: int, per_look: int, alpha: float, margin: float) -> bool:
    """Equal versions (B exactly `margin` worse), a graded outcome: the share of 2 or 3 parts right."""
    def draw(rng: random.Random, side: int) -> tuple[str, float]:
        k, p = rng.choice((2, 3)), rate - margin * side
        return "multi", sum(rng.random() < p for _ in range(k)) / k

    return _promoted(draw, rng, looks, per_look, alpha, margin)


@pytest.mark.parametrize("rate,margin", [(0.1, 0.0), (0.1, 0.05), (0.3, 0.05)])
def test_a_graded_outcome_keeps_the_error_rate_under_the_null(rate: float, margin: float) -> None:
    # the swarm gates on the share of parts right: its variance floor is lower than a pass/fail's, and must
    # still keep false promotions under alpha (+3 standard errors) at low rates, where early looks see all zeros
    rng = random.Random(7)
    alpha, runs = 0.05, 400
    promoted = sum(_graded_null_run(rng, rate, 30, 10, alpha, margin) for _ in range(runs))
    assert promoted / runs <= alpha + 3 * (alpha * (1 - alpha) / runs) ** 0.5, promoted


def test_a_graded_outcome_is_not_floored_at_the_pass_fail_variance() -> None:
    from flywheel.serving.stats import Moments, _pooled_var

    shares = [0.0] * 60 + [0.5] * 30 + [1.0] * 10  # mean 0.25, sample variance about 0.11
    binary = [0.0] * 75 + [1.0] * 25  # the same mean as pass/fail: variance about 0.19
    graded_var = _pooled_var(Moments.of(shares), Moments.of(shares))
    assert graded_var == pytest.approx(0.115, abs=0.002), graded_var
    assert _pooled_var(Moments.of(binary), Moments.of(binary)) == pytest.approx(0.1884, abs=0.002)
    zeros = Moments.of([0.0] * 40)
    assert 0 < _pooled_var(zeros, zeros.add(0.5)) < 0.05, "all but one zero: small, never 0"


def test_a_fixed_alpha_test_repeated_at_every_look_is_fooled_more_often() -> None:
    # the reason for the sequential test: the same streams with a z-test at every look
    rng = random.Random(99)
    fooled = 0
    for _ in range(300):
        a = b = 0
        n = 0
        for _ in range(40):
            for _ in range(15):
                a += rng.random() < 0.3
                b += rng.random() < 0.3
            n += 15
            if two_proportions(a, n, b, n).p_better < 0.05:
                fooled += 1
                break
    assert fooled / 300 > 0.12, fooled


def test_stratified_weights_and_empty_strata() -> None:
    from flywheel.serving.stats import Moments, stratified

    a = {"x": Moments.of([0.0, 1.0, 0.0, 1.0]), "y": Moments.of([0.0, 0.0])}
    b = {"x": Moments.of([1.0, 1.0, 1.0, 1.0]), "y": Moments.of([0.0, 0.0]), "z": Moments.of([1.0])}
    est = stratified(a, b, min_per_side=2)
    assert est is not None and est.strata == 2  # z has one session on one side: left out
    assert abs(est.diff - 8 / 12 * 0.5) < 1e-9  # x has 8 of the 12 sessions, y (no difference) 4
    fixed = stratified(a, b, {"x": 1.0, "y": 3.0}, min_per_side=2)
    assert fixed is not None and abs(fixed.diff - 0.25 * 0.5) < 1e-9
    assert stratified({"x": Moments.of([1.0])}, b, min_per_side=2) is None
    assert stratified(a, b) is None, "the default wants five sessions a side per type"
