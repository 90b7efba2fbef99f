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
what an always-valid test is for. The guardrails are watched the same way.

Guardrails (serving/guardrails.py): the rule is one formula, promote iff the split is the router's
(the sample-ratio check, `stats.sample_ratio`) AND the primary test says better AND every guardrail
(errors, malformed calls, tail latency, tokens, the judge's score, optionally the offline set) is
shown within its margin, each test at alpha; a guardrail shown beyond its margin rejects (and rolls
back a champion against the control). Excluding infrastructure errors from the comparison is not a
blind spot: the error share is a guardrail. Promoting needs every one of those tests to reject its
null, so the rule's chance of a false promotion is at most alpha with no split of alpha (Berger's
intersection-union principle); `flywheel bench gate` measures it with every guardrail at its margin.

alpha is per challenger: over k challengers the chance that at least one no-better challenger is
promoted is up to 1 - (1 - alpha)^k. `GateRule.stream` (lord, daily) sets each challenger's level from
the stream instead (serving/promote.py `stream_alpha`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import ClassVar, Iterable, Literal

from flywheel.base.config import ConfigError, check_choices, setting
from flywheel.serving import guardrails
from flywheel.serving.guardrails import GuardCheck, GuardValues
from flywheel.serving.sessions import ERROR_STATUSES, SessionRecord, mature
from flywheel.serving.stats import (
    GroupSequentialLook,
    Moments,
    RatioCheck,
    SequentialDecision,
    group_sequential_bounds,
    group_sequential_look,
    sample_ratio,
    sequential_test,
)

Test = Literal["msprt", "group-sequential"]
Spending = Literal["obf", "pocock"]  # serving/stats.py alpha_spent
Stream = Literal["per-challenger", "lord", "daily"]  # error over a stream of challengers (serving/promote.py)
# what a team would set out of the box (infra/recipes/tool_use.toml says why each): the margins are what the
# deployment tolerates, fixed before any run; `flywheel bench gate` measures the whole rule's power with them
DEFAULT_GUARDRAILS = {"errors": 0.02, "malformed": 0.04, "slow": 0.06, "tokens": 0.25, "judge": 0.5}


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
    guardrails: dict[str, float] = setting(dict(DEFAULT_GUARDRAILS), "guardrail -> non-inferiority margin: errors, "
                                           "malformed, slow (shares, in points), tokens (relative), judge (score "
                                           "points), offline (points); each must be shown no worse than the champion "
                                           "by its margin (serving/guardrails.py); leave one out to switch it off")
    srm_alpha: float = setting(0.05, "error rate of the sample-ratio check (always valid, every round): a split "
                                     "unlike the router's shares voids the test (0: no check, for arms this "
                                     "project's router does not assign)")
    stream: Stream = setting("per-challenger", "error over a stream of challengers: per-challenger (alpha each), "
                                               "lord (LORD++ online FDR at alpha) or daily (at most alpha of any "
                                               "false promotion per UTC day)")

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
        unknown = sorted(set(self.guardrails) - set(guardrails.GUARDRAILS))
        if unknown:
            raise ConfigError(f"guardrails: unknown {unknown}; known: {sorted(guardrails.GUARDRAILS)}")
        if any(not m >= 0.0 for m in self.guardrails.values()):
            raise ConfigError(f"guardrails: margins must be >= 0, got {self.guardrails}")
        if not 0.0 <= self.srm_alpha < 0.5:
            raise ConfigError(f"srm_alpha: {self.srm_alpha} is not within [0, 0.5) (0: no check)")
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
    # the guardrails' per-session values, in the same order (empty: the sessions carry none)
    guards_a: list[GuardValues] = field(default_factory=list)
    guards_b: list[GuardValues] = field(default_factory=list)
    # per counted session, how many of the side's errored sessions ended before it: a look at n sessions a side
    # tests the error share of the sessions that had ended by then (empty: only the totals are known)
    errored_before_a: list[int] = field(default_factory=list)
    errored_before_b: list[int] = field(default_factory=list)
    # the sample-ratio check: every session each side was routed in the window (any status) and b's expected share
    # of the two; None: no check (the caller does not know the split)
    assigned: tuple[int, int] = (0, 0)
    expected_b: float | None = None
    _first: dict[int, tuple[dict[str, Moments], dict[str, Moments]]] = field(default_factory=dict, repr=False,
                                                                              compare=False)

    @property
    def n_a(self) -> int:
        return sum(m.n for m in self.a.values())

    @property
    def n_b(self) -> int:
        return sum(m.n for m in self.b.values())

    def add(self, side: str, task_type: str, value: float, guard: GuardValues | None = None,
            errored_before: int | None = None) -> None:
        table = self.a if side == "a" else self.b
        table[task_type] = table.get(task_type, Moments()).add(value)
        (self.order_a if side == "a" else self.order_b).append((task_type, value))
        if guard is not None:
            (self.guards_a if side == "a" else self.guards_b).append(guard)
        if errored_before is not None:
            (self.errored_before_a if side == "a" else self.errored_before_b).append(errored_before)

    def errors_at(self, n: int) -> tuple[Moments, Moments] | None:
        """The error share of each side's sessions that had ended by its n-th counted one; None: not tracked."""
        if len(self.errored_before_a) < n or len(self.errored_before_b) < n:
            return None
        return (guardrails.error_moments(self.errored_before_a[n - 1], n),
                guardrails.error_moments(self.errored_before_b[n - 1], n))

    def first_guards(self, n: int) -> tuple[list[GuardValues], list[GuardValues]]:
        """The guardrail values of each side's first n sessions (empty when the sessions carry none)."""
        return self.guards_a[:n], self.guards_b[:n]

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
    """What the rule says: promote | reject | expire | hold (challenger), rollback | keep (champion), halt (the
    split is not the router's: the test is void, no decision on biased evidence)."""

    action: str
    reason: str
    numbers: dict[str, float] = field(default_factory=dict)
    guards: list[GuardCheck] = field(default_factory=list)  # each guardrail at the deciding (or last) look
    srm: RatioCheck | None = None


def _side(records: Iterable[SessionRecord], version: int, arm: str) -> list[SessionRecord]:
    return [r for r in records if r.version == version and r.arm == arm]


def concurrent(records: list[SessionRecord], a: tuple[int, str], b: tuple[int, str], now: float, rule: GateRule,
               since: float | None = None, expected_b: float | None = None) -> Evidence:
    """Evidence for b against a: (version, arm) each; sessions that started at or after the later of
    `since` and b's first session, whose outcome window has closed at `now`. expected_b: b's share of the two
    arms' sessions under the router's split (the sample-ratio check), or None."""
    side_a, side_b = _side(records, *a), _side(records, *b)
    start = min((r.started for r in side_b), default=None)
    if start is None:
        return Evidence(since=since)
    if since is not None:
        start = max(start, since)
    ev = Evidence(since=start, expected_b=expected_b)
    assigned = []
    errors = set(rule.error_statuses)
    for name, side in (("a", side_a), ("b", side_b)):
        window = [r for r in side if r.started >= start]
        assigned.append(len(window))
        split = mature(window, now, rule.maturity_s, rule.error_statuses)
        errored_ends = sorted(r.ended for r in window if r.ended is not None and r.status in errors)
        # the order their outcome windows closed in (maturity_s after the end): a session that matures later
        # is appended later, so the first n of a side stay the first n at every later round
        for r in sorted(split.counted, key=lambda r: (r.ended or 0.0, r.started, r.session_id)):
            ev.add(name, r.task_type, float(r.outcome), GuardValues.of(r),  # type: ignore[arg-type]
                   bisect.bisect_right(errored_ends, r.ended or 0.0))
        ev.excluded.update({f"errored_{name}": split.errored, f"unlabelled_{name}": split.unlabelled,
                            f"open_{name}": split.open})
    ev.assigned = (assigned[0], assigned[1])
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


def _verdict(action: str, reason: str, numbers: dict[str, float], guards: list[GuardCheck] | None = None,
             srm: RatioCheck | None = None) -> Verdict:
    """A verdict whose numbers also hold each guardrail's and the sample-ratio check's (the decision explains
    itself in MLflow)."""
    guards = guards or []
    for g in guards:
        numbers.update(g.numbers())
    if srm is not None:
        numbers.update({"srm_n_a": float(srm.n_a), "srm_n_b": float(srm.n_b), "srm_expected_b": srm.expected_b,
                        "srm_observed_b": srm.observed_b, "srm_log_lr": srm.log_lr, "srm_threshold": srm.threshold,
                        "srm_p": srm.p_value, "srm_mismatch": float(srm.mismatch)})
    return Verdict(action, reason, numbers, guards, srm)


def _online_guards(rule: GateRule) -> list[tuple[str, float]]:
    return [(name, m) for name, m in sorted(rule.guardrails.items()) if name in guardrails.ONLINE]


def _srm(ev: Evidence, rule: GateRule) -> RatioCheck | None:
    if rule.srm_alpha == 0 or ev.expected_b is None or not 0.0 < ev.expected_b < 1.0 or sum(ev.assigned) == 0:
        return None
    return sample_ratio(ev.assigned[0], ev.assigned[1], ev.expected_b, rule.srm_alpha)


def _srm_halt(srm: RatioCheck, ev: Evidence, rule: GateRule, who: str) -> Verdict:
    return _verdict("halt", f"sample ratio mismatch: {who} got {srm.n_b} of {srm.n_a + srm.n_b} sessions "
                    f"({srm.observed_b:.1%}), the router's split gives {srm.expected_b:.1%} (always-valid p "
                    f"{srm.p_value:.2g} < {rule.srm_alpha}); sessions are being lost or mis-routed on one arm, so "
                    "the comparison is biased: the test is void (neither promoted nor rejected; the next version is "
                    "tested on a fresh window, which halts too until the split is fixed)",
                    _numbers(ev, None, rule), srm=srm)


def _error_guard(ev: Evidence, rule: GateRule, alpha: float | None = None) -> GuardCheck | None:
    """The infrastructure-error share (always valid): excluding errored sessions from the comparison must not let a
    version that causes them look good on the sessions it did not break."""
    if "errors" not in rule.guardrails or "errored_a" not in ev.excluded:
        return None  # off, or evidence that does not count errored sessions (a hand-built one)
    a = guardrails.error_moments(ev.excluded.get("errored_a", 0), ev.n_a)
    b = guardrails.error_moments(ev.excluded.get("errored_b", 0), ev.n_b)
    return guardrails.check_always_valid("errors", rule.guardrails["errors"], a, b,
                                         rule.alpha if alpha is None else alpha, rule.min_sessions)


def _breached(guards: list[GuardCheck]) -> GuardCheck | None:
    return next((g for g in guards if g.breach), None)


def _look_guards(ev: Evidence, rule: GateRule, n: int, bound: float) -> list[GuardCheck]:
    """Every online guardrail on the first n sessions a side, and the error share when it is tracked per look."""
    ga, gb = ev.first_guards(n)
    guards = [guardrails.check_at_look(name, m, ga, gb, bound, rule.min_sessions) for name, m in _online_guards(rule)
              if name != "judge"]  # the judge's scores arrive late: always valid, on every judged session (decide)
    at_look = ev.errors_at(n) if "errors" in rule.guardrails else None
    if at_look is not None:  # the error share at this look, against its boundary, like the others
        guards.append(guardrails.check_z("errors", rule.guardrails["errors"], *at_look, bound, rule.min_sessions))
    return guards


def _missing(guards: list[GuardCheck], shown: set[str], extra: list[GuardCheck]) -> list[GuardCheck]:
    """The guardrails that apply and have not been shown within their margins (at this look or an earlier one; the
    always-valid `extra` ones now)."""
    return [g for g in guards if g.applies and g.name not in shown] + [g for g in extra if g.applies and not g.ok]


def _decide_group_sequential(ev: Evidence, rule: GateRule, extra: list[GuardCheck]) -> Verdict:
    """The planned looks the evidence has reached, in order, each on the first n sessions of each side.

    At each look the primary test and every online guardrail are tested against the look's boundary. Promote at
    the first look by which the primary has crossed "better" and each guardrail has crossed "within its margin"
    (each at some look so far: every one of those events has probability <= alpha under its own null, so the
    intersection-union bound holds) and the always-valid `extra` ones (errors when not tracked per look, the judge)
    are shown now. A primary "worse" or a guardrail breached at a look rejects. All looks without that: expire;
    looks still to come: hold."""
    bounds, sizes = rule.bounds(), rule.look_sizes()
    last: GroupSequentialLook | None = None
    better_at: GroupSequentialLook | None = None
    shown: set[str] = set()
    guards: list[GuardCheck] = []
    for k, n in enumerate(sizes, start=1):
        if min(ev.n_a, ev.n_b) < n:
            break
        look = group_sequential_look(*ev.first(n), k, bounds, rule.margin, rule.strata_weights or None)
        if look is None:
            continue
        last = look
        guards = _look_guards(ev, rule, n, bounds[k - 1])
        shown |= {g.name for g in guards if g.ok}
        e = look.estimate
        text = (f"look {k} of {len(sizes)} at {n} sessions a side: challenger {e.mean_b:.3f} vs champion "
                f"{e.mean_a:.3f}, diff {e.diff:+.3f} +- {1.96 * math.sqrt(e.var):.3f}")
        if better_at is None and look.worse:
            return _verdict("reject", f"worse: {text}; z {look.z_worse:.2f} >= {look.bound:.2f}",
                            _gs_numbers(ev, look, rule), guards + extra)
        breach = _breached(guards)
        if breach is not None:
            return _verdict("reject", f"guardrail breached: {breach.describe()} ({text})", _gs_numbers(ev, look, rule),
                            guards + extra)
        better_at = better_at or (look if look.better else None)
        if better_at is not None and not _missing(guards, shown, extra):
            return _verdict("promote", f"better{'' if not rule.margin else f' than champion - {rule.margin}'} at "
                            f"look {better_at.look} (z {better_at.z_better:.2f} >= {better_at.bound:.2f}) and every "
                            f"guardrail within its margin: {text}", _gs_numbers(ev, better_at, rule), guards + extra)
    waiting = ("better, but not yet shown within its margin: "
               + "; ".join(g.describe() for g in _missing(guards, shown, extra)) if better_at is not None else "")
    return _undecided(ev, rule, last, waiting, _gs_numbers(ev, better_at or last, rule), guards + extra)


def _undecided(ev: Evidence, rule: GateRule, last: GroupSequentialLook | None, waiting: str,
               numbers: dict[str, float], guards: list[GuardCheck]) -> Verdict:
    """Group-sequential without a decision: expire after the last look (or at the cap), else hold."""
    sizes = rule.look_sizes()
    if min(ev.n_a, ev.n_b) >= sizes[-1]:
        return _verdict("expire", f"undecided at the last of {len(sizes)} looks ({sizes[-1]} sessions a side)"
                        + (f": {waiting}" if waiting else ""), numbers, guards)
    if ev.n_b >= sizes[-1] + rule.max_sessions:
        # the champion's side never reached the last look: the cap keeps a challenger from holding for ever
        return _verdict("expire", f"the champion had {ev.n_a} concurrent sessions after the challenger's {ev.n_b}: "
                        f"the last look ({sizes[-1]} a side) was not reached", numbers, guards)
    reached = (f"look {last.look}: z {last.z_better:.2f} (better) / {last.z_worse:.2f} (worse) < {last.bound:.2f}; "
               if last else "")
    upcoming = next(n for n in sizes if n > min(ev.n_a, ev.n_b))
    return _verdict("hold", f"undecided: {waiting + '; ' if waiting else reached}next look at {upcoming} sessions a "
                    f"side (champion {ev.n_a}, challenger {ev.n_b})", numbers, guards)


def looks(ev: Evidence, rule: GateRule) -> list[dict[str, object]]:
    """Each planned look the evidence has reached (group-sequential): its sessions, the primary's estimate, z and
    boundary, and each guardrail's statistic and whether it was shown, for `flywheel status`."""
    if rule.test != "group-sequential":
        return []
    rows: list[dict[str, object]] = []
    bounds = rule.bounds()
    for k, n in enumerate(rule.look_sizes(), start=1):
        if min(ev.n_a, ev.n_b) < n:
            break
        look = group_sequential_look(*ev.first(n), k, bounds, rule.margin, rule.strata_weights or None)
        if look is None:
            continue
        rows.append({"look": k, "sessions": n, "diff": look.estimate.diff, "z_better": look.z_better,
                     "z_worse": look.z_worse, "bound": look.bound,
                     "guards": {g.name: ("n/a" if not g.applies else "breach" if g.breach else
                                         f"{g.statistic:.2f}" + (" ok" if g.ok else ""))
                                for g in _look_guards(ev, rule, n, bounds[k - 1])}})
    return rows


def _always_valid_guards(ev: Evidence, rule: GateRule, srm: RatioCheck | None
                         ) -> tuple[GuardCheck | None, GuardCheck | None, Verdict | None]:
    """The guardrails tested on every session so far at every round, whatever the test: the error share and the
    judge's score (its scores arrive late, so a look's sessions would not stay fixed). (errors, judge, a reject
    when either is breached)."""
    errors = _error_guard(ev, rule)
    if errors is not None and errors.breach:
        return errors, None, _verdict(
            "reject", f"more sessions ended in an error: challenger {ev.excluded.get('errored_b', 0)} of "
            f"{errors.test.n_b if errors.test else 0}, champion {ev.excluded.get('errored_a', 0)} of "
            f"{errors.test.n_a if errors.test else 0}; {errors.describe()}", _numbers(ev, None, rule), [errors], srm)
    judge = (guardrails.check_online_always_valid("judge", rule.guardrails["judge"], ev.guards_a, ev.guards_b,
                                                  rule.alpha, rule.min_sessions)
             if "judge" in rule.guardrails else None)
    if judge is not None and judge.breach:
        return errors, judge, _verdict("reject", f"guardrail breached: {judge.describe()}", _numbers(ev, None, rule),
                                       [judge], srm)
    return errors, judge, None


def decide(ev: Evidence, rule: GateRule) -> Verdict:
    """The challenger (b) against the champion (a): promote, reject, expire, hold, or halt (sample ratio mismatch).

    The rule, as a formula (docs/serving.md): promote iff the split is the router's AND the primary test says
    better AND every guardrail says within its margin, each test at alpha."""
    srm = _srm(ev, rule)
    if srm is not None and srm.mismatch:
        return _srm_halt(srm, ev, rule, "the challenger")
    errors, judge, breached = _always_valid_guards(ev, rule, srm)
    if breached is not None:
        return breached
    if ev.n_a < rule.min_sessions or ev.n_b < rule.min_sessions:
        # the cap first: a champion with no concurrent sessions must not keep a challenger on hold for ever
        action = "expire" if ev.n_b >= rule.max_sessions else "hold"
        return _verdict(action, f"too few mature concurrent sessions: champion {ev.n_a}, challenger {ev.n_b}, need "
                        f"{rule.min_sessions} each", _numbers(ev, None, rule), srm=srm)
    if rule.test == "group-sequential":
        # with the error share tracked per look it is tested there like every guardrail (more power at the planned
        # size); its always-valid test above still stops a challenger that breaks sessions between looks
        tracked = bool(ev.errored_before_a) and bool(ev.errored_before_b)
        extra = [g for g in (None if tracked else errors, judge) if g is not None]
        verdict = _decide_group_sequential(ev, rule, extra)
        if srm is not None:
            verdict = _verdict(verdict.action, verdict.reason, verdict.numbers, verdict.guards, srm)
        return verdict
    weights = rule.strata_weights or None
    test = sequential_test(ev.a, ev.b, rule.alpha, rule.tau, rule.margin, weights)
    numbers = _numbers(ev, test, rule)
    if test is None:
        action = "expire" if ev.n_b >= rule.max_sessions else "hold"
        return _verdict(action, "no task type has enough sessions on both sides yet", numbers, srm=srm)
    guards = [guardrails.check_online_always_valid(name, m, ev.guards_a, ev.guards_b, rule.alpha, rule.min_sessions)
              for name, m in _online_guards(rule) if name != "judge"] + [g for g in (errors, judge) if g is not None]
    e = test.estimate
    text = (f"challenger {e.mean_b:.3f} (n {e.n_b}) vs champion {e.mean_a:.3f} (n {e.n_a}), diff {e.diff:+.3f} "
            f"+- {1.96 * math.sqrt(e.var):.3f}")
    if test.worse:
        return _verdict("reject", f"worse: {text}; log LR {test.log_lr_worse:.2f} >= {test.threshold:.2f}", numbers,
                        guards, srm)
    breach = _breached(guards)
    if breach is not None:
        return _verdict("reject", f"guardrail breached: {breach.describe()} ({text})", numbers, guards, srm)
    missing = [g for g in guards if g.applies and not g.ok]
    if test.better and not missing:
        return _verdict("promote", f"better{'' if not rule.margin else f' than champion - {rule.margin}'} and every "
                        f"guardrail within its margin: {text}; log LR {test.log_lr_better:.2f} >= "
                        f"{test.threshold:.2f}", numbers, guards, srm)
    waiting = ("better, but not yet shown within its margin: " + "; ".join(g.describe() for g in missing) + "; "
               if test.better else "")
    if ev.n_b >= rule.max_sessions:
        return _verdict("expire", f"undecided after {ev.n_b} >= {rule.max_sessions} sessions: {waiting}{text}",
                        numbers, guards, srm)
    return _verdict("hold", f"undecided: {waiting}{text}; log LR {test.log_lr_better:.2f} (better) / "
                    f"{test.log_lr_worse:.2f} (worse) < {test.threshold:.2f}", numbers, guards, srm)


def decide_rollback(ev: Evidence, rule: GateRule) -> Verdict:
    """The champion (b) against the concurrent control (a): rollback when it is significantly worse, or when a
    guardrail is breached against the control (always-valid tests: a champion is watched for as long as it serves).

    No sample-ratio check here: the champion's share moves whenever a challenger comes or goes (the router gives it
    the challenger's share in between), so there is no fixed split to test against."""
    if ev.n_a < rule.min_sessions or ev.n_b < rule.min_sessions:
        return _verdict("keep", f"too few mature sessions since the promotion: control {ev.n_a}, champion {ev.n_b}",
                        _numbers(ev, None, rule))
    test = sequential_test(ev.a, ev.b, rule.alpha, rule.tau, 0.0, rule.strata_weights or None)
    numbers = _numbers(ev, test, rule)
    errors = _error_guard(ev, rule)
    guards = [guardrails.check_online_always_valid(name, m, ev.guards_a, ev.guards_b, rule.alpha, rule.min_sessions)
              for name, m in _online_guards(rule)] + ([errors] if errors else [])
    breach = _breached(guards)
    if test is None:
        if breach is not None:
            return _verdict("rollback", f"guardrail breached against the control: {breach.describe()}", numbers,
                            guards)
        return _verdict("keep", "no task type has enough sessions on both sides yet", numbers, guards)
    e = test.estimate
    text = f"champion {e.mean_b:.3f} (n {e.n_b}) vs control {e.mean_a:.3f} (n {e.n_a})"
    if test.worse:
        return _verdict("rollback", f"worse than the control: {text}; log LR {test.log_lr_worse:.2f} >= "
                        f"{test.threshold:.2f}", numbers, guards)
    if breach is not None:
        return _verdict("rollback", f"guardrail breached against the control: {breach.describe()} ({text})", numbers,
                        guards)
    return _verdict("keep", f"holds: {text}; log LR (worse) {test.log_lr_worse:.2f} < {test.threshold:.2f}", numbers,
                    guards)
