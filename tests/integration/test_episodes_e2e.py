"""Kafka -> the real lake writer -> `flywheel episodes`: episodes from records that crossed the broker.

Sessions go to a fresh events topic with two partitions (keyed by session_id, as the SDK does),
outcomes to a fresh outcomes topic, half of them only after a first builder run (their sessions'
30 s windows have closed, so label 1 counts them missing); the second run resumes from its
cursor over the lake writer's files and appends label 2 for exactly those sessions. With the late
outcomes, a third of the events cross the broker again (an SDK replaying its spool after an
outage): copies of sessions already labelled, which must change no row and count as duplicates.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pytest

from bench.fixtures import sessions as synthetic
from flywheel.ingest import lake
from flywheel.ingest.lake_writer import LakeWriterConfig, run

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[2]
TOML = """
[outcomes.task_success]
window_s = 30
missing = 0.0
lo = 0.0
hi = 1.0
[task_types.tool_use]
wait_for = ["task_success"]
"""


def produce(bootstrap: str, topic: str, records: list[dict]) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for r in records:
        producer.send(topic, key=r["session_id"].encode(), value=json.dumps(r).encode())
    producer.flush()
    producer.close()


def write_lake(bootstrap: str, topics: dict[str, str], root: Path, expect: dict[str, int]) -> None:
    cfg = LakeWriterConfig(kafka_bootstrap=bootstrap, events_topic=topics["events"], outcomes_topic=topics["outcomes"],
                           dlq_topic=topics["dlq"], group_id=f"g-{topics['events']}", lake_root=str(root),
                           roll_max_age_s=0.5, var_dir=str(root.parent / "var"), session_timeout_s=6)

    def rows(table: str) -> int:
        return sum(f.rows_range for f in lake.list_files(str(root), table))

    def done() -> bool:
        return all(rows(t) >= n for t, n in expect.items())

    deadline = time.monotonic() + 90
    run(cfg, stop=lambda _w: done() or time.monotonic() > deadline)
    assert done(), f"lake writer: {[(t, rows(t)) for t in expect]} of {expect}"


def builder(root: Path, tmp: Path) -> subprocess.CompletedProcess:
    toml = tmp / "rewards.toml"
    toml.write_text(TOML)
    return subprocess.run([sys.executable, "-m", "flywheel.cli", "episodes", "--lake-root", str(root), "--state-dir",
                           str(tmp / "state"), "--rewards-toml", str(toml), "--var-dir", str(tmp / "var")],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)


def test_kafka_lake_writer_to_episodes(kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path) -> None:
    topics = {"events": new_topic("ep-events", partitions=2), "outcomes": new_topic("ep-outcomes"), "dlq": new_topic("ep-dlq")}
    root = tmp_path / "lake"
    start = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=10)
    events, outcomes = synthetic.generate(30, start, seed=7, sub_agents=0.5, spacing_s=1.0)
    early, late = outcomes[::2], outcomes[1::2]
    produce(kafka_bootstrap, topics["events"], events)
    produce(kafka_bootstrap, topics["outcomes"], early)
    write_lake(kafka_bootstrap, topics, root, {"events": len(events), "outcomes": len(early)})
    assert len({f.partition for f in lake.list_files(str(root), "events")}) == 2

    first = builder(root, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    n_calls = sum(e["type"] == "llm_call" for e in events)
    table = pa.concat_tables([lake.read_file(str(root), f) for f in lake.list_files(str(root), "episodes")])
    assert table.num_rows == n_calls, f"{table.num_rows} rows for {n_calls} llm_calls"
    assert set(table["label_version"].to_pylist()) == {1}

    produce(kafka_bootstrap, topics["outcomes"], late)
    replayed = events[::3]
    produce(kafka_bootstrap, topics["events"], replayed)
    write_lake(kafka_bootstrap, topics, root, {"events": len(events) + len(replayed), "outcomes": len(outcomes)})
    second = builder(root, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    rows = pa.concat_tables([lake.read_file(str(root), f) for f in lake.list_files(str(root), "episodes")]).to_pylist()
    late_sids = {o["session_id"]: o["value"] for o in late}
    label2 = [r for r in rows if r["label_version"] == 2]
    assert {r["session_id"] for r in label2} == set(late_sids), "each late outcome appends label 2 of its session"
    assert all(r["r_outcome"] == late_sids[r["session_id"]] for r in label2)
    assert len(rows) == n_calls + len(label2)
    state = tmp_path / "state"
    counters = json.loads((state / (state / "CURRENT").read_text().strip() / "state.json").read_text())["counters"]
    # the lake writer may drop copies itself (a de-duplication window); each copy that landed is a duplicate here
    landed = sum(lake.read_file(str(root), f).num_rows for f in lake.list_files(str(root), "events")) - len(events)
    assert "dropped_late_event" not in counters, f"re-sent copies counted as late events: {counters}"
    assert counters.get("dropped_duplicate_event", 0) == landed, f"{landed} of {len(replayed)} copies landed: {counters}"
