"""The gate simulation: the gate's own rule, its error rate under the null, its power, determinism,
and `flywheel bench gate`'s JSON line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flywheel.serving import decision
from flywheel.serving.decision import Evidence, GateRule, Verdict
from flywheel.serving.gate_sim import (
    Scenario,
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

    assert gate.main(["--challengers", "30", "--max-sessions", "150", "--out-dir", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    required = {"false_promotion_rate", "false_promotion_se", "alpha", "power_5pt", "power_10pt",
                "median_sessions_to_decision", "challengers", "tau", "margin", "min_sessions", "max_sessions",
                "challenger_per_look", "champion_ratio"}
    assert required <= set(result), f"missing {sorted(required - set(result))}"
    assert result["challengers"] == 30 and result["max_sessions"] == 150
    assert 0.0 <= result["false_promotion_rate"] <= 1.0 and 0.0 <= result["power_10pt"] <= 1.0
    assert (tmp_path / "power_vs_lift.png").stat().st_size > 0
    assert (tmp_path / "config.toml").exists()
