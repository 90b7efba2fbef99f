"""The promotion gate's decision rule, as pure functions: what it compares, and when the evidence suffices.

serving/promote.py reads the lake and the registry, calls these, and applies the result;
`flywheel bench gate` calls the same functions on simulated session streams to measure the
rule's error rates, so what is measured is what runs.

What is compared (`concurrent`): sessions served at the same time. The challenger's sessions
(arm challenger, served by the challenger) against the champion's (arm champion) that started at
or after the challenger's first session, both counted only once their outcome window has closed
(`maturity_s` after the session ended), without sessions that ended in an infrastructure error
or never got the outcome (both counted apart, in the decision's numbers). Rewards are the
session's outcome (the verifier's task_success by default), grouped by task type.

The test (`decide`): a stratified difference of means (task types weighted by their pooled share,
or a fixed mix), tested in both one-sided directions: "the challenger is better than the champion
by more than -margin" promotes, "the challenger is worse" rejects. Two tests, `GateRule.test`:

- msprt: two mixture SPRTs (serving/stats.py). Valid at every look with no planned size, so the
  gate may look every few seconds for as long as it likes and each direction still errs with
  probability at most alpha. The price: at n sessions a side it needs a difference of about 3
  standard errors (k's v2 in docs/experiments.md: +5.4 points at ~280 a side, not enough).
- group-sequential: looks planned in advance at max_sessions * k / looks sessions a side; at each,
  the first n sessions of each side in the order they matured (so a look is replayed exactly by
  every later round, and the gate may poll as often as it likes: only a planned size is a look)
  are compared with a z boundary from Lan-DeMets alpha spending (serving/stats.py). Traffic decides
  when a look comes, not how many sessions it holds, so the information fractions are known in
  advance. The last look's boundary is near the fixed-sample one (about 1.7 standard errors at
  three looks, O'Brien-Fleming type spending): at the demo's ~250 sessions a side it has about twice
  the mSPRT's power at +5 points. A test cut short (a newer version replaces the challenger before
  its last look) only spends less alpha. The variance is a plug-in, so the guarantee is
  asymptotic; `flywheel bench gate` measures it either way.

A fixed-sample test re-run every round would be valid neither way (with 17 challengers the old gate
"found" a better champion in 9-11% of null runs). A challenger that reaches `max_sessions` (msprt)
or its last look (group-sequential) without deciding expires: not promoted; its evidence was not
enough, which is not evidence that it is worse.

Rollback (`decide_rollback`) runs the mSPRT, whatever the promotion test, on the champion's sessions
since its promotion against the control arm's, concurrent: a champion significantly worse than the
control is rolled back. A champion is watched for as long as it serves, with no planned size, which is
what an always-valid test is for. So is the error-rate guard below.

Excluding infrastructure errors from the comparison is not a blind spot: the same test runs on the
share of sessions that ended in an error, and a challenger that errs significantly more is rejected.
alpha is per challenger: over a run of k challengers the chance that at least one no-better
challenger is promoted is up to 1 - (1 - alpha)^k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Iterable, Literal

from flywheel.base.config import ConfigError, check_choices, setting
from flywheel.serving.sessions import ERROR_STATUSES, SessionRecord, mature
from flywheel.serving.stats import (
    GroupSequentialLook,
    Moments,
    SequentialDecision,
    group_sequential_bounds,
    group_sequential_look,
    sequential_test,
)

Test = Literal["msprt", "group-sequential"]
Spending = Literal["obf", "pocock"]  # serving/stats.py alpha_spent


@dataclass
class GateRule:
    """The gate's statistical rule (shared by `flywheel promote` and `flywheel bench gate`)."""

    RECIPE_SECTION: ClassVar[str] = "gate"  # `flywheel promote --recipe tool_use` reads the recipe's [gate]

    alpha: float = setting(0.05, "error rate of each one-sided sequential test (false promotion, false rejection, "
                                 "false rollback)")
    tau: float = setting(0.1, "scale of the mSPRT's mixture over effect sizes, in outcome units: the test is most "
                              "sensitive to differences of about this size (0.1: ten points of success)")
    margin: float = setting(0.0, "non-inferiority margin: promote when the challenger is better than the champion "
                                 "minus this (0: it must be better)")
    min_sessions: int = setting(30, "sessions each side needs before the first look (the normal "
                                    "approximation needs some)")
    max_sessions: int = setting(1000, "challenger sessions after which an undecided challenger expires (not promoted)")
    maturity_s: float = setting(60.0, "seconds after a session ends before it counts: its outcome window has closed")
    outcome_kind: str = setting("task_success", "the outcome kind the gate compares (a session's latest value of it)")
    error_statuses: list[str] = setting(list(ERROR_STATUSES), "session_end statuses that mean an infrastructure error: "
                                                              "excluded, counted apart")
    strata_weights: dict[str, float] = setting({}, "fixed task-type mix, e.g. tool_use.add=0.3,tool_use.weather=0.7 "
                                                   "(empty: each type's share of both arms' sessions)")
    test: Test = setting("msprt", "the promotion test: msprt (always valid at every look, no planned size) or "
                                 "group-sequential (looks planned at max_sessions * k / looks sessions a side, alpha "
                                 "spent across them: more power at the planned size; serving/decision.py says when)")
    looks: int = setting(3, "group-sequential: planned looks, equally spaced in sessions per side up to max_sessions")
    spending: Spending = setting("obf", "group-sequential: the alpha-spending function, obf (O'Brien-Fleming type: "
                                   "most power at the last look) or pocock (stops sooner on large effects)")

    def check(self) -> None:
        self.check_rule()

    def check_rule(self) -> None:
        if not 0.0 < self.alpha < 0.5:
            raise ConfigError(f"alpha: {self.alpha} is not within (0, 0.5)")
        if not self.tau > 0.0:
            raise ConfigError(f"tau: {self.tau} must be > 0")
        if not self.margin >= 0.0:
            raise ConfigError(f"margin: {self.margin} must be >= 0")
        if self.min_sessions < 2:
            raise ConfigError(f"min_sessions: {self.min_sessions} < 2; a variance needs two sessions per side")
        if self.max_sessions < self.min_sessions:
            raise ConfigError(f"max_sessions ({self.max_sessions}) < min_sessions ({self.min_sessions})")
        if self.maturity_s < 0:
            raise ConfigError(f"maturity_s: {self.maturity_s} must be >= 0")
        if any(w < 0 for w in self.strata_weights.values()):
            raise ConfigError(f"strata_weights: negative weight in {self.strata_weights}")
        check_choices(self)
        if self.test == "group-sequential":
            if self.looks < 1:
                raise ConfigError(f"looks: {self.looks} must be >= 1")
            if self.look_sizes()[0] < self.min_sessions:
                raise ConfigError(f"looks ({self.looks}) and max_sessions ({self.max_sessions}): the first look at "
                                  f"{self.look_sizes()[0]} sessions a side comes before min_sessions "
                                  f"({self.min_sessions})")

    def look_sizes(self) -> list[int]:
        """Group-sequential: sessions per side at each planned look, the last at max_sessions."""
        return [math.ceil(self.max_sessions * k / self.looks) for k in range(1, self.looks + 1)]

    def bounds(self) -> tuple[float, ...]:
        """Group-sequential: each look's z boundary (either direction), from the spending function."""
        return group_sequential_bounds(tuple(n / self.max_sessions for n in self.look_sizes()), self.alpha,
                                       self.spending)


@dataclass
class Evidence:
    """Concurrent, mature sessions of a baseline side (a) and a tested side (b), per task type."""

    a: dict[str, Moments] = field(default_factory=dict)
    b: dict[str, Moments] = field(default_factory=dict)
    since: float | None = None  # the concurrent window starts here (epoch seconds)
    excluded: dict[str, int] = field(default_factory=dict)  # errored_a, unlabelled_b, open ...
    # each side's sessions in the order their outcome windows closed: a group-sequential look at n sessions a
    # side reads the first n of each, so a later round replays an earlier look exactly
    order_a: list[tuple[str, float]] = field(default_factory=list)
    order_b: list[tuple[str, float]] = field(default_factory=list)
    _first: dict[int, tuple[dict[str, Moments], dict[str, Moments]]] = field(default_factory=dict, repr=False,
                                                                              compare=False)

    @property
    def n_a(self) -> int:
        return sum(m.n for m in self.a.values())

    @property
    def n_b(self) -> int:
        return sum(m.n for m in self.b.values())

    def add(self, side: str, task_type: str, value: float) -> None:
        table = self.a if side == "a" else self.b
        table[task_type] = table.get(task_type, Moments()).add(value)
        (self.order_a if side == "a" else self.order_b).append((task_type, value))

    def first(self, n: int) -> tuple[dict[str, Moments], dict[str, Moments]]:
        """The moments of each side's first n sessions (in the order they matured)."""
        if n in self._first:
            return self._first[n]
        out: tuple[dict[str, Moments], dict[str, Moments]] = ({}, {})
        for table, order in zip(out, (self.order_a, self.order_b)):
            for task_type, value in order[:n]:
                table[task_type] = table.get(task_type, Moments()).add(value)
        if min(len(self.order_a), len(self.order_b)) >= n:  # sessions are only appended: a full prefix never changes
            self._first[n] = out
        return out


@dataclass
class Verdict:
    """What the rule says: promote | reject | expire | hold (challenger), rollback | keep (champion)."""

    action: str
    reason: str
    numbers: dict[str, float] = field(default_factory=dict)


def _side(records: Iterable[SessionRecord], version: int, arm: str) -> list[SessionRecord]:
    return [r for r in records if r.version == version and r.arm == arm]


def concurrent(records: list[SessionRecord], a: tuple[int, str], b: tuple[int, str], now: float, rule: GateRule,
               since: float | None = None) -> Evidence:
    """Evidence for b against a: (version, arm) each; sessions that started at or after the later of
    `since` and b's first session, whose outcome window has closed at `now`."""
    side_a, side_b = _side(records, *a), _side(records, *b)
    start = min((r.started for r in side_b), default=None)
    if start is None:
        return Evidence(since=since)
    if since is not None:
        start = max(start, since)
    ev = Evidence(since=start)
    for name, side in (("a", side_a), ("b", side_b)):
        split = mature([r for r in side if r.started >= start], now, rule.maturity_s, rule.error_statuses)
        # the order their outcome windows closed in (maturity_s after the end): a session that matures later
        # is appended later, so the first n of a side stay the first n at every later round
        for r in sorted(split.counted, key=lambda r: (r.ended or 0.0, r.started, r.session_id)):
            ev.add(name, r.task_type, float(r.outcome))  # type: ignore[arg-type]
        ev.excluded.update({f"errored_{name}": split.errored, f"unlabelled_{name}": split.unlabelled,
                            f"open_{name}": split.open})
    return ev


def _numbers(ev: Evidence, test: SequentialDecision | None, rule: GateRule) -> dict[str, float]:
    out: dict[str, float] = {"n_a": ev.n_a, "n_b": ev.n_b, "alpha": rule.alpha, "tau": rule.tau, "margin": rule.margin,
                             "threshold_log_lr": math.log(1.0 / rule.alpha), "min_sessions": rule.min_sessions,
                             "max_sessions": rule.max_sessions}
    out.update({k: float(v) for k, v in ev.excluded.items()})
    if ev.since is not None:
        out["window_since"] = ev.since
    if test is not None:
        e = test.estimate
        out.update({"mean_a": e.mean_a, "mean_b": e.mean_b, "diff": e.diff, "se": math.sqrt(e.var), "strata": e.strata,
                    "log_lr_better": test.log_lr_better, "log_lr_worse": test.log_lr_worse,
                    "p_better": test.p_better, "p_worse": test.p_worse})
    return out


def _gs_numbers(ev: Evidence, look: GroupSequentialLook | None, rule: GateRule) -> dict[str, float]:
    out = _numbers(ev, None, rule)
    out.update({"looks": rule.looks, "looks_reached": sum(n <= min(ev.n_a, ev.n_b) for n in rule.look_sizes())})
    if look is not None:
        e = look.estimate
        out.update({"look": look.look, "look_sessions": rule.look_sizes()[look.look - 1], "mean_a": e.mean_a,
                    "mean_b": e.mean_b, "diff": e.diff, "se": math.sqrt(e.var), "strata": e.strata,
                    "z_better": look.z_better, "z_worse": look.z_worse, "z_bound": look.bound})
    return out


def _decide_group_sequential(ev: Evidence, rule: GateRule) -> Verdict:
    """The planned looks the evidence has reached, in order, each on the first n sessions of each side: the first
    that crosses a boundary decides; all looks without a crossing: expire; looks still to come: hold."""
    bounds, sizes = rule.bounds(), rule.look_sizes()
    weights = rule.strata_weights or None
    last: GroupSequentialLook | None = None
    for k, n in enumerate(sizes, start=1):
        if min(ev.n_a, ev.n_b) < n:
            break
        a, b = ev.first(n)
        look = group_sequential_look(a, b, k, bounds, rule.margin, weights)
        if look is None:
            continue
        last = look
        e = look.estimate
        text = (f"look {k} of {len(sizes)} at {n} sessions a side: challenger {e.mean_b:.3f} vs champion "
                f"{e.mean_a:.3f}, diff {e.diff:+.3f} +- {1.96 * math.sqrt(e.var):.3f}")
        if look.worse:
            return Verdict("reject", f"worse: {text}; z {look.z_worse:.2f} >= {look.bound:.2f}",
                           _gs_numbers(ev, look, rule))
        if look.better:
            return Verdict("promote", f"better{'' if not rule.margin else f' than champion - {rule.margin}'}: {text}; "
                           f"z {look.z_better:.2f} >= {look.bound:.2f}", _gs_numbers(ev, look, rule))
    numbers = _gs_numbers(ev, last, rule)
    if min(ev.n_a, ev.n_b) >= sizes[-1]:
        return Verdict("expire", f"undecided at the last of {len(sizes)} looks ({sizes[-1]} sessions a side)", numbers)
    if ev.n_b >= sizes[-1] + rule.max_sessions:
        # the champion's side never reached the last look: the cap keeps a challenger from holding for ever
        return Verdict("expire", f"the champion had {ev.n_a} concurrent sessions after the challenger's {ev.n_b}: the "
                       f"last look ({sizes[-1]} a side) was not reached", numbers)
    reached = (f"look {last.look}: z {last.z_better:.2f} (better) / {last.z_worse:.2f} (worse) < {last.bound:.2f}; "
               if last else "")
    return Verdict("hold", f"undecided: {reached}next look at {next(n for n in sizes if n > min(ev.n_a, ev.n_b))} "
                   f"sessions a side (champion {ev.n_a}, challenger {ev.n_b})", numbers)


def _error_test(ev: Evidence, rule: GateRule) -> SequentialDecision | None:
    """The same sequential test on "the session ended in an error" (b against a): excluding errored sessions from
    the comparison must not let a version that causes them look good on the sessions it did not break."""
    counts = []
    for side in ("a", "b"):
        errored = ev.excluded.get(f"errored_{side}", 0)
        n = errored + (ev.n_a if side == "a" else ev.n_b)
        counts.append(Moments(n, float(errored), float(errored)))  # an indicator is its own square
    if min(m.n for m in counts) < rule.min_sessions:
        return None
    return sequential_test({"all": counts[0]}, {"all": counts[1]}, rule.alpha, rule.tau)


def decide(ev: Evidence, rule: GateRule) -> Verdict:
    """The challenger (b) against the champion (a): promote, reject, expire or hold."""
    weights = rule.strata_weights or None
    errors = _error_test(ev, rule)
    if errors is not None and errors.better:  # "better" here: a higher error rate on the challenger's side
        return Verdict("reject", f"more sessions ended in an error: challenger {ev.excluded.get('errored_b', 0)} of "
                       f"{errors.estimate.n_b}, champion {ev.excluded.get('errored_a', 0)} of {errors.estimate.n_a}; "
                       f"log LR {errors.log_lr_better:.2f} >= {errors.threshold:.2f}", _numbers(ev, None, rule))
    if ev.n_a < rule.min_sessions or ev.n_b < rule.min_sessions:
        # the cap first: a champion with no concurrent sessions must not keep a challenger on hold for ever
        action = "expire" if ev.n_b >= rule.max_sessions else "hold"
        return Verdict(action, f"too few mature concurrent sessions: champion {ev.n_a}, challenger {ev.n_b}, need "
                       f"{rule.min_sessions} each", _numbers(ev, None, rule))
    if rule.test == "group-sequential":
        return _decide_group_sequential(ev, rule)
    test = sequential_test(ev.a, ev.b, rule.alpha, rule.tau, rule.margin, weights)
    numbers = _numbers(ev, test, rule)
    if test is None:
        action = "expire" if ev.n_b >= rule.max_sessions else "hold"
        return Verdict(action, "no task type has enough sessions on both sides yet", numbers)
    e = test.estimate
    text = (f"challenger {e.mean_b:.3f} (n {e.n_b}) vs champion {e.mean_a:.3f} (n {e.n_a}), diff {e.diff:+.3f} "
            f"+- {1.96 * math.sqrt(e.var):.3f}")
    if test.worse:
        return Verdict("reject", f"worse: {text}; log LR {test.log_lr_worse:.2f} >= {test.threshold:.2f}", numbers)
    if test.better:
        return Verdict("promote", f"better{'' if not rule.margin else f' than champion - {rule.margin}'}: {text}; "
                       f"log LR {test.log_lr_better:.2f} >= {test.threshold:.2f}", numbers)
    if ev.n_b >= rule.max_sessions:
        return Verdict("expire", f"undecided after {ev.n_b} >= {rule.max_sessions} sessions: {text}", numbers)
    return Verdict("hold", f"undecided: {text}; log LR {test.log_lr_better:.2f} (better) / {test.log_lr_worse:.2f} "
                   f"(worse) < {test.threshold:.2f}", numbers)


def decide_rollback(ev: Evidence, rule: GateRule) -> Verdict:
    """The champion (b) against the concurrent control (a): rollback when it is significantly worse."""
    if ev.n_a < rule.min_sessions or ev.n_b < rule.min_sessions:
        return Verdict("keep", f"too few mature sessions since the promotion: control {ev.n_a}, champion {ev.n_b}",
                       _numbers(ev, None, rule))
    test = sequential_test(ev.a, ev.b, rule.alpha, rule.tau, 0.0, rule.strata_weights or None)
    numbers = _numbers(ev, test, rule)
    if test is None:
        return Verdict("keep", "no task type has enough sessions on both sides yet", numbers)
    e = test.estimate
    text = f"champion {e.mean_b:.3f} (n {e.n_b}) vs control {e.mean_a:.3f} (n {e.n_a})"
    if test.worse:
        return Verdict("rollback", f"worse than the control: {text}; log LR {test.log_lr_worse:.2f} >= "
                       f"{test.threshold:.2f}", numbers)
    return Verdict("keep", f"holds: {text}; log LR (worse) {test.log_lr_worse:.2f} < {test.threshold:.2f}", numbers)
