"""The lake writer: Kafka -> an exactly-once Parquet trajectory lake.

    flywheel lake-writer [--lake-root var/lake] [--group-id flywheel-lake-writer] [--instance-id w1]

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
  records past the schema's limits or over schema.MAX_RECORD_BYTES, rows Arrow cannot hold,
  and any other exception one record raises while it is decoded or converted) go to the
  dead-letter topic as {reason, detail, topic, partition, offset, original_b64, ts}: no
  record can stop the writer. The DLQ producer is flushed before the file covering those
  offsets is published, so a crash re-sends (the DLQ is at-least-once; its key
  topic/partition/offset de-duplicates) but never loses one. An envelope too large for the
  DLQ topic is written to `<lake_root>/_dlq/` instead.
* Replays: the SDK is at-least-once. A row whose event_id (outcome_id) landed in the same
  partition within the last `dedup_window` rows is dropped and counted (not dead-lettered);
  its offset stays covered. The window is rebuilt from the lake's last files on assignment.
* Offsets: a gap (retention deleted records before they were read) is logged and counted
  and the writer goes on. A log that went back under the lake (a recreated or truncated
  topic, seen as a record below the expected offset, a log end below the lake's, or a new
  Kafka topic id) pauses that partition: nothing of it is written, no file is overwritten.

Decoding (ingest/decode.py) takes each polled run of a partition's records at once, column by column
(`decode_batch`, held to the record-by-record reference `decode_record`), in this process or, with
--decode-worker, in a child process (ingest/decode_worker.py).

The consumer is kafka-python's (the base install's client), or with --kafka-client confluent librdkafka's
through ingest/rdkafka_consumer.py: the same calls, the same protocol, about a third less CPU per record.

Files roll on record count, bytes, age (default at most 1 s after the first record of the
file arrived, so a quiet topic is visible within seconds) and on a change of the record's
UTC date. Lag and rates go to `flywheel status` through the heartbeat files (flywheel.base.heartbeat).

Compaction of the small files it writes is its own process (`flywheel compact`, ingest/compact.py).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import datetime as dt
import functools
import gc
import itertools
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
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
from flywheel.base.kafka import client_kwargs, connect_with_retry, load_kafka_config, recover_lost_join
from flywheel.base.metrics import Metrics, Reading, nan_if_negative
from flywheel.base.stop import stop_on_signals
from flywheel.ingest import lake, schema
from flywheel.ingest.decode import (  # noqa: F401 - the decode path's public names, also imported from here by tests
    _ID_COLUMN,
    DLQ_REASONS,
    DecodedBatch,
    Rejected,
    convert_rows,
    decode_batch,
    decode_record,
    rows_to_table,
    warm_up,
)
from flywheel.ingest.decode_worker import DecodeWorker, WorkerDied
from flywheel.ingest.rdkafka_consumer import RdKafkaConsumer

if TYPE_CHECKING:
    import pyarrow as pa
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

log = logging.getLogger(__name__)
KAFKA_CLIENTS = ("kafka-python", "confluent")



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
    instance_id: str | None = setting(None, "static group membership id: a restart with the same id gets its "
                                            "partitions back at once")
    writer_id: str | None = setting(None, "name in status and logs (default: instance_id or host-pid)")
    lake_root: str = setting(defaults.LAKE_ROOT, "lake root: a local path or a pyarrow filesystem URI (s3://...)")
    roll_max_records: int = setting(100_000, "publish a file once it holds this many records")
    roll_max_bytes: int = setting(64 * 1024 * 1024, "publish a file once its records' wire bytes reach this")
    roll_max_age_s: float = setting(1.0, "publish a file at most this long after its first record arrived")
    compression: str = setting("zstd", "Parquet compression codec")
    dedup_window: int = setting(100_000, "ids remembered per partition: a replayed event (or outcome) landing within "
                                "this many rows of its original is dropped; 0 turns de-duplication off")
    session_timeout_s: float = setting(10.0, "group session timeout: how soon a dead writer's partitions move")
    poll_timeout_s: float = setting(0.2, "longest wait in one consumer poll")
    max_poll_records: int = setting(1000, "records returned by one poll")
    fetch_partition_bytes: int = setting(4 * 1024 * 1024, "bytes fetched per partition per request (a larger record "
                                                          "still comes whole); 4 MiB took 12% less CPU per event "
                                                          "than 1 MiB on one core, at the same rate on two "
                                                          "(docs/lake.md, \"Against Quix Streams\")")
    kafka_client: str = setting("kafka-python", "the consumer's client library: kafka-python, or confluent "
                                "(librdkafka, `pip install agent-flywheel[rdkafka]`): about a third less CPU per "
                                "record on one core, the same protocol (docs/lake.md, \"Against Quix Streams\")")
    decode_worker: bool = setting(False, "decode polled records in a child process while the next poll fetches "
                                  "(on 2 cores it did not pay: docs/lake.md)")
    decode_depth: int = setting(4, "polled runs of records the decode worker may hold before the writer waits for it")
    status_interval_s: float = setting(2.0, "how often the status heartbeat and lag are refreshed")
    join_timeout_s: float = setting(60.0, "a writer that holds no partitions and has not become a stable group member "
                                    "for this long starts a new consumer (doubling the wait each time, up to 16x)")
    stall_timeout_s: float = setting(300.0, "a writer that holds partitions with records waiting yet publishes no file "
                                     "for this long publishes what it holds and starts a new consumer "
                                     "(doubling, up to 16x)")
    connect_timeout_s: float = setting(600.0, "how long start-up waits for an unreachable broker (retrying, each "
                                       "attempt logged) before it exits")
    var_dir: str = setting(defaults.VAR_DIR, "local state directory (status heartbeat, resolved config)")
    metrics_port: int = setting(0, "Prometheus endpoint http://0.0.0.0:<port>/metrics (0: off; e.g. 9101)")
    log_level: str = setting("INFO", "logging level")

    def check(self) -> None:
        if not self.events_topic and not self.outcomes_topic:
            raise ConfigError("events_topic, outcomes_topic: at least one topic is required")
        if self.events_topic and self.events_topic == self.outcomes_topic:
            raise ConfigError("events_topic, outcomes_topic: must differ (each topic feeds its own table)")
        if self.dlq_topic in (self.events_topic, self.outcomes_topic):
            raise ConfigError("dlq_topic: must differ from events_topic and outcomes_topic")
        for name in ("roll_max_records", "roll_max_bytes", "max_poll_records", "fetch_partition_bytes", "decode_depth"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1")
        if self.dedup_window < 0:
            raise ConfigError("dedup_window: must be >= 0 (0 turns de-duplication off)")
        if self.roll_max_age_s <= 0 or self.poll_timeout_s <= 0:
            raise ConfigError("roll_max_age_s, poll_timeout_s: must be > 0")
        if self.join_timeout_s <= 0 or self.connect_timeout_s <= 0 or self.stall_timeout_s <= 0:
            raise ConfigError("join_timeout_s, connect_timeout_s, stall_timeout_s: must be > 0")
        if self.kafka_client not in KAFKA_CLIENTS:
            raise ConfigError(f"kafka_client: one of {', '.join(KAFKA_CLIENTS)}, not {self.kafka_client!r}")
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
    # rows decode_batch already made, not yet de-duplicated: [table, first row, end row) runs, `pending` rows in all
    slices: list[list[Any]] = field(default_factory=list)
    pending: int = 0
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

    def take(self, table: "pa.Table", row: int) -> None:
        """Row `row` of a decoded batch's table joins this file (rows of one batch come in order)."""
        last = self.slices[-1] if self.slices else None
        if last is not None and last[0] is table and last[2] == row:
            last[2] = row + 1
        else:
            self.slices.append([table, row, row + 1])
        self.pending += 1

    def take_slices(self) -> "pa.Table":
        import pyarrow as pa

        parts = [table.slice(start, end - start) for table, start, end in self.slices]
        self.slices, self.pending = [], 0
        return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


CHUNK_ROWS = 1000


@dataclass
class Stats:
    records: int = 0
    rows: int = 0
    wire_bytes: int = 0
    files: int = 0
    dlq: int = 0
    conformed: int = 0  # publishes that followed another writer's claim
    duplicates: int = 0  # rows dropped because their id had landed within the window (counted here, not dead letters)
    gaps: int = 0  # times a partition's next record came after missing offsets
    gap_offsets: int = 0  # offsets those gaps skipped
    behind: int = 0  # records below the partition's expected offset, skipped
    rewound: int = 0  # partitions found with a log that no longer matches the lake (paused, see check_logs)
    rejoins: int = 0  # new consumers started because the group never became stable (_JoinWatch)
    lost_joins: int = 0  # group joins whose completion kafka-python dropped, restarted (recover_lost_join)
    stalls: int = 0  # new consumers started because partitions with records waiting published nothing (_StallWatch)
    poll_errors: int = 0  # polls that raised a retriable broker error, retried (_poll)


class IdWindow:
    """The ids of the last `size` rows landed in one partition: `x in window` means exactly "x is the id of one
    of the partition's last `size` landed rows".

    A deque of those rows' ids (oldest first) with a count per id, so an id that landed twice (rows written
    with de-duplication off, with another window size, or before it existed) stays in until its last copy
    leaves; and a duplicate, which does not land, neither enters nor refreshes anything. The window is then a
    function of the lake's rows alone: a writer that takes a partition over rebuilds from the lake's last
    `size` rows exactly the window its predecessor had, and a range redone after a crash drops the same
    duplicates and keeps its identical rows (given the same `size` on every writer).
    """

    def __init__(self, size: int, ids: Iterable[str] = ()) -> None:
        assert size > 0, f"IdWindow size {size} must be > 0 (dedup_window 0 keeps no window)"
        self.size = size
        self._rows: collections.deque[str] = collections.deque()
        self._counts: collections.Counter[str] = collections.Counter()
        for item in ids:
            self.add(item)

    def __contains__(self, item: object) -> bool:
        return item in self._counts

    def __len__(self) -> int:
        """Rows in the window (ids counted once per row)."""
        return len(self._rows)

    def add(self, item: str) -> None:
        """One more landed row with id `item`; the oldest row leaves once the window is full."""
        self._rows.append(item)
        self._counts[item] += 1
        if len(self._rows) > self.size:
            gone = self._rows.popleft()
            self._counts[gone] -= 1
            if not self._counts[gone]:
                del self._counts[gone]  # membership is presence in the Counter


Partition = tuple[str, int]


def _kafka_date(kafka_ts_ms: float | None) -> str | None:
    """The UTC date of a Kafka record timestamp; None for none (-1) or one outside the lake's dates (a producer
    sending microseconds as milliseconds, NaN, inf): that range's date then comes from its rows or the publish
    day. Never raises: it runs for every record that opens a file, the bad ones included."""
    try:
        when = dt.datetime.fromtimestamp(kafka_ts_ms / 1000, dt.timezone.utc)  # type: ignore[operator]
    except (TypeError, ValueError, OverflowError, OSError):
        return None
    return when.date().isoformat() if schema.MIN_TS <= when < schema.MAX_TS else None


class LakeWriter:
    """The writer's state and logic, independent of the consumer loop (tests drive it directly)."""

    def __init__(self, cfg: LakeWriterConfig, dlq: "DeadLetters", clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.dlq = dlq
        self.clock = clock
        self.tables = cfg.tables()
        self.buffers: dict[Partition, Buffer] = {}
        self.next_offset: dict[Partition, int | None] = {}  # where the next buffer starts (None: first record's offset)
        self.published: dict[Partition, int] = {}  # last offset published (or found published) per partition
        self.windows: dict[Partition, IdWindow] = {}  # ids landed lately, per partition (none when dedup_window is 0)
        self.started: set[Partition] = set()  # partitions that took a record in order since their assignment
        self.rewound: dict[Partition, str] = {}  # partition -> why its log no longer matches the lake
        self.unpaused: set[Partition] = set()  # rewound partitions the consumer loop has not paused yet
        self.unchecked: set[Partition] = set()  # assigned partitions whose log check_logs has not seen yet
        self.identities: dict[str, str] = {}  # topic -> the Kafka topic id the lake's files of it came from
        self.stats = Stats()
        self.lag_records = -1  # consumer lag the last heartbeat measured (-1: unknown)
        self.on_published: Callable[[str, int, int], None] = lambda topic, partition, last: None
        # a number per assignment of a partition: records decoded for an earlier one are not taken (_Decoder)
        self.generation: dict[Partition, int] = {}
        self._generations = itertools.count()

    # ---- assignment ------------------------------------------------------------------------
    def assign(self, partitions: Iterable[Partition]) -> dict[Partition, int | None]:
        """Take partitions over; return where to read each from (None: the log's beginning)."""
        starts: dict[Partition, int | None] = {}
        listings: dict[str, list[lake.LakeFile]] = {}
        for topic, partition in list(partitions):
            tp = (topic, partition)
            if topic not in listings:
                listings[topic] = [f for f in lake.list_files(self.cfg.lake_root, self.tables[topic])
                                   if f.source == topic]
            files = [f for f in listings[topic] if f.partition == partition]
            start = lake.offsets_after(files, topic).get(partition)
            starts[tp] = start
            self._forget(tp)
            self.next_offset[tp] = start
            self.generation[tp] = next(self._generations)
            if start is not None:
                self.published[tp] = start - 1
            if self.cfg.dedup_window > 0:
                self.windows[tp] = self._rebuild_window(tp, files)
            self.unchecked.add(tp)
        return starts

    def _rebuild_window(self, tp: Partition, files: list[lake.LakeFile]) -> IdWindow:
        if not files:
            return IdWindow(self.cfg.dedup_window)
        t0 = time.monotonic()
        ids = lake.stream_tail(self.cfg.lake_root, files, _ID_COLUMN[self.tables[tp[0]]], self.cfg.dedup_window)
        log.info("dedup: %s-%d: window rebuilt from the lake's last files (%d ids, %.2f s)", tp[0], tp[1], len(ids),
                 time.monotonic() - t0)
        return IdWindow(self.cfg.dedup_window, ids)

    def _forget(self, tp: Partition) -> None:
        """Drop everything held for a partition (its open file included)."""
        for held in (self.buffers, self.next_offset, self.published, self.windows, self.rewound, self.generation):
            held.pop(tp, None)
        for marked in (self.started, self.unpaused, self.unchecked):
            marked.discard(tp)

    def revoke(self, partitions: Iterable[Partition], flush: bool = True) -> None:
        """Give partitions up: publish what they hold (the next owner continues after it) or drop it."""
        for tp in list(partitions):
            if flush:
                try:
                    self._drain(tp, reason="revoked")
                except Exception as exc:  # dropping is safe: the new owner re-reads from the lake's next offset
                    log.warning("revoke: could not publish the open file of %s-%d (%s); dropped, the next owner "
                                "re-reads it", tp[0], tp[1], exc)
            self._forget(tp)

    # ---- the log against the lake --------------------------------------------------------------
    def check_logs(self, ends: dict[Partition, int], topic_ids: dict[str, str | None] | None = None) -> None:
        """Compare assigned partitions' Kafka logs with the lake; rewind (stop writing) those that no longer match.

        `ends` are log end offsets: a log that ends before the lake's next offset was recreated or truncated.
        `topic_ids` are Kafka topic ids (None: unknown). The lake keeps the first id it saw per topic; another
        id means the topic was recreated, which offsets alone miss once the new log outgrows the lake.
        """
        for topic, topic_id in (topic_ids or {}).items():
            recorded = self._identity(topic, topic_id)
            if recorded is not None and recorded != topic_id:
                for tp in sorted(tp for tp in self.next_offset if tp[0] == topic):
                    self._rewind(tp, f"the topic's id is {topic_id} but the lake's files came from topic id "
                                     f"{recorded}: the topic was recreated")
        for tp, end in ends.items():
            if topic_ids is not None:  # the full check after an assignment (the status refresh compares offsets only)
                self.unchecked.discard(tp)
            lake_next = self.published.get(tp, -1) + 1
            if tp in self.next_offset and end < lake_next:
                self._rewind(tp, f"its log ends at offset {end} but the lake already holds offsets up to "
                                 f"{lake_next - 1}: the topic was recreated or its log truncated")

    def _identity(self, topic: str, topic_id: str | None) -> str | None:
        if topic_id is None or topic not in self.tables:
            return None
        if topic not in self.identities:
            self.identities[topic] = lake.stream_identity(self.cfg.lake_root, self.tables[topic], topic, topic_id)
        return self.identities[topic]

    def _rewind(self, tp: Partition, why: str) -> None:
        """Stop writing a partition whose log no longer matches the lake. Writing on would either overwrite
        the lake's files (same offsets, other records) or, past them, look like a continuation while every
        reader's cursor skips the new offsets below it; the records stay in Kafka for an operator to decide."""
        if tp in self.rewound:
            return
        self.rewound[tp] = why
        self.unpaused.add(tp)
        self.stats.rewound += 1
        log.error("rewound: %s-%d: %s. Its records are not written from here on (the lake keeps its files, "
                  "nothing is overwritten or skipped, the records stay in Kafka); the other partitions go on. "
                  "If the topic was recreated on purpose, move this partition's lake files and claims aside "
                  "and restart the writer (docs/lake.md, 'A recreated topic')", tp[0], tp[1], why)

    def take_unpaused(self) -> list[Partition]:
        """Rewound partitions for the consumer loop to pause (each returned once)."""
        out, self.unpaused = sorted(self.unpaused), set()
        return out

    # ---- records -----------------------------------------------------------------------------
    def _in_order(self, tp: Partition, offset: int) -> bool:
        """Whether a consumed offset is to be taken. After missing offsets it is (logged and counted as a
        gap); below the expected one it is skipped (a fetch from before a seek delivers such records), and
        once the partition has taken records since its assignment that means its log went back: rewound."""
        buf = self.buffers.get(tp)
        expected = buf.last + 1 if buf is not None else self.next_offset[tp]
        if expected is not None and offset < expected:
            self.stats.behind += 1
            if tp in self.started:
                self._rewind(tp, f"offset {offset} came after offset {expected - 1}: its log went back")
            else:
                log.debug("skip: %s-%d@%d is below the lake's next offset %d", tp[0], tp[1], offset, expected)
            return False
        if expected is not None and offset > expected:
            self.stats.gaps += 1
            self.stats.gap_offsets += offset - expected
            log.warning("gap: %s-%d offsets %d..%d are not in the log (deleted by retention before they were read, "
                        "or a compacted or transactional topic); the next file covers them and the writer goes on",
                        tp[0], tp[1], expected, offset - 1)
        self.started.add(tp)
        return True

    def add(self, topic: str, partition: int, offset: int, value: bytes | None, key: bytes | None = None,
            kafka_ts_ms: int | None = None) -> None:
        """Take one consumed record into its partition's open file (rolling files as needed)."""
        tp = (topic, partition)
        if not self._admit(tp, offset):
            return
        try:
            row, date = decode_record(self.tables[topic], value)
        except Rejected as rej:
            self._place(tp, offset, value, key, kafka_ts_ms, None, None, (rej.reason, rej.detail))
            return
        self._place(tp, offset, value, key, kafka_ts_ms, row, date)

    def add_batch(self, topic: str, partition: int, records: list[Any], decoded: DecodedBatch) -> None:
        """Take a run of one partition's consumed records (with .offset, .value, .key, .timestamp), decoded by
        `decode_batch`, as `add` would take them one by one: the same files, rows and dead letters."""
        tp = (topic, partition)
        rows = iter(zip(decoded.good, decoded.dates))
        j, (at, date) = -1, next(rows, (-1, None))
        for i, m in enumerate(records):
            row: int | None = None
            if i == at:  # a good row: its place in decoded.table
                j += 1
                row, row_date, (at, date) = j, date, next(rows, (-1, None))
            if not self._admit(tp, m.offset):
                continue
            if row is None:
                self._place(tp, m.offset, m.value, m.key, m.timestamp, None, None, decoded.rejected[i])
            else:
                self._place(tp, m.offset, m.value, m.key, m.timestamp, (decoded.table, row), row_date)

    def _admit(self, tp: Partition, offset: int) -> bool:
        """Whether the partition takes this offset now; publishes a claimed range the offset is past."""
        if tp not in self.next_offset:
            raise AssertionError(f"record for unassigned partition {tp[0]}-{tp[1]}")
        if tp in self.rewound or not self._in_order(tp, offset):
            return False
        buf = self.buffers.get(tp)
        if buf is not None and buf.claim is not None and offset > buf.claim.last:
            # a gap in the log (compacted topic, transaction markers): the offsets up to the claimed end
            # do not exist, so the claimed range is complete
            buf.last = buf.claim.last
            self._publish(buf, reason="claim")
        return True

    def _place(self, tp: Partition, offset: int, value: bytes | None, key: bytes | None, kafka_ts_ms: int | None,
               row: "dict[str, Any] | tuple[pa.Table, int] | None", date: str | None,
               rejected: tuple[str, str] | None = None) -> None:
        """Put an admitted record in its partition's open file: a decoded row (a dict, or row j of an Arrow table
        decode_batch made), or, with `rejected` = (reason, detail), a dead letter whose offset the file covers."""
        topic, partition = tp
        buf = self.buffers.get(tp)
        if buf is not None and row is not None and buf.date is not None and date != buf.date and buf.claim is None:
            self._publish(buf, reason="date")
            buf = None
        if buf is None:
            buf = self._open(tp, offset, kafka_ts_ms)
        if rejected is not None:
            reason, detail = rejected
            log.warning("dlq: record at %s/%d@%d rejected (%s: %s); sent to %s",
                        topic, partition, offset, reason, detail, self.cfg.dlq_topic)
            self.dlq.send(dlq_envelope(reason, detail, topic, partition, offset, value, key))
            self.stats.dlq += 1
        elif type(row) is dict:
            if buf.slices:
                self._convert(buf)  # rows stay in offset order
            row["_topic"], row["_partition"], row["_offset"] = topic, partition, offset
            row["_ingest_ts"] = dt.datetime.now(dt.timezone.utc)
            buf.rows.append(row)
            buf.values.append(value or b"")
        else:
            if buf.rows:
                self._convert(buf)
            assert isinstance(row, tuple), row  # (table, row j) of a decoded batch
            buf.take(*row)
        if buf.date is None and rejected is None:
            buf.date = date
        if len(buf.rows) + buf.pending >= CHUNK_ROWS:
            self._convert(buf)
        self._count(buf, offset, value)

    def _count(self, buf: Buffer, offset: int, value: bytes | None) -> None:
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
        buf.kafka_date = _kafka_date(kafka_ts_ms)
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
                        data, compression=self.cfg.compression, claimed=True)  # claimed just above
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
        """Move decoded rows into an Arrow chunk. A row Arrow cannot hold (a token id beyond int32 ...) is
        dead-lettered alone, with its original bytes; a row whose id landed lately is dropped (`_drop_landed`)."""
        if buf.slices:
            buf.chunks.append(self._drop_landed(buf, buf.take_slices()))
        if not buf.rows:
            return
        chunk, bad = convert_rows(buf.table, buf.rows)
        for i, detail in bad:
            offset = buf.rows[i]["_offset"]
            log.warning("dlq: record at %s/%d@%d cannot be stored (%s); sent to %s",
                        buf.topic, buf.partition, offset, detail, self.cfg.dlq_topic)
            self.dlq.send(dlq_envelope("unstorable", detail, buf.topic, buf.partition, offset, buf.values[i]))
            self.stats.dlq += 1
        buf.chunks.append(self._drop_landed(buf, chunk))
        buf.rows, buf.values = [], []

    def _drop_landed(self, buf: Buffer, chunk: "pa.Table") -> "pa.Table":
        """Drop the rows whose id already landed in this partition within the window (the SDK is at-least-once:
        a replay re-sends what may have arrived), and remember the ids of the others.

        Runs at conversion, in offset order, on rows Arrow holds: so the window only ever holds ids that land,
        and is the same whichever writer redoes a range. A dropped row's offset stays covered by its file.
        """
        window = self.windows.get((buf.topic, buf.partition))
        if window is None or chunk.num_rows == 0:
            return chunk
        keep = []
        for row_id in chunk.column(_ID_COLUMN[buf.table]).to_pylist():
            landed = row_id in window
            keep.append(not landed)
            if not landed:
                window.add(row_id)
        dropped = keep.count(False)
        if not dropped:
            return chunk
        import pyarrow as pa

        self.stats.duplicates += dropped
        offsets = chunk.column("_offset")
        log.info("dedup: %s-%d: %d of %d rows at %d..%d dropped: their %s landed within the last %d rows",
                 buf.topic, buf.partition, dropped, chunk.num_rows, offsets[0].as_py(), offsets[-1].as_py(),
                 _ID_COLUMN[buf.table], window.size)
        return chunk.filter(pa.array(keep))


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
        self.reasons: collections.Counter[str] = collections.Counter()  # envelopes by reason (Prometheus)

    def send(self, envelope: dict[str, Any]) -> None:
        self.reasons[envelope["reason"]] += 1
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
    session_ms = int(cfg.session_timeout_s * 1000)
    heartbeat_ms = max(1000, session_ms // 4)
    fetch_max_bytes = 64 * 1024 * 1024
    if cfg.kafka_client == "confluent":
        # the same calls on librdkafka (ingest/rdkafka_consumer.py); typed as kafka-python's, whose subset it is
        return RdKafkaConsumer(
            cfg.kafka_bootstrap, load_kafka_config(), f"lake-writer-{cfg.name}", cfg.group_id, cfg.instance_id,
            session_timeout_ms=session_ms, heartbeat_interval_ms=heartbeat_ms,
            fetch_partition_bytes=cfg.fetch_partition_bytes, fetch_max_bytes=fetch_max_bytes)
    from kafka import KafkaConsumer

    return KafkaConsumer(
        bootstrap_servers=cfg.kafka_bootstrap,
        **client_kwargs(load_kafka_config(), f"lake-writer-{cfg.name}"),  # security settings shared by every process
        group_id=cfg.group_id,
        group_instance_id=cfg.instance_id,
        enable_auto_commit=False,  # progress lives in the lake; commits are a hint written after publish
        auto_offset_reset="earliest",
        session_timeout_ms=session_ms,
        heartbeat_interval_ms=heartbeat_ms,
        max_poll_records=cfg.max_poll_records,
        # A fetch drains within a few polls, so kafka-python sends the next fetch while the writer decodes the
        # last one (a partition with buffered records is not fetched); fewer, larger fetches cost less CPU per
        # record. A record larger than this still arrives whole (KIP-74), so oversized records reach the DLQ.
        max_partition_fetch_bytes=cfg.fetch_partition_bytes,
        fetch_max_bytes=fetch_max_bytes,
        # a topic or partition created after start is noticed within seconds, not the default 5 minutes
        metadata_max_age_ms=5000,
    )


def _dlq_producer(cfg: LakeWriterConfig) -> "KafkaProducer":
    from kafka import KafkaProducer

    return KafkaProducer(
        bootstrap_servers=cfg.kafka_bootstrap,
        **client_kwargs(load_kafka_config(), f"lake-writer-{cfg.name}-dlq"),
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
    write_resolved(cfg, Path(cfg.var_dir, "run", f"lake-writer-{name}.toml"))
    fs, base = lake.filesystem(cfg.lake_root)
    fs.create_dir(base, recursive=True)
    stopping = stop_on_signals("publishing open files and leaving the group")
    try:
        clients = _connect(cfg, stopping)
    except Exception as exc:
        log.error("setup: cannot reach Kafka at %s (%s: %s); exiting", cfg.kafka_bootstrap, type(exc).__name__, exc)
        return 2
    if clients is None:
        return 0 if stopping.is_set() else 2
    consumer, producer = clients
    warm_up()
    writer = LakeWriter(cfg, DeadLetters(producer, cfg.dlq_topic, cfg.lake_root))
    writer.on_published = functools.partial(_commit_hint, consumer)
    metrics = writer_metrics(writer)
    metrics.serve(cfg.metrics_port)
    rebalance = _Rebalance(writer, consumer)
    ConsumerRebalanceListener.register(_Rebalance)  # kafka-python checks isinstance; see _Rebalance
    consumer.subscribe(topics=sorted(cfg.tables()), listener=rebalance)
    status_name = f"lake-writer-{name}"

    def stopped() -> bool:
        return stopping.is_set() or (stop is not None and stop(writer))

    decoder = _Decoder(writer, rebalance, DecodeWorker if cfg.decode_worker else None, cfg.decode_depth)
    if decoder.worker is not None:
        log.info("setup: decode worker pid %d started", decoder.worker.process.pid)
    watch = _JoinWatch(cfg.join_timeout_s)
    stall = _StallWatch(cfg.stall_timeout_s)
    try:
        with _rare_gc():
            log.info("setup: subscribed; entering the loop")
            while True:
                try:
                    _loop(cfg, consumer, writer, rebalance, status_name, stopped, decoder, watch, stall)
                    break
                except _NeverJoined as stuck:
                    consumer = _new_consumer(cfg, consumer, writer, rebalance, str(stuck))
    finally:
        decoder.close()
        consumer.close()
        producer.close()
        metrics.close()
    write_status(status_name, {"state": "stopped", **vars(writer.stats)}, var_dir=cfg.var_dir)
    log.info("stop: %s", vars(writer.stats))
    return 0


def _connect(cfg: LakeWriterConfig, stopping: threading.Event) -> tuple["KafkaConsumer", "KafkaProducer"] | None:
    """The consumer (not yet subscribed) and the DLQ producer; None when stopped while waiting for the broker or
    when the DLQ topic is missing. A broker that is away is waited for (connect_timeout_s), not a reason to exit."""
    producer = connect_with_retry(lambda: _dlq_producer(cfg), "lake writer's DLQ producer", cfg.connect_timeout_s,
                                  stopping)
    if producer is None:
        return None
    # fail fast: with auto-creation off, a missing DLQ topic would only surface at the first bad record
    try:
        producer.partitions_for(cfg.dlq_topic)
    except Exception as exc:
        producer.close()
        log.error("setup: dead-letter topic %s is not available (%s); create it or pass --dlq-topic",
                  cfg.dlq_topic, exc)
        return None
    log.info("setup: DLQ producer connected (%s)", cfg.dlq_topic)
    try:
        consumer = connect_with_retry(lambda: _consumer(cfg), "lake writer's consumer", cfg.connect_timeout_s, stopping)
    except Exception:
        producer.close()
        raise
    if consumer is None:
        producer.close()
        return None
    _wait_for_topics(consumer, sorted(cfg.tables()))
    return consumer, producer


class _NeverJoined(Exception):
    """Raised by the loop when _JoinWatch gives up on the consumer's group join."""


class _Watch:
    """A condition that, unhealthy for `timeout_s` without a break, calls for a new consumer; each firing doubles the
    next wait, up to 16x, so a group or broker slow for another reason is not churned."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_s = self.timeout_s = timeout_s
        self.clock = clock
        self.since = clock()

    def _expired(self, healthy: bool) -> float | None:
        """Seconds unhealthy when that reaches the timeout (and the clock restarts), else None."""
        now = self.clock()
        if healthy:
            self.since = now
            return None
        if now - self.since < self.timeout_s:
            return None
        waited = now - self.since
        self.since = now
        self.timeout_s = min(self.timeout_s * 2, self.base_s * 16)
        return waited


class _JoinWatch(_Watch):
    """Notices a consumer that never becomes a stable group member.

    Twice in CI (2026-12-02 and -03, load ~4) one of two freshly started writers held no partition for 90 s
    while its topic had four and its group no other member; its heartbeat read `partitions: 0`. One cause was
    found later (a join whose completion kafka-python drops; `recover_lost_join`, run after every poll, repairs
    it within a poll); this watch stays as the fallback for any other (docs/reliability.md). A member that holds
    nothing because the group's other members hold everything is STABLE and is left alone; one that has been
    UNJOINED or REBALANCING for `timeout_s` with nothing held gets a new consumer (it has no open files, so
    nothing is lost), and the next wait doubles, up to 16x, so a group that is slow for another reason (a
    large group's rebalance) is not churned."""

    def due(self, held: int, state: str) -> str | None:
        """A reason to start a new consumer, or None; `state` is kafka-python's MemberState value."""
        waited = self._expired(bool(held) or state == "<stable>")
        return None if waited is None else f"no partitions and group state {state} for {waited:.0f} s"


class _StallWatch(_Watch):
    """Notices a writer that holds partitions with records waiting and publishes nothing.

    Once (issue 35) a writer ran at ~88% CPU for 10 minutes without publishing a file; the cause was not found.
    Any record consumed is published within roll_max_age_s, so "records waiting (lag > 0) on partitions it holds,
    none paused for a rewound log, and no file published for `timeout_s`" is a writer that is not working, whatever
    the cause: it then publishes what it holds, gives its partitions up and starts a new consumer (nothing is
    lost or written twice: its progress is the lake's). The next wait doubles, up to 16x, so a slow broker is not
    churned."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(timeout_s, clock)
        self.files = -1

    def due(self, held: int, lag: int, files: int, paused: int) -> str | None:
        """A reason to start a new consumer, or None; `files` is the writer's count of published files."""
        healthy = not held or lag <= 0 or bool(paused) or files != self.files
        self.files = files
        waited = self._expired(healthy)
        if waited is None:
            return None
        return f"{lag} records waiting on {held} partitions and no file published for {waited:.0f} s"


def _new_consumer(cfg: LakeWriterConfig, old: "KafkaConsumer", writer: LakeWriter, rebalance: "_Rebalance",
                  why: str) -> "KafkaConsumer":
    """Close a consumer stuck outside its group and subscribe a new one in its place; keep the old one when no
    new one can be made (the broker is away: the watch tries again after a longer wait)."""
    log.error("group: %s; starting a new consumer (docs/reliability.md: a stuck join or a stalled writer)", why)
    try:
        consumer = _consumer(cfg)
        _wait_for_topics(consumer, sorted(cfg.tables()))
    except Exception as exc:
        log.error("group: no new consumer (%s); keeping the old one", exc)
        return old
    writer.stats.rejoins += 1
    try:
        old.close(autocommit=False, timeout_ms=5000)
    except Exception as exc:  # the old one is abandoned either way
        log.warning("group: closing the stuck consumer failed: %s", exc)
    rebalance.consumer = consumer
    writer.on_published = functools.partial(_commit_hint, consumer)
    consumer.subscribe(topics=sorted(cfg.tables()), listener=rebalance)
    return consumer


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
            log.info("rebalance: revoked %s; publishing their open files",
                     sorted((t.topic, t.partition) for t in revoked))
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
          status_name: str, stopped: Callable[[], bool], decoder: _Decoder | None = None,
          watch: _JoinWatch | None = None, stall: _StallWatch | None = None) -> None:
    """Poll -> writer (publishing, with its commit hints) -> heartbeat, until `stopped()`; then publish
    every open file. Raises _NeverJoined when `watch` gives up on the group join (no file is open then), or when
    `stall` finds its partitions stuck (their open files published and the partitions given up first)."""
    decoder = decoder or _Decoder(writer, rebalance)
    last_status = time.monotonic()
    last_stats = Stats()
    failed_checks = 0
    while not stopped():
        batches = _poll(consumer, cfg, writer)
        rebalance.raise_failure()
        if recover_lost_join(consumer):
            writer.stats.lost_joins += 1
            log.warning("group: kafka-python dropped a finished join (no partitions, still rebalancing); rejoining")
        if writer.unchecked:
            # at every poll until it runs: a recreated topic must not reach the lake (_take holds the records back)
            found = _check_logs(consumer, writer, sorted(writer.unchecked), topic_ids=True, warn=not failed_checks)
            failed_checks = 0 if found is not None else failed_checks + 1
        _take(consumer, writer, batches, decoder)
        _pause_rewound(consumer, writer)
        writer.roll_due()
        now = time.monotonic()
        if now - last_status >= cfg.status_interval_s:
            state = consumer.group_metadata().state  # kafka-python's MemberState: <unjoined>, <rebalancing>, <stable>
            _heartbeat(cfg, status_name, consumer, writer, now - last_status, last_stats, state)
            last_stats = Stats(**vars(writer.stats))
            last_status = now
            stuck = watch and watch.due(len(writer.next_offset), state)
            if stuck:
                raise _NeverJoined(stuck)
            stalled = stall and stall.due(len(writer.next_offset), writer.lag_records, writer.stats.files,
                                          len(writer.rewound))
            if stalled:
                decoder.collect(wait=True)
                writer.revoke(list(writer.next_offset))  # publish and forget: the new consumer's owners resume after it
                writer.dlq.flush()
                writer.stats.stalls += 1
                raise _NeverJoined(stalled)
    decoder.collect(wait=True)
    writer.flush_all()
    writer.dlq.flush()


def _poll(consumer: "KafkaConsumer", cfg: LakeWriterConfig, writer: LakeWriter) -> dict["TopicPartition", list[Any]]:
    """consumer.poll, with a retriable broker error taken as an empty poll (counted, said, retried at the next).

    Why: kafka-python raises a connection error out of poll while a broker of the cluster is down and the
    coordinator lookup awaits a metadata refresh that failed on it (the 3-broker test's killed controller: the
    writer exited and its lake stopped). Nothing of the writer's state is touched by a failed poll; anything not
    retriable still ends the process."""
    from kafka.errors import KafkaError

    try:
        return consumer.poll(timeout_ms=int(cfg.poll_timeout_s * 1000), max_records=cfg.max_poll_records)
    except KafkaError as exc:
        if not getattr(exc, "retriable", False):
            raise
        writer.stats.poll_errors += 1
        if writer.stats.poll_errors % 20 == 1:  # the first, then every 20th: an outage can fail polls for minutes
            log.warning("poll failed (%s: %s); polling again (%d failed polls so far)", type(exc).__name__, exc,
                        writer.stats.poll_errors)
        time.sleep(min(cfg.poll_timeout_s, 0.5))  # a failing poll returns at once: do not spin on it
        return {}


def _take(consumer: "KafkaConsumer", writer: LakeWriter, batches: dict["TopicPartition", list[Any]],
          decoder: "_Decoder") -> None:
    """Hand polled records to the decoder (and so to the writer), except those of partitions revoked during the
    poll (the next owner reads them) and of partitions whose log check has not run yet (after an assignment, while
    the broker does not answer end_offsets): those are given back by seeking to their first offset, so they are
    read again once the check passed and never written before it."""
    for tp, messages in batches.items():
        part = (tp.topic, tp.partition)
        if part not in writer.next_offset or not messages:
            continue
        if part in writer.unchecked:
            consumer.seek(tp, messages[0].offset)
            continue
        if not decoder.take(part, messages):
            # the worker died and every partition was sought back to the lake: the rest of this poll is stale,
            # and seeking its partitions to their first polled offset (above) would skip what the lake lacks
            return
    decoder.collect()


class _Decoder:
    """Runs of polled records -> decode_batch -> LakeWriter.add_batch, in poll order.

    Without a worker it decodes in this process, at once. With one (ingest/decode_worker.py) a run is sent to the
    child and taken by the writer once decoded, while the next poll fetches; at most `depth` runs wait. A run is
    taken only while its partition keeps the assignment it was polled under (`LakeWriter.generation`): after a
    revocation it is the next owner's, after a new assignment the consumer was sought back to the lake's next
    offset and reads it again. If the child dies, the runs in flight are dropped, a new child starts and every
    assigned partition resumes from the lake, as after a restart of the writer: nothing is lost or written twice.
    """

    def __init__(self, writer: LakeWriter, rebalance: "_Rebalance | None" = None,
                 worker: "Callable[[], DecodeWorker] | None" = None, depth: int = 4) -> None:
        self.writer = writer
        self.rebalance = rebalance
        self.start_worker = worker
        self.worker = worker() if worker is not None else None
        self.depth = depth
        self.sent: collections.deque[tuple[Partition, int | None, list[Any]]] = collections.deque()
        self.restarts = 0
        self.failing = 0  # restarts since the last decoded run

    def take(self, tp: Partition, messages: list[Any]) -> bool:
        """Decode a run (or send it to the worker); False when the worker died and every partition was reassigned,
        so the caller drops the rest of the poll it came from."""
        table, offsets, values = self.writer.tables[tp[0]], [m.offset for m in messages], [m.value for m in messages]
        if self.worker is None:
            self.writer.add_batch(*tp, messages, decode_batch(table, *tp, offsets, values))
            return True
        try:
            self.worker.send(table, *tp, offsets, values)
        except WorkerDied as exc:
            self._restart(exc)
            return False
        self.sent.append((tp, self.writer.generation.get(tp), messages))
        return True

    def collect(self, wait: bool = False) -> None:
        """Hand the decoded runs to the writer: those ready, and the oldest while more than `depth` wait (every
        one when `wait`)."""
        while self.sent and (wait or len(self.sent) > self.depth or self.worker.ready()):  # type: ignore[union-attr]
            try:
                decoded = self.worker.receive()  # type: ignore[union-attr]
            except WorkerDied as exc:
                self._restart(exc)
                return
            self.failing = 0
            tp, generation, messages = self.sent.popleft()
            if generation is not None and self.writer.generation.get(tp) == generation:
                self.writer.add_batch(*tp, messages, decoded)

    def _restart(self, why: BaseException) -> None:
        from kafka import TopicPartition

        assert self.start_worker is not None and self.worker is not None
        self.restarts += 1
        self.failing += 1
        if self.failing > 3:  # it dies before decoding anything: a restart loop would hide that
            raise RuntimeError(f"decode: the worker died {self.failing} times in a row without decoding a run "
                               f"(last: {why}); stopping") from why
        parts = sorted(self.writer.next_offset)
        log.error("decode: %s; its %d runs in flight are dropped, a new worker starts and the %d assigned partitions "
                  "resume from the lake, as after a restart", why, len(self.sent), len(parts))
        self.sent.clear()
        self.worker.close(timeout_s=1.0)
        self.worker = self.start_worker()
        if self.rebalance is not None:
            self.rebalance.on_partitions_assigned({TopicPartition(t, p) for t, p in parts})

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


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


def _check_logs(consumer: "KafkaConsumer", writer: LakeWriter, parts: list[Partition],
                topic_ids: bool, warn: bool = True) -> dict[Partition, int] | None:
    """The log end offsets of `parts`, compared with the lake by `writer.check_logs` (with the topics' ids too
    when `topic_ids`: the check after an assignment), rewound partitions paused; None when the broker did not
    answer. A failed check after an assignment logs a warning when `warn` (the first of a run of failures)."""
    from kafka import TopicPartition

    try:
        ends = consumer.end_offsets([TopicPartition(t, p) for t, p in parts], timeout_ms=2000) if parts else {}
    except Exception as exc:
        if topic_ids:  # the partitions stay unchecked: not written (see _take), checked again at the next poll
            (log.warning if warn else log.debug)(
                "check: log end offsets of %d newly assigned partitions unavailable (%s); their records are held "
                "back until the check runs, retried at each poll", len(parts), exc)
        else:  # the status refresh: lag unknown this time, the offsets compared again at the next refresh
            log.debug("check: log end offsets of %d partitions unavailable (%s); compared again later",
                      len(parts), exc)
        return None
    found = {(tp.topic, tp.partition): end for tp, end in ends.items()}
    writer.check_logs(found, {t: _topic_id(consumer, t) for t in sorted({t for t, _ in parts})} if topic_ids else None)
    _pause_rewound(consumer, writer)
    return found


def _topic_id(consumer: "KafkaConsumer", topic: str) -> str | None:
    """The topic's Kafka id (KIP-516), None when unknown. kafka-python keeps it only in its client's cluster
    metadata, with no public accessor; brokers without topic ids send the zero UUID."""
    if isinstance(consumer, RdKafkaConsumer):
        return consumer.topic_id(topic)
    try:
        topic_id = consumer._client.cluster.topic_id(topic)
        return None if topic_id is None or topic_id.int == 0 else str(topic_id)
    except Exception:
        return None


def _pause_rewound(consumer: "KafkaConsumer", writer: LakeWriter) -> None:
    """Stop fetching rewound partitions: their records stay in Kafka, unread."""
    from kafka import TopicPartition

    parts = writer.take_unpaused()
    if parts:
        consumer.pause(*[TopicPartition(t, p) for t, p in parts])


def _heartbeat(cfg: LakeWriterConfig, status_name: str, consumer: "KafkaConsumer", writer: LakeWriter, dt_s: float,
               prev: Stats, group_state: str) -> None:
    ends = _check_logs(consumer, writer, list(writer.next_offset), topic_ids=False)
    lag = -1 if ends is None else sum(max(0, end - (writer.published.get(tp, -1) + 1)) for tp, end in ends.items())
    writer.lag_records = lag
    s = writer.stats
    fields = {
        "state": "running",
        "partitions": len(writer.next_offset),
        "lag_records": lag,
        "records_per_s": round((s.records - prev.records) / dt_s, 1),
        "mb_per_s": round((s.wire_bytes - prev.wire_bytes) / dt_s / 1e6, 2),
        "files": s.files,
        "rows": s.rows,
        "dlq": s.dlq,
        "duplicates": s.duplicates,
        "gaps": s.gaps,
        "gap_offsets": s.gap_offsets,
        "behind": s.behind,
        "rewound_partitions": [f"{t}/{p}" for t, p in sorted(writer.rewound)],
        "group_state": group_state.strip("<>"),
        "rejoins": s.rejoins,
        "lost_joins": s.lost_joins,
        "stalls": s.stalls,
        "poll_errors": s.poll_errors,
        "open_records": sum(b.count for b in writer.buffers.values() if not b.empty),
    }
    write_status(status_name, fields, var_dir=cfg.var_dir)


def writer_metrics(writer: LakeWriter) -> Metrics:
    """flywheel_lake_writer_*: the writer's Stats, its dead letters by reason and the heartbeat's lag,
    read at scrape."""
    metrics = Metrics("lake_writer")

    def readings() -> list[Reading]:
        s = writer.stats
        return [
            Reading("counter", "consumed", "records", "records taken from Kafka (landed, dead-lettered or dropped)",
                    s.records),
            Reading("counter", "consumed", "bytes", "wire bytes of those records", s.wire_bytes),
            Reading("counter", "landed", "rows", "rows published in lake files", s.rows),
            Reading("counter", "published", "files", "lake files published", s.files),
            Reading("counter", "dead_lettered", "records", "records sent to the DLQ, by reason",
                    dict(writer.dlq.reasons), "reason"),
            Reading("counter", "duplicate", "rows", "rows dropped: their id landed within dedup_window", s.duplicates),
            Reading("counter", "gap", "offsets", "offsets skipped by gaps in a partition's log", s.gap_offsets),
            Reading("gauge", "consumer_lag", "records", "log end minus published offset over the assigned partitions "
                    "(NaN: the broker did not answer)", nan_if_negative(writer.lag_records)),
            Reading("gauge", "assigned", "partitions", "partitions this writer owns", len(writer.next_offset)),
            Reading("counter", "group", "rejoins", "new consumers started after a group join that never completed",
                    s.rejoins),
            Reading("counter", "group", "lost_joins", "group joins whose completion kafka-python dropped, restarted",
                    s.lost_joins),
            Reading("counter", "group", "stalls", "new consumers started after partitions with records waiting "
                    "published no file for stall_timeout_s", s.stalls),
            Reading("counter", "poll", "errors", "polls that raised a retriable broker error, retried", s.poll_errors),
        ]

    metrics.read(readings)
    return metrics


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(LakeWriterConfig, argv, prog="flywheel lake-writer")
    setup_logging(cfg.log_level)
    return run(cfg)


if __name__ == "__main__":
    import sys

    sys.exit(main())
