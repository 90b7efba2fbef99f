"""Per-turn credit (rewards/turns.py) on hand-built sessions, through the episode builder with the shipped rewards.toml."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pytest

from bench.fixtures import sessions as synthetic
from flywheel.ingest import lake, schema
from flywheel.rewards import builder as episodes
from flywheel.rewards import config, turns
from flywheel.rewards.session import assemble

T0 = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)


def at(s: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=s)


def retry_session() -> tuple[synthetic.SessionBuilder, dict[str, str], dt.datetime]:
    """A wrong call, a malformed one, a right one, then the answer; returns the llm_call ids by role."""
    b = synthetic.SessionBuilder("s1", T0, task_type="tool_use.add").begin()
    ids = {"wrong": b.llm_call()["event_id"]}
    ids["wrong_call"] = b.tool()
    ids["malformed"] = b.llm_call()["event_id"]
    b.tool(malformed=True)
    ids["right"] = b.llm_call()["event_id"]
    ids["right_call"] = b.tool()
    ids["answer"] = b.llm_call()["event_id"]
    return b, ids, b.end()


def test_each_llm_call_owns_the_calls_logged_after_it() -> None:
    b, ids, _ = retry_session()
    made = turns.turns(assemble("s1", [e | {"ts": schema.parse_ts(e["ts"])} for e in b.events]))
    assert made[ids["wrong"]] == turns.ToolTurn((ids["wrong_call"],), 0)
    assert made[ids["malformed"]] == turns.ToolTurn((), 1)
    assert made[ids["answer"]] == turns.ToolTurn(), "the answer turn made no call: nothing but the verifier checks it"


def test_without_turn_kinds_nothing_is_turn_credited() -> None:
    cfg = config.parse("[outcomes.call_correct]\nlo = 0.0\nhi = 1.0\n[task_types.x]\n")
    assert turns.credit(cfg, cfg.task("x"), turns.ToolTurn(("c1",), 1), {}).r_turn is None


@pytest.fixture
def builder(tmp_path: Path) -> tuple[episodes.Builder, synthetic.LakeFeeder, str]:
    root = str(tmp_path / "lake")
    cfg = episodes.EpisodesConfig(lake_root=root, state_dir=str(tmp_path / "state"), var_dir=str(tmp_path / "var"))
    b = episodes.Builder(cfg, config.load())  # the shipped rewards.toml: tool_use has turn_kinds = ["call_correct"]
    yield b, synthetic.LakeFeeder(root), root
    b.close()


def rows(root: str) -> list[dict]:
    return pa.concat_tables([lake.read_file(root, f) for f in lake.list_files(root, "episodes")]).to_pylist()


def test_a_verified_turn_is_rewarded_by_its_check_and_the_answer_by_the_session(builder) -> None:
    b, feed, root = builder
    sb, ids, end = retry_session()
    feed.write("events", sb.events)
    feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, at(20)),
                            synthetic.outcome("s1", "call_correct", 0.0, at(20), agent_id="main", call_id=ids["wrong_call"]),
                            synthetic.outcome("s1", "call_correct", 1.0, at(20), agent_id="main", call_id=ids["right_call"])])
    b.run_pass(now=end + dt.timedelta(seconds=30))
    by_id = {r["episode_id"]: r for r in rows(root)}
    wrong, malformed, right, answer = (by_id[ids[k]] for k in ("wrong", "malformed", "right", "answer"))
    assert (wrong["r_turn"], wrong["reward"]) == (0.0, 0.0), "a wrong call earns nothing from the session a retry rescued"
    assert malformed["r_turn"] == 0.0 and malformed["reward"] == pytest.approx(-0.5), "a malformed call is a failed turn"
    assert (right["r_turn"], right["reward"]) == (1.0, 1.0)
    assert answer["r_turn"] is None and answer["reward"] == 1.0, "nothing verified the answer turn but the session outcome"
    assert all(r["r_outcome"] == 1.0 for r in by_id.values()), "r_outcome still records the session's outcome"


def test_a_late_turn_check_relabels_the_row(builder) -> None:
    b, feed, root = builder
    sb, ids, end = retry_session()
    feed.write("events", sb.events)
    feed.write("outcomes", [synthetic.outcome("s1", "task_success", 0.0, at(20))])
    b.run_pass(now=end + dt.timedelta(seconds=30))
    first = {r["episode_id"]: r for r in rows(root) if r["label_version"] == 1}
    assert first[ids["right"]]["r_turn"] is None and first[ids["right"]]["reward"] == 0.0, "unchecked: the session's 0"
    feed.write("outcomes", [synthetic.outcome("s1", "call_correct", 1.0, at(40), agent_id="main", call_id=ids["right_call"])])
    b.run_pass(now=end + dt.timedelta(seconds=60))
    second = {r["episode_id"]: r for r in rows(root) if r["label_version"] == 2}
    assert second[ids["right"]]["r_turn"] == 1.0 and second[ids["right"]]["reward"] == 1.0
    assert second[ids["answer"]]["reward"] == 0.0 and second[ids["malformed"]]["reward"] == pytest.approx(-0.5)


def test_an_outcome_about_one_call_never_counts_for_the_session() -> None:
    from flywheel.rewards import outcome_rewards

    call = {"kind": "task_success", "value": 1.0, "agent_id": None, "call_id": "c1", "ts": T0, "outcome_id": "o"}
    assert outcome_rewards.session_level([call]) == []
    cfg = config.load()
    assert outcome_rewards.score_for_agent(cfg, cfg.task("tool_use"), [call], "main", False).r_outcome == 0.0


def test_a_v1_outcome_may_not_name_a_call() -> None:
    record = synthetic.outcome("s1", "call_correct", 1.0, T0, call_id="c1")
    assert schema.validate_outcome(record)["call_id"] == "c1"
    with pytest.raises(schema.SchemaError, match="call_id"):
        schema.validate_outcome(record | {"schema_version": 1})


def test_an_agent_that_never_answered_is_not_paid_for_its_last_call(builder) -> None:
    b, feed, root = builder
    sb = synthetic.SessionBuilder("s2", T0, task_type="tool_use.add").begin()
    first = sb.llm_call()["event_id"]
    first_call = sb.tool()
    last = sb.llm_call()["event_id"]
    last_call = sb.tool()  # out of turns: no answer
    end = sb.end()
    feed.write("events", sb.events)
    feed.write("outcomes", [synthetic.outcome("s2", "task_success", 0.0, at(20)),
                            synthetic.outcome("s2", "call_correct", 1.0, at(20), agent_id="main", call_id=first_call),
                            synthetic.outcome("s2", "call_correct", 1.0, at(20), agent_id="main", call_id=last_call)])
    b.run_pass(now=end + dt.timedelta(seconds=30))
    by_id = {r["episode_id"]: r for r in rows(root)}
    assert by_id[first]["r_turn"] == 1.0, "the right call earlier in the session keeps its credit"
    assert by_id[last]["r_turn"] == 0.0 and by_id[last]["reward"] == 0.0, "the last turn is capped by the outcome"


def test_a_sub_agents_own_outcome_beats_the_sessions_whatever_the_order() -> None:
    from flywheel.rewards import outcome_rewards

    cfg = config.load()
    task = cfg.task("tool_use.multi")
    session = {"kind": "task_success", "value": 0.0, "ts": at(2), "outcome_id": "a"}
    part = {"kind": "task_success", "value": 1.0, "ts": at(1), "outcome_id": "b", "agent_id": "sub-1"}
    assert outcome_rewards.score_for_agent(cfg, task, [session, part], "sub-1", False).r_outcome == 1.0
    assert outcome_rewards.score_for_agent(cfg, task, [session, part], "sub-2", False).r_outcome == 0.0
