"""A short run of the whole closed loop (`flywheel demo`) against the real Kafka, vLLM and MLflow.

Every process is the real sub-command (proxy, lake writer, episode builder, learner, promotion
gate, outcome sources, agent). The test asserts that data flowed through every stage, sessions
to lake to outcomes to episodes to learner steps, and that the learner's new version was
published to and served by vLLM. It serves the plain tiny base (no warm start: that takes
minutes), so it says nothing about learning; the demo's report does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flywheel import stack as stack_mod
from flywheel.demo import closed_loop as demo
from flywheel.demo.report import lake_facts

pytestmark = pytest.mark.slow


def test_short_loop_flows_through_every_stage_and_serves_a_new_version(
        stack: stack_mod.StackConfig, base_model_dir: Path, vllm_url: str, tmp_path: Path, vllm_weights_lock: None) -> None:
    from flywheel.serving.publisher import reload_full

    cfg = demo.DemoConfig(minutes=1.5, var_dir=tmp_path / "var", report_dir=tmp_path / "report", base_model=base_model_dir,
                          warm_start=False, concurrency=6, learner_batch=16, publish_every_steps=2, publish_every_s=30.0,
                          gate_interval_s=10.0, gate_min_sessions=5, base_sessions=30, measure_s=0.0, drain_s=15.0, keep_stack=True,
                          live=False,
                          run_id=f"demo-test-{tmp_path.name[-8:]}".replace("_", "-"))
    try:
        assert demo.run(cfg) == 0
    finally:
        # leave the shared server on the base weights for everyone else
        reload_full(vllm_url, base_model_dir.resolve(), 0)
    run_dir = tmp_path / "var" / "demo" / cfg.run_id
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    facts = lake_facts(str(run_dir / "lake"))
    handed_off = len((run_dir / "sessions.jsonl").read_text().splitlines())

    assert handed_off >= 20, f"the agent finished only {handed_off} sessions in 90 s"
    assert facts.sessions_total >= 0.8 * handed_off, \
        f"{facts.sessions_total} of {handed_off} finished sessions reached the lake"
    judged = sum(s.sessions for s in facts.by_version.values()) + facts.mixed_sessions
    assert judged >= 0.8 * handed_off, f"only {judged} of {handed_off} sessions have a task_success outcome in the lake"
    assert summary["episodes"] > 0, f"no episode was built: {summary}"
    trained = (run_dir / "learner" / "trained.jsonl").read_text().splitlines()
    assert trained, "the learner trained no step"
    assert summary["versions_published"] >= 1, f"no version was published: {summary}"
    served = [v for v in facts.by_version if v > 0]
    assert served, f"no session was served by a new version: per version {summary['per_version']}"
    assert summary["p95_session_to_lake_s"] is not None and summary["p95_session_to_lake_s"] < 30, summary
    assert (tmp_path / "report" / "report.md").read_text().startswith("# agent-flywheel demo report")
    assert (tmp_path / "report" / "success_by_version.png").stat().st_size > 0
