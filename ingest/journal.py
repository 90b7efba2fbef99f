"""The SDK's write-ahead journal: every record a host logs is in the OS before the log call returns.

The SDK's queue lives in memory for the few milliseconds before its background thread sends or
spools a batch, so a SIGKILL of the host loses what it logged in that moment. For most hosts that
is the right trade (the hot path stays a deque append). A host whose logged calls are its product,
the capture proxy, answers an agent only after the call is logged: with a journal, an answered call
survives a SIGKILL of the proxy (`SessionLogger(..., journal_dir=DIR)`; the proxy's `--journal`).

How: `append` writes the record as one JSON line (its event_id assigned first) to the current
segment with one write(2), no fsync: the page cache survives the process, not a power loss, which
the spool's own fsync policy covers no better. Every `rotate_s` a helper thread starts a new segment
and asks the SDK to flush; when everything logged so far was acknowledged by Kafka, the segments
closed before that flush are deleted. A process that starts on a directory an earlier one left
(`leftovers`) logs those records again, with their event_ids, before anything new; a record sent
both times is one row in the lake (the writer de-duplicates by event_id within its window).

Bounded: past `max_bytes` the oldest closed segments are deleted (counted), which can only lose
records that are also in the SDK's queue or spool. Stdlib only (the SDK's import path).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

SUFFIX = ".jsonl"


class JournalLocked(RuntimeError):
    """Another process journals into this directory."""


class Journal:
    """Segments `<n>.jsonl` in one directory owned (flock) by one process; see the module docstring."""

    def __init__(self, directory: str | Path, id_field: str, rotate_s: float = 2.0,
                 max_bytes: int = 256 * 1024 * 1024) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.id_field = id_field
        self.rotate_s = rotate_s
        self.max_bytes = max_bytes
        self._lock_fd = os.open(self.directory / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            raise JournalLocked(f"{self.directory} is journalled by another process") from exc
        self._leftovers = sorted(self.directory.glob(f"*{SUFFIX}"), key=_number)
        self._next = (_number(self._leftovers[-1]) + 1) if self._leftovers else 1
        self._mutex = threading.Lock()
        self._closed_segments: list[Path] = []
        self._fd, self._path, self._size = self._open_segment()
        self.appended = 0
        self.errors = 0
        self.dropped_segments = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- start-up
    def leftovers(self) -> list[dict[str, Any]]:
        """Records an earlier process journalled and may not have delivered, oldest first (unreadable lines skipped)."""
        records: list[dict[str, Any]] = []
        for path in self._leftovers:
            try:
                lines = path.read_bytes().splitlines()
            except OSError as exc:
                log.warning("journal: %s unreadable (%s); its records are not replayed", path, exc)
                continue
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:  # the torn last line of a killed write: that call was never answered
                    continue
                if isinstance(record, dict):
                    records.append(record)
        return records

    def drop_leftovers(self) -> None:
        """Delete the earlier process's segments: call once their records were appended again (now in ours)."""
        for path in self._leftovers:
            path.unlink(missing_ok=True)
        self._leftovers = []

    def start(self, flush: Callable[[float], bool]) -> None:
        """Rotate every rotate_s and delete the segments a successful `flush(timeout)` covers."""
        self._thread = threading.Thread(target=self._run, args=(flush,), name="flywheel-sdk-journal", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- host side (hot path)
    def append(self, record: dict[str, Any]) -> None:
        """Write one record (its id assigned here if missing) into the OS; never raises to the host."""
        try:
            record.setdefault(self.id_field, uuid.uuid4().hex)
            line = json.dumps(record, separators=(",", ":"), default=_plain).encode() + b"\n"
            with self._mutex:
                os.write(self._fd, line)
                self._size += len(line)
            self.appended += 1
        except Exception as exc:  # a full disk or an odd value must not reach the host
            self.errors += 1
            if self.errors == 1 or self.errors % 1000 == 0:
                log.warning("journal: record not journalled (%s; %d so far); it is still queued for Kafka", exc,
                            self.errors)

    # ---------------------------------------------------------------- background
    def _run(self, flush: Callable[[float], bool]) -> None:
        while not self._stop.wait(self.rotate_s):
            self.checkpoint(flush)

    def checkpoint(self, flush: Callable[[float], bool]) -> bool:
        """Close the current segment (if it holds anything) and delete every closed one once `flush` confirms."""
        with self._mutex:
            if self._size:
                os.close(self._fd)
                self._closed_segments.append(self._path)
                self._fd, self._path, self._size = self._open_segment()
            covered = list(self._closed_segments)
        if not covered:
            return True
        if not flush(self.rotate_s):
            self._bound()  # the broker is away or the queue never emptied: keep them, within max_bytes
            return False
        for path in covered:
            path.unlink(missing_ok=True)
        with self._mutex:
            self._closed_segments = [p for p in self._closed_segments if p not in covered]
        return True

    def _bound(self) -> None:
        sizes = [(p, _size(p)) for p in self._closed_segments]
        total = sum(s for _, s in sizes)
        while sizes and total > self.max_bytes:
            path, size = sizes.pop(0)
            path.unlink(missing_ok=True)
            total -= size
            self.dropped_segments += 1
            with self._mutex:
                self._closed_segments.remove(path)
            log.warning("journal: over %d bytes while Kafka is unconfirmed; oldest segment %s deleted (its records "
                        "are still in the SDK's queue or spool)", self.max_bytes, path.name)

    def _open_segment(self) -> tuple[int, Path, int]:
        path = self.directory / f"{self._next:012d}{SUFFIX}"
        self._next += 1
        return os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600), path, 0

    def close(self, flush: Callable[[float], bool] | None = None) -> None:
        """Stop the helper; with `flush`, a last checkpoint (a clean stop leaves an empty directory)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.rotate_s + 5.0)
        if flush is not None:
            self.checkpoint(flush)
        with self._mutex:
            os.close(self._fd)
            if not self._size:
                self._path.unlink(missing_ok=True)
            self._fd = -1
        os.close(self._lock_fd)

    def forget_in_child(self) -> None:
        """In a forked child: close the inherited descriptors (the flock is the parent's, freed when it exits)."""
        for fd in (self._fd, self._lock_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def metrics(self) -> dict[str, int]:
        return {"journal_appended": self.appended, "journal_errors": self.errors,
                "journal_dropped_segments": self.dropped_segments}


def _number(path: Path) -> int:
    try:
        return int(path.stem)
    except ValueError:
        return 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _plain(value: Any) -> Any:
    """JSON for what a host may pass besides plain types (numpy arrays and scalars have tolist())."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
