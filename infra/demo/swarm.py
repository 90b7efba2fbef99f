"""The swarm scenario (`flywheel demo --scenario swarm`): spawning sub-agents, summarising and pruning the
context are actions the policy takes, logged with the SDK so the loop can train them.

    flywheel agent-sim --scenario swarm ...      (the demo starts it so)

Two kinds of session, both built from the tool-use parts of infra/demo/tasks.py:

* multi: one request with 2-3 independent parts ("add 3 and 4; weather in oslo; ..."). The policy may solve
  them itself, one tool call after another and then the joined answer (critical steps n+1: 3-4), or reply with the
  `spawn` tool, naming the request's pieces (its ";"-separated parts, counted from 1) each sub-agent takes,
  `<tool_call>{"name": "spawn", "arguments": {"parts": [1, 2]}}</tool_call>`, or writing each sub-task,
  `{"tasks": ["add 3 and 4", "weather in oslo"]}`: the harness starts one sub-agent of the policy per
  piece or task, in parallel, each its own agent of the session (SDK spawn_subagent, the proxy logs each
  sub-agent's calls under its agent id), and the orchestrator's answer is its sub-agents' answers. Critical
  steps: 1 + the slowest sub-agent (usually 2), so splitting pays. A sub-agent's answer is checked against
  its piece's part (with `tasks`, sub-agent i against part i): a part left out or given twice fails (PARL's
  r_finish), and an extra sub-agent is spurious. Why piece numbers: this 3M-parameter model cannot copy a
  request's text into sub-tasks (swarm run f: 47 spawns, every one with garbled sub-tasks such as "what is
  the weather in9 and 7 by 8", not one part right), so with `tasks` only, the outcome rightly taught it
  never to split; the decision to split, and into which pieces, stays the policy's (docs/swarm.md).
* long: 3-4 requests arrive one after another in one conversation, under a context budget (characters
  of the history). A model call whose history is over the budget is refused and the session fails from
  there on. Before that, the policy may reply `summarize` (the harness then asks it, in a second
  llm_call, to "Summarize the conversation so far."; that reply replaces every message before the
  current request, and the context_edit's summary_token_ids are that call's own completion token ids,
  as the proxy returned them) or `prune` with message indices to drop ({"drop": [0, 1, 2]}). The
  hand-off records each prune and whether it dropped the current request or its tool result, so the
  verifier can tell a harmful prune (outcome `prune_harmful`, rewards.toml's penalties.harmful_prune).

Every action is logged as a tool_call of the agent that decided it (name spawn, summarize or prune), right
after the llm_call that decided it, so the episode builder charges it to that row (rewards/parl.py
spawn_decisions, rewards/turns.py). The hand-off line has the tasks.py format (task spec, answers per
part, per part the agent and its calls), so `flywheel outcome-sim` verifies it unchanged, plus what the
swarm report counts. Pure Python here except the agent class, which runs inside `flywheel agent-sim`.
"""

from __future__ import annotations

import functools
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from flywheel.demo import tasks

log = logging.getLogger(__name__)

SPAWN, SUMMARIZE, PRUNE = "spawn", "summarize", "prune"
ACTIONS = (SPAWN, SUMMARIZE, PRUNE)
KINDS = ("multi", "long")
SUMMARY_REQUEST = "Summarize the conversation so far."
SUMMARY_PREFIX = "Summary: "
MAX_CHILDREN = 4  # a spawn asking for more is cut here (the extra ones would only be spurious)


@dataclass(frozen=True)
class SwarmTask:
    """One swarm session's work: the parts, and whether they come as one request (multi) or one by one (long)."""

    kind: str
    spec: tasks.TaskSpec

    @property
    def task_type(self) -> str:
        """tool_use.swarm_multi / tool_use.swarm_long: rewards.toml's tool_use rules, a baseline per kind."""
        return f"tool_use.swarm_{self.kind}"


MULTI_PARTS = (2, 3)
# Every swarm part is a closed-set lookup (weather, country, time zone of a city), so that a sub-agent can do its part
# and a session's success carries signal (issue 39). Runs c-i drew add/mul too, parts this model solves a few times in
# a hundred, and almost no multi-part session passed. Measured on the swarm warm start (docs/swarm.md), a lookup alone
# is solved 29% of the time: it does not yet copy the city, so this aim is not met.
LOOKUP_MIX: dict[str, float] = {tool: 1.0 / len(tasks.LOOKUPS) for tool in tasks.LOOKUPS}


def make_lookup_part(rng: random.Random, split: str | None = None) -> tasks.Part:
    """One swarm part: a lookup tool, a city and a phrasing (tasks.make_part over LOOKUP_MIX)."""
    return tasks.make_part(rng, split, mix=LOOKUP_MIX)


def make_swarm_task(rng: random.Random, long_share: float = 0.4, long_parts: int = 4) -> SwarmTask:
    """A multi-part request of 2-3 lookups (with 2, a spawn saves no critical step but each sub-agent sees the one
    part it can do; with 3 it saves one) or, with probability long_share, a long session (long_parts-1 or long_parts
    requests), its own share so it does not dilute the spawn result."""
    if rng.random() < long_share:
        kind, n = "long", rng.choice((long_parts - 1, long_parts))
    else:
        kind, n = "multi", rng.choice(MULTI_PARTS)
    parts = tuple(make_lookup_part(rng) for _ in range(n))
    return SwarmTask(kind, tasks.TaskSpec(f"w{rng.getrandbits(48):012x}", parts))


# ---------------------------------------------------------------------------------------------
# the actions' format (tasks.py's tool-call protocol, three more tool names)
# ---------------------------------------------------------------------------------------------
def format_spawn(subtasks: list[str]) -> str:
    return tasks.format_tool_call(SPAWN, {"tasks": list(subtasks)})


def format_spawn_parts(numbers: list[int]) -> str:
    return tasks.format_tool_call(SPAWN, {"parts": list(numbers)})


def request_pieces(request: str) -> list[str]:
    """A multi-part request's pieces, the texts a spawn's part numbers name (1 is the first)."""
    return [p.strip() for p in request.split(";")]


def format_summarize() -> str:
    return tasks.format_tool_call(SUMMARIZE, {})


def format_prune(drop: list[int]) -> str:
    return tasks.format_tool_call(PRUNE, {"drop": list(drop)})


def spawn_tasks(arguments: Any, request: str = "") -> list[tuple[str, int | None]] | None:
    """The sub-agents a spawn call asked for, as (sub-task text, the part it answers: None for none), or None when
    it is not a usable spawn (the call is then malformed).

    `parts`: numbers of the request's pieces (request_pieces); a sub-agent answers its piece's part, and a
    number given twice starts a second sub-agent on the same text that answers no part (spurious). `tasks`:
    sub-task texts the policy wrote; sub-agent i answers part i."""
    if not isinstance(arguments, dict):
        return None
    numbers = arguments.get("parts")
    if numbers is not None:
        pieces = request_pieces(request)
        if not isinstance(numbers, list) or not numbers or not all(
                isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= len(pieces) for k in numbers):
            return None
        seen: set[int] = set()
        out: list[tuple[str, int | None]] = []
        for k in numbers[:MAX_CHILDREN]:
            out.append((pieces[k - 1], None if k in seen else k - 1))
            seen.add(k)
        return out
    got = arguments.get("tasks")
    if not isinstance(got, list) or not got or not all(isinstance(t, str) for t in got):
        return None
    return [(t.strip(), i) for i, t in enumerate(got[:MAX_CHILDREN])]


def prune_indices(arguments: Any, n_messages: int) -> list[int] | None:
    """The message indices a prune call names, within the history before the prune decision (None: unusable)."""
    got = arguments.get("drop") if isinstance(arguments, dict) else None
    if not isinstance(got, list) or not got or not all(isinstance(i, int) and not isinstance(i, bool) for i in got):
        return None
    keep = sorted({i for i in got if 0 <= i < n_messages})
    return keep or None


def join_answers(answers: list[str | None]) -> str:
    return "; ".join(a or "" for a in answers)


def split_answer(answer: str | None, n: int) -> list[str | None]:
    """One answer per part from the orchestrator's "a; b; c" (missing ones None)."""
    pieces = [p.strip() for p in (answer or "").split(";")] if answer is not None else []
    return [pieces[i] if i < len(pieces) and pieces[i] else None for i in range(n)]


def chars(messages: list[tasks.Message]) -> int:
    return sum(len(str(m.get("content", ""))) for m in messages)


# ---------------------------------------------------------------------------------------------
# demonstrations for the warm start: an earlier orchestrator that split half of its multi-part requests
# ---------------------------------------------------------------------------------------------
Demo = tuple[list[tasks.Message], str]  # (the dialogue so far, the assistant reply to train)


def _serial_turns(parts: tuple[tasks.Part, ...]) -> list[Demo]:
    """A multi-part request solved by the agent itself: a call per part, then the joined answer."""
    messages: list[tasks.Message] = [{"role": "user", "content": "; ".join(p.text for p in parts)}]
    out: list[Demo] = []
    for i, p in enumerate(parts):
        call = tasks.format_tool_call(p.tool, p.args)
        out.append((list(messages), call))
        messages += [{"role": "assistant", "content": call}, tasks.tool_message(tasks.truth(p), f"call{i}")]
    out.append((list(messages), tasks.format_answer(join_answers([tasks.truth(p) for p in parts]))))
    return out


def _long_turns(parts: tuple[tasks.Part, ...]) -> list[Demo]:
    """Requests one after another, each a call and an answer, no edits."""
    messages: list[tasks.Message] = []
    out: list[Demo] = []
    for i, p in enumerate(parts):
        messages.append(tasks.user_message(p))
        call = tasks.format_tool_call(p.tool, p.args)
        out.append((list(messages), call))
        messages += [{"role": "assistant", "content": call}, tasks.tool_message(tasks.truth(p), f"call{i}")]
        answer = tasks.format_answer(tasks.truth(p))
        out.append((list(messages), answer))
        messages.append({"role": "assistant", "content": answer})
    return out


def _finished_history(rng: random.Random, n: int) -> list[tasks.Message]:
    messages: list[tasks.Message] = []
    for i in range(n):
        p = make_lookup_part(rng, "train")
        messages += [tasks.user_message(p), {"role": "assistant", "content": tasks.format_tool_call(p.tool, p.args)},
                     tasks.tool_message(tasks.truth(p), f"call{i}"),
                     {"role": "assistant", "content": tasks.format_answer(tasks.truth(p))}]
    return messages


def summary_text(messages: list[tasks.Message]) -> str:
    """The demonstrated summary: the answers given so far (what a later request could need)."""
    answers = [m["content"][len("Answer: "):] for m in messages if m["role"] == "assistant"
               and str(m.get("content", "")).startswith("Answer: ")]
    return join_answers(answers) if answers else "nothing yet"


DEMO_KINDS = ("single", "multi", "long")  # equal shares of the plain draws
SPLIT_SHARE = 0.5  # of the demonstrated multi-part requests, the share the earlier orchestrator split


def demonstrations(rng: random.Random, tool_share: float = 0.2, split_share: float = SPLIT_SHARE) -> list[Demo]:
    """One warm-start draw, from the logs of an earlier orchestrator (issue 39, stated in docs/swarm.md):

    * single (a third of the plain draws): a one-lookup request solved with a call and an answer, the work a
      sub-agent does with its piece;
    * multi (a third): a request of 2-3 lookups. The earlier orchestrator split `split_share` of them, its opening a
      spawn of every piece (`{"parts": [1, 2]}`), and solved the rest itself (a call per part, then the joined
      answer). Nothing in the request tells the two apart, so the warm-started policy opens a multi-part session
      with a spawn about split_share of the time, and which way pays is for production's outcomes to teach;
    * long (a third): requests one after another, a call and an answer each, no edits;

    and, with probability tool_share instead, a summary or a prune at a random point of a history: how to write
    each edit, never when it pays. Every part is a train-split lookup."""
    if rng.random() < tool_share:
        history = _finished_history(rng, rng.randint(0, 2))
        current = make_lookup_part(rng, "train")
        messages = history + [tasks.user_message(current)]
        if rng.random() < 0.5:
            return [(messages, format_summarize()),
                    (messages + [{"role": "user", "content": SUMMARY_REQUEST}], summary_text(history))]
        return [(messages, format_prune(list(range(len(history))) or [0]))]
    kind = rng.choice(DEMO_KINDS)
    if kind == "single":
        return _serial_turns((make_lookup_part(rng, "train"),))
    if kind == "long":
        return _long_turns(tuple(make_lookup_part(rng, "train") for _ in range(rng.choice((1, 2, 3)))))
    parts = tuple(make_lookup_part(rng, "train") for _ in range(rng.choice(MULTI_PARTS)))
    if rng.random() < split_share:
        return [([{"role": "user", "content": "; ".join(p.text for p in parts)}],
                 format_spawn_parts(list(range(1, len(parts) + 1))))]
    return _serial_turns(parts)


# ---------------------------------------------------------------------------------------------
# the harness: one swarm session, against any generate function
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    """One model reply: its text and, when the server returned them, its completion token ids."""

    text: str
    token_ids: list[int] | None = None


# generate(agent, messages) -> the reply of the policy as that agent (the agent: the SDK session it logs under)
Generate = Callable[[Any, list[tasks.Message]], Reply]


@dataclass
class SwarmLimits:
    max_turns_per_part: int = 3  # model replies per part (edits and spawns not counted)
    max_edits: int = 3  # summarize/prune actions per session
    # history size past which a model call is refused (long sessions: an edit is due by the third request)
    context_budget_chars: int = 260
    token_count: Callable[[str], int] = lambda text: max(1, len(text) // 3)
    # (completion token ids, their text, a character) -> the index of the token holding it (tasks.token_at with the
    # served tokenizer); None: unknown, and a malformed call's penalty falls on its whole reply
    token_at: Callable[[list[int], str, int], int | None] = lambda ids, text, char: None


@dataclass
class SwarmResult:
    """What one session did, for the hand-off line (tasks.py's fields plus the swarm's own)."""

    answers: list[str | None]
    parts: list[dict[str, Any]]
    spawned: int = 0
    spawn_tasks: list[str] = field(default_factory=list)
    edits: list[dict[str, Any]] = field(default_factory=list)  # {"kind", "call_id", "part", "removed_needed"}
    overflow: bool = False
    main_steps: int = 0
    child_steps: list[int] = field(default_factory=list)
    extra_agents: list[str] = field(default_factory=list)  # sub-agents past the request's parts: no part to answer

    @property
    def critical_steps(self) -> int:
        return self.main_steps + max(self.child_steps, default=0)


class SwarmSession:
    """Runs one SwarmTask as `agent` (an SDK session), with `generate` the policy and `run_parallel` a map that
    runs callables concurrently (a thread pool in the agent; a plain map in a test)."""

    def __init__(self, task: SwarmTask, agent: Any, generate: Generate, limits: SwarmLimits,
                 run_parallel: Callable[[list[Callable[[], Any]]], list[Any]] | None = None) -> None:
        self.task, self.agent, self.generate, self.limits = task, agent, generate, limits
        self.run_parallel = run_parallel or (lambda fns: [f() for f in fns])
        n = len(task.spec.parts)
        self.result = SwarmResult([None] * n, [{"agent_id": agent.agent_id, "calls": []} for _ in range(n)])

    # -- logging an action the policy took --------------------------------------------------------
    def _log_call(self, agent: Any, name: str, arguments: Any, ok: bool, output: str, malformed: bool = False,
                  reply: Reply | None = None) -> str:
        """Log a call and its result; a malformed one with the token of `reply` (the reply that wrote it)
        where it broke."""
        at = self._broke_at(reply) if malformed else None
        call_id = agent.tool_call(name, arguments, malformed=malformed or None, malformed_token=at)
        agent.tool_result(call_id, ok=ok, output=output, name=name)
        return call_id

    def _broke_at(self, reply: Reply | None) -> int | None:
        if reply is None or not reply.token_ids:
            return None
        return self.limits.token_at(reply.token_ids, reply.text, tasks.malformed_from(reply.text))

    def _tool(self, agent: Any, parsed: tasks.ParsedReply, part_index: int | None,
              reply: Reply | None = None) -> tasks.Message:
        """An ordinary tool call (or a malformed reply): run it, log it, return the tool message."""
        if parsed.kind == "malformed_call":
            self._log_call(agent, "unparsed", None, False, "error: malformed tool call", malformed=True, reply=reply)
            return tasks.tool_message("error: malformed tool call", "call")
        ok, output = tasks.run_tool(parsed.tool or "", parsed.arguments)
        call_id = self._log_call(agent, parsed.tool or "", parsed.arguments, ok, output)
        if part_index is not None:
            self.result.parts[part_index]["calls"].append({"call_id": call_id, "tool": parsed.tool,
                                                           "arguments": parsed.arguments})
        return tasks.tool_message(output, call_id)

    def _part_of(self, parsed: tasks.ParsedReply) -> int:
        """The part an orchestrator's own tool call works on: the first unsolved part it matches,
        else the first unsolved."""
        open_parts = [i for i, d in enumerate(self.result.parts) if not d.get("solved")]
        for i in open_parts:
            if tasks.call_matches(self.task.spec.parts[i], parsed.tool, parsed.arguments):
                self.result.parts[i]["solved"] = True
                return i
        return open_parts[0] if open_parts else 0

    # -- sessions ---------------------------------------------------------------------------------
    def run(self) -> SwarmResult:
        if self.task.kind == "multi":
            self._run_multi()
        else:
            self._run_long()
        for d in self.result.parts:
            d.pop("solved", None)
        return self.result

    def _run_multi(self) -> None:
        spec, n = self.task.spec, len(self.task.spec.parts)
        messages: list[tasks.Message] = [{"role": "user", "content": spec.text}]
        for _ in range(self.limits.max_turns_per_part * n):
            reply = self.generate(self.agent, messages)
            self.result.main_steps += 1
            parsed = tasks.parse_reply(reply.text)
            messages.append({"role": "assistant", "content": reply.text})
            if parsed.kind == "answer":
                self.result.answers = split_answer(parsed.answer, n)
                return
            if parsed.kind == "tool_call" and parsed.tool == SPAWN:
                subtasks = spawn_tasks(parsed.arguments, spec.text)
                if subtasks is not None:
                    self._spawn(subtasks)
                    return
                self._log_call(self.agent, SPAWN, parsed.arguments, False, "error: spawn needs tasks", malformed=True,
                               reply=reply)
                messages.append(tasks.tool_message("error: spawn needs tasks", "call"))
                continue
            if parsed.kind == "tool_call" and parsed.tool in (SUMMARIZE, PRUNE):
                messages = self._edit(parsed, messages, current=0, reply=reply)
                continue
            index = self._part_of(parsed) if parsed.kind == "tool_call" else None
            messages.append(self._tool(self.agent, parsed, index, reply))

    def _spawn(self, subagents: list[tuple[str, int | None]]) -> None:
        """One sub-agent per (sub-task, part it answers) of spawn_tasks, in parallel."""
        subtasks = [t for t, _ in subagents]
        call_id = self._log_call(self.agent, SPAWN, {"tasks": subtasks}, True, f"started {len(subtasks)} sub-agents")
        children = [self.agent.spawn_subagent(subtask=t) for t in subtasks]
        self.result.spawned, self.result.spawn_tasks = len(children), list(subtasks)
        log.debug("swarm: spawn %s -> %d sub-agents", call_id, len(children))

        def solve(i: int, child: Any, text: str) -> tuple[str | None, list[dict[str, Any]], int]:
            calls: list[dict[str, Any]] = []
            steps = 0
            last: list[Reply] = []  # this sub-agent's latest reply, for where a malformed call broke

            def generate(messages: list[tasks.Message]) -> str:
                nonlocal steps
                steps += 1
                last[:] = [self.generate(child, messages)]
                return last[0].text

            def on_turn(turn: tasks.TaskTurn) -> None:
                if turn.parsed.kind == "answer":
                    return
                malformed = turn.parsed.kind == "malformed_call"
                cid = self._log_call(child, turn.parsed.tool or "unparsed", turn.parsed.arguments, bool(turn.tool_ok),
                                     turn.tool_output or "", malformed=malformed, reply=last[0] if last else None)
                if not malformed:
                    calls.append({"call_id": cid, "tool": turn.parsed.tool, "arguments": turn.parsed.arguments})

            # the sub-agent's request is the text the policy wrote, not the user's: a wrong split fails its part
            part = tasks.Part("add", {}, text)
            answer, _ = tasks.solve_part(part, generate, self.limits.max_turns_per_part, budget_chars=10_000,
                                         on_turn=on_turn)
            return answer, calls, steps

        jobs: list[Callable[[], Any]] = [functools.partial(solve, i, c, t)
                                         for i, (c, t) in enumerate(zip(children, subtasks))]
        try:
            done = self.run_parallel(jobs)
        except Exception:
            for c in children:
                c.finish(ok=False)
            raise
        for (_, part), child, (answer, calls, steps) in zip(subagents, children, done):
            child.finish(ok=answer is not None)
            self.result.child_steps.append(steps)
            if part is not None and part < len(self.task.spec.parts):
                self.result.answers[part] = answer
                self.result.parts[part] = {"agent_id": child.agent_id, "calls": calls}
            else:
                self.result.extra_agents.append(child.agent_id)

    def _edit(self, parsed: tasks.ParsedReply, messages: list[tasks.Message], current: int,
              reply: Reply | None = None) -> list[tasks.Message]:
        """summarize or prune, decided by the reply just made (the last message); returns the new history."""
        decision = messages[-1]
        history = messages[:-1]
        if len(self.result.edits) >= self.limits.max_edits:
            self._log_call(self.agent, parsed.tool or "", parsed.arguments, False, "error: no edits left")
            return history + [decision, tasks.tool_message("error: no edits left", "call")]
        # the current request: the latest user message before the decision
        last_user = max((i for i, m in enumerate(history) if m["role"] == "user"), default=0)
        if parsed.tool == SUMMARIZE:
            call_id = self._log_call(self.agent, SUMMARIZE, parsed.arguments, True, "summarizing")
            removed = history[:last_user]
            summary = self.generate(self.agent, history + [{"role": "user", "content": SUMMARY_REQUEST}])
            self.result.main_steps += 1
            kept = history[last_user:]
            new = ([{"role": "assistant", "content": SUMMARY_PREFIX + summary.text}] if removed else []) + kept
            self.agent.context_edit(SUMMARIZE, sum(self.limits.token_count(str(m.get("content", ""))) for m in removed),
                                    summary.token_ids)
            self.result.edits.append({"kind": SUMMARIZE, "call_id": call_id, "part": current, "removed_needed": False,
                                      "removed": len(removed)})
            return new
        drop = prune_indices(parsed.arguments, len(history))
        # the current request stays: without it there is nothing to answer (and no prompt to send)
        if drop is not None:
            drop = [i for i in drop if i != last_user] or None
        if drop is None:
            self._log_call(self.agent, PRUNE, parsed.arguments, False, "error: prune needs drop", malformed=True,
                           reply=reply)
            return history + [decision, tasks.tool_message("error: prune needs drop", "call")]
        call_id = self._log_call(self.agent, PRUNE, {"drop": drop}, True, f"dropped {len(drop)} messages")
        removed = [history[i] for i in drop]
        # what the answer to the current request needs: the request itself and its tool results
        needed = any(i >= last_user for i in drop)
        self.agent.context_edit(PRUNE, sum(self.limits.token_count(str(m.get("content", ""))) for m in removed), None)
        self.result.edits.append({"kind": PRUNE, "call_id": call_id, "part": current, "removed_needed": needed,
                                  "removed": len(drop)})
        return [m for i, m in enumerate(history) if i not in set(drop)]

    def _run_long(self) -> None:
        spec = self.task.spec
        messages: list[tasks.Message] = []
        for i, part in enumerate(spec.parts):
            messages.append(tasks.user_message(part))
            replies = 0
            while replies < self.limits.max_turns_per_part:
                if chars(messages) > self.limits.context_budget_chars:
                    self.result.overflow = True  # the request is refused: this part and the rest fail
                    return
                reply = self.generate(self.agent, messages)
                self.result.main_steps += 1
                parsed = tasks.parse_reply(reply.text)
                messages.append({"role": "assistant", "content": reply.text})
                if parsed.kind == "answer":
                    self.result.answers[i] = parsed.answer
                    break
                if parsed.kind == "tool_call" and parsed.tool in (SUMMARIZE, PRUNE):
                    messages = self._edit(parsed, messages, current=i, reply=reply)
                    continue
                if parsed.kind == "tool_call" and parsed.tool == SPAWN:
                    self._log_call(self.agent, SPAWN, parsed.arguments, False, "error: nothing to split here")
                    messages.append(tasks.tool_message("error: nothing to split here", "call"))
                    replies += 1
                    continue
                messages.append(self._tool(self.agent, parsed, i, reply))
                replies += 1


def handoff_record(session_id: str, main_agent_id: str, task: SwarmTask, result: SwarmResult,
                   ended: float) -> dict[str, Any]:
    """The verifier's line: tasks.py's fields (task, answers, parts) and what the swarm report and checker need."""
    return {"session_id": session_id, "task": task.spec.to_json(), "answers": result.answers, "ended": ended,
            "parts": result.parts, "main_agent_id": main_agent_id, "scenario": "swarm", "kind": task.kind,
            "spawned": result.spawned, "spawn_tasks": result.spawn_tasks, "edits": result.edits,
            "overflow": result.overflow, "critical_steps": result.critical_steps, "extra_agents": result.extra_agents}


PARTS_CORRECT = "parts_correct"  # the swarm's graded outcome: the share of the session's parts answered right


def parts_correct(record: dict[str, Any]) -> tuple[float, dict[str, float]] | None:
    """The verifier's graded outcome of a swarm hand-off line: (share of the session's parts answered right,
    {sub-agent id: 1.0 or 0.0 for its own part, 0.0 for one past the parts}); None for a line of another scenario.
    task_success says whether all parts were right, which almost never happens while one part goes right a few times in
    ten: the share is what the rows are trained on and what the swarm's gate compares (docs/swarm.md)."""
    if record.get("scenario") != "swarm":
        return None
    spec = tasks.TaskSpec.from_json(record["task"])
    answers = record.get("answers") or []
    right = [tasks.check_part(p, tasks.recorded_answer(answers, i)) for i, p in enumerate(spec.parts)]
    mine: dict[str, float] = {}
    for i, done in enumerate(record.get("parts") or []):
        agent = done.get("agent_id") if isinstance(done, dict) else None
        if isinstance(agent, str) and agent != record.get("main_agent_id") and i < len(right):
            mine[agent] = 1.0 if right[i] else 0.0
    mine.update({str(a): 0.0 for a in record.get("extra_agents") or []})  # else its rows would get the session's share
    return sum(right) / max(1, len(right)), mine


def harmful_prunes(record: dict[str, Any], session_ok: bool) -> list[tuple[str, bool]]:
    """(call_id, harmful) of each prune in a swarm hand-off line: harmful when the session failed, the prune
    dropped what the current request needed, and that request's answer is wrong (the checker can tell)."""
    if record.get("scenario") != "swarm":
        return []
    spec = tasks.TaskSpec.from_json(record["task"])
    answers = record.get("answers") or []
    out = []
    for e in record.get("edits") or []:
        if e.get("kind") != PRUNE or not e.get("call_id"):
            continue
        i = int(e.get("part") or 0)
        wrong = i < len(spec.parts) and not tasks.check_part(spec.parts[i], tasks.recorded_answer(answers, i))
        out.append((str(e["call_id"]), bool(not session_ok and e.get("removed_needed") and wrong)))
    return out


# ---------------------------------------------------------------------------------------------
# the agent: `flywheel agent-sim --scenario swarm`
# ---------------------------------------------------------------------------------------------
def reply_token_ids(choice: Any) -> list[int] | None:
    """The completion token ids the proxy returned with the choice (return_token_ids), if any."""
    extra = getattr(choice, "model_extra", None) or {}
    ids = extra.get("token_ids") if isinstance(extra, dict) else None
    ids = ids if ids is not None else getattr(choice, "token_ids", None)
    return [int(t) for t in ids] if isinstance(ids, list) else None


def run_agent_session(sim: Any) -> None:
    """One swarm session inside `flywheel agent-sim --scenario swarm` (agent_sim.AgentSim.run_session calls it
    with itself: its logger, policy client, counters, sub-agent pool and hand-off file)."""
    with sim.rng_lock:
        task = make_swarm_task(sim.rng, sim.cfg.swarm_long_share)
    session_id = uuid.uuid4().hex
    session = sim.logger.session(task_type=task.task_type, session_id=session_id,
                                 tags={"task_id": task.spec.task_id, "parts": str(len(task.spec.parts)),
                                       "swarm": task.kind})
    limits = SwarmLimits(max_turns_per_part=sim.cfg.max_turns, context_budget_chars=sim.cfg.swarm_context_budget_chars,
                         token_count=sim.tokens.count, token_at=sim.tokens.token_at)
    runner = SwarmSession(task, session, sim.reply_generate(task.task_type), limits,
                          run_parallel=lambda fns: [f.result() for f in [sim.sub_pool.submit(fn) for fn in fns]])
    status = "ok"
    result = runner.result
    try:
        result = runner.run()
        sim.counts.add("subagents", result.spawned)
        sim.counts.add("context_edits", len(result.edits))
    except Exception as exc:  # the policy endpoint failed: infrastructure, not a policy outcome
        status = "error"
        sim.session_failed(session_id, exc)
    session.end(status)
    sim.counts.add("sessions")
    if status == "ok":
        sim.hand_off_record(handoff_record(session_id, session.agent_id, task, result, time.time()))


# ---------------------------------------------------------------------------------------------
# the warm start of the swarm scenario's policy-v0
# ---------------------------------------------------------------------------------------------
# appended to warm_start.RULE in the model's warm_start.json (issue 39)
WARM_RULE = "swarm-split-half-lookups"
WARM_TOOL_SHARE = 0.2


def warm_demos(rng: random.Random, n: int, tool_share: float = WARM_TOOL_SHARE) -> list[Demo]:
    """n (dialogue so far, reply) pairs for one warm-start batch (demonstrations(): edits on a minority)."""
    out: list[Demo] = []
    while len(out) < n:
        out += demonstrations(rng, tool_share)
    return out[:n]


def warm_rule() -> str:
    from flywheel.demo import warm_start

    return f"{warm_start.RULE}+{WARM_RULE}"


def warm_start_model(base_dir: Any, out_dir: Any, settings: Any = None,
                     tool_share: float = WARM_TOOL_SHARE) -> dict[str, Any]:
    """The swarm's policy-v0: warm_start.run's fixed-step pinned build, trained on warm_demos batches. Returns the
    record written to out_dir/warm_start.json. settings and tool_share: a test's shorter, action-heavier build (the
    demo uses the defaults)."""
    from flywheel.demo import warm_start

    log.info("swarm: warm start with the actions' format on %.0f%% of the draws", 100 * tool_share)
    return warm_start.run(base_dir, out_dir, settings, demos=f"{__name__}:warm_demos",
                          demos_kwargs={"tool_share": tool_share}, rule=warm_rule())


# ---------------------------------------------------------------------------------------------
# frozen sub-agents: a model of their own for the spawned pieces (Kimi K2.5's PARL: a trainable orchestrator,
# "frozen subagents")
# ---------------------------------------------------------------------------------------------
SUBAGENT_RULE = "swarm-subagent-one-lookup"


def subagent_demos(rng: random.Random, n: int) -> list[Demo]:
    """n (dialogue so far, reply) pairs of one-lookup requests, a call and an answer each: a sub-agent's whole job.
    Trained on these alone the tiny model copies the request's city into its call (the mixture of warm_demos
    does not form that copy: docs/swarm.md)."""
    out: list[Demo] = []
    while len(out) < n:
        out += _serial_turns((make_lookup_part(rng, "train"),))
    return out[:n]


def subagent_rule() -> str:
    from flywheel.demo import warm_start

    return f"{warm_start.RULE}+{SUBAGENT_RULE}"


def subagent_model(base_dir: Any, out_dir: Any, settings: Any = None) -> dict[str, Any]:
    """The frozen sub-agents' model: warm_start.run's fixed-step pinned build on subagent_demos batches."""
    from flywheel.demo import warm_start

    log.info("swarm: the sub-agents' model, on one-lookup requests only")
    return warm_start.run(base_dir, out_dir, settings, demos=f"{__name__}:subagent_demos", rule=subagent_rule())


def ensure_warm_model(base_dir: Any, out_dir: Any) -> Path:
    """out_dir, the swarm's policy-v0 built by warm_start_model from base_dir with the default settings (the swarm
    recipe's) unless the one there is current. The pre-flight's CLI takes it from here: run on a fresh clone, it
    stopped with transformers' "Repo id must be in the form ..." for the missing directory."""
    from flywheel.demo import warm_start

    if not warm_start.is_current(Path(out_dir), Path(base_dir), warm_rule(), warm_start.WarmStartSettings()):
        warm_start_model(base_dir, out_dir)
    return Path(out_dir)


def ensure_subagent_model(base_dir: Any, out_dir: Any) -> Path:
    """out_dir, built by subagent_model from base_dir (600 pinned steps, ~5 minutes) unless the one there is current:
    the demo's set-up and the pre-flight both take it from here."""
    from flywheel.demo import warm_start

    if not warm_start.is_current(Path(out_dir), Path(base_dir), subagent_rule()):
        subagent_model(base_dir, out_dir)
    return Path(out_dir)
