"""The SDK's on-disk spill spool: an append-only, bounded, segmented FIFO of encoded records.

When the broker is down or slow, the SDK's background thread appends encoded events here
instead of holding them in memory; when the broker answers again it replays them from the
head, in the order they were written, and only advances the head after Kafka acknowledged
them. A crash between send and commit replays a record twice, which is fine: every event
carries an event_id, and the lake writer drops a copy whose event_id landed in the same
partition within its window (`dedup_window` rows, 100,000 by default; docs/lake.md); a
later copy lands, and readers that need exactness de-duplicate by event_id.

Layout of a spool directory:

    000000000001.seg  000000000002.seg ...   records, one per line (JSON text never holds a raw newline)
    head.json                                {"segment": N, "offset": BYTES}: the next record to replay
    lock                                     flock'ed by the one process that owns the directory
    owner.json                               {"name": ..., "topic": ...}: whose records these are (written at
                                             creation by the SDK; another logger never adopts them)

Bounded: when the segments together exceed `max_bytes`, the OLDEST segment is deleted and its
unreplayed records are counted as dropped (the caller logs and reports them); the newest data
is kept because it is what the learner wants most. Stdlib only (the SDK's import path).

Durability: every append is written into the OS (it survives a crash or SIGKILL of the process);
it is fsynced in batches, once `sync_records` records or `sync_interval_s` seconds have gathered
since the last fsync (checked on each append and by `maybe_sync()`, which the SDK calls every
cycle), and at close. A power loss therefore loses at most the last `sync_interval_s` seconds or
`sync_records` records of spooled data (as long as the caller calls `maybe_sync()` at least that
often). A new segment's directory entry is fsynced when it is created. head.json is written without
fsync: after a power loss it may point earlier, which replays records again (duplicates, never a
loss), or past the data that survived (it can reach the disk before the tail's fsync): the head is
then clamped to the end of that segment, which holds only records replayed already.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from flywheel.base.atomic import Durability, fsync_path, write_json

SEGMENT_SUFFIX = ".seg"
SYNC_INTERVAL_S = 0.5  # the power-loss window of spooled records, in time ...
SYNC_RECORDS = 5000  # ... and in records (a burst reaches this long before the interval)
OWNER_FILE = "owner.json"


def read_owner(directory: str | Path) -> dict[str, str] | None:
    """The owner marker of a spool directory ({"name", "topic"}), or None when it has none (or it is unreadable)."""
    try:
        owner = json.loads((Path(directory) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return {str(k): str(v) for k, v in owner.items()} if isinstance(owner, dict) else None


class SpoolLocked(RuntimeError):
    """Another live process owns this spool directory."""


@dataclass
class _Segment:
    index: int
    path: Path
    size: int  # bytes on disk
    records: int  # records in the whole file


class Spool:
    """A FIFO of byte records on disk. Single-threaded: the SDK's background thread owns it."""

    def __init__(self, directory: str | Path, max_bytes: int = 256 * 1024 * 1024, segment_bytes: int = 8 * 1024 * 1024,
                 sync_interval_s: float = SYNC_INTERVAL_S, sync_records: int = SYNC_RECORDS,
                 owner: dict[str, str] | None = None) -> None:
        assert segment_bytes * 2 <= max_bytes, \
            f"segment_bytes {segment_bytes} must be at most half of max_bytes {max_bytes}"
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.sync_interval_s = sync_interval_s
        self.sync_records = sync_records
        self._unsynced = 0  # records written into the OS since the last fsync
        self._unsynced_since = 0.0  # monotonic time of the oldest of them
        self.syncs = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fh = open(self.directory / "lock", "a+")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._lock_fh.close()
            raise SpoolLocked(f"spool {self.directory} is owned by another process") from exc
        if owner is not None and read_owner(self.directory) is None:
            # fsynced with its directory entry: a marker lost to a power cut would leave a spool nobody adopts
            write_json(self.directory / OWNER_FILE, owner, Durability.DURABLE_DIR)
        self._segments: list[_Segment] = []
        self._head_segment = 0
        self._head_offset = 0
        self._head_consumed = 0  # records of the head segment before _head_offset
        self._writer: BinaryIO | None = None  # open append handle of the tail segment
        self._peeked: list[tuple[int, int]] = []  # (segment index, offset after the record) per peeked record
        self._load()

    # ---------------------------------------------------------------- state on disk
    def _load(self) -> None:
        for path in sorted(self.directory.glob(f"*{SEGMENT_SUFFIX}")):
            try:
                index = int(path.stem)
            except ValueError:
                continue
            data = path.read_bytes()
            complete = data.rfind(b"\n") + 1
            if complete < len(data):  # a torn last line from a crash mid-write: it was never acknowledged to anyone
                with open(path, "r+b") as fh:
                    fh.truncate(complete)
                data = data[:complete]
            self._segments.append(_Segment(index, path, len(data), data.count(b"\n")))
        try:
            head = json.loads((self.directory / "head.json").read_text())
            self._head_segment, self._head_offset = int(head["segment"]), int(head["offset"])
        except (OSError, ValueError, KeyError, TypeError):
            self._head_segment, self._head_offset = 0, 0
        # Segments before the head were fully replayed (their deletion may not have happened before a crash).
        while self._segments and self._segments[0].index < self._head_segment:
            self._segments.pop(0).path.unlink(missing_ok=True)
        if self._segments and self._segments[0].index == self._head_segment:
            head = self._segments[0]
            # head.json can reach the disk before the tail's fsync: after a power loss it may point past what
            # survived. Everything that did survive before it was replayed already; appends go on from the end.
            self._head_offset = min(self._head_offset, head.size)
            with open(head.path, "rb") as fh:
                self._head_consumed = fh.read(self._head_offset).count(b"\n")
        else:
            self._head_segment = self._segments[0].index if self._segments else 0
            self._head_offset = 0
            self._head_consumed = 0

    def _save_head(self) -> None:
        # advisory: a head lost to a power cut replays a few events again (the SDK is at-least-once)
        write_json(self.directory / "head.json", {"segment": self._head_segment, "offset": self._head_offset},
                   Durability.ADVISORY)

    # ---------------------------------------------------------------- queries
    def __len__(self) -> int:
        """Records not yet replayed."""
        segments = self._segments  # read once: the host's metrics() calls this while close() may replace it
        total = sum(s.records for s in segments)
        return total - (self._head_consumed if segments and segments[0].index == self._head_segment else 0)

    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in list(self._segments))

    # ---------------------------------------------------------------- writing
    def append(self, records: list[bytes]) -> int:
        """Append records at the tail; return how many OLD records were dropped to stay within max_bytes."""
        if not records:
            return 0
        tail = self._segments[-1] if self._segments else None
        if tail is None or tail.size >= self.segment_bytes:
            tail = self._new_segment()
        payload = b"\n".join(records) + b"\n"
        assert payload.count(b"\n") == len(records), "spool records must not contain a newline"
        if self._writer is None:
            self._writer = open(tail.path, "ab")
        writer = self._writer
        writer.write(payload)
        writer.flush()  # into the OS: survives a crash of this process; fsynced in batches (maybe_sync)
        tail.size += len(payload)
        tail.records += len(records)
        if not self._unsynced:
            self._unsynced_since = time.monotonic()
        self._unsynced += len(records)
        self.maybe_sync()
        return self._enforce_bound()

    def maybe_sync(self) -> bool:
        """fsync the tail once sync_records records or sync_interval_s seconds are unsynced; True if it did."""
        if self._unsynced and (self._unsynced >= self.sync_records
                               or time.monotonic() - self._unsynced_since >= self.sync_interval_s):
            self.sync()
            return True
        return False

    def sync(self) -> None:
        """fsync everything appended so far (os.fsync releases the GIL: the host's threads keep running)."""
        if self._writer is not None and self._unsynced:
            self._writer.flush()
            os.fsync(self._writer.fileno())
            self.syncs += 1
        self._unsynced = 0

    def _new_segment(self) -> _Segment:
        if self._writer is not None:
            self.sync()  # the old tail's last records, before its handle goes
            self._writer.close()
            self._writer = None
        index = self._segments[-1].index + 1 if self._segments else max(self._head_segment, 1)
        segment = _Segment(index, self.directory / f"{index:012d}{SEGMENT_SUFFIX}", 0, 0)
        segment.path.touch()
        fsync_path(self.directory)  # the new name survives a power loss, so its fsynced records do too
        if not self._segments:
            self._head_segment, self._head_offset, self._head_consumed = index, 0, 0
            self._save_head()
        self._segments.append(segment)
        return segment

    def _enforce_bound(self) -> int:
        dropped = 0
        while self.size_bytes > self.max_bytes and len(self._segments) > 1:
            oldest = self._segments.pop(0)
            unreplayed = oldest.records - (self._head_consumed if oldest.index == self._head_segment else 0)
            dropped += unreplayed
            oldest.path.unlink(missing_ok=True)
            self._head_segment, self._head_offset, self._head_consumed = self._segments[0].index, 0, 0
            self._peeked = []  # anything peeked from the dropped segment is gone
            self._save_head()
        return dropped

    # ---------------------------------------------------------------- replay
    def peek(self, max_records: int) -> list[bytes]:
        """Up to max_records from the head, without consuming them (commit() does that)."""
        out: list[bytes] = []
        self._peeked = []
        for segment in self._segments:
            if len(out) >= max_records:
                break
            offset = self._head_offset if segment.index == self._head_segment else 0
            if offset >= segment.size:
                continue
            if self._writer is not None and segment is self._segments[-1]:
                self._writer.flush()
            with open(segment.path, "rb") as fh:
                fh.seek(offset)
                while len(out) < max_records and offset < segment.size:
                    line = fh.readline()
                    if not line.endswith(b"\n"):
                        break
                    offset += len(line)
                    out.append(line[:-1])
                    self._peeked.append((segment.index, offset))
        return out

    def commit(self, n: int) -> None:
        """Consume the first n records of the last peek (they were acknowledged downstream)."""
        if n <= 0 or not self._peeked:
            return
        assert n <= len(self._peeked), f"commit({n}) after a peek of {len(self._peeked)} records"
        segment_index, offset = self._peeked[n - 1]
        if segment_index == self._head_segment:
            self._head_consumed += n
        else:
            self._head_consumed = sum(1 for s, _ in self._peeked[:n] if s == segment_index)
        self._head_segment, self._head_offset = segment_index, offset
        self._peeked = self._peeked[n:]
        # Fully replayed segments are deleted, except the tail, which keeps receiving appends.
        while len(self._segments) > 1 and (
            self._segments[0].index < self._head_segment
            or (self._segments[0].index == self._head_segment and self._head_offset >= self._segments[0].size)
        ):
            done = self._segments.pop(0)
            done.path.unlink(missing_ok=True)
            if done.index == self._head_segment:
                self._head_segment, self._head_offset, self._head_consumed = self._segments[0].index, 0, 0
        self._save_head()

    def close(self) -> None:
        if self._writer is not None:
            self.sync()
            self._writer.close()
            self._writer = None
        # An empty, fully replayed spool leaves nothing behind (a process per pid would otherwise
        # leave one empty directory per run).
        empty = len(self) == 0
        if empty:
            for segment in self._segments:
                segment.path.unlink(missing_ok=True)
            self._segments = []
            (self.directory / "head.json").unlink(missing_ok=True)
            (self.directory / OWNER_FILE).unlink(missing_ok=True)
            (self.directory / "lock").unlink(missing_ok=True)
        fcntl.flock(self._lock_fh, fcntl.LOCK_UN)
        self._lock_fh.close()
        if empty:
            try:
                self.directory.rmdir()
            except OSError:
                pass  # something else lives there


    def release_inherited_lock(self) -> None:
        """In a forked child: close its copy of the lock's descriptor, without LOCK_UN.

        flock belongs to the open file, shared by fork: LOCK_UN here would unlock the parent's spool, while a
        child that kept the descriptor would hold the lock after the parent died (a restarted parent would then
        find its spool locked). Closing the child's copy does neither. The tail's writer is left open: closing
        it would flush a buffer the parent may have been writing when it forked.
        """
        if not self._lock_fh.closed:
            self._lock_fh.close()
