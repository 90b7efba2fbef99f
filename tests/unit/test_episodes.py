"""The episode builder's join on a tmp_path lake: every outcome timing gives its documented result.

Lake files are written as the lake writer writes them (rewards.synthetic.LakeFeeder); each pass
runs with an explicit clock, so window decisions are exact.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.fixtures import sessions as synthetic
from flywheel.ingest import lake
from flywheel.rewards import builder as episodes
from flywheel.rewards import config

T0 = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)
TOML = """
[outcomes.task_success]
window_s = 600
missing = 0.0
lo = 0.0
hi = 1.0
[outcomes.accepted]
window_s = 60
missing = "ignore"
if_true = 0.75
if_false = -0.25
[outcomes.tests_passed]
window_s = 60
missing = "drop"
[task_types.tool_use]
wait_for = ["task_success"]
[task_types.strict]
wait_for = ["tests_passed"]
[penalties]
malformed_tool_call = -0.5
[join]
session_idle_timeout_s = 1800
unknown_session_hold_s = 300
relabel_horizon_s = 86400
"""


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.root = str(tmp / "lake")
        self.feed = synthetic.LakeFeeder(self.root)
        self.cfg = episodes.EpisodesConfig(lake_root=self.root, state_dir=str(tmp / "state"), var_dir=str(tmp / "var"))
        self.rewards = config.parse(TOML)
        self.builder = episodes.Builder(self.cfg, self.rewards)

    def session(self, sid: str, ended: bool = True, calls: int = 2, task_type: str = "tool_use") -> tuple[list[dict], dt.datetime]:
        b = synthetic.SessionBuilder(sid, T0, task_type=task_type).begin()
        for _ in range(calls):
            b.llm_call()
            b.tool()
        end = b.end() if ended else T0 + dt.timedelta(seconds=10)
        return b.events, end

    def restart(self) -> episodes.Builder:
        """A new builder process on the same state: the old one stops first (it holds the state's lock)."""
        self.builder.close()
        self.builder = episodes.Builder(self.cfg, self.rewards)
        return self.builder

    def run(self, at: dt.datetime) -> episodes.PassResult:
        return self.builder.run_pass(now=at)

    def rows(self) -> list[dict]:
        files = lake.list_files(self.root, "episodes")
        if not files:
            return []
        return pa.concat_tables([lake.read_file(self.root, f) for f in files]).to_pylist()

    def labels(self, sid: str) -> dict[int, list[dict]]:
        out: dict[int, list[dict]] = {}
        for r in self.rows():
            if r["session_id"] == sid:
                out.setdefault(r["label_version"], []).append(r)
        return out

    def counters(self) -> dict[str, int]:
        return self.builder.state.counters


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def after(t: dt.datetime, s: float) -> dt.datetime:
    return t + dt.timedelta(seconds=s)


def test_outcome_before_session_end_is_joined_into_label_1(rig: Rig) -> None:
    events, _ = rig.session("s1", ended=True)
    *body, end_event = events
    rig.feed.write("events", body)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(T0, 5))])
    rig.run(after(T0, 30))
    assert rig.rows() == [], "an open session must not be emitted"
    assert len(rig.builder.state.held_outcomes) == 1
    rig.feed.write("events", [end_event])
    res = rig.run(after(T0, 40))
    labels = rig.labels("s1")
    assert list(labels) == [1] and len(labels[1]) == 2, res
    assert {r["r_outcome"] for r in labels[1]} == {1.0}
    assert rig.builder.state.held_outcomes == []


def test_outcome_after_end_within_window_waits_for_it(rig: Rig) -> None:
    events, end = rig.session("s1")
    rig.feed.write("events", events)
    rig.run(after(end, 10))
    assert rig.rows() == [], "label 1 must wait for task_success within its 600 s window"
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 20))])
    rig.run(after(end, 30))
    labels = rig.labels("s1")
    assert list(labels) == [1] and labels[1][0]["reward"] == 1.0
    assert labels[1][0]["last_outcome_ts"] == after(end, 20)


def test_outcome_after_window_appends_label_2_and_leaves_label_1(rig: Rig) -> None:
    events, end = rig.session("s1")
    rig.feed.write("events", events)
    rig.run(after(end, 601))
    (first_file,) = lake.list_files(rig.root, "episodes")
    digest = hashlib.sha256(Path(first_file.path).read_bytes()).hexdigest()
    label1 = rig.labels("s1")[1]
    assert {r["r_outcome"] for r in label1} == {0.0}, "missing task_success counts as its configured 0.0"
    assert '"missing": 0.0' in label1[0]["reward_detail"]

    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 900))])
    res = rig.run(after(end, 901))
    assert res.relabels == 1
    labels = rig.labels("s1")
    assert sorted(labels) == [1, 2]
    assert [r["episode_id"] for r in labels[2]] == [r["episode_id"] for r in labels[1]]
    assert {r["r_outcome"] for r in labels[2]} == {1.0} and {r["reward"] for r in labels[2]} == {1.0}
    assert hashlib.sha256(Path(first_file.path).read_bytes()).hexdigest() == digest, "label 1's file was rewritten"

    # a third outcome of another kind appends label 3 with both outcomes
    rig.feed.write("outcomes", [synthetic.outcome("s1", "accepted", 0.0, after(end, 950))])
    rig.run(after(end, 960))
    labels = rig.labels("s1")
    assert sorted(labels) == [1, 2, 3]
    assert {r["r_outcome"] for r in labels[3]} == {1.0 - 0.25}


def test_duplicated_outcome_counts_once(rig: Rig) -> None:
    events, end = rig.session("s1")
    rig.feed.write("events", events)
    o = synthetic.outcome("s1", "task_success", 1.0, after(end, 5), outcome_id="dup-1")
    rig.feed.write("outcomes", [o, o])
    rig.run(after(end, 10))
    rig.feed.write("outcomes", [o])  # replayed again after label 1 was emitted
    res = rig.run(after(end, 20))
    assert sorted(rig.labels("s1")) == [1], "a replayed outcome must not create a new label"
    assert res.relabels == 0
    assert rig.counters()["dropped_duplicate_outcome"] == 2, rig.counters()


def test_unknown_session_outcome_is_held_then_dropped(rig: Rig) -> None:
    rig.feed.write("outcomes", [synthetic.outcome("ghost", "task_success", 1.0, T0)])
    rig.run(after(T0, 10))
    assert len(rig.builder.state.held_outcomes) == 1
    rig.run(after(T0, 200))  # still inside the 300 s hold
    assert len(rig.builder.state.held_outcomes) == 1
    rig.feed.write("events", [])  # nothing arrives for it
    rig.run(after(T0, 400))
    assert rig.builder.state.held_outcomes == []
    assert rig.counters().get("dropped_unknown_session") == 1, rig.counters()


def test_outcome_whose_session_arrives_later_is_joined(rig: Rig) -> None:
    events, end = rig.session("s1")
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 1))])
    rig.run(after(end, 2))
    rig.feed.write("events", events)
    rig.run(after(end, 100))
    assert {r["r_outcome"] for r in rig.labels("s1")[1]} == {1.0}


def test_duplicate_events_and_missing_session_end(rig: Rig) -> None:
    events, _ = rig.session("s1", ended=False, calls=3)
    rig.feed.write("events", events + events[:4])  # a replayed batch
    rig.run(after(T0, 60))
    assert rig.rows() == []
    res = rig.run(after(T0, 60 + 1800 + 601))  # idle timeout ends it, then task_success's window closes
    label1 = rig.labels("s1")[1]
    assert len(label1) == 3, f"3 llm_calls expected, got {len(label1)} rows"
    assert '"end": "idle_timeout"' in label1[0]["reward_detail"]
    assert rig.counters()["dropped_duplicate_event"] == 4, res


def test_missing_outcome_with_drop_rule_is_not_emitted(rig: Rig) -> None:
    events, end = rig.session("s1", task_type="strict")
    rig.feed.write("events", events)
    rig.run(after(end, 61))
    assert rig.rows() == []
    assert rig.counters()["dropped_session_missing_outcome"] == 1
    rig.feed.write("outcomes", [synthetic.outcome("s1", "tests_passed", 1.0, after(end, 70))])
    rig.run(after(end, 80))
    assert rig.rows() == [] and rig.counters()["dropped_session_dropped"] == 1


def test_rows_carry_tokens_and_trace_ids(rig: Rig) -> None:
    b = synthetic.SessionBuilder("s1", T0).begin()
    call = b.llm_call(version=3, n_prompt=5, n_completion=4)
    b.tool(malformed=True)
    b.spawn("kid")
    b.llm_call(agent="kid", parent="main", version=3)
    b.finish("kid", ok=True)
    b.context_edit(tokens_removed=50)
    end = b.end()
    rig.feed.write("events", b.events)
    # the verifier checked the kid's part too: r_finish counts it (its finish(ok=True) alone would not)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 1)),
                                synthetic.outcome("s1", "task_success", 1.0, after(end, 1), agent_id="kid")])
    rig.run(after(end, 2))
    rows = {r["episode_id"]: r for r in rig.rows()}
    r = rows[call["event_id"]]
    assert r["prompt_token_ids"] == call["prompt_token_ids"] and r["completion_token_ids"] == call["completion_token_ids"]
    assert r["completion_logprobs"] == pytest.approx(call["completion_logprobs"], abs=1e-6)
    assert r["loss_mask"] == [1, 1, 1, 1] and r["policy_version"] == 3 and r["model"] == "policy-v3"
    assert r["r_penalty"] == -0.5 and r["critical_steps"] == 2
    lam = rig.rewards.parl.lambda1 * (1 - 3 / rig.rewards.parl.anneal_end)
    assert r["r_parallel"] == pytest.approx(lam * 1 / 4) and r["r_finish"] == pytest.approx(lam * 1.0)
    assert r["reward"] == pytest.approx(1.0 - 0.5 + r["r_parallel"] + r["r_finish"])
    kid = [x for x in rows.values() if x["agent_id"] == "kid"][0]
    assert kid["parent_agent_id"] == "main" and kid["r_penalty"] == 0.0
    assert '"context_edits": 1' in r["reward_detail"] and '"context_tokens_removed": 50' in r["reward_detail"]
    (f,) = lake.list_files(rig.root, "episodes")
    assert (f.source, f.partition, f.first, f.last) == ("episodes", 0, 0, 1)
    assert pq.read_schema(f.path).equals(rig.builder.episode_schema, check_metadata=False)


def test_restart_resumes_from_the_cursor(rig: Rig, tmp_path: Path) -> None:
    events, end = rig.session("s1")
    rig.feed.write("events", events)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 1))])
    rig.run(after(end, 2))
    fresh = rig.restart()  # a new process on the same state
    res = fresh.run_pass(now=after(end, 3))
    assert res.idle and res.new_event_rows == 0
    events2, end2 = rig.session("s2")
    rig.feed.write("events", events2)
    rig.feed.write("outcomes", [synthetic.outcome("s2", "task_success", 0.0, after(end2, 1))])
    res = fresh.run_pass(now=after(end2, 2))
    assert res.new_event_rows == len(events2) and res.sessions_emitted == 1
    assert [f.first for f in lake.list_files(rig.root, "episodes")] == [0, 2]


def test_late_events_after_label_are_dropped(rig: Rig) -> None:
    events, end = rig.session("s1")
    rig.feed.write("events", events)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 1))])
    rig.run(after(end, 2))
    straggler = synthetic.SessionBuilder("s1", after(end, 3))
    straggler.llm_call()
    rig.feed.write("events", straggler.events)
    res = rig.run(after(end, 10))
    assert res.rows_written == 0 and rig.counters()["dropped_late_event"] == 1, rig.counters()
    assert rig.builder.state.pending is None or rig.builder.state.pending.num_rows == 0


def test_relabel_after_a_restart(rig: Rig) -> None:
    events, end = rig.session("s1")
    rig.feed.write("events", events)
    rig.run(after(end, 700))
    rig.restart()  # a new process: the emitted set comes from the index
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 800))])
    res = rig.run(after(end, 801))
    assert res.relabels == 1 and sorted(rig.labels("s1")) == [1, 2]


def test_end_grace_waits_for_stragglers(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.rewards = config.parse(TOML.replace("[join]", "[join]\nend_grace_s = 30"))
    rig.restart()
    events, end = rig.session("s1")
    rig.feed.write("events", events)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 1))])
    rig.run(after(end, 5))
    assert rig.rows() == [], "label 1 must wait end_grace_s after the newest event"
    late_call = synthetic.SessionBuilder("s1", after(end, 6))
    late_call.llm_call()
    rig.feed.write("events", late_call.events)
    rig.run(after(end, 40))
    assert len(rig.labels("s1")[1]) == 3, "the proxy's late llm_call belongs to label 1"


def test_rerun_of_a_killed_pass_reuses_its_judge_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The judge is the one input outside the lake: a re-run must not re-ask it and write different rows."""
    from flywheel.rewards import judge as judge_mod
    from flywheel.rewards.state import StateStore

    rig = Rig(tmp_path)
    rig.rewards = config.parse(TOML.replace("[task_types.tool_use]", "[task_types.tool_use]\njudge = true"))
    rig.cfg.judge_url = "http://127.0.0.1:9"  # nothing listens: the first attempt records an error
    rig.restart()
    events, end = rig.session("s1")
    rig.feed.write("events", events)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 1))])

    def killed(self: StateStore, *args: object) -> None:
        raise KeyboardInterrupt("killed before commit")

    monkeypatch.setattr(StateStore, "commit", killed)
    with pytest.raises(KeyboardInterrupt):
        rig.run(after(end, 2))
    first = rig.rows()
    assert len(first) == 2 and {r["r_judge"] for r in first} == {None}
    monkeypatch.undo()

    class Answering(judge_mod.Judge):  # a judge that would now answer 5
        def score(self, text: str, rubric: config.Rubric, deadline: float | None = None) -> judge_mod.JudgeResult:
            return judge_mod.JudgeResult(5, "ok")

    rig.restart()
    rig.builder.judge = Answering(rig.cfg.judge_url, rig.builder.judge.model, rig.rewards.judge, None)
    res = rig.run(after(end, 500))  # the clock passed in is ignored: the intent's clock rules
    strip = lambda rows: sorted((r["episode_id"], r["r_judge"], r["reward_detail"]) for r in rows)  # noqa: E731
    assert res.sessions_emitted == 1
    assert strip(rig.rows()) == strip(first), "the re-run wrote different rows than the killed attempt"
    assert not (tmp_path / "state" / "intent-judge.json").exists()


def test_index_segments_are_compacted_and_still_found(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(episodes, "SEGMENT_COMPACT_AT", 3)
    ends = {}
    for i in range(6):  # six passes, each labelling one session (window closed, task_success missing)
        events, ends[i] = rig.session(f"s{i}")
        rig.feed.write("events", events)
        rig.run(after(ends[i], 601))
    assert len(rig.builder.state.segments) <= 3, rig.builder.state.segments
    seg_files = sorted(p.name for p in (Path(rig.cfg.state_dir) / "segments").iterdir())
    assert seg_files == sorted(rig.builder.state.segments), "retired segments must be deleted"
    rig.restart()
    rig.feed.write("outcomes", [synthetic.outcome("s0", "task_success", 1.0, after(ends[0], 700)),
                                synthetic.outcome("s5", "task_success", 1.0, after(ends[5], 700))])
    res = rig.run(after(ends[5], 701))
    assert res.relabels == 2 and sorted(rig.labels("s0")) == [1, 2] and sorted(rig.labels("s5")) == [1, 2]


def test_compacted_event_files_are_read_past_the_cursor_only(rig: Rig) -> None:
    events_a, _ = rig.session("a", calls=1)
    events_b, end_b = rig.session("b", calls=1)
    (fa,) = rig.feed.write("events", events_a)
    rig.builder.cfg.max_files_per_pass = 1
    rig.run(after(end_b, 601))
    (fb,) = rig.feed.write("events", events_b)
    # compaction (ingest.lake_writer) publishes one file covering both ranges, then deletes the originals
    both = pa.concat_tables([lake.read_file(rig.root, fa), lake.read_file(rig.root, fb)])
    lake.write_file(rig.root, "events", fa.date, fa.source, fa.partition, fa.first, fb.last, both)
    lake.delete_files(rig.root, [fa, fb])
    res = rig.run(after(end_b, 602))
    assert res.new_event_rows == len(events_b), f"read {res.new_event_rows} rows, expected only b's {len(events_b)}"
    assert sorted(r["session_id"] for r in rig.rows()) == ["a", "b"]
    assert rig.counters().get("dropped_duplicate_event", 0) == 0


def test_a_corrupt_lake_file_stops_the_builder_before_its_cursor(rig: Rig) -> None:
    events, end = rig.session("s1")
    (f,) = rig.feed.write("events", events)
    Path(f.path).write_bytes(b"PAR1 not really parquet")
    with pytest.raises(episodes.LakeReadError, match=f.path.split("/")[-1]):
        rig.run(after(end, 700))
    assert rig.builder.state.events_cursor == {}, "the cursor must not move past a file that was not read"
    assert rig.rows() == []


def test_run_follows_in_a_thread_until_stop(rig: Rig) -> None:
    import threading

    events, end = rig.session("s1")
    rig.feed.write("events", events)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 1))])
    rig.cfg.follow, rig.cfg.poll_interval_s = True, 0.05
    done = threading.Event()
    result: list[int] = []
    toml = Path(rig.cfg.state_dir).parent / "r.toml"
    toml.write_text(TOML)
    rig.builder.close()  # run() starts its own builder on this state
    thread = threading.Thread(target=lambda: result.append(episodes.run(rig.cfg, config.load(toml), stop=done.is_set)))
    thread.start()
    deadline = time.monotonic() + 30
    while not rig.rows() and time.monotonic() < deadline:
        time.sleep(0.05)
    done.set()
    thread.join(timeout=30)
    assert result == [0] and len(rig.rows()) == 2


def test_relabel_finds_rows_after_the_episodes_table_was_compacted(rig: Rig) -> None:
    ends = {}
    for sid in ("a", "b"):
        events, ends[sid] = rig.session(sid)
        rig.feed.write("events", events)
        rig.run(after(ends[sid], 601))
    files = lake.list_files(rig.root, "episodes")
    assert len(files) == 2
    merged = pa.concat_tables([lake.read_file(rig.root, f) for f in files])
    lake.write_file(rig.root, "episodes", files[0].date, "episodes", 0, files[0].first, files[-1].last, merged)
    lake.delete_files(rig.root, files)
    rig.feed.write("outcomes", [synthetic.outcome("a", "task_success", 1.0, after(ends["b"], 700))])
    res = rig.run(after(ends["b"], 701))
    assert res.relabels == 1 and {r["r_outcome"] for r in rig.labels("a")[2]} == {1.0}


def test_outcome_about_one_agent_counts_for_its_rows_only(rig: Rig) -> None:
    b = synthetic.SessionBuilder("s1", T0).begin()
    b.llm_call()
    b.spawn("kid")
    b.llm_call(agent="kid", parent="main")
    b.finish("kid", ok=True)
    end = b.end()
    rig.feed.write("events", b.events)
    kid_outcome = synthetic.outcome("s1", "accepted", 0.0, after(end, 1)) | {"agent_id": "kid"}
    rig.feed.write("outcomes", [kid_outcome])
    rig.run(after(end, 2))
    assert rig.rows() == [], "an outcome about a sub-agent must not satisfy the session's wait for task_success"
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 3))])
    rig.run(after(end, 4))
    by_agent = {r["agent_id"]: r["r_outcome"] for r in rig.labels("s1")[1]}
    assert by_agent == {"main": 1.0, "kid": 1.0 - 0.25}, by_agent
    # a late outcome about the main agent relabels both; the kid keeps its own rejection
    rig.feed.write("outcomes", [synthetic.outcome("s1", "accepted", 1.0, after(end, 900)) | {"agent_id": "main"}])
    rig.run(after(end, 901))
    by_agent = {r["agent_id"]: r["r_outcome"] for r in rig.labels("s1")[2]}
    assert by_agent == {"main": 1.0 + 0.75, "kid": 1.0 - 0.25}, by_agent


def test_only_the_main_agents_first_call_opens_the_session_in_every_label(rig: Rig) -> None:
    b = synthetic.SessionBuilder("s1", T0).begin()
    first = b.llm_call()
    b.spawn("kid")
    kid = b.llm_call(agent="kid", parent="main")
    b.finish("kid", ok=True)
    second = b.llm_call()
    end = b.end()
    rig.feed.write("events", b.events)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 0.0, after(end, 1))])
    rig.run(after(end, 2))
    opens = lambda rows: {r["episode_id"]: r["opens_session"] for r in rows}  # noqa: E731
    assert opens(rig.labels("s1")[1]) == {first["event_id"]: True, kid["event_id"]: False, second["event_id"]: False}
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 900))])
    rig.run(after(end, 901))
    assert opens(rig.labels("s1")[2])[first["event_id"]] is True, "a relabel keeps the opening"


def test_judge_budget_spent_is_recorded_not_waited_for(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.rewards = config.parse(TOML.replace("[task_types.tool_use]", "[judge]\nbudget_s = 0\n[task_types.tool_use]\njudge = true"))
    rig.restart()
    events, end = rig.session("s1")
    rig.feed.write("events", events)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 1))])
    rig.run(after(end, 2))
    rows = rig.labels("s1")[1]
    assert {r["r_judge"] for r in rows} == {None} and {r["reward"] for r in rows} == {1.0}
    assert '"status": "budget"' in rows[0]["reward_detail"]
    assert rig.builder.judge.calls == 0


# --- re-sent copies (the SDK replays its spool after an outage): duplicates whenever they come -----------------


def test_copies_arriving_while_the_session_is_pending_change_nothing(rig: Rig) -> None:
    events, end = rig.session("s1", calls=3)
    rig.feed.write("events", events)
    rig.run(after(end, 2))  # pending: task_success not in, its window open
    rig.feed.write("events", events[2:] + events[:2])  # the SDK's replay: every event again, in another order
    res = rig.run(after(end, 3))
    assert res.pending_sessions == 1 and rig.rows() == [], res
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 4))])
    rig.run(after(end, 5))
    label1 = rig.labels("s1")
    assert sorted(label1) == [1] and len(label1[1]) == 3, f"3 llm_calls, once each: {[len(v) for v in label1.values()]}"
    assert len({r["episode_id"] for r in label1[1]}) == 3
    assert rig.counters()["dropped_duplicate_event"] == len(events), rig.counters()
    assert "dropped_late_event" not in rig.counters(), rig.counters()


def test_copies_arriving_after_the_label_are_duplicates_and_a_new_event_is_late(rig: Rig) -> None:
    events, end = rig.session("s1")
    rig.feed.write("events", events)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 1))])
    rig.run(after(end, 2))
    rig.restart()  # the emitted session's event ids come from the index, not from memory
    rig.feed.write("events", events)
    res = rig.run(after(end, 10))
    assert res.rows_written == 0 and res.drops == {"duplicate_event": len(events)}, res.drops
    # a relabel carries the event ids on: copies after label 2 are still duplicates
    rig.feed.write("outcomes", [synthetic.outcome("s1", "accepted", 1.0, after(end, 20))])
    assert rig.run(after(end, 21)).relabels == 1
    straggler = synthetic.SessionBuilder("s1", after(end, 3))
    straggler.llm_call()
    rig.feed.write("events", events[:3] + straggler.events)
    res = rig.run(after(end, 30))
    assert res.drops == {"duplicate_event": 3, "late_event": 1}, res.drops
    assert sorted(rig.labels("s1")) == [1, 2] and all(len(v) == 2 for v in rig.labels("s1").values())
    assert rig.counters()["dropped_duplicate_event"] == len(events) + 3 and rig.counters()["dropped_late_event"] == 1


def test_index_segments_without_event_ids_still_work(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments written before the index kept event ids: lookups, relabels and compaction still work."""
    monkeypatch.setattr(episodes, "SEGMENT_COMPACT_AT", 2)
    old, end = rig.session("old")
    rig.feed.write("events", old)
    rig.run(after(end, 601))
    (seg,) = [Path(rig.cfg.state_dir) / "segments" / s for s in rig.builder.state.segments]
    pq.write_table(pq.read_table(seg).drop(["event_ids"]), seg)  # as the previous builder wrote it
    rig.restart()
    rig.feed.write("events", old[:2])
    assert rig.run(after(end, 602)).drops == {"late_event": 2}, "an old index row knows no event ids: late, as before"
    for sid in ("new1", "new2"):  # two more segments: the third pass merges old and new ones
        events, end2 = rig.session(sid)
        rig.feed.write("events", events)
        rig.run(after(end2, 601))
    assert len(rig.builder.state.segments) <= 2, rig.builder.state.segments
    rig.feed.write("outcomes", [synthetic.outcome("old", "task_success", 1.0, after(end, 700))])
    rig.feed.write("events", events)  # copies of new2's events
    res = rig.run(after(end2, 700))
    assert res.relabels == 1 and res.drops == {"duplicate_event": len(events)}, res


# --- one builder per state directory ------------------------------------------------------------------------


def test_a_second_builder_on_the_same_state_is_refused_until_the_first_stops(rig: Rig) -> None:
    from flywheel.rewards.state import StateLockedError

    with pytest.raises(StateLockedError) as refused:
        episodes.Builder(rig.cfg, rig.rewards)
    message = str(refused.value)
    assert rig.cfg.state_dir in message and f"pid {os.getpid()}" in message, message
    rig.builder.close()
    second = episodes.Builder(rig.cfg, rig.rewards)  # the first one's lock went with it
    second.close()


def test_the_lock_of_a_killed_builder_is_released_by_its_death(tmp_path: Path) -> None:
    from flywheel.rewards.state import StateLock, StateLockedError

    state = tmp_path / "state"
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; from flywheel.rewards.state import StateLock; "
                              f"StateLock({str(state)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        with pytest.raises(StateLockedError, match=f"pid {child.pid}"):
            StateLock(state).acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    lock = StateLock(state).acquire()  # no stale lock after a SIGKILL: the kernel dropped it
    assert lock.held and (state / "LOCK").read_text().strip() == str(os.getpid())
    lock.release()


def test_a_malformed_call_that_says_where_it_broke_is_charged_from_that_token(rig: Rig) -> None:
    """The penalty's row trains from the call's malformed_token on (its well-formed prefix masked); a row with a
    second malformed call that does not say where, or with an index at 0 or past the end, trains every token."""
    b = synthetic.SessionBuilder("s1", T0).begin()
    spawn = b.llm_call(n_completion=8)
    b.tool(malformed=True, malformed_token=5)
    twice = b.llm_call(n_completion=8)
    b.tool(malformed=True, malformed_token=6)
    b.tool(malformed=True, malformed_token=3)
    unsaid = b.llm_call(n_completion=8)
    b.tool(malformed=True, malformed_token=4)
    b.tool(malformed=True)
    at_zero = b.llm_call(n_completion=8)
    b.tool(malformed=True, malformed_token=0)
    clean = b.llm_call(n_completion=8)
    end = b.end()
    rig.feed.write("events", b.events)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 1.0, after(end, 1))])
    rig.run(after(end, 2))
    rows = {r["episode_id"]: r for r in rig.rows()}
    assert rows[spawn["event_id"]]["loss_mask"] == [0] * 5 + [1] * 3
    assert rows[twice["event_id"]]["loss_mask"] == [0] * 3 + [1] * 5, "the earliest break of the turn"
    assert rows[unsaid["event_id"]]["loss_mask"] == [1] * 8
    assert rows[at_zero["event_id"]]["loss_mask"] == [1] * 8
    assert rows[clean["event_id"]]["loss_mask"] == [1] * 8 and rows[clean["event_id"]]["r_penalty"] == 0.0
    assert rows[spawn["event_id"]]["r_penalty"] == -0.5 and rows[twice["event_id"]]["r_penalty"] == -1.0
    assert json.loads(rows[spawn["event_id"]]["reward_detail"])["trained_from_token"] == 5


def test_a_harmful_prune_reported_after_label_1_costs_its_row_in_the_relabel(rig: Rig) -> None:
    rig.rewards = config.parse(TOML.replace("malformed_tool_call = -0.5", "malformed_tool_call = -0.5\nharmful_prune = -0.3"))
    rig.restart()
    b = synthetic.SessionBuilder("s1", T0).begin()
    pruning = b.llm_call()
    prune_call = b.tool()
    sloppy = b.llm_call()
    b.tool(malformed=True)
    end = b.end()
    rig.feed.write("events", b.events)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "task_success", 0.0, after(end, 5))])
    rig.run(after(end, 10))
    label1 = {r["episode_id"]: r for r in rig.labels("s1")[1]}
    assert label1[pruning["event_id"]]["r_penalty"] == 0.0 and label1[sloppy["event_id"]]["r_penalty"] == -0.5

    # the checker tells only later that the prune removed what the answer needed
    rig.feed.write("outcomes", [synthetic.outcome("s1", "prune_harmful", 1.0, after(end, 900), call_id=prune_call)])
    assert rig.run(after(end, 901)).relabels == 1
    label2 = {r["episode_id"]: r for r in rig.labels("s1")[2]}
    assert label2[pruning["event_id"]]["r_penalty"] == -0.3 and label2[pruning["event_id"]]["reward"] == -0.3
    assert label2[sloppy["event_id"]]["r_penalty"] == -0.5, "the malformed call's penalty is kept, not doubled or lost"
    detail = json.loads(label2[pruning["event_id"]]["reward_detail"])
    assert detail["penalty_parts"] == {"malformed": 0.0, "harmful_prune": -0.3} and detail["harmful_prunes"] == 1

    # a later, unrelated outcome keeps the penalty (it is recomputed from every outcome so far, not the new ones only)
    rig.feed.write("outcomes", [synthetic.outcome("s1", "accepted", 1.0, after(end, 950))])
    rig.run(after(end, 960))
    label3 = {r["episode_id"]: r for r in rig.labels("s1")[3]}
    assert label3[pruning["event_id"]]["r_penalty"] == -0.3


def test_a_call_served_across_a_reload_keeps_its_older_version_which_the_learner_ages_it_by(rig: Rig) -> None:
    """The proxy logs a call during which the server's weights changed with policy_version the older of the two and
    policy_version_alt the other (serving/proxy.py). The lake keeps both; the episode is the older version's row;
    the learner counts its staleness from there, so it is dropped no later than a row of that version."""
    from flywheel.learner.data import EpisodeStream

    b = synthetic.SessionBuilder("s-reload", T0).begin()
    call = b.llm_call(version=2)
    call["policy_version_alt"] = 3  # policy-v2 before the call, policy-v3 after it
    b.tool()
    end = b.end()
    rig.feed.write("events", b.events)
    rig.feed.write("outcomes", [synthetic.outcome("s-reload", "task_success", 1.0, after(end, 1))])
    rig.run(after(end, 2))
    stored = [r for f in lake.list_files(rig.root, "events") for r in lake.read_file(rig.root, f).to_pylist()
              if r["event_id"] == call["event_id"]]
    assert [(r["policy_version"], r["policy_version_alt"]) for r in stored] == [(2, 3)]
    (row,) = [r for r in rig.rows() if r["episode_id"] == call["event_id"]]
    assert row["policy_version"] == 2 and row["reward"] == pytest.approx(1.0)

    stream = EpisodeStream(rig.root, vocab_size=512, max_seq_len=256)
    stream.poll()
    # v2 served 12 steps ago, v3 2 steps ago: at a staleness limit of 8 the row is v2's, and stale
    batch, stats = stream.take(10, {2: 12, 3: 2}, 8)
    assert batch == [] and stats.stale == 1, stats
    stream = EpisodeStream(rig.root, vocab_size=512, max_seq_len=256)
    stream.poll()
    batch, stats = stream.take(10, {2: 5, 3: 2}, 8)
    assert [e.episode_id for e in batch] == [call["event_id"]] and stats.lags == {5: 1}, stats


def test_a_traced_session_trains_nothing_and_its_captured_calls_still_do(rig: Rig) -> None:
    """Schema v5: a traced_llm_call (an OpenTelemetry span: no token ids, no logprobs) is never a row; a session that
    also has captured llm_calls gets its rows as before."""
    traced = synthetic.SessionBuilder("otel-only", T0).begin()
    traced._event("main", "traced_llm_call", model="gpt-x", input_tokens=30, output_tokens=5, completion_text="hi")
    traced.tool()
    traced_end = traced.end()
    mixed = synthetic.SessionBuilder("mixed", T0).begin()
    mixed._event("main", "traced_llm_call", model="gpt-x", input_tokens=30, output_tokens=5)
    mixed.llm_call()
    mixed.tool()
    mixed.end()
    rig.feed.write("events", traced.events + mixed.events)
    rig.feed.write("outcomes", [synthetic.outcome(s, "task_success", 1.0, after(traced_end, 1))
                                for s in ("otel-only", "mixed")])
    rig.run(after(traced_end, 30))
    assert rig.labels("otel-only") == {}
    assert [len(rows) for rows in rig.labels("mixed").values()] == [1]
