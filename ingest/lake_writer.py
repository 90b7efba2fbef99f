"""The lake writer: Kafka -> an exactly-once Parquet trajectory lake, and lake compaction.

    flywheel lake-writer [--lake-root var/lake] [--group-id flywheel-lake-writer] [--instance-id w1]
    flywheel compact [--lake-root var/lake] [--before 2026-11-30]

A daemon in a Kafka consumer group. It reads `flywheel.events` and `flywheel.outcomes`,
validates each record against ingest/schema.py and writes immutable Parquet files (zstd)
into `<lake_root>/{events,outcomes}/date=YYYY-MM-DD/` through ingest/lake.py.

Exactly-once, whatever instant the process dies:
* The lake is the source of truth for progress. On every partition assignment the writer
  seeks to `lake.next_offsets()`; Kafka's committed offsets are written after each publish
  as a hint for monitoring tools only and never read back.
* A file holds one contiguous offset range of one partition and one date, and is published
  by atomic rename under a name that encodes the range, so a range redone after a crash
  gets the same name.
* Before publishing first..last a writer claims `first` in the lake (`lake.claim_range`).
  The first claim fixes the range end and date; a writer that finds an earlier claim (a
  stale owner after a rebalance, or the next owner re-reading a range whose writer died
  between claim and rename) publishes exactly the claimed range. So two writers can never
  publish partly overlapping files, and a zombie can at worst re-publish an identical name.
* A file's range covers every offset consumed, dead-lettered ones included. A range whose
  records were all bad is published as a file with zero rows, which keeps recovery from
  file names exact without any side table.
* Bad records (non-UTF-8, malformed JSON, unsupported schema_version, schema violations,
  records over schema.MAX_RECORD_BYTES, rows Arrow cannot hold) go to the dead-letter topic
  as {reason, detail, topic, partition, offset, original_b64, ts}; the DLQ producer is
  flushed before the file covering those offsets is published, so a crash re-sends (the DLQ
  is at-least-once; its key topic/partition/offset de-duplicates) but never loses one. An
  envelope too large for the DLQ topic is written to `<lake_root>/_dlq/` instead.

Files roll on record count, bytes, age (default at most 1 s after the first record of the
file arrived, so a quiet topic is visible within seconds) and on a change of the record's
UTC date. Lag and rates go to `flywheel status` through the heartbeat files (flywheel.base.heartbeat).

Compaction (`flywheel compact`) merges runs of contiguous small files of closed date
partitions per (topic, partition) into files named by the covering range: it publishes the
merged file first, then deletes the originals; in between `lake.list_files` shows only the
covering file, so no reader sees a row twice or misses one.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import functools
import gc
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from flywheel.base import defaults
from flywheel.base.config import (
    ConfigError,
    load_config,
    setting,
    setup_logging,
    write_resolved,
)
from flywheel.base.heartbeat import write_status
from flywheel.base.stop import stop_on_signals
from flywheel.ingest import lake, schema

if TYPE_CHECKING:
    import pyarrow as pa
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

log = logging.getLogger(__name__)

_VALIDATE = {"events": schema.validate_event, "outcomes": schema.validate_outcome}
_COLUMNS = {"events": schema.EVENT_COLUMNS, "outcomes": schema.OUTCOME_COLUMNS}
_ARROW_SCHEMA = {"events": schema.event_arrow_schema, "outcomes": schema.outcome_arrow_schema}


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
@dataclass
class LakeWriterConfig:
    """Kafka -> Parquet lake writer (one member of a consumer group)."""

    kafka_bootstrap: str = setting(defaults.KAFKA_BOOTSTRAP, "Kafka bootstrap servers")
    events_topic: str = setting(schema.EVENTS_TOPIC, "topic of agent events (lake table events); empty to skip")
    outcomes_topic: str = setting(schema.OUTCOMES_TOPIC, "topic of outcomes (lake table outcomes); empty to skip")
    dlq_topic: str = setting(schema.DLQ_TOPIC, "dead-letter topic for records that fail decoding or validation")
    group_id: str = setting("flywheel-lake-writer", "consumer group; writers in one group share the partitions")
    instance_id: str | None = setting(None, "static group membership id: a restart with the same id gets its partitions back at once")
    writer_id: str | None = setting(None, "name in status and logs (default: instance_id or host-pid)")
    lake_root: str = setting(defaults.LAKE_ROOT, "lake root: a local path or a pyarrow filesystem URI (s3://...)")
    roll_max_records: int = setting(100_000, "publish a file once it holds this many records")
    roll_max_bytes: int = setting(64 * 1024 * 1024, "publish a file once its records' wire bytes reach this")
    roll_max_age_s: float = setting(1.0, "publish a file at most this long after its first record arrived")
    compression: str = setting("zstd", "Parquet compression codec")
    session_timeout_s: float = setting(10.0, "group session timeout: how soon a dead writer's partitions move")
    poll_timeout_s: float = setting(0.2, "longest wait in one consumer poll")
    max_poll_records: int = setting(1000, "records returned by one poll")
    fetch_partition_bytes: int = setting(1024 * 1024, "bytes fetched per partition per request (a larger record still comes whole)")
    status_interval_s: float = setting(2.0, "how often the status heartbeat and lag are refreshed")
    var_dir: str = setting(defaults.VAR_DIR, "local state directory (status heartbeat, resolved config)")
    log_level: str = setting("INFO", "logging level")

    def check(self) -> None:
        if not self.events_topic and not self.outcomes_topic:
            raise ConfigError("events_topic, outcomes_topic: at least one topic is required")
        if self.events_topic and self.events_topic == self.outcomes_topic:
            raise ConfigError("events_topic, outcomes_topic: must differ (each topic feeds its own table)")
        if self.dlq_topic in (self.events_topic, self.outcomes_topic):
            raise ConfigError("dlq_topic: must differ from events_topic and outcomes_topic")
        for name in ("roll_max_records", "roll_max_bytes", "max_poll_records", "fetch_partition_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1")
        if self.roll_max_age_s <= 0 or self.poll_timeout_s <= 0:
            raise ConfigError("roll_max_age_s, poll_timeout_s: must be > 0")
        if self.session_timeout_s < 6:
            raise ConfigError("session_timeout_s: the broker refuses less than 6 s (group.min.session.timeout.ms)")

    @property
    def name(self) -> str:
        return self.writer_id or self.instance_id or f"{socket.gethostname()}-{os.getpid()}"

    def tables(self) -> dict[str, str]:
        """topic -> lake table."""
        out = {}
        if self.events_topic:
            out[self.events_topic] = "events"
        if self.outcomes_topic:
            out[self.outcomes_topic] = "outcomes"
        return out


# ---------------------------------------------------------------------------------------------
# Decoding: wire bytes -> a lake row, or a reason for the dead-letter topic (pure, unit-tested)
# ---------------------------------------------------------------------------------------------
class Rejected(Exception):
    """A record that cannot land; `reason` is a short code, the message the detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _converters(table: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    cols = _COLUMNS[table]
    return tuple(c.name for c in cols if c.kind == "ts"), tuple(c.name for c in cols if c.kind == "json")


_KIND_FIELDS = {t: _converters(t) for t in _COLUMNS}


try:  # decoding is most of the writer's work per record; orjson (the lake extra) is 3-5x the stdlib
    import orjson

    _loads = orjson.loads

    def _dumps_sorted(value: Any) -> str:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()

except ImportError:  # pragma: no cover - the lake extra installs orjson
    _loads = json.loads

    def _dumps_sorted(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))


def decode_record(table: str, value: bytes | None) -> tuple[dict[str, Any], str]:
    """Decode and validate one Kafka value into (lake row without meta columns, UTC date).

    Raises Rejected with the reason the dead-letter envelope carries.
    """
    if value is None:
        raise Rejected("empty", "record has no value (tombstone)")
    if len(value) > schema.MAX_RECORD_BYTES:
        raise Rejected("oversized", f"{len(value)} bytes > schema.MAX_RECORD_BYTES={schema.MAX_RECORD_BYTES}")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Rejected("not_utf8", f"value is not UTF-8: {exc}") from None
    try:
        record = _loads(text)
    except ValueError as exc:  # json.JSONDecodeError and orjson.JSONDecodeError are ValueErrors
        raise Rejected("malformed_json", f"value is not JSON: {exc}") from None
    if isinstance(record, dict) and record.get("schema_version") not in schema.SUPPORTED_SCHEMA_VERSIONS:
        raise Rejected("unsupported_schema_version",
                       f"schema_version {record.get('schema_version')!r} not in {sorted(schema.SUPPORTED_SCHEMA_VERSIONS)}")
    try:
        _VALIDATE[table](record)
    except schema.SchemaError as exc:
        raise Rejected("invalid", str(exc)) from None
    ts_fields, json_fields = _KIND_FIELDS[table]
    for name in ts_fields:
        if record.get(name) is not None:
            record[name] = schema.parse_ts(record[name])
    for name in json_fields:
        if record.get(name) is not None:
            record[name] = _dumps_sorted(record[name])
    return record, record["ts"].date().isoformat()


def dlq_envelope(reason: str, detail: str, topic: str, partition: int, offset: int, value: bytes | None,
                 key: bytes | None = None) -> dict[str, Any]:
    """The dead-letter record: enough to see why it failed and to replay the original bytes."""
    return {
        "reason": reason,
        "detail": detail,
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "key_b64": base64.b64encode(key).decode() if key is not None else None,
        "original_b64": base64.b64encode(value or b"").decode(),
        "ts": schema.now_ts(),
    }


def rows_to_table(table: str, rows: list[dict[str, Any]]) -> "pa.Table":
    """Rows (already converted by decode_record, meta columns added) -> an Arrow table of the lake schema."""
    import pyarrow as pa

    return pa.Table.from_pylist(rows, schema=_ARROW_SCHEMA[table]())


# ---------------------------------------------------------------------------------------------
# One open file per partition
# ---------------------------------------------------------------------------------------------
@dataclass
class Buffer:
    """The records of one partition not yet published: offsets first..last, one date.

    Decoded rows are converted to Arrow every `CHUNK_ROWS` rows, because Python dicts of token
    ids take ~10x the memory of their Arrow columns.
    """

    topic: str
    partition: int
    table: str
    first: int
    last: int = -1  # last offset consumed into this buffer (first - 1 while empty)
    date: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)  # decoded, not yet converted
    values: list[bytes] = field(default_factory=list)  # original bytes of `rows`, for the DLQ
    chunks: list["pa.Table"] = field(default_factory=list)
    wire_bytes: int = 0
    opened_at: float = 0.0  # monotonic time the first record arrived
    kafka_date: str | None = None  # date of the first record's Kafka timestamp: the date of an all-bad range
    claim: lake.Claim | None = None  # an earlier writer's claim on `first`: this buffer must end exactly there

    def __post_init__(self) -> None:
        if self.last < 0:
            self.last = self.first - 1

    @property
    def empty(self) -> bool:
        return self.last < self.first

    @property
    def count(self) -> int:
        return self.last - self.first + 1


CHUNK_ROWS = 1000


@dataclass
class Stats:
    records: int = 0
    rows: int = 0
    wire_bytes: int = 0
    files: int = 0
    dlq: int = 0
    conformed: int = 0  # publishes that followed another writer's claim


class LakeWriter:
    """The writer's state and logic, independent of the consumer loop (tests drive it directly)."""

    def __init__(self, cfg: LakeWriterConfig, dlq: "DeadLetters", clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.dlq = dlq
        self.clock = clock
        self.tables = cfg.tables()
        self.buffers: dict[tuple[str, int], Buffer] = {}
        self.next_offset: dict[tuple[str, int], int | None] = {}  # where the next buffer starts (None: first record's offset)
        self.published: dict[tuple[str, int], int] = {}  # last offset published (or found published) per partition
        self.stats = Stats()
        self.on_published: Callable[[str, int, int], None] = lambda topic, partition, last: None

    # ---- assignment ------------------------------------------------------------------------
    def assign(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
        """Take partitions over; return where to read each from (None: the log's beginning)."""
        parts = list(partitions)
        starts: dict[tuple[str, int], int | None] = {}
        by_topic: dict[str, dict[int, int]] = {}
        for topic, partition in parts:
            if topic not in by_topic:
                by_topic[topic] = lake.next_offsets(self.cfg.lake_root, self.tables[topic], topic)
            start = by_topic[topic].get(partition)
            starts[(topic, partition)] = start
            self.next_offset[(topic, partition)] = start
            self.buffers.pop((topic, partition), None)
            if start is not None:
                self.published[(topic, partition)] = start - 1
        return starts

    def revoke(self, partitions: Iterable[tuple[str, int]], flush: bool = True) -> None:
        """Give partitions up: publish what they hold (the next owner continues after it) or drop it."""
        for tp in list(partitions):
            if flush:
                try:
                    self._drain(tp, reason="revoked")
                except Exception as exc:  # dropping is safe: the new owner re-reads from the lake's next offset
                    log.warning("revoke: could not publish the open file of %s-%d (%s); dropped, the next owner "
                                "re-reads it", tp[0], tp[1], exc)
            self.buffers.pop(tp, None)
            self.next_offset.pop(tp, None)
            self.published.pop(tp, None)

    # ---- records -----------------------------------------------------------------------------
    def add(self, topic: str, partition: int, offset: int, value: bytes | None, key: bytes | None = None,
            kafka_ts_ms: int | None = None) -> None:
        """Take one consumed record into its partition's open file (rolling files as needed)."""
        tp = (topic, partition)
        if tp not in self.next_offset:
            raise AssertionError(f"record for unassigned partition {topic}-{partition}")
        buf = self.buffers.get(tp)
        if buf is not None and offset <= buf.last:
            return  # a fetch from before a seek delivered it again; the buffer already holds it
        if buf is None and self.next_offset[tp] is not None and offset < self.next_offset[tp]:
            return  # already published
        if buf is not None and buf.claim is not None and offset > buf.claim.last:
            # a gap in the log (compacted topic, transaction markers): the offsets up to the claimed end
            # do not exist, so the claimed range is complete
            buf.last = buf.claim.last
            self._publish(buf, reason="claim")
            buf = self.buffers.get(tp)
        table = self.tables[topic]
        try:
            row, date = decode_record(table, value)
        except Rejected as rej:
            row, date = None, None
            reason, detail = rej.reason, rej.detail
        if buf is not None and row is not None and buf.date is not None and date != buf.date and buf.claim is None:
            self._publish(buf, reason="date")
            buf = None
        if buf is None:
            buf = self._open(tp, offset, kafka_ts_ms)
        if row is None:
            log.warning("dlq: record at %s/%d@%d rejected (%s: %s); sent to %s",
                        topic, partition, offset, reason, detail, self.cfg.dlq_topic)
            self.dlq.send(dlq_envelope(reason, detail, topic, partition, offset, value, key))
            self.stats.dlq += 1
        else:
            row["_topic"], row["_partition"], row["_offset"] = topic, partition, offset
            row["_ingest_ts"] = dt.datetime.now(dt.timezone.utc)
            buf.rows.append(row)
            buf.values.append(value or b"")
            if buf.date is None:
                buf.date = date
            if len(buf.rows) >= CHUNK_ROWS:
                self._convert(buf)
        buf.last = offset
        buf.wire_bytes += len(value or b"")
        self.stats.records += 1
        self.stats.wire_bytes += len(value or b"")
        if buf.claim is not None:
            if offset >= buf.claim.last:
                self._publish(buf, reason="claim")
        elif buf.count >= self.cfg.roll_max_records:
            self._publish(buf, reason="count")
        elif buf.wire_bytes >= self.cfg.roll_max_bytes:
            self._publish(buf, reason="bytes")

    def _open(self, tp: tuple[str, int], offset: int, kafka_ts_ms: int | None) -> Buffer:
        start = self.next_offset[tp]
        first = offset if start is None else start
        topic, partition = tp
        buf = Buffer(topic, partition, self.tables[topic], first, opened_at=self.clock())
        if kafka_ts_ms is not None and kafka_ts_ms >= 0:
            buf.kafka_date = dt.datetime.fromtimestamp(kafka_ts_ms / 1000, dt.timezone.utc).date().isoformat()
        buf.claim = lake.read_claim(self.cfg.lake_root, buf.table, topic, partition, first)
        if buf.claim is not None:
            log.info("claim: %s-%d@%d was claimed as ..%d (%s) by an earlier writer; following it",
                     topic, partition, first, buf.claim.last, buf.claim.date)
        self.buffers[tp] = buf
        return buf

    def roll_due(self) -> None:
        """Publish buffers older than roll_max_age_s (a quiet topic still lands within seconds)."""
        now = self.clock()
        for buf in list(self.buffers.values()):
            if not buf.empty and buf.claim is None and now - buf.opened_at >= self.cfg.roll_max_age_s:
                self._publish(buf, reason="age")

    def flush_all(self, reason: str = "stop") -> None:
        for tp in list(self.buffers):
            self._drain(tp, reason)

    def _drain(self, tp: tuple[str, int], reason: str) -> None:
        """Publish everything a partition holds; a publish that follows a shorter claim leaves a remainder,
        which is published in turn. Stops early only at a longer claim (the next owner completes it)."""
        while True:
            buf = self.buffers.get(tp)
            if buf is None or buf.empty or (buf.claim is not None and buf.last < buf.claim.last):
                return
            before = (buf.first, buf.last)
            self._publish(buf, reason=reason)
            after = self.buffers.get(tp)
            if after is not None and (after.first, after.last) == before:
                return  # a longer claim appeared at publish time: wait for more records

    # ---- publish -----------------------------------------------------------------------------
    def _publish(self, buf: Buffer, reason: str) -> None:
        """Publish the buffer's range (or the claimed prefix of it) and open the remainder."""
        tp = (buf.topic, buf.partition)
        assert not buf.empty, f"publish of an empty buffer {buf.topic}-{buf.partition}@{buf.first}"
        date = buf.date or buf.kafka_date or dt.datetime.now(dt.timezone.utc).date().isoformat()
        claim = lake.claim_range(self.cfg.lake_root, buf.table, buf.topic, buf.partition, buf.first, buf.last, date)
        if claim.last > buf.last:
            # another writer claimed a longer range from here: keep reading until its end
            buf.claim = claim
            self.stats.conformed += 1
            return
        if claim.last != buf.last or claim.date != date:
            self.stats.conformed += 1
            log.info("claim: %s-%d@%d already claimed as ..%d (%s); publishing exactly that range",
                     buf.topic, buf.partition, buf.first, claim.last, claim.date)
        # the DLQ must hold every dead letter of this range before the range counts as consumed
        self._convert(buf)
        self.dlq.flush()
        import pyarrow as pa
        import pyarrow.compute as pc

        whole = pa.concat_tables(buf.chunks) if buf.chunks else rows_to_table(buf.table, [])
        data = whole if claim.last >= buf.last else whole.filter(pc.less_equal(whole["_offset"], claim.last))
        lake.write_file(self.cfg.lake_root, buf.table, claim.date, buf.topic, buf.partition, buf.first, claim.last,
                        data, compression=self.cfg.compression)
        self.stats.files += 1
        self.stats.rows += data.num_rows
        self.published[tp] = claim.last
        self.next_offset[tp] = claim.last + 1
        self.on_published(buf.topic, buf.partition, claim.last)
        log.debug("publish: %s-%d %d..%d (%d rows, %s, %s)", buf.topic, buf.partition, buf.first, claim.last,
                  data.num_rows, claim.date, reason)
        if buf.last <= claim.last:
            self.buffers.pop(tp, None)
            return
        # the records after the claimed end start the next file
        rest = Buffer(buf.topic, buf.partition, buf.table, claim.last + 1, last=buf.last, date=buf.date,
                      opened_at=buf.opened_at, kafka_date=buf.kafka_date)
        rest.chunks = [whole.filter(pc.greater(whole["_offset"], claim.last))]
        rest.wire_bytes = buf.wire_bytes * (buf.last - claim.last) // max(buf.count, 1)
        rest.claim = lake.read_claim(self.cfg.lake_root, rest.table, rest.topic, rest.partition, rest.first)
        self.buffers[tp] = rest
        if rest.claim is not None and rest.last >= rest.claim.last:
            self._publish(rest, reason="claim")

    def _convert(self, buf: Buffer) -> None:
        """Move decoded rows into an Arrow chunk; a row Arrow cannot hold (a token id beyond int32 ...)
        is dead-lettered alone, with its original bytes."""
        if buf.rows:
            buf.chunks.append(self._to_table(buf, buf.rows, buf.values))
            buf.rows, buf.values = [], []

    def _to_table(self, buf: Buffer, rows: list[dict[str, Any]], values: list[bytes]) -> "pa.Table":
        import pyarrow as pa

        errors = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError)
        try:
            return rows_to_table(buf.table, rows)
        except errors:
            pass
        good = []
        for row, value in zip(rows, values):
            try:
                rows_to_table(buf.table, [row])
            except errors as exc:
                offset = row["_offset"]
                log.warning("dlq: record at %s/%d@%d cannot be stored (%s); sent to %s",
                            buf.topic, buf.partition, offset, exc, self.cfg.dlq_topic)
                self.dlq.send(dlq_envelope("unstorable", f"{type(exc).__name__}: {exc}", buf.topic, buf.partition,
                                           offset, value))
                self.stats.dlq += 1
                continue
            good.append(row)
        return rows_to_table(buf.table, good)


# ---------------------------------------------------------------------------------------------
# Dead letters
# ---------------------------------------------------------------------------------------------
class DeadLetters:
    """Sends envelopes to the DLQ topic; flush() returns only once every one is acknowledged.

    An envelope the broker refuses as too large is written under <lake_root>/_dlq/ instead,
    so the original bytes are kept whatever their size. Any other failure raises: the range
    is then not published and a restart sends again.
    """

    def __init__(self, producer: "KafkaProducer | None", topic: str, lake_root: str) -> None:
        self.producer = producer
        self.topic = topic
        self.lake_root = lake_root
        self.pending: list[tuple[dict[str, Any], Any]] = []
        self.sent: list[dict[str, Any]] = []  # envelopes, for tests without a producer

    def send(self, envelope: dict[str, Any]) -> None:
        payload = json.dumps(envelope).encode()
        if self.producer is None:
            self.sent.append(envelope)
            return
        from kafka.errors import MessageSizeTooLargeError

        key = f"{envelope['topic']}/{envelope['partition']}@{envelope['offset']}".encode()
        try:
            future = self.producer.send(self.topic, key=key, value=payload)
        except MessageSizeTooLargeError as exc:
            self._spill(envelope, payload, str(exc))
            return
        self.pending.append((envelope, future))

    def flush(self) -> None:
        if self.producer is None or not self.pending:
            return
        from kafka.errors import MessageSizeTooLargeError, RecordListTooLargeError

        self.producer.flush()
        pending, self.pending = self.pending, []
        for envelope, future in pending:
            try:
                future.get(timeout=30)
            except (MessageSizeTooLargeError, RecordListTooLargeError) as exc:
                self._spill(envelope, json.dumps(envelope).encode(), str(exc))

    def _spill(self, envelope: dict[str, Any], payload: bytes, why: str) -> None:
        fs, base = lake.filesystem(self.lake_root)
        directory = f"{base}/_dlq/{envelope['topic']}"
        fs.create_dir(directory, recursive=True)
        path = f"{directory}/{envelope['partition']:04d}-{envelope['offset']:020d}.json"
        with fs.open_output_stream(path) as fh:
            fh.write(payload)
        log.warning("dlq: envelope for %s/%d@%d too large for %s (%s); kept at %s",
                    envelope["topic"], envelope["partition"], envelope["offset"], self.topic, why, path)


# ---------------------------------------------------------------------------------------------
# The process
# ---------------------------------------------------------------------------------------------
def _consumer(cfg: LakeWriterConfig) -> "KafkaConsumer":
    from kafka import KafkaConsumer

    return KafkaConsumer(
        bootstrap_servers=cfg.kafka_bootstrap,
        group_id=cfg.group_id,
        group_instance_id=cfg.instance_id,
        client_id=f"lake-writer-{cfg.name}",
        enable_auto_commit=False,  # progress lives in the lake; commits are a hint written after publish
        auto_offset_reset="earliest",
        session_timeout_ms=int(cfg.session_timeout_s * 1000),
        heartbeat_interval_ms=max(1000, int(cfg.session_timeout_s * 1000 / 4)),
        max_poll_records=cfg.max_poll_records,
        # Small fetches drain within one or two polls, so kafka-python sends the next fetch while the writer
        # decodes the last one (a partition with buffered records is not fetched). A record larger than this
        # still arrives whole (KIP-74), so oversized records reach the DLQ.
        max_partition_fetch_bytes=cfg.fetch_partition_bytes,
        fetch_max_bytes=64 * 1024 * 1024,
        # a topic or partition created after start is noticed within seconds, not the default 5 minutes
        metadata_max_age_ms=5000,
    )


def _dlq_producer(cfg: LakeWriterConfig) -> "KafkaProducer":
    from kafka import KafkaProducer

    return KafkaProducer(
        bootstrap_servers=cfg.kafka_bootstrap,
        client_id=f"lake-writer-{cfg.name}-dlq",
        acks="all",
        linger_ms=5,
        retries=5,
        max_request_size=3 * schema.MAX_RECORD_BYTES,  # base64 of a max-size record, plus the envelope
        max_block_ms=15000,  # how long start-up waits for the DLQ topic's metadata
    )


def run(cfg: LakeWriterConfig, stop: Callable[[LakeWriter], bool] | None = None) -> int:
    """Consume, validate, publish; until SIGTERM/SIGINT (or `stop(writer)` returns True: tests, benchmarks)."""
    from kafka import ConsumerRebalanceListener

    name = cfg.name
    log.info("setup: lake writer %s, group %s, topics %s -> lake %s", name, cfg.group_id, cfg.tables(), cfg.lake_root)
    write_resolved(cfg, os.path.join(cfg.var_dir, "run", f"lake-writer-{name}.toml"))
    fs, base = lake.filesystem(cfg.lake_root)
    fs.create_dir(base, recursive=True)
    stopping = stop_on_signals("publishing open files and leaving the group")
    clients = _connect(cfg)
    if clients is None:
        return 2
    consumer, producer = clients
    writer = LakeWriter(cfg, DeadLetters(producer, cfg.dlq_topic, cfg.lake_root))
    writer.on_published = functools.partial(_commit_hint, consumer)
    rebalance = _Rebalance(writer, consumer)
    ConsumerRebalanceListener.register(_Rebalance)  # kafka-python checks isinstance; see _Rebalance
    consumer.subscribe(topics=sorted(cfg.tables()), listener=rebalance)
    status_name = f"lake-writer-{name}"

    def stopped() -> bool:
        return stopping.is_set() or (stop is not None and stop(writer))

    try:
        with _rare_gc():
            log.info("setup: subscribed; entering the loop")
            _loop(cfg, consumer, writer, rebalance, status_name, stopped)
    finally:
        consumer.close()
        producer.close()
    write_status(status_name, {"state": "stopped", **vars(writer.stats)}, var_dir=cfg.var_dir)
    log.info("stop: %s", vars(writer.stats))
    return 0


def _connect(cfg: LakeWriterConfig) -> tuple["KafkaConsumer", "KafkaProducer"] | None:
    """The consumer (not yet subscribed) and the DLQ producer, or None when the DLQ topic is missing."""
    producer = _dlq_producer(cfg)
    # fail fast: with auto-creation off, a missing DLQ topic would only surface at the first bad record
    try:
        producer.partitions_for(cfg.dlq_topic)
    except Exception as exc:
        producer.close()
        log.error("setup: dead-letter topic %s is not available (%s); create it or pass --dlq-topic", cfg.dlq_topic, exc)
        return None
    log.info("setup: DLQ producer connected (%s)", cfg.dlq_topic)
    consumer = _consumer(cfg)
    _wait_for_topics(consumer, sorted(cfg.tables()))
    return consumer, producer


def _commit_hint(consumer: "KafkaConsumer", topic: str, partition: int, last: int) -> None:
    """LakeWriter.on_published: commit the offset after a published file, for monitoring tools only."""
    from kafka import TopicPartition
    from kafka.structs import OffsetAndMetadata

    try:
        consumer.commit_async({TopicPartition(topic, partition): OffsetAndMetadata(last + 1, "", -1)})
    except Exception as exc:  # a hint only: the lake is the source of truth
        log.debug("commit hint failed: %s", exc)


class _Rebalance:
    """The consumer's rebalance listener: revoked partitions publish their open files, assigned ones
    resume from the lake.

    Registered as a kafka.ConsumerRebalanceListener by run() rather than subclassing it, so this
    module imports kafka-python only when the writer runs. kafka-python logs and swallows a
    listener's exception; an assignment that could not seek to the lake must stop the process
    instead (the next start recovers), so failures are kept for the loop (`raise_failure`).
    """

    def __init__(self, writer: LakeWriter, consumer: "KafkaConsumer") -> None:
        self.writer = writer
        self.consumer = consumer
        self.failures: list[BaseException] = []

    def on_partitions_revoked(self, revoked: set["TopicPartition"]) -> None:
        if revoked:
            log.info("rebalance: revoked %s; publishing their open files", sorted((t.topic, t.partition) for t in revoked))
        self.writer.revoke([(t.topic, t.partition) for t in revoked])

    def on_partitions_lost(self, lost: set["TopicPartition"]) -> None:
        # kafka-python >= 3 calls this after a forced eviction; its base class's default, kept here, is to
        # revoke: a fenced writer may still publish, since claims make that at worst an identical file
        self.on_partitions_revoked(lost)

    def on_partitions_assigned(self, assigned: set["TopicPartition"]) -> None:
        try:
            self._assign(assigned)
        except Exception as exc:
            self.failures.append(exc)

    def _assign(self, assigned: set["TopicPartition"]) -> None:
        from kafka import TopicPartition

        starts = self.writer.assign([(t.topic, t.partition) for t in assigned])
        for (topic, partition), start in sorted(starts.items()):
            tp = TopicPartition(topic, partition)
            if start is None:
                self.consumer.seek_to_beginning(tp)
            else:
                self.consumer.seek(tp, start)
        if starts:
            log.info("rebalance: assigned %s; resuming from the lake at %s", len(starts),
                     {f"{t}/{p}": s for (t, p), s in sorted(starts.items())})

    def raise_failure(self) -> None:
        """Raise the first assignment that failed, if any."""
        if self.failures:
            raise RuntimeError(f"rebalance: could not resume assigned partitions from the lake: {self.failures[0]}") \
                from self.failures[0]


@contextlib.contextmanager
def _rare_gc() -> Iterator[None]:
    # Decoded records are acyclic dicts and lists freed by reference counting as soon as they are in Arrow;
    # the default collector threshold (700) would still scan the heap every few hundred records.
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)  # run() may be called inside a longer-lived process (tests, benchmarks)
        gc.unfreeze()


def _loop(cfg: LakeWriterConfig, consumer: "KafkaConsumer", writer: LakeWriter, rebalance: _Rebalance,
          status_name: str, stopped: Callable[[], bool]) -> None:
    """Poll -> writer (publishing, with its commit hints) -> heartbeat, until `stopped()`; then publish
    every open file."""
    last_status = time.monotonic()
    last_stats = Stats()
    while not stopped():
        batches = consumer.poll(timeout_ms=int(cfg.poll_timeout_s * 1000), max_records=cfg.max_poll_records)
        rebalance.raise_failure()
        for tp, messages in batches.items():
            if (tp.topic, tp.partition) not in writer.next_offset:
                continue  # revoked during this poll
            for m in messages:
                writer.add(tp.topic, tp.partition, m.offset, m.value, m.key, m.timestamp)
        writer.roll_due()
        now = time.monotonic()
        if now - last_status >= cfg.status_interval_s:
            _heartbeat(cfg, status_name, consumer, writer, now - last_status, last_stats)
            last_stats = Stats(**vars(writer.stats))
            last_status = now
    writer.flush_all()
    writer.dlq.flush()


def _wait_for_topics(consumer: "KafkaConsumer", topics: list[str], timeout_s: float = 10.0) -> None:
    """Join with the topics' partitions known: an assignment computed without them would be empty
    until the next metadata refresh."""
    deadline = time.monotonic() + timeout_s
    missing = list(topics)
    while missing and time.monotonic() < deadline:
        consumer.topics()  # refreshes cluster metadata
        missing = [t for t in topics if not consumer.partitions_for_topic(t)]
        if missing:
            time.sleep(0.2)
    for topic in missing:
        log.warning("setup: topic %s does not exist yet; its partitions are taken once it appears", topic)
    for topic in topics:
        if topic not in missing:
            log.info("setup: topic %s has %d partitions", topic, len(consumer.partitions_for_topic(topic)))


def _heartbeat(cfg: LakeWriterConfig, status_name: str, consumer: "KafkaConsumer", writer: LakeWriter, dt_s: float,
               prev: Stats) -> None:
    from kafka import TopicPartition

    parts = [TopicPartition(t, p) for t, p in writer.next_offset]
    lag = 0
    try:
        ends = consumer.end_offsets(parts, timeout_ms=2000) if parts else {}
        for tp, end in ends.items():
            lag += max(0, end - (writer.published.get((tp.topic, tp.partition), -1) + 1))
    except Exception as exc:  # status is advisory
        log.debug("status: end offsets unavailable (%s)", exc)
        lag = -1
    s = writer.stats
    fields = {
        "state": "running",
        "partitions": len(parts),
        "lag_records": lag,
        "records_per_s": round((s.records - prev.records) / dt_s, 1),
        "mb_per_s": round((s.wire_bytes - prev.wire_bytes) / dt_s / 1e6, 2),
        "files": s.files,
        "rows": s.rows,
        "dlq": s.dlq,
        "open_records": sum(b.count for b in writer.buffers.values() if not b.empty),
    }
    write_status(status_name, fields, var_dir=cfg.var_dir)


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(LakeWriterConfig, argv, prog="flywheel lake-writer")
    setup_logging(cfg.log_level)
    return run(cfg)


# ---------------------------------------------------------------------------------------------
# Compaction
# ---------------------------------------------------------------------------------------------
@dataclass
class CompactConfig:
    """Merge small files of closed date partitions of the lake."""

    lake_root: str = setting(defaults.LAKE_ROOT, "lake root: a local path or a pyarrow filesystem URI")
    before: str | None = setting(None, "compact date partitions strictly before this date (default: today, UTC)")
    tables: list[str] = setting(["events", "outcomes"], "tables to compact")
    small_file_bytes: int = setting(32 * 1024 * 1024, "files smaller than this are merge candidates")
    target_rows: int = setting(1_000_000, "a merged file holds at most this many offsets")
    compression: str = setting("zstd", "Parquet compression codec")
    dry_run: bool = setting(False, "only print what would be merged")
    stale_temp_s: float = setting(3600.0, "delete temp files of killed writers older than this in closed dates")
    log_level: str = setting("INFO", "logging level")

    def check(self) -> None:
        if self.before is not None:
            try:
                dt.date.fromisoformat(self.before)
            except ValueError:
                raise ConfigError(f"before: {self.before!r} is not a date YYYY-MM-DD") from None
        bad = [t for t in self.tables if t not in ("events", "outcomes")]
        if bad:
            raise ConfigError(f"tables: {bad} cannot be compacted (events, outcomes only)")
        if self.target_rows < 2:
            raise ConfigError("target_rows: must be >= 2")


def plan_compaction(files: list[lake.LakeFile], sizes: dict[str, int], before: str, small_file_bytes: int,
                    target_rows: int) -> list[list[lake.LakeFile]]:
    """Runs of contiguous small files (one stream, one closed date) to merge, each run >= 2 files.

    Pure: `files` are the visible files (covered ones removed), `sizes` their byte sizes.
    """
    groups: dict[tuple[str, str, int], list[lake.LakeFile]] = {}
    for f in files:
        if f.date and f.date < before:
            groups.setdefault((f.date, f.source, f.partition), []).append(f)
    runs: list[list[lake.LakeFile]] = []
    for group in groups.values():
        group.sort(key=lambda f: f.first)
        run: list[lake.LakeFile] = []
        for f in group:
            small = sizes.get(f.path, 0) < small_file_bytes
            fits = bool(run) and f.first == run[-1].last + 1 and f.last - run[0].first + 1 <= target_rows
            if small and fits:
                run.append(f)
                continue
            if len(run) >= 2:
                runs.append(run)
            run = [f] if small else []
        if len(run) >= 2:
            runs.append(run)
    return runs


def _delete_stale_temps(fs: Any, root: str, table: str, before: str, older_than_s: float) -> int:
    """Remove temp files a killed writer left in closed date partitions (late events may still be
    written into a closed date, so only temps older than `older_than_s` go)."""
    import pyarrow.fs as pafs

    base = lake.filesystem(root)[1]
    table_dir = f"{base}/{table}"
    if fs.get_file_info(table_dir).type == pafs.FileType.NotFound:
        return 0
    now = time.time()
    count = 0
    for info in fs.get_file_info(pafs.FileSelector(table_dir, recursive=True)):
        parent = info.path.rsplit("/", 2)[-2]
        if (info.type == pafs.FileType.File and info.base_name.startswith(".") and info.base_name.endswith(".tmp")
                and parent.startswith("date=") and parent[5:] < before and info.mtime is not None
                and now - info.mtime.timestamp() > older_than_s):
            fs.delete_file(info.path)
            count += 1
    return count


def compact(cfg: CompactConfig) -> dict[str, int]:
    """Merge runs of small files; publish each merged file before deleting what it covers."""
    import pyarrow as pa
    import pyarrow.fs as pafs
    from rich.progress import Progress

    before = cfg.before or dt.datetime.now(dt.timezone.utc).date().isoformat()
    fs, _ = lake.filesystem(cfg.lake_root)
    totals = {"runs": 0, "merged_files": 0, "leftovers_deleted": 0, "stale_temps_deleted": 0}
    for table in cfg.tables:
        on_disk = lake.list_all_files(cfg.lake_root, table)
        visible = lake.list_files(cfg.lake_root, table)
        # files covered by a visible one are leftovers of a compaction that died before deleting them
        leftovers = [f for f in set(on_disk) - set(visible) if f.date and f.date < before]
        if leftovers and not cfg.dry_run:
            totals["leftovers_deleted"] += lake.delete_files(cfg.lake_root, leftovers)
        if not cfg.dry_run:
            totals["stale_temps_deleted"] += _delete_stale_temps(fs, cfg.lake_root, table, before, cfg.stale_temp_s)
        infos = fs.get_file_info([f.path for f in visible])
        sizes = {i.path: i.size for i in infos if i.type == pafs.FileType.File}
        runs = plan_compaction(visible, sizes, before, cfg.small_file_bytes, cfg.target_rows)
        log.info("compact: %s: %d runs of small files before %s", table, len(runs), before)
        if cfg.dry_run:
            for r in runs:
                log.info("compact: would merge %s-%d %d..%d (%d files, %s)", r[0].source, r[0].partition,
                         r[0].first, r[-1].last, len(r), r[0].date)
            totals["runs"] += len(runs)
            continue
        with Progress(transient=True) as progress:
            task = progress.add_task(f"compact {table}", total=len(runs))
            for r in runs:
                parts = [lake.read_file(cfg.lake_root, f) for f in r]
                merged = pa.concat_tables(parts, promote_options="default")
                lake.write_file(cfg.lake_root, table, r[0].date, r[0].source, r[0].partition, r[0].first, r[-1].last,
                                merged, compression=cfg.compression)
                lake.delete_files(cfg.lake_root, r)
                totals["runs"] += 1
                totals["merged_files"] += len(r)
                progress.advance(task)
    log.info("compact: done %s", totals)
    return totals


def compact_main(argv: list[str] | None = None) -> int:
    cfg = load_config(CompactConfig, argv, prog="flywheel compact")
    setup_logging(cfg.log_level)
    compact(cfg)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
