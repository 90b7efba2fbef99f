"""The judge's share of one episode-builder pass: which sessions it scores, and the retry queue.

A pass judges (1) the sessions it labels now whose task type judges and whose session id falls in
the type's `judge_sample` share (a hash, so a re-run picks the same sessions), and (2) sessions of
earlier passes whose judge failed retryably (timeout, endpoint unavailable, pass budget spent).
Both run through `Judge.score_many` (bounded concurrency, the pass's time and call budget), new
sessions first. A label-1 session the judge failed on is emitted without a score and queued; a
queued session scored later gets a new label (`judge_retry`: its rows again with the score), so a
judge outage delays the score, never the episode. The queue lives in the builder's committed state
(`BuilderState.judge_retry`, with the rendered transcript, since the session's events are gone once
it is emitted); an entry is given up after `[judge].max_attempts` failed tries, or when the queue
is over `[judge].retry_queue` (the oldest first). Every answer goes into the pass's memo, which the
builder saves before its episode file, so a re-run of a killed pass writes the same scores.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from flywheel.ingest import schema
from flywheel.rewards import transcript as transcript_mod
from flywheel.rewards.config import RewardConfig, Rubric, TaskType
from flywheel.rewards.judge import Judge, JudgeResult, cache_key, judge_version
from flywheel.rewards.session import SessionEvents

log = logging.getLogger(__name__)
Memo = dict[str, tuple[int | None, str]]  # cache key -> (score, status) of this pass's answers


def sampled(session_id: str, rate: float) -> bool:
    """Whether a session falls in a `judge_sample` share: the same answer on every run and every builder, and
    independent of the SDK's own sampling (salted)."""
    return schema.session_sampled(session_id, rate, salt="judge:")


def judge_detail(rewards: RewardConfig, model: str, task: TaskType,
                 result: JudgeResult | None) -> dict[str, Any] | None:
    """reward_detail.judge of a row: status, score, the judge version that scored it and the weight in force."""
    if result is None:
        return None
    rubric = rewards.rubrics[task.rubric]
    weight = rewards.judge_weight(task)
    return {"status": result.status, "score": result.score, "rubric": rubric.name, "rubric_version": rubric.version,
            "version": judge_version(model, rubric), "weight": weight, "shadow": weight == 0}


@dataclass
class JudgedPass:
    judged: dict[str, JudgeResult] = field(default_factory=dict)  # label-1 session -> its answer
    retried: dict[str, JudgeResult] = field(default_factory=dict)  # queued session scored now -> its answer
    queue: list[dict[str, Any]] = field(default_factory=list)  # the retry queue to commit
    gave_up: int = 0


def _queued(rewards: RewardConfig, model: str, rec: dict[str, Any]) -> tuple[str, str, Rubric] | None:
    task = rewards.task(rec["task_type"])
    if not task.judge:
        return None  # the judge was switched off for the type since: nothing to retry
    rubric = rewards.rubrics[task.rubric]
    return cache_key(rec["text"], rubric, model), rec["text"], rubric


def due_retries(queue: list[dict[str, Any]], clock: dt.datetime) -> list[dict[str, Any]]:
    """The queued sessions whose retry time has come at `clock` (the pass's clock, so a re-run agrees)."""
    return [rec for rec in queue if dt.datetime.fromisoformat(rec["retry_ts"]) <= clock]


def _queue_entry(rec: dict[str, Any], attempts: int, status: str, clock: dt.datetime, after_s: float) -> dict[str, Any]:
    """A queue record after a try: its next retry `after_s` doubled per attempt from the pass's clock."""
    retry = clock + dt.timedelta(seconds=after_s * 2 ** max(0, attempts - 1))
    return rec | {"attempts": attempts, "status": status, "retry_ts": retry.isoformat()}


def judge_pass(sessions: list[SessionEvents], queue: list[dict[str, Any]], rewards: RewardConfig, judge: Judge,
               memo: Memo, clock: dt.datetime) -> JudgedPass:
    """Score `sessions` (those labelled now) and the queued retries due at `clock`; `memo` gets every answer
    (pre-filled on a re-run)."""
    cfg = rewards.judge
    deadline = time.monotonic() + cfg.budget_s
    new: dict[str, tuple[str, str, Rubric, str]] = {}  # session -> (key, text, rubric, task type)
    for s in sessions:
        task = rewards.task(s.task_type)
        if task.judge and sampled(s.session_id, task.judge_sample):
            text = transcript_mod.transcript(s, cfg.max_tokens, cfg.chars_per_token)
            rubric = rewards.rubrics[task.rubric]
            new[s.session_id] = (cache_key(text, rubric, judge.model), text, rubric, s.task_type or "default")
    due = due_retries(queue, clock)
    old = {rec["session_id"]: (rec, _queued(rewards, judge.model, rec)) for rec in due}
    ask: dict[str, tuple[str, Rubric]] = {}
    for key, text, rubric in [item[:3] for item in new.values()] + [q for _, q in old.values() if q is not None]:
        if key not in memo:
            ask[key] = (text, rubric)
    for key, result in judge.score_many(ask, deadline, cfg.max_calls).items():
        memo[key] = (result.score, result.status)
    out = JudgedPass()
    for sid, (key, text, _, task_type) in new.items():
        out.judged[sid] = JudgeResult(*memo[key])
        if out.judged[sid].retryable:
            entry = {"session_id": sid, "task_type": task_type, "text": text}
            out.queue.append(_queue_entry(entry, int(memo[key][1] != "budget"), memo[key][1], clock, cfg.retry_after_s))
    for sid, (rec, q) in old.items():
        result = JudgeResult(*memo[q[0]]) if q is not None else JudgeResult(None, "error: judge off")
        attempts = rec["attempts"] + (result.status != "budget")
        if result.score is not None:
            out.retried[sid] = result
        elif result.retryable and attempts < cfg.max_attempts:
            out.queue.append(_queue_entry(rec, attempts, result.status, clock, cfg.retry_after_s))
        else:
            out.gave_up += 1
            log.warning("judge: session %s given up after %d attempts (%s); its rows stay without a judge score",
                        sid, attempts, result.status)
    # the queue in order of entry: those not due yet, those retried now, then this pass's new failures;
    # past the cap the oldest are given up
    waiting = [rec for rec in queue if rec["session_id"] not in old]
    out.queue = waiting + [r for r in out.queue if r["session_id"] not in new] + \
        [r for r in out.queue if r["session_id"] in new]
    if len(out.queue) > cfg.retry_queue:
        over = len(out.queue) - cfg.retry_queue
        out.gave_up += over
        log.warning("judge: retry queue over %d; the %d oldest sessions given up", cfg.retry_queue, over)
        out.queue = out.queue[over:]
    return out
