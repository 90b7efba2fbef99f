"""Simulated session streams for the promotion gate: its error rates, measured on the code that decides.

Each simulated challenger is a stream of mature concurrent sessions, champion and challenger, with
Bernoulli outcomes per task type. The stream grows look by look (the gate's rounds), and after every
look the gate's own rule, `flywheel.serving.decision.decide`, says promote, reject, expire or hold,
exactly as `flywheel promote` would on the lake. Counting the verdicts over many challengers gives
the rule's false-promotion rate (no true lift), its power (a true lift) and how many sessions a
decision takes. `flywheel bench gate` prints them; the demo's report quotes the false-promotion rate.

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


@dataclass(frozen=True)
class Scenario:
    """The traffic a challenger meets: the champion's success per task type, the task mix, the true lift."""

    rates: dict[str, float]  # task type -> the champion's success rate
    mix: dict[str, float]  # task type -> share of sessions (the same on both arms)
    lift: float = 0.0  # added to the challenger's rate in every task type, clipped to [0, 1]
    challenger_per_look: int = 15  # challenger sessions that become mature between two gate looks
    champion_ratio: float = 1.0  # champion sessions per challenger session in the concurrent window

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
    """Draws one arm's sessions: a task type by the mix, then a success with that type's rate."""

    def __init__(self, scenario: Scenario, lift: float) -> None:
        types = sorted(scenario.mix)
        total = sum(scenario.mix.values())
        self.types = types
        self.cumulative = list(_accumulate([scenario.mix[t] / total for t in types]))
        self.rates = [min(1.0, max(0.0, scenario.rates[t] + lift)) for t in types]

    def add(self, ev: Evidence, side: str, n: int, rng: random.Random) -> None:
        last = len(self.types) - 1
        for _ in range(n):
            # bisect on the cumulative shares; min() guards the float rounding of the last share
            i = min(bisect.bisect_right(self.cumulative, rng.random()), last)
            ev.add(side, self.types[i], 1.0 if rng.random() < self.rates[i] else 0.0)


def _accumulate(values: list[float]) -> list[float]:
    out, running = [], 0.0
    for v in values:
        running += v
        out.append(running)
    return out


def _one_challenger(rule: GateRule, scenario: Scenario, champion: _Arm, challenger: _Arm,
                    rng: random.Random) -> tuple[str, int]:
    """Grow the evidence look by look until the gate decides; (action, challenger sessions then)."""
    ev = Evidence()
    per_look = scenario.challenger_per_look
    owed = 0.0  # the champion's fractional sessions carried to the next look
    # decide expires a challenger at max_sessions once the test can run, so this bound is never
    # reached by a sound rule; it turns a rule that can never decide into an error, not a hang
    bound = max(rule.max_sessions, rule.min_sessions) + 100 * per_look
    while True:
        owed += scenario.champion_ratio * per_look
        n_champion = round(owed)
        owed -= n_champion
        champion.add(ev, "a", n_champion, rng)
        challenger.add(ev, "b", per_look, rng)
        verdict = decision.decide(ev, rule)  # the module attribute, so what runs is the gate's own rule
        if verdict.action != "hold":
            return verdict.action, ev.n_b
        assert ev.n_b < bound, f"gate_sim: no verdict after {ev.n_b} challenger sessions ({verdict.reason})"


def simulate(rule: GateRule, scenario: Scenario, challengers: int, seed: int = 0,
             on_challenger: Callable[[], None] | None = None) -> SimResult:
    """Run `challengers` simulated challengers through the gate's rule; deterministic for a seed.

    on_challenger: called after each challenger's verdict (a progress bar), never with data.
    """
    rule.check_rule()
    scenario.check()
    rng = random.Random(seed)
    champion, challenger = _Arm(scenario, 0.0), _Arm(scenario, scenario.lift)
    counts = {"promote": 0, "reject": 0, "expire": 0}
    sessions: list[int] = []
    for _ in range(challengers):
        action, n_b = _one_challenger(rule, scenario, champion, challenger, rng)
        assert action in counts, f"gate_sim: decide returned {action!r}, not promote/reject/expire/hold"
        counts[action] += 1
        sessions.append(n_b)
        if on_challenger is not None:
            on_challenger()
    return SimResult(challengers, counts["promote"], counts["reject"], counts["expire"], sessions)


def at_null(rule: GateRule, scenario: Scenario) -> Scenario:
    """The scenario at the null's worst case for promotion: a challenger exactly `rule.margin` worse (0: equal)."""
    return dataclasses.replace(scenario, lift=0.0 - rule.margin)  # 0.0 - : no "-0" lift in a table


def false_promotion_rate(rule: GateRule, scenario: Scenario, challengers: int = 2000, seed: int = 0) -> float:
    """The promote rate at the null's worst case (`at_null`): what the gate's alpha promises to bound."""
    return simulate(rule, at_null(rule, scenario), challengers, seed).promote_rate
