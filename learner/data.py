"""The learner's input: new rows of the episodes table, checked, de-duplicated and batched.

Read path: `lake.files_since(root, "episodes", cursor)` lists files with anything new (by the
cursor: the cost of a poll grows with new files, not with the table); every
row is validated (`parse_row`), and valid rows wait in `pending` until a step takes them.
A step takes rows in lake order (`take`; or newest first, see `take`), dropping rows served more
than K learner steps before the current weights (counted per lag) at the moment the step is
formed, because the weights move on while rows wait. The lag is counted in steps along the
learner's own line (TrainerState.lineage), not in version numbers, which jump after the gate
rejects versions: a row served by a version off the line (abandoned, or never this learner's) is stale.

Durability. The cursor only moves past a file once every row of it has left `pending`
(trained, or dropped for a reason), so a crash can never lose a row. Rows of a partly
consumed file come back after a restart and are recognised by `trained` (episode_id ->
label_version), which the checkpoint stores with the cursor: a row is never trained twice.

Relabels. The episode builder appends a row with a higher label_version when a late outcome
changes an episode's reward. Policy: an episode is trained at most once, with the newest
label the learner has seen before training it. A newer label of an episode still pending
replaces the older row; a newer label of an episode already trained is skipped and counted
(`relabel_after_train`): training it again would double its weight in the gradient. Revisiting
old samples with corrected rewards is a replay question, left to a future replay buffer.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from flywheel.base.versions import FROZEN_VERSION
from flywheel.ingest import lake, schema

log = logging.getLogger(__name__)

TABLE = "episodes"
# Behaviour logprobs come from a softmax, so they are <= 0; allow rounding noise of the float32 column.
_LOGPROB_SLACK = 1e-4


@dataclass(frozen=True)
class Episode:
    """One trainable sample, exactly as served (token ids are never re-tokenised)."""

    episode_id: str
    label_version: int
    task_type: str
    group_id: str | None
    policy_version: int
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    loss_mask: tuple[int, ...]
    reward: float
    call_ts: str | None = None  # when the llm_call happened (ISO-8601 UTC): a version's lineage names its episode range
    # the penalties inside `reward` (<= 0): a penalised row is never reinforced (loss.advantages)
    r_penalty: float = 0.0
    sampling: dict[str, Any] | None = None  # the behaviour's sampling parameters (temperature, top_p, top_k ...)
    # the PARL shaping inside `reward` (r_parallel + r_finish): annealed by learner step (shaping_scale)
    r_shaping: float = 0.0
    r_unshaped: float | None = None  # `reward` without the shaping, summed from its parts as the builder sums them
    shaping_clock: str | None = None  # the shaped row's anneal clock (the shaping_clock column)
    # the session's opening call (the opens_session column): take() can reserve room for these
    opens_session: bool = False

    def trained_reward(self, scale: float) -> float:
        """The reward a step trains: the shaping inside `reward` scaled by `scale` (shaping_scale at this step).

        At scale 0 the reward is rebuilt from its other parts rather than `reward - r_shaping`, whose rounding
        (about 1e-16) would leave a row that should tie its group a tiny advantage, which positive-only
        advantages then train: annealed to zero means exactly zero."""
        if not self.r_shaping or scale >= 1.0:
            return self.reward
        if scale <= 0.0 and self.r_unshaped is not None:
            return self.r_unshaped
        return self.reward - (1.0 - scale) * self.r_shaping

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def parse_row(row: dict[str, Any], vocab_size: int, max_seq_len: int) -> Episode | str:
    """An Episode, or the reason the row cannot be trained (the caller logs and counts it)."""
    ident = row.get("episode_id") or "<no episode_id>"
    for col in schema.EPISODE_COLUMNS:  # the schema's required columns, not a list of our own
        if col.required and row.get(col.name) is None:
            return f"{ident}: {col.name} is null"
    completion, logprobs, mask = row["completion_token_ids"], row["completion_logprobs"], row["loss_mask"]
    prompt = row["prompt_token_ids"]
    if not (len(completion) == len(logprobs) == len(mask)):
        return (f"{ident}: lengths differ (completion_token_ids {len(completion)}, completion_logprobs "
                f"{len(logprobs)}, loss_mask {len(mask)})")
    if not completion or not prompt:
        return f"{ident}: empty prompt or completion"
    if len(prompt) + len(completion) > max_seq_len:
        return f"{ident}: {len(prompt) + len(completion)} tokens exceed max_seq_len {max_seq_len}"
    bad_ids = [t for t in (*prompt, *completion) if t is None or not 0 <= t < vocab_size]
    if bad_ids:
        return f"{ident}: token ids {bad_ids[:3]} outside the vocabulary [0, {vocab_size})"
    if any(m not in (0, 1) for m in mask):
        return f"{ident}: loss_mask holds values other than 0/1"
    if not any(mask):
        return f"{ident}: loss_mask masks every completion token (nothing to train)"
    if any(lp is None or not math.isfinite(lp) or lp > _LOGPROB_SLACK for lp in logprobs):
        return f"{ident}: completion_logprobs hold NaN, inf or a positive value"
    reward = row["reward"]
    if not math.isfinite(reward):
        return f"{ident}: reward {reward} is not finite"
    sampling = parse_sampling(row.get("sampling"))
    if row.get("sampling") is not None and sampling is None:
        # the behaviour's distribution is unknown, so no ratio can be right: refused, not trained as T=1
        return f"{ident}: sampling {str(row['sampling'])[:60]!r} is not a JSON object"
    return Episode(
        episode_id=str(row["episode_id"]),
        label_version=int(row["label_version"]),
        task_type=str(row["task_type"]),
        group_id=row.get("group_id") or None,
        policy_version=int(row["policy_version"]),
        prompt_ids=tuple(int(t) for t in prompt),
        completion_ids=tuple(int(t) for t in completion),
        behaviour_logprobs=tuple(float(x) for x in logprobs),
        loss_mask=tuple(int(m) for m in mask),
        reward=float(reward),
        call_ts=iso_ts(row.get("call_ts")),
        r_penalty=float(row.get("r_penalty") or 0.0),
        r_shaping=float(row.get("r_parallel") or 0.0) + float(row.get("r_finish") or 0.0),
        r_unshaped=unshaped_reward(row),
        shaping_clock=row.get("shaping_clock"),  # the builder writes it on shaped rows only
        opens_session=row.get("opens_session") is True,
        sampling=sampling,
    )


def unshaped_reward(row: dict[str, Any]) -> float | None:
    """The row's reward without PARL shaping: the schema's episode_reward with r_parallel = r_finish = 0 (the
    builder's own sum, so it equals an unshaped twin's reward bit for bit); None when the outcome is missing."""
    if row.get("r_outcome") is None and row.get("r_turn") is None:
        return None
    return schema.episode_reward(float(row.get("r_outcome") or 0.0), row.get("r_turn"), row.get("r_judge"), 0.0, 0.0,
                                 float(row.get("r_penalty") or 0.0))


def shaping_scale(step: int, start: int, end: int) -> float:
    """What the PARL shaping of a row is worth at learner step `step` (the steps finished before this one):
    1 up to `start`, linear to exactly 0.0 at `end` and after; 1 always when end is 0 (the learner does not
    anneal: the builder's lambdas stand). Kimi K2.5 anneals r_parallel and r_finish to zero over training,
    so late training optimises the outcome alone; the learner's own step is that training clock."""
    from flywheel.rewards.parl import anneal

    return 1.0 if end <= 0 else anneal(1.0, step, start, end)


def parse_sampling(value: Any) -> dict[str, Any] | None:
    """The episode's sampling column (a JSON object, as text in Parquet) as a dict; None when absent or unreadable
    (parse_row refuses a row whose column is present but unreadable)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return dict(value) if isinstance(value, dict) else None


def iso_ts(value: Any) -> str | None:
    """A lake timestamp (a datetime from Parquet, or ISO text) as ISO-8601 UTC text, microseconds,
    so stamps sort as text."""
    if value is None or isinstance(value, str):
        return value
    if value.tzinfo is None:  # the lake's timestamps are UTC; a naive one is UTC too
        value = value.replace(tzinfo=datetime.timezone.utc)
    return value.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# Sampling parameters the learner reproduces (learner/model.py processed_log_softmax), those that
# do not change the per-token distribution, and those it cannot reproduce unless neutral.
_REPRODUCED = ("temperature", "top_p", "top_k")
_NO_EFFECT = ("max_tokens", "max_completion_tokens", "n", "seed", "stop", "stop_token_ids", "ignore_eos")
_NEUTRAL = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}
_GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature (sampling_params._SAMPLING_EPS)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def unsupported_sampling(sampling: dict[str, Any] | None) -> str | None:
    """Why the learner cannot score a row's tokens under the distribution they were sampled from; None if it can.

    The reason is a short category (the stream counts rows under `unsupported_sampling` and logs
    each reason once). A missing or null key is vLLM's default. Greedy rows (temperature 0) have no
    sampling distribution to correct towards; min_p, penalties and logit_bias change the
    distribution in ways the learner does not replay; an unknown key might, so it is refused too.
    """
    for key, value in (sampling or {}).items():
        if value is None or key in _NO_EFFECT:
            continue
        if key in _REPRODUCED:
            if not _number(value) or (key == "top_k" and (value != int(value) or value < -1)):
                return f"{key} is not a valid number"
            if key == "temperature" and value < _GREEDY_BELOW:
                return "temperature 0 (greedy sampling)"
            if key == "top_p" and not 0.0 < value <= 1.0:
                return "top_p outside (0, 1]"
        elif key in _NEUTRAL:
            if not _number(value) or value != _NEUTRAL[key]:
                return f"{key} != {_NEUTRAL[key]}"
        elif key == "logit_bias":
            if value:
                return "logit_bias set"
        else:
            return f"unknown sampling parameter {key!r}"
    return None


@dataclass
class TakeStats:
    """What forming one batch dropped, and the lags of what it kept."""

    stale: int = 0
    lags: Counter = field(default_factory=Counter)  # lag in learner steps -> rows kept


@dataclass
class _Pending:
    episode: Episode
    file: lake.LakeFile


class EpisodeStream:
    """New episodes since a durable cursor, with the de-duplication state a checkpoint restores."""

    def __init__(self, root: str, vocab_size: int, max_seq_len: int,
                 cursor: lake.Cursor | None = None, trained: dict[str, int] | None = None,
                 abandoned: set[int] | None = None) -> None:
        self.root = root
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.cursor: lake.Cursor = dict(cursor or {})
        self.trained: dict[str, int] = dict(trained or {})  # episode_id -> label_version trained
        self.pending: list[_Pending] = []
        self._index: dict[str, int] = {}  # episode_id -> position in pending
        self._loaded: list[lake.LakeFile] = []  # files read into memory, in lake order
        self._listed = False  # whether a poll has listed the whole table (lake.files_since's full)
        self._remaining: Counter = Counter()  # file path -> rows of it still pending
        self.counters: Counter = Counter()  # corrupt, stale, frozen, duplicate, relabel_after_train, relabel_replaced
        self._sampling_reasons: set[str] = set()  # unsupported_sampling reasons already logged
        # versions of a line the gate rejected (the learner went back to the champion): their rows
        # are stale whatever their number says, since the weights no longer descend from them
        self.abandoned: set[int] = set(abandoned or ())

    # -- reading ------------------------------------------------------------------------------
    def poll(self) -> int:
        """Read files not yet loaded; returns how many valid new rows became pending."""
        loaded = {f.path for f in self._loaded}
        # listed by cursor from past what is already loaded, so a poll costs what is new; the first poll of a
        # process lists the whole table once (files written before every table was claimed)
        read_to = lake.advance(self.cursor, self._loaded)
        new_files = [f for f in lake.files_since(self.root, TABLE, read_to, full=not self._listed)
                     if f.path not in loaded]
        self._listed = True
        added = 0
        for f in new_files:
            # an unreadable file raises lake.LakeReadError before the cursor passes it, and the learner stops
            # (lake.read_file's policy, the builder's too): skipped, its rows could never be trained, since the
            # learner does not read backwards. A file a compaction replaced is found again by the next poll.
            try:
                rows = lake.read_file(self.root, f).to_pylist()
            except lake.LakeFileGone:
                break
            self._loaded.append(f)
            for row in rows:
                added += self._add(row, f)
        self._loaded.sort(key=lambda f: (f.source, f.partition, f.first))
        self._advance_cursor()
        return added

    def _add(self, row: dict[str, Any], f: lake.LakeFile) -> int:
        parsed = parse_row(row, self.vocab_size, self.max_seq_len)
        if isinstance(parsed, str):
            self.counters["corrupt"] += 1
            log.warning("data: episode row in %s skipped: %s", f.path.rsplit("/", 1)[-1], parsed)
            return 0
        if self._refuse_sampling(parsed):
            return 0
        if parsed.policy_version == FROZEN_VERSION:  # a frozen model's call (the swarm's sub-agents): never trained
            self.counters["frozen"] += 1
            return 0
        done = self.trained.get(parsed.episode_id)
        if done is not None:
            # re-read after a restart (same label) or a late relabel of a trained episode: never train twice
            key = "relabel_after_train" if parsed.label_version > done else "duplicate"
            self.counters[key] += 1
            return 0
        at = self._index.get(parsed.episode_id)
        if at is not None:
            old = self.pending[at]
            if parsed.label_version <= old.episode.label_version:
                self.counters["duplicate"] += 1
                return 0
            # newer label of a pending episode: train the newest; the old row's file no longer waits on it
            self.counters["relabel_replaced"] += 1
            self._remaining[old.file.path] -= 1
            self.pending[at] = _Pending(parsed, f)
            self._remaining[f.path] += 1
            return 0
        self._index[parsed.episode_id] = len(self.pending)
        self.pending.append(_Pending(parsed, f))
        self._remaining[f.path] += 1
        return 1

    def _refuse_sampling(self, episode: Episode) -> bool:
        """Count (and log once per reason) a row whose sampling settings the learner cannot correct for."""
        reason = unsupported_sampling(episode.sampling)
        if reason is None:
            return False
        self.counters["unsupported_sampling"] += 1
        if reason not in self._sampling_reasons:
            self._sampling_reasons.add(reason)
            log.warning("data: episode %s not trained: %s; its importance ratios would be wrong (rows for this "
                        "reason are counted as unsupported_sampling, logged once)", episode.episode_id, reason)
        return True

    # -- batching -----------------------------------------------------------------------------
    def fresh(self, policy_version: int, lags: Mapping[int, int], max_staleness_steps: int) -> bool:
        """A row may be trained: served by a version on the learner's line at most max_staleness_steps
        learner steps behind the current weights (lags: TrainerState.lags()), not an abandoned one."""
        lag = lags.get(policy_version)
        return lag is not None and lag <= max_staleness_steps and policy_version not in self.abandoned

    def trainable(self, lags: Mapping[int, int], max_staleness_steps: int) -> int:
        """Pending rows that would survive the staleness filter now."""
        return sum(1 for p in self.pending if self.fresh(p.episode.policy_version, lags, max_staleness_steps))

    def drop_stale(self, lags: Mapping[int, int], max_staleness_steps: int) -> int:
        """Drop pending rows that lag too far or left the line (they only get staler); returns how many."""
        keep = [p for p in self.pending if self.fresh(p.episode.policy_version, lags, max_staleness_steps)]
        dropped = len(self.pending) - len(keep)
        if dropped:
            for p in self.pending:
                if not self.fresh(p.episode.policy_version, lags, max_staleness_steps):
                    self._remaining[p.file.path] -= 1
            self.pending = keep
            self._index = {p.episode.episode_id: i for i, p in enumerate(keep)}
            self.counters["stale"] += dropped
            log.info("data: dropped %d episodes served more than %d learner steps before the current weights, or by "
                     "a version off the learner's line", dropped, max_staleness_steps)
            self._advance_cursor()
        return dropped

    def take(self, n: int, lags: Mapping[int, int], max_staleness_steps: int,
             newest_first: bool = False, openings: int = 0) -> tuple[list[Episode], TakeStats]:
        """Up to n fresh episodes; stale ones met on the way are dropped and counted.

        In lake order by default (every row is trained once, as long as it stays fresh enough).
        newest_first takes the most recent rows instead: a learner slower than the traffic then
        trains on what the current policy produced and the older backlog ages out through the
        staleness filter (counted as stale), instead of training every step on rows
        max_staleness_steps steps old. TakeStats.lags counts the kept rows by their lag in steps.

        openings: up to this many of the n places go first to rows that open a session (the main agent's
        first call, whichever way it decided), in the same order, and the rest of the batch is filled as
        before. A session has one opening and several later turns, so a learner slower than the traffic
        otherwise drops its openings as stale at the rate of the other rows; the reserve trains the
        decisions at the start of sessions (to spawn or not, in the swarm) without favouring either way.
        """
        stats = TakeStats()
        order = list(reversed(self.pending) if newest_first else self.pending)
        chosen: set[int] = set()
        if openings > 0:
            for i, p in enumerate(order):
                if len(chosen) >= min(openings, n):
                    break
                if p.episode.opens_session and self.fresh(p.episode.policy_version, lags, max_staleness_steps):
                    chosen.add(i)
        batch: list[Episode] = []
        keep: list[_Pending] = []
        others = n - len(chosen)  # places left for the rows in order
        for i, p in enumerate(order):
            if i not in chosen:
                if others <= 0:
                    keep.append(p)
                    continue
                if not self.fresh(p.episode.policy_version, lags, max_staleness_steps):
                    stats.stale += 1
                    self._remaining[p.file.path] -= 1
                    continue
                others -= 1
            batch.append(p.episode)
            stats.lags[lags[p.episode.policy_version]] += 1
            self._remaining[p.file.path] -= 1
        if newest_first:
            keep.reverse()  # pending stays in lake order
        self.pending = keep
        self._index = {p.episode.episode_id: i for i, p in enumerate(keep)}
        self.counters["stale"] += stats.stale
        return batch, stats

    def mark_trained(self, batch: list[Episode]) -> None:
        """Record a finished step's episodes and move the cursor past fully consumed files."""
        for e in batch:
            self.trained[e.episode_id] = e.label_version
        self._advance_cursor()

    def _advance_cursor(self) -> None:
        # per stream, only a prefix of fully consumed files may pass: a later file done before an
        # earlier one must not carry the cursor over the earlier file's pending rows
        blocked: set[str] = set()
        still: list[lake.LakeFile] = []
        for f in self._loaded:
            if f.key in blocked or self._remaining[f.path] > 0:
                blocked.add(f.key)
                still.append(f)
                continue
            self.cursor = lake.advance(self.cursor, [f])
            self._remaining.pop(f.path, None)
        self._loaded = still

    def data_window(self) -> dict[str, Any]:
        """What the weights have seen so far (recorded in policy.json)."""
        return {"cursor": dict(self.cursor), "episodes_trained": len(self.trained)}
