"""The in-process SDK (SessionLogger, Session, OutcomeReporter): what a production agent imports to log
its sessions and their outcomes to Kafka, from inside its own process.

    log = SessionLogger(bootstrap="127.0.0.1:9092")
    with log.session(task_type="code_edit") as s:
        s.llm_call(model="policy-v3", policy_version=3, prompt_token_ids=[...],
                   completion_token_ids=[...], completion_logprobs=[...])
        call = s.tool_call("run_tests", {"path": "tests/"})
        s.tool_result(call, ok=True, output="3 passed")
        child = s.spawn_subagent(subtask="fix the lint errors")
        ...
        child.finish(ok=True)
    OutcomeReporter(bootstrap="127.0.0.1:9092").report(s.session_id, kind="tests_passed", value=1.0)

It runs in the agent's process, on its hot path, so it must never slow it down, block it, crash it, or lose
what it was given (modelled on the Langfuse SDK: a small public surface over background I/O that never hurts its host):

* A call builds a dict and appends it to a bounded in-memory queue (no I/O, no JSON, no
  locks); a background thread does the rest: event id, redaction, size caps, JSON encoding,
  full schema validation, and batching into an idempotent kafka-python producer (acks=all,
  lz4, keyed by session_id so a session stays ordered in one partition).
* When the broker is down or does not acknowledge, events spill to an append-only bounded
  spool on disk (ingest/spool.py, fsynced in batches) and are replayed in order once it
  answers again; while the spool holds anything, new events queue behind it so order is
  kept. Sends in flight when the outage is noticed are copied to the spool as well. Records
  that may have reached Kafka are replayed anyway (at-least-once): downstream de-duplicates
  by event_id.
* Recovery needs no restart: a producer whose sends stay unresolved after the broker is back
  (kafka-python's idempotent producer after an outage past its delivery timeout, design.md)
  is closed without waiting and replaced, and what it held is re-sent from the spool.
* The spool is per logger name and topic (<root>/<name>@<topic>, the name defaulting to the
  program's, without the pid; the root is FLYWHEEL_SPOOL_DIR, else the user's state directory
  $XDG_STATE_HOME/flywheel/spool or ~/.local/state/flywheel/spool, never the host's working
  directory): a restarted agent replays its predecessor's spool, and adopts
  the sibling spools (<spool>-<pid>) that dead processes of the same name and topic left behind
  (each spool's owner.json says whose it is).
* Bad input (missing fields, wrong types, unknown fields, non-JSON values, oversized text)
  logs one warning per kind of problem, is counted, and never raises into the host: text is
  cut to schema.MAX_TEXT_CHARS and named in `truncated`; non-JSON values are stored as
  their repr(); JSON nested past schema.MAX_JSON_DEPTH is cut (named in `truncated`); an
  event past another schema limit, or that still fails validation, is dropped and counted.
* No bootstrap (argument None and no FLYWHEEL_KAFKA_BOOTSTRAP), or FLYWHEEL_ENABLED=0: one warning,
  then a no-op. FLYWHEEL_SAMPLE_RATE=r logs whole sessions, those whose id hashes below r (the same
  hash in every process, so an OutcomeReporter drops the outcomes of exactly those sessions). Both
  are read once, when a SessionLogger or OutcomeReporter is made; a bad value warns and logs all.
* `async with log.session()` as well as `with`; `current_session()` is the innermost session entered
  in this thread or asyncio task; `session.headers()` are the capture proxy's headers for it, and
  `wrap_openai(client)` sends them on every request an openai client makes inside the session.
* `flush(timeout)`, `close()`, atexit, and fork safety (a forked child gets a fresh queue,
  thread, producer and spool of its own).

Imports only the standard library and kafka-python (lazily, in the background thread).
"""

from __future__ import annotations

import array
import atexit
import collections
import contextvars
import inspect
import itertools
import json
import logging
import math
import os
import reprlib
import sys
import threading
import time
import uuid
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Sequence, TypeVar

from flywheel.ingest import schema, wire
from flywheel.ingest.journal import Journal, JournalLocked
from flywheel.ingest.redact import Redactor, redact_json, redact_text
from flywheel.ingest.sdk_counters import Counters, WarnOnce
from flywheel.ingest.sdk_producer import ProducerLife, _close_producer
from flywheel.ingest.sdk_spools import SPOOL_DIR_ENV as SPOOL_DIR_ENV
from flywheel.ingest.sdk_spools import SpoolKeeper, _name_component
from flywheel.ingest.sdk_spools import default_journal_dir as default_journal_dir
from flywheel.ingest.sdk_spools import default_spool_dir as default_spool_dir
from flywheel.ingest.sdk_spools import default_spool_root as default_spool_root
from flywheel.ingest.spool import Spool

# SPOOL_DIR_ENV and default_*_dir/root are re-exported (`x as x`): where a logger's spool lives is public surface
log = logging.getLogger(__name__)
_C = TypeVar("_C")  # the client wrap_openai is given and returns

BOOTSTRAP_ENV = "FLYWHEEL_KAFKA_BOOTSTRAP"
ENABLED_ENV = "FLYWHEEL_ENABLED"
SAMPLE_RATE_ENV = "FLYWHEEL_SAMPLE_RATE"
# The capture proxy's request headers (serving/proxy.py reads them; Session.headers() writes them).
HEADER_SESSION_ID = "X-Flywheel-Session-Id"
HEADER_AGENT_ID = "X-Flywheel-Agent-Id"
HEADER_PARENT_AGENT_ID = "X-Flywheel-Parent-Agent-Id"
HEADER_TASK_TYPE = "X-Flywheel-Task-Type"
HEADER_SESSION_EVENT = "X-Flywheel-Session-Event"
MAIN_AGENT = "main"
PARK_AFTER_S = 0.1  # during a replay, queued records older than this are parked in the spool (SIGKILL window)

# Free-text fields: redacted and capped at MAX_TEXT_CHARS. JSON fields: strings inside are redacted,
# and the whole value is capped by its JSON length.
_TEXT_FIELDS = ("prompt_text", "completion_text", "output", "subtask")
_JSON_COLUMNS = tuple(c.name for c in schema.EVENT_COLUMNS if c.kind == "json")  # tags, sampling, arguments
_REQUIRED = {
    etype: tuple(c.name for c in cols if c.required) for etype, cols in schema.EVENT_FIELDS.items()
}
_OUTCOME_REQUIRED = tuple(c.name for c in schema.OUTCOME_COLUMNS if c.required)
_SEQUENCE_FIELDS = ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "summary_token_ids")


def _resolve_bootstrap(bootstrap: str | None) -> str | None:
    return bootstrap if bootstrap else (os.environ.get(BOOTSTRAP_ENV) or None)


def _default_name() -> str:
    """The program's name, without the pid: stable across restarts, so a restarted agent finds its spool."""
    path = Path(sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-") else "python")
    stem = path.parent.name if path.stem == "__main__" else path.stem  # `python -m pkg`: the package
    return _name_component(stem)


def _sampled(session_id: str, rate: float) -> bool:
    """Per-session sampling (schema.session_sampled, unsalted: the OutcomeReporter drops the same sessions)."""
    return schema.session_sampled(session_id, rate)


_ENV_WARNED: set[tuple[str, str]] = set()  # (variable, value) pairs already warned about in this process


def _warn_setting(what: str, value: Any, consequence: str) -> None:
    if (what, repr(value)) not in _ENV_WARNED:
        _ENV_WARNED.add((what, repr(value)))
        log.warning("sdk: %s=%r is not valid; %s", what, value, consequence)


def _env_enabled() -> bool:
    """FLYWHEEL_ENABLED: 0/false/no/off turn the SDK into a no-op; unset, or anything else, leaves it on."""
    raw = os.environ.get(ENABLED_ENV)
    value = "" if raw is None else raw.strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value not in ("", "1", "true", "yes", "on"):
        _warn_setting(ENABLED_ENV, raw, "use 0/false/no/off or 1/true/yes/on; logging stays on")
    return True


def _resolve_sample_rate(rate: Any) -> float:
    """The argument, else FLYWHEEL_SAMPLE_RATE, else 1.0; anything but a number in [0, 1] warns and logs all."""
    what = "sample_rate"
    if rate is None:
        rate, what = os.environ.get(SAMPLE_RATE_ENV, "").strip() or 1.0, SAMPLE_RATE_ENV
    try:
        value = float(rate)
    except (TypeError, ValueError):
        value = math.nan
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        _warn_setting(what, rate, "it must be a number in [0, 1]; every session is logged")
        return 1.0
    return value


def _json_default(value: Any) -> Any:
    """Turn the array-likes agents commonly pass (numpy, torch, tuples, sets) into JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


# Per event type, the fields _snapshot() looks at (only those: this runs on the hot path).
_SNAPSHOT_FIELDS = {
    etype: tuple(c.name for c in cols if c.name in _SEQUENCE_FIELDS + _JSON_COLUMNS)
    for etype, cols in schema.EVENT_FIELDS.items()
}


def _snapshot(name: str, value: Any) -> Any:
    """What the background thread will encode: dicts copied shallowly, array-likes made lists, lists as given."""
    kind = type(value)
    if kind is list or kind is tuple or kind is str:
        return value
    if kind is dict:
        return value.copy()
    if name in _JSON_COLUMNS:
        return value  # another JSON value: the encoder deals with it
    tolist = getattr(value, "tolist", None)  # numpy arrays, torch tensors: a copy, which also freezes them
    if tolist is not None:
        return tolist()
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{name} should be a list of numbers, got {kind.__name__}") from None


def _finite(value: Any) -> Any:
    """NaN and infinities (not JSON) inside a free-form value, as their repr() text."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default_or_repr(value: Any) -> Any:
    try:
        return _json_default(value)
    except TypeError:
        return repr(value)


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
_LIVE: "weakref.WeakSet[_Pipeline]" = weakref.WeakSet()  # for the one atexit and at-fork hook
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


class _Pipeline:
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
        self.spool_max_bytes = spool_max_bytes
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
            _close_producer(producer, timeout=0.0)

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
            _close_producer(self.producers.drop(), timeout=0 if self._down else 1)
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


# ---------------------------------------------------------------------------------------------
# Encoding (background thread): event id, redaction, caps, JSON, validation
# ---------------------------------------------------------------------------------------------
class _Encoder:
    """A host's record -> (key, payload) for Kafka, on the background thread; None when it is dropped (counted in
    `counts`, warned once per kind). `over_cap(what, record, size)` says whether a payload is over the topic's
    record cap (the pipeline's producer learns it), and names the record in a DLQ notice when it is."""

    def __init__(self, counts: Counters, warn: WarnOnce, over_cap: Callable[[str, dict[str, Any], int], bool],
                 redact: Redactor | None, validate: Callable[[Any], Any],
                 id_field: str, columns: tuple[schema.Col, ...], wire_format: str = "packed") -> None:
        self._counts = counts
        self._warn = warn
        self._over_cap = over_cap
        self._redact = redact
        self._validate = validate
        self._id_field = id_field
        self._columns = columns  # for schema.check_limits: EVENT_COLUMNS or OUTCOME_COLUMNS
        self._wire_format = wire_format  # ingest/wire.py: "packed" (schema v3) or "json" (v2, token lists as JSON)

    def __call__(self, record: dict[str, Any]) -> tuple[bytes, bytes] | None:
        for name in [k for k, v in record.items() if v is None]:
            del record[name]  # optional fields not given
        record.setdefault(self._id_field, uuid.uuid4().hex)
        what = record.get("type", "outcome")
        for name in _SEQUENCE_FIELDS:
            value = record.get(name)
            if value is not None and not isinstance(value, list):
                record[name] = value.tolist() if hasattr(value, "tolist") else list(value)
        truncated: list[str] = list(record.get("truncated") or [])
        self._cap_text(record, truncated)
        for name in _JSON_COLUMNS:
            value = record.get(name)
            if value is not None:
                record[name] = self._json_value(what, name, value, truncated)
        if truncated:
            self._counts.truncated += 1
            record["truncated"] = sorted(set(truncated))
        return self._payload(what, record)

    def _cap_text(self, record: dict[str, Any], truncated: list[str]) -> None:
        """Redact the free-text fields and cut every string at MAX_TEXT_CHARS, naming what was cut."""
        for name, value in list(record.items()):
            if isinstance(value, str):
                if self._redact is not None and name in _TEXT_FIELDS:
                    value = self._redact(value)
                if len(value) > schema.MAX_TEXT_CHARS:
                    value = value[: schema.MAX_TEXT_CHARS]
                    truncated.append(name)
                record[name] = value

    def _json_value(self, what: str, name: str, value: Any, truncated: list[str]) -> Any:
        """A JSON field as plain JSON: non-JSON values as their repr(), nothing nested deeper than
        schema.MAX_JSON_DEPTH (deeper containers become a short repr()), redacted, capped by its text."""
        text = self._json_text(what, name, value, truncated)
        value = json.loads(text)
        if text.count("[") + text.count("{") >= schema.MAX_JSON_DEPTH:  # fewer containers cannot nest that deep
            value, clipped = _clip_depth(value)
            if clipped:
                self._too_deep(what, name, truncated)
                text = json.dumps(value)
        if self._redact is not None:
            value = redact_json(value, self._redact)
            # The cap below cuts the text: it must be the redacted text, or a secret survives in the prefix.
            # Below half the cap the default redactor (placeholders about as long as what they replace) cannot
            # push it over, so the common small field is not encoded twice.
            if len(text) > schema.MAX_TEXT_CHARS // 2:
                text = json.dumps(value)
        if len(text) > schema.MAX_TEXT_CHARS:
            value = text[: schema.MAX_TEXT_CHARS]  # a prefix of its JSON text, flagged as cut
            truncated.append(name)
        return value

    def _json_text(self, what: str, name: str, value: Any, truncated: list[str]) -> str:
        try:
            return json.dumps(value, default=_json_default, allow_nan=False)
        except RecursionError:  # nested past the interpreter's recursion limit: cut it first
            value, _ = _clip_depth(value)
            self._too_deep(what, name, truncated)
        except (TypeError, ValueError) as exc:
            self._counts.coerced += 1
            self._warn(f"json:{what}:{name}", "sdk: %s %s is not JSON serialisable (%s); such values are stored "
                      "as their repr() text", what, name, exc)
            value, clipped = _clip_depth(value)  # also unrolls a circular reference only down to the limit
            if clipped:
                self._too_deep(what, name, truncated)
        try:  # keep the structure, replace only the values JSON cannot hold
            return json.dumps(_finite(value), default=_json_default_or_repr, allow_nan=False)
        except (TypeError, ValueError, RecursionError):  # keys JSON cannot hold: nothing structured to keep
            return json.dumps(_SHORT_REPR.repr(value))

    def _too_deep(self, what: str, name: str, truncated: list[str]) -> None:
        self._counts.limited += 1
        truncated.append(name)
        self._warn(f"limit:too_deep:{what}:{name}", "sdk: %s %s nested deeper than schema.MAX_JSON_DEPTH=%d; what "
                   "lies deeper is stored as a short repr() text and the field is named in `truncated`", what, name,
                  schema.MAX_JSON_DEPTH)

    def _payload(self, what: str, record: dict[str, Any]) -> tuple[bytes, bytes] | None:
        """(key, value) for Kafka once the record passes the schema and the size bound; None (counted) if not."""
        try:
            self._validate(_without_numeric_lists(record, what))
            # The lake writer's limits (it would dead-letter the record): the JSON fields were cut to them above,
            # what is left (token counts, int, float and timestamp ranges) cannot be cut without lying: drop.
            schema.check_limits({k: v for k, v in record.items() if k not in _JSON_COLUMNS}, self._columns)
            # allow_nan=False: NaN/Infinity are not JSON, and the lake writer's strict parser would reject the record.
            # Packed (v3), the token lists become base64 of int32/float32: under half JSON's encoding time here
            # (44 vs 105 us per bench llm_call) and a fraction of the lake writer's decoding (docs/lake.md).
            payload = wire.encode(record, self._wire_format, default=_json_default)
        except schema.LimitError as exc:
            self._counts.invalid += 1
            self._counts.limited += 1
            self._warn(f"limit:{exc.reason}:{what}", "sdk: %s dropped, past a schema limit (%s): %s",
                      what, exc.reason, exc)
            return None
        except (schema.SchemaError, TypeError, ValueError, OverflowError) as exc:
            self._counts.invalid += 1
            self._warn(f"invalid:{what}:{str(exc)[:40]}", "sdk: %s dropped: %s", what, exc)
            return None
        key = str(record.get("session_id", "")).encode()
        if self._over_cap(what, record, len(payload) + len(key)):
            return None
        return key, payload


_LIST_KINDS = {c.name: c.kind for c in schema.EVENT_COLUMNS if c.kind in ("ints", "floats")}
# The lake stores token ids as int32 (schema.arrow_type("ints")): packing them into a 32-bit array checks the
# range in the same C pass that checks the type.
_INT32 = next(code for code in "il" if array.array(code).itemsize == 4)
# Not schema.short_repr: that one is for error messages (50 characters); this one stores what a value looked
# like in place of what lies too deep, so it keeps more of it.
_SHORT_REPR = reprlib.Repr()  # bounded output, and no recursion past its maxlevel (a repr() of a deep value has both)
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 3, 200, 200


def _clip_depth(value: Any, depth: int = 1) -> tuple[Any, bool]:
    """`value` as dicts and lists, every container nested deeper than schema.MAX_JSON_DEPTH (1 is {"a": 1})
    replaced by a short repr() of it; and whether any was. Recurses at most MAX_JSON_DEPTH + 1 frames."""
    is_dict = isinstance(value, dict)
    if not is_dict and not isinstance(value, (list, tuple, set, frozenset)):
        return value, False
    if depth > schema.MAX_JSON_DEPTH:
        return _SHORT_REPR.repr(value), True
    clipped = False
    if is_dict:
        out: dict[Any, Any] = {}
        for key, item in value.items():
            out[key], cut = _clip_depth(item, depth + 1)
            clipped = clipped or cut
        return out, clipped
    items = []
    for item in value:
        item, cut = _clip_depth(item, depth + 1)
        items.append(item)
        clipped = clipped or cut
    return items, clipped


def _without_numeric_lists(record: dict[str, Any], what: str) -> dict[str, Any]:
    """Check the token-id and logprob lists in C (array.array), and return a copy without them.

    schema.validate_event checks every element in a Python generator: ~1 us per token, which on a
    long prompt is most of the background thread's time (and GIL the host waits for). The copy keeps
    the schema's own check of every other field; the list rules are the schema's, applied here.
    """
    lists = {name: record[name] for name in _LIST_KINDS if record.get(name) is not None}
    if not lists:
        return record
    for name, value in lists.items():
        kind = _LIST_KINDS[name]
        if not isinstance(value, list):
            raise schema.SchemaError(f"{what} event: field {name!r} should be {kind}, got {type(value).__name__}")
        try:
            packed = array.array(_INT32 if kind == "ints" else "d", value)
        except TypeError as exc:
            raise schema.SchemaError(f"{what} event: field {name!r} should be {kind} ({exc})") from None
        except OverflowError:
            raise schema.LimitError("int_out_of_range", f"{what} event: field {name!r} holds a token id outside int32, "
                                    "the lake's column type") from None
        if kind == "floats" and packed:
            total = sum(packed)  # NaN propagates; only then look for it element by element
            if total != total and any(x != x for x in packed):
                raise schema.SchemaError(f"{what} event: field {name!r} holds NaN")
    if what == "llm_call" and "completion_logprobs" in lists and "completion_token_ids" in lists:
        n_lp, n_tok = len(lists["completion_logprobs"]), len(lists["completion_token_ids"])
        if n_lp != n_tok:
            raise schema.SchemaError(f"llm_call event: completion_logprobs has {n_lp} values for {n_tok} "
                                     "completion tokens")
    light = dict(record)
    for name in lists:
        light[name] = []
    return light


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------
# The sessions entered with `with`/`async with` in this context (thread or asyncio task), innermost last. An
# immutable tuple rather than a Token per entry: a Session shared by concurrent tasks, or exited in another
# context than it was entered in, can then neither raise into the host nor unset another task's session.
_ENTERED: contextvars.ContextVar[tuple["Session", ...]] = contextvars.ContextVar("flywheel_sessions", default=())


def current_session() -> "Session | None":
    """The innermost Session entered (`with`/`async with`) in this thread or asyncio task, else None.

    A task created inside `with s:` starts with s as its current session (asyncio copies the context);
    a thread starts with none.
    """
    entered = _ENTERED.get()
    return entered[-1] if entered else None


class _Client:
    """What SessionLogger and OutcomeReporter share: bootstrap resolution and the pipeline."""

    _topic_default = schema.EVENTS_TOPIC
    _id_field = "event_id"
    _columns = schema.EVENT_COLUMNS

    def __init__(
        self,
        bootstrap: str | None = None,
        topic: str | None = None,
        *,
        name: str | None = None,
        spool_dir: str | Path | None = None,
        max_queue: int = 20_000,
        batch_max: int = 500,
        linger_s: float = 0.01,
        spool_max_bytes: int = 256 * 1024 * 1024,
        compression: str | None = "lz4",
        outage_after_s: float = 2.0,
        retry_s: float = 1.0,
        inflight_wait_s: float = 3.0,
        metrics_interval_s: float = 60.0,
        exit_timeout_s: float = 5.0,
        redact: Redactor | None = redact_text,
        producer_config: dict[str, Any] | None = None,
        sample_rate: float | None = None,
        wire_format: str = "packed",
        journal_dir: str | Path | None = None,
    ) -> None:
        if wire_format not in wire.FORMATS:
            _warn_setting("wire_format", wire_format, f"not one of {wire.FORMATS}; packed is used")
            wire_format = "packed"
        self.topic = topic or self._topic_default
        self.bootstrap = _resolve_bootstrap(bootstrap)
        self.name = name or _default_name()
        self.sample_rate = _resolve_sample_rate(sample_rate)
        self.sampled_out = 0  # sessions (SessionLogger) or outcomes (OutcomeReporter) not logged by sample_rate
        self._pipe: _Pipeline | None = None
        if not _env_enabled():
            log.warning("sdk: %s=%s; %s logs nothing", ENABLED_ENV, os.environ.get(ENABLED_ENV), type(self).__name__)
            return
        if self.bootstrap is None:
            log.warning("sdk: no Kafka bootstrap given (argument or %s); %s logs nothing",
                        BOOTSTRAP_ENV, type(self).__name__)
            return
        if compression == "lz4":
            try:
                import lz4.frame  # noqa: F401  (kafka-python needs it for lz4)
            except ImportError:
                compression = "gzip"  # stdlib; slower, but never a reason not to log
        counts, warn = Counters(), WarnOnce()  # one of each, for the pipeline and its encoder

        def over_cap(what: str, record: dict[str, Any], size: int) -> bool:  # the cap the pipeline's producer learns
            return self._pipe is not None and self._pipe.over_cap(what, record, size)

        encoder = _Encoder(counts, warn, over_cap, redact, self._validate, self._id_field, self._columns, wire_format)
        self._pipe = _Pipeline(
            self.bootstrap, self.topic, encoder, name=self.name, spool_dir=spool_dir, max_queue=max_queue,
            batch_max=batch_max, linger_s=linger_s, spool_max_bytes=spool_max_bytes, compression=compression,
            outage_after_s=outage_after_s, retry_s=retry_s, inflight_wait_s=inflight_wait_s,
            metrics_interval_s=metrics_interval_s,
            exit_timeout_s=exit_timeout_s, producer_config=producer_config, counts=counts, warn=warn,
        )
        if journal_dir is not None:
            self._open_journal(Path(journal_dir))

    def _open_journal(self, directory: Path) -> None:
        """Journal every record before the log call returns (ingest/journal.py); log an earlier process's first."""
        assert self._pipe is not None
        try:
            journal = Journal(directory, self._id_field)
        except (OSError, JournalLocked) as exc:
            log.warning("sdk: %s: journal %s not opened (%s); records are logged without it", self.name, directory, exc)
            return
        earlier = journal.leftovers()
        self._pipe.journal = journal
        for record in earlier:  # journalled again, now in this process's segment, before the old ones go
            self._pipe.put(record)
        journal.drop_leftovers()
        if earlier:
            log.warning("sdk: %s: %d records an earlier process journalled and may not have delivered are logged "
                        "again (copies land once: the lake de-duplicates by %s)",
                        self.name, len(earlier), self._id_field)
        journal.start(self._pipe.flush)

    @staticmethod
    def _validate(record: Any) -> Any:
        return schema.validate_event(record)

    @property
    def enabled(self) -> bool:
        return self._pipe is not None

    def metrics(self) -> dict[str, Any]:
        """Counters: enqueued, sent, spilled, replayed, dropped, invalid ... ({"enabled": False} when disabled)."""
        if self._pipe is None:
            return {"enabled": False}
        journal = self._pipe.journal.metrics() if self._pipe.journal is not None else {}
        return {**self._pipe.metrics(), **journal, "sampled_out": self.sampled_out}

    def flush(self, timeout: float = 10.0) -> bool:
        """Block until everything logged so far reached Kafka (True) or timeout (False)."""
        return True if self._pipe is None else self._pipe.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what can be delivered within timeout, spill the rest to disk; later calls are dropped."""
        if self._pipe is not None:
            self._pipe.close(timeout)
            if self._pipe.journal is not None:  # what was delivered leaves the journal; what was spooled stays too
                self._pipe.journal.close(self._pipe.flush)

    def __enter__(self) -> "_Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SessionLogger(_Client):
    """Logs agent sessions to Kafka (flywheel.events). Thread-safe; one per process is enough.

    Options (keyword, defaults in brackets):
      name            logger name [the program's name]; the spool is per name and topic, so a restarted
                      process of the same name replays what an earlier one spooled
      spool_dir       [<root>/<name>@<topic>, root: FLYWHEEL_SPOOL_DIR, else $XDG_STATE_HOME/flywheel/spool,
                      else ~/.local/state/flywheel/spool]  spool_max_bytes  [256 MiB; oldest dropped beyond]
      max_queue       records held in memory [20,000]; beyond, new records are dropped and counted
      batch_max       records per background batch [500]
      linger_s        background wake-up [0.01]; short, so queued records are encoded and freed before
                      the garbage collector promotes them (which makes the host's full collections frequent)
      outage_after_s  no acknowledgement for this long = broker down, spill to disk [2.0]
      retry_s         how often a down broker is retried [1.0]
      inflight_wait_s once the broker listens again, how long sends from before the outage may take to
                      resolve before the producer is replaced and they are re-sent from the spool [3.0]
      compression     producer compression [lz4; gzip when the lz4 package is missing]
      redact          Callable[[str], str] applied to text fields [flywheel.ingest.redact.redact_text]; None: off
      sample_rate     share of sessions logged, whole sessions by a hash of session_id [FLYWHEEL_SAMPLE_RATE, else 1.0]
      metrics_interval_s [60]   exit_timeout_s  how long the exit hook may deliver [5]
      producer_config extra KafkaProducer settings
      journal_dir     write every record into this directory before the log call returns, so a SIGKILL of the
                      host loses nothing it logged (ingest/journal.py; the capture proxy uses it) [None: off]
      wire_format     "packed" (schema v3: token ids and logprobs as base64 of int32/float32) or "json" (v2: JSON
                      lists, for a lake writer older than v3) [packed]; ingest/wire.py
    FLYWHEEL_ENABLED=0 makes it a no-op (one warning), whatever the arguments.
    """

    def __init__(self, bootstrap: str | None = None, topic: str | None = None, **options: Any) -> None:
        super().__init__(bootstrap, topic, **options)
        self._seqs: dict[str, itertools.count[int]] = {}
        self._seq_lock = threading.Lock()

    def _seq_for(self, agent_id: str) -> Any:
        counter = self._seqs.get(agent_id)
        if counter is None:
            with self._seq_lock:
                counter = self._seqs.setdefault(agent_id, itertools.count())
        return counter

    def session(self, task_type: str = "unknown", tags: dict[str, Any] | None = None, session_id: str | None = None,
                agent_id: str = MAIN_AGENT) -> "Session":
        """Start a session (emits session_start); use as `with log.session(...) as s:` (or `async with`) to emit
        session_end when the block ends: ok, or error when it raises."""
        s = Session(self, session_id or uuid.uuid4().hex, agent_id, None, owns_lifecycle=True)
        if s._pipe is None and self._pipe is not None:
            self.sampled_out += 1
        s.start(task_type, tags)
        return s

    def attach(self, session_id: str, agent_id: str = MAIN_AGENT, parent_agent_id: str | None = None,
               task_type: str | None = None) -> "Session":
        """Log into an existing session (started by another process or thread); emits nothing by itself.

        `task_type` is only for `headers()` (the proxy's task header); the session's own is in its session_start.
        """
        s = Session(self, session_id, agent_id, parent_agent_id, owns_lifecycle=False)
        s.task_type = task_type
        return s


class Session:
    """One agent (main or sub-agent) inside one session. Every method is non-blocking and never raises."""

    def __init__(self, logger: SessionLogger, session_id: Any, agent_id: Any, parent_agent_id: str | None,
                 owns_lifecycle: bool, parent: "Session | None" = None) -> None:
        self.session_id = str(session_id)
        self.agent_id = str(agent_id)
        self.parent_agent_id = parent_agent_id
        self._logger = logger
        self._pipe = logger._pipe if _sampled(self.session_id, logger.sample_rate) else None
        self._seq = logger._seq_for(self.agent_id)
        self._owns_lifecycle = owns_lifecycle
        self._parent = parent
        self._ended = False
        self.task_type: str | None = parent.task_type if parent is not None else None

    @property
    def sampled(self) -> bool:
        """Whether this session is logged (False: sampled out by sample_rate, or the logger is a no-op)."""
        return self._pipe is not None

    def headers(self) -> dict[str, str]:
        """The capture proxy's headers for this agent of this session, for requests made on its behalf.

        Empty when the session is not logged (sampled out, FLYWHEEL_ENABLED=0, no bootstrap): the proxy would
        otherwise log its model calls without the rest of the session, half a session that trains on nothing.
        """
        if self._pipe is None:
            return {}
        headers = {HEADER_SESSION_ID: self.session_id, HEADER_AGENT_ID: self.agent_id}
        if self.parent_agent_id is not None:
            headers[HEADER_PARENT_AGENT_ID] = str(self.parent_agent_id)
        if self.task_type and self.task_type != "unknown":  # "unknown" is the default, not something known
            headers[HEADER_TASK_TYPE] = str(self.task_type)
        return headers

    # ---------------------------------------------------------------- hot path
    def _emit(self, etype: str, fields: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        pipe = self._pipe
        if pipe is None:
            return
        try:
            if extra:
                pipe.warn(f"unknown:{etype}:{sorted(extra)}", "sdk: %s got unknown field(s) %s; they are not logged "
                          "(schema v%d is closed)", etype, sorted(extra), schema.SCHEMA_VERSION)
            for name in _REQUIRED[etype]:
                if fields.get(name) is None:
                    pipe.counts.invalid += 1
                    pipe.warn(f"missing:{etype}:{name}", "sdk: %s without required %r; event dropped", etype, name)
                    return
            # Dicts (tool arguments, tags) are copied: agents reuse them right after the call. Token-id lists
            # are not: copying 1,000 ids would double the call's cost, so they must not be mutated after the
            # call (fresh lists from a tokenizer or an HTTP reply, the common case, are fine).
            for name in _SNAPSHOT_FIELDS[etype]:
                value = fields.get(name)
                if value is not None:
                    fields[name] = _snapshot(name, value)
            # One dict build; None values are dropped by the background encoder, not here.
            pipe.put({
                "schema_version": schema.SCHEMA_VERSION,
                "session_id": self.session_id,
                "agent_id": self.agent_id,
                "parent_agent_id": self.parent_agent_id,
                "seq": next(self._seq),
                "ts": schema.now_ts(),
                "type": etype,
                **fields,
            })
        except Exception as exc:  # the SDK's own bug must never reach the agent
            pipe.counts.invalid += 1
            pipe.warn(f"emit:{etype}", "sdk: %s could not be enqueued (%s); event dropped", etype, exc)

    def start(self, task_type: str = "unknown", tags: dict[str, Any] | None = None, **extra: Any) -> None:
        """Emit session_start (done by SessionLogger.session(); call it yourself after attach())."""
        self.task_type = task_type
        self._emit("session_start", {"task_type": task_type, "tags": tags}, extra)

    def end(self, status: str = "ok", **extra: Any) -> None:
        """Emit session_end once (later calls are ignored)."""
        if self._ended:
            return
        self._ended = True
        self._emit("session_end", {"status": status}, extra)

    def llm_call(
        self,
        model: str | None = None,
        policy_version: int | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        completion_token_ids: Sequence[int] | None = None,
        completion_logprobs: Sequence[float] | None = None,
        *,
        finish_reason: str | None = None,
        latency_s: float | None = None,
        sampling: dict[str, Any] | None = None,
        prompt_text: str | None = None,
        completion_text: str | None = None,
        group_id: str | None = None,
        request_id: str | None = None,
        arm: str | None = None,
        **extra: Any,
    ) -> None:
        """One model call with the exact token ids the server saw and sampled, and their behaviour logprobs.

        The lists are kept by reference until the background thread encodes them (milliseconds): do not
        mutate them after the call (numpy arrays and tensors are converted, which copies them).
        """
        self._emit("llm_call", {
            "model": model, "policy_version": policy_version, "prompt_token_ids": prompt_token_ids,
            "completion_token_ids": completion_token_ids, "completion_logprobs": completion_logprobs,
            "finish_reason": finish_reason, "latency_s": latency_s, "sampling": sampling, "prompt_text": prompt_text,
            "completion_text": completion_text, "group_id": group_id, "request_id": request_id, "arm": arm,
        }, extra)

    def tool_call(self, name: str | None = None, arguments: Any = None, call_id: str | None = None,
                  malformed: bool | None = None, malformed_token: int | None = None, **extra: Any) -> str:
        """Log a tool call; returns its call_id (pass it to tool_result).

        For a call the harness could not use (malformed=True), malformed_token is the index, in the completion
        token ids of the llm_call that wrote it, of the first token past what still read as a call: the
        malformed-call penalty is then charged from that token on instead of to the whole reply."""
        call_id = call_id or uuid.uuid4().hex[:16]
        self._emit("tool_call", {"call_id": call_id, "name": name, "arguments": arguments, "malformed": malformed,
                                 "malformed_token": malformed_token}, extra)
        return call_id

    def tool_result(self, call_id: str | None = None, ok: bool | None = None, output: str | None = None,
                    name: str | None = None, **extra: Any) -> None:
        """Log a tool's result (output is redacted and capped at schema.MAX_TEXT_CHARS)."""
        if output is not None and not isinstance(output, str):
            output = repr(output)  # a tool returned an object: keep what it looked like
        self._emit("tool_result", {"call_id": call_id, "ok": ok, "output": output, "name": name}, extra)

    def spawn_subagent(self, subtask: str | None = None, agent_id: str | None = None, **extra: Any) -> "Session":
        """Emit subagent_spawn here and return the child's Session (its own agent_id, this agent as parent).

        Call child.finish(ok) when it is done (or use it as a context manager).
        """
        child_id = agent_id or f"sub-{uuid.uuid4().hex[:10]}"
        self._emit("subagent_spawn", {"child_agent_id": child_id, "subtask": subtask}, extra)
        return Session(self._logger, self.session_id, child_id, self.agent_id, owns_lifecycle=False, parent=self)

    def finish(self, ok: bool = True) -> None:
        """For a sub-agent: emit subagent_finish on the parent (once)."""
        if self._parent is None or self._ended:
            return
        self._ended = True
        self._parent._emit("subagent_finish", {"child_agent_id": self.agent_id, "ok": bool(ok)})

    def context_edit(self, edit_kind: str | None = None, tokens_removed: int | None = None,
                     summary_token_ids: Sequence[int] | None = None, **extra: Any) -> None:
        """The agent summarised or pruned its context (edit_kind summarize | prune)."""
        self._emit("context_edit", {"edit_kind": edit_kind, "tokens_removed": tokens_removed,
                                    "summary_token_ids": summary_token_ids}, extra)

    def _enter_current(self) -> None:
        _ENTERED.set(_ENTERED.get() + (self,))

    def _leave_current(self) -> None:
        """Drop this session's innermost entry in this context; a no-op where it was never entered."""
        entered = _ENTERED.get()
        for i in range(len(entered) - 1, -1, -1):
            if entered[i] is self:
                _ENTERED.set(entered[:i] + entered[i + 1:])
                return

    def __enter__(self) -> "Session":
        self._enter_current()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._leave_current()
        if self._parent is not None:
            self.finish(ok=exc_type is None)
        elif self._owns_lifecycle:
            self.end("error" if exc_type is not None else "ok")

    # `async with log.session() as s:`. session() has emitted session_start before these are looked up, so they
    # only enter and leave, like the sync pair; without them `async with` raised TypeError after session_start.
    async def __aenter__(self) -> "Session":
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)


def _session_header_pairs() -> list[tuple[str, str]]:
    """The current session's headers as (name, value), or none where one cannot go into an HTTP header."""
    session = current_session()
    if session is None:
        return []
    pairs = list(session.headers().items())
    if all(v.isascii() and v.isprintable() for _, v in pairs):
        return pairs
    pipe = session._pipe
    if pipe is not None:
        pipe.warn("headers:non-ascii", "sdk: session %r has ids an HTTP header cannot carry; its requests go "
                  "without flywheel headers (the proxy does not log them)", session.session_id)
    return []


def _add_session_headers(request: Any) -> None:
    """httpx request hook: the current session's headers, where the request does not set them itself."""
    try:
        for name, value in _session_header_pairs():
            if name not in request.headers:
                request.headers[name] = value
    except Exception as exc:  # the SDK never breaks its host's requests
        log.debug("sdk: session headers not added (%s)", exc)


async def _add_session_headers_async(request: Any) -> None:
    _add_session_headers(request)


def wrap_openai(client: _C) -> _C:
    """Make an openai client (`OpenAI` or `AsyncOpenAI`; or an `httpx.Client`/`AsyncClient`) send the current
    session's headers (`Session.headers()`) on every request; returns the same client, instrumented in place.

        client = wrap_openai(openai.OpenAI(base_url="http://proxy:8100/v1"))
        async with log.session(task_type="code_edit"):
            await aclient.chat.completions.create(...)   # carries X-Flywheel-Session-Id ...

    The session is looked up per request (`current_session()`), so one client serves every thread and task;
    outside a session a request carries none. Headers a request sets itself win. Copies made with
    `client.with_options(...)` share its HTTP client, so they carry the headers too. openai is never imported.
    """
    # openai keeps its httpx client in `_client` (every release since 1.0); an httpx request hook sees the
    # request after openai built it and before it is sent, in the caller's thread or task.
    http = client if hasattr(client, "event_hooks") else getattr(client, "_client", None)
    hooks = getattr(http, "event_hooks", None)
    if http is None or not isinstance(hooks, dict):
        raise TypeError(f"wrap_openai: {type(client).__name__} is neither an openai client nor an httpx client")
    hook = (_add_session_headers_async if inspect.iscoroutinefunction(getattr(http, "send", None))
            else _add_session_headers)
    requests = list(hooks.get("request", []))
    if hook not in requests:  # wrapping twice adds nothing
        http.event_hooks = {**hooks, "request": [*requests, hook]}
    return client


class OutcomeReporter(_Client):
    """Reports outcomes (flywheel.outcomes) from any process, at any later time; same non-blocking machinery.

    Takes SessionLogger's options. With sample_rate (or FLYWHEEL_SAMPLE_RATE) below 1 it drops the outcomes of
    exactly the sessions a SessionLogger of the same rate drops (the same hash of session_id in every process).
    """

    _topic_default = schema.OUTCOMES_TOPIC
    _id_field = "outcome_id"
    _columns = schema.OUTCOME_COLUMNS

    @staticmethod
    def _validate(record: Any) -> Any:
        return schema.validate_outcome(record)

    def report(self, session_id: str, kind: str, value: float, agent_id: str | None = None,
               source: str | None = None, ts: str | None = None, outcome_id: str | None = None,
               call_id: str | None = None) -> str:
        """Enqueue one outcome; returns its outcome_id. Never raises (bad input is warned and counted).

        `agent_id` narrows the outcome to one agent of the session (a sub-agent's own check), `call_id` to one
        tool call (the call_id `Session.tool_call` returned): a turn-level check, which gives the llm_call that
        produced the call its own reward where rewards.toml lists the kind in the task type's turn_kinds.

        Pass `outcome_id` when the same outcome may be reported again (a source that re-sends after a
        crash): the episode builder keeps the first copy of an id, so a re-send is then a duplicate.
        """
        outcome_id = outcome_id or uuid.uuid4().hex
        pipe = self._pipe
        if pipe is None:
            return outcome_id
        try:
            if self.sample_rate < 1.0 and not _sampled(str(session_id), self.sample_rate):
                self.sampled_out += 1  # its session's events were never logged: the outcome would reward nothing
                return outcome_id
            record = {"schema_version": schema.SCHEMA_VERSION, "outcome_id": outcome_id, "session_id": session_id,
                      "kind": kind, "value": value, "ts": ts or schema.now_ts()}
            if agent_id is not None:
                record["agent_id"] = agent_id
            if call_id is not None:
                record["call_id"] = call_id
            if source is not None:
                record["source"] = source
            for name in _OUTCOME_REQUIRED:
                if record.get(name) is None:
                    pipe.counts.invalid += 1
                    pipe.warn(f"missing:outcome:{name}", "sdk: outcome without required %r; dropped", name)
                    return outcome_id
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                try:
                    record["value"] = float(value)
                except (TypeError, ValueError):
                    pipe.counts.invalid += 1
                    pipe.warn("outcome:value", "sdk: outcome value %r is not a number; dropped", value)
                    return outcome_id
            pipe.put(record)
        except Exception as exc:
            pipe.counts.invalid += 1
            pipe.warn("outcome:emit", "sdk: outcome could not be enqueued (%s); dropped", exc)
        return outcome_id
