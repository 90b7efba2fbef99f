"""A short run of the whole closed loop (`flywheel demo`) against the real Kafka, vLLM and MLflow.

Every process is the real sub-command (proxy, lake writer, episode builder, learner, promotion
gate, outcome sources, agent). The test asserts that data flowed through every stage, sessions
to lake to outcomes to episodes to learner steps, that the learner's new version was
published to and served by vLLM, and that every llm_call carries the router's arm. It runs on
the test session's two servers: with the control arm on policy-v0, the first new version goes
to the free server and the gate can judge it against the concurrent champion. It serves the
plain tiny base (no warm start: that takes minutes), so it says nothing about learning; the
demo's report does.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Callable

import pytest

from flywheel import stack as stack_mod
from flywheel.demo import closed_loop as demo
from flywheel.demo.report import lake_facts
from flywheel.ingest import lake
from flywheel.serving.sessions import read_sessions

# Budget, measured on a quiet 2-core machine: 242 s run alone, of which ~60 s the session stack's start (then set-up,
# ~110 s of traffic to the early final window's end, drain and report); in the suite, with the stack up, it took 262 s
# when its traffic ran the full 3 minutes. The bound is ~6x that, so a machine shared with another CPU-bound job
# (about 2.5x slower here) never reaches it; a hang does.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def test_short_loop_flows_through_every_stage_and_serves_a_new_version(
        stack: stack_mod.StackConfig, base_model_dir: Path, vllm_urls: list[str], tmp_path: Path,
        run_demo: Callable[[demo.DemoConfig], int]) -> None:
    assert len(vllm_urls) == 2, f"the test session's stack should run two vLLM servers: {vllm_urls}"
    # The final window (40 s, from when the proxy's router has re-read the cleared aliases) starts once a
    # published version has as many sessions with an outcome in the lake as the gate needs for a look
    # (final_after_sessions = min_sessions), at the latest after 140 s of traffic (3 minutes, the cap for a busy
    # machine): a smoke run, so learning_claim is off. base_sessions stays the default 0: the learner's
    # start-up (torch import, model load: 25-85 s on 2 loaded cores) comes before the traffic, the path
    # `flywheel demo` takes (the swarm test keeps a base phase)
    tuned = demo.DemoConfig()  # the tool_use recipe, with small batches and a gate that looks after 5 sessions
    learner = dataclasses.replace(tuned.learner, batch_size=16, min_batch=16, micro_batch=16, publish_every_steps=2,
                                  publish_every_s=30.0)
    gate = dataclasses.replace(tuned.gate, min_sessions=5)
    cfg = demo.DemoConfig(minutes=3.0, learning_claim=False, var_dir=tmp_path / "var", report_dir=tmp_path / "report",
                          base_model=base_model_dir, warm_start=False, concurrency=6, learner=learner, gate=gate,
                          # vllm_nice 0: the session's shared servers, which no test can make less nice again
                          vllm_servers=2, vllm_nice=0, gate_interval_s=10.0, measure_s=40.0,
                          final_after_sessions=gate.min_sessions, drain_s=15.0, keep_stack=True, live=False,
                          run_id=f"demo-test-{uuid.uuid4().hex[:8]}")  # unique: the MLflow store outlives a test run
    cfg.check()
    assert run_demo(cfg) == 0
    run_dir = tmp_path / "var" / "demo" / cfg.run_id
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    facts = lake_facts(str(run_dir / "lake"))
    handed_off = len((run_dir / "sessions.jsonl").read_text().splitlines())

    assert handed_off >= 20, f"the agent finished only {handed_off} sessions"
    assert facts.sessions_total >= 0.8 * handed_off, \
        f"{facts.sessions_total} of {handed_off} finished sessions reached the lake"
    judged = sum(s.sessions for s in facts.by_version.values()) + facts.mixed_sessions
    assert judged >= 0.8 * handed_off, f"only {judged} of {handed_off} sessions have a task_success outcome in the lake"
    assert summary["episodes"] > 0, f"no episode was built: {summary}"
    # the shadow judge (infra/demo/rewards.toml) scored a sample of sessions in the loop, and none of it is in a reward
    assert summary["judge_scored"] > 0, f"the shadow judge scored no session: {summary.get('judge_scored')}"
    assert summary["judge_n"] <= summary["judge_scored"], summary
    trained = (run_dir / "learner" / "trained.jsonl").read_text().splitlines()
    assert trained, "the learner trained no step"
    assert summary["versions_published"] >= 1, f"no version was published: {summary}"
    served = [v for v in facts.by_version if v > 0]
    assert served, f"no session was served by a new version: per version {summary['per_version']}"
    assert summary["p95_session_to_lake_s"] is not None and summary["p95_session_to_lake_s"] < 30, summary
    assert (tmp_path / "report" / "report.md").read_text().startswith("# agent-flywheel demo report")
    assert (tmp_path / "report" / "success_by_version.png").stat().st_size > 0
    arms = _llm_call_arms(str(run_dir / "lake"))
    assert arms and None not in arms and set(arms) <= {"control", "champion", "challenger"}, \
        f"llm_calls per arm (None: no arm logged): {arms}"
    assert "control" in arms, f"no llm_call was served by the control arm: {arms}"
    final = json.loads((run_dir / "final_window.json").read_text())
    assert final["router_confirmed"], f"the proxy's router never re-read the aliases after the clear: {final}"
    in_window = [r for r in read_sessions(str(run_dir / "lake")) if r.started >= final["since"]]
    assert in_window, f"no session started in the final window (from {final['since']:.0f})"
    on_challenger = [r.session_id for r in in_window if r.arm == "challenger"]
    assert not on_challenger, f"{len(on_challenger)} of {len(in_window)} final-window sessions went to a challenger"


def _llm_call_arms(lake_root: str) -> dict[str | None, int]:
    """{arm: llm_calls} over the lake's events."""
    import duckdb

    files = [f.path for f in lake.list_files(lake_root, "events")]
    listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
    rows = duckdb.sql(f"SELECT arm, count(*) FROM read_parquet([{listed}], union_by_name = true) "
                      "WHERE type = 'llm_call' GROUP BY 1").fetchall()
    return {arm: int(n) for arm, n in rows}
