"""A group join kafka-python 3.0.12 drops, and `recover_lost_join` restarting it, on the real broker.

A fresh group on a fresh topic: the leader's first assignment is made before it knows the topic's partitions,
the metadata that follows asks for a rejoin, and a poll whose time runs out while that join runs leaves it
unawaited for ever (flywheel.base.kafka.recover_lost_join says how). Polling with a timeout of 0 ms makes the
window wide: without the repair the consumers end up rebalancing with nothing assigned (10 of 10 when this was
written); with it, every one holds its partitions.
"""

from __future__ import annotations

import time
import uuid
from typing import Callable

from flywheel.base.kafka import recover_lost_join

PARTITIONS = 4


def _join(bootstrap: str, topic: str, repair: bool, seconds: float = 4.0) -> tuple[str, int, int]:
    """(member state, partitions held, repairs) after polling a new group's consumer with timeout 0 for `seconds`."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=f"test-join-{uuid.uuid4().hex[:8]}",
                             client_id="tests", enable_auto_commit=False)
    repairs = 0
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            consumer.poll(timeout_ms=0)  # a busy writer's poll: the join runs between polls, on kafka-python's thread
            if repair and recover_lost_join(consumer):
                repairs += 1
        return str(consumer.group_metadata().state), len(consumer.assignment()), repairs
    finally:
        consumer.close(autocommit=False)


def test_a_join_whose_completion_was_dropped_is_restarted_and_the_member_gets_its_partitions(
        kafka_bootstrap: str, new_topic: Callable[..., str]) -> None:
    without = [_join(kafka_bootstrap, new_topic("join", partitions=PARTITIONS), repair=False) for _ in range(2)]
    print(f"without the repair (state, partitions, -): {without}")
    repaired = [_join(kafka_bootstrap, new_topic("join", partitions=PARTITIONS), repair=True) for _ in range(4)]
    print(f"with the repair (state, partitions, repairs): {repaired}")
    for state, held, _ in repaired:
        assert (state, held) == ("<stable>", PARTITIONS), f"a member stayed out of its group: {repaired}"
