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
"""

from __future__ import annotations

import json
import logging
import random
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.base import defaults
from flywheel.base.config import (
    ConfigError,
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
    context_budget_chars: int = setting(150, "history length (chars) past which the agent summarises failed attempts (two failed calls exceed it)")
    handoff: Path = setting(DEFAULT_HANDOFF, "JSONL file finished sessions are appended to (the verifier reads it)")
    tokenizer: str = setting(defaults.BASE_MODEL_DIR, "model dir whose tokenizer.json counts context-edit tokens ('' = estimate)")
    request_timeout_s: float = setting(120.0, "timeout of one model call")
    seed: int = setting(0, "seed of the task stream (0: random)")
    spool_name: str = setting("agent-sim", "the SDK's spill spool name")
    var_dir: Path = setting(Path(defaults.VAR_DIR), "local state root; the heartbeat goes to <var_dir>/run/status/")
    status_name: str = setting("agent-sim", "name of the heartbeat under var/run/status")
    log_level: str = setting("INFO", "logging level")

    def check(self) -> None:
        if self.concurrency < 1:
            raise ConfigError(f"concurrency: must be >= 1, got {self.concurrency}")
        if not 0.0 <= self.multi_share <= 1.0:
            raise ConfigError(f"multi_share: must be in [0, 1], got {self.multi_share}")
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
        self.started = time.time()
        self.sub_pool = ThreadPoolExecutor(max_workers=max(2, cfg.concurrency), thread_name_prefix="subagent")
        cfg.handoff.parent.mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------------- one model call
    def _generate(self, session_id: str, agent_id: str, parent: str | None, task_type: str):
        headers = {H_SESSION: session_id, H_AGENT: agent_id, H_TASK: task_type}
        if parent:
            headers[H_PARENT] = parent

        def generate(messages: list[tasks.Message]) -> str:
            resp = self.client.chat.completions.create(
                model=self.cfg.model, messages=messages, max_tokens=self.cfg.max_tokens,
                temperature=self.cfg.temperature, extra_headers=headers, timeout=self.cfg.request_timeout_s)
            self.counts.add("llm_calls")
            return resp.choices[0].message.content or ""

        return generate

    # ---------------------------------------------------------------- one agent solving one part
    def _solve(self, part: tasks.Part, agent: Any, task_type: str) -> str | None:
        """Run the tool-use dialogue for one part as `agent` (main agent or sub-agent); log tools and edits."""
        pending: dict[str, str] = {}

        def on_turn(turn: tasks.Turn) -> None:
            if turn.parsed.kind == "answer":
                return
            malformed = turn.parsed.kind == "malformed_call"
            self.counts.add("malformed_calls" if malformed else "tool_calls")
            call_id = agent.tool_call(turn.parsed.tool or "unparsed", turn.parsed.arguments, malformed=malformed or None)
            agent.tool_result(call_id, ok=bool(turn.tool_ok), output=turn.tool_output, name=turn.parsed.tool)
            pending[call_id] = turn.tool_output or ""

        def on_compact(removed: list[tasks.Message], note: tasks.Message) -> None:
            self.counts.add("context_edits")
            removed_tokens = sum(self.tokens.count(str(m.get("content", ""))) for m in removed)
            agent.context_edit("summarize", removed_tokens, self.tokens.ids(note["content"]))

        generate = self._generate(agent.session_id, agent.agent_id, agent.parent_agent_id, task_type)
        answer, _turns = tasks.solve_part(part, generate, self.cfg.max_turns, self.cfg.context_budget_chars,
                                          on_turn=on_turn, on_compact=on_compact)
        return answer

    # ---------------------------------------------------------------- one session
    def run_session(self) -> None:
        with self.rng_lock:
            spec = tasks.make_task(self.rng, self.cfg.multi_share)
        session_id = uuid.uuid4().hex
        session = self.logger.session(task_type=spec.task_type, session_id=session_id,
                                      tags={"task_id": spec.task_id, "parts": str(len(spec.parts))})
        status = "ok"
        answers: list[str | None] = []
        try:
            if not spec.multi:
                answers = [self._solve(spec.parts[0], session, spec.task_type)]
            else:
                # independent parts: one sub-agent each, in parallel (what PARL rewards)
                children = [session.spawn_subagent(subtask=p.text) for p in spec.parts]
                self.counts.add("subagents", len(children))
                futures = [self.sub_pool.submit(self._solve, p, c, spec.task_type) for p, c in zip(spec.parts, children)]
                for child, fut in zip(children, futures):
                    try:
                        answers.append(fut.result())
                    except Exception:
                        answers.append(None)
                        child.finish(ok=False)
                        raise
                    child.finish(ok=answers[-1] is not None)
        except Exception as exc:  # the policy endpoint failed: an infrastructure error, not a policy outcome
            status = "error"
            self.counts.add("errors")
            log.warning("agent: session %s failed (%s: %s); ended with status error, not sent to the verifier",
                        session_id, type(exc).__name__, exc)
            self.stop.wait(1.0)  # back off instead of spinning on a dead endpoint
        session.end(status)
        self.counts.add("sessions")
        if status == "ok":
            self._hand_off(session_id, spec, answers)

    def _hand_off(self, session_id: str, spec: tasks.TaskSpec, answers: list[str | None]) -> None:
        record = {"session_id": session_id, "task": spec.to_json(), "answers": answers, "ended": time.time()}
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
        workers = [threading.Thread(target=self._worker, name=f"agent-{i}", daemon=True) for i in range(self.cfg.concurrency)]
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
    log.info("agent: stopped after %d sessions (%d errors)", fields["sessions"], fields["errors"])
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(AgentSimConfig, argv, prog="flywheel agent-sim")
    setup_logging(cfg.log_level)
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request would drown the agent's own log
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return run(cfg)
