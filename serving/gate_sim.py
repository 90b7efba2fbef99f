"""Simulated session streams for the promotion gate: its error rates, measured on the code that decides.

Each simulated challenger is a stream of mature concurrent sessions, champion and challenger, with
Bernoulli outcomes per task type and, with `Guards`, each session's guardrail metrics (a malformed
call, an infrastructure error, a lognormal latency, a token count) and a random split between the
arms, so the guardrails and the sample-ratio check run as they do on the lake. The stream grows
look by look (the gate's rounds), and after every look the gate's own rule,
`flywheel.serving.decision.decide`, says promote, reject, expire, halt or hold, exactly as
`flywheel promote` would on the lake. Counting the verdicts over many challengers gives
the rule's false-promotion rate (no true lift), its power (a true lift) and how many sessions a
decision takes. `flywheel bench gate` prints them; the demo's report quotes the false-promotion rate.
`simulate_stream` runs a day of challengers at a publishing cadence, each at the level its stream
mode gives it, for the false promotions per day.

Pure Python and deterministic for a seed: no I/O, no service.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Callable

from flywheel.serving import decision
from flywheel.serving.decision import Evidence, GateRule
from flywheel.serving.guardrails import GuardValues


@dataclass(frozen=True)
class Guards:
    """Guardrail metrics of each session: the champion's, and how the challenger's differ.

    The defaults are the demo's order of magnitude (docs/experiments.md: malformed calls on 6.5-10% of the
    champion's sessions; errors rare; sessions of a few seconds; a few hundred tokens)."""

    malformed: float = 0.07  # share of the champion's tool calls that are malformed
    extra_calls: float = 0.2  # tool calls per session: 1 + Poisson(this) (the demo's: one, or two for multi-part)
    errors: float = 0.005  # share of its sessions that end in an infrastructure error
    latency_median_s: float = 6.0  # lognormal latency
    latency_sigma: float = 0.5
    tokens_mean: float = 400.0  # normal token count, floored at 1
    tokens_cv: float = 0.3
    malformed_shift: float = 0.0  # the challenger's malformed share: + this
    errors_shift: float = 0.0  # its error share: + this
    latency_scale: float = 1.0  # its latency: times this
    tokens_scale: float = 1.0  # its tokens: times this

    def at_margins(self, margins: dict[str, float]) -> "Guards":
        """The challenger exactly at every guardrail's margin: the worst case of the guardrails' nulls."""
        return dataclasses.replace(self, malformed_shift=margins.get("malformed", 0.0),
                                   errors_shift=margins.get("errors", 0.0),
                                   latency_scale=self.latency_scale_for(margins.get("slow", 0.0)),
                                   tokens_scale=1.0 + margins.get("tokens", 0.0))

    def latency_scale_for(self, slow_margin: float) -> float:
        """The latency factor at which the challenger's share beyond the champion's p95 is 5% + slow_margin."""
        from scipy.stats import norm

        share = min(0.999, 0.05 + slow_margin)
        return math.exp(self.latency_sigma * (norm.isf(0.05) - norm.isf(share)))


@dataclass(frozen=True)
class Scenario:
    """The traffic a challenger meets: the champion's success per task type, the task mix, the true lift."""

    rates: dict[str, float]  # task type -> the champion's success rate
    mix: dict[str, float]  # task type -> share of sessions (the same on both arms)
    lift: float = 0.0  # added to the challenger's rate in every task type, clipped to [0, 1]
    challenger_per_look: int = 15  # challenger sessions that become mature between two gate looks
    champion_ratio: float = 1.0  # champion sessions per challenger session in the concurrent window
    guards: Guards | None = None  # None: sessions carry no guardrail metrics and no errors (the split is fixed)
    challenger_loss: float = 0.0  # share of the challenger's sessions lost before the lake (a sample ratio mismatch)

    def check(self) -> None:
        missing = sorted(set(self.mix) - set(self.rates))
        if missing:
            raise ValueError(f"scenario: mix names task types without a rate: {missing}")
        if not self.mix or any(w < 0 for w in self.mix.values()) or sum(self.mix.values()) <= 0:
            raise ValueError(f"scenario: mix needs non-negative shares with a positive sum, got {self.mix}")
        if any(not 0.0 <= r <= 1.0 for r in self.rates.values()):
            raise ValueError(f"scenario: rates must be within [0, 1], got {self.rates}")
        if self.challenger_per_look < 1 or self.champion_ratio <= 0:
            raise ValueError(f"scenario: challenger_per_look ({self.challenger_per_look}) must be >= 1 and "
                             f"champion_ratio ({self.champion_ratio}) > 0")
        if not 0.0 <= self.challenger_loss < 1.0:
            raise ValueError(f"scenario: challenger_loss {self.challenger_loss} must be within [0, 1)")

    def overall_rate(self, lift: float = 0.0) -> float:
        total = sum(self.mix.values())
        return sum(w / total * min(1.0, max(0.0, self.rates[t] + lift)) for t, w in self.mix.items())


@dataclass
class SimResult:
    """The verdicts of `challengers` simulated challengers."""

    challengers: int
    promoted: int
    rejected: int
    expired: int
    sessions_to_decision: list[int] = field(default_factory=list)  # challenger sessions at the deciding look
    halted: int = 0  # stopped by the sample-ratio check
    halted_before_last_look: int = 0  # ... while neither side had reached the last look's sessions
    superseded: int = 0  # replaced by the next challenger before any verdict (a stream's cadence)

    @property
    def halt_rate(self) -> float:
        return self.halted / self.challengers if self.challengers else math.nan

    @property
    def promote_rate(self) -> float:
        return self.promoted / self.challengers if self.challengers else math.nan

    @property
    def reject_rate(self) -> float:
        return self.rejected / self.challengers if self.challengers else math.nan

    @property
    def expire_rate(self) -> float:
        return self.expired / self.challengers if self.challengers else math.nan

    @property
    def promote_se(self) -> float:
        """Simulation standard error of promote_rate (binomial)."""
        return binomial_se(self.promote_rate, self.challengers)

    @property
    def median_sessions(self) -> float:
        return float(statistics.median(self.sessions_to_decision)) if self.sessions_to_decision else math.nan


def binomial_se(rate: float, n: int) -> float:
    return math.sqrt(rate * (1.0 - rate) / n) if n else math.nan


class _Arm:
    """Draws one arm's sessions: a task type by the mix, then a success with that type's rate (and, with guards,
    an error, a malformed call, a latency and a token count)."""

    def __init__(self, scenario: Scenario, lift: float, challenger: bool = False) -> None:
        types = sorted(scenario.mix)
        total = sum(scenario.mix.values())
        self.types = types
        self.cumulative = list(_accumulate([scenario.mix[t] / total for t in types]))
        self.rates = [min(1.0, max(0.0, scenario.rates[t] + lift)) for t in types]
        g = scenario.guards
        self.guards = g
        if g is not None:
            self.malformed = min(1.0, max(0.0, g.malformed + (g.malformed_shift if challenger else 0.0)))
            self.errors = min(1.0, max(0.0, g.errors + (g.errors_shift if challenger else 0.0)))
            self.log_median = math.log(g.latency_median_s * (g.latency_scale if challenger else 1.0))
            self.tokens = g.tokens_mean * (g.tokens_scale if challenger else 1.0)

    def add(self, ev: Evidence, side: str, n: int, rng: random.Random) -> None:
        last = len(self.types) - 1
        g = self.guards
        for _ in range(n):
            # bisect on the cumulative shares; min() guards the float rounding of the last share
            i = min(bisect.bisect_right(self.cumulative, rng.random()), last)
            if g is None:
                ev.add(side, self.types[i], 1.0 if rng.random() < self.rates[i] else 0.0)
                continue
            if rng.random() < self.errors:  # excluded from the comparison, counted apart (decision.concurrent)
                key = f"errored_{side}"
                ev.excluded[key] = ev.excluded.get(key, 0) + 1
                continue
            calls = 1 + _poisson(g.extra_calls, rng)
            guard = GuardValues(_binomial(calls, self.malformed, rng),
                                math.exp(rng.gauss(self.log_median, g.latency_sigma)),
                                max(1, round(rng.gauss(self.tokens, g.tokens_cv * self.tokens))), None, calls)
            ev.add(side, self.types[i], 1.0 if rng.random() < self.rates[i] else 0.0, guard,
                   ev.excluded[f"errored_{side}"])


def _accumulate(values: list[float]) -> list[float]:
    out, running = [], 0.0
    for v in values:
        running += v
        out.append(running)
    return out


def _binomial(n: int, p: float, rng: random.Random) -> int:
    return sum(rng.random() < p for _ in range(n))


def _poisson(mean: float, rng: random.Random) -> int:
    """Knuth's method (small means only)."""
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k


def _one_challenger(rule: GateRule, scenario: Scenario, champion: _Arm, challenger: _Arm,
                    rng: random.Random, lifetime: int | None = None) -> tuple[str, int, bool]:
    """Grow the evidence look by look until the gate decides; (action, challenger sessions then, whether a side
    had reached the last look). lifetime: challenger sessions routed before the next challenger replaces it
    ("superseded" then)."""
    random_split = scenario.guards is not None
    # with guards the router's split is random (each session to the challenger with its share) and the gate
    # checks it; without, each look adds exactly the planned sessions (the old, fixed stream)
    expected_b = 1.0 / (1.0 + scenario.champion_ratio)
    ev = Evidence(expected_b=expected_b if random_split else None)
    if random_split:
        ev.excluded.update({"errored_a": 0, "errored_b": 0})
    per_look = scenario.challenger_per_look
    owed = 0.0  # the champion's fractional sessions carried to the next look
    routed_b = 0
    # decide expires a challenger at max_sessions once the test can run, so this bound is never
    # reached by a sound rule; it turns a rule that can never decide into an error, not a hang
    bound = max(rule.max_sessions, rule.min_sessions) + 100 * per_look
    last = rule.look_sizes()[-1] if rule.test == "group-sequential" else rule.max_sessions
    while True:
        owed += (1.0 + scenario.champion_ratio) * per_look if random_split else scenario.champion_ratio * per_look
        total = round(owed)
        owed -= total
        if random_split:
            n_b = _binomial(total, expected_b, rng)
            n_a = total - n_b
            routed_b += n_b
            n_b -= _binomial(n_b, scenario.challenger_loss, rng)
        else:
            n_a, n_b = total, per_look
            routed_b += n_b
        champion.add(ev, "a", n_a, rng)
        challenger.add(ev, "b", n_b, rng)
        if random_split:
            ev.assigned = (ev.n_a + ev.excluded["errored_a"], ev.n_b + ev.excluded["errored_b"])
        if lifetime is not None and routed_b >= lifetime:
            return "superseded", ev.n_b, False
        verdict = decision.decide(ev, rule)  # the module attribute, so what runs is the gate's own rule
        if verdict.action != "hold":
            return verdict.action, ev.n_b, min(ev.n_a, ev.n_b) >= last
        assert ev.n_b < bound, f"gate_sim: no verdict after {ev.n_b} challenger sessions ({verdict.reason})"


def simulate(rule: GateRule, scenario: Scenario, challengers: int, seed: int = 0,
             on_challenger: Callable[[], None] | None = None) -> SimResult:
    """Run `challengers` simulated challengers through the gate's rule; deterministic for a seed.

    on_challenger: called after each challenger's verdict (a progress bar), never with data.
    """
    rule.check_rule()
    scenario.check()
    rng = random.Random(seed)
    champion, challenger = _Arm(scenario, 0.0), _Arm(scenario, scenario.lift, challenger=True)
    counts = {"promote": 0, "reject": 0, "expire": 0, "halt": 0}
    sessions: list[int] = []
    early_halts = 0
    for _ in range(challengers):
        action, n_b, reached_last = _one_challenger(rule, scenario, champion, challenger, rng)
        assert action in counts, f"gate_sim: decide returned {action!r}, not promote/reject/expire/halt/hold"
        counts[action] += 1
        early_halts += action == "halt" and not reached_last
        sessions.append(n_b)
        if on_challenger is not None:
            on_challenger()
    return SimResult(challengers, counts["promote"], counts["reject"], counts["expire"], sessions, counts["halt"],
                     early_halts)


def at_null(rule: GateRule, scenario: Scenario) -> Scenario:
    """The scenario at the null's worst case for promotion: a challenger exactly `rule.margin` worse (0: equal),
    and with guards, exactly at every guardrail's margin."""
    guards = scenario.guards.at_margins(rule.guardrails) if scenario.guards is not None else None
    return dataclasses.replace(scenario, lift=0.0 - rule.margin, guards=guards)  # 0.0 - : no "-0" lift in a table


def false_promotion_rate(rule: GateRule, scenario: Scenario, challengers: int = 2000, seed: int = 0) -> float:
    """The promote rate at the null's worst case (`at_null`): what the gate's alpha promises to bound."""
    return simulate(rule, at_null(rule, scenario), challengers, seed).promote_rate


# ---------------------------------------------------------------------------------------------
# A stream of challengers: false promotions per day at a publishing cadence
# ---------------------------------------------------------------------------------------------
@dataclass
class StreamResult:
    """`days` of challengers, one every cadence_s, each tested until the next replaces it."""

    mode: str
    cadence_s: float
    days: float
    challengers: int
    promoted: int
    false_promotions: int  # promotions of challengers no better than the champion
    true_challengers: int  # challengers that were better
    levels: list[float] = field(default_factory=list)  # each challenger's alpha

    @property
    def per_day(self) -> float:
        return self.challengers / self.days

    @property
    def false_per_day(self) -> float:
        return self.false_promotions / self.days

    @property
    def fdr(self) -> float:
        """False promotions over promotions (0 with none)."""
        return self.false_promotions / self.promoted if self.promoted else 0.0


def simulate_stream(rule: GateRule, null: Scenario, cadence_s: float, challenger_sessions_per_s: float,
                    days: float, mode: str = "per-challenger", better: Scenario | None = None,
                    better_share: float = 0.0, seed: int = 0,
                    on_challenger: Callable[[], None] | None = None) -> StreamResult:
    """A day's stream of challengers through the gate's rule, with each challenger's level from `mode` exactly as
    `flywheel promote` sets it (serving/stats.py lord_alpha, daily_alpha). A challenger gets cadence_s x
    challenger_sessions_per_s sessions before the next replaces it (its test is cut short then: it promotes less
    often, never more). better_share of the challengers come from `better` (a true lift), the rest from `null`."""
    from flywheel.serving.stats import daily_alpha, lord_alpha

    rng = random.Random(seed)
    per_day = 86400.0 / cadence_s
    n = max(1, round(per_day * days))
    lifetime = max(1, round(cadence_s * challenger_sessions_per_s))
    arms = {False: (_Arm(null, 0.0), _Arm(null, null.lift, challenger=True))}
    if better is not None:
        arms[True] = (_Arm(better, 0.0), _Arm(better, better.lift, challenger=True))
    out = StreamResult(mode, cadence_s, days, n, 0, 0, 0)
    discoveries: list[int] = []
    for i in range(1, n + 1):
        if mode == "lord":
            level = lord_alpha(i, discoveries, rule.alpha)
        elif mode == "daily":
            level = daily_alpha(1 + (i - 1) % max(1, round(per_day)), rule.alpha)
        else:
            level = rule.alpha
        out.levels.append(level)
        is_better = better is not None and rng.random() < better_share
        out.true_challengers += is_better
        scenario = better if is_better and better is not None else null
        champion, challenger = arms[is_better]
        action, _, _ = _one_challenger(dataclasses.replace(rule, alpha=level), scenario, champion, challenger, rng,
                                       lifetime)
        if action == "promote":
            out.promoted += 1
            out.false_promotions += not is_better
            discoveries.append(i)
        if on_challenger is not None:
            on_challenger()
    return out
