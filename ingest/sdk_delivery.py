"""SDK delivery: non-blocking, loss-avoiding delivery of a logger's records to one Kafka topic.

A host's call appends to a bounded in-memory queue; a background thread encodes (ingest/sdk_encoding.py), sends
through the producer (ingest/sdk_producer.py), spills to the spool when Kafka is down or does not acknowledge
(ingest/sdk_spools.py) and replays it in order once Kafka answers again, replacing a producer whose sends stay
unresolved. flush, close, atexit and fork safety live here too. The public API is flywheel.ingest.sdk.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import json
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from flywheel.ingest.journal import Journal
from flywheel.ingest.sdk_counters import Counters, WarnOnce
from flywheel.ingest.sdk_producer import ProducerLife, close_producer
from flywheel.ingest.sdk_spools import SpoolKeeper
from flywheel.ingest.spool import Spool

log = logging.getLogger("flywheel.ingest.sdk")  # the SDK's parts all log as the SDK: a host configures one logger

PARK_AFTER_S = 0.1  # during a replay, queued records older than this are parked in the spool (SIGKILL window)

# Errors that concern the record itself, not the broker: retrying (or replaying) it can never succeed,
# so it is dropped and counted instead of blocking the spool's head forever.
_POISON_ERRORS = frozenset({"MessageSizeTooLargeError", "RecordListTooLargeError", "CorruptRecordError",
                            "InvalidRecordError"})


def _is_poison(exc: BaseException | None) -> bool:
    return exc is not None and type(exc).__name__ in _POISON_ERRORS


# Where an in-flight send's record lives besides the producer (the third item of a _pending entry). A record
# leaves _pending only when Kafka answered or when it is safe on disk, so dropping a producer loses nothing.
_IN_MEMORY = 0  # only in _pending: a failure sends it to the spool
_FROM_SPOOL = 1  # a replay: the spool keeps it until the ack commits it
_COPIED = 2  # copied into the spool when the broker was declared down: it may arrive twice, never zero times


# ---------------------------------------------------------------------------------------------
# The pipeline: bounded queue -> background thread -> Kafka, spilling to the spool
# ---------------------------------------------------------------------------------------------
_LIVE: "weakref.WeakSet[Pipeline]" = weakref.WeakSet()  # for the one atexit and at-fork hook
_HOOKS_INSTALLED = False
_FORK_ORPHANS: list[Any] = []  # producers and spools inherited through fork(): never used, never closed in the child


def _install_process_hooks() -> None:
    # One process-wide hook each instead of one per pipeline: register_at_fork cannot be undone.
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    atexit.register(_close_live)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_reset_live_in_child)


def _close_live() -> None:
    for p in list(_LIVE):
        p.close(timeout=p.exit_timeout_s)


def _reset_live_in_child() -> None:
    for p in list(_LIVE):
        p._reset_in_child()


class _Rejected:
    """What _send returns for a record Kafka refused for good: a resolved, failed future."""

    is_done = True

    def __init__(self, exception: BaseException) -> None:
        self.exception = exception

    def succeeded(self) -> bool:
        return False

    def failed(self) -> bool:
        return True


class _Delivered:
    """A resolved, successful future: a spooled copy of a record Kafka acknowledged in the meantime."""

    is_done = True
    exception = None

    def succeeded(self) -> bool:
        return True

    def failed(self) -> bool:
        return False


class Pipeline:
    """Non-blocking, loss-avoiding delivery of dict records to one Kafka topic."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        encode: Callable[[dict[str, Any]], tuple[bytes, bytes] | None],
        *,
        name: str,
        spool_dir: str | Path | None,
        max_queue: int,
        batch_max: int,
        linger_s: float,
        spool_max_bytes: int,
        compression: str | None,
        outage_after_s: float,
        retry_s: float,
        inflight_wait_s: float,
        metrics_interval_s: float,
        exit_timeout_s: float,
        producer_config: dict[str, Any] | None,
        counts: Counters | None = None,
        warn: WarnOnce | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.name = name
        self._encode = encode
        self.journal: Journal | None = None  # set by the client when the host asked for one (journal_dir)
        self.max_queue = max_queue
        self.batch_max = batch_max
        self.linger_s = linger_s
        self.compression = compression
        self.outage_after_s = outage_after_s
        self.retry_s = retry_s
        self.inflight_wait_s = inflight_wait_s
        self.metrics_interval_s = metrics_interval_s
        self.exit_timeout_s = exit_timeout_s
        self.producer_config = dict(producer_config or {})
        self.warn = warn if warn is not None else WarnOnce()
        self.counts = counts if counts is not None else Counters()  # shared with the client's encoder
        self.spools = SpoolKeeper(name, topic, spool_dir, spool_max_bytes, self.counts, self.warn)
        self._init_state()
        _install_process_hooks()
        _LIVE.add(self)
        self._start()

    def _init_state(self) -> None:
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._needs_start = False
        self.producers = ProducerLife(self.bootstrap, self.topic, self.name, self.compression, self.retry_s,
                                      self.producer_config, self.counts, self.warn)
        self._spool: Spool | None = None
        self._failed: collections.deque[tuple[bytes, bytes]] = collections.deque()
        # send id -> (key, value, where the record also lives: _IN_MEMORY | _FROM_SPOOL | _COPIED, monotonic send time)
        self._pending: dict[int, tuple[bytes, bytes, int, float]] = {}
        # values of _COPIED sends that Kafka acknowledged after all: their spool copy is skipped, not sent again
        self._acked_copies: set[bytes] = set()
        self._send_ids = itertools.count()
        self._progress_ts = time.monotonic()
        self._down = False
        self._down_since = 0.0
        self._reachable_since: float | None = None  # first probe that found the broker listening again
        self._replace_producer = False  # the producer failed a replay against a listening broker
        self._restarts_in_outage = 0  # producers given up on since the broker was last declared down
        self._next_stall_check = 0.0
        self._next_replay = 0.0
        self._last_metrics = time.monotonic()
        self._last_logged: dict[str, int] = {}
        self._stopping_deadline = float("inf")
        self._in_hand = False
        self._queued_since: float | None = None  # when a replay's wait first saw the host's queue non-empty
        self._opened = False  # the background thread has looked for spools left by earlier processes
        self._cb_lock = threading.Lock()
        self._yielded = time.perf_counter()
        self.counts.reset()  # a forked child counts its own records from zero

    @property
    def _spool(self) -> Spool | None:
        return self.spools.spool

    @_spool.setter
    def _spool(self, value: Spool | None) -> None:
        self.spools.spool = value

    @property
    def _spool_dir(self) -> Path:
        return self.spools.dir

    @_spool_dir.setter
    def _spool_dir(self, value: Path) -> None:
        self.spools.dir = value

    @property
    def _producer(self) -> Any:
        return self.producers.producer

    def _ensure_producer(self, probed: bool = False) -> None:
        why = self.producers.ensure(probed)
        if why is not None:
            self._mark_down(why)

    def _send_notices(self) -> None:
        if not self._down:
            self.producers.send_notices()

    def over_cap(self, what: str, record: dict[str, Any], size: int) -> bool:
        """Whether an encoded record is over the topic's record cap (named in a DLQ notice when it is)."""
        return self.producers.over_cap(what, record, size)

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"flywheel-sdk-{self.name}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- host side (hot path)
    def put(self, record: dict[str, Any]) -> bool:
        """Enqueue without blocking; False (counted, warned) when the queue is full or closed."""
        if self._needs_start:
            self._needs_start = False
            self._start()
        if len(self._queue) >= self.max_queue or self._closed:
            self.counts.dropped_full += 1
            self.warn("full", "sdk %s: queue full (%d records) or closed; record dropped", self.name, self.max_queue)
            return False
        if self.journal is not None:
            self.journal.append(record)
        self._queue.append(record)
        if len(self._queue) >= self.batch_max:
            self._wake.set()
        return True

    def metrics(self) -> dict[str, Any]:
        spool = self._spool  # read once: _finish sets it to None concurrently
        try:
            spool_records, spool_bytes = (len(spool), spool.size_bytes) if spool is not None else (0, 0)
        except Exception:  # a spool being closed right now: host-facing calls never raise
            spool_records, spool_bytes = 0, 0
        return {
            "enqueued": self.counts.popped + len(self._queue),
            "sent": self.counts.sent,
            "spilled": self.counts.spilled,
            "replayed": self.counts.replayed,
            "dropped": self.counts.dropped_full + self.counts.dropped_spool,
            "dropped_queue_full": self.counts.dropped_full,
            "dropped_spool_full": self.counts.dropped_spool,
            "invalid": self.counts.invalid,
            "coerced": self.counts.coerced,
            "truncated": self.counts.truncated,
            "limited": self.counts.limited,
            "oversized": self.counts.oversized,
            "oversized_noticed": self.counts.oversized_noticed,
            "record_cap": self.producers.record_cap,
            "send_errors": self.counts.send_errors,
            "rejected": self.counts.rejected,
            "producer_restarts": self.counts.producer_restarts,
            "adopted": self.counts.adopted,
            "io_errors": self.counts.io_errors,
            "queue_depth": len(self._queue),
            "inflight": len(self._pending),
            "spool_records": spool_records,
            "spool_bytes": spool_bytes,
            "broker_down": self._down,
        }

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything enqueued so far was acknowledged by Kafka (True) or timeout (False).

        With the broker down, records spilled to disk count as not yet delivered.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._opened and not (self._queue or self._in_hand or self._pending or self._failed
                                     or self._spool_pending()):
                return True
            if self._thread is None or not self._thread.is_alive():
                return False
            self._wake.set()
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what can be delivered within timeout, spill the rest to disk, stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._stopping_deadline = time.monotonic() + timeout
        self._stopping = True
        self._wake.set()
        if self._thread is not None and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout + 5.0)
        _LIVE.discard(self)

    def _reset_in_child(self) -> None:
        # The parent owns the queue's contents, the producer's sockets and the spool directory:
        # the child must neither send the parent's records nor unlock the parent's spool.
        if self.journal is not None:  # nor write into the parent's journal, nor keep its lock after the parent dies
            self.journal.forget_in_child()
            self.journal = None
        # Both are kept alive, unused: dropping the producer would run its __del__ (close, flush on the
        # parent's sockets), and closing the spool would unlock the parent's spool (flock is shared by fork).
        _FORK_ORPHANS.extend(x for x in (self._producer, self._spool) if x is not None)
        if self._spool is not None:
            self._spool.release_inherited_lock()  # else a SIGKILLed parent's successor finds its spool locked
        self._init_state()
        self._spool_dir = self._spool_dir.with_name(f"{self._spool_dir.name}-{os.getpid()}")
        self._needs_start = True

    # ---------------------------------------------------------------- background thread
    def _run(self) -> None:
        try:
            try:
                self.spools.open_existing()
            except OSError as exc:
                self._io_failed("open", exc)
            self._opened = True
            while True:
                self._wake.wait(self.linger_s)
                self._wake.clear()
                try:
                    self._cycle()
                except OSError as exc:  # EIO, ENOSPC from the spool: the disk may recover, so keep cycling
                    self._io_failed("cycle", exc)
                if self._stopping:
                    self._finish()
                    return
        except Exception:  # the host must never see this thread die silently, nor be affected by it
            log.exception("sdk %s: background thread failed; records stay queued and are not sent", self.name)

    def _io_failed(self, phase: str, exc: OSError) -> None:
        """Count and warn (once per kind) an I/O error that escaped a cycle, then back off for retry_s."""
        self.counts.io_errors += 1
        self._in_hand = False  # what the cycle held is in the spool, in _pending or counted as dropped
        self.warn(f"io:{phase}:{exc.errno}", "sdk %s: I/O error in the background thread (%s: %s); retrying every "
                  "%.1fs, records stay queued meanwhile", self.name, phase, exc, self.retry_s)
        self._wake.wait(self.retry_s)  # close() sets it: a stopping logger does not wait out the back-off

    def _cycle(self) -> None:
        self._ensure_producer()
        self._respool_failures()
        self._drain_queue()
        self._send_notices()
        self._check_health()
        if (self._spool_pending() or self._down) and time.monotonic() >= self._next_replay:
            self._replay()  # also ends an outage that spilled nothing (in-flight records were delivered late)
        if self._spool is not None:
            self._spool.maybe_sync()  # a quiet tail is fsynced within the spool's interval too
        self._maybe_log_metrics()

    def _drain_queue(self) -> None:
        queue = self._queue
        # Only what is queued now: a host that enqueues as fast as we encode must not keep this loop
        # from returning to the health check (that is how an outage is noticed).
        budget = len(queue)
        while queue and budget > 0:
            self._in_hand = True  # records popped but not yet in _pending or the spool: flush() must wait
            batch: list[tuple[bytes, bytes]] = []
            while queue and budget > 0 and len(batch) < self.batch_max:
                record = queue.popleft()
                budget -= 1
                self.counts.popped += 1
                encoded = self._encode_safely(record)
                if encoded is not None:
                    batch.append(encoded)
                self._yield_gil()
            self._route(batch)
            self._in_hand = False

    def _yield_gil(self) -> None:
        # After every millisecond of work, step off the GIL for 50 us. A host thread that wants the GIL
        # otherwise waits for the interpreter's 5 ms switch interval while encoding or producer.send()
        # (kafka-python builds record batches in the caller's thread) runs in bursts of tens of ms.
        # sleep(0) is not enough: it re-takes the GIL before the woken host thread is scheduled.
        if time.perf_counter() - self._yielded > 0.001:
            time.sleep(0.00005)
            self._yielded = time.perf_counter()

    def _encode_safely(self, record: dict[str, Any]) -> tuple[bytes, bytes] | None:
        try:
            return self._encode(record)
        except Exception as exc:  # an encoder bug must cost one record, not the thread
            self.counts.invalid += 1
            self.warn(f"encode:{type(exc).__name__}", "sdk %s: record could not be encoded (%s); dropped",
                      self.name, exc)
            return None

    def _route(self, batch: list[tuple[bytes, bytes]]) -> None:
        if not batch:
            return
        if self._down or self._producer is None or self._spool_pending():
            self.spools.spill(batch)
            return
        for i, (key, value) in enumerate(batch):
            if self._down:  # a send just failed (it spilled its record): the rest must not wait on Kafka too
                self.spools.spill(batch[i:])
                return
            result = self._send(key, value, _IN_MEMORY)
            if isinstance(result, _Rejected):
                self._reject(result.exception, value)
            self._yield_gil()

    def _send(self, key: bytes, value: bytes, where: int) -> Any:
        send_id = next(self._send_ids)
        now = time.monotonic()
        if not self._pending:
            self._progress_ts = now
        self._pending[send_id] = (key, value, where, now)
        try:
            future = self._producer.send(self.topic, key=key, value=value)
        except Exception as exc:  # metadata timeout, producer closed ...: the broker is unusable now
            self._pending.pop(send_id, None)
            self.counts.send_errors += 1
            if _is_poison(exc):
                return _Rejected(exc)  # the record, not the broker: callers drop it and count it
            if type(exc).__name__ != "KafkaTimeoutError":  # not a slow broker (no metadata yet): a broken producer
                self._replace_producer = True
            self._mark_down(f"send failed: {exc}")
            if where == _IN_MEMORY:
                self.spools.spill([(key, value)])
            return None
        future.add_callback(self._on_ack, send_id)
        future.add_errback(self._on_error, send_id)
        return future

    # Callbacks run on kafka-python's I/O thread, or on ours when a future is already resolved: hence the lock.
    def _on_ack(self, send_id: int, _metadata: Any) -> None:
        with self._cb_lock:
            entry = self._pending.get(send_id)
            self._progress_ts = time.monotonic()
            if entry is not None:
                if entry[2] == _FROM_SPOOL:
                    self.counts.replayed += 1
                elif entry[2] == _COPIED:
                    self._acked_copies.add(entry[1])
                self.counts.sent += 1
                del self._pending[send_id]  # last: flush() sees an empty _pending only after the counters moved

    def _on_error(self, send_id: int, exc: BaseException) -> None:
        poison = _is_poison(exc)
        with self._cb_lock:
            entry = self._pending.pop(send_id, None)
            if entry is None:  # a send of a producer given up on: its record is in the spool already
                return
            self.counts.send_errors += 1
            if entry[2] == _IN_MEMORY and not poison:  # spool records (replayed or copied) stay there until acked
                self._failed.append((entry[0], entry[1]))
        if poison and entry[2] == _IN_MEMORY:
            self._reject(exc, entry[1])
            return
        self.warn(f"send:{type(exc).__name__}", "sdk %s: Kafka did not take a batch (%s); records go to the spool",
                  self.name, exc)

    def _reject(self, exc: BaseException, value: bytes | None = None) -> None:
        """Count a record Kafka refused for good; with its bytes at hand, name it in a DLQ notice too."""
        self.counts.rejected += 1
        self.warn(f"reject:{type(exc).__name__}", "sdk %s: Kafka refused a record for good (%s); dropped%s", self.name,
                  exc, "" if value is None else f" and named in a notice to {self.producers.dlq_topic}")
        if value is not None:
            try:
                record = json.loads(value)
            except ValueError:
                record = {}
            self.producers.add_notice("oversized" if "TooLarge" in type(exc).__name__ else "rejected",
                             f"{type(exc).__name__}: {exc}"[:500], record if isinstance(record, dict) else {},
                             len(value))

    def _respool_failures(self) -> None:
        if self._failed:
            self._in_hand = True
            batch = []
            while self._failed:
                batch.append(self._failed.popleft())
            self._mark_down("records failed")
            self.spools.spill(batch)
            self._in_hand = False

    def _check_health(self) -> None:
        now = time.monotonic()
        if self._pending and not self._down and now - self._progress_ts > self.outage_after_s:
            self._mark_down(f"no acknowledgement for {self.outage_after_s:.1f}s")
        if self._pending and now >= self._next_stall_check:
            self._next_stall_check = now + 1.0
            with self._cb_lock:  # the oldest send (dicts keep insertion order); callbacks delete concurrently
                oldest = next(iter(self._pending.values()), None)
            # kafka-python fails a send after delivery_timeout_ms; one still unresolved well after that never
            # will be (its idempotent producer after a long outage, design.md): give that producer up.
            if oldest is not None and now - oldest[3] > self.producers.delivery_timeout_s + self.inflight_wait_s:
                self._mark_down(f"a send unresolved after {now - oldest[3]:.0f}s")
                self._abandon_producer(f"a send unresolved {now - oldest[3]:.0f}s after it was made, past the "
                                       f"producer's delivery timeout of {self.producers.delivery_timeout_s:.0f}s")

    def _mark_down(self, why: str) -> None:
        if not self._down:
            self._down = True
            self._down_since = time.monotonic()
            self._reachable_since = None
            self._restarts_in_outage = 0
            self._next_replay = time.monotonic() + self.retry_s
            log.warning("sdk %s: Kafka at %s unavailable (%s); spilling to %s until it answers",
                        self.name, self.bootstrap, why, self._spool_dir)
            self._copy_inflight_to_spool()

    def _copy_inflight_to_spool(self) -> None:
        """Put every in-flight record that exists only in memory into the spool too.

        Sends made before the outage was noticed would otherwise live only in the producer until they
        resolve: up to delivery_timeout_ms, or never. On disk they survive a SIGKILL of the host, and
        the producer can be dropped without losing them. One that is delivered late arrives twice.
        """
        with self._cb_lock:  # marked under the lock, so _on_error cannot also queue one of them for the spool
            copies = [(sid, e) for sid, e in self._pending.items() if e[2] == _IN_MEMORY]
            for sid, (key, value, _where, ts) in copies:
                self._pending[sid] = (key, value, _COPIED, ts)
        if copies:
            self.spools.spill([(e[0], e[1]) for _sid, e in copies])

    def _abandon_producer(self, why: str) -> None:
        """Close the producer without waiting and start afresh; every record it held is in the spool."""
        self._copy_inflight_to_spool()
        with self._cb_lock:
            abandoned = len(self._pending)
            self._pending.clear()
        producer = self.producers.drop()  # the next _ensure_producer creates one at once
        self._replace_producer = False
        self.counts.producer_restarts += 1
        self._restarts_in_outage += 1
        # A broker that listens but keeps failing replays makes this happen every retry: warn once per outage.
        log.log(logging.WARNING if self._restarts_in_outage == 1 else logging.INFO,
                "sdk %s: replacing the Kafka producer (%s); its %d in-flight records are re-sent from the spool",
                self.name, why, abandoned)
        if producer is not None:
            close_producer(producer, timeout=0.0)

    def _spool_pending(self) -> bool:
        spool = self._spool  # read once: flush() calls this from the host's thread while _finish clears it
        return spool is not None and len(spool) > 0

    def _replay(self, chunk: int = 2000, ack_timeout_s: float = 10.0) -> None:
        """Send spooled records oldest first; commit each chunk only once Kafka acknowledged it."""
        self._next_replay = time.monotonic() + self.retry_s
        if not self.producers.broker_reachable():
            self._reachable_since = None
            return
        now = time.monotonic()
        if self._reachable_since is None:
            self._reachable_since = now
        if self._pending or self._replace_producer:
            # Sends from before the outage: after a short one the producer delivers them within a second or two
            # of the broker's return (fewer duplicates); after one longer than its delivery timeout some never
            # resolve (design.md). So wait a bounded time, then drop that producer (the records are in the spool).
            waited = now - max(self._progress_ts, self._reachable_since)
            if not self._replace_producer and waited < self.inflight_wait_s:
                return
            self._abandon_producer(f"{len(self._pending)} sends unresolved {waited:.1f}s after the broker answered"
                                   if not self._replace_producer else "it failed a replay")
        self._ensure_producer(probed=True)
        if self._producer is None:
            return
        spool = self._spool
        self._in_hand = True  # flush() waits for the end of a replay, not just an empty spool
        try:
            self._replay_spool(spool, chunk, ack_timeout_s)
        finally:
            self._in_hand = False

    def _replay_spool(self, spool: Spool | None, chunk: int, ack_timeout_s: float) -> None:
        while spool is not None and len(spool) and not (self._stopping and time.monotonic() > self._stopping_deadline):
            records = spool.peek(chunk)
            if not records:  # a head past the data (spool._load clamps it): never spin here holding the GIL
                break
            futures = []
            for value in records:
                if self._acked_copies and value in self._acked_copies:  # delivered late by the producer it left
                    self._acked_copies.discard(value)
                    futures.append(_Delivered())
                    continue
                future = self._send(self._key_of(value), value, _FROM_SPOOL)
                if future is None:  # Kafka refused a send: the records stay in the spool for the next try
                    break
                futures.append(future)
                self._yield_gil()
            ok = self._commit_acknowledged(spool, futures, ack_timeout_s)
            if ok < len(records):
                if len(futures) == len(records):
                    # Sends taken but not acknowledged by a broker that listens: the next try uses a fresh producer
                    # (one that expired batches may never send again). Unresolved ones stay in _pending until then.
                    self._replace_producer = True
                self._mark_down(f"replay: {len(records) - ok} of {len(records)} records not acknowledged")
                return
            if not len(spool):
                break  # caught up: what is queued now follows the spool straight to Kafka, in order
            self._drain_into_spool()  # behind the spool, to keep order (and the host's queue short)
            self._in_hand = True  # (_drain_into_spool clears it)
        if self._down:
            log.info("sdk %s: Kafka answers again after %.1fs; spool replayed (%d records so far)",
                     self.name, time.monotonic() - self._down_since, self.counts.replayed)
        self._down = False
        self._acked_copies.clear()  # any left were copies replayed before their late ack: nothing to skip

    def _commit_acknowledged(self, spool: Spool, futures: list[Any], ack_timeout_s: float) -> int:
        """Commit the acknowledged prefix of a replayed chunk as acks arrive; return how many were committed.

        Stops at the first failed send, or after ack_timeout_s without an ack: a slow broker that keeps
        acknowledging is waited for, and what it took is off the spool even if the rest of the chunk fails.
        """
        ok, progress = 0, time.monotonic()
        while ok < len(futures):
            start = ok
            while ok < len(futures) and futures[ok].is_done:
                f = futures[ok]
                if f.failed() and _is_poison(f.exception):
                    self._reject(f.exception)  # consumed: replaying it again could never succeed
                elif not f.succeeded():
                    spool.commit(ok - start)
                    return ok
                ok += 1
            if ok > start:
                spool.commit(ok - start)
                progress = time.monotonic()
            elif time.monotonic() - progress > ack_timeout_s:
                break
            if ok < len(futures):
                self._park_waiting_queue()
                spool.maybe_sync()  # the spool's power-loss window holds during a long wait for acks too
                time.sleep(0.01)
        return ok

    def _park_waiting_queue(self) -> None:
        """During a replay's wait for acks, move the host's queue behind the spool once it holds batch_max records
        or its oldest record has waited PARK_AFTER_S: only in memory, a SIGKILL would lose it for as long as the
        replay lasts. Not every short queue at once: a replay that spools what arrives during every brief wait
        would never end under steady load."""
        if not self._queue:
            self._queued_since = None
            return
        now = time.monotonic()
        if self._queued_since is None:
            self._queued_since = now  # first seen (we look every 10 ms): its oldest record is at least this old
        if len(self._queue) >= self.batch_max or now - self._queued_since >= PARK_AFTER_S:
            self._drain_into_spool()
            self._in_hand = True  # (_drain_into_spool clears it; the replay still holds its chunk)

    def _drain_into_spool(self) -> None:
        # New records keep arriving during a long replay: park them behind the spool to keep order
        # and keep the in-memory queue short.
        self._in_hand = True
        self._queued_since = None
        batch: list[Any] = []
        while self._queue and len(batch) < 50_000:
            self.counts.popped += 1
            encoded = self._encode_safely(self._queue.popleft())
            if encoded is not None:
                batch.append(encoded)
            self._yield_gil()
        if batch:
            self.spools.spill(batch)
        self._in_hand = False

    @staticmethod
    def _key_of(value: bytes) -> bytes:
        try:
            return str(json.loads(value).get("session_id", "")).encode()
        except (ValueError, AttributeError):
            return b""

    # ---------------------------------------------------------------- shutdown and metrics
    def _finish(self) -> None:
        deadline = self._stopping_deadline
        self._respool_failures()
        self._drain_queue()
        self._send_notices()
        if self._spool_pending() and not self._down:
            self._replay()
        if self._producer is not None and self._pending:
            remaining = 0.0 if self._down else max(0.0, deadline - time.monotonic())
            try:
                self._producer.flush(timeout=remaining)
            except Exception:
                pass
        # Whatever Kafka has not acknowledged goes to disk: it may arrive twice, never zero times. Copy first, then
        # respool: an errback that fires before the copy puts its record in _failed, which is read after it.
        self._copy_inflight_to_spool()
        self._respool_failures()
        with self._cb_lock:
            self._pending.clear()
        if self._producer is not None:
            close_producer(self.producers.drop(), timeout=0 if self._down else 1)
        if self._spool is not None:
            if len(self._spool):
                log.warning("sdk %s: %d records remain in spool %s; a process with the same name replays them",
                            self.name, len(self._spool), self._spool_dir)
            self._spool.close()
            self._spool = None
        self._log_metrics(force=True)

    def _maybe_log_metrics(self) -> None:
        if time.monotonic() - self._last_metrics >= self.metrics_interval_s:
            self._log_metrics()

    def _log_metrics(self, force: bool = False) -> None:
        self._last_metrics = time.monotonic()
        metrics = self.metrics()
        counters = {k: v for k, v in metrics.items() if isinstance(v, int) and not isinstance(v, bool)}
        if counters != self._last_logged or force:
            self._last_logged = counters
            log.info("sdk %s: %s", self.name, ", ".join(f"{k}={v}" for k, v in metrics.items()))
