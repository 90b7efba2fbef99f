"""Labelling: a routed session's episode rows and index row, for its label 1 or a relabel (label N+1).

The episode builder's pass plans, merges, routes and commits (rewards/builder.py); its label stage turns each
routed session into rows here: the rewards of every llm_call (outcome per agent, per-turn credit, the judge,
PARL shaping on the row that decided a spawn, penalties), the loss mask, the reward detail people read, and
the index row the builder keeps for the session. A relabel reads the session's previous rows back from the
episodes table (lake.read_file) and recomputes their rewards from every outcome so far; nothing is rewritten.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any, Callable

from flywheel.ingest import lake, schema
from flywheel.ingest.lake import LakeReadError
from flywheel.rewards import config as reward_config
from flywheel.rewards import judge as judge_mod
from flywheel.rewards import judge_pass, outcome_rewards, parl, turns
from flywheel.rewards.session import SessionEvents, opening_call


def outcome_json(o: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in o.items()}


def outcome_py(o: dict[str, Any]) -> dict[str, Any]:
    out = dict(o)
    for key in ("ts", "_ingest_ts", "held_since"):
        if isinstance(out.get(key), str):
            out[key] = schema.parse_ts(out[key])
    return out


OUTCOME_KEEP = ("outcome_id", "session_id", "agent_id", "call_id", "kind", "value", "ts", "source")


@dataclass
class Due:
    """A session whose label 1 is due this pass."""

    session: SessionEvents
    outcomes: list[dict[str, Any]]  # every outcome of the session so far, agent-level ones included
    end_ts: dt.datetime  # the session_end's ts, or the last event's + the idle timeout
    end_how: str  # "session_end" or "idle_timeout"
    window_closed: bool  # the waited-for kinds still absent count as their `missing` rule says
    drop: str | None = None  # "missing_outcome" or "no_llm_calls": indexed as label 0, no rows


def label_1_index_row(due: Due, task: reward_config.TaskType, relabel_horizon_s: float) -> dict[str, Any]:
    """The index row of a session's label 1 (its episode_file is set when the file is written)."""
    return {
        "session_id": due.session.session_id,
        "label_version": 1,
        "reason": "window_closed" if due.window_closed else "outcomes_in",
        "task_type": due.session.task_type or task.name,
        "end_ts": due.end_ts,
        "expires_ts": due.end_ts + dt.timedelta(seconds=relabel_horizon_s),
        "outcomes": json.dumps([outcome_json({k: o.get(k) for k in OUTCOME_KEEP}) for o in due.outcomes],
                               sort_keys=True),
        "event_ids": sorted(e["event_id"] for events in due.session.agents.values() for e in events),
    }


def _penalty_now(detail: dict[str, Any], r_penalty: float, harmful: set[str],
                 harmful_prune: float) -> tuple[float, dict[str, float] | None]:
    """A relabelled row's r_penalty and its parts: the malformed part as label 1 set it, the harmful-prune part
    from every outcome so far (a checker's report may come after label 1). A row labelled before the parts
    were recorded keeps its r_penalty (None: no parts to update)."""
    parts = detail.get("penalty_parts")
    if parts is None:
        return r_penalty, None
    hit = harmful_prune if harmful.intersection(detail.get("calls") or ()) else 0.0
    parts = {"malformed": float(parts["malformed"]), "harmful_prune": hit}
    return parts["malformed"] + hit, parts


def loss_mask_from(n: int, trained_from: int | None) -> list[int]:
    """The loss_mask of a completion of n tokens trained from token `trained_from` on (None: every token).

    An index of 0 or past the last token trains the whole completion: a row always keeps a token to train."""
    if trained_from is None or not 0 < trained_from < n:
        return [1] * n
    return [0] * trained_from + [1] * (n - trained_from)


class Labeller:
    """The label stage of a pass: rows and index rows from routed sessions, under one rewards config."""

    def __init__(self, rewards: reward_config.RewardConfig, judge_model: Callable[[], str], lake_root: str) -> None:
        self.rewards = rewards
        self._judge_model = judge_model  # the builder's judge's model, named in each row's reward detail
        self.lake_root = lake_root  # a relabel reads the session's previous rows from its episodes

    def label_one(self, due: Due, judged: judge_mod.JudgeResult | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Label 1 of a due session: its rows and its index row (label 0 and no rows when it is dropped);
        `judged`: the judge's answer for it this pass, if any."""
        s = due.session
        task = self.rewards.task(s.task_type)
        index_row = label_1_index_row(due, task, self.rewards.join.relabel_horizon_s)
        if due.drop is not None:
            return [], index_row | {"label_version": 0, "reason": due.drop}
        stats = parl.parl_stats(s, self.rewards.parl, due.outcomes)
        made, finals = turns.turns(s), turns.final_calls(s)
        malformed, n_malformed = parl.malformed_penalties(s, self.rewards.penalties.malformed_tool_call, made)
        shaping = parl.row_shaping(s, self.rewards.parl, due.outcomes)
        harmful = parl.harmful_prune_penalties(made, due.outcomes, self.rewards.penalties)
        r_judge = judged.r_judge(self.rewards.judge_weight(task)) if judged is not None else None
        detail_base = {
            "judge": judge_pass.judge_detail(self.rewards, self._judge_model(), task, judged),
            "parl": parl.detail(stats) | {"anneal_clock": self.rewards.parl.anneal_clock,
                                          "spurious": sum(x.n_spurious for x in shaping.values())},
            "malformed_tool_calls": n_malformed,
            "harmful_prunes": len(harmful),
            "context_edits": s.context_edits,
            "context_tokens_removed": s.context_tokens_removed,
            "end": due.end_how,
            "end_ts": due.end_ts.isoformat(),
            "status": s.status,
            "label_reason": index_row["reason"],
            "rewards_config": self.rewards.digest,
        }
        scores = {a: outcome_rewards.score_for_agent(self.rewards, task, due.outcomes, a, due.window_closed)
                  for a in s.agents}
        checked = turns.call_outcomes(due.outcomes, task.turn_kinds)
        opening = opening_call(s)
        rows = []
        for e in s.llm_calls:
            # the parts kept apart, with the row's own call_ids, so that a relabel can apply a harmful-prune
            # report that arrives after this label (_relabel)
            parts = {"malformed": malformed.get(e["event_id"], 0.0), "harmful_prune": harmful.get(e["event_id"], 0.0)}
            r_penalty = parts["malformed"] + parts["harmful_prune"]
            mine = scores[e["agent_id"]]
            made_here = made.get(e["event_id"], turns.ToolTurn())
            turn = turns.credit(self.rewards, task, made_here, checked,
                                mine.r_outcome if e["event_id"] in finals else None)
            decided = shaping.get(e["event_id"])
            # a row penalised only for malformed calls that said where they broke trains from there on: its
            # well-formed prefix is neither pushed down nor reinforced (tasks.malformed_from says why)
            trained_from = made_here.malformed_token if parts["malformed"] < 0 and not parts["harmful_prune"] else None
            rows.append(self.row(s, e, label=1, r_outcome=mine.r_outcome, r_judge=r_judge, stats=stats,
                                  r_penalty=r_penalty, trained_from=trained_from,
                                  detail=detail_base | {"outcomes": mine.detail, "penalty_this_call": r_penalty,
                                                        "penalty_parts": parts, "calls": list(made_here.calls),
                                                        "trained_from_token": trained_from,
                                                        "turn": turn.detail or None,
                                                        "spawn_decision": None if decided is None else {
                                                            "n_spawned": decided.n_spawned,
                                                            "n_verified": decided.n_verified,
                                                            "n_spurious": decided.n_spurious}},
                                  outcomes=due.outcomes, r_turn=turn.r_turn, opens_session=e["event_id"] == opening,
                                  judge_score=None if judged is None else judged.score, shaping=decided))
        return rows, index_row

    def row(self, s: SessionEvents, e: dict[str, Any], label: int, r_outcome: float, r_judge: float | None,
             stats: parl.ParlStats, r_penalty: float, detail: dict[str, Any], outcomes: list[dict[str, Any]],
             r_turn: float | None = None, shaping: parl.RowShaping | None = None,
             judge_score: int | None = None, trained_from: int | None = None,
             opens_session: bool = False) -> dict[str, Any]:
        # PARL terms go to the row that decided the spawn (parl.row_shaping), none to the others
        r_parallel, r_finish = (shaping.r_parallel, shaping.r_finish) if shaping is not None else (0.0, 0.0)
        reward = schema.episode_reward(r_outcome, r_turn, r_judge, r_parallel, r_finish, r_penalty)
        return {
            "episode_id": e["event_id"],
            "label_version": label,
            "session_id": s.session_id,
            "agent_id": e["agent_id"],
            "parent_agent_id": s.parent.get(e["agent_id"]),
            "task_type": s.task_type or "default",
            "group_id": e.get("group_id"),
            "model": e["model"],
            "policy_version": e["policy_version"],
            "prompt_token_ids": e["prompt_token_ids"],
            "completion_token_ids": e["completion_token_ids"],
            "completion_logprobs": e["completion_logprobs"],
            "loss_mask": loss_mask_from(len(e["completion_token_ids"]), trained_from),
            "reward": reward,
            "r_outcome": r_outcome,
            "r_judge": r_judge,
            "r_parallel": r_parallel,
            "r_finish": r_finish,
            "r_penalty": r_penalty,
            "r_turn": r_turn,
            "judge_score": judge_score,
            "sampling": e.get("sampling"),
            "reward_detail": json.dumps(detail, sort_keys=True, default=str),
            "opens_session": opens_session,
            "shaping_clock": self.rewards.parl.anneal_clock if r_parallel or r_finish else None,
            "critical_steps": stats.critical_steps,
            "call_ts": e["ts"],
            "session_end_ts": s.end_ts,
            "last_outcome_ts": max((o["ts"] for o in outcomes), default=None),
        }

    def relabel(self, entry: dict[str, Any], new: list[dict[str, Any]], clock: dt.datetime,
                 judged: judge_mod.JudgeResult | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Label N+1 of an emitted session: its rows of label N again, the outcome reward recomputed (and the judge's
        score set, when a queued retry scored it now)."""
        label = int(entry["label_version"]) + 1
        prev = lake.read_file(self.lake_root, self.episode_file(entry["episode_file"]),
                              filters=[("session_id", "=", entry["session_id"]),
                                       ("label_version", "=", label - 1)]).to_pylist()
        assert prev, (f"index says session {entry['session_id']} label {label - 1} is in {entry['episode_file']}, "
                      "found no rows")
        outcomes = ([outcome_py(o) for o in json.loads(entry["outcomes"])]
                    + [{k: o.get(k) for k in OUTCOME_KEEP} for o in new])
        task = self.rewards.task(entry["task_type"])
        end_ts = entry["end_ts"]
        whole = outcome_rewards.session_level(outcomes)
        _, closed = outcome_rewards.label_due(self.rewards, task, {o["kind"] for o in whole}, end_ts, clock)
        scores = {a: outcome_rewards.score_for_agent(self.rewards, task, outcomes, a, closed)
                  for a in {r["agent_id"] for r in prev}}
        last_outcome = max((o["ts"] for o in outcomes), default=None)  # a judge retry's session may have none
        reason = "late_outcome" if new else "judge_retry"
        harmful = parl.harmful_call_ids(outcomes, self.rewards.penalties)
        details = [json.loads(r["reward_detail"]) for r in prev]
        penalties = [_penalty_now(d, r["r_penalty"], harmful, self.rewards.penalties.harmful_prune)
                     for r, d in zip(prev, details)]
        n_harmful = sum(1 for _, parts in penalties if parts and parts["harmful_prune"])
        rows = []
        # file order: the rows of the label it follows
        for r, detail, (r_penalty, parts) in zip(prev, details, penalties):
            score = scores[r["agent_id"]]
            turn = turns.recredit(self.rewards, task, detail, outcomes, score.r_outcome)
            detail |= {"outcomes": score.detail, "label_reason": reason, "rewards_config": self.rewards.digest,
                       "turn": turn.detail or None}
            if parts is not None:
                detail |= {"penalty_parts": parts, "penalty_this_call": r_penalty, "harmful_prunes": n_harmful}
                if parts["harmful_prune"]:  # the prune's penalty is the whole reply's, not only a broken call's
                    r = r | {"loss_mask": loss_mask_from(len(r["completion_token_ids"]), None)}
            if judged is not None:
                r = r | {"r_judge": judged.r_judge(self.rewards.judge_weight(task)), "judge_score": judged.score}
                detail["judge"] = judge_pass.judge_detail(self.rewards, self._judge_model(), task, judged)
            reward = schema.episode_reward(score.r_outcome, turn.r_turn, r["r_judge"], r["r_parallel"], r["r_finish"],
                                           r_penalty)
            rows.append(r | {"label_version": label, "r_outcome": score.r_outcome, "r_turn": turn.r_turn,
                             "reward": reward, "r_penalty": r_penalty,
                             "reward_detail": json.dumps(detail, sort_keys=True), "last_outcome_ts": last_outcome})
        index_row = entry | {
            "label_version": label,
            "reason": reason,
            "outcomes": json.dumps([outcome_json(o) for o in outcomes], sort_keys=True),
        }
        return rows, index_row

    def episode_file(self, rel: str) -> lake.LakeFile:
        """The file holding an index entry's rows: the one it was written to, or the file a compaction
        merged it into."""
        import pyarrow.fs as pafs

        fs, base = lake.filesystem(self.lake_root)
        path = f"{base}/{rel}"
        parsed = lake.parse_file_name(rel.rsplit("/", 1)[-1])
        assert parsed is not None, f"index holds a bad episode file name {rel!r}"
        source, stream, first, last = parsed
        if fs.get_file_info(path).type == pafs.FileType.File:
            parent = rel.rsplit("/", 2)[-2] if rel.count("/") >= 2 else ""
            date = parent[len("date="):] if parent.startswith("date=") else ""
            return lake.LakeFile("episodes", date, source, stream, first, last, path)
        for f in lake.list_files(self.lake_root, "episodes"):
            if f.partition == stream and f.first <= first and f.last >= last:
                return f
        raise LakeReadError(f"episodes: the rows of {rel} are in no episodes file (deleted outside compaction?)")
