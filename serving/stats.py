"""The project's statistics (the gate and the report): one-sided tests for "is B worse/better than A", and
confidence intervals.

Pure functions over plain lists, unit-tested without any service. Rewards are per session (one
number per production session), so sessions, not llm_calls, are the independent samples.
"""

from __future__ import annotations

import functools
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
    return Comparison(n_a, n_b, p_a, p_b, diff, z, 0.5 * math.erfc(-z / math.sqrt(2)),
                      0.5 * math.erfc(z / math.sqrt(2)), "two-proportion-z")


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


# ---------------------------------------------------------------------------------------------
# The gate's sequential test: always valid, however often it looks
# ---------------------------------------------------------------------------------------------
# A session's reward variance never counts as smaller than this (rewards in [0, 1]): a stratum in
# which every session so far failed has sample variance 0, and an estimate with variance 0 would
# make the first success look like infinite evidence. 0.01 is a success rate of about 1%.
VAR_FLOOR = 0.01


@dataclass(frozen=True)
class Moments:
    """Sufficient statistics of one arm in one stratum: count, sum and sum of squares of the rewards."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0
    graded: int = 0  # values strictly between 0 and 1 (a share of parts right, not a pass/fail)

    def add(self, value: float) -> "Moments":
        return Moments(self.n + 1, self.total + value, self.squares + value * value,
                       self.graded + int(0.0 < value < 1.0))

    @staticmethod
    def of(values: list[float]) -> "Moments":
        return Moments(len(values), float(sum(values)), float(sum(v * v for v in values)),
                       sum(0.0 < v < 1.0 for v in values))

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan


def _pooled_var(a: Moments, b: Moments) -> float:
    """Sample variance of both arms' rewards together (equal under the null), floored.

    Pass/fail rewards (every value 0 or 1) are floored at m(1 - m) of the smoothed mean
    m = (sum + 1) / (n + 2), the largest variance a [0, 1] reward of that mean can have: at the 2-4%
    success of a hard task type a fixed floor would understate it. A graded reward in [0, 1] (a share
    of parts right) has less variance than a pass/fail one of its mean, and that maximum would make the
    test needlessly slow: it is floored at the sample variance with the same two pseudo-sessions added
    (one at 0, one at 1), which is never 0. Other rewards: VAR_FLOOR.
    """
    n = a.n + b.n
    total, squares = a.total + b.total, a.squares + b.squares
    mean = total / n
    var = max(0.0, (squares - n * mean * mean) / max(n - 1, 1))
    if (a.graded or b.graded) and squares <= total + 1e-9 and total >= -1e-9:
        smoothed = (total + 1.0) / (n + 2.0)
        return max(var, (squares + 1.0 - (n + 2.0) * smoothed * smoothed) / (n + 1.0))
    if squares <= total + 1e-9 and total >= -1e-9:
        smoothed = (total + 1.0) / (n + 2.0)
        return max(var, smoothed * (1.0 - smoothed))
    return max(var, VAR_FLOOR)


@dataclass(frozen=True)
class Stratified:
    """B minus A, averaged over strata (task types) at fixed weights, with the variance of that difference."""

    n_a: int
    n_b: int
    mean_a: float  # weighted over the strata used
    mean_b: float
    diff: float
    var: float  # variance of diff
    strata: int  # strata with at least min_per_side sessions on each side (the others are left out)


def stratified(a: dict[str, Moments], b: dict[str, Moments], weights: dict[str, float] | None = None,
               min_per_side: int = 5) -> Stratified | None:
    """The stratified difference of means; None when no stratum has `min_per_side` sessions on both sides.

    weights: stratum -> weight (a fixed task mix, renormalised over the strata present); None: each
    stratum's share of both arms' sessions together, the same for both arms, so a different task mix
    between arms cannot move the estimate.
    """
    used = [k for k in sorted(set(a) & set(b)) if a[k].n >= min_per_side and b[k].n >= min_per_side]
    if weights is not None:
        used = [k for k in used if weights.get(k, 0.0) > 0.0]
    if not used:
        return None
    raw = {k: (weights[k] if weights is not None else float(a[k].n + b[k].n)) for k in used}
    total = sum(raw.values())
    diff = var = mean_a = mean_b = 0.0
    for k in used:
        w = raw[k] / total
        v = _pooled_var(a[k], b[k])
        mean_a += w * a[k].mean
        mean_b += w * b[k].mean
        diff += w * (b[k].mean - a[k].mean)
        var += w * w * v * (1.0 / a[k].n + 1.0 / b[k].n)
    return Stratified(sum(a[k].n for k in used), sum(b[k].n for k in used), mean_a, mean_b, diff, var, len(used))


def msprt_log_lr(diff: float, var: float, theta0: float, tau: float) -> float:
    """log of the mixture likelihood ratio for "the true difference exceeds theta0" (one-sided mSPRT).

    The estimate diff ~ N(theta, var); the alternative theta = theta0 + delta mixes delta over a
    half-normal of scale tau (delta > 0). Integrating the Gaussian likelihood ratio gives
        Lambda = 2 sqrt(var / (var + tau^2)) Phi(x tau / sqrt(var (var + tau^2)))
                 exp(tau^2 x^2 / (2 var (var + tau^2))),
    x = diff - theta0. Seen as a process over the growing sample (information 1/var), every mixture
    component is a non-negative martingale under theta = theta0 (a supermartingale below it), so by
    Ville's inequality P(Lambda ever reaches 1/alpha) <= alpha: the test stays valid however often
    the gate looks (Johari et al., "Always valid inference", 2017; Robbins 1970). The variance is
    estimated (a plug-in), so the guarantee is asymptotic; `flywheel bench gate` measures it.
    """
    from scipy.special import log_ndtr

    if var <= 0.0:
        raise ValueError(f"msprt_log_lr: var must be > 0, got {var}")
    x = diff - theta0
    t2 = tau * tau
    return (math.log(2.0) + 0.5 * math.log(var / (var + t2)) + float(log_ndtr(x * tau / math.sqrt(var * (var + t2))))
            + t2 * x * x / (2.0 * var * (var + t2)))


def always_valid_p(log_lr: float) -> float:
    """The always-valid p-value of a mixture likelihood ratio: 1 / Lambda, capped at 1 (Ville's inequality)."""
    return min(1.0, math.exp(-log_lr))


@dataclass(frozen=True)
class SequentialDecision:
    """One look of the gate's two one-sided mSPRTs on a stratified difference (B minus A)."""

    estimate: Stratified
    margin: float
    log_lr_better: float  # evidence for diff > -margin (B better than A, or no worse than margin)
    log_lr_worse: float  # evidence for diff < 0 (B worse than A)
    threshold: float  # log(1 / alpha): a log LR at or above it decides

    @property
    def better(self) -> bool:
        return self.log_lr_better >= self.threshold

    @property
    def worse(self) -> bool:
        return self.log_lr_worse >= self.threshold

    @property
    def p_better(self) -> float:
        """Always-valid p-value of this look for "no better"."""
        return always_valid_p(self.log_lr_better)

    @property
    def p_worse(self) -> float:
        return always_valid_p(self.log_lr_worse)


def sequential_test(a: dict[str, Moments], b: dict[str, Moments], alpha: float, tau: float, margin: float = 0.0,
                    weights: dict[str, float] | None = None) -> SequentialDecision | None:
    """Is B better than A (by more than -margin), or worse than A? Each direction errs with probability <= alpha.

    None when no stratum has five sessions on each side yet (stratified: min_per_side).
    """
    est = stratified(a, b, weights)
    if est is None:
        return None
    return SequentialDecision(est, margin, msprt_log_lr(est.diff, est.var, -margin, tau),
                              msprt_log_lr(-est.diff, est.var, 0.0, tau), math.log(1.0 / alpha))


# ---------------------------------------------------------------------------------------------
# The gate's group-sequential test: a few looks planned in advance, alpha spent across them
# ---------------------------------------------------------------------------------------------
SPENDING = ("obf", "pocock")


def alpha_spent(t: float, alpha: float, spending: str) -> float:
    """Lan-DeMets spending function: the share of the one-sided alpha used up by information fraction t.

    obf: O'Brien-Fleming type, 2 - 2 Phi(z_{1 - alpha/2} / sqrt t): almost nothing early, nearly the whole alpha
    at the last look, so the last look's boundary is close to the fixed-sample one (most power at the planned size).
    pocock: alpha ln(1 + (e - 1) t): spent about evenly, so a large effect stops sooner and the last look costs more.
    """
    from scipy.stats import norm

    if t <= 0.0:
        return 0.0
    t = min(t, 1.0)
    if spending == "obf":
        return float(2.0 * norm.sf(norm.isf(alpha / 2.0) / math.sqrt(t)))
    if spending == "pocock":
        return alpha * math.log(1.0 + (math.e - 1.0) * t)
    raise ValueError(f"alpha_spent: spending {spending!r} is not one of {SPENDING}")


@functools.lru_cache(maxsize=64)
def group_sequential_bounds(fractions: tuple[float, ...], alpha: float, spending: str = "obf") -> tuple[float, ...]:
    """The z boundary of each look of a one-sided group-sequential test (Lan and DeMets 1983).

    At look k (information fraction t_k, increasing, the last 1) the standardised statistic Z_k crosses when
    Z_k >= b_k. Under the null, Z_k sqrt(t_k) is a Brownian motion at time t_k (independent increments), so
    b_k is set so that the probability of crossing first at look k is what the spending function adds between
    t_{k-1} and t_k: the chance of ever crossing is alpha(1) = alpha, however the effect turns out. Computed by
    the Armitage-McPherson-Rowe recursion: the density of the score on a grid, kept only where no earlier look
    crossed, convolved with the Gaussian increment to the next look.
    """
    import numpy as np
    from scipy.stats import norm

    assert (fractions and 0.0 < fractions[0] and all(a < b for a, b in zip(fractions, fractions[1:]))
            and fractions[-1] <= 1.0), \
        f"group_sequential_bounds: fractions must increase within (0, 1], got {fractions}"
    h = 0.004
    x = np.arange(-10.0, 10.0 + h / 2, h)  # the score S = Z sqrt(t); |S| < 10 covers t <= 1 to 1e-20
    bounds: list[float] = []
    density = None  # the score's sub-density at the last look, where no look has crossed
    spent, previous_t = 0.0, 0.0
    for t in fractions:
        step = t - previous_t
        if density is None:
            density = norm.pdf(x, scale=math.sqrt(t))
        else:
            half = int(math.ceil(8.0 * math.sqrt(step) / h))
            kernel = norm.pdf(np.arange(-half, half + 1) * h, scale=math.sqrt(step)) * h
            density = np.convolve(density, kernel, mode="same")
        target = alpha_spent(t, alpha, spending) - spent
        # tail[i]: P(S_t >= x[i], no earlier crossing), by the trapezoid rule (half of the first cell)
        tail = np.cumsum((density * h)[::-1])[::-1] - 0.5 * density * h
        if target <= 1e-12:
            bound = math.inf
        else:
            # tail decreases with x: interpolate the score at which it equals the target
            i = int(np.searchsorted(-tail, -target))
            i = min(max(i, 1), len(x) - 1)
            frac = (tail[i - 1] - target) / max(tail[i - 1] - tail[i], 1e-300)
            bound = float((x[i - 1] + frac * h) / math.sqrt(t))
        bounds.append(bound)
        if math.isfinite(bound):
            density = np.where(x >= bound * math.sqrt(t), 0.0, density)
            spent = alpha_spent(t, alpha, spending)
        previous_t = t
    return tuple(bounds)


@dataclass(frozen=True)
class GroupSequentialLook:
    """One planned look of the gate's two one-sided group-sequential tests on a stratified difference (B minus A)."""

    estimate: Stratified
    margin: float
    look: int  # 1-based
    looks: int
    z_better: float  # (diff + margin) / se: evidence for diff > -margin
    z_worse: float  # -diff / se: evidence for diff < 0
    bound: float  # this look's boundary for either direction

    @property
    def better(self) -> bool:
        return self.z_better >= self.bound

    @property
    def worse(self) -> bool:
        return self.z_worse >= self.bound


def group_sequential_look(a: dict[str, Moments], b: dict[str, Moments], look: int, bounds: tuple[float, ...],
                          margin: float = 0.0, weights: dict[str, float] | None = None) -> GroupSequentialLook | None:
    """Look `look` (1-based) of `bounds`: both one-sided z statistics of the stratified difference; None when no
    stratum has five sessions on each side."""
    est = stratified(a, b, weights)
    if est is None:
        return None
    se = math.sqrt(est.var)
    return GroupSequentialLook(est, margin, look, len(bounds), (est.diff + margin) / se, -est.diff / se,
                               bounds[look - 1])


# ---------------------------------------------------------------------------------------------
# Guardrails: non-inferiority of a metric where lower is better (errors, malformed calls, latency, cost)
# ---------------------------------------------------------------------------------------------
def _side_var(m: Moments) -> float:
    """One side's sample variance, floored as `_pooled_var` floors a pooled one (a 0/1 metric at the largest
    variance its smoothed mean allows): a side with no malformed call yet must not look infinitely precise."""
    if m.n < 1:
        return math.nan
    mean = m.total / m.n
    var = max(0.0, (m.squares - m.n * mean * mean) / max(m.n - 1, 1))
    if m.graded == 0 and abs(m.squares - m.total) <= 1e-9 * max(m.n, 1) and m.total >= -1e-9:
        smoothed = (m.total + 1.0) / (m.n + 2.0)  # every value 0 or 1
        return max(var, smoothed * (1.0 - smoothed))
    return max(var, VAR_FLOOR * max(1.0, mean * mean))  # a relative floor (cv 0.1) for counts such as tokens


@dataclass(frozen=True)
class NonInferiority:
    """B against A on a guardrail metric: is B no worse than A by `margin`?

    The contrast is c = limit - mean_b, where limit is mean_a + margin (absolute margin) or mean_a (1 + margin)
    (relative: at most `margin` more, e.g. 0.1 = ten percent more tokens). c > 0 is "not worse at the margin"; its
    variance is var_b / n_b + k^2 var_a / n_a with k = 1 or 1 + margin, so a relative margin is tested exactly as
    the linear hypothesis mean_b - (1 + margin) mean_a < 0 (no ratio estimator, no delta method).
    """

    n_a: int
    n_b: int
    mean_a: float
    mean_b: float
    margin: float
    relative: bool
    contrast: float  # limit - mean_b: > 0 when B is within the margin
    var: float  # variance of the contrast

    @property
    def limit(self) -> float:
        return self.mean_a * (1.0 + self.margin) if self.relative else self.mean_a + self.margin

    @property
    def z_ok(self) -> float:
        """Evidence that B is within the margin (non-inferior)."""
        return self.contrast / math.sqrt(self.var)

    @property
    def breach_contrast(self) -> float:
        """mean_b - limit: > 0 when B is beyond the margin."""
        return -self.contrast


def noninferiority(a: Moments, b: Moments, margin: float, relative: bool = False) -> NonInferiority | None:
    """The guardrail's contrast on two sides' moments (lower is better); None with fewer than two sessions a side."""
    if a.n < 2 or b.n < 2:
        return None
    k = 1.0 + margin if relative else 1.0
    limit = a.mean * k if relative else a.mean + margin
    var = _side_var(b) / b.n + k * k * _side_var(a) / a.n
    return NonInferiority(a.n, b.n, a.mean, b.mean, margin, relative, limit - b.mean, var)


# ---------------------------------------------------------------------------------------------
# Sample-ratio mismatch: an always-valid test of the arms' split
# ---------------------------------------------------------------------------------------------
SRM_CONCENTRATION = 100.0  # the mixture's Beta(c p0, c (1 - p0)): a prior sd of about 0.05 around a share of 0.5


@dataclass(frozen=True)
class RatioCheck:
    """The two arms' session counts against the split the router was told to make."""

    n_a: int
    n_b: int
    expected_b: float  # B's expected share of the two arms' sessions
    log_lr: float  # the mixture likelihood ratio of "the split is not expected_b", log
    threshold: float  # log(1 / alpha)

    @property
    def observed_b(self) -> float:
        total = self.n_a + self.n_b
        return self.n_b / total if total else math.nan

    @property
    def mismatch(self) -> bool:
        return self.log_lr >= self.threshold

    @property
    def p_value(self) -> float:
        """Always-valid p-value of "the split is as configured"."""
        return always_valid_p(self.log_lr)


def sample_ratio(n_a: int, n_b: int, expected_b: float, alpha: float,
                 concentration: float = SRM_CONCENTRATION) -> RatioCheck:
    """The sequential sample-ratio-mismatch test (Lindon and Malek 2022, "Anytime-valid inference for multinomial
    count data", for two arms: a beta-binomial mixture).

    Under the configured split each session lands on B with probability p0 = expected_b, independently (the router
    hashes session ids). The likelihood ratio of a Beta(c p0, c (1 - p0)) mixture over p against p0,
        Lambda_n = B(x + c p0, n - x + c (1 - p0)) / B(c p0, c (1 - p0)) / (p0^x (1 - p0)^(n - x)),
    is a non-negative martingale under p0, so by Ville's inequality P(Lambda ever reaches 1/alpha) <= alpha: the
    gate may check the split every round, for as long as it likes.
    """
    from scipy.special import betaln

    if not 0.0 < expected_b < 1.0:
        raise ValueError(f"sample_ratio: expected_b must be within (0, 1), got {expected_b}")
    x, n = n_b, n_a + n_b
    a0, b0 = concentration * expected_b, concentration * (1.0 - expected_b)
    log_lr = (float(betaln(x + a0, n - x + b0) - betaln(a0, b0))
              - x * math.log(expected_b) - (n - x) * math.log(1.0 - expected_b))
    return RatioCheck(n_a, n_b, expected_b, log_lr, math.log(1.0 / alpha))


# ---------------------------------------------------------------------------------------------
# Error over a stream of challengers
# ---------------------------------------------------------------------------------------------
def lord_gamma(j: int) -> float:
    """LORD's default spending sequence (Javanmard and Montanari 2018), gamma_j proportional to
    log(max(j, 2)) / (j e^sqrt(log j)); with this constant it sums to about 0.98 (at most 1 is what LORD needs)."""
    if j < 1:
        return 0.0
    return 0.07720838 * math.log(max(j, 2)) / (j * math.exp(math.sqrt(math.log(j))))


def lord_alpha(index: int, discoveries: list[int], alpha: float, w0: float | None = None) -> float:
    """LORD++ (Ramdas et al. 2017): the level of the `index`-th test (1-based) in a stream, given the indices of
    the earlier tests that rejected (here: challengers promoted).

        alpha_i = gamma_i W0 + (alpha - W0) gamma_{i - tau_1} + alpha sum_{j >= 2} gamma_{i - tau_j}

    Starting wealth W0 = alpha / 2. Under independence of the null p-values from each other and from the non-nulls
    this keeps the false discovery rate (the expected share of promotions that were of no-better challengers) at
    most alpha at every point of the stream; with no promotion at all, the levels sum to less than W0, so the chance
    of any false promotion over the whole stream stays below alpha / 2.
    """
    w0 = alpha / 2.0 if w0 is None else w0
    assert 0.0 < w0 <= alpha, f"lord_alpha: w0 {w0} must be within (0, alpha]"
    taus = sorted(t for t in discoveries if t < index)
    out = lord_gamma(index) * w0
    for k, tau in enumerate(taus):
        out += (alpha - w0 if k == 0 else alpha) * lord_gamma(index - tau)
    return out


def daily_alpha(index_in_day: int, alpha_day: float) -> float:
    """The level of the day's `index_in_day`-th challenger (1-based) under an alpha budget per day: alpha_day
    6 / (pi^2 i^2), which sums to alpha_day, so the chance of any false promotion in a day is at most alpha_day
    (a union bound: no independence needed)."""
    assert index_in_day >= 1
    return alpha_day * 6.0 / (math.pi ** 2 * index_in_day ** 2)
