"""The lake writer on its optional librdkafka client (`--kafka-client confluent`, ingest/rdkafka_consumer.py) keeps
every guarantee of the default client: exactly once through SIGKILLs, and a takeover inside one group (here a group
mixing both clients, so each resumes the other's lake and reads the topic's identity the other recorded). A
recreated topic paused by its Kafka topic id: tests/integration/test_lake_writer.py, on both clients. Real
subprocesses against the session's broker."""

from __future__ import annotations

import random
import signal
import threading
import uuid
from pathlib import Path
from typing import Callable

import pytest

from tests.integration.test_lake_writer_kill import (
    BAD_EVERY,
    check_exact,
    kill_loop,
    landed,
    produce,
    read_letters,
    start_writer,
    wait_for,
)

pytest.importorskip("confluent_kafka", reason="the rdkafka extra (make setup installs it with [all])")

CONFLUENT = ["--kafka-client", "confluent"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_30k_events_survive_8_sigkills_of_a_librdkafka_writer(kafka_bootstrap: str, new_topic: Callable[..., str],
                                                              tmp_path: Path) -> None:
    n, partitions, kills = 30_000, 4, 8
    topic, dlq = new_topic("lw-rd-kill", partitions=partitions), new_topic("lw-rd-kill-dlq")
    root, var = tmp_path / "lake", tmp_path / "var"
    var.mkdir()
    group = f"test-lw-rd-kill-{uuid.uuid4().hex[:8]}"
    produced: list[str] = []
    producer = threading.Thread(target=lambda: produced.extend(produce(kafka_bootstrap, topic, n, partitions, 1500,
                                                                       BAD_EVERY)))
    producer.start()
    progress = kill_loop(kafka_bootstrap, topic, dlq, group, root, var, producer, n, kills, random.Random(5),
                         extra=CONFLUENT)
    mid_stream = sum(1 for a, b in zip(progress, progress[1:]) if b > a and b < n)
    assert mid_stream >= 4, f"only {mid_stream} kills came between progress and completion: {progress}"
    # (no exit status here: the last incarnation may get its SIGTERM while it still imports; the group test below
    # holds a librdkafka writer to a clean exit on SIGTERM)
    check_exact(root, topic, produced, partitions)
    bad = {(i % partitions, i // partitions) for i in range(BAD_EVERY - 1, n, BAD_EVERY)}
    letters = read_letters(kafka_bootstrap, dlq, len(bad))
    assert bad <= letters, f"{len(bad - letters)} of {len(bad)} dead letters missing from the DLQ"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_of_both_clients_hands_partitions_over_and_lands_each_event_once(
        kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path) -> None:
    """kafka-python's writer lands the first half and records the topic's identity; it is killed mid-stream and the
    librdkafka writer takes every partition over from the lake. Had the two clients named the topic id differently,
    the second would pause every partition as a recreated topic and the second half would never land."""
    from flywheel.base.heartbeat import read_statuses

    n, partitions = 12_000, 4
    topic, dlq = new_topic("lw-mixed", partitions=partitions), new_topic("lw-mixed-dlq")
    root, var = tmp_path / "lake", tmp_path / "var"
    var.mkdir()
    group = f"test-lw-mixed-{uuid.uuid4().hex[:8]}"
    a = start_writer(kafka_bootstrap, topic, dlq, group, "a", root, var)
    b = start_writer(kafka_bootstrap, topic, dlq, group, "b", root, var, extra=CONFLUENT)

    def both_own_partitions() -> bool:
        st = read_statuses(var)
        return all(st.get(f"lake-writer-{w}", {}).get("partitions", 0) > 0 for w in ("a", "b"))

    try:
        wait_for(both_own_partitions, 150, "both writers to own partitions")
        produced = produce(kafka_bootstrap, topic, n // 2, partitions)
        wait_for(lambda: landed(root, topic) >= n // 2, 60, "the first half in the lake")
        a.send_signal(signal.SIGKILL)
        a.wait()
        produced += produce(kafka_bootstrap, topic, n - n // 2, partitions)
        wait_for(lambda: landed(root, topic) >= n, 90, f"{n} events after b took over a's partitions")
        wait_for(lambda: read_statuses(var)["lake-writer-b"].get("partitions") == partitions, 10,
                 "b's heartbeat to show all partitions")
        wait_for(lambda: read_statuses(var)["lake-writer-b"].get("lag_records") == 0, 10, "b's heartbeat to show lag 0")
        assert read_statuses(var)["lake-writer-b"].get("rewound_partitions") == [], "b paused a partition it owns"
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
    assert b.returncode == 0, f"SIGTERM must finish the current work and exit 0, got {b.returncode}"
    check_exact(root, topic, produced, partitions)
