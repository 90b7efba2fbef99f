"""The project's statistics (the gate and the report): one-sided tests for "is B worse/better than A", and
confidence intervals.

Pure functions over plain lists, unit-tested without any service. Rewards are per session (one
number per production session), so sessions, not llm_calls, are the independent samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Comparison:
    """B against A: the mean difference and the one-sided p-value of "B is worse than A"."""

    n_a: int
    n_b: int
    mean_a: float
    mean_b: float
    diff: float  # mean_b - mean_a
    statistic: float
    p_worse: float  # small: B is significantly worse than A
    p_better: float  # small: B is significantly better than A
    test: str


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): a t interval of the mean (nan bounds with fewer than 2 values)."""
    from scipy import stats

    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = stats.t.ppf(0.5 + level / 2, n - 1) * math.sqrt(var / n)
    return mean, mean - half, mean + half


def welch(a: list[float], b: list[float]) -> Comparison:
    """Welch's t-test (unequal variances) of mean(b) against mean(a), both one-sided p-values.

    Two constant samples (zero variance) have no t statistic: equal means give p 0.5 both ways,
    different means are treated as a certain difference.
    """
    from scipy import stats

    n_a, n_b = len(a), len(b)
    assert n_a >= 2 and n_b >= 2, f"welch needs 2+ samples per side, got {n_a} and {n_b}"
    mean_a, mean_b = sum(a) / n_a, sum(b) / n_b
    var_a = sum((x - mean_a) ** 2 for x in a) / (n_a - 1)
    var_b = sum((x - mean_b) ** 2 for x in b) / (n_b - 1)
    se2 = var_a / n_a + var_b / n_b
    diff = mean_b - mean_a
    if se2 == 0.0:
        p_worse = 0.5 if diff == 0 else (0.0 if diff < 0 else 1.0)
        return Comparison(n_a, n_b, mean_a, mean_b, diff, math.copysign(math.inf, diff) if diff else 0.0, p_worse,
                          1.0 - p_worse if diff else 0.5, "welch-t")
    t = diff / math.sqrt(se2)
    df = se2**2 / ((var_a / n_a) ** 2 / max(n_a - 1, 1) + (var_b / n_b) ** 2 / max(n_b - 1, 1))
    return Comparison(n_a, n_b, mean_a, mean_b, diff, t, float(stats.t.cdf(t, df)), float(stats.t.sf(t, df)),
                      "welch-t")


def two_proportions(success_a: int, n_a: int, success_b: int, n_b: int) -> Comparison:
    """Two-proportion z-test (pooled) of B's success rate against A's, both one-sided p-values."""
    assert n_a > 0 and n_b > 0, f"two_proportions needs samples on both sides, got {n_a} and {n_b}"
    p_a, p_b = success_a / n_a, success_b / n_b
    pooled = (success_a + success_b) / (n_a + n_b)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    diff = p_b - p_a
    if se == 0.0:  # both all-success or all-failure: no evidence either way
        return Comparison(n_a, n_b, p_a, p_b, diff, 0.0, 0.5, 0.5, "two-proportion-z")
    z = diff / se
    # the normal cdf and survival function through erfc: exact, and no scipy on this path
    return Comparison(n_a, n_b, p_a, p_b, diff, z, 0.5 * math.erfc(-z / math.sqrt(2)), 0.5 * math.erfc(z / math.sqrt(2)),
                      "two-proportion-z")


def p_better(success_a: int, n_a: int, success_b: int, n_b: int) -> float:
    """One-sided p-value of "B's success rate is higher than A's" (two_proportions); 1.0 if a side is empty."""
    if n_a == 0 or n_b == 0:
        return 1.0
    return two_proportions(success_a, n_a, success_b, n_b).p_better


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a binomial proportion (sensible at small n and near 0 or 1)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at p = 0 or 1 rounding can put the bound a hair past p; an interval must contain its estimate
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))
