"""The gate's guardrails: non-inferiority tests on what a reward-hacking policy moves first.

A challenger is promoted only when the primary metric (task success) is better AND every guardrail
is shown to be no worse than the champion's by more than its margin (serving/decision.py applies the
rule; docs/serving.md states it as a formula). Each guardrail is its own one-sided test of
    H0_g: the challenger is worse than the champion by at least margin_g
at the gate's alpha, with the primary test's machinery (the same looks and boundaries under the
group-sequential test, an always-valid mixture SPRT under msprt). Promotion needs every H0 rejected,
so a false promotion (promoting while any H0 holds) needs at least that one test to err: the error of
the whole rule is at most alpha with no split of alpha between the tests (Berger's intersection-union
principle, 1982). The price is power: each guardrail must also be shown, so margins are set wide
enough that a challenger equal to the champion shows them at the demo's traffic (`flywheel bench gate`
measures the power of the whole rule).

The guardrails (their margins in `GateRule.guardrails`; leave one out to switch it off):

  errors     share of sessions that ended in an infrastructure error        points (0.02: two points)
  malformed  share of tool calls the harness could not parse                  points
  slow       share of sessions slower than the champion's 95th percentile    points (the champion's is about 5%)
  tokens     prompt + completion tokens per session (cost)                   relative (0.2: 20% more)
  judge      the LLM judge's score of the session (higher is better)         score points
  offline    the offline task set's greedy success (serving/evaluate.py)     points; a fixed-sample test

Latency is guarded at the tail, as a share beyond the champion's p95: the champion's own share is 5%
by construction, and the test is Mood's quantile test with a margin. `judge` applies only once both
sides have min_sessions judged sessions (the judge, not the policy, decides which are judged); the
others apply whenever the sessions carry them. A guardrail that does not apply does not block.
A guardrail shown *breached* (worse beyond its margin, at the same alpha) rejects a challenger and
rolls back a champion against the control.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from flywheel.serving.stats import Moments, NonInferiority, msprt_log_lr, noninferiority

if TYPE_CHECKING:
    from flywheel.serving.sessions import SessionRecord

# name -> whether its margin is relative; every test runs on a lower-is-better value (the judge's score negated,
# the offline set's failures), and `shown` turns it back into the metric people read
GUARDRAILS: dict[str, bool] = {"errors": False, "malformed": False, "slow": False, "tokens": True, "judge": False,
                               "offline": False}
ONLINE = ("malformed", "slow", "tokens", "judge")  # read per session from the look's sessions (malformed: a ratio)
SLOW_QUANTILE = 0.95


@dataclass(frozen=True)
class GuardValues:
    """One session's guardrail metrics."""

    malformed: int = 0  # malformed tool calls
    latency_s: float | None = None
    tokens: int | None = None  # None: the session made no llm_call (or the record does not say)
    judge: float | None = None
    tool_calls: int = 0  # all tool calls, malformed or not

    @staticmethod
    def of(r: "SessionRecord") -> "GuardValues":
        return GuardValues(r.malformed, r.latency_s, r.tokens, r.judge, max(r.tool_calls, r.malformed))


@dataclass(frozen=True)
class GuardCheck:
    """One guardrail at one look: the test, whether it is shown within its margin and whether it is breached."""

    name: str
    margin: float
    test: NonInferiority | None  # None: does not apply (too few sessions carry the metric)
    statistic: float  # evidence that the challenger is within the margin: z, or a log LR
    breach_statistic: float  # evidence that it is beyond the margin
    threshold: float  # the look's z boundary, or log(1 / alpha)
    kind: str  # "z" or "log_lr"
    note: str = ""

    @property
    def applies(self) -> bool:
        return self.test is not None

    @property
    def ok(self) -> bool:
        return self.test is not None and self.statistic >= self.threshold

    @property
    def breach(self) -> bool:
        return self.test is not None and self.breach_statistic >= self.threshold

    def shown(self, value: float) -> float:
        """A tested (lower-is-better) value as the metric reads: the judge's score, the offline success."""
        return -value if self.name == "judge" else 1.0 - value if self.name == "offline" else value

    def describe(self) -> str:
        if self.test is None:
            return f"{self.name}: n/a ({self.note or 'too few sessions carry it'})"
        t = self.test
        margin = f"{t.margin:.0%} more" if t.relative else f"{t.margin:g}"
        return (f"{self.name}: challenger {self.shown(t.mean_b):.4g} vs champion {self.shown(t.mean_a):.4g} (margin "
                f"{margin}{'; ' + self.note if self.note else ''}), {self.kind} {self.statistic:.2f} "
                f"{'>=' if self.ok else '<'} {self.threshold:.2f}{' BREACHED' if self.breach else ''}")

    def numbers(self) -> dict[str, float]:
        key = f"guard_{self.name}_"
        out = {key + "margin": self.margin, key + "applies": float(self.applies)}
        if self.test is not None:
            a, b, half = self.shown(self.test.mean_a), self.shown(self.test.mean_b), 1.96 * math.sqrt(self.test.var)
            out.update({key + "diff": b - a, key + "ci_low": b - a - half, key + "ci_high": b - a + half})
            out.update({key + "a": a, key + "b": b,
                        key + "n_a": float(self.test.n_a), key + "n_b": float(self.test.n_b),
                        key + "se": math.sqrt(self.test.var), key + "stat": self.statistic,
                        key + "breach_stat": self.breach_statistic, key + "threshold": self.threshold,
                        key + "ok": float(self.ok), key + "breach": float(self.breach)})
        return out


def _quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ratio(values: Sequence[GuardValues]) -> tuple[int, float, float] | None:
    """(sessions, share of tool calls malformed, its variance): a ratio of sums over sessions, whose variance is the
    linearised one over sessions (calls of one session are not independent), floored at the binomial variance of
    the calls with half a malformed call added (no call malformed yet must not look certain)."""
    n = len(values)
    calls = sum(v.tool_calls for v in values)
    if n < 2 or calls == 0:
        return None
    bad = sum(v.malformed for v in values)
    share, mean_calls = bad / calls, calls / n
    linear = sum((v.malformed - share * v.tool_calls) ** 2 for v in values) / (n * (n - 1) * mean_calls ** 2)
    smoothed = (bad + 0.5) / (calls + 1.0)
    return n, share, max(linear, smoothed * (1.0 - smoothed) / calls)


def malformed_test(a: Sequence[GuardValues], b: Sequence[GuardValues], margin: float) -> NonInferiority | None:
    """The malformed-call share, challenger against champion: share_b <= share_a + margin."""
    ra, rb = _ratio(a), _ratio(b)
    if ra is None or rb is None:
        return None
    return NonInferiority(ra[0], rb[0], ra[1], rb[1], margin, False, ra[1] + margin - rb[1], ra[2] + rb[2])


def _smoothed(count: int, n: int) -> float:
    return (count + 0.5) / (n + 1.0)


def slow_test(a: Sequence[GuardValues], b: Sequence[GuardValues], margin: float
              ) -> tuple[NonInferiority | None, str]:
    """The share of sessions beyond the champion's p95 latency q, challenger against champion (Mood's quantile test
    with a margin): share_b <= share_a + margin.

    q is estimated from the champion's own sessions, and that noise reaches the challenger's share through the
    ratio of the two latency densities at q: var(share_b - share_a) = p_b (1 - p_b) / n_b
    + r^2 p_a (1 - p_a) / n_a, r = f_b(q) / f_a(q). r is 1 when the two are alike and about 1.8 at an 11% share
    beyond q; taking it as 1 made the test show a challenger at its margin 8.5% of the time at a 5% level. r is
    estimated from each side's share of sessions between the champion's 90th and 99th percentiles."""
    la = sorted(v.latency_s for v in a if v.latency_s is not None)
    lb = [v.latency_s for v in b if v.latency_s is not None]
    if len(la) < 2 or len(lb) < 2:
        return None, ""
    q = _quantile(la, SLOW_QUANTILE)
    low, high = _quantile(la, 0.90), _quantile(la, 0.99)
    n_a, n_b = len(la), len(lb)
    p_a = sum(x > q for x in la) / n_a
    p_b = sum(x > q for x in lb) / n_b
    r = (_smoothed(sum(low <= x <= high for x in lb), n_b) / _smoothed(sum(low <= x <= high for x in la), n_a))
    sa, sb = _smoothed(round(p_a * n_a), n_a), _smoothed(round(p_b * n_b), n_b)
    var = max(p_b * (1 - p_b), sb * (1 - sb)) / n_b + r * r * max(p_a * (1 - p_a), sa * (1 - sa)) / n_a
    return (NonInferiority(n_a, n_b, p_a, p_b, margin, False, p_a + margin - p_b, var),
            f"beyond the champion's p95 {q:.3g} s")


def guard_moments(name: str, a: Sequence[GuardValues], b: Sequence[GuardValues]) -> tuple[Moments, Moments]:
    """Each side's moments of a mean guardrail (tokens, judge) in lower-is-better units."""
    if name == "tokens":
        return (Moments.of([float(v.tokens) for v in a if v.tokens is not None]),
                Moments.of([float(v.tokens) for v in b if v.tokens is not None]))
    if name == "judge":
        return (Moments.of([-v.judge for v in a if v.judge is not None]),
                Moments.of([-v.judge for v in b if v.judge is not None]))
    raise ValueError(f"guard_moments: {name!r} is not a mean guardrail (tokens, judge)")


def _test(name: str, a: Moments, b: Moments, margin: float, min_sessions: int) -> NonInferiority | None:
    if min(a.n, b.n) < max(2, min_sessions if name == "judge" else 2):
        return None
    return noninferiority(a, b, margin, GUARDRAILS[name])


def online_test(name: str, margin: float, a: Sequence[GuardValues], b: Sequence[GuardValues],
                min_sessions: int) -> tuple[NonInferiority | None, str]:
    """Guardrail `name` on two sides' sessions: its contrast and variance (None: it does not apply), and a note."""
    if name == "malformed":
        t = malformed_test(a, b, margin)
        return t, "" if t is not None else "no tool calls"
    if name == "slow":
        return slow_test(a, b, margin)
    if name in ("tokens", "judge"):
        return _test(name, *guard_moments(name, a, b), margin, min_sessions), ""
    raise ValueError(f"online_test: {name!r} is not an online guardrail ({ONLINE})")


def _z_check(name: str, margin: float, t: NonInferiority | None, bound: float, note: str = "") -> GuardCheck:
    """A guardrail's z statistics (within the margin, beyond it) against a z boundary; n/a without a test."""
    if t is None:
        return GuardCheck(name, margin, None, math.nan, math.nan, bound, "z", note)
    return GuardCheck(name, margin, t, t.z_ok, -t.z_ok, bound, "z", note)


def check_at_look(name: str, margin: float, a: Sequence[GuardValues], b: Sequence[GuardValues], bound: float,
                  min_sessions: int) -> GuardCheck:
    """Group-sequential: the guardrail's z statistics on one look's sessions, against that look's boundary."""
    t, note = online_test(name, margin, a, b, min_sessions)
    return _z_check(name, margin, t, bound, note)


def check_z(name: str, margin: float, a: Moments, b: Moments, bound: float, min_sessions: int) -> GuardCheck:
    """Group-sequential, on moments: the guardrail's z statistics against one look's boundary."""
    return _z_check(name, margin, _test(name, a, b, margin, min_sessions), bound)


def _tau(t: NonInferiority) -> float:
    """The mixture's scale: differences of about the margin (relative: in the metric's units), never zero."""
    scale = t.margin * abs(t.mean_a) if t.relative else t.margin
    return max(scale, 1e-3, 0.01 * abs(t.mean_a))


def check_always_valid(name: str, margin: float, a: Moments, b: Moments, alpha: float,
                       min_sessions: int, note: str = "", test: NonInferiority | None = None) -> GuardCheck:
    """The guardrail's two one-sided mixture SPRTs (serving/stats.py): valid at any look, with no planned size."""
    threshold = math.log(1.0 / alpha)
    t = test if test is not None else _test(name, a, b, margin, min_sessions)  # a test given: a ratio, a quantile
    if t is None:
        return GuardCheck(name, margin, None, math.nan, math.nan, threshold, "log_lr", note)
    tau = _tau(t)
    return GuardCheck(name, margin, t, msprt_log_lr(t.contrast, t.var, 0.0, tau),
                      msprt_log_lr(t.breach_contrast, t.var, 0.0, tau), threshold, "log_lr", note)


def check_online_always_valid(name: str, margin: float, a: Sequence[GuardValues], b: Sequence[GuardValues],
                              alpha: float, min_sessions: int) -> GuardCheck:
    t, note = online_test(name, margin, a, b, min_sessions)
    return check_always_valid(name, margin, Moments(), Moments(), alpha, min_sessions, note, t) if t is not None \
        else GuardCheck(name, margin, None, math.nan, math.nan, math.log(1.0 / alpha), "log_lr", note)


def error_moments(errored: int, counted: int) -> Moments:
    """The error share as moments: an indicator is its own square."""
    return Moments(errored + counted, float(errored), float(errored))


def check_offline(margin: float, successes_a: int, n_a: int, successes_b: int, n_b: int, alpha: float) -> GuardCheck:
    """The offline task set as a guardrail: one fixed-sample test (greedy scores do not change between rounds), the
    challenger's success no lower than the champion's minus the margin, at z_{1 - alpha}."""
    from scipy.stats import norm

    bound = float(norm.isf(alpha))
    if n_a < 2 or n_b < 2:
        return GuardCheck("offline", margin, None, math.nan, math.nan, bound, "z", "no offline scores")
    # failures as the lower-is-better metric: the same contrast as every other guardrail
    a = Moments(n_a, float(n_a - successes_a), float(n_a - successes_a))
    b = Moments(n_b, float(n_b - successes_b), float(n_b - successes_b))
    t = noninferiority(a, b, margin)
    assert t is not None
    return _z_check("offline", margin, t, bound)
