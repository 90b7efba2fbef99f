"""PARL shaping for parallel agents (Kimi K2.5), critical steps, and the malformed-tool-call guard.

    r = lambda1 * r_parallel + lambda2 * r_finish + r_outcome

r_parallel rewards instantiating sub-agents, capped so spawning more than `parallel_cap` earns
nothing more: min(n_spawned, cap) / cap. r_finish is the fraction of spawned sub-agents whose
part a check verified (an outcome about the child, `finish_kind`), so spawning without solving is
not rewarded ("spurious parallelism"); a child's own "finished ok" claim earns nothing. Shaping
is off (`enabled = false`) where the harness, not the policy, decides to spawn. Both lambdas anneal linearly to exactly
0, so late training optimises the outcome alone. Two clocks (`anneal_clock`): "policy_version", the newest policy
version of the session's own llm_calls (known from the events, identical on every re-run of the builder), or
"learner_step": the builder writes the terms at their full lambdas and the learner scales them by
anneal(1, its step, ...) when it trains the row (learner/data.py shaping_scale), so the terms are
exactly zero from the learner's configured step on, whatever version served the session.

The shaping goes to the row that decided to spawn, not to the whole session: a spawn decision is
the llm_call of the spawning agent just before its subagent_spawn events (`spawn_decisions`), and it
is paid r_parallel and r_finish for the children IT spawned. Every other row keeps r_outcome only,
so a sub-agent's row or the orchestrator's later rows are not paid for a choice they did not make.
Spawns with no llm_call of the agent before them were decided by the harness and shape no row.
Spurious spawns (`spurious_spawns`): a child whose sub-task was empty or repeated a sibling's of the
same decision; they count in r_parallel's n but never in r_finish's verified share, and the report
counts them.

Critical steps (the latency measure PARL optimises instead of total steps): for an agent, its
own llm_calls plus, for each stage where it spawned sub-agents in parallel, the slowest child's
critical steps. A stage is a run of subagent_spawn events with no llm_call of the spawning agent
between them. Children that logged events under the agent as parent but were never announced
by a spawn event form one extra stage, so their work is not lost from the count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from flywheel.rewards.config import ParlSettings, PenaltySettings
from flywheel.rewards.session import SessionEvents
from flywheel.rewards.turns import ToolTurn, turns


@dataclass(frozen=True)
class ParlStats:
    n_spawned: int
    n_finished_ok: int
    r_parallel_raw: float  # before its lambda
    r_finish_raw: float
    lambda1: float
    lambda2: float
    critical_steps: int

    @property
    def r_parallel(self) -> float:
        return self.lambda1 * self.r_parallel_raw

    @property
    def r_finish(self) -> float:
        return self.lambda2 * self.r_finish_raw


def anneal(lambda0: float, t: int, start: int, end: int) -> float:
    """lambda0 up to `start`, linear down to exactly 0.0 at `end` and after."""
    assert end > start, f"anneal end {end} must be after start {start}"
    if t >= end:
        return 0.0
    if t <= start:
        return lambda0
    return lambda0 * (end - t) / (end - start)


def spawned_children(s: SessionEvents) -> dict[str, bool]:
    """Every spawned child (any depth) -> whether it reported a successful finish (the latest finish wins)."""
    children: dict[str, bool] = {}
    for evs in s.agents.values():
        for e in evs:
            if e["type"] == "subagent_spawn":
                children.setdefault(e["child_agent_id"], False)
    for evs in s.agents.values():
        for e in evs:
            if e["type"] == "subagent_finish" and e["child_agent_id"] in children:
                children[e["child_agent_id"]] = bool(e.get("ok"))
    return children


def critical_steps(s: SessionEvents, agent_id: str | None = None, _seen: frozenset[str] = frozenset()) -> int:
    """Longest chain of llm_call steps from `agent_id` (default: the main agent) through its sub-agents."""
    agent_id = agent_id or s.main_agent
    if agent_id in _seen or agent_id not in s.agents and agent_id not in s.parent:
        return 0  # a cycle in bad data, or a child that never logged anything
    seen = _seen | {agent_id}
    steps = 0
    stage: list[str] = []
    announced: set[str] = set()

    def close_stage() -> int:
        return max((critical_steps(s, c, seen) for c in stage), default=0)

    for e in s.agents.get(agent_id, []):
        if e["type"] == "llm_call":
            steps += 1 + close_stage()
            stage = []
        elif e["type"] == "subagent_spawn":
            stage.append(e["child_agent_id"])
            announced.add(e["child_agent_id"])
    steps += close_stage()
    unannounced = [a for a, p in s.parent.items() if p == agent_id and a not in announced and a != agent_id]
    steps += max((critical_steps(s, c, seen) for c in unannounced), default=0)
    return steps


def spawn_decisions(s: SessionEvents) -> dict[str, list[dict[str, Any]]]:
    """event_id of each llm_call that decided a spawn -> the subagent_spawn events it decided (in order).

    The decision is the spawning agent's latest llm_call before the spawn: the model's reply that asked
    for sub-agents. Spawns before any llm_call of their agent were the harness's choice: no row has them."""
    out: dict[str, list[dict[str, Any]]] = {}
    for evs in s.agents.values():
        last: str | None = None
        for e in evs:
            if e["type"] == "llm_call":
                last = e["event_id"]
            elif e["type"] == "subagent_spawn" and last is not None:
                out.setdefault(last, []).append(e)
    return out


def spurious_spawns(spawns: Iterable[dict[str, Any]]) -> int:
    """Sub-agents of one decision whose sub-task was empty or the same (case and spacing aside)
    as an earlier sibling's."""
    seen: set[str] = set()
    n = 0
    for e in spawns:
        task = " ".join(str(e.get("subtask") or "").lower().split())
        if not task or task in seen:
            n += 1
        seen.add(task)
    return n


def lambdas(cfg: ParlSettings, version: int) -> tuple[float, float]:
    """(lambda1, lambda2) the builder writes: 0 when shaping is off; annealed by the session's policy version
    on the "policy_version" clock; the full values on the "learner_step" clock (the learner anneals them)."""
    if not cfg.enabled:
        return 0.0, 0.0
    if cfg.anneal_clock == "learner_step":
        return cfg.lambda1, cfg.lambda2
    return (anneal(cfg.lambda1, version, cfg.anneal_start, cfg.anneal_end),
            anneal(cfg.lambda2, version, cfg.anneal_start, cfg.anneal_end))


@dataclass(frozen=True)
class RowShaping:
    """The PARL terms of one spawn-decision row (already multiplied by the lambdas in force)."""

    n_spawned: int
    n_verified: int
    n_spurious: int
    r_parallel: float
    r_finish: float


def row_shaping(s: SessionEvents, cfg: ParlSettings, outcomes: Iterable[dict[str, Any]] = ()) -> dict[str, RowShaping]:
    """event_id of each spawn-decision row -> its terms; rows not in the map get no shaping."""
    outcomes = list(outcomes)
    version = max((int(e["policy_version"]) for e in s.llm_calls), default=0)
    lam1, lam2 = lambdas(cfg, version)
    out: dict[str, RowShaping] = {}
    for eid, spawns in spawn_decisions(s).items():
        children = list(dict.fromkeys(e["child_agent_id"] for e in spawns))
        n = len(children)
        spurious = spurious_spawns(spawns)
        ok = len(verified_children(children, outcomes, cfg))
        out[eid] = RowShaping(n, ok, spurious, lam1 * min(n, cfg.parallel_cap) / cfg.parallel_cap,
                              lam2 * (ok / n if n else 0.0))
    return out


def verified_children(children: Iterable[str], outcomes: Iterable[dict[str, Any]], cfg: ParlSettings) -> set[str]:
    """The sub-agents whose own part a check verified: the newest `finish_kind` outcome about the child
    (agent_id = child, no call_id) is at or above finish_threshold. Its subagent_finish(ok) is the
    child's own claim and verifies nothing."""
    wanted = set(children)
    latest: dict[str, dict[str, Any]] = {}
    for o in sorted(outcomes, key=lambda o: (o["ts"], o["outcome_id"])):
        if o["kind"] == cfg.finish_kind and o.get("agent_id") in wanted and not o.get("call_id"):
            latest[o["agent_id"]] = o
    return {a for a, o in latest.items() if float(o["value"]) >= cfg.finish_threshold}


def parl_stats(s: SessionEvents, cfg: ParlSettings, outcomes: Iterable[dict[str, Any]] = ()) -> ParlStats:
    """The session's PARL counts and lambdas (the terms a row is paid are row_shaping's); with `enabled` false
    both lambdas are 0 (the counts are still reported)."""
    children = spawned_children(s)
    n = len(children)
    ok = len(verified_children(children, outcomes, cfg))
    version = max((int(e["policy_version"]) for e in s.llm_calls), default=0)
    lam1, lam2 = lambdas(cfg, version)
    return ParlStats(
        n_spawned=n,
        n_finished_ok=ok,
        r_parallel_raw=min(n, cfg.parallel_cap) / cfg.parallel_cap,
        r_finish_raw=ok / n if n else 0.0,
        lambda1=lam1,
        lambda2=lam2,
        critical_steps=critical_steps(s),
    )


def malformed_penalties(s: SessionEvents, penalty: float,
                        made: dict[str, ToolTurn] | None = None) -> tuple[dict[str, float], int]:
    """event_id of an llm_call -> its penalty (<= 0), and the number of malformed tool calls.

    A malformed tool call is charged to the llm_call that produced it, as turns.turns assigns calls
    (the same agent's call just before it; the agent's first call when it came before any). If the
    agent made no call at all, the session's first call pays, so a malformed call is never free.
    `made`: turns(s), when the caller has it already.
    """
    made = turns(s) if made is None else made
    count = sum(1 for evs in s.agents.values() for e in evs if e["type"] == "tool_call" and e.get("malformed"))
    out = {eid: t.malformed * penalty for eid, t in made.items() if t.malformed}
    orphans = count - sum(t.malformed for t in made.values())  # logged by agents that made no llm_call
    if orphans and s.llm_calls:
        first = s.llm_calls[0]["event_id"]
        out[first] = out.get(first, 0.0) + orphans * penalty
    return out, count


def harmful_prune_penalties(made: dict[str, ToolTurn], outcomes: Iterable[dict[str, Any]],
                            penalties: PenaltySettings) -> dict[str, float]:
    """event_id of an llm_call whose prune the checker found harmful -> penalties.harmful_prune (<= 0).

    The checker can tell only where it knows what the answer needed: it reports `harmful_edit_kind` with
    the prune call's call_id (>= 0.5: the session failed and the prune had removed what the answer needed).
    Without such a report the pruning row keeps the session outcome, like any other row."""
    harmful = harmful_call_ids(outcomes, penalties)
    return {eid: penalties.harmful_prune for eid, t in made.items() if harmful.intersection(t.calls)}


def harmful_call_ids(outcomes: Iterable[dict[str, Any]], penalties: PenaltySettings) -> set[str]:
    """The call_ids of the prunes the checker reported harmful (value >= 0.5), among `outcomes`."""
    return {str(o["call_id"]) for o in outcomes
            if o["kind"] == penalties.harmful_edit_kind and o.get("call_id") and float(o["value"]) >= 0.5}


def detail(stats: ParlStats) -> dict[str, Any]:
    return {
        "n_spawned": stats.n_spawned,
        "n_finished_ok": stats.n_finished_ok,
        "r_parallel_raw": stats.r_parallel_raw,
        "r_finish_raw": stats.r_finish_raw,
        "lambda1": stats.lambda1,
        "lambda2": stats.lambda2,
    }
