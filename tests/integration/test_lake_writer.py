"""The lake writer against the real Kafka broker: dead letters, plain readers, status."""

from __future__ import annotations

import base64
import json
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from flywheel.ingest import lake, schema
from flywheel.ingest.lake_writer import LakeWriterConfig, run

pytestmark = pytest.mark.timeout(180)


def session_event(i: int, **extra: object) -> dict:
    record = {"schema_version": 1, "event_id": uuid.uuid4().hex, "session_id": f"s{i % 5}", "agent_id": "main",
              "seq": i, "ts": schema.now_ts(), "type": "session_start", "task_type": "code_edit",
              "tags": {"i": i}}
    record.update(extra)
    return record


def run_until(cfg: LakeWriterConfig, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Run the writer in this process until `done()` holds (checked between polls)."""
    deadline = time.monotonic() + timeout_s
    state = {"last": 0.0}

    def stop(_writer: object) -> bool:
        if time.monotonic() > deadline:
            return True
        if time.monotonic() - state["last"] < 0.5:
            return False
        state["last"] = time.monotonic()
        return done()

    run(cfg, stop=stop)
    assert done(), f"the writer did not finish within {timeout_s} s"


def read_dlq(bootstrap: str, topic: str, n: int, timeout_s: float = 20.0) -> list[dict]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, group_id=None, max_partition_fetch_bytes=32 * 1024 * 1024,
                             fetch_max_bytes=64 * 1024 * 1024)
    out: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        for messages in consumer.poll(timeout_ms=500).values():
            out += [json.loads(m.value) for m in messages]
    consumer.close()
    return out


def test_bad_records_land_in_the_dlq_and_good_ones_around_them_land(kafka_bootstrap: str, tmp_path: Path) -> None:
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    # the oversized case needs topics that accept records beyond schema.MAX_RECORD_BYTES
    big = {"max.message.bytes": str(16 * 1024 * 1024)}
    suffix = uuid.uuid4().hex[:10]
    topic, dlq = f"test.lw-events.{suffix}", f"test.lw-dlq.{suffix}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(topic, 1, 1, topic_configs=big), NewTopic(dlq, 1, 1, topic_configs=big)])
    try:
        missing = session_event(0)
        del missing["session_id"]
        oversized = json.dumps(session_event(0, task_type="x" * (schema.MAX_RECORD_BYTES + 10))).encode()
        bad = {
            1: (b'{"schema_version": 1, "event_id": ', "malformed_json"),
            3: (json.dumps(session_event(3, schema_version=7)).encode(), "unsupported_schema_version"),
            5: (json.dumps(missing).encode(), "invalid"),
            7: (oversized, "oversized"),
            9: (bytes(range(256)) * 4, "not_utf8"),
        }
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, max_request_size=16 * 1024 * 1024)
        good_ids = []
        for i in range(11):
            if i in bad:
                value = bad[i][0]
            else:
                record = session_event(i)
                good_ids.append(record["event_id"])
                value = json.dumps(record).encode()
            producer.send(topic, value=value, key=b"k").get(timeout=30)
        producer.close()

        root = str(tmp_path / "lake")
        cfg = LakeWriterConfig(kafka_bootstrap=kafka_bootstrap, events_topic=topic, outcomes_topic="", dlq_topic=dlq,
                               group_id=f"test-lw-{suffix}", lake_root=root, var_dir=str(tmp_path / "var"),
                               roll_max_age_s=0.5, session_timeout_s=6)
        run_until(cfg, lambda: lake.next_offsets(root, "events", topic) == {0: 11})

        import pyarrow.parquet as pq

        landed = [r for f in lake.list_files(root, "events") for r in pq.read_table(f.path).to_pylist()]
        assert sorted(r["event_id"] for r in landed) == sorted(good_ids), "the good records around the bad ones must land"
        assert sorted(r["_offset"] for r in landed) == [0, 2, 4, 6, 8, 10]
        letters = {e["offset"]: e for e in read_dlq(kafka_bootstrap, dlq, len(bad))}
        assert sorted(letters) == sorted(bad), f"DLQ holds offsets {sorted(letters)}, expected {sorted(bad)}"
        for offset, (value, reason) in bad.items():
            e = letters[offset]
            assert e["reason"] == reason, f"offset {offset}: reason {e['reason']} ({e['detail']}), expected {reason}"
            assert base64.b64decode(e["original_b64"]) == value, f"offset {offset}: DLQ lost the original bytes"
            assert (e["topic"], e["partition"]) == (topic, 0) and e["detail"]
    finally:
        admin.delete_topics([topic, dlq])
        admin.close()


def test_plain_duckdb_and_pyarrow_read_the_lake(kafka_bootstrap: str, new_topic: Callable[..., str],
                                                 tmp_path: Path) -> None:
    from kafka import KafkaProducer

    events, outcomes, dlq = new_topic("lw-ev", partitions=2), new_topic("lw-out", partitions=1), new_topic("lw-dlq")
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=10)
    for i in range(300):
        producer.send(events, value=json.dumps(session_event(i)).encode(), key=f"s{i % 5}".encode())
    for i in range(20):
        outcome = {"schema_version": 1, "outcome_id": uuid.uuid4().hex, "session_id": f"s{i % 5}",
                   "kind": "tests_passed", "value": 1.0, "ts": schema.now_ts(), "source": "ci"}
        producer.send(outcomes, value=json.dumps(outcome).encode())
    producer.flush()
    producer.close()

    root = tmp_path / "lake"
    var = tmp_path / "var"
    cfg = LakeWriterConfig(kafka_bootstrap=kafka_bootstrap, events_topic=events, outcomes_topic=outcomes,
                           dlq_topic=dlq, group_id=f"test-lw-{uuid.uuid4().hex[:8]}",
                           lake_root=str(root), var_dir=str(var), roll_max_age_s=0.5, session_timeout_s=6,
                           status_interval_s=0.5)

    def landed() -> bool:
        ev = sum(lake.next_offsets(str(root), "events", events).values())
        return ev == 300 and lake.next_offsets(str(root), "outcomes", outcomes) == {0: 20}

    run_until(cfg, landed)

    import duckdb
    import pyarrow.dataset as ds

    con = duckdb.connect()
    n_events = con.execute(f"SELECT count(*) FROM read_parquet('{root}/events/**/*.parquet', hive_partitioning=1)").fetchone()[0]
    n_dates = con.execute(f"SELECT count(DISTINCT date) FROM read_parquet('{root}/events/**/*.parquet', hive_partitioning=1)").fetchone()[0]
    n_outcomes = con.execute(f"SELECT sum(value) FROM read_parquet('{root}/outcomes/**/*.parquet')").fetchone()[0]
    assert (n_events, n_outcomes) == (300, 20.0), f"duckdb read {n_events} events, outcome sum {n_outcomes}"
    assert n_dates >= 1
    table = ds.dataset(str(root / "events"), format="parquet", partitioning="hive").to_table()
    assert table.num_rows == 300 and "date" in table.column_names, table.schema
    status = json.loads(next((var / "run" / "status").glob("lake-writer-*.json")).read_text())
    assert status["state"] == "stopped" and status["rows"] == 320, status


def test_a_missing_dlq_topic_fails_at_start_up(kafka_bootstrap: str, new_topic: Callable[..., str],
                                               tmp_path: Path) -> None:
    cfg = LakeWriterConfig(kafka_bootstrap=kafka_bootstrap, events_topic=new_topic("lw-ev"), outcomes_topic="",
                           dlq_topic=f"test.absent.{uuid.uuid4().hex[:8]}", lake_root=str(tmp_path / "lake"),
                           var_dir=str(tmp_path / "var"))
    assert run(cfg) == 2, "a writer without its dead-letter topic must refuse to start"
