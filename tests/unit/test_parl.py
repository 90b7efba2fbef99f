"""PARL shaping, critical steps and the malformed-tool-call guard on hand-built sessions."""

from __future__ import annotations

import datetime as dt

import pytest

from bench.fixtures import sessions as synthetic
from flywheel.ingest import schema
from flywheel.rewards import config, parl
from flywheel.rewards.session import assemble

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def as_lake_rows(events: list[dict]) -> list[dict]:
    """What the builder sees: ts parsed to datetimes."""
    return [e | {"ts": schema.parse_ts(e["ts"])} for e in events]


def three_subagents_two_finish(version: int = 0) -> synthetic.SessionBuilder:
    b = synthetic.SessionBuilder("s1", T0).begin()
    b.llm_call(version=version)  # main step 1: plans, then spawns 3 in parallel
    for c in ("a", "b", "c"):
        b.spawn(c)
    for _ in range(3):
        b.llm_call(agent="a", parent="main", version=version)
    for _ in range(5):
        b.llm_call(agent="b", parent="main", version=version)
    b.llm_call(agent="c", parent="main", version=version)
    b.finish("a", ok=True)
    b.finish("b", ok=True)
    b.finish("c", ok=False)
    b.llm_call(version=version)  # main step 2: merges
    b.end()
    return b


def part_checks(values: dict[str, float]) -> list[dict]:
    """The verifier's per-part outcomes (task_success about each sub-agent), ts parsed as the builder has them."""
    return [synthetic.outcome("s1", "task_success", v, T0, agent_id=a) | {"ts": T0} for a, v in values.items()]


def test_three_subagents_two_verified() -> None:
    cfg = config.ParlSettings(lambda1=0.2, lambda2=0.4, parallel_cap=4, anneal_start=0, anneal_end=10)
    s = assemble("s1", as_lake_rows(three_subagents_two_finish().events))
    # a and b claim ok, c does not; the checks say a and c solved their parts, b did not
    stats = parl.parl_stats(s, cfg, part_checks({"a": 1.0, "b": 0.0, "c": 1.0}))
    assert (stats.n_spawned, stats.n_finished_ok) == (3, 2), "r_finish counts verified parts, not the children's claims"
    claims_only = parl.parl_stats(s, cfg)
    assert claims_only.n_finished_ok == 0 and claims_only.r_finish == 0.0, "returning text is not finishing"
    off = parl.parl_stats(s, config.ParlSettings(enabled=False), part_checks({"a": 1.0, "b": 1.0, "c": 1.0}))
    assert (off.r_parallel, off.r_finish, off.n_finished_ok) == (0.0, 0.0, 3), "off: no shaping, counts still reported"
    assert stats.r_parallel_raw == pytest.approx(3 / 4)
    assert stats.r_finish_raw == pytest.approx(2 / 3)
    assert stats.r_parallel == pytest.approx(0.2 * 3 / 4) and stats.r_finish == pytest.approx(0.4 * 2 / 3)
    # stage 1: 1 main step + slowest child (b, 5 steps); stage 2: 1 main step -> 7 (total steps would be 11)
    assert stats.critical_steps == 7, stats
    assert len(s.llm_calls) == 11


def test_parallel_reward_is_capped() -> None:
    b = synthetic.SessionBuilder("s2", T0).begin()
    b.llm_call()
    for i in range(9):
        b.spawn(f"c{i}")
    b.end()
    stats = parl.parl_stats(assemble("s2", as_lake_rows(b.events)), config.ParlSettings(parallel_cap=4))
    assert stats.r_parallel_raw == 1.0 and stats.r_finish_raw == 0.0


def test_critical_steps_sums_stages_and_nests() -> None:
    b = synthetic.SessionBuilder("s3", T0).begin()
    b.llm_call()
    b.spawn("x")
    b.spawn("y")
    b.llm_call()  # closes stage 1 (x: 2 steps + its own child z: 3 -> 5; y: 4)
    b.spawn("w")  # stage 2, closed by session end (w: 1)
    b.llm_call(agent="x", parent="main")
    b.spawn("z", agent="x", parent="main")
    b.llm_call(agent="x", parent="main")
    for _ in range(3):
        b.llm_call(agent="z", parent="x")
    for _ in range(4):
        b.llm_call(agent="y", parent="main")
    b.llm_call(agent="w", parent="main")
    b.end()
    s = assemble("s3", as_lake_rows(b.events))
    # main: 2 own steps + stage1 max(x=1+ (z=3) +1 = 5, y=4) + stage2 w=1 = 8
    assert parl.critical_steps(s) == 8


def test_annealing_reaches_exactly_zero_at_its_end() -> None:
    values = [parl.anneal(0.3, t, 2, 12) for t in range(0, 15)]
    assert values[:3] == [0.3, 0.3, 0.3]
    assert values[12] == 0.0 and values[13] == 0.0 and values[14] == 0.0
    assert all(a >= b for a, b in zip(values, values[1:])), values
    assert values[7] == pytest.approx(0.15)
    cfg = config.ParlSettings(lambda1=0.2, lambda2=0.4, anneal_start=0, anneal_end=10)
    late = parl.parl_stats(assemble("s1", as_lake_rows(three_subagents_two_finish(version=10).events)), cfg)
    assert late.r_parallel == 0.0 and late.r_finish == 0.0 and late.lambda1 == 0.0


def test_malformed_tool_call_is_charged_to_the_call_that_made_it() -> None:
    b = synthetic.SessionBuilder("s4", T0).begin()
    first = b.llm_call()
    b.tool(malformed=False)
    second = b.llm_call()
    b.tool(malformed=True)
    b.tool(malformed=True)
    b.end()
    penalties, n = parl.malformed_penalties(assemble("s4", as_lake_rows(b.events)), -0.5)
    assert n == 2
    assert penalties == {second["event_id"]: -1.0}, penalties
    assert first["event_id"] not in penalties


def test_order_inside_an_agent_is_ts_then_seq() -> None:
    """Two emitters (proxy: llm_call, SDK: tool events) with their own seq counters interleave by ts."""
    b = synthetic.SessionBuilder("s5", T0).begin()
    call = b.llm_call()
    b.tool(malformed=True)
    events = as_lake_rows(b.events)
    # the proxy's counter is far ahead of the SDK's: seq alone would put the tool call first
    for e in events:
        if e["event_id"] == call["event_id"]:
            e["seq"] = 1000
    s = assemble("s5", list(reversed(events)))
    types = [e["type"] for e in s.agents["main"]]
    assert types == ["session_start", "llm_call", "tool_call", "tool_result"], types
    penalties, _ = parl.malformed_penalties(s, -0.5)
    assert penalties == {call["event_id"]: -0.5}
