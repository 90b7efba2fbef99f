"""The episode builder: lake events + outcomes -> rewarded episodes in lake/episodes.

It joins what production agents did (lake/events) with what was learned about it afterwards
(lake/outcomes, arriving asynchronously), scores each session's reward (verifiable outcomes,
the LLM judge, PARL shaping, penalties) and appends the llm_call rows the learner trains on.
Sessions still waiting live in the builder's state (rewards/state.py), not in a re-scan of the lake:

    flywheel episodes                       # catch up with the lake, then exit
    flywheel episodes --follow              # keep polling (SIGTERM finishes the pass and exits 0)
    flywheel episodes --rewards-toml my.toml --state-dir var/state/episodes
    flywheel episodes --member 1 --members 2 --state-dir var/state/episodes-1   # one of two builders

One pass (`Builder.run_pass`):
1. plan: the lake files new since the committed cursors (at most max_files_per_pass per table)
   and the pass's clock, saved as the intent before any output; a pass that did not commit is
   re-run from its intent instead.
2. merge: the new event rows join the pending ones (de-duplicated by event_id), the new outcomes
   join the held ones (de-duplicated by outcome_id).
3. route (`route`, pure): which sessions get label 1 now, which stay pending, which emitted
   sessions get a new label, which outcomes stay held, and what is dropped and why.
4. label (rewards/labels.py): rewards for the routed sessions -> episode rows and index rows.
5. commit: judge answers, the episode file, the index segment, then the new state generation.

Join rules (the numbers are in the rewards TOML; see rewards/rewards.toml):
* A session ends at its session_end event, or `join.session_idle_timeout_s` after its last event.
* Label 1 of an ended session is emitted when every outcome kind its task type waits for is in,
  or when the longest window among the missing kinds has passed since the session ended; each
  missing kind then counts as its `missing` rule says (a number, "ignore", or "drop": the
  session is not trained on). Outcomes that arrived before the session ended are included.
* An outcome arriving after label N was emitted appends label N+1: every llm_call row of the
  session again, with the reward recomputed from all its outcomes. Nothing is rewritten.
  After `join.relabel_horizon_s` past the session end, late outcomes are dropped ("too_late").
* An outcome whose outcome_id was seen before is dropped ("duplicate_outcome"). An outcome with an
  agent_id counts for that agent's rows only and does not satisfy the session's wait_for.
* An outcome for a session the builder has not seen is held for `join.unknown_session_hold_s`
  (its session's events may still be on their way through the other topic), then dropped
  ("unknown_session"). Outcomes for a session dropped at label 1 are dropped ("session_dropped").
* Events are de-duplicated by event_id ("duplicate_event"), also against the sessions already
  emitted: the index keeps each emitted session's event ids, so a copy the SDK re-sends after an
  outage is a duplicate whenever it comes. An event the session was labelled without is dropped
  ("late_event": the session was trained without it). Every drop is counted by reason in the
  status heartbeat; late events are logged.

Output rows: one per llm_call (every agent's, sub-agents included), in the schema of
ingest.schema.EPISODE_COLUMNS; the file is lake/episodes/date=<pass day>/episodes-<stream>-F-L.parquet
with F..L the rows' sequence numbers, so the learner reads new rows with lake.files_since.
Every decision of a pass uses the clock recorded in its intent, so a killed pass re-runs to the
same rows (see rewards/state.py); only `emitted_ts` tells when a row was written.

Split by partition (`Assignment`): events and outcomes are both keyed by session_id, so N builders
can each own some Kafka partitions (`--partitions 0,2`, or `--member K --members N`: p % N == K),
each with its own state dir and cursor, writing stream <stream> (a partition it owns, so names never
collide). Each records its partitions in the lake once (`claim_partitions`), so an overlapping or
re-split builder is refused, and a split over topics of unequal partition counts is refused at start.
A killed builder is taken over by restarting it with the same assignment and state dir.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from flywheel.base import defaults
from flywheel.base.config import load_config, setting, setup_logging, write_resolved
from flywheel.base.heartbeat import write_status
from flywheel.base.metrics import Metrics, Reading
from flywheel.base.stop import stop_on_signals
from flywheel.ingest import lake, schema
from flywheel.ingest.lake import LakeReadError
from flywheel.rewards import config as reward_config
from flywheel.rewards import judge as judge_mod
from flywheel.rewards import judge_pass, outcome_rewards
from flywheel.rewards.labels import OUTCOME_KEEP, Due, Labeller, outcome_json, outcome_py
from flywheel.rewards.session import SessionEvents, assemble
from flywheel.rewards.state import (
    ALL_PARTITIONS,
    BuilderState,
    Intent,
    StateLock,
    StateLockedError,
    StateStore,
)

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa

log = logging.getLogger(__name__)
SOURCE = "episodes"  # the episodes table's stream name in lake file names
SEGMENT_COMPACT_AT = 64  # live index segments before a pass merges them into one
# The event columns the builder reads (and keeps for pending sessions); free text such as tool
# output, arguments and tags is never needed for rewards, so it is not read at all.
EVENT_COLUMNS_USED = (
    "event_id", "session_id", "agent_id", "parent_agent_id", "seq", "ts", "type", "task_type", "model",
    "policy_version",
    "prompt_token_ids", "completion_token_ids", "completion_logprobs", "group_id", "prompt_text", "completion_text",
    "malformed", "malformed_token", "ok", "child_agent_id", "edit_kind", "tokens_removed", "status", "_offset",
    "call_id", "sampling",  # a turn check names its call; the learner scores tokens under the logged sampling
)
# ... except by the LLM judge, which reads the whole trajectory (rewards/transcript.py): read only when a
# task type judges
JUDGE_EVENT_COLUMNS = ("name", "arguments", "output", "subtask")


@dataclass
class EpisodesConfig:
    """Episode builder: lake events + outcomes -> rewarded episodes."""

    lake_root: str = setting(defaults.LAKE_ROOT, "lake root (path or pyarrow filesystem URI)")
    state_dir: str = setting("var/state/episodes", "builder state: cursors, pending sessions, index, judge cache")
    rewards_toml: str = setting("", "reward rules of this deployment (empty: the packaged rewards/rewards.toml)")
    follow: bool = setting(False, "keep polling for new lake files instead of exiting when caught up")
    poll_interval_s: float = setting(2.0, "seconds between passes in --follow mode when nothing is new")
    max_files_per_pass: int = setting(256, "lake files per table consumed by one pass (bounds a pass's memory)")
    judge_url: str = setting(defaults.VLLM_URL, "OpenAI-compatible endpoint of the LLM judge")
    judge_model: str = setting("", "judge model name (empty: [judge].model of the rewards TOML)")
    judge_api_key_env: str = setting("FLYWHEEL_JUDGE_API_KEY", "environment variable holding the judge endpoint's API "
                                                               "key (the key itself is never logged or written)")
    var_dir: str = setting(defaults.VAR_DIR, "where the status heartbeat is written")
    metrics_port: int = setting(0, "Prometheus endpoint http://0.0.0.0:<port>/metrics (0: off; e.g. 9102)")
    partitions: list[int] = setting([], "Kafka partitions (of events and outcomes alike) this builder owns (empty: "
                                        "all, or by --member)")
    member: int = setting(0, "this builder's index among --members: it owns partition p when p % members == member")
    members: int = setting(1, "builders splitting the partitions by p % members (1: no split)")
    partition_count: int = setting(0, "partitions of the events and outcomes topics, checked against the lake when "
                                      "split (0: inferred from the lake)")
    log_level: str = setting("INFO", "logging level")

    def check(self) -> None:
        from flywheel.base.config import ConfigError

        if self.max_files_per_pass < 1:
            raise ConfigError(f"max_files_per_pass must be >= 1, got {self.max_files_per_pass}")
        if self.poll_interval_s <= 0:
            raise ConfigError(f"poll_interval_s must be > 0, got {self.poll_interval_s}")
        if self.members < 1 or not 0 <= self.member < self.members:
            raise ConfigError(f"member must be in [0, members): member {self.member}, members {self.members}")
        if self.partitions and self.members > 1:
            raise ConfigError(f"partitions {self.partitions} and members {self.members}: give a static list or "
                              "member/members, not both")
        if any(p < 0 for p in self.partitions) or len(set(self.partitions)) != len(self.partitions):
            raise ConfigError(f"partitions must be distinct and >= 0, got {self.partitions}")
        if self.partition_count < 0 or any(p >= self.partition_count > 0 for p in self.partitions):
            raise ConfigError(f"partitions {self.partitions} must lie below partition_count {self.partition_count}")


@dataclass
class PassResult:
    pass_no: int
    new_event_rows: int = 0
    new_outcome_rows: int = 0
    sessions_emitted: int = 0  # label 1
    relabels: int = 0  # label 2+
    rows_written: int = 0
    pending_sessions: int = 0
    held_outcomes: int = 0
    drops: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    idle: bool = False  # nothing new and nothing due: no file, no commit


# ---------------------------------------------------------------------------------------------
# Splitting by partition: which Kafka partitions a builder owns
# ---------------------------------------------------------------------------------------------
class AssignmentError(RuntimeError):
    """This builder's partitions clash with the lake, its state, or another builder's; it does not start."""


@dataclass(frozen=True)
class Assignment:
    """The partitions one builder owns, of events and outcomes alike.

    Both topics are keyed by session_id, so with equal partition counts a session's events and
    its outcomes share a partition number and one builder sees all of a session. `stream` is the
    partition number of the episode files it writes: a partition it owns (the lowest of a static
    list, or `member`), so two builders with the same stream both own that partition, which the
    lake's partition records refuse (`claim_partitions`): episode file names never collide.
    """

    partitions: frozenset[int] = frozenset()  # a static list; empty: by member
    member: int = 0
    members: int = 1

    @classmethod
    def of(cls, cfg: EpisodesConfig) -> "Assignment":
        return cls(frozenset(cfg.partitions), cfg.member, cfg.members)

    @property
    def split(self) -> bool:
        return bool(self.partitions) or self.members > 1

    @property
    def stream(self) -> int:
        return min(self.partitions) if self.partitions else self.member

    def owns(self, partition: int) -> bool:
        return partition in self.partitions if self.partitions else partition % self.members == self.member

    def describe(self) -> str:
        if self.partitions:
            return "partitions " + ",".join(str(p) for p in sorted(self.partitions))
        return f"member {self.member} of {self.members}" if self.members > 1 else ALL_PARTITIONS


def check_partition_counts(root: str, declared: int) -> None:
    """Refuse a split over topics whose partition counts differ (a session's outcomes would reach another builder).

    The lake only shows the partitions that have files: with `declared` (the topics' count) a
    partition at or past it is the evidence; without, the highest partition of each table is.
    """
    seen = {t: {f.partition for f in lake.list_files(root, t)} for t in ("events", "outcomes")}
    if declared:
        over = {t: sorted(p for p in ps if p >= declared) for t, ps in seen.items()}
        if over["events"] or over["outcomes"]:
            raise AssignmentError(f"episodes: --partition-count {declared} but the lake holds files of partitions "
                                  f"{over} past it: the topics' counts differ or the declared count is wrong; "
                                  "a split needs events and outcomes with one partition count "
                                  "(`flywheel topics check`)")
        return
    if seen["events"] and seen["outcomes"] and max(seen["events"]) != max(seen["outcomes"]):
        raise AssignmentError(f"episodes: the lake's events span partitions 0..{max(seen['events'])} and its outcomes "
                              f"0..{max(seen['outcomes'])}: split by partition, a session's outcomes would reach "
                              "another builder than its events. Give both topics one partition count, run one "
                              "builder (no --partitions/--members), or, when the lake is only sparse so far, "
                              "declare the topics' count with --partition-count")


def claim_partitions(root: str, assignment: Assignment, partitions: Iterable[int]) -> None:
    """Record in the lake, once per partition, which assignment builds its episodes; refuse another's.

    Two builders owning one partition would both emit its sessions (duplicates the learner trains
    twice), and re-splitting a lake would hand a partition to a builder without its pending
    sessions and index. The record is the lake's create-once file (the one the lake writer's
    topic identity uses: exclusive on a local disk, a conditional PUT on S3).
    """
    mine = assignment.describe()
    names = {p: f"partition-{p:04d}" for p in sorted(partitions)}
    # every record read before any is made, so a refused builder leaves no partition recorded as its own
    holders = {p: lake.read_identity(root, "episodes", name) for p, name in names.items()}
    for p, name in sorted(names.items(), key=lambda item: holders[item[0]] in (None, mine)):
        holder = holders[p] or lake.stream_identity(root, "episodes", name, mine)  # a racing builder may win it here
        if holder != mine:
            raise AssignmentError(f"episodes: partition {p} is built by the builder with {holder!r}, not {mine!r}; "
                                  "two owners would emit its sessions twice. Run that assignment, or rebuild the "
                                  f"episodes table from scratch (delete lake/episodes, lake/{lake.CLAIMS_DIR}/episodes "
                                  "and every builder's state)")


# ---------------------------------------------------------------------------------------------
# Reading the lake
# ---------------------------------------------------------------------------------------------
def conform(table: "pa.Table", target: "pa.Schema") -> "pa.Table":
    """Select and cast to `target`, adding absent optional columns as nulls (older schema versions)."""
    import pyarrow as pa

    columns = []
    for f in target:
        if f.name in table.column_names:
            columns.append(table[f.name].cast(f.type))
        else:
            columns.append(pa.nulls(table.num_rows, f.type))
    return pa.Table.from_arrays(columns, schema=target)


def read_range(root: str, table: str, since: lake.Cursor, until: lake.Cursor, target: "pa.Schema",
               files: list[lake.LakeFile] | None = None) -> "pa.Table":
    """Rows of `table` with offsets in (since, until] per stream."""
    import pyarrow as pa
    import pyarrow.compute as pc

    parts = []
    for f in lake.files_since(root, table, since) if files is None else files:
        stop = until.get(f.key, -1)
        if f.first > stop:
            continue
        t = lake.rows_after_cursor(_read_columns(root, f, target.names), f, since)
        if f.last > stop:
            t = t.filter(pc.less_equal(t["_offset"], stop))
        parts.append(conform(t, target))
    return pa.concat_tables(parts) if parts else target.empty_table()


def _read_columns(root: str, f: lake.LakeFile, names: list[str]) -> "pa.Table":
    """One lake file, only the columns the builder uses (tool outputs and tags stay on disk). An unreadable
    file raises lake.LakeReadError and the builder stops before consuming it (lake.read_file's policy)."""
    return lake.read_file(root, f, names)


def plan_until(root: str, table: str, cursor: lake.Cursor, max_files: int, owns: Callable[[int], bool] = lambda p: True,
               full: bool = False) -> tuple[lake.Cursor, list[lake.LakeFile], int]:
    """The cursor after the next `max_files` new files of the owned partitions, those files, and how many
    remain after them.

    Listed by cursor (lake.files_since), so a pass costs what is new, not what the lake holds; `full` lists the
    whole table (a builder's first pass in its process). Each stream is followed for at most max_files + 1
    files: the pass takes no more, and one past them says that more remain (the count is then a lower bound).
    """
    files = lake.files_since(root, table, cursor, owns=owns, limit=max_files + 1, full=full)
    return lake.advance(cursor, files[:max_files]), files[:max_files], max(0, len(files) - max_files)


# ---------------------------------------------------------------------------------------------
# The emitted-session index (segments)
# ---------------------------------------------------------------------------------------------
def segment_schema() -> "pa.Schema":
    import pyarrow as pa

    return pa.schema([
        ("session_id", pa.string()),
        ("label_version", pa.int64()),  # 0: the session was not emitted (dropped or no llm_call)
        ("reason", pa.string()),
        ("task_type", pa.string()),
        ("end_ts", pa.timestamp("us", tz="UTC")),
        ("expires_ts", pa.timestamp("us", tz="UTC")),
        ("episode_file", pa.string()),  # lake path relative to the root: episodes/date=.../name
        ("outcomes", pa.string()),  # JSON list of every outcome applied so far
        # every event id the session was labelled with, so a re-sent copy counts as a duplicate, not as
        # a late event; null in segments written before the builder kept them
        ("event_ids", pa.list_(pa.string())),
    ])


def lookup_index(con: "duckdb.DuckDBPyConnection", store: StateStore, segments: list[str],
                 session_ids: set[str]) -> dict[str, dict[str, Any]]:
    """Latest index row of each given session found in the live segments."""
    import pyarrow as pa

    if not session_ids or not segments:
        return {}
    paths = [str(store.segment_path(s)) for s in segments]
    con.register("wanted", pa.table({"sid": sorted(session_ids)}))
    rows = con.sql(
        f"SELECT s.* FROM read_parquet({paths!r}, union_by_name = true) s JOIN wanted w ON s.session_id = w.sid "
        "QUALIFY row_number() OVER (PARTITION BY s.session_id ORDER BY s.label_version DESC) = 1"
    ).to_arrow_table().to_pylist()
    con.unregister("wanted")
    return {r["session_id"]: r for r in rows}


# ---------------------------------------------------------------------------------------------
# Outcome records
# ---------------------------------------------------------------------------------------------
def merge_outcomes(held: list[dict[str, Any]], new: list[dict[str, Any]], clock: dt.datetime
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """(held outcomes as records, new outcomes not seen before, how many new ones were duplicates).

    New rows are taken in lake order (topic, partition, offset), so the first copy of a replayed
    outcome wins; each is stamped `held_since` = the pass clock, which starts its unknown-session hold.
    """
    records = [outcome_py(o) for o in held]
    seen_ids = {o["outcome_id"] for o in records}
    fresh: list[dict[str, Any]] = []
    duplicates = 0
    for o in sorted(new, key=lambda o: (o["_topic"], o["_partition"], o["_offset"])):
        if o["outcome_id"] in seen_ids:
            duplicates += 1
            continue
        seen_ids.add(o["outcome_id"])
        fresh.append({k: o.get(k) for k in OUTCOME_KEEP} | {"held_since": clock})
    return records, fresh, duplicates


# ---------------------------------------------------------------------------------------------
# Routing: what a pass decides, from its inputs and its clock only (pure)
# ---------------------------------------------------------------------------------------------
@dataclass
class Routing:
    """Where everything a pass holds goes."""

    due: list[Due]  # by session id
    pending: set[str]  # sessions still open or waiting for outcomes: their events stay in the state
    relabel: dict[str, list[dict[str, Any]]]  # emitted session -> its new outcomes (label N+1)
    held: list[dict[str, Any]]  # outcomes kept for a later pass: of pending sessions, or of sessions not seen yet
    drops: Counter[str]  # by reason
    late_sessions: list[str]  # emitted sessions that got events they were not labelled with (late_event)
    expired: list[dict[str, Any]]  # outcomes of never-seen sessions past their hold (unknown_session)


def session_end(s: SessionEvents, clock: dt.datetime,
                join: reward_config.JoinSettings) -> tuple[dt.datetime, str] | None:
    """(when, how) a session ended, or None while it may still get events."""
    if s.ended:
        assert s.end_ts is not None, f"session {s.session_id} ended without an end ts"
        if clock - s.last_ts < dt.timedelta(seconds=join.end_grace_s):
            return None  # events from the other emitter (proxy vs SDK) may still be in flight
        return s.end_ts, "session_end"
    if clock - s.last_ts >= dt.timedelta(seconds=join.session_idle_timeout_s):
        return s.last_ts + dt.timedelta(seconds=join.session_idle_timeout_s), "idle_timeout"
    return None


def label_1_due(s: SessionEvents, outcomes: list[dict[str, Any]], clock: dt.datetime,
                rewards: reward_config.RewardConfig) -> Due | None:
    """Label 1 of a session if it is due at `clock`; None while it is open or waiting for outcomes."""
    end = session_end(s, clock, rewards.join)
    if end is None:
        return None
    end_ts, end_how = end
    task = rewards.task(s.task_type)
    whole = outcome_rewards.session_level(outcomes)
    due, closed = outcome_rewards.label_due(rewards, task, {o["kind"] for o in whole}, end_ts, clock)
    if not due:
        return None
    drop = None
    if outcome_rewards.score_outcomes(rewards, task, whole, closed).drop:
        drop = "missing_outcome"
    elif not s.llm_calls:
        drop = "no_llm_calls"
    return Due(s, outcomes, end_ts, end_how, closed, drop)


def outcome_fate(o: dict[str, Any], live: dict[str, list[dict[str, Any]]], index: dict[str, dict[str, Any]],
                 clock: dt.datetime, hold_s: float) -> str:
    """Where one outcome goes: "session" (a session not emitted yet), "relabel", "hold", or why it is dropped."""
    sid = o["session_id"]
    if sid in live:
        return "session"
    if sid in index:
        entry = index[sid]
        if o["outcome_id"] in {a["outcome_id"] for a in json.loads(entry["outcomes"])}:
            return "duplicate_outcome"
        if entry["label_version"] == 0:
            return "session_dropped"
        if clock > entry["expires_ts"]:
            return "too_late"
        return "relabel"
    if clock - o["held_since"] >= dt.timedelta(seconds=hold_s):
        return "unknown_session"
    return "hold"


def labelled_copies(events: list[dict[str, Any]], entry: dict[str, Any]) -> int:
    """How many of these events of an emitted session are copies of events it was labelled with.

    An index row written before the builder kept event ids (`event_ids` null) knows none: its
    session's events all count as late, as they did then.
    """
    known = set(entry.get("event_ids") or ())
    return sum(e["event_id"] in known for e in events)


def route(by_session: dict[str, list[dict[str, Any]]], index: dict[str, dict[str, Any]], outcomes: list[dict[str, Any]],
          clock: dt.datetime, rewards: reward_config.RewardConfig) -> Routing:
    """Decide a pass: the sessions labelled now, those left pending, the relabels, the outcomes held, the drops.

    `by_session`: the de-duplicated events (pending and new) of each session; `index`: the latest
    index row of every session among them, or among the outcomes', that was emitted before;
    `outcomes`: the held outcomes, then the new ones. Nothing here reads a clock or a file.
    """
    drops: Counter[str] = Counter()
    late: list[str] = []
    for sid in [sid for sid in by_session if sid in index]:
        copies = labelled_copies(by_session[sid], index[sid])
        if copies:
            drops["duplicate_event"] += copies
        if len(by_session[sid]) > copies:
            late.append(sid)
            drops["late_event"] += len(by_session[sid]) - copies
    live = {sid: events for sid, events in by_session.items() if sid not in index}
    outcomes_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
    relabel: dict[str, list[dict[str, Any]]] = defaultdict(list)
    held: list[dict[str, Any]] = []
    expired: list[dict[str, Any]] = []
    for o in outcomes:
        fate = outcome_fate(o, live, index, clock, rewards.join.unknown_session_hold_s)
        if fate == "session":
            outcomes_of[o["session_id"]].append(o)
        elif fate == "relabel":
            relabel[o["session_id"]].append(o)
        elif fate == "hold":
            held.append(o)
        else:
            drops[fate] += 1
            if fate == "unknown_session":
                expired.append(o)
    due: list[Due] = []
    pending: set[str] = set()
    for sid in sorted(live):
        d = label_1_due(assemble(sid, live[sid]), outcomes_of.get(sid, []), clock, rewards)
        if d is None:
            pending.add(sid)
            held.extend(outcomes_of.get(sid, []))
            continue
        if d.drop is not None:
            drops[f"session_{d.drop}"] += 1
        due.append(d)
    return Routing(due, pending, dict(relabel), held, drops, late, expired)


def lifetime_counters(previous: dict[str, int], drops: Counter[str], res: "PassResult") -> dict[str, int]:
    """The state's lifetime totals after a pass."""
    counters = Counter(previous)
    counters.update({f"dropped_{k}": v for k, v in drops.items() if v})
    counters.update({"sessions_emitted": res.sessions_emitted, "relabels": res.relabels,
                     "rows_written": res.rows_written, "event_rows_read": res.new_event_rows,
                     "outcome_rows_read": res.new_outcome_rows})
    return dict(counters)


# ---------------------------------------------------------------------------------------------
# The builder
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PassPlan:
    """What one pass reads and the clock it decides by."""

    intent: Intent
    resumed: bool  # the intent of a pass that did not commit: same input, same clock, same rows
    files: dict[str, list[lake.LakeFile] | None]  # per table, the files to read (None: list them again)


@dataclass
class Labelled:
    """A pass's output before it is written."""

    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # episode rows, in file order
    index_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # one per session labelled or dropped
    sessions: int = 0  # sessions emitted at label 1
    relabels: int = 0


class Builder:
    def __init__(self, cfg: EpisodesConfig, rewards: reward_config.RewardConfig) -> None:
        import duckdb
        import pyarrow as pa

        self.cfg = cfg
        self.rewards = rewards
        # first, before the state is read or cleaned up: a second builder on this state is refused here
        self.lock = StateLock(cfg.state_dir).acquire()
        try:
            self.store = StateStore(cfg.state_dir)
            self.con = duckdb.connect()
            self.con.execute("SET TimeZone='UTC'")
            self.judge = judge_mod.Judge(cfg.judge_url, cfg.judge_model or rewards.judge.model, rewards.judge,
                                         Path(cfg.state_dir) / "judge_cache",
                                         api_key=os.environ.get(cfg.judge_api_key_env))
            self.state = self.store.load()
            self.assignment = Assignment.of(cfg)
            self._check_assignment()
            self.store.cleanup(self.state)
            self.emitted = self._load_emitted()
        except BaseException:
            self.lock.release()  # a builder that failed to start must not keep the state locked
            raise
        self.labeller = Labeller(rewards, lambda: self.judge.model, cfg.lake_root)  # the judge in use when labelling
        self.judge_memo: dict[str, tuple[int | None, str]] = {}
        self.judged = judge_pass.JudgedPass()  # this pass's judge answers and the retry queue it commits
        self.backlog_files = 0  # lake files past this pass's input (catch-up progress)
        self.listed = False  # whether a pass of this process has listed the whole lake (plan_until's full)
        self.claimed: set[int] = set()  # partitions this process has recorded as its own in the lake
        full = schema.event_arrow_schema()
        judging = any(t.judge for t in rewards.task_types.values())
        self.event_schema = pa.schema([full.field(n) for n in EVENT_COLUMNS_USED + JUDGE_EVENT_COLUMNS * judging])
        self.outcome_schema = schema.outcome_arrow_schema()
        self.episode_schema = schema.episode_arrow_schema()

    def close(self) -> None:
        """Release the state (its lock) and the DuckDB connection; the builder is unusable after."""
        self.con.close()
        self.lock.release()

    def __enter__(self) -> "Builder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_assignment(self) -> None:
        """Refuse a state of other partitions and, split, topics of unequal partition counts (before any cleanup)."""
        mine = self.assignment.describe()
        if self.state.assignment not in (None, mine):
            raise AssignmentError(
                f"episodes: state dir {self.cfg.state_dir} holds the cursors, pending sessions and index of "
                f"{self.state.assignment!r}, this builder was given {mine!r}; a state cannot change its partitions. "
                "Restart it with that assignment, or give this one its own --state-dir (see docs/rewards.md)")
        if self.assignment.split:
            check_partition_counts(self.cfg.lake_root, self.cfg.partition_count)

    def _claim(self, intent: Intent) -> None:
        """Record the partitions a plan reads as this builder's before any of their rows is consumed."""
        parts = {int(key.rsplit("/", 1)[1]) for key in (*intent.events_until, *intent.outcomes_until)}
        foreign = sorted(p for p in parts if not self.assignment.owns(p))
        if foreign:  # only the intent of a killed first pass, resumed under another assignment, can hold them
            raise AssignmentError(f"episodes: the pass in flight in {self.cfg.state_dir} reads partitions {foreign}, "
                                  f"which {self.assignment.describe()!r} does not own; restart with the assignment "
                                  "it was started with")
        claim_partitions(self.cfg.lake_root, self.assignment, parts - self.claimed)
        self.claimed |= parts

    def _load_emitted(self) -> set[int]:
        """Hashes of every session in the live index: read once per process, then kept up to date.

        A hash collision only costs one extra index lookup; Python's per-process string hash is
        fine because the set never leaves the process.
        """
        if not self.state.segments:
            return set()
        paths = [str(self.store.segment_path(s)) for s in self.state.segments]
        ids = self.con.sql(f"SELECT DISTINCT session_id FROM read_parquet({paths!r})").to_arrow_table()
        return {hash(sid) for sid in ids.column(0).to_pylist()}

    # -- one pass ---------------------------------------------------------------------------------
    def run_pass(self, now: dt.datetime | None = None) -> PassResult:
        """One pass: plan, merge, route, label, commit (see the module docstring); idle when nothing changed."""
        t0 = time.perf_counter()
        st = self.state
        plan = self._plan(now)
        self._claim(plan.intent)
        intent = plan.intent
        clock = schema.parse_ts(intent.now)
        res = PassResult(st.pass_no + 1)
        new_events, new_outcomes = self._read(plan)
        res.new_event_rows, res.new_outcome_rows = new_events.num_rows, new_outcomes.num_rows
        has_pending = st.pending is not None and st.pending.num_rows > 0
        # files of zero rows (ranges whose records were all dead-lettered) still move the cursor: a pass that read
        # only those commits it, or every later pass would read them again (and stall behind max_files_per_pass of them)
        moved = intent.events_until != st.events_cursor or intent.outcomes_until != st.outcomes_cursor
        if not plan.resumed and not new_events.num_rows and not new_outcomes.num_rows and not has_pending \
                and not st.held_outcomes and not judge_pass.due_retries(st.judge_retry, clock) and not moved:
            return self._idle(res, t0)
        if not plan.resumed:
            self.store.save_intent(intent)

        drops: Counter[str] = Counter()
        events, dup_events = self._merge_events(new_events)
        drops["duplicate_event"] += dup_events
        held, fresh, dup_outcomes = merge_outcomes(st.held_outcomes, new_outcomes.to_pylist(), clock)
        drops["duplicate_outcome"] += dup_outcomes
        by_session = self._group(events)
        index = self._emitted_before(by_session, new_events, fresh)
        routing = route(by_session, index, held + fresh, clock, self.rewards)
        drops.update(routing.drops)
        self._log_route_drops(routing)
        labelled = self._label(routing, index, clock, plan.resumed)
        res.sessions_emitted, res.relabels = labelled.sessions, labelled.relabels
        res.pending_sessions, res.held_outcomes = len(routing.pending), len(routing.held)

        if not plan.resumed and not (res.new_event_rows or res.new_outcome_rows or labelled.rows or labelled.index_rows
                                     or any(drops.values())) and len(routing.held) == len(held) \
                and self.judged.queue == st.judge_retry and not moved:
            # waiting sessions, nothing changed: no new generation for a pass that decided nothing
            self.store.clear_intent()
            return self._idle(res, t0)
        self._commit(intent, clock, labelled, drops, self._pending_table(events, routing.pending), routing.held, res)
        res.drops = {k: v for k, v in drops.items() if v}
        res.seconds = time.perf_counter() - t0
        return res

    @staticmethod
    def _idle(res: PassResult, t0: float) -> PassResult:
        res.idle = True
        res.seconds = time.perf_counter() - t0
        return res

    # -- plan -------------------------------------------------------------------------------------
    def _plan(self, now: dt.datetime | None) -> PassPlan:
        """The next files past each cursor and the clock (`now` or the wall clock), or the plan of a pass
        that did not commit."""
        st = self.state
        intent = self.store.load_intent()
        if intent is not None and intent.base_pass == st.pass_no:
            log.info("pass %d: resuming the plan of a pass that did not commit (same input, same clock)",
                     st.pass_no + 1)
            return PassPlan(intent, resumed=True, files={"events": None, "outcomes": None})
        clock = now or dt.datetime.now(dt.timezone.utc)
        max_files = self.cfg.max_files_per_pass
        owns = self.assignment.owns
        # the first passes of a process list the whole tables (files the claim chain cannot reach: written before every
        # file was claimed) until one leaves nothing behind; a capped full pass that handed the rest to the chain would
        # stop at the first unclaimed file, and an empty answer from the chain reads as "nothing new"
        full = not self.listed
        events_until, event_files, events_left = plan_until(self.cfg.lake_root, "events", st.events_cursor, max_files,
                                                            owns, full)
        outcomes_until, outcome_files, outcomes_left = plan_until(self.cfg.lake_root, "outcomes", st.outcomes_cursor,
                                                                  max_files, owns, full)
        self.backlog_files = events_left + outcomes_left
        self.listed = self.listed or not self.backlog_files
        intent = Intent(
            base_pass=st.pass_no,
            now=clock.isoformat(),
            events_until=events_until,
            outcomes_until=outcomes_until,
            first_seq=st.next_seq,
        )
        return PassPlan(intent, resumed=False, files={"events": event_files, "outcomes": outcome_files})

    def _read(self, plan: PassPlan) -> tuple["pa.Table", "pa.Table"]:
        """The event and outcome rows between the committed cursors and the plan's."""
        st, root = self.state, self.cfg.lake_root
        events = read_range(root, "events", st.events_cursor, plan.intent.events_until, self.event_schema,
                            plan.files["events"])
        outcomes = read_range(root, "outcomes", st.outcomes_cursor, plan.intent.outcomes_until, self.outcome_schema,
                              plan.files["outcomes"])
        return events, outcomes

    # -- merge ------------------------------------------------------------------------------------
    def _merge_events(self, new_events: "pa.Table") -> tuple["pa.Table", int]:
        import pyarrow as pa

        pending = self.state.pending if self.state.pending is not None else self.event_schema.empty_table()
        both = pa.concat_tables([conform(pending, self.event_schema), new_events])
        if not both.num_rows:
            return both, 0
        # an explicit row number: pending rows come first, so a replayed copy never displaces the original
        numbered = both.append_column("_rn", pa.array(range(both.num_rows), pa.int64()))
        self.con.register("ev_all", numbered)
        deduped = self.con.sql(
            "SELECT * EXCLUDE (_rn) FROM ev_all "
            "QUALIFY row_number() OVER (PARTITION BY event_id ORDER BY _rn) = 1 ORDER BY _rn"
        ).to_arrow_table()
        self.con.unregister("ev_all")
        deduped = conform(deduped, self.event_schema)
        return deduped, both.num_rows - deduped.num_rows

    @staticmethod
    def _group(events: "pa.Table") -> dict[str, list[dict[str, Any]]]:
        import pyarrow as pa

        # timestamps as integer microseconds: building tz-aware datetimes is most of to_pylist's cost
        i = events.schema.get_field_index("ts")
        events = events.set_column(i, "ts", events["ts"].cast(pa.int64())).drop(["_offset"])
        out: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for e in events.to_pylist():
            out[e["session_id"]].append(e)
        return out

    # -- route (its input from the index) ---------------------------------------------------------
    def _emitted_before(self, by_session: dict[str, list[dict[str, Any]]], new_events: "pa.Table",
                        fresh: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Index rows of the sessions this pass touches that were emitted before (pending ones were not:
        not looked up)."""
        st = self.state
        pending_ids = set(st.pending.column("session_id").to_pylist()) if st.pending is not None else set()
        new_event_sids = set(new_events.column("session_id").to_pylist())
        unknown = (new_event_sids - pending_ids) | {o["session_id"] for o in fresh if o["session_id"] not in by_session}
        # only sessions the in-memory filter knows are looked up, so a pass never scans the whole index
        return lookup_index(self.con, self.store, st.segments, {sid for sid in unknown if hash(sid) in self.emitted})

    def _log_route_drops(self, routing: Routing) -> None:
        if routing.drops.get("duplicate_event"):
            log.info("episodes: %d re-sent copies of events of sessions already labelled; dropped (duplicate_event)",
                     routing.drops["duplicate_event"])
        for sid in routing.late_sessions:
            log.warning("episodes: events arrived for session %s after it was labelled without them; dropped "
                        "(late_event)", sid)
        for o in routing.expired:
            log.warning("episodes: outcome %s for unknown session %s held %.0fs; dropped (unknown_session)",
                        o["outcome_id"], o["session_id"], self.rewards.join.unknown_session_hold_s)

    # -- label ------------------------------------------------------------------------------------
    def _label(self, routing: Routing, index: dict[str, dict[str, Any]], clock: dt.datetime, resumed: bool) -> Labelled:
        """Rewards for the routed sessions: label 1 of the due ones, label N+1 of the relabelled ones."""
        out = Labelled()
        # a re-run of this intent reuses the judge answers (failures included) its killed attempt
        # recorded, so it writes the same rows as the attempt a reader may already have seen
        self.judge_memo = self.store.load_judge_memo() if resumed else {}
        self.judged = judge_pass.judge_pass([d.session for d in routing.due if d.drop is None], self.state.judge_retry,
                                            self.rewards, self.judge, self.judge_memo, clock)
        for due in routing.due:
            rows, index_row = self.labeller.label_one(due, self.judged.judged.get(due.session.session_id))
            out.rows.extend(rows)
            out.index_rows.append(index_row)
            out.sessions += bool(rows)
        retried = self.judged.retried  # queued sessions the judge scored now: a new label, with a late outcome's if any
        entries = index | lookup_index(self.con, self.store, self.state.segments, set(retried) - set(index))
        for sid in sorted(set(routing.relabel) | (set(retried) & set(entries))):
            rows, index_row = self.labeller.relabel(entries[sid], routing.relabel.get(sid, []), clock, retried.get(sid))
            out.rows.extend(rows)
            out.index_rows.append(index_row)
            out.relabels += 1
        return out

    # -- commit -----------------------------------------------------------------------------------
    def _commit(self, intent: Intent, clock: dt.datetime, labelled: Labelled, drops: Counter[str], pending: "pa.Table",
                held: list[dict[str, Any]], res: PassResult) -> None:
        """Write the pass's output, then commit: judge answers, episode file, index segment, new generation.

        The order is the crash safety (rewards/state.py): whatever the new generation names is on
        disk before CURRENT names it, and each file's name comes from the intent, so a re-run of a
        pass killed anywhere in here rewrites the same files with the same rows.
        """
        if self.judge_memo:
            self.store.save_judge_memo(self.judge_memo)
        episode_rel = self._write_episodes(intent.first_seq, clock, labelled.rows)
        res.rows_written = len(labelled.rows)
        segments, retired = self._write_segment(res.pass_no, labelled.index_rows, episode_rel, clock)
        new_state = BuilderState(
            pass_no=res.pass_no,
            next_seq=intent.first_seq + len(labelled.rows),
            events_cursor=intent.events_until,
            outcomes_cursor=intent.outcomes_until,
            held_outcomes=[outcome_json(o) for o in sorted(held, key=lambda o: o["outcome_id"])],
            segments=segments,
            counters=lifetime_counters(self.state.counters, drops, res),
            pending=pending,
            assignment=self.assignment.describe(),
            judge_retry=self.judged.queue,
        )
        self.store.commit(new_state, retired)
        self.state = new_state
        self.emitted.update(hash(r["session_id"]) for r in labelled.index_rows)

    def _write_episodes(self, first_seq: int, clock: dt.datetime, rows: list[dict[str, Any]]) -> str:
        """The pass's episode file, named by its rows' sequence numbers; its lake path ("" when there are no rows)."""
        import pyarrow as pa

        if not rows:
            return ""
        first, last = first_seq, first_seq + len(rows) - 1
        table = pa.Table.from_pylist([r | {"emitted_ts": clock} for r in rows], schema=self.episode_schema)
        # each builder numbers its own rows: its stream (a partition it owns) keeps the names of two builders apart
        written = lake.write_file(self.cfg.lake_root, "episodes", clock.date().isoformat(), SOURCE,
                                  self.assignment.stream, first, last, table)
        return f"episodes/date={written.date}/{Path(written.path).name}"

    def _write_segment(self, pass_no: int, index_rows: list[dict[str, Any]], episode_rel: str,
                       clock: dt.datetime) -> tuple[list[str], list[str]]:
        """The pass's index segment (merged with the live ones once there are SEGMENT_COMPACT_AT):
        (live segments, retired)."""
        import pyarrow as pa

        segments = list(self.state.segments)
        if not index_rows:
            return segments, []
        rows = [r | {"episode_file": episode_rel if r["label_version"] > 0 else ""} for r in index_rows]
        seg_table = pa.Table.from_pylist(rows, schema=segment_schema())
        retired: list[str] = []
        if len(segments) + 1 > SEGMENT_COMPACT_AT:
            seg_table, retired = self._compact_segments(segments, seg_table, clock), segments
            segments = []
        name = f"seg-{pass_no:012d}.parquet"
        self.store.write_segment(name, seg_table)
        return segments + [name], retired

    def _compact_segments(self, segments: list[str], current: "pa.Table", clock: dt.datetime) -> "pa.Table":
        """Merge the live segments (latest row per session, unexpired) with this pass's rows."""
        import pyarrow as pa

        paths = [str(self.store.segment_path(s)) for s in segments]
        self.con.register("cur", current)
        merged = self.con.sql(
            f"SELECT * FROM (SELECT * FROM read_parquet({paths!r}, union_by_name = true) "
            "UNION ALL BY NAME SELECT * FROM cur) "
            f"WHERE expires_ts > TIMESTAMPTZ '{clock.isoformat()}' "
            "QUALIFY row_number() OVER (PARTITION BY session_id ORDER BY label_version DESC) = 1 ORDER BY session_id"
        ).to_arrow_table()
        self.con.unregister("cur")
        return (conform(merged, segment_schema()) if merged.num_rows
                else pa.Table.from_pylist([], schema=segment_schema()))

    def _pending_table(self, events: "pa.Table", keep: set[str]) -> "pa.Table":
        import pyarrow as pa
        import pyarrow.compute as pc

        if not keep or not events.num_rows:
            return self.event_schema.empty_table()
        return events.filter(pc.is_in(events["session_id"], value_set=pa.array(sorted(keep), pa.string())))

    # -- status heartbeat -------------------------------------------------------------------------
    def status(self, res: PassResult | None) -> dict[str, Any]:
        st = self.state
        return {
            "assignment": self.assignment.describe(),
            "pass": st.pass_no,
            "rows_total": st.next_seq,
            "pending_sessions": res.pending_sessions if res else None,
            "held_outcomes": len(st.held_outcomes),
            "judge_calls": self.judge.calls,
            "judge_failures": self.judge.failures,
            "judge_retry_queue": len(st.judge_retry),
            "last_pass_s": round(res.seconds, 3) if res else None,
            "backlog_files": self.backlog_files,
            **st.counters,
        }


# ---------------------------------------------------------------------------------------------
# Prometheus
# ---------------------------------------------------------------------------------------------
PASS_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class EpisodesMetrics:
    """flywheel_episodes_*: the state's lifetime counters and the last pass's gauges, read at scrape; pass durations."""

    def __init__(self, builder: Builder) -> None:
        self.builder = builder
        self.last: PassResult | None = None
        self.metrics = Metrics("episodes")
        self.pass_seconds = self.metrics.histogram("pass_duration", "seconds", "passes that read or labelled something",
                                                   PASS_BUCKETS_S)
        self.metrics.read(self.readings)

    def observe(self, res: PassResult) -> None:
        self.last = res
        if not res.idle:
            self.pass_seconds.observe(res.seconds)

    def readings(self) -> list[Reading]:
        b, c = self.builder, dict(self.builder.state.counters)
        drops = {k[len("dropped_"):]: v for k, v in c.items() if k.startswith("dropped_")}
        return [
            Reading("counter", "written", "episodes", "episode rows written (every label version)",
                    c.get("rows_written", 0)),
            Reading("counter", "labelled", "sessions", "sessions given their first label",
                    c.get("sessions_emitted", 0)),
            Reading("counter", "relabelled", "sessions", "sessions labelled again (a later outcome)",
                    c.get("relabels", 0)),
            Reading("counter", "read_event", "rows", "event rows read from the lake", c.get("event_rows_read", 0)),
            Reading("counter", "read_outcome", "rows", "outcome rows read from the lake",
                    c.get("outcome_rows_read", 0)),
            Reading("counter", "dropped", "records", "events, outcomes and sessions skipped, by reason",
                    drops, "reason"),
            Reading("counter", "judge", "calls", "LLM judge calls", b.judge.calls),
            Reading("counter", "judge_failed", "calls", "LLM judge calls that failed", b.judge.failures),
            Reading("gauge", "pending", "sessions", "sessions open or waiting for outcomes (NaN before the first pass)",
                    self.last.pending_sessions if self.last else float("nan")),
            Reading("gauge", "held", "outcomes", "outcomes kept for a later pass", len(b.state.held_outcomes)),
            Reading("gauge", "backlog", "files", "lake files past the last pass's input", b.backlog_files),
            Reading("counter", "committed", "passes", "passes committed to this state", b.state.pass_no),
        ]


# ---------------------------------------------------------------------------------------------
# Process entry points
# ---------------------------------------------------------------------------------------------
def heartbeat_name(assignment: Assignment) -> str:
    """`episodes` for the one builder; a split one's heartbeat carries its stream so builders do not overwrite it."""
    return f"episodes-{assignment.stream}" if assignment.split else "episodes"


def run(cfg: EpisodesConfig, rewards: reward_config.RewardConfig | None = None,
        stop: Callable[[], bool] | None = None) -> int:
    """Catch up with the lake (or follow it) until caught up, SIGTERM, or `stop()` (the demo runs it in a thread)."""
    rewards = rewards or reward_config.load(cfg.rewards_toml)
    log.info("episodes: rewards config %s (digest %s), %d outcome kinds, %d task types",
             rewards.source, rewards.digest, len(rewards.outcomes), len(rewards.task_types))
    with Builder(cfg, rewards) as builder:  # takes the state dir's lock before anything is written there
        write_resolved(cfg, Path(cfg.state_dir) / "episodes-config.toml")
        log.info("episodes: state %s at pass %d (%d rows written so far), lake %s, %s (episode stream %d)",
                 cfg.state_dir, builder.state.pass_no, builder.state.next_seq, cfg.lake_root,
                 builder.assignment.describe(), builder.assignment.stream)
        if any(t.judge for t in rewards.task_types.values()):
            log.info("episodes: LLM judge on for %s via %s model %s (output %s, API key %s)",
                     {t.name: {"weight": rewards.judge_weight(t), "sample": t.judge_sample}
                      for t in rewards.task_types.values() if t.judge},
                     cfg.judge_url, builder.judge.model, rewards.judge.output,
                     "set" if os.environ.get(cfg.judge_api_key_env) else f"not set (${cfg.judge_api_key_env})")
        metrics = EpisodesMetrics(builder)
        metrics.metrics.serve(cfg.metrics_port)
        try:
            passes = _pass_loop(builder, cfg, stop, metrics)
        finally:
            metrics.metrics.close()
        log.info("episodes: stopped after %d passes; %d rows in the episodes table", passes, builder.state.next_seq)
    return 0


def _pass_loop(builder: Builder, cfg: EpisodesConfig, stop: Callable[[], bool] | None,
               metrics: EpisodesMetrics | None = None) -> int:
    """Passes until caught up (or, following, until SIGTERM or `stop()`); how many ran."""
    stop_flag = stop_on_signals("finishing the pass in hand, then exiting", signals=(signal.SIGTERM,))
    passes = 0
    last_status = 0.0
    while not stop_flag.is_set() and not (stop is not None and stop()):
        res = builder.run_pass()
        passes += 1
        if metrics is not None:
            metrics.observe(res)
        if not res.idle:
            log.info("pass %d: read %d events, %d outcomes; labelled %d sessions, %d relabels, %d rows; "
                     "%d sessions pending, %d outcomes held; drops %s; %.2fs; %d lake files to go",
                     res.pass_no, res.new_event_rows, res.new_outcome_rows, res.sessions_emitted, res.relabels,
                     res.rows_written, res.pending_sessions, res.held_outcomes, res.drops or "none", res.seconds,
                     builder.backlog_files)
        if not res.idle or time.monotonic() - last_status > 5:
            write_status(heartbeat_name(builder.assignment), builder.status(res), cfg.var_dir)
            last_status = time.monotonic()
        caught_up = res.idle or (res.new_event_rows == 0 and res.new_outcome_rows == 0)
        if caught_up:
            if not cfg.follow:
                break
            time.sleep(cfg.poll_interval_s)
    return passes


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(EpisodesConfig, argv, "flywheel episodes")
    setup_logging(cfg.log_level)
    try:
        rewards = reward_config.load(cfg.rewards_toml)
    except reward_config.RewardConfigError as exc:
        log.error("episodes: %s", exc)
        return 2
    try:
        return run(cfg, rewards)
    except (LakeReadError, StateLockedError, AssignmentError) as exc:
        log.error("%s", exc)
        return 1
