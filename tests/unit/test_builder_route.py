"""The builder's routing decision (`builder.route`) on hand-built sessions, outcomes and index rows.

No lake, no state: each test states the pass clock and checks which sessions are labelled, which
stay pending, which emitted sessions are relabelled, which outcomes are held and what is dropped.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from flywheel.rewards import config
from flywheel.rewards.builder import Routing, route

T0 = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)
TOML = """
[outcomes.task_success]
window_s = 600
missing = 0.0
[outcomes.tests_passed]
window_s = 60
missing = "drop"
[task_types.tool_use]
wait_for = ["task_success"]
[task_types.strict]
wait_for = ["tests_passed"]
[join]
end_grace_s = 5
session_idle_timeout_s = 1800
unknown_session_hold_s = 300
relabel_horizon_s = 86400
"""


@pytest.fixture
def rewards() -> config.RewardConfig:
    return config.parse(TOML)


def at(s: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=s)


def session(sid: str, ended: bool = True, task_type: str = "tool_use", calls: int = 2) -> list[dict[str, Any]]:
    """Events one second apart: start, `calls` llm_calls, and a session_end when `ended`."""
    types = ["session_start"] + ["llm_call"] * calls + (["session_end"] if ended else [])
    return [{"event_id": f"{sid}-e{i}", "session_id": sid, "agent_id": "main", "parent_agent_id": None, "seq": i,
             "ts": at(i), "type": t, "task_type": task_type if t == "session_start" else None,
             "status": "ok" if t == "session_end" else None} for i, t in enumerate(types)]


def outcome(sid: str, oid: str, kind: str = "task_success", value: float = 1.0, held_since: dt.datetime = T0,
            agent_id: str | None = None) -> dict[str, Any]:
    return {"outcome_id": oid, "session_id": sid, "agent_id": agent_id, "kind": kind, "value": value, "ts": held_since,
            "source": "verifier", "held_since": held_since}


def emitted(sid: str, label: int = 1, applied: tuple[str, ...] = (), expires: dt.datetime = at(86400)) -> dict[str, Any]:
    """An index row of a session emitted before (label 0: dropped at label 1)."""
    return {"session_id": sid, "label_version": label, "expires_ts": expires,
            "outcomes": json.dumps([{"outcome_id": o} for o in applied])}


def due_ids(r: Routing) -> list[str]:
    return [d.session.session_id for d in r.due]


def test_session_with_its_outcome_is_due_and_takes_the_outcome(rewards: config.RewardConfig) -> None:
    o = outcome("s1", "o1")
    r = route({"s1": session("s1")}, {}, [o], at(60), rewards)
    assert due_ids(r) == ["s1"] and r.pending == set() and r.held == [], r
    (d,) = r.due
    assert d.outcomes == [o] and d.drop is None and not d.window_closed
    assert (d.end_how, d.end_ts) == ("session_end", at(3)), (d.end_how, d.end_ts)


def test_open_session_stays_pending_and_its_outcomes_are_held(rewards: config.RewardConfig) -> None:
    o = outcome("s1", "o1")
    r = route({"s1": session("s1", ended=False)}, {}, [o], at(60), rewards)
    assert r.due == [] and r.pending == {"s1"} and r.held == [o], r


def test_end_grace_keeps_a_just_ended_session_pending(rewards: config.RewardConfig) -> None:
    events, o = session("s1"), outcome("s1", "o1")
    assert route({"s1": events}, {}, [o], at(3 + 4), rewards).pending == {"s1"}, "4 s after the last event, grace is 5 s"
    assert due_ids(route({"s1": events}, {}, [o], at(3 + 5), rewards)) == ["s1"]


def test_missing_outcome_waits_for_its_window_then_counts_as_missing(rewards: config.RewardConfig) -> None:
    events = {"s1": session("s1")}
    assert route(events, {}, [], at(3 + 599), rewards).pending == {"s1"}, "task_success's window is 600 s"
    r = route(events, {}, [], at(3 + 600), rewards)
    assert due_ids(r) == ["s1"] and r.due[0].window_closed and r.due[0].drop is None, r


def test_session_without_end_ends_at_the_idle_timeout(rewards: config.RewardConfig) -> None:
    events = {"s1": session("s1", ended=False)}
    assert route(events, {}, [], at(2 + 1799), rewards).pending == {"s1"}
    r = route(events, {}, [outcome("s1", "o1")], at(2 + 1800), rewards)
    (d,) = r.due
    assert (d.end_how, d.end_ts) == ("idle_timeout", at(2 + 1800)), (d.end_how, d.end_ts)


def test_agent_outcome_does_not_satisfy_the_sessions_wait(rewards: config.RewardConfig) -> None:
    o = outcome("s1", "o1", agent_id="main")
    r = route({"s1": session("s1")}, {}, [o], at(60), rewards)
    assert r.pending == {"s1"} and r.held == [o], r


def test_drop_rule_and_no_llm_calls_are_due_as_drops(rewards: config.RewardConfig) -> None:
    events = {"strict": session("strict", task_type="strict"), "empty": session("empty", calls=0)}
    r = route(events, {}, [outcome("empty", "o1")], at(3 + 60), rewards)
    assert {d.session.session_id: d.drop for d in r.due} == {"strict": "missing_outcome", "empty": "no_llm_calls"}, r.due
    assert r.drops == {"session_missing_outcome": 1, "session_no_llm_calls": 1}, r.drops


def test_events_of_an_emitted_session_are_dropped_as_late(rewards: config.RewardConfig) -> None:
    late = session("s1")[:2]
    r = route({"s1": late, "s2": session("s2")}, {"s1": emitted("s1")}, [outcome("s2", "o2")], at(60), rewards)
    assert due_ids(r) == ["s2"] and r.pending == set() and r.late_sessions == ["s1"], r
    assert r.drops == {"late_event": 2}, r.drops


def test_outcomes_of_emitted_sessions_relabel_or_drop_by_reason(rewards: config.RewardConfig) -> None:
    index = {"live": emitted("live", applied=("old",)), "gone": emitted("gone", label=0),
             "expired": emitted("expired", expires=at(100))}
    new = outcome("live", "new")
    outcomes = [outcome("live", "old"), new, outcome("gone", "g"), outcome("expired", "x")]
    r = route({}, index, outcomes, at(101), rewards)
    assert r.relabel == {"live": [new]}, r.relabel
    assert r.drops == {"duplicate_outcome": 1, "session_dropped": 1, "too_late": 1}, r.drops
    assert r.due == [] and r.held == [], r


def test_outcome_of_an_unseen_session_is_held_then_dropped(rewards: config.RewardConfig) -> None:
    o = outcome("ghost", "o1", held_since=T0)
    kept = route({}, {}, [o], at(299), rewards)
    assert kept.held == [o] and not kept.drops, kept
    gone = route({}, {}, [o], at(300), rewards)
    assert gone.held == [] and gone.expired == [o] and gone.drops == {"unknown_session": 1}, gone


def test_due_sessions_come_in_session_id_order_and_inputs_are_not_changed(rewards: config.RewardConfig) -> None:
    by_session = {sid: session(sid) for sid in ("c", "a", "b")}
    by_session["late"] = session("late")
    before = {sid: list(events) for sid, events in by_session.items()}
    r = route(by_session, {"late": emitted("late")}, [outcome(s, f"o-{s}") for s in "cab"], at(60), rewards)
    assert due_ids(r) == ["a", "b", "c"], due_ids(r)
    assert by_session == before, "route must not change the events it was handed"


def test_merge_outcomes_keeps_the_first_copy_in_lake_order() -> None:
    from flywheel.rewards.builder import merge_outcomes

    def row(oid: str, offset: int) -> dict[str, Any]:
        return outcome("s1", oid) | {"_topic": "flywheel.outcomes", "_partition": 0, "_offset": offset, "value": offset}

    held = [{"outcome_id": "h", "session_id": "s1", "ts": T0.isoformat(), "held_since": T0.isoformat()}]
    held_py, fresh, duplicates = merge_outcomes(held, [row("a", 2), row("h", 0), row("a", 1)], at(10))
    assert held_py[0]["held_since"] == T0, "held records come back with datetimes"
    assert [(o["outcome_id"], o["value"]) for o in fresh] == [("a", 1)], fresh
    assert duplicates == 2 and fresh[0]["held_since"] == at(10)


def test_copies_of_a_labelled_sessions_events_are_duplicates_and_only_new_ones_late(rewards: config.RewardConfig) -> None:
    events = session("s1")
    index = {"s1": emitted("s1") | {"event_ids": [e["event_id"] for e in events]}}
    copies = route({"s1": events}, index, [], at(60), rewards)
    assert copies.drops == {"duplicate_event": 4} and copies.late_sessions == [], (copies.drops, copies.late_sessions)
    assert copies.due == [] and copies.pending == set(), "a copy must not reopen a labelled session"
    new = dict(events[1], event_id="s1-new")
    mixed = route({"s1": events[:2] + [new]}, index, [], at(60), rewards)
    assert mixed.drops == {"duplicate_event": 2, "late_event": 1} and mixed.late_sessions == ["s1"], mixed.drops


def test_label_1_index_row_keeps_every_event_id_of_every_agent(rewards: config.RewardConfig) -> None:
    from flywheel.rewards.labels import label_1_index_row

    events = session("s1")
    child = [dict(events[1], event_id="s1-kid", agent_id="kid", parent_agent_id="main", seq=0)]
    (d,) = route({"s1": events + child}, {}, [outcome("s1", "o1")], at(60), rewards).due
    row = label_1_index_row(d, rewards.task("tool_use"), rewards.join.relabel_horizon_s)
    assert row["event_ids"] == sorted([e["event_id"] for e in events] + ["s1-kid"]), row["event_ids"]
