"""`flywheel agent-sim`: a simulated production agent running the demo's tool-use tasks.

    flywheel agent-sim --proxy-url http://127.0.0.1:8100 --concurrency 8 --duration-s 600

It is an ordinary agent: it talks to the policy only through the capture proxy with the
official `openai` client (session id and agent id in X-Flywheel-* headers, so the proxy logs
each llm_call with its exact tokens), and logs what the proxy cannot see with the SDK:
session start and end, tool calls and results, sub-agents, context edits. Tasks with two
independent parts run one sub-agent per part, in parallel.

When a session ends, the agent appends one line to its hand-off file for the verifier
(`var/run/agent-sim/sessions.jsonl`: session id, the task spec, the answers given). The agent
does not judge itself: `flywheel outcome-sim` recomputes the truth from the spec and reports it.
SIGTERM finishes the sessions in flight, flushes the SDK and exits 0.

Two switches for `flywheel bench chaos` (docs/reliability.md), off by default:
* `--durable-handoff`: an ended session waits (in memory) until a flush of the SDK confirms that Kafka
  acknowledged its events, and only then is it handed off, so a hand-off line means its events reached
  Kafka; the line says `"durable": false` when the flush timed out (`durable_timeout_s`). The flushes run
  on their own thread: during a broker outage the workers go on making sessions (their events spill to
  the SDK's spool) and the hand-offs follow once the broker is back.
* `--event-ledger PATH`: one JSON line per event the agent hands to the SDK (and per llm_call the
  proxy answered), then one `done` line per session after its hand-off: the truth the chaos run
  compares with the lake, written so that a SIGKILL cannot take back a line already written.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from flywheel.base import defaults
from flywheel.base.config import (
    ConfigError,
    check_choices,
    load_config,
    setting,
    setup_logging,
    write_resolved,
)
from flywheel.base.heartbeat import write_status
from flywheel.base.stop import stop_on_signals
from flywheel.demo import tasks

log = logging.getLogger(__name__)

H_SESSION = "X-Flywheel-Session-Id"  # the capture proxy's headers (flywheel.serving.proxy)
H_AGENT = "X-Flywheel-Agent-Id"
H_PARENT = "X-Flywheel-Parent-Agent-Id"
H_TASK = "X-Flywheel-Task-Type"
DEFAULT_HANDOFF = Path(defaults.VAR_DIR) / "run" / "agent-sim" / "sessions.jsonl"


@dataclass
class AgentSimConfig:
    """The simulated production agent: where the policy and the broker are, how much traffic to make."""

    proxy_url: str = setting(defaults.PROXY_URL, "the capture proxy (OpenAI-compatible); /v1 is appended")
    kafka_bootstrap: str = setting(defaults.KAFKA_BOOTSTRAP, "Kafka for the SDK's events")
    events_topic: str = setting("flywheel.events", "topic of the SDK's events")
    model: str = setting("policy", "model name sent to the proxy (the proxy's router picks the served version)")
    concurrency: int = setting(8, "sessions in flight at once (threads)")
    sessions: int = setting(0, "stop after this many sessions (0: no limit)")
    duration_s: float = setting(0.0, "stop after this many seconds (0: until SIGTERM)")
    multi_share: float = setting(0.2, "share of tasks with two independent parts (run by two sub-agents)")
    max_turns: int = setting(3, "model replies allowed per part")
    max_tokens: int = setting(40, "max_tokens per model call (a tool call is about 20-30 tokens)")
    temperature: float = setting(1.0, "sampling temperature (1.0: the policy's own distribution, what RL needs)")
    scenario: Literal["tool_use", "swarm"] = setting(
        "tool_use", "tool_use (tasks.py's sessions) or swarm (infra/demo/swarm.py: the policy decides to spawn "
                    "sub-agents, summarise or prune its context)")
    swarm_long_share: float = setting(0.4, "swarm: share of long multi-turn sessions (the rest are "
                                           "multi-part requests)")
    subagent_model: str = setting("", "swarm: model name the sub-agents' calls ask for (the proxy's frozen_models "
                                      "sends it to a frozen model's server); empty: they ask for `model`, the policy")
    swarm_context_budget_chars: int = setting(260, "swarm: history size (chars) past which a long session's model "
                                                   "call is refused")
    context_budget_chars: int = setting(150, "history length (chars) past which the agent summarises failed attempts "
                                             "(two failed calls exceed it)")
    handoff: Path = setting(DEFAULT_HANDOFF, "JSONL file finished sessions are appended to (the verifier reads it)")
    tokenizer: str = setting(defaults.BASE_MODEL_DIR, "model dir whose tokenizer.json counts context-edit tokens "
                                                      "('' = estimate)")
    request_timeout_s: float = setting(120.0, "timeout of one model call")
    seed: int = setting(0, "seed of the task stream (0: random)")
    durable_handoff: bool = setting(False, "hand a session off only once an SDK flush confirmed its events reached "
                                           "Kafka (flywheel bench chaos)")
    durable_timeout_s: float = setting(120.0, "longest wait for that flush; the line then says durable false")
    event_ledger: str = setting("", "append one JSON line per event handed to the SDK, and one per finished session, "
                                    "to this file ('' = off; flywheel bench chaos reads it)")
    spool_name: str = setting("agent-sim", "the SDK's spill spool name")
    var_dir: Path = setting(Path(defaults.VAR_DIR), "local state root; the heartbeat goes to <var_dir>/run/status/")
    status_name: str = setting("agent-sim", "name of the heartbeat under var/run/status")
    log_level: str = setting("INFO", "logging level")

    def check(self) -> None:
        if self.concurrency < 1:
            raise ConfigError(f"concurrency: must be >= 1, got {self.concurrency}")
        if not 0.0 <= self.multi_share <= 1.0:
            raise ConfigError(f"multi_share: must be in [0, 1], got {self.multi_share}")
        check_choices(self)
        if not 0.0 <= self.swarm_long_share <= 1.0:
            raise ConfigError(f"swarm_long_share: must be in [0, 1], got {self.swarm_long_share}")
        if self.max_turns < 1 or self.max_tokens < 1:
            raise ConfigError("max_turns and max_tokens must be >= 1")


class _Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, int] = {"sessions": 0, "llm_calls": 0, "errors": 0, "subagents": 0, "context_edits": 0,
                                       "tool_calls": 0, "malformed_calls": 0}

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.values[key] += n


class _TokenCounter:
    """Counts tokens with the served model's tokenizer (tokenizers only, no transformers), or estimates."""

    def __init__(self, model_dir: str) -> None:
        self._tok: Any = None
        path = Path(model_dir) / "tokenizer.json" if model_dir else None
        if path is not None and path.is_file():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(path))

    def ids(self, text: str) -> list[int] | None:
        return None if self._tok is None else list(self._tok.encode(text).ids)

    def count(self, text: str) -> int:
        ids = self.ids(text)
        return len(ids) if ids is not None else max(1, len(text) // 3)  # byte-level BPE averages ~3 chars/token

    def token_at(self, token_ids: list[int], text: str, char: int) -> int | None:
        """The index of the completion token holding character `char` of `text` (None without a tokenizer)."""
        if self._tok is None:
            return None
        return tasks.token_at(self._tok.decode, token_ids, text, char)


class EventLedger:
    """What the agent handed to the SDK, one JSON line per event: {"session_id", "agent_id", "type", "t"} (t: epoch s).

    Each line is written before the SDK call it names, with one os.write on an O_APPEND descriptor: the
    line is whole and in the page cache once written, so a SIGKILL cannot take it back, and an event the
    killed agent's SDK had not delivered yet stays listed. llm_call lines are written when the proxy's
    reply arrives (the proxy logs the call before it replies). After a session's hand-off comes
    {"session_id", "agent_id", "type": "done", "status", "durable"}.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def note(self, session_id: str, agent_id: str, etype: str, **fields: Any) -> None:
        line = json.dumps({"session_id": session_id, "agent_id": agent_id, "type": etype, "t": round(time.time(), 3),
                           **fields}) + "\n"
        with self._lock:
            os.write(self._fd, line.encode())

    def close(self) -> None:
        os.close(self._fd)


class LedgerSession:
    """An SDK Session (main agent or sub-agent) that notes each event in the ledger before logging it."""

    def __init__(self, inner: Any, ledger: EventLedger, parent: "LedgerSession | None" = None) -> None:
        self._inner, self._ledger, self._parent = inner, ledger, parent
        self.session_id, self.agent_id, self.parent_agent_id = inner.session_id, inner.agent_id, inner.parent_agent_id
        self._closed = False  # session_end / subagent_finish are emitted once, as the SDK does

    def _note(self, etype: str) -> None:
        self._ledger.note(self.session_id, self.agent_id, etype)

    def tool_call(self, *args: Any, **kwargs: Any) -> str:
        self._note("tool_call")
        return self._inner.tool_call(*args, **kwargs)

    def tool_result(self, *args: Any, **kwargs: Any) -> None:
        self._note("tool_result")
        self._inner.tool_result(*args, **kwargs)

    def context_edit(self, *args: Any, **kwargs: Any) -> None:
        self._note("context_edit")
        self._inner.context_edit(*args, **kwargs)

    def spawn_subagent(self, *args: Any, **kwargs: Any) -> "LedgerSession":
        self._note("subagent_spawn")
        return LedgerSession(self._inner.spawn_subagent(*args, **kwargs), self._ledger, parent=self)

    def finish(self, ok: bool = True) -> None:
        if self._parent is not None and not self._closed:
            self._closed = True
            self._parent._note("subagent_finish")  # the SDK emits it on the parent
        self._inner.finish(ok)

    def end(self, status: str = "ok") -> None:
        if not self._closed:
            self._closed = True
            self._note("session_end")
        self._inner.end(status)


@dataclass
class Finished:
    """An ended session on its way to the hand-off file and the ledger."""

    session_id: str
    agent_id: str
    status: str
    spec: tasks.TaskSpec
    answers: list[str | None]
    ended: float
    # per part: the agent that solved it and its well-formed tool calls (call_id, tool, arguments), so the
    # verifier can check each call (per-turn credit) and each sub-agent's part on its own
    parts: list[dict[str, Any]] = field(default_factory=list)


class DurableHandoff:
    """`--durable-handoff`: ended sessions wait here; a thread flushes the SDK, which confirms everything logged
    before the flush (the waiting sessions' events included), and then passes them on to `finish`."""

    def __init__(self, logger: Any, timeout_s: float, finish: Any) -> None:
        self.logger, self.timeout_s, self.finish = logger, timeout_s, finish
        self._queue: queue.Queue[Finished] = queue.Queue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="durable-handoff", daemon=True)
        self._thread.start()

    def put(self, item: Finished) -> None:
        self._queue.put(item)

    def _take(self) -> list[Finished]:
        try:
            batch = [self._queue.get(timeout=0.2)]
        except queue.Empty:
            return []
        while True:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                if self._closing.is_set():
                    return
                continue
            durable = self.logger.flush(self.timeout_s)
            if not durable:
                log.warning("agent: the SDK did not confirm %d ended session(s) within %.0fs; handed off with "
                            "durable false", len(batch), self.timeout_s)
            for item in batch:
                self.finish(item, durable)

    def close(self, timeout_s: float) -> None:
        """Hand off everything still waiting (flushing first), then stop the thread."""
        self._closing.set()
        self._thread.join(timeout_s)


class AgentSim:
    """Runs sessions on worker threads; one SessionLogger and one openai client shared by all."""

    def __init__(self, cfg: AgentSimConfig, logger: Any, client: Any) -> None:
        self.cfg = cfg
        self.logger = logger
        self.client = client
        self.stop = threading.Event()
        self.counts = _Counter()
        self.tokens = _TokenCounter(cfg.tokenizer)
        self.rng = random.Random(cfg.seed or None)
        self.rng_lock = threading.Lock()
        self.handoff_lock = threading.Lock()
        self.ledger = EventLedger(Path(cfg.event_ledger)) if cfg.event_ledger else None
        self.durable = DurableHandoff(logger, cfg.durable_timeout_s, self._finish) if cfg.durable_handoff else None
        self.started = time.time()
        self.sub_pool = ThreadPoolExecutor(max_workers=max(2, cfg.concurrency), thread_name_prefix="subagent")
        cfg.handoff.parent.mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------------- one model call
    def _generate(self, session_id: str, agent_id: str, parent: str | None, task_type: str,
                  last_ids: list[list[int] | None]):
        """generate(messages) -> the reply's text; the reply's completion token ids go to last_ids[0] (the proxy
        returns them when asked, return_token_ids), so a malformed call can say which token broke it."""
        from flywheel.demo.swarm import reply_token_ids

        headers = {H_SESSION: session_id, H_AGENT: agent_id, H_TASK: task_type}
        if parent:
            headers[H_PARENT] = parent

        def generate(messages: list[tasks.Message]) -> str:
            resp = self.client.chat.completions.create(
                model=self.cfg.model, messages=messages, max_tokens=self.cfg.max_tokens,
                temperature=self.cfg.temperature, extra_headers=headers, timeout=self.cfg.request_timeout_s,
                extra_body={"return_token_ids": True})
            self.counts.add("llm_calls")
            if self.ledger is not None:
                self.ledger.note(session_id, agent_id, "llm_call")
            last_ids[0] = reply_token_ids(resp.choices[0])
            return resp.choices[0].message.content or ""

        return generate

    # ---------------------------------------------------------------- one agent solving one part
    def _solve(self, part: tasks.Part, agent: Any, task_type: str) -> tuple[str | None, dict[str, Any]]:
        """Run the tool-use dialogue for one part as `agent` (main agent or sub-agent); log tools and edits.
        Returns the answer and what the verifier needs to check the part's calls."""
        pending: dict[str, str] = {}
        calls: list[dict[str, Any]] = []
        last_ids: list[list[int] | None] = [None]  # the latest reply's completion token ids (generate sets them)

        def on_turn(turn: tasks.TaskTurn) -> None:
            if turn.parsed.kind == "answer":
                return
            malformed = turn.parsed.kind == "malformed_call"
            self.counts.add("malformed_calls" if malformed else "tool_calls")
            # where the call broke (tasks.malformed_from): the penalty is charged from that token on. Without it the
            # whole reply was pushed down, the well-formed `<tool_call>{"name": "add", ...}}</` before a stop token
            # that came too early included (run 12's v1: 34 of its 288 calls so, all add/mul)
            broke_at = (self.tokens.token_at(last_ids[0], turn.reply, tasks.malformed_from(turn.reply))
                        if malformed and last_ids[0] else None)
            call_id = agent.tool_call(turn.parsed.tool or "unparsed", turn.parsed.arguments,
                                      malformed=malformed or None, malformed_token=broke_at)
            agent.tool_result(call_id, ok=bool(turn.tool_ok), output=turn.tool_output, name=turn.parsed.tool)
            pending[call_id] = turn.tool_output or ""
            if not malformed:
                calls.append({"call_id": call_id, "tool": turn.parsed.tool, "arguments": turn.parsed.arguments})

        def on_compact(removed: list[tasks.Message], note: tasks.Message) -> None:
            self.counts.add("context_edits")
            removed_tokens = sum(self.tokens.count(str(m.get("content", ""))) for m in removed)
            agent.context_edit("summarize", removed_tokens, self.tokens.ids(note["content"]))

        generate = self._generate(agent.session_id, agent.agent_id, agent.parent_agent_id, task_type, last_ids)
        answer, _turns = tasks.solve_part(part, generate, self.cfg.max_turns, self.cfg.context_budget_chars,
                                          on_turn=on_turn, on_compact=on_compact)
        return answer, {"agent_id": agent.agent_id, "calls": calls}

    def reply_generate(self, task_type: str) -> Any:
        """generate(agent, messages) -> swarm.Reply for the swarm scenario: the reply's text and its completion
        token ids, which the proxy returns when asked (return_token_ids), so a summary the model writes is
        logged with exactly the tokens of its own llm_call."""
        from flywheel.demo.swarm import Reply, reply_token_ids

        def generate(agent: Any, messages: list[tasks.Message]) -> Reply:
            headers = {H_SESSION: agent.session_id, H_AGENT: agent.agent_id, H_TASK: task_type}
            if agent.parent_agent_id:
                headers[H_PARENT] = str(agent.parent_agent_id)
            # frozen sub-agents (Kimi K2.5's PARL): a child agent's calls go to their own model, the policy is the
            # orchestrator only
            model = self.cfg.subagent_model if agent.parent_agent_id and self.cfg.subagent_model else self.cfg.model
            resp = self.client.chat.completions.create(
                model=model, messages=messages, max_tokens=self.cfg.max_tokens,
                temperature=self.cfg.temperature, extra_headers=headers, timeout=self.cfg.request_timeout_s,
                extra_body={"return_token_ids": True})
            self.counts.add("llm_calls")
            choice = resp.choices[0]
            return Reply(choice.message.content or "", reply_token_ids(choice))

        return generate

    # ---------------------------------------------------------------- one session
    def run_session(self) -> None:
        if self.cfg.scenario == "swarm":
            from flywheel.demo import swarm

            swarm.run_agent_session(self)  # the policy decides to spawn, summarise, prune (infra/demo/swarm.py)
            return
        with self.rng_lock:
            spec = tasks.make_task(self.rng, self.cfg.multi_share)
        session_id = uuid.uuid4().hex
        if self.ledger is not None:
            from flywheel.ingest.sdk import MAIN_AGENT

            self.ledger.note(session_id, MAIN_AGENT, "session_start")
        session = self.logger.session(task_type=spec.task_type, session_id=session_id,
                                      tags={"task_id": spec.task_id, "parts": str(len(spec.parts))})
        if self.ledger is not None:
            session = LedgerSession(session, self.ledger)
        status = "ok"
        answers: list[str | None] = []
        parts: list[dict[str, Any]] = []
        try:
            if not spec.multi:
                answer, checked = self._solve(spec.parts[0], session, spec.task_type)
                answers, parts = [answer], [checked]
            else:
                # independent parts: one sub-agent each, in parallel (what PARL rewards)
                children = [session.spawn_subagent(subtask=p.text) for p in spec.parts]
                self.counts.add("subagents", len(children))
                futures = [self.sub_pool.submit(self._solve, p, c, spec.task_type)
                           for p, c in zip(spec.parts, children)]
                for child, fut in zip(children, futures):
                    try:
                        answer, checked = fut.result()
                    except Exception:
                        answers.append(None)
                        child.finish(ok=False)
                        raise
                    answers.append(answer)
                    parts.append(checked)
                    child.finish(ok=answer is not None)
        except Exception as exc:  # the policy endpoint failed: an infrastructure error, not a policy outcome
            status = "error"
            self.session_failed(session_id, exc)
        session.end(status)
        self.counts.add("sessions")
        finished = Finished(session_id, session.agent_id, status, spec, answers, time.time(), parts)
        if self.durable is not None:
            self.durable.put(finished)  # handed off once the SDK confirms its events
        else:
            self._finish(finished, None)

    def session_failed(self, session_id: str, exc: Exception) -> None:
        """A session the policy endpoint failed: counted, logged, and a pause before the next."""
        self.counts.add("errors")
        log.warning("agent: session %s failed (%s: %s); ended with status error, not sent to the verifier",
                    session_id, type(exc).__name__, exc)
        self.stop.wait(1.0)  # back off instead of spinning on a dead endpoint

    def _finish(self, f: Finished, durable: bool | None) -> None:
        if f.status == "ok":
            self._hand_off(f, durable)
        if self.ledger is not None:
            # after the hand-off line: a kill between the two leaves a session the verifier judges but
            # the ledger calls unfinished, never the other way round
            self.ledger.note(f.session_id, f.agent_id, "done", status=f.status, durable=durable)

    def _hand_off(self, f: Finished, durable: bool | None) -> None:
        record: dict[str, Any] = {"session_id": f.session_id, "task": f.spec.to_json(), "answers": f.answers,
                                  "ended": f.ended, "parts": f.parts}
        if durable is not None:
            record["durable"] = durable
        self.hand_off_record(record)

    def hand_off_record(self, record: dict[str, Any]) -> None:
        """Append one finished session's line to the verifier's hand-off file."""
        line = json.dumps(record) + "\n"
        with self.handoff_lock, open(self.cfg.handoff, "a") as fh:
            fh.write(line)  # one write of a whole line, so the verifier never reads half of one

    # ---------------------------------------------------------------- the loop
    def _worker(self) -> None:
        while not self.stop.is_set() and not self._done():
            self.run_session()

    def _done(self) -> bool:
        if self.cfg.sessions and self.counts.values["sessions"] >= self.cfg.sessions:
            return True
        return bool(self.cfg.duration_s) and time.time() - self.started >= self.cfg.duration_s

    def heartbeat(self) -> dict[str, Any]:
        elapsed = max(1e-6, time.time() - self.started)
        values = dict(self.counts.values)
        fields = {**values, "sessions_per_s": round(values["sessions"] / elapsed, 3), "elapsed_s": round(elapsed, 1),
                  "sdk": {k: v for k, v in self.logger.metrics().items() if isinstance(v, (int, float))}}
        write_status(self.cfg.status_name, fields, self.cfg.var_dir)
        return fields

    def run(self) -> dict[str, Any]:
        workers = [threading.Thread(target=self._worker, name=f"agent-{i}", daemon=True)
                   for i in range(self.cfg.concurrency)]
        for w in workers:
            w.start()
        last = 0.0
        while any(w.is_alive() for w in workers):
            if time.time() - last >= 2.0:
                fields = self.heartbeat()
                if time.time() - last >= 30.0 or last == 0.0:
                    log.info("agent: %d sessions (%.2f/s), %d llm calls, %d errors", fields["sessions"],
                             fields["sessions_per_s"], fields["llm_calls"], fields["errors"])
                last = time.time()
            time.sleep(0.2)
        self.sub_pool.shutdown(wait=True)
        if self.durable is not None:
            self.durable.close(self.cfg.durable_timeout_s + 10.0)
        return self.heartbeat()


def run(cfg: AgentSimConfig) -> int:
    from openai import OpenAI

    from flywheel.ingest.sdk import SessionLogger

    cfg.handoff.parent.mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, cfg.handoff.parent / "agent-sim.toml")
    log.info("agent: policy via proxy %s, events to %s (%s), hand-off %s", cfg.proxy_url, cfg.kafka_bootstrap,
             cfg.events_topic, cfg.handoff)
    # max_retries=0: a failed call ends the session as an error instead of re-sampling behind the logger's back
    client = OpenAI(base_url=cfg.proxy_url.rstrip("/") + "/v1", api_key="flywheel-demo", max_retries=0,
                    timeout=cfg.request_timeout_s)
    logger = SessionLogger(cfg.kafka_bootstrap, cfg.events_topic, name=cfg.spool_name)
    sim = AgentSim(cfg, logger, client)
    stop_on_signals("finishing the sessions in hand", sim.stop, signals=(signal.SIGTERM,))
    try:
        fields = sim.run()
    except KeyboardInterrupt:
        sim.stop.set()
        fields = sim.heartbeat()
    logger.flush(30.0)
    logger.close()
    if sim.ledger is not None:
        sim.ledger.close()
    log.info("agent: stopped after %d sessions (%d errors)", fields["sessions"], fields["errors"])
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(AgentSimConfig, argv, prog="flywheel agent-sim")
    setup_logging(cfg.log_level)
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request would drown the agent's own log
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return run(cfg)
