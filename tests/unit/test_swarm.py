"""The swarm scenario's harness (infra/demo/swarm.py) with a scripted policy, and its PARL/edit rewards on
hand-built sessions (rewards/parl.py) and the learner-step annealing (learner/data.py)."""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from bench.fixtures import sessions as synthetic
from flywheel.demo import swarm, tasks
from flywheel.ingest import schema
from flywheel.learner.data import parse_row, shaping_scale
from flywheel.rewards import config, parl
from flywheel.rewards.session import assemble
from flywheel.rewards.turns import turns

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


@dataclass
class Agent:
    """Records what the harness logs through the SDK's Session surface (tool calls, spawns, context edits)."""

    agent_id: str = "main"
    session_id: str = "s1"
    parent_agent_id: str | None = None
    log: list[tuple[str, Any]] = field(default_factory=list)
    children: list["Agent"] = field(default_factory=list)
    finished: bool | None = None

    def tool_call(self, name: str, arguments: Any, malformed: bool | None = None, malformed_token: int | None = None) -> str:
        cid = f"{self.agent_id}-c{len(self.log)}"
        self.log.append(("tool_call", (name, cid)))
        if malformed:
            self.log.append(("malformed_token", malformed_token))
        return cid

    def tool_result(self, call_id: str, ok: bool, output: str, name: str | None = None) -> None:
        self.log.append(("tool_result", call_id))

    def spawn_subagent(self, subtask: str) -> "Agent":
        child = Agent(f"sub{len(self.children)}", self.session_id, self.agent_id)
        self.children.append(child)
        self.log.append(("spawn", subtask))
        return child

    def finish(self, ok: bool) -> None:
        self.finished = ok

    def context_edit(self, kind: str, tokens_removed: int, summary_token_ids: list[int] | None) -> None:
        self.log.append(("context_edit", (kind, tokens_removed, summary_token_ids)))


class Policy:
    """A scripted policy: solves a one-part request right; `plan` says what it does with a multi-part one or a
    long history. Every reply gets fresh token ids, recorded per agent as the proxy would log them."""

    def __init__(self, plan: str) -> None:
        self.plan = plan
        self.calls: list[tuple[str, str, list[int]]] = []  # (agent, reply, completion ids)

    def reply(self, agent: Agent, messages: list[tasks.Message]) -> swarm.Reply:
        text = self._text(messages)
        if self.plan == "prune_needed" and '"prune"' in text:
            self.pruned = True
        ids = [random.randrange(512) for _ in range(len(text) // 3 + 1)]
        self.calls.append((agent.agent_id, text, ids))
        return swarm.Reply(text, ids)

    def _text(self, messages: list[tasks.Message]) -> str:
        last = messages[-1]
        if self.plan == "prune_needed":  # drops the tool result it needs, then cannot answer
            if last["role"] == "tool":
                return swarm.format_prune([len(messages) - 1]) if not getattr(self, "pruned", False) else "Answer: ?"
            if getattr(self, "pruned", False):
                return "Answer: lost"
        if last["content"] == swarm.SUMMARY_REQUEST:
            return swarm.summary_text(messages)
        if last["role"] == "tool":
            return tasks.format_answer(last["content"]) if ";" not in messages[0]["content"] else self._next_serial(messages)
        request = last["content"]
        if ";" in request:
            texts = [t.strip() for t in request.split(";")]
            if self.plan == "spawn":
                return swarm.format_spawn(texts)
            if self.plan == "spurious":
                return swarm.format_spawn([texts[0], texts[0]])
            if self.plan == "spawn_extra":  # every part, and the first once more: one sub-agent past the parts
                return swarm.format_spawn(texts + [texts[0]])
            if self.plan == "spawn_parts_reversed":  # piece numbers, last first
                return swarm.format_spawn_parts(list(range(len(texts), 0, -1)))
            if self.plan == "spawn_parts_twice":  # the first piece twice, the rest left out
                return swarm.format_spawn_parts([1, 1])
            if self.plan == "spawn_parts_beyond":  # a piece the request does not have
                return swarm.format_spawn_parts([1, len(texts) + 1]) if len(messages) == 1 else "Answer: ?"
            return self._next_serial(messages)
        if self.plan == "summarize" and swarm.chars(messages) > 100 and len(messages) > 2:
            return swarm.format_summarize()
        part = _part_of_text(request)
        return tasks.format_tool_call(part.tool, part.args)

    def _next_serial(self, messages: list[tasks.Message]) -> str:
        texts = [t.strip() for t in messages[0]["content"].split(";")]
        results = [m["content"] for m in messages if m["role"] == "tool"]
        if len(results) == len(texts):
            return tasks.format_answer(swarm.join_answers(results))
        part = _part_of_text(texts[len(results)])
        return tasks.format_tool_call(part.tool, part.args)


def _part_of_text(text: str) -> tasks.Part:
    for tool, args, phrasing in tasks.task_space():
        if tasks.prompt_text(tool, args, phrasing) == text:
            return tasks.Part(tool, args, text)
    raise AssertionError(f"no part reads {text!r}")


def _task(kind: str, n: int, seed: int = 3) -> swarm.SwarmTask:
    rng = random.Random(seed)
    return swarm.SwarmTask(kind, tasks.TaskSpec("t1", tuple(tasks.make_part(rng) for _ in range(n))))


def test_a_model_spawn_runs_one_sub_agent_per_task_it_wrote_and_pays_in_critical_steps() -> None:
    task, main, policy = _task("multi", 3), Agent(), Policy("spawn")
    result = swarm.SwarmSession(task, main, policy.reply, swarm.SwarmLimits()).run()
    assert [c.agent_id for c in main.children] == ["sub0", "sub1", "sub2"] and all(c.finished for c in main.children)
    assert tasks.check(task.spec, result.answers), result.answers
    assert [p["agent_id"] for p in result.parts] == ["sub0", "sub1", "sub2"]
    assert main.log[0] == ("tool_call", ("spawn", "main-c0")), "the spawn is logged as the orchestrator's own tool call"
    assert result.critical_steps == 1 + 2, result
    serial = swarm.SwarmSession(task, Agent(), Policy("serial").reply, swarm.SwarmLimits()).run()
    assert tasks.check(task.spec, serial.answers) and serial.spawned == 0
    assert serial.critical_steps == 3 + 1, f"serial: a call per part and the answer, got {serial.critical_steps}"
    record = swarm.handoff_record("s1", "main", task, serial, 0.0)
    assert {p["agent_id"] for p in record["parts"]} == {"main"} and record["main_agent_id"] == "main"


def test_a_spawn_by_piece_numbers_answers_each_part_with_the_sub_agent_given_its_piece() -> None:
    """{"parts": [3, 2, 1]}: sub-agent i takes piece 3-i and answers that piece's part, whatever the order."""
    task, main = _task("multi", 3), Agent()
    result = swarm.SwarmSession(task, main, Policy("spawn_parts_reversed").reply, swarm.SwarmLimits()).run()
    assert result.spawn_tasks == [p.text for p in reversed(task.spec.parts)]
    assert tasks.check(task.spec, result.answers), result.answers
    assert [p["agent_id"] for p in result.parts] == ["sub2", "sub1", "sub0"] and result.critical_steps == 3
    twice = swarm.SwarmSession(task, Agent(), Policy("spawn_parts_twice").reply, swarm.SwarmLimits()).run()
    assert twice.spawned == 2 and twice.extra_agents == ["sub1"], "a piece given twice: the second answers nothing"
    assert tasks.check_part(task.spec.parts[0], twice.answers[0]) and twice.answers[1:] == [None, None]
    beyond = Agent()
    out = swarm.SwarmSession(task, beyond, Policy("spawn_parts_beyond").reply, swarm.SwarmLimits()).run()
    assert out.spawned == 0 and ("malformed_token", None) in beyond.log, "a piece past the request: a malformed spawn"
    assert swarm.spawn_tasks({"parts": [True]}, "a; b") is None and swarm.spawn_tasks({"parts": []}, "a") is None


def test_a_spurious_spawn_fails_the_part_it_left_out() -> None:
    task = _task("multi", 2)
    result = swarm.SwarmSession(task, Agent(), Policy("spurious").reply, swarm.SwarmLimits()).run()
    assert result.spawned == 2 and result.spawn_tasks[0] == result.spawn_tasks[1]
    assert tasks.check_part(task.spec.parts[0], result.answers[0]) and not tasks.check(task.spec, result.answers)


def test_the_summary_tokens_are_the_models_own_completion() -> None:
    task, main, policy = _task("long", 4), Agent(), Policy("summarize")
    result = swarm.SwarmSession(task, main, policy.reply, swarm.SwarmLimits(context_budget_chars=200)).run()
    edits = [x for kind, x in main.log if kind == "context_edit"]
    assert edits and all(e[0] == "summarize" and e[1] > 0 for e in edits), main.log
    wrote = [ids for _, text, ids in policy.calls if not text.startswith(("<tool_call>", "Answer:"))]
    assert [e[2] for e in edits] == wrote, "summary_token_ids must be the completion of the call that wrote each summary"
    assert not result.overflow and tasks.check(task.spec, result.answers), result
    # the same policy without the action overflows the budget and fails the rest of the session
    plain = swarm.SwarmSession(task, Agent(), Policy("serial").reply, swarm.SwarmLimits(context_budget_chars=200)).run()
    assert plain.overflow and not tasks.check(task.spec, plain.answers)


def test_a_prune_of_the_current_tool_result_is_harmful_when_the_part_then_fails() -> None:
    task, main = _task("long", 3), Agent()
    result = swarm.SwarmSession(task, main, Policy("prune_needed").reply, swarm.SwarmLimits(max_edits=1)).run()
    record = swarm.handoff_record("s1", "main", task, result, 0.0)
    ok = tasks.check(task.spec, result.answers)
    verdicts = swarm.harmful_prunes(record, ok)
    assert verdicts and result.edits[0]["removed_needed"], result.edits
    assert not ok and verdicts == [(result.edits[0]["call_id"], True)], (verdicts, result)
    # the same prune in a session that succeeded harmed nothing the checker can see
    assert swarm.harmful_prunes(record, True) == [(result.edits[0]["call_id"], False)]


def test_the_outcome_simulator_sends_the_prune_verdict_of_a_swarm_session(tmp_path) -> None:
    """The simulator process, not only harmful_prunes: a swarm hand-off line with a prune yields its verdict."""
    import json

    from flywheel.demo import outcome_sim

    task, main = _task("long", 3), Agent()
    result = swarm.SwarmSession(task, main, Policy("prune_needed").reply, swarm.SwarmLimits(max_edits=1)).run()
    cfg = outcome_sim.OutcomeSimConfig(handoff=tmp_path / "sessions.jsonl", cursor=tmp_path / "cursor.json",
                                       verifier_delay_s=1.0, user_share=0.0, seed=3)
    cfg.handoff.write_text(json.dumps(swarm.handoff_record("s1", "main", task, result, 0.0)) + "\n")

    class Reporter:
        def __init__(self) -> None:
            self.sent: list[tuple[str, float, str | None]] = []

        def report(self, session_id: str, kind: str, value: float, **kw: object) -> str:
            self.sent.append((kind, value, kw.get("call_id")))  # type: ignore[arg-type]
            return str(kw.get("outcome_id"))

        def flush(self, timeout: float = 10.0) -> bool:
            return True

        def metrics(self) -> dict:
            return {"dropped": 0}

    reporter = Reporter()
    sim = outcome_sim.OutcomeSim(cfg, reporter)
    sim.step(now=5.0)
    assert ("prune_harmful", 1.0, result.edits[0]["call_id"]) in reporter.sent, reporter.sent
    assert sim.status()["prune_harmful"] == 1 and sim.status()["task_success"] == 1, sim.status()


def test_the_verifier_grades_the_share_of_parts_right_for_the_session_and_each_sub_agent(tmp_path) -> None:
    """parts_correct: the session's share of parts answered right (reported beside task success; runs c-i trained and gated on it) and, with
    its agent_id, each sub-agent's own part; a line of the default scenario gets none."""
    from flywheel.demo import outcome_sim

    task = _task("multi", 3)
    result = swarm.SwarmSession(task, Agent(), Policy("spawn").reply, swarm.SwarmLimits()).run()
    result.answers[1] = "Answer: wrong"
    record = swarm.handoff_record("s1", "main", task, result, 0.0)
    assert swarm.parts_correct(record) == (pytest.approx(2 / 3), {"sub0": 1.0, "sub1": 0.0, "sub2": 1.0})
    serial = swarm.SwarmSession(task, Agent(), Policy("serial").reply, swarm.SwarmLimits()).run()
    assert swarm.parts_correct(swarm.handoff_record("s2", "main", task, serial, 0.0)) == (1.0, {})
    assert swarm.parts_correct({k: v for k, v in record.items() if k != "scenario"}) is None
    cfg = outcome_sim.OutcomeSimConfig(handoff=tmp_path / "h.jsonl", cursor=tmp_path / "c.json", user_share=0.0)
    due = outcome_sim.schedule(record, cfg, random.Random(0))
    graded = {(d.agent_id, round(d.value, 4)) for d in due if d.kind == swarm.PARTS_CORRECT}
    assert graded == {(None, 0.6667), ("sub0", 1.0), ("sub1", 0.0), ("sub2", 1.0)}, graded
    verdict = next(d for d in due if d.kind == "task_success" and d.agent_id is None)
    assert verdict.value == 0.0 and all(d.at < verdict.at for d in due if d.kind == swarm.PARTS_CORRECT), \
        "graded outcomes land before the verdict label 1 waits for"
    assert len({d.outcome_id for d in due}) == len(due)
    checked = {d.agent_id: d.value for d in due if d.kind == "task_success" and d.agent_id}
    assert checked == {a: v for a, v in graded if a}, "a sub-agent's graded part agrees with its own part check"
    # a spawn of more sub-agents than parts: the one past the parts has no part, so it is graded 0, not the session's share
    over = swarm.handoff_record("s3", "main", _task("multi", 2), swarm.SwarmSession(
        _task("multi", 2), Agent(), Policy("spawn_extra").reply, swarm.SwarmLimits()).run(), 0.0)
    assert over["extra_agents"] and swarm.parts_correct(over)[1][over["extra_agents"][0]] == 0.0, over


def test_the_swarm_judges_every_row_by_its_agents_outcome_not_by_per_turn_credit() -> None:
    """Spawn and a serial first call decide the same turn: both are judged by the session's task success (a
    sub-agent's rows by its own part's check), so a right serial call in a session that failed earns 0. The share of
    parts right is reported with weight 0 (issue 39: with lookup parts task success carries the signal)."""
    from flywheel.demo import plan
    from flywheel.rewards import outcome_rewards
    from flywheel.rewards.turns import ToolTurn, call_outcomes, credit

    rules = config.load(plan.SWARM_REWARDS)
    task = rules.task("tool_use.swarm_multi")
    outcomes = [synthetic.outcome("s1", "call_correct", 1.0, T0, call_id="c1") | {"ts": T0},
                synthetic.outcome("s1", "parts_correct", 0.5, T0) | {"ts": T0},
                synthetic.outcome("s1", "parts_correct", 1.0, T0, agent_id="sub0") | {"ts": T0},
                synthetic.outcome("s1", "task_success", 0.0, T0) | {"ts": T0},
                synthetic.outcome("s1", "task_success", 1.0, T0, agent_id="sub0") | {"ts": T0}]
    assert credit(rules, task, ToolTurn(("c1",)), call_outcomes(outcomes, task.turn_kinds)).r_turn is None
    main = outcome_rewards.score_for_agent(rules, task, outcomes, "main", window_closed=True)
    sub = outcome_rewards.score_for_agent(rules, task, outcomes, "sub0", window_closed=True)
    assert (main.r_outcome, sub.r_outcome) == (0.0, 1.0), (main, sub)
    passed = outcomes[:2] + [synthetic.outcome("s1", "task_success", 1.0, T0) | {"ts": T0}]
    assert outcome_rewards.score_for_agent(rules, task, passed, "main", window_closed=True).r_outcome == 1.0


def test_a_broken_spawn_is_logged_with_the_token_where_it_stopped_reading_as_a_call() -> None:
    """The harness maps tasks.malformed_from's character to a token with the limits' token_at, so the penalty
    falls on the broken sub-task, not on the `<tool_call>{"name": "spawn"` prefix the policy got right."""
    pieces: list[str] = []

    def reply(agent: Agent, messages: list[tasks.Message]) -> swarm.Reply:
        text = '<tool_call>{"name": "spawn", "arguments": {"tasks": ["add 3 and 4", "weather in o' if len(messages) == 1 \
            else "Answer: 7; sunny"
        ids = list(range(len(pieces), len(pieces) + len(text)))  # one character per token
        pieces.extend(text)
        return swarm.Reply(text, ids)

    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    task = _task("multi", 2)
    main = Agent()
    limits = swarm.SwarmLimits(token_at=lambda ids, text, char: tasks.token_at(decode, ids, text, char))
    swarm.SwarmSession(task, main, reply, limits).run()
    broken = '<tool_call>{"name": "spawn", "arguments": {"tasks": ["add 3 and 4", '
    assert ("malformed_token", len(broken)) in main.log, main.log
    unknown = Agent()
    swarm.SwarmSession(task, unknown, reply, swarm.SwarmLimits()).run()
    assert ("malformed_token", None) in unknown.log, "without a tokenizer the whole reply is charged"


def test_multi_part_requests_have_two_or_three_lookup_parts() -> None:
    rng = random.Random(1)
    made = [swarm.make_swarm_task(rng) for _ in range(400)]
    assert {len(t.spec.parts) for t in made if t.kind == "multi"} == set(swarm.MULTI_PARTS) == {2, 3}
    tools = [p.tool for t in made for p in t.spec.parts]
    assert set(tools) == set(tasks.LOOKUPS), f"swarm parts are the closed-set lookups only: {sorted(set(tools))}"
    assert {t.kind for t in made} == set(swarm.KINDS)


def _opening(demo: list[swarm.Demo]) -> tuple[list[tasks.Message], str]:
    return demo[0]


def test_the_demonstrated_orchestrator_splits_half_of_its_multi_part_requests_and_no_single_one() -> None:
    """The declared choice (issue 39): multi-part openings are a spawn of every piece about half the time and a
    serial call otherwise; a one-part request is never split; edits appear on a minority of draws."""
    rng = random.Random(0)
    draws = [swarm.demonstrations(rng, tool_share=0.2) for _ in range(3000)]
    multi, single, edits = [], [], 0
    for demo in draws:
        messages, reply = _opening(demo)
        parsed = tasks.parse_reply(reply)
        assert parsed.kind == "tool_call", reply
        if parsed.tool in (swarm.SUMMARIZE, swarm.PRUNE):
            edits += 1
            continue
        if len(messages) != 1:
            continue  # a long dialogue's later request
        pieces = swarm.request_pieces(messages[0]["content"])
        (multi if len(pieces) > 1 else single).append((pieces, parsed))
    spawns = [(pieces, p) for pieces, p in multi if p.tool == swarm.SPAWN]
    assert 0.45 < len(spawns) / len(multi) < 0.55, f"{len(spawns)} of {len(multi)} multi-part openings split"
    assert all(p.arguments == {"parts": list(range(1, len(pieces) + 1))} for pieces, p in spawns), \
        "a demonstrated split names every piece once"
    assert not any(p.tool == swarm.SPAWN for _, p in single), "a one-part request was split"
    assert 0.15 < edits / len(draws) < 0.25, f"{edits} of {len(draws)} draws demonstrate an edit"
    for demo in draws:
        for _, reply in demo:
            assert tasks.parse_reply(reply).kind in ("tool_call", "answer"), reply
    lookups = {tasks.prompt_text(t, a, i) for t, a, i in tasks.task_space() if t in tasks.LOOKUPS}
    for demo in draws:
        for messages, _ in demo:
            requests = [m["content"] for m in messages if m["role"] == "user" and m["content"] != swarm.SUMMARY_REQUEST]
            assert all(set(swarm.request_pieces(r)) <= lookups for r in requests), f"a request not of lookups: {requests}"


# ---------------------------------------------------------------------------------------------
# rewards on hand-built sessions
# ---------------------------------------------------------------------------------------------
def _rows(events: list[dict]) -> list[dict]:
    return [e | {"ts": schema.parse_ts(e["ts"])} for e in events]


def _session(spawn: list[str] | None) -> tuple[Any, dict, list[dict]]:
    b = synthetic.SessionBuilder("s1", T0, task_type="tool_use.swarm_multi").begin()
    decide = b.llm_call()
    if spawn is not None:
        b.tool()
        for i, text in enumerate(spawn):
            b.spawn(f"k{i}")
            b.events[-1]["subtask"] = text
        for i in range(len(spawn)):
            b.llm_call(agent=f"k{i}", parent="main")
            b.finish(f"k{i}", ok=True)
    else:
        b.llm_call()
    b.end()
    checks = [synthetic.outcome("s1", "task_success", 1.0, T0, agent_id="k0") | {"ts": T0}]
    return assemble("s1", _rows(b.events)), decide, checks


def test_parl_terms_go_to_the_spawn_decision_row_only() -> None:
    cfg = config.ParlSettings(lambda1=0.4, lambda2=0.2, parallel_cap=4, anneal_clock="learner_step")
    s, decide, checks = _session(["add 3 and 4", "weather in oslo"])
    shaped = parl.row_shaping(s, cfg, checks)
    assert list(shaped) == [decide["event_id"]], "only the orchestrator's deciding call is shaped"
    row = shaped[decide["event_id"]]
    assert (row.n_spawned, row.n_verified, row.n_spurious) == (2, 1, 0)
    assert row.r_parallel == pytest.approx(0.4 * 2 / 4) and row.r_finish == pytest.approx(0.2 * 1 / 2)
    # no spawn: nothing shaped
    s, _, checks = _session(None)
    assert parl.row_shaping(s, cfg, checks) == {}
    # spurious: the same sub-task twice (and an empty one) count, and r_finish only pays verified parts
    s, decide, checks = _session(["add 3 and 4", "add 3  and 4", ""])
    row = parl.row_shaping(s, cfg, checks)[decide["event_id"]]
    assert (row.n_spawned, row.n_spurious) == (3, 2) and row.r_finish == pytest.approx(0.2 / 3)
    # harness spawns (no llm_call of the agent before them) shape nothing
    b = synthetic.SessionBuilder("s2", T0).begin()
    b.spawn("k0")
    b.llm_call(agent="k0", parent="main")
    b.end()
    assert parl.row_shaping(assemble("s2", _rows(b.events)), cfg) == {}


def test_policy_version_clock_anneals_to_exactly_zero_and_learner_step_clock_leaves_it_to_the_learner() -> None:
    by_version = config.ParlSettings(lambda1=0.4, lambda2=0.2, anneal_start=0, anneal_end=5)
    assert parl.lambdas(by_version, 5) == (0.0, 0.0) and parl.lambdas(by_version, 0) == (0.4, 0.2)
    by_step = config.ParlSettings(lambda1=0.4, lambda2=0.2, anneal_end=5, anneal_clock="learner_step")
    assert parl.lambdas(by_step, 50) == (0.4, 0.2)
    assert [shaping_scale(t, 10, 30) for t in (0, 10, 20, 29)] == [1.0, 1.0, 0.5, pytest.approx(0.05)]
    assert all(shaping_scale(t, 10, 30) == 0.0 for t in range(30, 200)), "exactly zero from the end step on"
    assert shaping_scale(10_000, 0, 0) == 1.0, "end 0: the learner does not anneal"
    with pytest.raises(config.RewardConfigError, match="anneal_clock"):
        config.parse('[parl]\nanneal_clock = "wall"\n')


def test_the_learner_trains_the_shaping_at_its_steps_weight() -> None:
    from bench.fixtures.episodes import episode_row

    row = episode_row(prompt=[1, 2], completion=[3], logprobs=[-0.5], reward=1.3, task_type="tool_use.swarm_multi")
    row.update(r_outcome=1.0, r_parallel=0.2, r_finish=0.1)
    ep = parse_row(row, vocab_size=512, max_seq_len=64)
    assert not isinstance(ep, str), ep
    assert ep.trained_reward(1.0) == pytest.approx(1.3) and ep.trained_reward(0.0) == pytest.approx(1.0)


def test_a_harmful_prune_costs_the_row_that_decided_it() -> None:
    b = synthetic.SessionBuilder("s1", T0).begin()
    prune_row = b.llm_call()
    call_id = b.tool()
    other = b.llm_call()
    b.end()
    s = assemble("s1", _rows(b.events))
    pens = config.PenaltySettings(harmful_prune=-0.3)
    harmful = [synthetic.outcome("s1", "prune_harmful", 1.0, T0, call_id=call_id) | {"ts": T0}]
    assert parl.harmful_prune_penalties(turns(s), harmful, pens) == {prune_row["event_id"]: -0.3}
    assert other["event_id"] not in parl.harmful_prune_penalties(turns(s), harmful, pens)
    harmless = [harmful[0] | {"value": 0.0}]
    assert parl.harmful_prune_penalties(turns(s), harmless, pens) == {}


# ---------------------------------------------------------------------------------------------
# the report's swarm section (infra/demo/swarm_report.py)
# ---------------------------------------------------------------------------------------------
def test_report_compares_the_final_window_and_finds_when_shaping_reached_zero() -> None:
    from flywheel.demo import swarm_report as sr

    def s(arm: str, version: int, spawned: int, steps: int, ok: bool, kind: str = "multi", parts: int = 2,
          started: float = 100.0) -> sr.SwarmSessionStats:
        return sr.SwarmSessionStats(kind, version, arm, started, ok, spawned, 0, steps, 0, n_parts=parts)

    window = ([s("control", 0, 0, 4, True)] * 30 + [s("control", 0, 2, 3, True)] * 10
              + [s("champion", 3, 3, 3, True)] * 36 + [s("champion", 3, 0, 5, False)] * 4 + [s("champion", 3, 0, 9, True, "long")])
    out = sr.compare(window + [sr.SwarmSessionStats("multi", 3, "champion", 50.0, True, 0, 0, 9, 0)], since=90.0, champion=3)
    assert (out["parallel_share_control"], out["parallel_share_champion"]) == (0.25, 0.9)
    assert out["p_value_parallel"] < 0.01 and out["n_multi_champion"] == 40, out
    assert out["critical_steps_champion"] == pytest.approx(3.2) and out["critical_steps_control"] == pytest.approx(3.75)
    assert out["success_champion"] == pytest.approx(37 / 41, abs=1e-4) and len(out["success_ci_champion"]) == 2
    assert (out["success_multi_control"], out["success_multi_champion"]) == (1.0, 0.9), "the long session is not counted"
    assert out["p_value_success_multi"] > 0.5, "the champion solved fewer multi-part sessions"
    assert out["critical_steps_3_control"] is None and out["n_three_part_champion"] == 0, "no three-part session"
    three = sr.compare([s("control", 0, 0, 4, True, parts=3), s("control", 0, 0, 5, True, parts=3),
                        s("champion", 3, 3, 3, True, parts=3), s("champion", 3, 0, 4, True)], since=90.0, champion=3)
    assert (three["critical_steps_3_control"], three["critical_steps_3_champion"]) == (4.5, 3.0), three
    # once the shaping is 0 (t >= 200): the champion arm, whichever version holds it, against the control
    late = ([s("control", 0, 0, 4, True, started=250.0)] * 20 + [s("control", 0, 2, 3, True, started=250.0)] * 5
            + [s("champion", 4, 2, 3, True, started=250.0)] * 18 + [s("champion", 5, 0, 4, True, started=260.0)] * 2
            + [s("champion", 3, 2, 3, True, started=150.0)] * 50)
    after = sr.after_shaping(late, 200.0)
    assert (after["parallel_share_after_shaping_control"], after["parallel_share_after_shaping_champion"]) == (0.2, 0.9)
    assert after["n_multi_after_shaping_champion"] == 20 and after["p_value_parallel_after_shaping"] < 0.01, after
    assert sr.after_shaping(late, None)["p_value_parallel_after_shaping"] is None, "the shaping never reached 0"
    curve = [{"t": 60.0 * m, "step": m, "lambda1": 0.3 * max(0.0, 1 - m / 5), "lambda2": 0.0} for m in range(10)]
    assert sr.zero_from(curve, 0.0) == 5.0
    rec = {"task": {"parts": [{}, {}]}, "spawn_tasks": ["add 3 and 4", "Add 3 and 4", "", "weather in oslo"]}
    assert sr.spurious(rec) == 2 + 2, "a repeat, an empty task, and two past the request's two parts"


def test_a_prune_never_drops_the_request_being_answered() -> None:
    task, main = _task("long", 3), Agent()
    session = swarm.SwarmSession(task, main, Policy("serial").reply, swarm.SwarmLimits())
    history = [tasks.user_message(task.spec.parts[0])]
    parsed = tasks.parse_reply(swarm.format_prune([0]))
    out = session._edit(parsed, history + [{"role": "assistant", "content": swarm.format_prune([0])}], current=0)
    assert out[0] == history[0] and not main.log[-1][0] == "context_edit", "the request stays; the prune is refused"


def test_the_swarm_recipe_and_flags_reach_each_sub_command() -> None:
    import dataclasses
    from pathlib import Path

    from flywheel.base.config import ConfigError, from_recipe, load_config
    from flywheel.demo import plan
    from flywheel.demo.agent_sim import AgentSimConfig
    from flywheel.learner.config import LearnerConfig
    from flywheel.rewards.builder import EpisodesConfig
    from flywheel.serving.promote import PromoteConfig

    cfg = from_recipe(plan.DemoConfig, "swarm")
    cfg = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, shaping_anneal_end_step=7))
    cfg.check()
    assert (cfg.scenario, cfg.warm_model) == ("swarm", Path("var/models/tiny-swarm-warm")), "its own policy-v0"
    with pytest.raises(ConfigError, match="--recipe swarm"):
        plan.DemoConfig(scenario="swarm").check()  # the tool-use values under the swarm's name: refused
    agent = load_config(AgentSimConfig, plan.scenario_flags(cfg, "agent-sim"), prog="agent-sim")
    assert (agent.scenario, agent.max_tokens) == ("swarm", plan.SWARM_MAX_TOKENS)
    episodes = load_config(EpisodesConfig, ["--rewards-toml", "other.toml", *plan.scenario_flags(cfg, "episodes")],
                           prog="episodes")
    assert episodes.rewards_toml == str(plan.SWARM_REWARDS), "the scenario's rules win over the command's own"
    assert config.load(plan.SWARM_REWARDS).parl.anneal_clock == "learner_step"
    ends = plan.Endpoints(kafka_bootstrap="127.0.0.1:9092", vllm_url="http://v0", tracking_uri="file:///m", proxy_port=1)

    def gate_of(demo: plan.DemoConfig) -> PromoteConfig:
        argv = plan.promote_command(demo, plan.plan_run(demo, 0.0), ends)
        return load_config(PromoteConfig, argv[1:], prog="promote")

    def learner_of(demo: plan.DemoConfig) -> LearnerConfig:
        return load_config(LearnerConfig, plan.learner_command(demo, plan.plan_run(demo, 0.0), ends)[1:], prog="learner")

    gate = gate_of(cfg)
    assert gate.outcome_kind == "task_success" == cfg.gate.outcome_kind, "the report reads the same rule"
    assert gate.margin == cfg.gate.margin == 0.0, "the swarm gates on superiority in task success (issue 39)"
    learner = learner_of(cfg)
    assert (learner.shaping_anneal_start_step, learner.shaping_anneal_end_step) == (0, 7)
    assert (learner.kl_coef, learner.kl_target, learner.opening_share, learner.kl_rows, learner.kl_estimator) == \
        (1.0, 0.0, 0.5, "all", "exact"), "the tool-use recipe's KL anchor at ten times its coefficient (run sw3's rule)"
    default_learner = learner_of(plan.DemoConfig())
    assert (default_learner.kl_coef, default_learner.kl_target, default_learner.opening_share,
            default_learner.kl_rows) == (0.1, 0.0, 0.0, "all"), "the default demo's learner is the tool-use recipe's"
    assert default_learner.shaping_anneal_end_step == 0, "the default demo does not anneal"
    default = gate_of(plan.DemoConfig())
    assert (default.outcome_kind, default.margin) == ("task_success", 0.0), "the default demo's gate is unchanged"
    rules = config.load(plan.SWARM_REWARDS)
    assert rules.outcomes["task_success"].weight == 1.0 and rules.outcomes["parts_correct"].weight == 0.0
    assert plan.scenario_flags(plan.DemoConfig(), "agent-sim") == [], "the default demo is unchanged"
