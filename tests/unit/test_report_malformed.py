"""The report's malformed-call shares: per arm, the final champion's and the control's calls in the final window."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from bench.fixtures.sessions import LakeFeeder, SessionBuilder, outcome
from flywheel.demo import report
from flywheel.serving.sessions import SessionRecord

T0 = 1_700_000_000.0


def _record(sid: str, arm: str, version: int, started: float) -> SessionRecord:
    return SessionRecord(sid, "tool_use.add", version, arm, started, started + 5.0, "ok", 1.0, started + 6.0)


def test_malformed_share_counts_calls_of_the_given_sessions_only() -> None:
    records = [_record("a", "champion", 2, T0), _record("b", "champion", 2, T0)]
    calls = {"a": (3, 1), "b": (1, 0), "other": (10, 10)}
    assert report.malformed_share(records, calls) == (0.25, 4)
    assert report.malformed_share(records, {}) == (None, 0), "no call: no share, not 0%"
    assert report.malformed_share([], calls) == (None, 0)


def test_the_final_window_reports_each_arms_share_of_malformed_calls() -> None:
    sessions = [_record("c1", "champion", 2, T0 + 100), _record("c2", "champion", 2, T0 + 110),
                _record("early", "champion", 2, T0 + 10),  # before the window: not counted
                _record("k1", "control", 0, T0 + 100), _record("k2", "control", 0, T0 + 120),
                _record("ch", "challenger", 3, T0 + 100)]
    calls = {"c1": (2, 0), "c2": (2, 1), "early": (5, 5), "k1": (1, 1), "k2": (3, 1), "ch": (4, 4)}
    facts = report.Facts(sessions=sessions, tool_calls=calls, champion=2, champion_promoted_at=T0 + 50)
    out = report.measurement(facts, final_since=T0 + 60, control_version=0)
    got = {k: out[k] for k in ("malformed_share_champion_final", "n_calls_champion_final",
                                "malformed_share_control_final", "n_calls_control_final")}
    assert got == {"malformed_share_champion_final": 0.25, "n_calls_champion_final": 4,
                   "malformed_share_control_final": 0.5, "n_calls_control_final": 4}, got
    without = report.measurement(facts, final_since=None)
    assert without["malformed_share_champion_final"] is None and without["n_calls_control_final"] is None


def test_lake_facts_reads_every_tool_call_of_a_session_sub_agents_included(tmp_path: Path) -> None:
    start = dt.datetime.fromtimestamp(T0, dt.timezone.utc)
    events, outcomes = [], []
    for sid, marks in (("s1", (True, False)), ("s2", (False,))):
        b = SessionBuilder(sid, start, task_type="tool_use.add").begin()
        b.llm_call(version=0, arm="control")
        for malformed in marks:
            b.tool(malformed=malformed)
        if sid == "s1":
            b.spawn("child")
            b.tool(agent="child", parent="main", malformed=True)
        end = b.end()
        events += b.events
        outcomes.append(outcome(sid, "task_success", 1.0, end + dt.timedelta(seconds=1)))
    feeder = LakeFeeder(str(tmp_path / "lake"))
    feeder.write("events", events)
    feeder.write("outcomes", outcomes)
    facts = report.lake_facts(str(tmp_path / "lake"))
    assert facts.tool_calls == {"s1": (3, 2), "s2": (1, 0)}, facts.tool_calls
