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

This module is the public API (SessionLogger, Session, OutcomeReporter, wrap_openai, the settings read from the
environment). Behind it, one module per concern, sharing one Counters object and one WarnOnce
(ingest/sdk_counters.py): delivery, the queue, background thread, send, spill and replay (sdk_delivery.py);
encoding (sdk_encoding.py); the producer's life (sdk_producer.py); the spools (sdk_spools.py).
"""

from __future__ import annotations

import contextvars
import inspect
import itertools
import logging
import math
import os
import sys
import threading
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, Sequence, TypeVar

from flywheel.ingest import schema, wire
from flywheel.ingest.journal import Journal, JournalLocked
from flywheel.ingest.redact import Redactor, redact_text
from flywheel.ingest.sdk_counters import Counters, WarnOnce
from flywheel.ingest.sdk_delivery import Pipeline
from flywheel.ingest.sdk_encoding import JSON_COLUMNS, SEQUENCE_FIELDS, Encoder
from flywheel.ingest.sdk_spools import SPOOL_DIR_ENV as SPOOL_DIR_ENV
from flywheel.ingest.sdk_spools import default_journal_dir as default_journal_dir
from flywheel.ingest.sdk_spools import default_spool_dir as default_spool_dir
from flywheel.ingest.sdk_spools import default_spool_root as default_spool_root
from flywheel.ingest.sdk_spools import name_component

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

_REQUIRED = {
    etype: tuple(c.name for c in cols if c.required) for etype, cols in schema.EVENT_FIELDS.items()
}
_OUTCOME_REQUIRED = tuple(c.name for c in schema.OUTCOME_COLUMNS if c.required)


def _resolve_bootstrap(bootstrap: str | None) -> str | None:
    return bootstrap if bootstrap else (os.environ.get(BOOTSTRAP_ENV) or None)


def _default_name() -> str:
    """The program's name, without the pid: stable across restarts, so a restarted agent finds its spool."""
    path = Path(sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-") else "python")
    stem = path.parent.name if path.stem == "__main__" else path.stem  # `python -m pkg`: the package
    return name_component(stem)


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


# Per event type, the fields _snapshot() looks at (only those: this runs on the hot path).
_SNAPSHOT_FIELDS = {
    etype: tuple(c.name for c in cols if c.name in SEQUENCE_FIELDS + JSON_COLUMNS)
    for etype, cols in schema.EVENT_FIELDS.items()
}


def _snapshot(name: str, value: Any) -> Any:
    """What the background thread will encode: dicts copied shallowly, array-likes made lists, lists as given."""
    kind = type(value)
    if kind is list or kind is tuple or kind is str:
        return value
    if kind is dict:
        return value.copy()
    if name in JSON_COLUMNS:
        return value  # another JSON value: the encoder deals with it
    tolist = getattr(value, "tolist", None)  # numpy arrays, torch tensors: a copy, which also freezes them
    if tolist is not None:
        return tolist()
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{name} should be a list of numbers, got {kind.__name__}") from None


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
        self._pipe: Pipeline | None = None
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

        encoder = Encoder(counts, warn, over_cap, redact, self._validate, self._id_field, self._columns, wire_format)
        self._pipe = Pipeline(
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
    def _emit(self, etype: str, fields: dict[str, Any], extra: dict[str, Any] | None = None,
              ts: str | None = None, event_id: str | None = None) -> None:
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
            record = {
                "schema_version": schema.SCHEMA_VERSION,
                "session_id": self.session_id,
                "agent_id": self.agent_id,
                "parent_agent_id": self.parent_agent_id,
                "seq": next(self._seq),
                "ts": ts or schema.now_ts(),
                "type": etype,
                **fields,
            }
            if event_id is not None:
                record["event_id"] = event_id  # else the encoder draws one
            pipe.put(record)
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
        policy_version_alt: int | None = None,
        **extra: Any,
    ) -> None:
        """One model call with the exact token ids the server saw and sampled, and their behaviour logprobs.

        policy_version_alt: the other version the call may have been served by, when the server's weights
        changed during it (policy_version is then the older one; see the schema).

        The lists are kept by reference until the background thread encodes them (milliseconds): do not
        mutate them after the call (numpy arrays and tensors are converted, which copies them).
        """
        self._emit("llm_call", {
            "model": model, "policy_version": policy_version, "prompt_token_ids": prompt_token_ids,
            "completion_token_ids": completion_token_ids, "completion_logprobs": completion_logprobs,
            "finish_reason": finish_reason, "latency_s": latency_s, "sampling": sampling, "prompt_text": prompt_text,
            "completion_text": completion_text, "group_id": group_id, "request_id": request_id, "arm": arm,
            "policy_version_alt": policy_version_alt,
        }, extra)

    def traced_llm_call(self, model: str | None = None, *, policy_version: int | None = None,
                        provider: str | None = None, input_tokens: int | None = None,
                        output_tokens: int | None = None, finish_reason: str | None = None,
                        latency_s: float | None = None, sampling: dict[str, Any] | None = None,
                        prompt_text: str | None = None, completion_text: str | None = None,
                        request_id: str | None = None, arm: str | None = None, trace_id: str | None = None,
                        span_id: str | None = None, **extra: Any) -> None:
        """A model call known without its token ids or logprobs (a hosted model, a trace): schema v5.

        The learner does not train on it; the gate counts its session and the lake keeps its text."""
        self._emit("traced_llm_call", {
            "model": model, "policy_version": policy_version, "provider": provider, "input_tokens": input_tokens,
            "output_tokens": output_tokens, "finish_reason": finish_reason, "latency_s": latency_s,
            "sampling": sampling, "prompt_text": prompt_text, "completion_text": completion_text,
            "request_id": request_id, "arm": arm, "trace_id": trace_id, "span_id": span_id}, extra)

    def record(self, etype: str, fields: dict[str, Any], *, ts: str | None = None,
               event_id: str | None = None) -> None:
        """Emit one event of type `etype` with `fields`, at time `ts` (a wire timestamp; default now) and with
        `event_id` (default: a fresh one). For importers that replay what happened elsewhere, such as the OTLP
        receiver: the event keeps its own time, and a stable id makes a re-sent import a duplicate the lake writer
        drops. Unknown types and fields are dropped and counted like any invalid event."""
        if etype not in _REQUIRED:
            if self._pipe is not None:
                self._pipe.counts.invalid += 1
                self._pipe.warn(f"type:{etype}", "sdk: unknown event type %r; event dropped", etype)
            return
        known = {c.name for c in schema.EVENT_FIELDS[etype]}
        self._emit(etype, {k: v for k, v in fields.items() if k in known},
                   {k: v for k, v in fields.items() if k not in known}, ts=ts, event_id=event_id)

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
