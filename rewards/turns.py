"""Per-turn credit: the llm_call that produced a verified tool call is rewarded by that check.

The session's outcome says whether the whole task succeeded; it cannot say which turn earned it.
Where something checks one tool call (the task's verifier recomputing what the call should have
been, a test run on one edit), it reports an outcome with the call's `call_id` (schema v2), and
the task type lists that kind in rewards.toml's `turn_kinds`. Then:

* the llm_call that produced the call gets r_turn = weight * score(value) of the newest such
  outcome (the mean over its calls when it produced several), and r_turn replaces the session's
  outcome in that row's reward: a correct call in a failed session is reinforced, a wrong one in a
  session a later retry rescued is not;
* a malformed call (the harness could not parse it) is a verified failure of its turn: r_turn 0,
  so with the malformed-call penalty the row's reward is negative whatever the session did;
* every other row (the final answer, calls nothing checked) keeps the session's (or its agent's)
  outcome, the fallback for turns nothing verifies;
* an agent's LAST llm_call is what the verifier's outcome judges (normally the answer): when it is a
  verified call instead (the agent ran out of turns without answering), its r_turn is at most the
  outcome, so a session that never answers is never paid for its calls alone.

A call is charged to the llm_call of the same agent that came just before it, as the malformed
penalty is (rewards/parl.py). Pure functions over a SessionEvents and outcome dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from flywheel.rewards.config import RewardConfig, TaskType
from flywheel.rewards.outcome_rewards import latest_per_kind
from flywheel.rewards.session import SessionEvents


@dataclass(frozen=True)
class ToolTurn:
    """What one llm_call did with tools: the call_ids it produced and how many of them were malformed.

    malformed_token: the earliest completion token a malformed call of this turn was charged from (the
    tool_call's malformed_token); None when there is no malformed call or one of them did not say.
    """

    calls: tuple[str, ...] = ()
    malformed: int = 0
    malformed_token: int | None = None


@dataclass
class TurnCredit:
    r_turn: float | None  # None: nothing verified this turn (the row keeps the session outcome)
    detail: dict[str, Any] = field(default_factory=dict)


def turns(s: SessionEvents) -> dict[str, ToolTurn]:
    """event_id of each llm_call -> the tool calls it produced (the calls its agent logged after it,
    before its next call)."""
    out: dict[str, ToolTurn] = {}
    for evs in s.agents.values():
        last: str | None = None
        early: list[dict[str, Any]] = []  # calls logged before the agent's first llm_call: charged to that call
        for e in evs:
            if e["type"] == "llm_call":
                last = e["event_id"]
                out[last] = ToolTurn()
                for c in early:
                    out[last] = _add(out[last], c)
                early = []
            elif e["type"] == "tool_call":
                if last is None:
                    early.append(e)
                else:
                    out[last] = _add(out[last], e)
    return out


def _add(t: ToolTurn, call: dict[str, Any]) -> ToolTurn:
    if call.get("malformed"):
        at = call.get("malformed_token")
        at = at if isinstance(at, int) and at >= 0 else None
        if t.malformed and (at is None or t.malformed_token is None):
            at = None  # one call of the turn charges the whole reply: so does the turn
        elif t.malformed and at is not None and t.malformed_token is not None:
            at = min(at, t.malformed_token)
        return ToolTurn(t.calls, t.malformed + 1, at)
    if not call.get("call_id"):
        return t  # nothing can name it, so nothing can verify it
    return ToolTurn((*t.calls, str(call["call_id"])), t.malformed, t.malformed_token)


def final_calls(s: SessionEvents) -> set[str]:
    """The event_id of each agent's last llm_call."""
    out: set[str] = set()
    for evs in s.agents.values():
        calls = [e["event_id"] for e in evs if e["type"] == "llm_call"]
        if calls:
            out.add(calls[-1])
    return out


def call_outcomes(outcomes: Iterable[dict[str, Any]], kinds: tuple[str, ...]) -> dict[str, dict[str, dict[str, Any]]]:
    """call_id -> {kind: the newest outcome of that kind about the call}, for the turn kinds only."""
    by_call: dict[str, list[dict[str, Any]]] = {}
    for o in outcomes:
        if o.get("call_id") and o["kind"] in kinds:
            by_call.setdefault(str(o["call_id"]), []).append(o)
    return {c: latest_per_kind(os) for c, os in by_call.items()}


def credit(cfg: RewardConfig, task: TaskType, turn: ToolTurn, checked: dict[str, dict[str, dict[str, Any]]],
           final_outcome: float | None = None) -> TurnCredit:
    """r_turn of one llm_call from its calls' checks (`checked` as call_outcomes returns it); final_outcome:
    the agent's outcome when this is its last llm_call (r_turn is then at most that)."""
    if not task.turn_kinds:
        return TurnCredit(None)
    scores: list[float] = [0.0] * turn.malformed
    detail: dict[str, Any] = {"calls": list(turn.calls), "malformed": turn.malformed, "checks": {},
                              "final": final_outcome is not None}
    for call_id in turn.calls:
        latest = checked.get(call_id)
        if not latest:
            continue
        total = 0.0
        for kind, o in sorted(latest.items()):
            rule = cfg.outcomes[kind]  # turn kinds are checked to have a table when the config loads
            total += rule.weight * rule.score(float(o["value"]))
        scores.append(total)
        detail["checks"][call_id] = {k: o["value"] for k, o in latest.items()}
    if not scores:
        return TurnCredit(None, detail)
    r_turn = sum(scores) / len(scores)
    return TurnCredit(r_turn if final_outcome is None else min(r_turn, final_outcome), detail)


def recredit(cfg: RewardConfig, task: TaskType, previous_detail: dict[str, Any],
             outcomes: Iterable[dict[str, Any]], r_outcome: float) -> TurnCredit:
    """r_turn again for a relabel, from the calls label 1 recorded in its detail and every outcome so far
    (r_outcome: the row's agent outcome now, the cap when label 1 found it was the agent's last call)."""
    turn_detail = previous_detail.get("turn") or {}
    turn = ToolTurn(tuple(turn_detail.get("calls") or ()), int(turn_detail.get("malformed") or 0))
    return credit(cfg, task, turn, call_outcomes(outcomes, task.turn_kinds),
                  r_outcome if turn_detail.get("final") else None)
