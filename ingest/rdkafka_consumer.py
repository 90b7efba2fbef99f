"""The lake writer's optional Kafka client: librdkafka (confluent-kafka) behind the part of kafka-python's
KafkaConsumer that the writer uses, so the writer's loop, its exactly-once protocol and its checks stay one code.

Why: on one core the writer spent about a quarter of its CPU in kafka-python (its I/O thread reading 4 KiB at a
time, and per-record unpacking in Python); librdkafka consumes the same records for about a third of that
(docs/lake.md, "Against Quix Streams"). kafka-python stays the default client (`--kafka-client kafka-python`):
the base install carries no native library. `pip install agent-flywheel[rdkafka]` adds this one.

What the writer relies on, and how it holds here:
* Records come per partition in offset order as `(offset, value, key, timestamp)` objects, grouped by a
  kafka-python TopicPartition, as KafkaConsumer.poll returns them.
* An assignment starts where the writer says: the rebalance listener's seeks made during the assignment callback
  are collected and the partitions are assigned with those offsets (librdkafka refuses a seek on a partition
  whose assignment is not active yet). A seek later (a run held back for its log check) is librdkafka's seek,
  which drops the partition's prefetched records.
* Revocation reaches the listener before the partitions go (eager assignment: range), a lost assignment too; a
  close does not call the listener, as kafka-python's does not.
* end_offsets are the high watermarks (a fresh request, not a cache); topic ids come from the admin API, as a
  uuid.UUID string like kafka-python's, so a lake written by either client names its topic the same way.
* Errors: a fatal client error raises (the writer exits, its supervisor restarts it); others are logged and
  librdkafka retries them itself, as kafka-python's retriable errors are.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

from flywheel.base.kafka import KafkaClientConfig

log = logging.getLogger(__name__)

# errors a retry does not mend: the writer stops on them, as kafka-python's poll raises them
_PERMANENT = {"TOPIC_AUTHORIZATION_FAILED", "GROUP_AUTHORIZATION_FAILED", "CLUSTER_AUTHORIZATION_FAILED"}


@dataclass(frozen=True, slots=True)
class Record:
    """One consumed record with kafka-python's attribute names (the writer reads these four)."""

    offset: int
    value: bytes | None
    key: bytes | None
    timestamp: int | None


class _GroupMetadata:
    def __init__(self, state: str) -> None:
        self.state = state


def rdkafka_config(cfg: KafkaClientConfig, client_id: str) -> dict[str, Any]:
    """librdkafka settings for the shared client settings (security, client id), as client_kwargs gives
    kafka-python's."""
    conf: dict[str, Any] = {
        "security.protocol": cfg.security_protocol.lower(),
        "client.id": f"{cfg.client_id}-{client_id}" if cfg.client_id else client_id,
    }
    if cfg.sasl:
        conf.update({"sasl.mechanisms": cfg.sasl_mechanism, "sasl.username": cfg.sasl_username,
                     "sasl.password": cfg.sasl_password})
    for ours, theirs in (("ssl_cafile", "ssl.ca.location"), ("ssl_certfile", "ssl.certificate.location"),
                         ("ssl_keyfile", "ssl.key.location")):
        if getattr(cfg, ours):
            conf[theirs] = getattr(cfg, ours)
    return conf


def uuid_text(tid: Any) -> str | None:
    """A confluent_kafka.Uuid as kafka-python spells a topic id (uuid.UUID's text); None for none or the zero id
    (a broker without topic ids). Its halves come as Java longs: signed."""
    if tid is None:
        return None
    bits = ((tid.get_most_significant_bits() & (2**64 - 1)) << 64) | (tid.get_least_significant_bits() & (2**64 - 1))
    return None if bits == 0 else str(uuid.UUID(int=bits))


def _kafka_parts(partitions: list[Any]) -> set[Any]:
    """librdkafka's partitions as the kafka-python TopicPartitions the writer's listener takes."""
    from kafka import TopicPartition

    return {TopicPartition(p.topic, p.partition) for p in partitions}


class RdKafkaConsumer:
    """KafkaConsumer's methods the lake writer calls, on a confluent_kafka.Consumer."""

    def __init__(self, bootstrap: str, client: KafkaClientConfig, client_id: str, group_id: str,
                 instance_id: str | None, session_timeout_ms: int, heartbeat_interval_ms: int,
                 fetch_partition_bytes: int, fetch_max_bytes: int) -> None:
        from confluent_kafka import Consumer

        # what any client of this cluster needs (the admin client below takes only these)
        self._client_conf = {"bootstrap.servers": bootstrap, **rdkafka_config(client, client_id)}
        conf: dict[str, Any] = {
            **self._client_conf,
            "group.id": group_id,
            "enable.auto.commit": False,  # progress lives in the lake; commits are a hint written after publish
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            # kafka-python's default: librdkafka's read_committed would skip aborted transactional records that
            # the default client lands, and stop at a hanging transaction while the lag (log end) grows
            "isolation.level": "read_uncommitted",
            "session.timeout.ms": session_timeout_ms,
            "heartbeat.interval.ms": heartbeat_interval_ms,
            "partition.assignment.strategy": "range",  # eager, as kafka-python's default: revoke all, then assign
            "max.partition.fetch.bytes": fetch_partition_bytes,
            "fetch.max.bytes": fetch_max_bytes,
            # the prefetch queue: bounded, so a paused or slow writer does not buffer a whole topic in memory
            "queued.max.messages.kbytes": 65536,
            "topic.metadata.refresh.interval.ms": 5000,  # a new topic or partition is noticed within seconds
            "error_cb": self._on_error,
        }
        if instance_id:
            conf["group.instance.id"] = instance_id
        self._consumer = Consumer(conf)
        try:  # librdkafka connects lazily: ask once, so an unreachable broker fails here and start-up retries it
            self._consumer.list_topics(timeout=5)
        except Exception:
            self._consumer.close()
            raise
        self._listener: Any = None
        self._pending: dict[tuple[str, int], int] | None = None  # seeks made inside an assignment callback
        self._state = "<unjoined>"
        self._metadata: Any = None
        self._fatal: Exception | None = None
        self._errors = 0
        self._admin: Any = None

    # ---- group ---------------------------------------------------------------------------------------
    def subscribe(self, topics: list[str], listener: Any) -> None:
        self._listener = listener
        self._consumer.subscribe(topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_lost)

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        from confluent_kafka import TopicPartition as RdTopicPartition

        self._pending = {}
        try:
            if self._listener is not None:
                self._listener.on_partitions_assigned(_kafka_parts(partitions))
        finally:
            pending, self._pending = self._pending, None
            # an offset the listener did not set stays librdkafka's (committed, else auto.offset.reset)
            assigned = [RdTopicPartition(p.topic, p.partition, pending.get((p.topic, p.partition), p.offset))
                        for p in partitions]
            consumer.assign(assigned)
            # librdkafka keeps an application's pause across an unassign and assign; kafka-python starts a new
            # assignment unpaused, and the writer pauses what it must again (a rewound log)
            consumer.resume(assigned)
            self._state = "<stable>"

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        self._give_up(consumer, partitions, "on_partitions_revoked")

    def _on_lost(self, consumer: Any, partitions: list[Any]) -> None:
        self._give_up(consumer, partitions, "on_partitions_lost")

    def _give_up(self, consumer: Any, partitions: list[Any], callback: str) -> None:
        """A revocation or a lost assignment: the listener's `callback` first, then the partitions go."""
        self._state = "<rebalancing>"
        try:
            if self._listener is not None:
                getattr(self._listener, callback)(_kafka_parts(partitions))
        finally:
            consumer.unassign()

    def group_metadata(self) -> _GroupMetadata:
        """kafka-python's MemberState names: <unjoined> before the first assignment, <rebalancing> between a
        revocation and the next assignment, <stable> after one."""
        return _GroupMetadata(self._state)

    # ---- records -------------------------------------------------------------------------------------
    def poll(self, timeout_ms: int = 0, max_records: int = 500) -> dict[Any, list[Record]]:
        """Up to max_records records, grouped by partition in offset order, as KafkaConsumer.poll."""
        from kafka import TopicPartition

        if self._fatal is not None:
            raise self._fatal
        out: dict[Any, list[Record]] = {}
        keys: dict[tuple[str, int], Any] = {}
        for m in self._consumer.consume(num_messages=max_records, timeout=timeout_ms / 1000):
            err = m.error()
            if err is not None:
                if err.fatal() or err.name() in _PERMANENT:
                    # as kafka-python raises a non-retriable error out of poll: the writer exits, and says why
                    raise RuntimeError(f"kafka: consumer error: {err}")
                self._warn(f"consume: {err} (librdkafka retries it)")
                continue
            topic, partition, offset = m.topic(), m.partition(), m.offset()
            if topic is None or partition is None or offset is None:  # only error events lack them
                continue
            tp = keys.get((topic, partition))
            if tp is None:
                tp = keys[(topic, partition)] = TopicPartition(topic, partition)
                out[tp] = []
            kind, ts = m.timestamp()
            out[tp].append(Record(offset, m.value(), m.key(), ts if kind else None))
        return out

    def seek(self, tp: Any, offset: int) -> None:
        if self._pending is not None:
            self._pending[(tp.topic, tp.partition)] = offset
            return
        from confluent_kafka import TopicPartition as RdTopicPartition

        self._consumer.seek(RdTopicPartition(tp.topic, tp.partition, offset))

    def seek_to_beginning(self, *tps: Any) -> None:
        from confluent_kafka import OFFSET_BEGINNING

        for tp in tps:
            self.seek(tp, OFFSET_BEGINNING)

    def pause(self, *tps: Any) -> None:
        from confluent_kafka import TopicPartition as RdTopicPartition

        self._consumer.pause([RdTopicPartition(tp.topic, tp.partition) for tp in tps])

    def commit_async(self, offsets: dict[Any, Any]) -> None:
        from confluent_kafka import TopicPartition as RdTopicPartition

        self._consumer.commit(offsets=[RdTopicPartition(tp.topic, tp.partition, meta.offset)
                                       for tp, meta in offsets.items()], asynchronous=True)

    # ---- metadata ------------------------------------------------------------------------------------
    def topics(self) -> set[str]:
        self._metadata = self._consumer.list_topics(timeout=5)
        return set(self._metadata.topics)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        if self._metadata is None:
            self.topics()
        meta = self._metadata.topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return None
        return set(meta.partitions)

    def end_offsets(self, tps: Iterable[Any], timeout_ms: int = 2000) -> dict[Any, int]:
        """The log end offsets, asked of the brokers now in one admin request (raises when it is not answered).

        Not the consumer's get_watermark_offsets: its request waits behind the consumer's own long-polling fetch
        on the broker's one connection, up to fetch.wait.max.ms a partition, which stalled the writer's loop
        ~2 s at every status refresh."""
        from confluent_kafka import TopicPartition as RdTopicPartition
        from confluent_kafka.admin import OffsetSpec

        tps = list(tps)
        if not tps:
            return {}
        futures = self._admin_client().list_offsets(
            {RdTopicPartition(tp.topic, tp.partition): OffsetSpec.latest() for tp in tps},
            request_timeout=timeout_ms / 1000)
        ends = {(k.topic, k.partition): f.result(timeout=timeout_ms / 1000).offset for k, f in futures.items()}
        return {tp: ends[(tp.topic, tp.partition)] for tp in tps}

    def _admin_client(self) -> Any:
        from confluent_kafka.admin import AdminClient

        if self._admin is None:
            self._admin = AdminClient(self._client_conf)
        return self._admin

    def topic_id(self, topic: str) -> str | None:
        """The topic's id (KIP-516) as kafka-python names it (a uuid.UUID's text); None when unknown."""
        from confluent_kafka import TopicCollection

        try:
            described = self._admin_client().describe_topics(TopicCollection([topic]),
                                                              request_timeout=5)[topic].result()
        except Exception as exc:  # unknown: the writer treats it as kafka-python's None
            log.debug("topic id of %s unavailable: %s", topic, exc)
            return None
        return uuid_text(getattr(described, "topic_id", None))

    # ---- life ----------------------------------------------------------------------------------------
    def _on_error(self, err: Any) -> None:
        if err.fatal():
            self._fatal = RuntimeError(f"kafka: fatal client error: {err}")
        self._warn(f"kafka client: {err}")

    def _warn(self, text: str) -> None:
        """A client error librdkafka retries itself: the first, then every 20th (an outage repeats them)."""
        self._errors += 1
        (log.warning if self._errors % 20 == 1 else log.debug)("%s (%d client errors so far)", text, self._errors)

    def close(self, autocommit: bool = False, timeout_ms: int | None = None) -> None:
        """Leave the group without calling the listener (as kafka-python's close); give up waiting after
        timeout_ms (librdkafka's close has no timeout of its own: with the coordinator away it can wait ~60 s)."""
        self._listener = None
        closer = threading.Thread(target=self._consumer.close, name="rdkafka-close", daemon=True)
        closer.start()
        closer.join(None if timeout_ms is None else timeout_ms / 1000)
        if closer.is_alive():
            log.warning("kafka: the consumer did not close within %d ms; leaving it behind", timeout_ms)
