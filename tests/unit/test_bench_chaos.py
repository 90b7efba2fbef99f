"""`flywheel bench chaos` without the stack: its fault schedule, its commands, its audit on synthetic lakes, and the
agent-sim switches it relies on (the event ledger lists exactly what the agent handed to the SDK; the hand-off
waits for the SDK's flush)."""

from __future__ import annotations

import base64
import datetime as dt
import json
import uuid
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import chaos
from flywheel.base.config import build_parser, resolve
from flywheel.demo.agent_sim import AgentSim, AgentSimConfig
from flywheel.demo.outcome_sim import OutcomeSimConfig
from flywheel.demo.plan import Endpoints
from flywheel.ingest.lake_writer import LakeWriterConfig
from flywheel.learner.config import LearnerConfig
from flywheel.rewards import config as reward_config
from flywheel.rewards.builder import EpisodesConfig
from flywheel.serving.promote import PromoteConfig
from flywheel.serving.proxy import ProxyConfig

T0 = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)


# ---------------------------------------------------------------------------------------------
# the schedule
# ---------------------------------------------------------------------------------------------
def test_schedule_kills_every_process_in_turn_and_puts_the_outage_inside_the_traffic() -> None:
    faults = chaos.schedule(7, 240.0, 14, 50.0)
    assert faults == chaos.schedule(7, 240.0, 14, 50.0), "the same seed must give the same schedule"
    assert faults != chaos.schedule(8, 240.0, 14, 50.0)
    kills = [f for f in faults if f.kind == "kill"]
    outages = [f for f in faults if f.kind == "outage"]
    assert len(kills) == 14 and len(outages) == 1, faults
    # each round of seven kills every process once, before any is killed a second time
    assert sorted(f.target for f in kills[:7]) == sorted(chaos.PROCESSES), [f.target for f in kills]
    assert Counter(f.target for f in kills) == Counter({p: 2 for p in chaos.PROCESSES})
    lo, hi = chaos.KILL_WINDOW[0], 240.0 - chaos.KILL_WINDOW[1]
    assert all(lo <= f.at <= hi for f in kills), [round(f.at) for f in kills]
    assert lo <= outages[0].at <= 240.0 - 50.0 - 60.0, outages


def test_schedule_refuses_traffic_too_short_for_the_outage() -> None:
    with pytest.raises(ValueError, match="too short"):
        chaos.schedule(1, 150.0, 14, 50.0)


# ---------------------------------------------------------------------------------------------
# the commands: the demo's own, every path under the run folder, the agent with the chaos switches
# ---------------------------------------------------------------------------------------------
CONFIGS = {"lake-writer": LakeWriterConfig, "episodes": EpisodesConfig, "proxy": ProxyConfig,
           "outcome-sim": OutcomeSimConfig, "learner": LearnerConfig, "promote": PromoteConfig,
           "agent-sim": AgentSimConfig}


def _parse(cls: type, argv: list[str]) -> Any:
    args = build_parser(cls, "test", "test").parse_args(argv)
    return resolve(cls, {}, {}, {k: v for k, v in vars(args).items() if k != "config"})


def test_commands_parse_and_keep_all_state_under_the_run_folder(tmp_path: Path) -> None:
    args = chaos.parse_args(["--seed", "5", "--base-model", str(tmp_path / "base")])
    run_dir = tmp_path / "bench" / "chaos-t"
    cfg = chaos.demo_config(args, run_dir, "chaos-t")
    plan = chaos.ChaosPlan(run_id="chaos-t", var_dir=run_dir, traffic_s=0.0)
    ends = Endpoints("127.0.0.1:19999", "http://127.0.0.1:8000", "sqlite:///x.db", 8123)
    cmds = chaos.commands(cfg, plan, ends, durable_timeout_s=80.0, seed=5)
    assert set(cmds) == set(chaos.PROCESSES)
    assert all(argv[0] == name for name, (argv, _) in cmds.items()), "each argv starts with its sub-command"
    parsed = {name: _parse(CONFIGS[name], argv[1:]) for name, (argv, _) in cmds.items()}
    agent = parsed["agent-sim"]
    assert agent.durable_handoff and agent.durable_timeout_s == 80.0 and agent.seed == 5, agent
    assert Path(agent.event_ledger) == run_dir / "agent-ledger.jsonl"
    assert agent.duration_s == 0.0, "the agent must run until the bench stops it, restarts included"
    assert Path(parsed["lake-writer"].lake_root) == run_dir / "lake"
    assert Path(parsed["episodes"].state_dir).is_relative_to(run_dir)
    assert Path(parsed["learner"].run_dir) == run_dir / "learner"
    assert Path(parsed["outcome-sim"].cursor).is_relative_to(run_dir)
    for name in ("lake-writer", "episodes", "learner", "promote", "agent-sim", "outcome-sim"):
        assert Path(parsed[name].var_dir) == run_dir, (name, parsed[name].var_dir)
    assert parsed["proxy"].kafka_bootstrap == parsed["agent-sim"].kafka_bootstrap == "127.0.0.1:19999"
    assert parsed["learner"].batch_size == 16 and not cfg.warm_start


# ---------------------------------------------------------------------------------------------
# the audit on synthetic data
# ---------------------------------------------------------------------------------------------
def _event(sid: str, etype: str, agent: str = "main", seq: int = 0, event_id: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"event_id": event_id or uuid.uuid4().hex, "session_id": sid, "agent_id": agent, "type": etype, "seq": seq,
            "ts": T0 + dt.timedelta(seconds=seq), "task_type": extra.get("task_type"),
            "policy_version": extra.get("policy_version"), "model": extra.get("model"), "_partition": 0, "_offset": 0}


def _session(sid: str, llm_calls: int = 2, end_s: float = 10.0) -> list[dict[str, Any]]:
    events = [_event(sid, "session_start", task_type="tool_use.add")]
    for i in range(llm_calls):
        events += [_event(sid, "llm_call", seq=3 * i + 1, policy_version=0, model="policy-v0"),
                   _event(sid, "tool_call", seq=3 * i + 2), _event(sid, "tool_result", seq=3 * i + 3)]
    end = _event(sid, "session_end", seq=99)
    end["ts"] = T0 + dt.timedelta(seconds=end_s)
    return events + [end]


def _ledger_of(events: list[dict[str, Any]], done: dict[str, tuple[str, bool | None]]) -> chaos.Ledger:
    """The agent's ledger of these events, each noted 1 ms before the SDK stamped its ts (as agent-sim does)."""
    ledger = chaos.Ledger()
    for e in events:
        ledger.expected[e["session_id"]][(e["agent_id"], e["type"])] += 1
        ledger.times[(e["session_id"], e["agent_id"], e["type"])].append(e["ts"].timestamp() - 0.001)
    ledger.done.update(done)
    return ledger


def _facts(events: list[dict[str, Any]], ledger: chaos.Ledger, **changes: Any) -> chaos.Facts:
    base = dict(ledger=ledger, not_logged=Counter(), events=events, outcomes=[], episodes=[], trained=[], registered=set(),
                kafka=[], kafka_ends={}, lake_ranges={}, dlq=[], spools={}, horizon=(T0 + dt.timedelta(hours=1)).timestamp(),
                rewards=reward_config.load(None))
    base.update(changes)
    return chaos.Facts(**base)


def test_a_complete_session_passes_and_each_kind_of_loss_is_counted_where_it_belongs() -> None:
    a, b, c = _session("a" * 32), _session("b" * 32), _session("c" * 32)
    ledger = _ledger_of(a + b + c, {"a" * 32: ("ok", True), "b" * 32: ("ok", True)})  # c: agent killed mid-session
    lake = a + [e for e in b if e["type"] != "tool_result"] + c[:2]
    r = chaos.event_checks(_facts(lake, ledger))
    assert r["events_lost"] == 2 and r["events_lost_by_type"] == {"tool_result": 2}, r
    assert r["events_lost_uncompleted"] == len(c) - 2, r
    assert r["sessions_in_lake"] == 1 and r["sessions_incomplete_in_lake"] == 1, r
    assert r["events_duplicated_in_lake"] == 0


def test_duplicates_dead_letters_and_calls_the_proxy_did_not_log() -> None:
    a = _session("a" * 32)
    ledger = _ledger_of(a, {"a" * 32: ("ok", True)})
    ledger.expected["a" * 32][("main", "llm_call")] += 1  # one more answered call, which the proxy said it did not log
    refused = next(e for e in a if e["type"] == "tool_call")
    letter = {"reason": "invalid", "original_b64": base64.b64encode(json.dumps(
        {**refused, "ts": str(refused["ts"])}).encode()).decode()}
    lake = [e for e in a if e is not refused] + [a[0]]  # session_start twice (a replay)
    facts = _facts(lake, ledger, not_logged=Counter({"a" * 32: 1}), dlq=[json.dumps(letter).encode()])
    r = chaos.event_checks(facts)
    assert r["events_lost"] == 0 and r["events_dead_lettered"] == 1, r
    assert r["events_duplicated_in_lake"] == 1 and r["sessions_with_duplicates"] == 1 and r["sessions_in_lake"] == 0, r


def test_matured_sessions_need_episodes_with_every_llm_call() -> None:
    sids = ["a" * 32, "b" * 32, "c" * 32, "d" * 32]
    events = [e for s in sids for e in _session(s)]
    ledger = _ledger_of(events, {s: ("ok", True) for s in sids})
    landed = T0 + dt.timedelta(seconds=20)
    outcomes = [{"session_id": s, "kind": "task_success", "_ingest_ts": landed} for s in sids[:3]]
    outcomes.append({"session_id": sids[3], "kind": "task_success", "_ingest_ts": T0 + dt.timedelta(hours=2)})  # too late
    calls = {s: [e["event_id"] for e in events if e["session_id"] == s and e["type"] == "llm_call"] for s in sids}
    episodes = [{"episode_id": i, "label_version": 1, "session_id": sids[0]} for i in calls[sids[0]]]
    episodes += [{"episode_id": calls[sids[1]][0], "label_version": 1, "session_id": sids[1]}] * 2  # one row twice, one missing
    horizon = (T0 + dt.timedelta(seconds=60)).timestamp()  # before any 600 s window closed
    r = chaos.episode_checks(_facts(events, ledger, outcomes=outcomes, episodes=episodes, horizon=horizon))
    assert r["matured_sessions"] == 3 and r["sessions_not_matured_yet"] == 1, r  # d's outcome landed after the horizon
    assert r["matured_sessions_without_episodes"] == 1 and r["matured_sessions_incomplete_episodes"] == 1, r
    assert r["episode_rows_missing"] == 1 + 2 and r["events_duplicated_in_episodes"] == 1, r
    assert r["sessions_without_outcome"] == 0


def test_an_episode_from_a_re_issued_event_counts_as_duplicated() -> None:
    a = _session("a" * 32)
    call = next(e for e in a if e["type"] == "llm_call")
    twin = {**call, "event_id": uuid.uuid4().hex}  # the same call under a new id
    episodes = [{"episode_id": x["event_id"], "label_version": 1, "session_id": "a" * 32} for x in (call, twin)]
    r = chaos.episode_checks(_facts(a + [twin], _ledger_of(a, {"a" * 32: ("ok", True)}), episodes=episodes))
    assert r["events_duplicated_in_episodes"] == 1, r


def test_trained_twice_ignores_a_step_redone_after_a_kill() -> None:
    lines = [{"step": 1, "episode_ids": ["e1", "e2"]}, {"step": 2, "episode_ids": ["e3"]},
             {"step": 2, "episode_ids": ["e3", "e4"]},  # killed before its checkpoint: redone, last run counts
             {"step": 3, "episode_ids": ["e5"]}]
    assert chaos.trained_checks(lines) == {"episodes_trained_twice": 0, "learner_steps": 3, "episodes_trained": 5,
                                           "learner_steps_redone": 1}
    lines.append({"step": 4, "episode_ids": ["e1"]})
    assert chaos.trained_checks(lines)["episodes_trained_twice"] == 1


def test_trained_twice_follows_the_weights_back_to_an_older_checkpoint() -> None:
    # checkpoints every 3 steps: killed after step 5 was logged, the learner resumed from step 3's checkpoint and
    # trained steps 4 and 5 again from its weights, in other batches (e4 moved to step 5, e6 to step 4)
    lines = [{"step": s, "episode_ids": [f"e{s}"]} for s in (1, 2, 3, 4, 5)]
    lines += [{"step": 4, "episode_ids": ["e6", "e5"]}, {"step": 5, "episode_ids": ["e4"]},
              {"step": 6, "episode_ids": ["e7"]}]
    assert chaos.trained_checks(lines) == {"episodes_trained_twice": 0, "learner_steps": 6, "episodes_trained": 7,
                                           "learner_steps_redone": 2}, "steps 4-5 of the lost weights do not count"
    # killed again after step 8 was logged (checkpoint at 6); the restart stopped before a step: steps 7-8 trained
    # weights no checkpoint kept, which the newest checkpoint's step tells
    lines += [{"step": 7, "episode_ids": ["e8"]}, {"step": 8, "episode_ids": ["e9"]}]
    assert chaos.trained_checks(lines, checkpoint_step=6) == {
        "episodes_trained_twice": 0, "learner_steps": 6, "episodes_trained": 7, "learner_steps_redone": 4}
    assert chaos.trained_checks(lines)["learner_steps"] == 8, "without the checkpoint's step the lost lines count"
    assert chaos.trained_checks(lines + [{"step": 9, "episode_ids": ["e3"]}])["episodes_trained_twice"] == 1, \
        "one lineage training e3 at steps 3 and 9"


def test_served_versions_must_be_registered_except_the_base() -> None:
    events = [_event("a" * 32, "llm_call", policy_version=v, model="policy-v0") for v in (0, 1, 2, 3)]
    r = chaos.served_checks(_facts(events, chaos.Ledger(), registered={1, 2}))
    assert r["served_versions"] == [0, 1, 2, 3] and r["unregistered_served_versions"] == [3], r
    assert chaos.served_checks(_facts(events, chaos.Ledger(), registered=None))["unregistered_served_versions"] == [1, 2, 3]


def test_kafka_checks_find_gaps_and_records_the_lake_left_behind() -> None:
    a = _session("a" * 32, llm_calls=1)
    kafka = [(0, i, json.dumps({"event_id": e["event_id"]}).encode()) for i, e in enumerate(a)]
    kafka.append((0, len(a), json.dumps({"event_id": "never-landed"}).encode()))
    ranges = {"events": {0: [(0, 1), (3, len(a) - 1)]}, "outcomes": {}}
    r = chaos.kafka_checks(_facts(a, chaos.Ledger(), kafka=kafka, kafka_ends={"events": {0: len(a) + 1}, "outcomes": {0: 4}},
                                  lake_ranges=ranges))
    assert r["lake_offset_gaps"] == 1 and r["lake_behind_kafka"] == 1 + 4, r
    assert r["kafka_events_not_in_lake"] == 1 and r["kafka_records"] == len(a) + 1, r


def test_failures_name_each_check_with_its_numbers() -> None:
    good = {"events_lost": 0, "events_duplicated_in_episodes": 0, "episodes_trained_twice": 0,
            "matured_sessions_without_episodes": 0, "sessions_in_lake": 40, "sessions_completed": 40,
            "unregistered_served_versions": [], "kills": 14, "broker_outage_s": 51.0}
    assert chaos.failures(good) == []
    bad = {**good, "events_lost": 3, "sessions_in_lake": 38, "kills": 11, "broker_outage_s": 30.0,
           "unregistered_served_versions": [4]}
    got = chaos.failures(bad)
    assert "events_lost = 3" in got and "kills 11 < 12" in got and "broker_outage_s 30.0 < 45.0" in got, got
    assert any("38 != sessions_completed 40" in x for x in got) and any("[4]" in x for x in got), got


# ---------------------------------------------------------------------------------------------
# the audit's items: where each lost or duplicated event's trail stops, and the faults around it
# ---------------------------------------------------------------------------------------------
def _wire(e: dict[str, Any]) -> bytes:
    """An event as the SDK sends it (and spools it): JSON, ts as ISO-8601 text."""
    return json.dumps({**{k: e[k] for k in chaos.TRAIL_FIELDS}, "ts": e["ts"].isoformat(), "schema_version": 3}).encode()


def _at(seconds: float) -> float:
    return (T0 + dt.timedelta(seconds=seconds)).timestamp()


def _fault(kind: str, target: str, seconds: float, until: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, "target": target, "t": _at(seconds), "at_s": seconds}
    if kind == "outage":
        out["until"] = None if until is None else _at(until)
    return out


def test_a_lost_event_is_listed_with_the_stage_where_its_trail_stops_and_the_faults_around_it(tmp_path: Path) -> None:
    sid = "a" * 32
    a = _session(sid)  # ts = T0 + seq: tool_call seqs 2 and 5, tool_result seqs 3 and 6
    ledger = _ledger_of(a, {sid: ("ok", True)})
    in_kafka = next(e for e in a if e["type"] == "tool_result" and e["seq"] == 3)  # the lake writer lost it
    in_spool = next(e for e in a if e["type"] == "tool_call" and e["seq"] == 5)  # never acknowledged by Kafka
    nowhere = next(e for e in a if e["type"] == "tool_result" and e["seq"] == 6)  # lost in the SDK's memory
    lake = [e for e in a if e not in (in_kafka, in_spool, nowhere)]
    kafka = [(1, i, _wire(e)) for i, e in enumerate(lake + [in_kafka])]  # in_kafka at partition 1, offset len(lake)
    faults = [_fault("outage", "kafka", -100.0, until=-80.0),  # over 30 s before any of them: not listed
              _fault("kill", "proxy", -10.0), _fault("kill", "lake-writer", 4.0), _fault("crash", "lake-writer", 5.5),
              _fault("kill", "agent-sim", 200.0)]  # over 60 s after: not listed
    facts = _facts(lake, ledger, kafka=kafka, lake_ranges={"events": {1: [(0, len(lake))]}},
                   spooled=[{**chaos.wire_event(_wire(in_spool)), "spool": f"chaos-t-agent@{sid}"}], faults=faults)

    assert chaos.event_checks(facts)["events_lost"] == 3
    items = chaos.audit_items(facts)
    lost = items["lost"]
    assert lost["count"] == 3 and lost["stops_at"] == {"kafka": 1, "spool": 1, "sdk": 1}, lost
    by_stop = {x["stops_at"]: x for x in lost["items"]}

    k = by_stop["kafka"]  # in Kafka, not in the lake: the writer passed its offset (a lake file covers it)
    assert (k["event_id"], k["type"], k["seq"], k["agent_id"]) == (in_kafka["event_id"], "tool_result", 3, "main"), k
    assert k["seen_in"] == ["sdk", "kafka"] and k["kafka"] == [{"partition": 1, "offset": len(lake), "lake_file_covers": True}], k
    assert k["handed_at"] == pytest.approx(_at(3) - 0.001) and k["session_completed"] and k["durable"] is True, k
    assert [(x["kind"], x["target"], x["dt_s"]) for x in k["faults"]] == [
        ("kill", "proxy", -13.0), ("kill", "lake-writer", 1.0), ("crash", "lake-writer", 2.5)], k["faults"]

    sp = by_stop["spool"]
    assert sp["event_id"] == in_spool["event_id"] and sp["seq"] == 5 and sp["seen_in"] == ["sdk", "spool"], sp
    assert sp["spool"] == [f"chaos-t-agent@{sid}"] and "kafka" not in sp, sp

    sdk = by_stop["sdk"]  # never reached a spool or Kafka: its id is unknown, the ledger's line gives its hand-off
    assert sdk["event_id"] is None and sdk["type"] == "tool_result" and sdk["seen_in"] == ["sdk"], sdk
    assert sdk["handed_at"] == pytest.approx(_at(6) - 0.001), (sdk, "the tool_result line left after pairing seq 3")
    assert [x["dt_s"] for x in sdk["faults"]] == [-16.0, -2.0, -0.5], sdk["faults"]

    written = chaos.write_audit(tmp_path / chaos.AUDIT_FILE, {"events_lost": 3}, items)
    back = json.loads(written.read_text())
    assert back["summary"] == {"events_lost": 3} and back["lost"]["count"] == 3 and set(back["stages"]) == set(chaos.STAGES)
    assert [x["target"] for x in back["faults"]] == ["kafka", "proxy", "lake-writer", "lake-writer", "agent-sim"]


def test_lost_items_match_the_counts_and_the_file_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    done, killed = "b" * 32, "c" * 32  # the agent was killed while c was in flight
    b, c = _session(done, llm_calls=3), _session(killed, llm_calls=3)
    ledger = _ledger_of(b + c, {done: ("ok", False)})
    lake = [e for e in b if e["type"] != "llm_call"] + c[:3]
    facts = _facts(lake, ledger, faults=[_fault("outage", "kafka", -200.0)])  # never came back: still around
    counts = chaos.event_checks(facts)
    monkeypatch.setattr(chaos, "MAX_LISTED", 2)
    items = chaos.audit_items(facts)
    assert items["lost"]["count"] == counts["events_lost"] == 3, (items["lost"], counts)
    assert items["lost_uncompleted"]["count"] == counts["events_lost_uncompleted"] == len(c) - 3
    assert items["lost"]["listed"] == 2 and len(items["lost"]["items"]) == 2, "a category lists at most MAX_LISTED"
    call = items["lost"]["items"][0]
    assert call["type"] == "llm_call" and call["stops_at"] == "sdk" and call["durable"] is False, call
    assert call["faults"][0]["kind"] == "outage" and call["faults"][0]["until"] is None, call


def test_duplicated_events_and_episodes_trained_twice_are_listed_with_their_faults() -> None:
    sid = "d" * 32
    a = _session(sid)
    call = next(e for e in a if e["type"] == "llm_call")
    replayed = {**call, "_partition": 2, "_offset": 40}  # the same event_id landed twice
    trained = [{"step": 1, "policy_version": 0, "episode_ids": [call["event_id"]], "t": _at(30)},
               {"step": 2, "policy_version": 1, "episode_ids": [call["event_id"]], "t": _at(50)}]
    faults = [_fault("kill", "lake-writer", 2.0), _fault("kill", "learner", 40.0)]
    facts = _facts(a + [replayed], _ledger_of(a, {sid: ("ok", True)}), trained=trained, faults=faults,
                   episodes=[{"episode_id": call["event_id"], "label_version": 1, "session_id": sid}] * 2)
    items = chaos.audit_items(facts)
    dup = items["duplicated_in_lake"]["items"]
    assert len(dup) == 1 and dup[0]["event_id"] == call["event_id"] and dup[0]["lake_rows"] == 2, dup
    assert dup[0]["lake"] == [{"partition": 0, "offset": 0}, {"partition": 2, "offset": 40}], dup
    assert dup[0]["stops_at"] == "episodes" and [x["target"] for x in dup[0]["faults"]] == ["lake-writer", "learner"]
    ep = items["duplicated_in_episodes"]["items"]
    assert len(ep) == 1 and ep[0]["episode_rows"] == 2 and ep[0]["label_version"] == 1, ep
    twice = items["trained_twice"]["items"]
    assert len(twice) == 1 and [s["step"] for s in twice[0]["steps"]] == [1, 2], twice
    assert [(x["target"], x["dt_s"]) for x in twice[0]["faults"]] == [("lake-writer", -28.0), ("learner", 10.0)], twice
    assert items["lost"]["count"] == 0


def test_the_run_writes_the_audit_file_with_the_faults_as_done_and_names_it_in_the_summary(tmp_path: Path) -> None:
    args = chaos.parse_args(["--var-dir", str(tmp_path), "--run-id", "chaos-t", "--base-model", str(tmp_path / "base")])
    run = chaos.ChaosRun(args)
    run.traffic_start = _at(-50)
    run.sup = chaos.Supervisor(run.procs, {}, lambda _: None)
    run.sup.timeline += [(_at(-20), "kill", "agent-sim"), (_at(2), "crash", "lake-writer")]
    run.broker = SimpleNamespace(stopping_at=_at(-10), up_at=_at(60))
    timeline = run.fault_timeline()
    assert [(x["kind"], x["at_s"]) for x in timeline] == [("kill", 30.0), ("outage", 40.0), ("crash", 52.0)], timeline
    assert timeline[1]["down_s"] == 70.0
    sid = "f" * 32
    a = _session(sid)
    result = {"events_lost": 1}
    run.write_items(_facts(a[1:], _ledger_of(a, {sid: ("ok", True)}), faults=timeline), result)
    assert result["audit_path"] == str(run.plan.run_dir / "audit.json") and result["events_lost_stop_at"] == {"sdk": 1}
    back = json.loads(Path(result["audit_path"]).read_text())
    lost = back["lost"]["items"]
    assert [x["type"] for x in lost] == ["session_start"] and back["summary"]["events_lost"] == 1, back["lost"]
    assert [(x["kind"], x["dt_s"]) for x in lost[0]["faults"]] == [("kill", -20.0), ("outage", -10.0), ("crash", 2.0)]


def test_read_spools_lists_the_events_a_spool_still_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flywheel.ingest.spool import Spool

    monkeypatch.setattr(chaos, "REPO_ROOT", tmp_path)
    e = _event("e" * 32, "tool_call", seq=4)
    spool = Spool(tmp_path / "var" / "spool" / "chaos-t-agent@chaos-t.events")
    spool.append([_wire(e), json.dumps({"outcome_id": "o1", "session_id": "e" * 32}).encode()])
    spool.close()
    counts, events = chaos.read_spools("chaos-t")
    assert counts == {"chaos-t-agent@chaos-t.events": 2}, counts
    assert [(x["event_id"], x["seq"], x["spool"]) for x in events] == [(e["event_id"], 4, "chaos-t-agent@chaos-t.events")]
    assert chaos.spool_records("chaos-t") == counts


# ---------------------------------------------------------------------------------------------
# the agent-sim switches
# ---------------------------------------------------------------------------------------------
class FakeSession:
    """Records what the agent hands to the SDK, as (session_id, agent_id, type)."""

    def __init__(self, sink: list[tuple[str, str, str]], session_id: str, agent_id: str = "main",
                 parent: "FakeSession | None" = None) -> None:
        self.sink, self.session_id, self.agent_id, self.parent = sink, session_id, agent_id, parent
        self.parent_agent_id = parent.agent_id if parent else None

    def _e(self, etype: str) -> None:
        self.sink.append((self.session_id, self.agent_id, etype))

    def tool_call(self, *args: Any, **kwargs: Any) -> str:
        self._e("tool_call")
        return uuid.uuid4().hex[:16]

    def tool_result(self, *args: Any, **kwargs: Any) -> None:
        self._e("tool_result")

    def context_edit(self, *args: Any, **kwargs: Any) -> None:
        self._e("context_edit")

    def spawn_subagent(self, *args: Any, **kwargs: Any) -> "FakeSession":
        self._e("subagent_spawn")
        return FakeSession(self.sink, self.session_id, f"sub-{uuid.uuid4().hex[:6]}", self)

    def finish(self, ok: bool = True) -> None:
        assert self.parent is not None
        self.parent._e("subagent_finish")

    def end(self, status: str = "ok") -> None:
        self._e("session_end")


class FakeLogger:
    def __init__(self, flush_result: bool) -> None:
        self.sink: list[tuple[str, str, str]] = []
        self.flush_result, self.flushes = flush_result, 0

    def session(self, task_type: str, session_id: str, tags: dict[str, Any]) -> FakeSession:
        s = FakeSession(self.sink, session_id)
        s._e("session_start")
        return s

    def flush(self, timeout: float) -> bool:
        self.flushes += 1
        return self.flush_result

    def metrics(self) -> dict[str, Any]:
        return {}


def _client(calls: list[str]) -> Any:
    def create(**kwargs: Any) -> Any:
        calls.append(kwargs["extra_headers"]["X-Flywheel-Agent-Id"])
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="not a tool call"))])

    return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))


@pytest.mark.parametrize("flushed", [True, False])
def test_ledger_lists_what_the_agent_logged_and_the_hand_off_waits_for_the_flush(tmp_path: Path, flushed: bool) -> None:
    ledger_path = tmp_path / "ledger.jsonl"
    cfg = AgentSimConfig(handoff=tmp_path / "sessions.jsonl", event_ledger=str(ledger_path), durable_handoff=True,
                         durable_timeout_s=1.0, tokenizer="", seed=3, multi_share=0.5, var_dir=tmp_path)
    logger, calls = FakeLogger(flushed), []
    sim = AgentSim(cfg, logger, _client(calls))
    for _ in range(6):
        sim.run_session()
    sim.sub_pool.shutdown()
    assert sim.durable is not None
    sim.durable.close(10.0)  # hands off what still waits for its flush
    ledger = chaos.read_ledger(ledger_path)
    sdk = Counter((s, a, t) for s, a, t in logger.sink)
    noted = Counter({(s, a, t): n for s, counts in ledger.expected.items() for (a, t), n in counts.items() if t != "llm_call"})
    assert noted == sdk, f"ledger {noted} != what the SDK got {sdk}"
    assert any(t == "subagent_spawn" for _, _, t in logger.sink), "multi_share 0.5 over 6 seeded sessions spawns sub-agents"
    assert sum(n for c in ledger.expected.values() for (_, t), n in c.items() if t == "llm_call") == len(calls)
    assert 1 <= logger.flushes <= 6 and len(ledger.done) == 6, (logger.flushes, ledger.done)
    assert all(durable is flushed for _, durable in ledger.done.values()), ledger.done
    handed = [json.loads(line) for line in (tmp_path / "sessions.jsonl").read_text().splitlines()]
    assert len(handed) == sum(1 for s, _ in ledger.done.values() if s == "ok") and all(h["durable"] is flushed for h in handed)


def test_ledger_skips_a_torn_line_and_the_proxy_log_gives_the_calls_it_did_not_log(tmp_path: Path) -> None:
    sid = "e" * 32
    (tmp_path / "ledger.jsonl").write_text(
        json.dumps({"session_id": sid, "agent_id": "main", "type": "llm_call", "t": 5.0}) + "\n"
        + json.dumps({"session_id": sid, "agent_id": "main", "type": "done", "status": "ok", "durable": True}) + "\n"
        + '{"session_id": "' + sid[:10])  # a kill mid-write
    ledger = chaos.read_ledger(tmp_path / "ledger.jsonl")
    assert ledger.expected[sid] == Counter({("main", "llm_call"): 1}) and ledger.done == {sid: ("ok", True)}
    assert ledger.llm_times[sid] == [5.0]
    (tmp_path / "proxy.log").write_text(  # the proxy's own warnings (serving/proxy.py), word for word
        f"[w] proxy: session {sid}: http://127.0.0.1:8000 could not tell its loaded version (before 1, after None); "
        "llm_call not logged\n"
        f"[i] proxy: session {sid}: http://127.0.0.1:8000 held policy-v1 before and policy-v2 after the call; "
        "logged as policy-v1 with policy_version_alt 2\n"
        f"[w] proxy: session {sid} choice 0: vLLM returned no prompt ids, 3 token ids and 3 logprobs; llm_call not logged\n"
        f"[i] proxy: session {'f' * 32} routed\n")
    assert chaos.not_logged_calls(tmp_path / "proxy.log") == Counter({sid: 2})


def test_a_call_lost_with_a_proxy_kill_is_attributed_to_it_and_still_lost() -> None:
    sid = "a" * 32
    a = _session(sid)
    ledger = _ledger_of(a, {sid: ("ok", True)})
    ledger.llm_times[sid] = [100.0, 110.0]
    lake = [e for e in a if e["type"] != "llm_call"] + [next(e for e in a if e["type"] == "llm_call")]
    near = chaos.event_checks(_facts(lake, ledger, proxy_kills=[111.0]))
    assert near["events_lost"] == 1 and near["events_lost_near_proxy_kill"] == 1, near
    far = chaos.event_checks(_facts(lake, ledger, proxy_kills=[150.0]))
    assert far["events_lost"] == 1 and far["events_lost_near_proxy_kill"] == 0, far


def test_no_hand_off_before_the_flush_confirms_and_the_workers_do_not_wait_for_it(tmp_path: Path) -> None:
    import threading

    released = threading.Event()

    class BrokerAway(FakeLogger):
        def flush(self, timeout: float) -> bool:
            self.flushes += 1
            return released.wait(timeout)

    cfg = AgentSimConfig(handoff=tmp_path / "sessions.jsonl", event_ledger=str(tmp_path / "ledger.jsonl"),
                         durable_handoff=True, durable_timeout_s=30.0, tokenizer="", seed=4, multi_share=0.0, var_dir=tmp_path)
    logger = BrokerAway(True)
    sim = AgentSim(cfg, logger, _client([]))
    for _ in range(3):
        sim.run_session()  # returns while the flush waits: the worker goes on making traffic
    assert not (tmp_path / "sessions.jsonl").exists(), "a session was handed off before Kafka confirmed its events"
    assert chaos.read_ledger(tmp_path / "ledger.jsonl").done == {}
    released.set()
    assert sim.durable is not None
    sim.durable.close(10.0)
    done = chaos.read_ledger(tmp_path / "ledger.jsonl").done
    assert len(done) == 3 and all(d is True for _, d in done.values()), done
