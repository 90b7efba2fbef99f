"""Synthetic sessions and outcomes written straight into a lake, for tests and `flywheel bench episodes`.

Records go through the lake writer's own decoding (`ingest.lake_writer.decode_record`, which
validates them against ingest/schema.py) and `rows_to_table`, and are published with
`ingest.lake.write_file` under Kafka-style names, so the builder reads exactly what the real
lake writer would have written — without a broker in the loop.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

from ingest import lake, lake_writer, schema


def _ts(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).isoformat(timespec="microseconds")


@dataclass
class SessionBuilder:
    """Appends schema-valid events of one session; each agent keeps its own seq counter."""

    session_id: str
    start: dt.datetime
    task_type: str = "tool_use"
    main: str = "main"
    events: list[dict[str, Any]] = field(default_factory=list)
    _seq: dict[str, int] = field(default_factory=dict)
    _t: float = 0.0  # seconds since start of the last event

    def _event(self, agent: str, etype: str, parent: str | None = None, dt_s: float = 1.0, **fields: Any) -> dict[str, Any]:
        self._t += dt_s
        seq = self._seq.get(agent, 0)
        self._seq[agent] = seq + 1
        e = {"schema_version": schema.SCHEMA_VERSION, "event_id": uuid.uuid4().hex, "session_id": self.session_id,
             "agent_id": agent, "parent_agent_id": parent, "seq": seq,
             "ts": _ts(self.start + dt.timedelta(seconds=self._t)), "type": etype, **fields}
        self.events.append(e)
        return e

    def begin(self) -> "SessionBuilder":
        self._event(self.main, "session_start", task_type=self.task_type, tags={"synthetic": "1"})
        return self

    def llm_call(self, agent: str | None = None, parent: str | None = None, version: int = 0, n_prompt: int = 16,
                 n_completion: int = 8, rng: random.Random | None = None, text: str | None = None) -> dict[str, Any]:
        rng = rng or random.Random(0)
        agent = agent or self.main
        return self._event(
            agent, "llm_call", parent, model=f"policy-v{version}", policy_version=version,
            prompt_token_ids=[rng.randrange(512) for _ in range(n_prompt)],
            completion_token_ids=[rng.randrange(512) for _ in range(n_completion)],
            completion_logprobs=[-rng.random() * 3 for _ in range(n_completion)],
            finish_reason="stop", latency_s=0.05, sampling={"temperature": 1.0},
            prompt_text=text, completion_text=None if text is None else f"answer to {text}",
        )

    def tool(self, agent: str | None = None, parent: str | None = None, malformed: bool = False, ok: bool = True) -> None:
        agent = agent or self.main
        call_id = uuid.uuid4().hex[:8]
        self._event(agent, "tool_call", parent, call_id=call_id, name="search", arguments={"q": "x"}, malformed=malformed)
        self._event(agent, "tool_result", parent, call_id=call_id, name="search", ok=ok and not malformed, output="done")

    def spawn(self, child: str, agent: str | None = None, parent: str | None = None) -> None:
        self._event(agent or self.main, "subagent_spawn", parent, child_agent_id=child, subtask=f"part {child}")

    def finish(self, child: str, ok: bool, agent: str | None = None, parent: str | None = None) -> None:
        self._event(agent or self.main, "subagent_finish", parent, child_agent_id=child, ok=ok)

    def context_edit(self, tokens_removed: int = 100) -> None:
        self._event(self.main, "context_edit", edit_kind="summarize", tokens_removed=tokens_removed, summary_token_ids=[1, 2, 3])

    def end(self, status: str = "ok") -> dt.datetime:
        e = self._event(self.main, "session_end", status=status)
        return schema.parse_ts(e["ts"])


def outcome(session_id: str, kind: str, value: float, ts: dt.datetime, outcome_id: str | None = None,
            source: str = "verifier") -> dict[str, Any]:
    return {"schema_version": schema.SCHEMA_VERSION, "outcome_id": outcome_id or uuid.uuid4().hex, "session_id": session_id,
            "kind": kind, "value": float(value), "ts": _ts(ts), "source": source}


class LakeFeeder:
    """Writes records into lake/events and lake/outcomes as the lake writer would (contiguous offsets per partition)."""

    def __init__(self, root: str, topics: dict[str, str] | None = None) -> None:
        self.root = root
        self.topics = topics or {"events": schema.EVENTS_TOPIC, "outcomes": schema.OUTCOMES_TOPIC}
        self.next_offset: dict[tuple[str, int], int] = {}
        self.files: list[lake.LakeFile] = []

    def write(self, table: str, records: list[dict[str, Any]], partition: int = 0,
              ingest_ts: dt.datetime | None = None) -> list[lake.LakeFile]:
        """Publish `records` (wire dicts) as new files: one per run of consecutive records with the same date."""
        ingest_ts = ingest_ts or dt.datetime.now(dt.timezone.utc)
        topic = self.topics[table]
        written: list[lake.LakeFile] = []
        run: list[dict[str, Any]] = []
        run_date = None
        for rec in records:
            row, date = lake_writer.decode_record(table, json.dumps(rec).encode())
            if run and date != run_date:
                written.append(self._publish(table, topic, partition, run_date, run))
                run = []
            run_date = date
            off = self.next_offset.get((table, partition), 0) + len(run)
            run.append(row | {"_topic": topic, "_partition": partition, "_offset": off, "_ingest_ts": ingest_ts})
        if run:
            written.append(self._publish(table, topic, partition, run_date, run))
        self.files.extend(written)
        return written

    def _publish(self, table: str, topic: str, partition: int, date: str | None, rows: list[dict[str, Any]]) -> lake.LakeFile:
        assert date is not None
        first = self.next_offset.get((table, partition), 0)
        last = first + len(rows) - 1
        self.next_offset[(table, partition)] = last + 1
        return lake.write_file(self.root, table, date, topic, partition, first, last, lake_writer.rows_to_table(table, rows))


def generate(n_sessions: int, start: dt.datetime, seed: int = 0, calls: tuple[int, int] = (1, 4), sub_agents: float = 0.3,
             task_type: str = "tool_use", outcome_kind: str = "task_success", spacing_s: float = 5.0
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`n_sessions` finished sessions (some with sub-agents and malformed tool calls) and one outcome each."""
    rng = random.Random(seed)
    events: list[dict[str, Any]] = []
    outcomes: list[dict[str, Any]] = []
    for i in range(n_sessions):
        sid = f"s-{seed}-{i:07d}-{uuid.UUID(int=rng.getrandbits(128)).hex[:8]}"
        b = SessionBuilder(sid, start + dt.timedelta(seconds=i * spacing_s), task_type=task_type).begin()
        for _ in range(rng.randint(*calls)):
            b.llm_call(rng=rng, version=rng.randint(0, 3))
            b.tool(malformed=rng.random() < 0.05)
        if rng.random() < sub_agents:
            children = [f"{sid}-sub{j}" for j in range(rng.randint(1, 3))]
            for c in children:
                b.spawn(c)
            for c in children:
                b.llm_call(agent=c, parent=b.main, rng=rng)
            for c in children:
                b.finish(c, ok=rng.random() < 0.7)
            b.llm_call(rng=rng)
        end = b.end()
        events.extend(b.events)
        outcomes.append(outcome(sid, outcome_kind, float(rng.random() < 0.5), end + dt.timedelta(seconds=2)))
    return events, outcomes
