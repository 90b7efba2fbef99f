"""Outcome kinds -> r_outcome, and when label 1 of a session is due."""

from __future__ import annotations

import datetime as dt

from flywheel.rewards import config, outcome_rewards

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
CFG = config.parse("""
[outcomes.task_success]
window_s = 600
missing = 0.0
lo = 0.0
hi = 1.0
[outcomes.accepted]
window_s = 60
missing = "drop"
if_true = 0.75
if_false = -0.25
[outcomes.dissatisfied_followup]
weight = 2.0
if_true = -0.5
if_false = 0.0
[task_types.tool_use]
wait_for = ["task_success"]
[task_types.tab]
wait_for = ["accepted"]
""")


def o(kind: str, value: float, sec: int, oid: str) -> dict:
    return {"kind": kind, "value": value, "ts": T0 + dt.timedelta(seconds=sec), "outcome_id": oid}


def test_weighted_sum_and_newest_of_a_kind_wins() -> None:
    task = CFG.task("tool_use")
    score = outcome_rewards.score_outcomes(
        CFG, task, [o("task_success", 0.0, 1, "a"), o("task_success", 1.0, 5, "b"), o("dissatisfied_followup", 1.0, 3, "c")], False)
    assert score.r_outcome == 1.0 + 2.0 * -0.5, score.detail
    assert not score.drop


def test_cursor_tab_accept_and_reject() -> None:
    tab = CFG.task("tab")
    assert outcome_rewards.score_outcomes(CFG, tab, [o("accepted", 1.0, 1, "a")], False).r_outcome == 0.75
    assert outcome_rewards.score_outcomes(CFG, tab, [o("accepted", 0.0, 1, "a")], False).r_outcome == -0.25


def test_missing_rules_apply_only_after_the_window() -> None:
    task = CFG.task("tool_use")
    assert outcome_rewards.label_due(CFG, task, set(), T0, T0 + dt.timedelta(seconds=599)) == (False, False)
    assert outcome_rewards.label_due(CFG, task, set(), T0, T0 + dt.timedelta(seconds=600)) == (True, True)
    assert outcome_rewards.label_due(CFG, task, {"task_success"}, T0, T0) == (True, False)
    closed = outcome_rewards.score_outcomes(CFG, task, [], True)
    assert closed.r_outcome == 0.0 and closed.detail["task_success"]["missing"] == 0.0
    dropped = outcome_rewards.score_outcomes(CFG, CFG.task("tab"), [], True)
    assert dropped.drop and dropped.detail["accepted"] == {"missing": "drop"}


def test_unconfigured_kind_is_recorded_not_rewarded() -> None:
    score = outcome_rewards.score_outcomes(CFG, CFG.task("default"), [o("mystery", 1.0, 1, "a")], False)
    assert score.r_outcome == 0.0 and score.detail["mystery"]["score"] is None


def test_agent_scoped_outcomes() -> None:
    outcomes = [o("task_success", 1.0, 1, "a"), o("accepted", 0.0, 2, "b") | {"agent_id": "kid"}]
    assert outcome_rewards.session_level(outcomes) == outcomes[:1]
    task = CFG.task("tool_use")
    assert outcome_rewards.score_for_agent(CFG, task, outcomes, "kid", False).r_outcome == 1.0 - 0.25
    assert outcome_rewards.score_for_agent(CFG, task, outcomes, "main", False).r_outcome == 1.0
