"""One session assembled from its events: agents, their ordered steps, sub-agent tree, end.

Events of one agent can come from two emitters (the capture proxy logs llm_call, the agent's
SDK logs tool events), each with its own seq counter, so order inside an agent is (ts, seq),
with event_id as the last tie-breaker so two runs always agree. Duplicates (same event_id,
e.g. a replayed batch) are dropped before this module sees the events.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Iterable


@dataclass
class SessionEvents:
    session_id: str
    task_type: str | None
    main_agent: str
    agents: dict[str, list[dict[str, Any]]]  # agent_id -> events ordered by (ts, seq, event_id)
    parent: dict[str, str | None]  # agent_id -> parent agent id (None for the main agent)
    ended: bool  # a session_end event was seen
    status: str | None  # session_end status
    end_ts: dt.datetime | None  # session_end ts
    last_ts: dt.datetime  # newest event ts (used for the idle timeout)
    context_edits: int = 0
    context_tokens_removed: int = 0
    llm_calls: list[dict[str, Any]] = field(default_factory=list)  # every agent's, in (agent order, ts, seq)

    def end_or_last(self) -> dt.datetime:
        return self.end_ts or self.last_ts


def opening_call(s: SessionEvents) -> str | None:
    """event_id of the session's opening llm_call: the main agent's first (where the agent decides how to go about
    the request: answer, call a tool, spawn sub-agents); None when the main agent made no call."""
    mine = [e for e in s.llm_calls if e["agent_id"] == s.main_agent]
    return min(mine, key=order_key)["event_id"] if mine else None


def as_datetime(ts: dt.datetime | int) -> dt.datetime:
    """Event ts as an aware datetime (the builder hands them over as integer microseconds since the epoch)."""
    if isinstance(ts, dt.datetime):
        return ts
    return _EPOCH + dt.timedelta(microseconds=ts)


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def order_key(e: dict[str, Any]) -> tuple[Any, ...]:
    return (e["ts"], e["seq"], e["event_id"])


def assemble(session_id: str, events: Iterable[dict[str, Any]]) -> SessionEvents:
    """Build a SessionEvents from its de-duplicated events (any order; ts as datetimes or integer microseconds)."""
    agents: dict[str, list[dict[str, Any]]] = {}
    parent: dict[str, str | None] = {}
    task_type = None
    main = None
    end_ts = None
    status = None
    last_ts = None
    for e in events:
        assert e["session_id"] == session_id, f"event {e['event_id']} belongs to {e['session_id']}, not {session_id}"
        agents.setdefault(e["agent_id"], []).append(e)
        if e.get("parent_agent_id") is not None or e["agent_id"] not in parent:
            parent[e["agent_id"]] = e.get("parent_agent_id")
        if e["type"] == "session_start":
            task_type = e.get("task_type") or task_type
            main = main or e["agent_id"]
        elif e["type"] == "session_end":
            # several ends (e.g. a retried close): the latest one wins
            if end_ts is None or e["ts"] >= end_ts:
                end_ts, status = e["ts"], e.get("status")
        last_ts = e["ts"] if last_ts is None else max(last_ts, e["ts"])
    assert last_ts is not None, f"session {session_id} has no events"
    for evs in agents.values():
        evs.sort(key=order_key)
    if main is None:
        # no session_start seen (yet): the root agent is the one without a parent, earliest first
        roots = sorted((a for a, p in parent.items() if p is None), key=lambda a: order_key(agents[a][0]))
        main = roots[0] if roots else min(agents, key=lambda a: order_key(agents[a][0]))
    s = SessionEvents(session_id, task_type, main, agents, parent, end_ts is not None, status,
                None if end_ts is None else as_datetime(end_ts), as_datetime(last_ts))
    for agent_id in agent_order(s):
        for e in s.agents[agent_id]:
            if e["type"] == "llm_call":
                s.llm_calls.append(e)
            elif e["type"] == "context_edit":
                s.context_edits += 1
                s.context_tokens_removed += int(e.get("tokens_removed") or 0)
    return s


def agent_order(s: SessionEvents) -> list[str]:
    """Main agent first, then the others by their first event (a stable order for output rows)."""
    others = sorted((a for a in s.agents if a != s.main_agent), key=lambda a: (order_key(s.agents[a][0]), a))
    return [s.main_agent] + others
