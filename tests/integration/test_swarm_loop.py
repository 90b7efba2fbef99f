"""A short swarm run (`flywheel demo --scenario swarm`) against the real Kafka, vLLM and MLflow: the policy's
own spawn and summary decisions flow through the lake into episodes, with the right rows rewarded.

The policy-v0 is the suite's swarm warm start of the tiny base (the demo's rule and action share in 150 steps of 32
demonstrations, shared with test_swarm_preflight_builds, which holds it to the pre-flight's bar), loaded into the test
session's two servers as weights (load_policy_v0_weights), so the shared stack is not restarted. The sub-agents are
frozen, as the recipe runs them: a quick build of their own model (300 steps on one-lookup requests) on a server of
its own, their calls logged with FROZEN_VERSION and never trained. It says nothing about learning; the 20-minute
demo's report does.

Why not fewer steps (measured with transformers, 200 sampled replies each, on the earlier 16-a-step builds with the
actions on half the draws): after 100 steps the model spawned on 3.5% of multi-part first turns (62% of its replies
malformed), and one CI run's 224 multi-part sessions held no spawn; after 300 it spawned on 17.5% and summarised on
31% of turns with a finished history. Builds of 32 a step open 39-51% of multi-part sessions with a spawn (150 and
300 steps: docs/swarm.md, "In the suite"); their summaries are fewer (a fifth of the draws hold an edit, not half),
and this test's runs on both (sessions 39 and 40) still found both.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest

from flywheel import stack as stack_mod
from flywheel.base.config import from_recipe
from flywheel.base.versions import FROZEN_VERSION
from flywheel.demo import closed_loop as demo
from flywheel.demo import swarm, warm_start
from flywheel.demo.plan import SUBAGENT_SERVED
from flywheel.ingest import lake

# Its budget, measured: the run takes ~310 s in the suite on a quiet 2-core machine (session 39: 314 s), and went past
# the suite's 900 s beside one CPU-bound job when it trained its own warm start (issue 35). The builds now run in the
# background from the session's start (run alone, `pytest -k swarm` first waits ~6 minutes for them); the bound is
# the run's ~5x plus the builds: only a hang reaches it, not a busy machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_model_spawns_and_summaries_flow_into_episodes_with_the_right_rows_rewarded(
        stack: stack_mod.StackConfig, base_model_dir: Path, tmp_path: Path, run_demo: Callable[[demo.DemoConfig], int],
        background_build: Callable[[str], Path]) -> None:
    # built from the session's start in the background (conftest.BackgroundBuild: SWARM_TEST_WARM)
    built = background_build("test_swarm_loop.py")
    warm, subagents = built / "warm", built / "subagent"
    assert json.loads((warm / "warm_start.json").read_text())["settings"]["max_steps"] == 150
    assert warm_start.is_current(warm, base_model_dir, rule=swarm.warm_rule()), "built from another base or rule"
    assert warm_start.is_current(subagents, base_model_dir, rule=swarm.subagent_rule()), "sub-agents: another rule"
    tuned = from_recipe(demo.DemoConfig, "swarm")  # with small batches, an early anneal, a gate that looks after 5
    learner = dataclasses.replace(tuned.learner, batch_size=16, min_batch=16, micro_batch=16, publish_every_steps=2,
                                  publish_every_s=30.0, shaping_anneal_end_step=4)
    cfg = dataclasses.replace(tuned, minutes=3.0, var_dir=tmp_path / "var", report_dir=tmp_path / "report",
                              base_model=base_model_dir, warm_model=warm, subagent_model=subagents,
                              load_policy_v0_weights=True, concurrency=6,
                              learner=learner, gate=dataclasses.replace(tuned.gate, min_sessions=5), vllm_servers=2,
                              vllm_nice=0,  # the session's shared servers: no test can make them less nice again
                              gate_interval_s=10.0, base_sessions=30, measure_s=40.0, drain_s=20.0,
                              keep_stack=True, live=False, run_id=f"swarm-test-{uuid.uuid4().hex[:8]}")
    cfg.check()
    try:
        assert run_demo(cfg) == 0
    finally:  # keep_stack keeps the session's servers, not this run's frozen one
        stack_mod.stop_frozen_vllm(stack, SUBAGENT_SERVED)
    run_dir = tmp_path / "var" / "demo" / cfg.run_id
    events = _table(str(run_dir / "lake"), "events")
    episodes = {r["episode_id"]: r for r in _table(str(run_dir / "lake"), "episodes") if r["label_version"] == 1}
    by_agent: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in sorted(events, key=lambda e: (e["ts"], e["seq"])):
        by_agent.setdefault((e["session_id"], e["agent_id"]), []).append(e)

    # a spawn the model decided: the orchestrator's llm_call, then its spawn tool call and the subagent_spawn events
    decisions: dict[str, int] = {}
    for evs in by_agent.values():
        last = None
        for e in evs:
            if e["type"] == "llm_call":
                last = e
            elif e["type"] == "subagent_spawn" and last is not None:
                decisions[last["event_id"]] = decisions.get(last["event_id"], 0) + 1
    assert decisions, f"no model-initiated spawn in {len(events)} events"
    decided_rows = [episodes[eid] for eid in decisions if eid in episodes]
    assert decided_rows, f"none of {len(decisions)} spawn decisions has an episode row"
    shaped = {eid for eid, r in episodes.items() if r["r_parallel"] > 0}
    assert shaped and shaped <= set(decisions), \
        f"r_parallel on {len(shaped - set(decisions))} rows that decided no spawn (of {len(shaped)} shaped)"
    child_rows = [r for r in episodes.values() if r["parent_agent_id"] is not None]
    assert child_rows and all(r["r_parallel"] == 0 and r["r_finish"] == 0 for r in child_rows), \
        "a sub-agent's row was paid for its parent's spawn"

    # frozen sub-agents: every child agent's call went to their own model, logged off the learner's line, and none
    # was trained; the orchestrator's calls are the policy's
    calls = [e for e in events if e["type"] == "llm_call"]
    child_calls = [e for e in calls if e["parent_agent_id"] is not None]
    assert child_calls and all(e["policy_version"] == FROZEN_VERSION and e["model"] == SUBAGENT_SERVED
                               for e in child_calls), {(e["policy_version"], e["model"]) for e in child_calls}
    assert all(e["policy_version"] >= 0 for e in calls if e["parent_agent_id"] is None), "an orchestrator call frozen"
    trained = {eid for line in (run_dir / "learner" / "trained.jsonl").read_text().splitlines()
               for eid in json.loads(line)["episode_ids"]}
    assert trained and not trained & {r["episode_id"] for r in child_rows}, "a frozen sub-agent's row was trained"

    # a summary the model wrote: context_edit(summarize) whose token ids are the completion of the agent's call just before
    summaries = []
    for evs in by_agent.values():
        last = None
        for e in evs:
            if e["type"] == "llm_call":
                last = e
            elif e["type"] == "context_edit" and e["edit_kind"] == "summarize" and last is not None:
                summaries.append((e, last))
    assert summaries, "no model-initiated summary"
    own: list[tuple[dict[str, Any], dict[str, Any]]] = []
    unmatched: list[dict[str, Any]] = []
    for e, call in summaries:
        if list(e["summary_token_ids"] or []) == list(call["completion_token_ids"]):
            own.append((e, call))
        else:
            unmatched.append(e)
    # The one allowed exception: the summary's own call is not in the lake because the proxy did not log it (it was
    # served across a weight reload, so its version is unknown: docs/reliability.md). Such a summary matches no
    # llm_call of its agent, and the proxy counted at least as many unlogged calls.
    for e in unmatched:
        calls = [c for c in by_agent[(e["session_id"], e["agent_id"])] if c["type"] == "llm_call"]
        assert all(list(c["completion_token_ids"]) != list(e["summary_token_ids"] or []) for c in calls), \
            f"summary {e['event_id']} has the tokens of another call of its agent, not of the call that wrote it"
    unlogged = (run_dir / "logs" / "proxy.log").read_text().count("llm_call not logged")
    assert len(unmatched) <= unlogged, \
        f"{len(unmatched)} of {len(summaries)} summaries are not their call's tokens ({unlogged} calls unlogged by the proxy)"
    assert own, "no summary whose writing call is in the lake"
    rewarded = [episodes[call["event_id"]] for _, call in own if call["event_id"] in episodes]
    assert rewarded, "no summary-writing call reached the episodes"
    for r in rewarded:  # trained with the session's outcome (no turn check verifies a summary)
        assert r["r_turn"] is None and r["reward"] == pytest.approx(r["r_outcome"] + r["r_penalty"]), r
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    for key in ("parallel_share_control", "parallel_share_champion", "p_value_parallel", "critical_steps_control",
                "critical_steps_champion", "success_control", "success_champion", "shaping_zero_from_min", "minutes",
                "parts_correct_control", "parts_correct_champion"):
        assert key in summary, f"summary.json lacks {key}"
    assert summary["swarm_sessions"] > 0, summary
    assert (tmp_path / "report" / "swarm_by_version.png").stat().st_size > 0


def _table(lake_root: str, table: str) -> list[dict[str, Any]]:
    import duckdb

    files = [f.path for f in lake.list_files(lake_root, table)]
    if not files:
        return []
    listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
    return duckdb.sql(f"SELECT * FROM read_parquet([{listed}], union_by_name = true)").fetch_arrow_table().to_pylist()
