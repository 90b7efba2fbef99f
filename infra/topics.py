"""`flywheel topics create|check`: the events, outcomes and DLQ topics on a real Kafka cluster.

    flywheel topics create --kafka-bootstrap b1:9092 --partitions 12 --replication-factor 3
    flywheel topics check  --kafka-bootstrap b1:9092     # exit 1 naming each mismatch

`create` creates the topics that are missing with the given partitions, replication factor and configs
(min.insync.replicas, retention.ms, max.message.bytes), leaves existing ones alone, then checks all three.
`check` reads the live topics (metadata and describe_configs) and names every setting that falls short:
fewer partitions or replicas, a lower min.insync.replicas (or one no smaller than the replication factor,
so one broker down stops acks=all writes), a shorter retention, or a max.message.bytes below the flag or
below the largest record the SDK sends (events, outcomes) or the lake writer dead-letters (DLQ).
Security settings come from FLYWHEEL_KAFKA_* (flywheel.base.kafka), as for every other process.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass
from typing import Any, Literal

from flywheel.base import defaults
from flywheel.base.config import ConfigError, check_choices, load_config, setting, setup_logging
from flywheel.base.kafka import (
    RECORD_OVERHEAD_BYTES,
    client_kwargs,
    create_missing_topics,
    load_kafka_config,
    topic_configs,
)
from flywheel.ingest import schema

log = logging.getLogger(__name__)

# The largest record each topic must take: the SDK's (key + value under its cap), and the lake writer's
# dead letter of such a record (base64 of the original inside a JSON envelope).
SDK_LARGEST_RECORD = schema.MAX_RECORD_BYTES + RECORD_OVERHEAD_BYTES
DLQ_LARGEST_RECORD = 4 * math.ceil(schema.MAX_RECORD_BYTES / 3) + 4 * RECORD_OVERHEAD_BYTES


@dataclass
class TopicsConfig:
    """Create or check the flywheel topics on a Kafka cluster."""

    action: Literal["create", "check"] = setting("check", "create or check")
    kafka_bootstrap: str = setting(defaults.KAFKA_BOOTSTRAP, "Kafka bootstrap servers")
    events_topic: str = setting(schema.EVENTS_TOPIC, "topic of agent events")
    outcomes_topic: str = setting(schema.OUTCOMES_TOPIC, "topic of outcomes")
    dlq_topic: str = setting(schema.DLQ_TOPIC, "dead-letter topic")
    partitions: int = setting(12, "partitions per topic (at least the number of lake writers you will run)")
    replication_factor: int = setting(3, "replicas per partition")
    min_insync_replicas: int = setting(2, "min.insync.replicas: replicas that must have a record before "
                                          "acks=all succeeds")
    retention_ms: int = setting(7 * 24 * 3600 * 1000, "retention.ms: how long a lake writer may be down without loss")
    max_message_bytes: int = setting(8 * 1024 * 1024, "max.message.bytes: largest record batch a topic accepts")
    timeout_s: float = setting(30.0, "how long an admin request may take")
    log_level: str = setting("INFO", "logging level")

    def check(self) -> None:
        check_choices(self)
        for name in ("partitions", "replication_factor", "min_insync_replicas", "retention_ms", "max_message_bytes"):
            if getattr(self, name) < 1 and not (name == "retention_ms" and getattr(self, name) == -1):
                raise ConfigError(f"{name}: must be >= 1"
                                  + (" (or -1: keep forever)" if name == "retention_ms" else ""))
        if self.min_insync_replicas > self.replication_factor:
            raise ConfigError(f"min_insync_replicas, replication_factor: {self.min_insync_replicas} in-sync replicas "
                              f"cannot be required of {self.replication_factor} replicas")
        if len({self.events_topic, self.outcomes_topic, self.dlq_topic}) != 3:
            raise ConfigError("events_topic, outcomes_topic, dlq_topic: must be three different topics")

    def topics(self) -> dict[str, int]:
        """Each topic and the largest record it must take."""
        return {self.events_topic: SDK_LARGEST_RECORD, self.outcomes_topic: SDK_LARGEST_RECORD,
                self.dlq_topic: DLQ_LARGEST_RECORD}

    def topic_settings(self) -> dict[str, str]:
        return {"min.insync.replicas": str(self.min_insync_replicas), "retention.ms": str(self.retention_ms),
                "max.message.bytes": str(self.max_message_bytes)}


@dataclass
class LiveTopic:
    """What the cluster says about one topic."""

    partitions: int
    replication_factor: int  # the smallest replica count of any partition
    configs: dict[str, str]


def mismatches(cfg: TopicsConfig, topic: str, live: LiveTopic | None, largest_record: int) -> list[str]:
    """Each way `live` falls short of `cfg` for `topic`, as one line naming the setting and both values."""
    if live is None:
        return [f"{topic}: missing (run `flywheel topics create`)"]
    out = []
    if live.partitions < cfg.partitions:
        out.append(f"{topic}: {live.partitions} partitions < --partitions {cfg.partitions}")
    if live.replication_factor < cfg.replication_factor:
        out.append(f"{topic}: replication factor {live.replication_factor} < --replication-factor "
                   f"{cfg.replication_factor}")
    isr = _int(live.configs.get("min.insync.replicas"))
    if isr is not None and isr < cfg.min_insync_replicas:
        out.append(f"{topic}: min.insync.replicas {isr} < --min-insync-replicas {cfg.min_insync_replicas}")
    if isr is not None and live.replication_factor > 1 and isr >= live.replication_factor:
        out.append(f"{topic}: min.insync.replicas {isr} >= replication factor {live.replication_factor}: "
                   "one broker down stops every acks=all write")
    retention = _int(live.configs.get("retention.ms"))
    if retention is not None and retention != -1 and (cfg.retention_ms == -1 or retention < cfg.retention_ms):
        out.append(f"{topic}: retention.ms {retention} < --retention-ms {cfg.retention_ms}")
    size = _int(live.configs.get("max.message.bytes"))
    if size is not None and size < cfg.max_message_bytes:
        out.append(f"{topic}: max.message.bytes {size} < --max-message-bytes {cfg.max_message_bytes}")
    if size is not None and size < largest_record:
        who = ("a dead letter of the largest SDK record" if largest_record == DLQ_LARGEST_RECORD
               else "the SDK's largest record")
        out.append(f"{topic}: max.message.bytes {size} < {who} ({largest_record} bytes)")
    return out


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def live_topics(admin: Any, topics: list[str]) -> dict[str, LiveTopic]:
    """Partitions, replication factor and configs of each existing topic among `topics`."""
    described = {(t.get("name") or t.get("topic")): t for t in admin.describe_topics(topics)}
    configs = topic_configs(admin, [t for t in topics if t in described and not described[t].get("error_code")])
    out = {}
    for name, meta in described.items():
        if meta.get("error_code") or name not in configs:
            continue  # unknown topic (or not ours to describe)
        parts = meta.get("partitions") or []
        replicas = [len(p.get("replica_nodes", p.get("replicas", []))) for p in parts]
        out[name] = LiveTopic(len(parts), min(replicas, default=0), configs[name])
    return out


def _admin(cfg: TopicsConfig) -> Any:
    from kafka import KafkaAdminClient

    kafka = load_kafka_config()
    log.info("setup: admin client for %s (%s)", cfg.kafka_bootstrap, kafka.describe())
    return KafkaAdminClient(bootstrap_servers=cfg.kafka_bootstrap, request_timeout_ms=int(cfg.timeout_s * 1000),
                            **client_kwargs(kafka, "flywheel-topics"))


def create(cfg: TopicsConfig, admin: Any) -> list[str]:
    """Create the missing topics with cfg's settings; return their names."""
    missing = create_missing_topics(admin, list(cfg.topics()), cfg.partitions, cfg.replication_factor,
                                    cfg.topic_settings())
    if missing:
        log.info("create: %s with %d partitions x %d replicas, %s", missing, cfg.partitions, cfg.replication_factor,
                 cfg.topic_settings())
    for topic in sorted(set(cfg.topics()) - set(missing)):
        log.info("create: %s exists; left as it is (the check below says whether it fits)", topic)
    return missing


def check(cfg: TopicsConfig, admin: Any) -> list[str]:
    """Every mismatch between the live topics and cfg (empty: all fit)."""
    live = live_topics(admin, list(cfg.topics()))
    return [line for topic, largest in cfg.topics().items()
            for line in mismatches(cfg, topic, live.get(topic), largest)]


def run(cfg: TopicsConfig) -> int:
    admin = _admin(cfg)
    try:
        if cfg.action == "create":
            create(cfg, admin)
        problems = check(cfg, admin)
    finally:
        admin.close()
    for line in problems:
        log.error("check: %s", line)
    if not problems:
        log.info("check: %s fit (partitions >= %d, replicas >= %d, %s)", ", ".join(cfg.topics()), cfg.partitions,
                 cfg.replication_factor, cfg.topic_settings())
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        args = ["--action", args[0]] + args[1:]
    cfg = load_config(TopicsConfig, args, prog="flywheel topics")
    setup_logging(cfg.log_level)
    try:
        load_kafka_config()  # fail fast, with one line, on bad FLYWHEEL_KAFKA_* settings
    except ConfigError as exc:
        log.error("setup: %s", exc)
        return 2
    return run(cfg)
