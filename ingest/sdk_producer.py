"""An SDK logger's Kafka producer: created in the background when the broker listens (never blocking the host),
its settings, the topic's record cap learned once, and the dead-letter notices sent through it. When to send, spill
and replay is the delivery pipeline's (flywheel.ingest.sdk); this module only makes, configures and closes the
producer. kafka-python is imported lazily, in the background thread.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import threading
import time
from typing import Any

from flywheel.base.config import ConfigError
from flywheel.base.kafka import RECORD_OVERHEAD_BYTES, client_kwargs, load_kafka_config, topic_configs
from flywheel.ingest import schema
from flywheel.ingest.sdk_counters import Counters, WarnOnce

log = logging.getLogger("flywheel.ingest.sdk")  # the SDK's parts all log as the SDK: a host configures one logger


def close_producer(producer: Any, timeout: float) -> None:
    """Close a KafkaProducer within `timeout` seconds (0: at once), whatever it still holds."""
    try:
        producer.close(timeout=timeout)
    except Exception:
        # kafka-python 3.0: close() raises from its flush() while records are still pending and then
        # never force-closes, leaving its sender thread running and __del__ retrying (and raising) at
        # exit. Everything pending is already in our spool: stop it the way close() would have.
        sender = getattr(producer, "_sender", None)
        if sender is not None:
            sender.force_close()
        producer._closed = True


class ProducerLife:
    """The producer of one logger's pipeline (None while Kafka is unreachable), and what it learns of the topic."""

    def __init__(self, bootstrap: str, topic: str, name: str, compression: str | None, retry_s: float,
                 producer_config: dict[str, Any], counts: Counters, warn: WarnOnce) -> None:
        self.bootstrap, self.topic, self.name = bootstrap, topic, name
        self.compression, self.retry_s, self.producer_config = compression, retry_s, producer_config
        self._counts, self.warn = counts, warn
        self.producer: Any = None
        self.tried = 0.0  # monotonic time of the last attempt to create one
        self.delivery_timeout_s = 30.0  # the producer's delivery_timeout_ms, once created
        # The record cap: schema.MAX_RECORD_BYTES until the topic's max.message.bytes is read (once, at connect)
        self.record_cap = schema.MAX_RECORD_BYTES
        self.topic_max_message_bytes: int | None = None
        self._cap_learned = False
        self.dlq_topic = schema.DLQ_TOPIC
        self._notices: collections.deque[dict[str, Any]] = collections.deque(maxlen=1000)  # DLQ notices not yet sent

    def drop(self) -> Any:
        """Forget the producer (the caller closes it) so that the next ensure() makes a new one at once."""
        producer, self.producer = self.producer, None
        self.tried = 0.0
        return producer

    def broker_reachable(self) -> bool:
        for server in self.bootstrap.split(","):
            host, _, port = server.strip().rpartition(":")
            try:
                with socket.create_connection((host or "127.0.0.1", int(port or 9092)), timeout=0.5):
                    return True
            except (OSError, ValueError):
                continue
        return False

    def ensure(self, probed: bool = False) -> str | None:
        """Create the producer if there is none (at most every retry_s); `probed`: the broker was just found
        listening. Returns why there is none when an attempt failed (the pipeline then counts Kafka as down)."""
        if self.producer is not None or time.monotonic() - self.tried < self.retry_s:
            return None
        self.tried = time.monotonic()
        # fail in milliseconds instead of blocking for bootstrap_timeout_ms
        if not probed and not self.broker_reachable():
            return "no broker listening"
        try:
            from kafka import KafkaProducer
        except ImportError as exc:
            self.warn("import", "sdk %s: kafka-python is not installed (%s); records are spooled", self.name, exc)
            return "kafka-python missing"
        try:
            config = self.settings()
        except ConfigError as exc:  # bad FLYWHEEL_KAFKA_* settings: the host keeps running, records are spooled
            self.warn("kafka-config", "sdk %s: Kafka client settings invalid (%s); records are spooled", self.name, exc)
            return "Kafka client settings invalid"
        try:
            self.producer = KafkaProducer(**config)
        except Exception as exc:  # NoBrokersAvailable, KafkaTimeoutError, authentication and config errors
            return f"cannot connect: {type(exc).__name__}: {exc}"
        self.delivery_timeout_s = float(config["delivery_timeout_ms"]) / 1000.0
        if not self._cap_learned:
            # Once per pipeline, beside this thread: an admin round trip (seconds where describe is slow or refused)
            # must not hold up delivery. Until it answers the cap is schema.MAX_RECORD_BYTES, and a record the topic
            # refuses as too large is named in a DLQ notice all the same (_reject).
            self._cap_learned = True
            threading.Thread(target=self._learn_record_cap, args=(config,), name=f"flywheel-sdk-{self.name}-cap",
                             daemon=True).start()
        # kafka-python registers its own atexit close, which would run before ours (atexit is LIFO) and
        # close the producer while our queue still holds records; our hook closes it after draining.
        unregister = getattr(self.producer, "_unregister_cleanup", None)
        if callable(unregister):
            unregister()
        log.info("sdk %s: connected to Kafka at %s (topic %s, compression %s)",
                 self.name, self.bootstrap, self.topic, self.compression)
        return None

    def settings(self) -> dict[str, Any]:
        """kafka-python settings: ours, then the shared security settings (FLYWHEEL_KAFKA_*), then producer_config."""
        config: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap.split(","),
            **client_kwargs(load_kafka_config(), f"flywheel-sdk-{self.name}"),
            "acks": "all",
            "enable_idempotence": True,  # broker-side de-duplication of producer retries
            "compression_type": self.compression,
            "linger_ms": 10,
            "batch_size": 256 * 1024,
            "max_request_size": schema.MAX_RECORD_BYTES + 64 * 1024,
            "bootstrap_timeout_ms": 2000,  # creation happens here, in the background, and is retried
            # a send must never stall this thread for long (the host is not waiting, the queue is)
            "max_block_ms": 2000,
            "request_timeout_ms": 5000,
            "delivery_timeout_ms": 30_000,  # after this a record fails and goes to the spool
            "reconnect_backoff_max_ms": 1000,
        }
        config.update(self.producer_config)
        return config

    def _learn_record_cap(self, config: dict[str, Any]) -> None:
        """Cap records below the topic's max.message.bytes, read once through an admin client with the producer's
        settings: a default cluster's 1 MiB would otherwise refuse records the schema allows up to 4 MiB."""
        try:
            from kafka import KafkaAdminClient

            settings = {k: v for k, v in config.items() if k in KafkaAdminClient.DEFAULT_CONFIG}
            settings.update(client_id=f"{config.get('client_id', 'flywheel-sdk')}-admin", request_timeout_ms=5000)
            admin = KafkaAdminClient(**settings)
            try:
                limit = int(topic_configs(admin, [self.topic])[self.topic]["max.message.bytes"])
            finally:
                admin.close()
        except Exception as exc:  # no describe rights, an old broker, a topic not created yet: keep the cap we have
            log.warning("sdk %s: cannot read max.message.bytes of %s (%s: %s); records stay capped at %d bytes",
                        self.name, self.topic, type(exc).__name__, exc, self.record_cap)
            return
        self.topic_max_message_bytes = limit
        self.record_cap = min(schema.MAX_RECORD_BYTES, limit - RECORD_OVERHEAD_BYTES)
        log.info("sdk %s: topic %s takes records up to max.message.bytes=%d; records capped at %d bytes",
                 self.name, self.topic, limit, self.record_cap)

    def over_cap(self, what: str, record: dict[str, Any], size: int) -> bool:
        """Whether a record of `size` bytes is over the record cap; one that is goes to oversized_record."""
        if size <= self.record_cap:
            return False
        self.oversized_record(what, record, size)
        return True

    def oversized_record(self, what: str, record: dict[str, Any], size: int) -> None:
        """A record over the cap: counted, warned once, and named in a small notice to the DLQ topic.

        Never silently dropped, yet never sent whole: the topic would refuse it. The notice (reason, event id,
        session id, size, cap) is what the lake writer's dead letters look like, so the same DLQ dashboards and
        `flywheel status` see it; the record's content is not kept (it may hold the agent's prompts, and a
        side file on the agent's host is where nobody looks).
        """
        self._counts.oversized += 1
        detail = (f"{size} bytes > cap {self.record_cap} (topic {self.topic} max.message.bytes "
                  f"{self.topic_max_message_bytes or 'unknown'}, schema.MAX_RECORD_BYTES {schema.MAX_RECORD_BYTES})")
        self.warn(f"oversized:{what}", "sdk %s: %s not sent: %s; counted as oversized and named in a notice to %s",
                  self.name, what, detail, self.dlq_topic)
        self.add_notice("oversized", detail, record, size)

    def add_notice(self, reason: str, detail: str, record: dict[str, Any], size: int) -> None:
        self._notices.append({"reason": reason, "detail": detail, "topic": self.topic, "partition": None,
                              "offset": None, "source": f"sdk:{self.name}",
                              "id": record.get("event_id") or record.get("outcome_id"), "type": record.get("type"),
                              "session_id": record.get("session_id"), "bytes": size, "ts": schema.now_ts()})

    def send_notices(self) -> None:
        """Send the DLQ notices not yet sent (the pipeline calls this only while Kafka is up)."""
        while self._notices and self.producer is not None:
            notice = self._notices[0]
            try:
                future = self.producer.send(self.dlq_topic, key=str(notice["id"]).encode(),
                                             value=json.dumps(notice).encode())
            except Exception as exc:  # kept for the next cycle (the deque is bounded)
                self.warn(f"notice:{type(exc).__name__}", "sdk %s: DLQ notice not sent (%s); retried", self.name, exc)
                return
            self._notices.popleft()
            future.add_callback(self._on_notice)
            future.add_errback(lambda exc: self.warn("notice-failed", "sdk %s: DLQ notice to %s failed (%s); the "
                                                     "record stays counted as oversized",
                                                     self.name, self.dlq_topic, exc))

    def _on_notice(self, _metadata: Any) -> None:
        self._counts.oversized_noticed += 1
