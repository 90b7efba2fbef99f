"""The gate's group-sequential test: its boundaries (Lan-DeMets alpha spending), its error rate under the null
and its power at the demo's traffic (seeded simulations of the gate's own decide), and that a look is replayed
exactly at every later round (it reads the first n sessions of each side in the order they matured)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flywheel.base.config import ConfigError
from flywheel.serving.decision import Evidence, GateRule, concurrent, decide
from flywheel.serving.gate_sim import Scenario, binomial_se, simulate
from flywheel.serving.sessions import SessionRecord
from flywheel.serving.stats import alpha_spent, group_sequential_bounds

# the demo's rule (infra/demo/plan.py) and a demo-like task mix at the warm start's success rates
RULE = GateRule(test="group-sequential", looks=3, spending="obf", alpha=0.05, min_sessions=30, max_sessions=240,
                maturity_s=10.0)
DEMO = Scenario(rates={"tool_use.weather": 0.75, "tool_use.add": 0.04, "tool_use.mul": 0.055, "tool_use.multi": 0.07},
                mix={"tool_use.weather": 0.3, "tool_use.add": 0.3, "tool_use.mul": 0.3, "tool_use.multi": 0.1})


def test_one_look_is_the_fixed_sample_test_and_two_looks_match_the_published_boundaries() -> None:
    assert abs(group_sequential_bounds((1.0,), 0.05)[0] - 1.6449) < 2e-3
    # Lan-DeMets O'Brien-Fleming type, one-sided 0.025, looks at 1/2 and 1: 2.963 and 1.969 (Jennison and
    # Turnbull's tables; gsDesign gives the same)
    first, last = group_sequential_bounds((0.5, 1.0), 0.025, "obf")
    assert abs(first - 2.963) < 5e-3 and abs(last - 1.969) < 5e-3, (first, last)
    assert alpha_spent(1.0, 0.05, "obf") == pytest.approx(0.05) and alpha_spent(1.0, 0.05, "pocock") == pytest.approx(0.05)


@pytest.mark.parametrize("fractions,spending", [((1 / 3, 2 / 3, 1.0), "obf"), ((0.25, 0.5, 0.75, 1.0), "pocock"),
                                                ((0.4, 1.0), "obf")])
def test_a_brownian_motion_crosses_some_boundary_with_probability_alpha(fractions: tuple[float, ...], spending: str) -> None:
    # the definition itself, checked by Monte Carlo: Z_k = W(t_k) / sqrt(t_k) under the null
    alpha, n = 0.05, 400_000
    bounds = group_sequential_bounds(fractions, alpha, spending)
    rng = np.random.default_rng(3)
    steps = np.diff((0.0, *fractions))
    w = np.cumsum(rng.standard_normal((n, len(fractions))) * np.sqrt(steps), axis=1)
    crossed = (w / np.sqrt(fractions) >= np.array(bounds)).any(axis=1).mean()
    assert abs(crossed - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / n), f"crossed {crossed:.4f}, alpha {alpha}, {bounds}"


def test_the_gates_false_promotion_rate_under_the_null_is_at_most_alpha() -> None:
    n = 1000
    res = simulate(RULE, DEMO, n, seed=5)
    bound = RULE.alpha + 3 * binomial_se(RULE.alpha, n)
    assert res.promote_rate <= bound, f"null promote rate {res.promote_rate:.3f} > {bound:.3f} over {n} challengers"
    assert res.expired > 0.8 * n, f"equal versions should mostly reach the last look undecided: {res}"
    assert max(res.sessions_to_decision) <= RULE.max_sessions + DEMO.challenger_per_look, res.sessions_to_decision[:20]


def test_the_gate_has_power_at_the_demos_traffic_and_more_than_the_msprt_at_five_points() -> None:
    n = 400
    gs = simulate(RULE, Scenario(DEMO.rates, DEMO.mix, lift=0.10), n, seed=2)
    assert gs.promote_rate >= 0.85, f"power at +10 points {gs.promote_rate:.3f} over {n} challengers"
    five = Scenario(DEMO.rates, DEMO.mix, lift=0.05)
    gs5 = simulate(RULE, five, n, seed=2).promote_rate
    msprt5 = simulate(GateRule(test="msprt", alpha=0.05, min_sessions=30, max_sessions=240, maturity_s=10.0), five, n,
                      seed=2).promote_rate
    assert gs5 > 1.5 * msprt5, f"power at +5 points: group-sequential {gs5:.3f}, msprt {msprt5:.3f} at 240 a side"


def _fill(ev: Evidence, side: str, outcomes: list[float]) -> None:
    for value in outcomes:
        ev.add(side, "t", value)


def test_a_look_reads_the_first_n_sessions_a_side_and_later_sessions_do_not_change_it() -> None:
    rule = GateRule(test="group-sequential", looks=2, max_sessions=100, min_sessions=30, maturity_s=0.0)
    ev = Evidence()
    _fill(ev, "a", [1.0 if i % 5 == 0 else 0.0 for i in range(50)])  # champion 20%
    _fill(ev, "b", [1.0 if i % 5 < 4 else 0.0 for i in range(50)])  # challenger 80%
    verdict = decide(ev, rule)
    assert verdict.action == "promote" and verdict.numbers["look"] == 1, verdict
    # the challenger's next 50 all fail: the first look still says promote, replayed from the first 50
    _fill(ev, "a", [1.0] * 50)
    _fill(ev, "b", [0.0] * 50)
    again = decide(ev, rule)
    assert again.action == "promote" and again.numbers["look"] == 1, again
    assert again.numbers["diff"] == pytest.approx(verdict.numbers["diff"]), (verdict.numbers, again.numbers)


def test_between_looks_the_gate_holds_and_after_the_last_it_expires() -> None:
    rule = GateRule(test="group-sequential", looks=2, max_sessions=100, min_sessions=30, maturity_s=0.0)
    ev = Evidence()
    same = [1.0 if i % 3 == 0 else 0.0 for i in range(49)]
    _fill(ev, "a", same)
    _fill(ev, "b", same)
    held = decide(ev, rule)
    assert held.action == "hold" and "next look at 50" in held.reason, held
    _fill(ev, "a", same * 2 + [0.0] * 3)
    _fill(ev, "b", same * 2 + [0.0] * 3)
    assert decide(ev, rule).action == "expire"


def test_sessions_are_ordered_by_when_they_ended_not_by_when_they_started() -> None:
    rule = GateRule(test="group-sequential", looks=1, max_sessions=30, min_sessions=30, maturity_s=0.0)
    records = [SessionRecord(f"s{i}", "t", 1, "challenger", started=100.0 - i, ended=200.0 + i, status="ok",
                             outcome=float(i % 2)) for i in range(4)]
    ev = concurrent(records, (0, "champion"), (1, "challenger"), now=1e9, rule=rule)
    assert [v for _, v in ev.order_b] == [0.0, 1.0, 0.0, 1.0], ev.order_b


@pytest.mark.parametrize("changes,field", [({"test": "t-test"}, "test"), ({"spending": "linear"}, "spending"),
                                           ({"looks": 0}, "looks"), ({"looks": 10}, "min_sessions")])
def test_a_rule_that_cannot_run_is_refused_naming_the_field(changes: dict[str, object], field: str) -> None:
    rule = GateRule(**{**dict(test="group-sequential", max_sessions=240, min_sessions=30), **changes})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=field):
        rule.check_rule()


def test_with_twice_the_champions_traffic_the_null_promote_rate_stays_at_most_alpha() -> None:
    # two strata, the champion with twice the challenger's sessions: a look waits for the smaller side
    scenario = Scenario(rates={"easy": 0.4, "hard": 0.1}, mix={"easy": 0.5, "hard": 0.5}, champion_ratio=2.0)
    n = 600
    res = simulate(RULE, scenario, n, seed=11)
    assert res.promote_rate <= RULE.alpha + 3 * binomial_se(RULE.alpha, n), res
