"""The gate's guardrails, its sample-ratio check and its error control over a stream of challengers, on hand-built
session sets (serving/guardrails.py, serving/decision.py, serving/stats.py, serving/promote.py; no services)."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

import pytest

from flywheel.serving.decision import Evidence, GateRule, decide
from flywheel.serving.promote import PromoteConfig, gate_round, rollback_round, stream_alpha
from flywheel.serving.sessions import SessionRecord
from flywheel.serving.stats import Moments, daily_alpha, lord_alpha, lord_gamma, noninferiority, sample_ratio

SPLIT = {"control_share": 0.2, "challenger_share": 0.4}  # champion 0.4: the check expects equal arms
CFG = PromoteConfig(min_sessions=30, max_sessions=2000, alpha=0.05, maturity_s=10.0, **SPLIT)
NOW = 100_000.0


def _arm(version: int, arm: str, n: int, seed: int, rate: float = 0.3, malformed: float = 0.02, calls: int = 1,
         tokens: float = 300.0, slow: float = 1.0, judge: float | None = None, status: str = "ok",
         start: float = 1000.0) -> list[SessionRecord]:
    """n sessions: success at `rate`; `calls` tool calls each, each malformed with probability `malformed`; about
    `tokens` tokens; latency 4-6 s times `slow`; a judge score around `judge` (None: not judged)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = start + 2 * i
        bad = sum(rng.random() < malformed for _ in range(calls))
        score = None if judge is None else min(5.0, max(1.0, round(rng.gauss(judge, 0.7))))
        out.append(SessionRecord(f"{arm}-{version}-{seed}-{i}", "t", version, arm, t,
                                 t + slow * (4.0 + 2.0 * rng.random()), status, float(rng.random() < rate), t + 8,
                                 malformed=bad, tool_calls=calls, tokens=int(rng.gauss(tokens, 0.2 * tokens)),
                                 judge=score))
    return out


def _round(challenger: list[SessionRecord], champion: list[SessionRecord] | None = None,
           cfg: PromoteConfig = CFG) -> tuple[str, str, dict[str, float]]:
    champion = champion if champion is not None else _arm(1, "champion", 400, 1)
    d = gate_round(1, 2, champion + challenger, None, cfg, NOW)
    return d.action, d.reason, d.numbers


def test_a_better_challenger_within_every_margin_is_promoted_and_says_so() -> None:
    action, reason, numbers = _round(_arm(2, "challenger", 400, 2, rate=0.7))
    assert action == "promote" and "every guardrail within its margin" in reason, reason
    for name in ("errors", "malformed", "slow", "tokens"):
        assert numbers[f"online_guard_{name}_ok"] == 1.0, (name, numbers)
        for key in ("a", "b", "margin", "stat", "threshold", "se", "ci_low", "ci_high", "n_a", "n_b"):
            assert f"online_guard_{name}_{key}" in numbers, (name, key)
    assert numbers["online_guard_judge_applies"] == 0.0, "no session was judged: the judge guardrail does not apply"
    assert numbers["online_srm_mismatch"] == 0.0 and 0.45 < numbers["online_srm_observed_b"] < 0.55, numbers


@pytest.mark.parametrize("name,changes", [
    ("malformed", {"malformed": 0.25}),  # a reward hacker: +40 points of success, a quarter of its calls broken
    ("tokens", {"tokens": 700.0}),  # more than twice the cost
    ("slow", {"slow": 2.0}),  # every session twice as slow
])
def test_a_better_challenger_beyond_one_guardrail_is_rejected_naming_it(name: str, changes: dict[str, float]) -> None:
    action, reason, numbers = _round(_arm(2, "challenger", 400, 3, rate=0.7, **changes))  # type: ignore[arg-type]
    assert action == "reject" and f"guardrail breached: {name}" in reason, reason
    assert numbers[f"online_guard_{name}_breach"] == 1.0, numbers


def test_within_the_margin_but_not_shown_is_not_a_promotion() -> None:
    # 3 points more malformed calls against a 4-point margin: not a breach, but at 60 sessions a side far from shown
    champion = _arm(1, "champion", 60, 4, malformed=0.07)
    action, reason, _ = _round(_arm(2, "challenger", 60, 5, rate=0.9, malformed=0.10), champion)
    assert action == "hold" and "not yet shown within its margin: malformed" in reason, reason


def test_the_malformed_guardrail_is_a_share_of_tool_calls_not_of_sessions() -> None:
    # three calls a session, one in ten malformed: 27% of sessions have one, but the share of calls is 10%
    champion = _arm(1, "champion", 400, 6, malformed=0.10, calls=3)
    _, _, numbers = _round(_arm(2, "challenger", 400, 7, rate=0.7, malformed=0.10, calls=3), champion)
    assert 0.07 < numbers["online_guard_malformed_a"] < 0.13, numbers["online_guard_malformed_a"]


def test_the_judge_guardrail_applies_once_sessions_are_judged() -> None:
    champion = _arm(1, "champion", 400, 8, judge=4.0)
    action, reason, numbers = _round(_arm(2, "challenger", 400, 9, rate=0.7, judge=2.5), champion)
    assert action == "reject" and "guardrail breached: judge" in reason, reason
    assert numbers["online_guard_judge_a"] == pytest.approx(4.0, abs=0.2), "the score reads as the judge gives it"
    action, _, _ = _round(_arm(2, "challenger", 400, 9, rate=0.7, judge=4.0), champion)
    assert action == "promote"


def test_a_guardrail_left_out_of_the_config_does_not_decide() -> None:
    no_tokens = dataclasses.replace(CFG, guardrails={k: v for k, v in CFG.guardrails.items() if k != "tokens"})
    action, _, numbers = _round(_arm(2, "challenger", 400, 3, rate=0.7, tokens=700.0), cfg=no_tokens)
    assert action == "promote" and "online_guard_tokens_ok" not in numbers


def test_a_champion_that_breaches_a_guardrail_against_the_control_is_rolled_back() -> None:
    control = _arm(0, "control", 400, 10)
    assert rollback_round(2, control + _arm(2, "champion", 400, 11), CFG, None, NOW).action == "keep"
    d = rollback_round(2, control + _arm(2, "champion", 400, 12, malformed=0.30), CFG, None, NOW)
    assert d.action == "rollback" and "guardrail breached against the control: malformed" in d.reason, d.reason


# ---------------------------------------------------------------------------------------------
# The sample-ratio check
# ---------------------------------------------------------------------------------------------
def test_a_split_unlike_the_routers_halts_the_decision() -> None:
    # the router gives both arms 40%; a third of the challenger's sessions never reached the lake
    action, reason, numbers = _round(_arm(2, "challenger", 260, 13, rate=0.9))
    assert action == "halt" and "sample ratio mismatch" in reason, reason
    assert numbers["online_srm_log_lr"] >= numbers["online_srm_threshold"], numbers
    # the same sessions under a split that gives the challenger 260 / 660 of the two arms: no mismatch
    skewed = dataclasses.replace(CFG, control_share=0.0, challenger_share=260 / 660)
    assert _round(_arm(2, "challenger", 260, 13, rate=0.9, malformed=0.01), cfg=skewed)[0] == "promote"


def test_the_split_counts_every_routed_session_errored_or_still_open() -> None:
    # 400 against 400 routed, but 150 of the challenger's ended in an error: excluded from the comparison, still
    # routed to it, so no mismatch (the error guardrail speaks to them)
    challenger = _arm(2, "challenger", 250, 14, rate=0.7) + _arm(2, "challenger", 150, 15, status="error",
                                                                   start=1001.0)
    action, reason, numbers = _round(challenger)
    assert numbers["online_srm_n_b"] == 400 and numbers["online_srm_mismatch"] == 0.0, numbers
    assert action == "reject" and "error" in reason, reason


def test_the_sample_ratio_check_errs_at_most_srm_alpha_however_often_it_looks() -> None:
    rng = random.Random(0)
    runs, alpha, halted = 2000, 0.05, 0
    for _ in range(runs):
        n_a = n_b = 0
        for _look in range(40):  # a look every 15 sessions, to 600
            for _ in range(15):
                if rng.random() < 0.5:
                    n_b += 1
                else:
                    n_a += 1
            if sample_ratio(n_a, n_b, 0.5, alpha).mismatch:
                halted += 1
                break
    assert halted / runs <= alpha, f"false alarms {halted / runs:.3f} > {alpha} over 40 looks"
    assert sample_ratio(300, 200, 0.5, 0.05).mismatch and not sample_ratio(260, 240, 0.5, 0.05).mismatch


# ---------------------------------------------------------------------------------------------
# Non-inferiority and the stream's levels
# ---------------------------------------------------------------------------------------------
def test_a_relative_margin_is_the_linear_hypothesis_b_below_one_plus_margin_times_a() -> None:
    a, b = Moments.of([100.0] * 50 + [140.0] * 50), Moments.of([130.0] * 50 + [170.0] * 50)
    t = noninferiority(a, b, 0.25, relative=True)
    assert t is not None and t.limit == pytest.approx(150.0) and t.contrast == pytest.approx(0.0)
    assert t.z_ok == pytest.approx(0.0)
    assert noninferiority(a, b, 0.5, relative=True).z_ok > 5  # type: ignore[union-attr]


def test_lord_levels_follow_the_formula_and_grow_after_a_promotion() -> None:
    alpha = 0.05
    assert lord_alpha(1, [], alpha) == pytest.approx(lord_gamma(1) * alpha / 2)
    assert lord_alpha(5, [], alpha) == pytest.approx(lord_gamma(5) * alpha / 2)
    after = lord_alpha(5, [3], alpha)
    assert after == pytest.approx(lord_gamma(5) * alpha / 2 + (alpha - alpha / 2) * lord_gamma(2))
    assert lord_alpha(6, [3, 5], alpha) == pytest.approx(
        lord_gamma(6) * alpha / 2 + alpha / 2 * lord_gamma(3) + alpha * lord_gamma(1))
    assert sum(lord_alpha(i, [], alpha) for i in range(1, 5000)) < alpha / 2
    assert sum(daily_alpha(i, alpha) for i in range(1, 10_000)) == pytest.approx(alpha, rel=1e-3)


@dataclass
class _Version:
    policy_version: int
    tags: dict[str, str] = field(default_factory=dict)


class _Registry:
    def __init__(self, n: int) -> None:
        self._versions = [_Version(v) for v in range(1, n + 1)]

    def versions(self) -> list[_Version]:
        return self._versions

    def tag_version(self, version: int, tags: dict[str, object]) -> None:
        self._versions[version - 1].tags.update({k: str(v) for k, v in tags.items()})


def test_each_challenger_gets_its_level_once_and_keeps_it() -> None:
    registry = _Registry(4)
    lord = dataclasses.replace(CFG, stream="lord")
    assert stream_alpha(CFG, registry, 1) is None, "per-challenger: the rule's alpha"  # type: ignore[arg-type]
    first = stream_alpha(lord, registry, 1)  # type: ignore[arg-type]
    assert first == pytest.approx(lord_alpha(1, [], 0.05))
    assert stream_alpha(lord, registry, 1) == first, "a running test's level never moves"  # type: ignore[arg-type]
    registry.tag_version(1, {"gate_decision": "promote"})
    second = stream_alpha(lord, registry, 2)  # type: ignore[arg-type]
    assert registry.versions()[1].tags["gate_stream_index"] == "2"
    assert second == pytest.approx(lord_alpha(2, [1], 0.05)) and second > lord_alpha(2, [], 0.05)
    daily = dataclasses.replace(CFG, stream="daily")
    assert stream_alpha(daily, registry, 3) == pytest.approx(daily_alpha(3, 0.05))  # type: ignore[arg-type]


def test_a_hand_built_evidence_without_guardrail_values_decides_on_the_primary_alone() -> None:
    ev = Evidence()
    for i in range(100):
        ev.add("a", "t", float(i % 5 == 0))
        ev.add("b", "t", float(i % 5 < 4))
    verdict = decide(ev, GateRule(min_sessions=30, max_sessions=200))
    assert verdict.action == "promote" and all(not g.applies for g in verdict.guards), verdict
    assert math.isnan(verdict.numbers.get("srm_log_lr", math.nan)), "no split known: no sample-ratio check"


def test_read_sessions_takes_the_guardrails_columns_from_the_lake(tmp_path: pytest.TempPathFactory) -> None:
    import datetime as dt

    from bench.fixtures.episodes import episode_row, write_episodes
    from bench.fixtures.sessions import LakeFeeder, SessionBuilder
    from flywheel.serving.sessions import read_sessions

    root = str(tmp_path) + "/lake"  # type: ignore[operator]
    t0 = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc)
    b = SessionBuilder("s", t0).begin()
    b.llm_call(version=1, arm="champion", n_prompt=20, n_completion=5)
    b.tool(malformed=True)
    b.tool()
    b.llm_call(version=1, arm="champion", n_prompt=30, n_completion=7)
    b.spawn("child")
    b.tool(agent="child", parent=b.main, malformed=True)  # a sub-agent's malformed call is the session's too
    b.end()
    LakeFeeder(root).write("events", b.events)
    write_episodes(root, [episode_row(reward=1.0, session_id="s", label_version=1) | {"judge_score": 2},
                          episode_row(reward=1.0, session_id="s", label_version=2) | {"judge_score": 4}], seq=0)
    plain = read_sessions(root)[0]
    assert (plain.malformed, plain.tool_calls, plain.tokens) == (2, 3, 20 + 5 + 30 + 7), plain
    assert plain.judge is None, "the episodes are read only when the judge guardrail asks"
    assert plain.latency_s == pytest.approx(plain.ended - plain.started)  # type: ignore[operator]
    assert read_sessions(root, judge=True)[0].judge == 2.0, "the first label's score: a tested score never changes"


def test_status_shows_the_challengers_looks_guardrails_and_split() -> None:
    import io

    from rich.console import Console

    from flywheel.serving.promote import print_looks

    cfg = dataclasses.replace(CFG, test="group-sequential", max_sessions=240, looks=3)
    records = _arm(1, "champion", 200, 16) + _arm(2, "challenger", 200, 17, rate=0.32)
    out = io.StringIO()
    print_looks(Console(file=out, width=200), cfg, records, 1, 2, None)
    text = out.getvalue()
    assert "looks at [80, 160, 240]" in text and "now 200 / 200" in text, text
    rows = [line.split("│")[1:3] for line in text.splitlines() if line.startswith("│")]
    assert [(a.strip(), b.strip()) for a, b in rows] == [("1", "80"), ("2", "160")], text
    assert all(name in text for name in ("errors", "malformed", "slow", "tokens")), text
    assert "sample ratio: challenger 200 of 400 (50.0%, expected 50.0%)" in text, text
    assert "gate now: hold: undecided" in text and "next look at 240" in text, text


def test_status_reads_the_running_gates_rule(tmp_path: pytest.TempPathFactory) -> None:
    from pathlib import Path

    from flywheel.base.config import write_resolved
    from flywheel.serving.promote import running_config

    var = Path(str(tmp_path))
    assert running_config(str(var)).test == "msprt", "no gate ran here: the defaults"
    ran = dataclasses.replace(CFG, test="group-sequential", max_sessions=240, guardrails={"malformed": 0.03})
    write_resolved(ran, var / "run" / "promote.toml")
    got = running_config(str(var))
    assert (got.test, got.guardrails, got.challenger_share, got.control_share) == \
        ("group-sequential", {"malformed": 0.03}, 0.4, 0.2)
