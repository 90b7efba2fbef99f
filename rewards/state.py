"""Durable state of the episode builder, and how a pass commits it.

    <state_dir>/CURRENT                  name of the committed generation, replaced atomically
    <state_dir>/gen-<pass>/state.json     cursors, next row sequence, held outcomes, live segments, counters,
                                         and the partitions they are of (the builder's assignment)
    <state_dir>/gen-<pass>/pending.parquet events of sessions not yet emitted (lake event schema)
    <state_dir>/intent.json              the plan of the pass in flight: its input range, clock and first row seq
    <state_dir>/intent-judge.json        the judge answers of the pass in flight, written before its episode file
    <state_dir>/segments/seg-<pass>.parquet  index of emitted sessions (label, episode file, outcomes, event ids),
                                         immutable
    <state_dir>/LOCK                     flock held by the one builder using this state; holds its pid

Crash safety: a pass first writes its intent (input range = cursor after, `now`, first row
sequence number), then its episode file (name fixed by the intent's sequence numbers) and its
index segment, and only then commits the new generation by replacing CURRENT. A builder killed
anywhere re-runs the same intent from the same committed generation, so it rewrites the same
file names with the same rows: the episodes table ends up as a clean run's, nothing lost,
nothing duplicated. Judge answers are the one input from outside the lake: the pass records
them (failures included) before it writes its episode file, and a re-run uses that record, so
the rewritten file holds the same rewards as the one a reader may already have read.

One builder per state directory: a second one would clean up the first one's generation in
flight and commit over it. `StateLock` takes an exclusive `fcntl.flock` on `<state_dir>/LOCK` for
the builder's life; the kernel drops it when the process dies, SIGKILL included, so a restarted
builder never waits for a stale lock.

A state belongs to one assignment (rewards/builder.py: the partitions a builder owns): its cursors,
pending sessions and index are of those partitions, so a builder with another assignment refuses
it rather than read partitions it has no history of. A builder split off the lake is taken over by
restarting it with the same assignment on the same state directory: it resumes from its cursor.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.base.atomic import (
    Durability,
    publish,
    temp_path,
    write_json,
    write_text,
    write_with,
)
from flywheel.ingest import lake

if TYPE_CHECKING:
    import pyarrow as pa


ALL_PARTITIONS = "all partitions"  # the assignment of a builder that does not split the lake


class StateLockedError(RuntimeError):
    """Another builder holds this state directory."""


class StateLock:
    """An exclusive flock on `<state_dir>/LOCK`, held from `acquire` until `release` or the process's end."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / "LOCK"
        self._fd: int | None = None

    def acquire(self) -> "StateLock":
        """Take the lock or raise StateLockedError naming the state dir and, when it wrote it, the holder's pid."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise StateLockedError(
                f"episodes: state dir {self.path.parent} is in use by another episode builder (pid {holder}, lock "
                f"{self.path}); two builders on one state would overwrite each other's passes. Stop that one, "
                "or give this one its own --state-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message above; the flock is the lock
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


@dataclass
class BuilderState:
    pass_no: int = 0
    next_seq: int = 0  # first row sequence number of the next episode file
    events_cursor: lake.Cursor = field(default_factory=dict)
    outcomes_cursor: lake.Cursor = field(default_factory=dict)
    held_outcomes: list[dict[str, Any]] = field(default_factory=list)  # outcomes of pending or unknown sessions
    segments: list[str] = field(default_factory=list)  # live index segment file names
    counters: dict[str, int] = field(default_factory=dict)  # lifetime totals (emitted, dropped by reason ...)
    pending: "pa.Table | None" = None  # events of sessions not emitted yet
    # the partitions whose cursors, pending sessions and index these are (Assignment.describe); None: a fresh state
    assignment: str | None = None
    # sessions whose judge failed retryably (timeout, unavailable, budget), retried on later passes (rewards/builder.py)
    judge_retry: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "pass_no": self.pass_no,
            "next_seq": self.next_seq,
            "events_cursor": self.events_cursor,
            "outcomes_cursor": self.outcomes_cursor,
            "held_outcomes": self.held_outcomes,
            "segments": self.segments,
            "counters": self.counters,
            "assignment": self.assignment,
            "judge_retry": self.judge_retry,
        }


@dataclass(frozen=True)
class Intent:
    base_pass: int  # the committed generation this plan starts from
    now: str  # the pass's clock (ISO UTC): every time-based decision of the pass uses it
    events_until: lake.Cursor  # consume event rows up to these offsets
    outcomes_until: lake.Cursor
    first_seq: int

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


class StateStore:
    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        self.segments_dir = self.dir / "segments"

    def gen_dir(self, pass_no: int) -> Path:
        return self.dir / f"gen-{pass_no:012d}"

    def segment_path(self, name: str) -> Path:
        return self.segments_dir / name

    def load(self) -> BuilderState:
        import pyarrow.parquet as pq

        try:
            current = (self.dir / "CURRENT").read_text().strip()
        except FileNotFoundError:
            return BuilderState()
        gen = self.dir / current
        record = json.loads((gen / "state.json").read_text())
        record.setdefault("assignment", ALL_PARTITIONS)  # written before builders split the lake: it owned them all
        state = BuilderState(**record)
        pending = gen / "pending.parquet"
        state.pending = pq.read_table(pending) if pending.exists() else None
        return state

    def load_intent(self) -> Intent | None:
        try:
            return Intent(**json.loads((self.dir / "intent.json").read_text()))
        except FileNotFoundError:
            return None

    def save_intent(self, intent: Intent) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json(self.dir / "intent.json", intent.to_json(), Durability.DURABLE, sort_keys=True)

    def clear_intent(self) -> None:
        for name in ("intent.json", "intent-judge.json"):
            try:
                (self.dir / name).unlink()
            except FileNotFoundError:
                pass

    def load_judge_memo(self) -> dict[str, tuple[int | None, str]]:
        """Judge answers recorded by the in-flight intent (empty when it wrote none)."""
        try:
            return {k: (v[0], v[1]) for k, v in json.loads((self.dir / "intent-judge.json").read_text()).items()}
        except FileNotFoundError:
            return {}

    def save_judge_memo(self, memo: dict[str, tuple[int | None, str]]) -> None:
        write_json(self.dir / "intent-judge.json", {k: list(v) for k, v in memo.items()}, Durability.DURABLE,
                   sort_keys=True)

    def write_segment(self, name: str, table: "pa.Table") -> None:
        import pyarrow.parquet as pq

        # durable: a committed generation names this segment, so its bytes must be on disk first
        write_with(self.segment_path(name), lambda tmp: pq.write_table(table, tmp), Durability.DURABLE)

    def commit(self, state: BuilderState, retired_segments: list[str]) -> None:
        """Publish `state` as the committed generation, then clear the intent and old files."""
        import pyarrow.parquet as pq

        gen = self.gen_dir(state.pass_no)
        if gen.exists():  # left by a pass killed before its commit
            shutil.rmtree(gen)
        tmp = temp_path(gen)  # .gen-<pass>.<hex>.tmp: removed with old generations below
        tmp.mkdir(parents=True)
        (tmp / "state.json").write_text(json.dumps(state.to_json(), sort_keys=True))
        if state.pending is not None and state.pending.num_rows:
            pq.write_table(state.pending, tmp / "pending.parquet")
        publish(tmp, gen, Durability.DURABLE)
        previous = None
        try:
            previous = (self.dir / "CURRENT").read_text().strip()
        except FileNotFoundError:
            pass
        write_text(self.dir / "CURRENT", gen.name, Durability.DURABLE_DIR)  # the commit point
        self.clear_intent()
        if previous and previous != gen.name:
            shutil.rmtree(self.dir / previous, ignore_errors=True)
        for name in retired_segments:
            try:
                self.segment_path(name).unlink()
            except FileNotFoundError:
                pass

    def cleanup(self, state: BuilderState) -> None:
        """Remove what a killed pass left behind: temp dirs, superseded generations, unreferenced segments."""
        if not self.dir.exists():
            return
        current = self.gen_dir(state.pass_no).name
        for path in self.dir.iterdir():
            if path.name.startswith(".gen-") or (path.name.startswith("gen-") and path.name != current):
                shutil.rmtree(path, ignore_errors=True)
        if self.segments_dir.exists():
            live = set(state.segments)
            for path in self.segments_dir.iterdir():
                if path.name not in live:
                    path.unlink(missing_ok=True)
