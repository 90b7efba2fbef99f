"""The learner's input: new rows of the episodes table, checked, de-duplicated and batched.

Read path: `lake.files_since(root, "episodes", cursor)` lists files with anything new; every
row is validated (`parse_row`), and valid rows wait in `pending` until a step takes them.
A step takes rows in lake order (`take`; or newest first, see `take`), dropping rows whose
policy_version lags the learner's current version by more than K (counted per lag) at the
moment the step is formed, because the current version grows while rows wait.

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
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flywheel.ingest import lake

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

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def parse_row(row: dict[str, Any], vocab_size: int, max_seq_len: int) -> Episode | str:
    """An Episode, or the reason the row cannot be trained (the caller logs and counts it)."""
    ident = row.get("episode_id") or "<no episode_id>"
    for name in ("episode_id", "label_version", "task_type", "policy_version", "prompt_token_ids",
                 "completion_token_ids", "completion_logprobs", "loss_mask", "reward"):
        if row.get(name) is None:
            return f"{ident}: {name} is null"
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
    )


def iso_ts(value: Any) -> str | None:
    """A lake timestamp (a datetime from Parquet, or ISO text) as ISO-8601 UTC text, microseconds, so stamps sort as text."""
    if value is None or isinstance(value, str):
        return value
    if value.tzinfo is None:  # the lake's timestamps are UTC; a naive one is UTC too
        value = value.replace(tzinfo=datetime.timezone.utc)
    return value.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class TakeStats:
    """What forming one batch dropped, and the lags of what it kept."""

    stale: int = 0
    lags: Counter = field(default_factory=Counter)  # lag -> rows kept


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
        self._remaining: Counter = Counter()  # file path -> rows of it still pending
        self.counters: Counter = Counter()  # corrupt, stale, duplicate, relabel_after_train, relabel_replaced
        # versions of a line the gate rejected (the learner went back to the champion): their rows
        # are stale whatever their number says, since the weights no longer descend from them
        self.abandoned: set[int] = set(abandoned or ())

    # -- reading ------------------------------------------------------------------------------
    def poll(self) -> int:
        """Read files not yet loaded; returns how many valid new rows became pending."""
        loaded = {f.path for f in self._loaded}
        new_files = [f for f in lake.files_since(self.root, TABLE, self.cursor) if f.path not in loaded]
        added = 0
        for f in new_files:
            try:
                rows = lake.read_file(self.root, f).to_pylist()
            except Exception as exc:  # a truncated or foreign file must not stop training; it stays unread
                self.counters["unreadable_file"] += 1
                log.error("data: cannot read %s (%s: %s); file skipped and left for an operator", f.path,
                          type(exc).__name__, exc)
                rows = []
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

    # -- batching -----------------------------------------------------------------------------
    def fresh(self, policy_version: int, current_version: int, max_staleness: int) -> bool:
        """A row may be trained: served by a version at most max_staleness behind, not an abandoned one."""
        return policy_version not in self.abandoned and current_version - policy_version <= max_staleness

    def trainable(self, current_version: int, max_staleness: int) -> int:
        """Pending rows that would survive the staleness filter now."""
        return sum(1 for p in self.pending if self.fresh(p.episode.policy_version, current_version, max_staleness))

    def drop_stale(self, current_version: int, max_staleness: int) -> int:
        """Drop pending rows that lag too far (they only get staler); returns how many."""
        keep = [p for p in self.pending if self.fresh(p.episode.policy_version, current_version, max_staleness)]
        dropped = len(self.pending) - len(keep)
        if dropped:
            for p in self.pending:
                if not self.fresh(p.episode.policy_version, current_version, max_staleness):
                    self._remaining[p.file.path] -= 1
            self.pending = keep
            self._index = {p.episode.episode_id: i for i, p in enumerate(keep)}
            self.counters["stale"] += dropped
            log.info("data: dropped %d episodes lagging policy_version %d by more than %d", dropped,
                     current_version, max_staleness)
            self._advance_cursor()
        return dropped

    def take(self, n: int, current_version: int, max_staleness: int,
             newest_first: bool = False) -> tuple[list[Episode], TakeStats]:
        """Up to n fresh episodes; stale ones met on the way are dropped and counted.

        In lake order by default (every row is trained once, as long as it stays fresh enough).
        newest_first takes the most recent rows instead: a learner slower than the traffic then
        trains on what the current policy produced and the older backlog ages out through the
        staleness filter (counted as stale), instead of training every step on rows max_staleness
        versions old.
        """
        stats = TakeStats()
        batch: list[Episode] = []
        keep: list[_Pending] = []
        for p in (reversed(self.pending) if newest_first else self.pending):
            lag = current_version - p.episode.policy_version
            if len(batch) >= n:
                keep.append(p)
            elif not self.fresh(p.episode.policy_version, current_version, max_staleness):
                stats.stale += 1
                self._remaining[p.file.path] -= 1
            else:
                batch.append(p.episode)
                stats.lags[lag] += 1
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
