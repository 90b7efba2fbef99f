"""Verifiable outcome rewards: outcome records of one session -> r_outcome, and when label 1 is due.

Pure functions over plain dicts (outcome records as in ingest.schema.OUTCOME_COLUMNS, with `ts`
as an aware datetime), so the join rules are unit-tested without a lake.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Iterable

from flywheel.rewards.config import RewardConfig, TaskType


@dataclass
class OutcomeScore:
    r_outcome: float
    drop: bool  # a waited-for kind with missing = "drop" never came: do not train on this session
    detail: dict[str, Any] = field(default_factory=dict)  # per kind: value, score, weight, or "missing: ..."


def latest_per_kind(outcomes: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The newest outcome of each kind (by ts, then outcome_id so ties resolve the same way every run)."""
    out: dict[str, dict[str, Any]] = {}
    for o in sorted(outcomes, key=lambda o: (o["ts"], o["outcome_id"])):
        out[o["kind"]] = o
    return out


def score_outcomes(cfg: RewardConfig, task: TaskType, outcomes: Iterable[dict[str, Any]],
                   window_closed: bool) -> OutcomeScore:
    """r_outcome of a session from its (de-duplicated) outcomes.

    `window_closed` says whether the waited-for kinds that are absent count as missing (their
    window passed) — only then does the kind's `missing` rule apply.
    """
    latest = latest_per_kind(outcomes)
    total = 0.0
    drop = False
    detail: dict[str, Any] = {}
    for kind, o in sorted(latest.items()):
        rule = cfg.kind(kind)
        if rule is None:
            # an outcome kind nobody configured carries no reward; recorded so the gap is visible
            detail[kind] = {"value": o["value"], "score": None, "note": "kind not in rewards config"}
            continue
        score = rule.score(float(o["value"]))
        total += rule.weight * score
        detail[kind] = {"value": o["value"], "score": score, "weight": rule.weight}
    for kind in task.wait_for:
        if kind in latest or not window_closed:
            continue
        rule = cfg.outcomes[kind]
        if rule.missing == "drop":
            drop = True
            detail[kind] = {"missing": "drop"}
        elif rule.missing == "ignore":
            detail[kind] = {"missing": "ignore"}
        else:
            total += rule.weight * float(rule.missing)
            detail[kind] = {"missing": float(rule.missing), "score": float(rule.missing), "weight": rule.weight}
    return OutcomeScore(total, drop, detail)


def label_due(cfg: RewardConfig, task: TaskType, kinds_present: set[str], end_ts: dt.datetime,
              now: dt.datetime) -> tuple[bool, bool]:
    """(due, window_closed) for label 1 of an ended session.

    Due when every waited-for kind is in, or when the longest window among the missing ones has
    passed since the session ended (window_closed then says the missing rules apply).
    """
    missing = [k for k in task.wait_for if k not in kinds_present]
    if not missing:
        return True, False
    deadline = end_ts + dt.timedelta(seconds=max(cfg.outcomes[k].window_s for k in missing))
    closed = now >= deadline
    return closed, closed


def session_level(outcomes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Outcomes about the whole session (no agent_id, no call_id): only these satisfy a task type's wait_for."""
    return [o for o in outcomes if not o.get("agent_id") and not o.get("call_id")]


def score_for_agent(cfg: RewardConfig, task: TaskType, outcomes: list[dict[str, Any]], agent_id: str,
                    window_closed: bool) -> OutcomeScore:
    """r_outcome of one agent's rows: the session's outcomes plus those reported about this agent.

    An outcome with an agent_id is narrower than the session (e.g. a sub-agent's own verifier): it
    counts for that agent's llm_calls only, and for a kind both carry, the agent's wins (the narrower
    check says more about these rows than the session's verdict, whichever came later). An outcome
    about one tool call (call_id) is a turn's, never the agent's (rewards/turns.py).
    """
    mine = [o for o in outcomes if not o.get("call_id") and o.get("agent_id") == agent_id]
    narrow = {o["kind"] for o in mine}
    session = [o for o in outcomes if not o.get("call_id") and not o.get("agent_id") and o["kind"] not in narrow]
    return score_outcomes(cfg, task, session + mine, window_closed)
