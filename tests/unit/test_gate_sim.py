"""The gate simulation: the gate's own rule, its error rate under the null, its power, determinism,
and `flywheel bench gate`'s JSON line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from flywheel.serving import decision
from flywheel.serving.decision import Evidence, GateRule, Verdict
from flywheel.serving.gate_sim import (
    Guards,
    Scenario,
    at_null,
    binomial_se,
    false_promotion_rate,
    simulate,
)

# the demo's rule and traffic (bench/gate.py's defaults)
RULE = GateRule(alpha=0.05, tau=0.1, margin=0.0, min_sessions=30, max_sessions=500)
TWO_TYPES = Scenario(rates={"easy": 0.4, "hard": 0.1}, mix={"easy": 0.5, "hard": 0.5})


def test_null_promote_rate_is_at_most_alpha() -> None:
    n = 400
    res = simulate(RULE, TWO_TYPES, n, seed=1)
    bound = RULE.alpha + 3 * binomial_se(RULE.alpha, n)
    assert res.promote_rate <= bound, f"null promote rate {res.promote_rate:.3f} > {bound:.3f} over {n} challengers"
    assert res.promoted + res.rejected + res.expired == n == len(res.sessions_to_decision)


def test_a_true_lift_of_15_points_is_promoted() -> None:
    res = simulate(RULE, Scenario(TWO_TYPES.rates, TWO_TYPES.mix, lift=0.15), 300, seed=2)
    assert res.promote_rate > 0.8, f"power at +15 points {res.promote_rate:.3f} (reject {res.reject_rate:.3f})"
    assert res.reject_rate < 0.01, f"a better challenger rejected in {res.reject_rate:.3f} of runs"
    assert res.median_sessions < RULE.max_sessions, f"median sessions to a decision {res.median_sessions}"


def test_the_verdict_is_decide_s(monkeypatch: pytest.MonkeyPatch) -> None:
    looks: list[tuple[int, int]] = []

    def fake(ev: Evidence, rule: GateRule) -> Verdict:
        looks.append((ev.n_a, ev.n_b))
        return Verdict("expire" if len(looks) % 4 == 0 else "hold", "fake")

    monkeypatch.setattr(decision, "decide", fake)
    half = Scenario(TWO_TYPES.rates, TWO_TYPES.mix, challenger_per_look=15, champion_ratio=0.5)
    res = simulate(RULE, half, 3, seed=0)
    assert len(looks) == 12, f"decide called {len(looks)} times for 3 challengers deciding at their 4th look"
    assert (res.expired, res.promoted, res.rejected) == (3, 0, 0)
    assert res.sessions_to_decision == [60, 60, 60]
    # 7.5 champion sessions a look: the fraction is carried, not dropped
    assert looks[:4] == [(8, 15), (15, 30), (23, 45), (30, 60)], looks[:4]


def test_seeded_runs_repeat() -> None:
    lifted = Scenario(TWO_TYPES.rates, TWO_TYPES.mix, lift=0.05)
    a, b = simulate(RULE, lifted, 100, seed=7), simulate(RULE, lifted, 100, seed=7)
    assert a == b
    assert simulate(RULE, lifted, 100, seed=8).sessions_to_decision != a.sessions_to_decision


def test_false_promotion_rate_tests_a_challenger_margin_worse() -> None:
    rule = GateRule(alpha=0.05, tau=0.1, margin=0.05, min_sessions=30, max_sessions=200)
    worse = Scenario(TWO_TYPES.rates, TWO_TYPES.mix, lift=-0.05)
    assert false_promotion_rate(rule, TWO_TYPES, 100, seed=3) == simulate(rule, worse, 100, seed=3).promote_rate


def test_bench_gate_prints_a_json_last_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import gate

    assert gate.main(["--challengers", "30", "--gate.max-sessions", "150", "--stream-days", "0.1",
                      "--out-dir", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    required = {"false_promotion_rate", "false_promotion_se", "alpha", "power_5pt", "power_10pt",
                "median_sessions_to_decision", "challengers", "tau", "margin", "min_sessions", "max_sessions",
                "challenger_per_look", "champion_ratio", "false_promotion_rate_guardrails_at_margin",
                "malformed_breach_promote_rate", "srm_detected_before_last_look", "srm_false_alarm_rate",
                "power_10pt_primary_only", "false_promotions_per_day_demo_per_challenger",
                "false_promotions_per_day_every_5_min_lord", "false_promotions_per_day_hourly_daily",
                "mixed_every_5_min_lord"}
    assert required <= set(result), f"missing {sorted(required - set(result))}"
    assert result["challengers"] == 30 and result["max_sessions"] == 150
    # the rule measured is the recipe's (the demo's), not a copy of it
    assert result["guardrails"]["malformed"] == 0.04 and result["test"] == "group-sequential"
    assert 0.0 <= result["false_promotion_rate"] <= 1.0 and 0.0 <= result["power_10pt"] <= 1.0
    assert (tmp_path / "power_vs_lift.png").stat().st_size > 0
    assert (tmp_path / "config.toml").exists()


# ---------------------------------------------------------------------------------------------
# The whole rule: guardrails, the sample-ratio check, a stream of challengers
# ---------------------------------------------------------------------------------------------
GUARDED = GateRule(test="group-sequential", looks=3, alpha=0.05, min_sessions=30, max_sessions=240,
                   guardrails={"errors": 0.02, "malformed": 0.04, "slow": 0.06, "tokens": 0.25})
DEMO_LIKE = Scenario(rates={"add": 0.10, "weather": 0.5}, mix={"add": 0.6, "weather": 0.4}, guards=Guards())


def test_a_challenger_better_on_success_but_beyond_a_guardrails_margin_is_not_promoted() -> None:
    n = 300
    worse = dataclasses.replace(Guards(), malformed_shift=0.05)
    res = simulate(GUARDED, dataclasses.replace(DEMO_LIKE, lift=0.15, guards=worse), n, seed=4)
    assert res.promote_rate <= GUARDED.alpha + 2 * binomial_se(GUARDED.alpha, n), res
    # the same challenger without the malformed calls is promoted most of the time: the guardrail is what stops it
    fine = simulate(GUARDED, dataclasses.replace(DEMO_LIKE, lift=0.15), n, seed=4)
    assert fine.promote_rate > 0.3 + res.promote_rate, (fine, res)


def test_at_every_guardrails_margin_and_no_better_the_rule_promotes_at_most_alpha() -> None:
    n = 400
    res = simulate(GUARDED, at_null(GUARDED, DEMO_LIKE), n, seed=6)
    assert res.promote_rate <= GUARDED.alpha + 2 * binomial_se(GUARDED.alpha, n), res


def test_a_lost_third_of_one_arms_sessions_halts_before_the_last_look() -> None:
    n = 200
    rule = dataclasses.replace(GUARDED, srm_alpha=0.05)
    lost = simulate(rule, dataclasses.replace(DEMO_LIKE, challenger_loss=1 / 3), n, seed=7)
    assert lost.halted_before_last_look >= 0.85 * n, lost
    sound = simulate(rule, DEMO_LIKE, n, seed=7)
    assert sound.halted <= 0.05 * n + 2 * binomial_se(0.05, n) * n, sound


def test_a_stream_under_lord_spends_less_than_its_wealth_and_per_challenger_does_not() -> None:
    from flywheel.serving.gate_sim import simulate_stream

    rule = dataclasses.replace(GUARDED, guardrails={})
    null = dataclasses.replace(DEMO_LIKE, guards=None)
    per = simulate_stream(rule, null, 3600.0, 0.8, 20, "per-challenger", seed=1)
    lord = simulate_stream(rule, null, 3600.0, 0.8, 20, "lord", seed=1)
    assert per.challengers == lord.challengers == 480
    assert sum(lord.levels) < rule.alpha / 2, "with no discovery LORD++ spends less than its starting wealth"
    assert per.false_promotions >= 5, f"480 null challengers at alpha 0.05 each: {per.false_promotions} promoted"
    assert lord.false_promotions <= 2, lord.false_promotions
