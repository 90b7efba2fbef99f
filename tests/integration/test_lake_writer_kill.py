"""Exactly-once under SIGKILL: the lake holds each produced event once, whatever instant writers die.

The writers run as real subprocesses (`python -m ingest.lake_writer`) against the real broker.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from flywheel.ingest import lake, schema

ROOT = Path(__file__).resolve().parents[2]


BAD_EVERY = 997  # this many records in, one is malformed JSON: dead letters must survive the kills too


def produce(bootstrap: str, topic: str, n: int, partitions: int, rate: float | None = None,
            bad_every: int | None = None) -> list[str]:
    """Produce n small events round-robin over the partitions (at most `rate` per second).

    Returns the event_ids of the good events; every `bad_every`-th record is malformed JSON instead.
    """
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=256 * 1024,
                             compression_type="lz4", acks=1)
    ts = schema.now_ts()
    ids = []
    t0 = time.monotonic()
    for i in range(n):
        if bad_every and i % bad_every == bad_every - 1:
            producer.send(topic, value=b'{"schema_version": 1, "event_id": "cut', partition=i % partitions)
            continue
        eid = uuid.uuid4().hex
        ids.append(eid)
        record = {"schema_version": 1, "event_id": eid, "session_id": f"s{i % 97}", "agent_id": "main", "seq": i,
                  "ts": ts, "type": "session_start", "task_type": "t"}
        producer.send(topic, value=json.dumps(record).encode(), partition=i % partitions)
        if rate is not None and i % 50 == 0:  # smooth: bursts every 0.5 s could leave every open file empty
            time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
    producer.flush()
    producer.close()
    return ids


def start_writer(bootstrap: str, topic: str, dlq: str, group: str, instance: str, root: Path,
                 var: Path, roll_max_age_s: float = 0.5, extra: list[str] | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "flywheel.ingest.lake_writer", "--kafka-bootstrap", bootstrap, "--events-topic", topic,
            "--outcomes-topic", "", "--dlq-topic", dlq, "--group-id", group, "--instance-id", instance,
            "--lake-root", str(root), "--var-dir", str(var), "--roll-max-age-s", str(roll_max_age_s),
            "--roll-max-records", "2000",
            "--session-timeout-s", "6", "--log-level", "WARNING", *(extra or [])]
    log = open(var / f"{instance}.log", "ab")
    return subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def landed(root: Path, topic: str) -> int:
    return sum(lake.next_offsets(str(root), "events", topic).values())


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.3)


def check_exact(root: Path, topic: str, produced: list[str], partitions: int) -> None:
    import duckdb

    files = lake.list_files(str(root), "events")
    for p in range(partitions):
        ranges = sorted((f.first, f.last) for f in files if f.partition == p)
        assert ranges and ranges[0][0] == 0, f"partition {p}: files start at {ranges[:1]}"
        gaps = [(a, b) for a, b in zip(ranges, ranges[1:]) if b[0] != a[1] + 1]
        assert not gaps, f"partition {p}: files overlap or leave gaps: {gaps[:5]}"
    con = duckdb.connect()
    glob = f"{root}/events/**/*.parquet"
    total, distinct = con.execute(f"SELECT count(*), count(DISTINCT event_id) FROM read_parquet('{glob}')").fetchone()
    ids = [r[0] for r in con.execute(f"SELECT event_id FROM read_parquet('{glob}') ORDER BY event_id").fetchall()]
    want = hashlib.sha256("".join(sorted(produced)).encode()).hexdigest()
    got = hashlib.sha256("".join(ids).encode()).hexdigest()
    assert (total, distinct) == (len(produced), len(produced)), \
        f"lake holds {total} rows, {distinct} distinct event_ids; produced {len(produced)}"
    assert got == want, "event_id checksum of the lake differs from the produced events"


# The default client over 100,000 events and 20 kills; the librdkafka client (--kafka-client confluent, the rdkafka
# extra) over 30,000 and 8: (client, events, kills, kills that must come mid-stream, seed)
KILL_RUNS = [pytest.param("kafka-python", 100_000, 20, 10, 4, id="100k-20-kills-kafka-python"),
             pytest.param("confluent", 30_000, 8, 4, 5, id="30k-8-kills-confluent")]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("client", "n", "kills", "min_mid_stream", "seed"), KILL_RUNS)
def test_events_survive_sigkills(kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path, client: str,
                                 n: int, kills: int, min_mid_stream: int, seed: int) -> None:
    if client == "confluent":
        pytest.importorskip("confluent_kafka", reason="the rdkafka extra (make setup installs it with [all])")
    partitions = 4
    topic, dlq = new_topic("lw-kill", partitions=partitions), new_topic("lw-kill-dlq")
    root, var = tmp_path / "lake", tmp_path / "var"
    var.mkdir()
    group = f"test-lw-kill-{uuid.uuid4().hex[:8]}"
    extra = ["--kafka-client", client]
    produced: list[str] = []
    # produce while the writer is being killed, as in production, spread over the kill loop
    producer = threading.Thread(target=lambda: produced.extend(produce(kafka_bootstrap, topic, n, partitions, 1500, BAD_EVERY)))
    producer.start()
    rng = random.Random(seed)
    proc = start_writer(kafka_bootstrap, topic, dlq, group, "w1", root, var, extra=extra)
    progress = []
    try:
        for _ in range(kills):
            # kill at a random instant once this incarnation is publishing: mid-file, mid-publish, mid-DLQ
            before = landed(root, topic)
            wait_for(lambda: landed(root, topic) > before or (not producer.is_alive() and before >= n), 30,
                     "the restarted writer to publish")
            time.sleep(rng.uniform(0.0, 1.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            progress.append(landed(root, topic))
            proc = start_writer(kafka_bootstrap, topic, dlq, group, "w1", root, var, extra=extra)
        producer.join()
        wait_for(lambda: landed(root, topic) >= n, 180, f"{n} events in the lake (progress per kill {progress})")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    # the kills must land while work is in flight, or the test proves nothing about crashes
    mid_stream = sum(1 for a, b in zip(progress, progress[1:]) if b > a and b < n)
    print(f"lake offsets after each kill: {progress}")
    assert mid_stream >= min_mid_stream, f"only {mid_stream} kills came between progress and completion: {progress}"
    check_exact(root, topic, produced, partitions)
    # every dead letter reached the DLQ before its range was published (repeats allowed: at-least-once)
    bad = {(i % partitions, i // partitions) for i in range(BAD_EVERY - 1, n, BAD_EVERY)}
    letters = read_letters(kafka_bootstrap, dlq, len(bad))
    assert bad <= letters, f"{len(bad - letters)} of {len(bad)} dead letters missing from the DLQ"


def read_letters(bootstrap: str, topic: str, at_least: int, timeout_s: float = 30.0) -> set[tuple[int, int]]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None,
                             enable_auto_commit=False)
    out: set[tuple[int, int]] = set()
    deadline = time.monotonic() + timeout_s
    while len(out) < at_least and time.monotonic() < deadline:
        for messages in consumer.poll(timeout_ms=500).values():
            out |= {(e["partition"], e["offset"]) for e in (json.loads(m.value) for m in messages)}
    consumer.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("b_client", ["kafka-python", "confluent"])
def test_two_writers_one_killed_the_other_takes_over(kafka_bootstrap: str, new_topic: Callable[..., str],
                                                     tmp_path: Path, b_client: str) -> None:
    """Writer a (kafka-python) is killed mid-stream and b takes its partitions over from the lake. With b on
    librdkafka the group mixes both clients: had they spelled the topic's id differently, b would pause every
    partition as a recreated topic and the second half would never land."""
    if b_client == "confluent":
        pytest.importorskip("confluent_kafka", reason="the rdkafka extra (make setup installs it with [all])")
    from flywheel.base.heartbeat import read_statuses

    n, partitions = 20_000, 4
    topic, dlq = new_topic("lw-pair", partitions=partitions), new_topic("lw-pair-dlq")
    root, var = tmp_path / "lake", tmp_path / "var"
    var.mkdir()
    group = f"test-lw-pair-{uuid.uuid4().hex[:8]}"
    a = start_writer(kafka_bootstrap, topic, dlq, group, "a", root, var)
    b = start_writer(kafka_bootstrap, topic, dlq, group, "b", root, var, extra=["--kafka-client", b_client])

    def both_own_partitions() -> bool:
        st = read_statuses(var)
        return all(st.get(f"lake-writer-{w}", {}).get("partitions", 0) > 0 for w in ("a", "b"))

    try:
        wait_for(both_own_partitions, 150, "both writers to own partitions")  # start-up rebalance; took >60 s once under a loaded CI run
        produced = produce(kafka_bootstrap, topic, n // 2, partitions)
        wait_for(lambda: landed(root, topic) > 0, 30, "the first files")
        a.send_signal(signal.SIGKILL)  # mid-stream: a holds open files of its partitions
        a.wait()
        produced += produce(kafka_bootstrap, topic, n - n // 2, partitions)
        wait_for(lambda: landed(root, topic) >= n, 90, f"{n} events after b took over a's partitions")
        wait_for(lambda: read_statuses(var)["lake-writer-b"].get("partitions") == partitions, 10,
                 "b's heartbeat to show all partitions")
        # lag in `flywheel status` is end offset minus the lake's next offset: caught up means 0
        wait_for(lambda: read_statuses(var)["lake-writer-b"].get("lag_records") == 0, 10, "b's heartbeat to show lag 0")
        assert read_statuses(var)["lake-writer-b"].get("rewound_partitions") == [], "b paused a partition it owns"
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
    assert b.returncode == 0, f"SIGTERM must finish the current work and exit 0, got {b.returncode}"
    check_exact(root, topic, produced, partitions)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_frozen_writer_that_wakes_after_losing_its_partitions_duplicates_nothing(
        kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path) -> None:
    """The zombie case: a writer stalls (SIGSTOP) past the session timeout with open files, the other
    writer takes its partitions over and publishes past them, then the stalled one wakes up and
    publishes what it held before it notices. Range claims must keep the lake exact."""
    from flywheel.base.heartbeat import read_statuses

    partitions = 4
    topic, dlq = new_topic("lw-zombie", partitions=partitions), new_topic("lw-zombie-dlq")
    root, var = tmp_path / "lake", tmp_path / "var"
    var.mkdir()
    group = f"test-lw-zombie-{uuid.uuid4().hex[:8]}"
    # the zombie rolls by age every 5 s only, so at the instant it freezes it holds open files (rolling every
    # 0.5 s it could freeze just after a roll, holding nothing, and the run would not test the race)
    zombie = start_writer(kafka_bootstrap, topic, dlq, group, "z", root, var, roll_max_age_s=5.0)
    other = start_writer(kafka_bootstrap, topic, dlq, group, "o", root, var)
    produced: list[str] = []
    try:
        wait_for(lambda: all(read_statuses(var).get(f"lake-writer-{w}", {}).get("partitions", 0) > 0 for w in "zo"),
                 60, "both writers to own partitions")
        # a steady stream, so the zombie holds open files at the instant it freezes
        feeder = threading.Thread(target=lambda: produced.extend(produce(kafka_bootstrap, topic, 12_000, partitions, 1000)))
        feeder.start()
        wait_for(lambda: landed(root, topic) > 1000, 30, "the first files")
        zombie.send_signal(signal.SIGSTOP)
        frozen = lake.next_offsets(str(root), "events", topic)
        wait_for(lambda: read_statuses(var)["lake-writer-o"].get("partitions") == partitions, 60,
                 "the other writer to take every partition over")
        # every partition, the zombie's included, must move past where the freeze left it: the new owner then
        # holds a claim where each of the zombie's open files starts (the sum of offsets could move on the
        # other writer's own partitions alone, and the zombie would claim first)

        def past_the_freeze() -> bool:
            now = lake.next_offsets(str(root), "events", topic)
            return len(now) == partitions and all(n > frozen.get(p, 0) for p, n in now.items())

        wait_for(past_the_freeze, 30, "the new owner to publish past the zombie's open files on every partition")
        zombie.send_signal(signal.SIGCONT)  # wakes with stale open files, publishes, then learns it was fenced
        feeder.join()
        wait_for(lambda: landed(root, topic) >= 12_000, 90, "all events after the zombie woke up")
        time.sleep(3)  # let the zombie's stale publishes (if any) land before the check
    finally:
        for p in (zombie, other):
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
    check_exact(root, topic, produced, partitions)
    stats = read_statuses(var)["lake-writer-z"]
    print(f"zombie after waking: {stats}")
    # the woken writer held open files of partitions it had lost: it must have met the new owner's claims
    assert stats["conformed"] >= 1, f"the zombie never met a claim, so this run did not test the race: {stats}"


class _Forwarder:
    """A TCP port that forwards to the broker, opened on demand: the broker 'comes back' at the writer's address.
    After bootstrap the writer follows the broker's advertised listener, so only the first connections pass here."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server: socket.socket | None = None

    def open(self) -> None:
        self.server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        assert self.server is not None
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.mark.timeout(240)
def test_a_writer_started_while_the_broker_is_away_waits_for_it_and_then_lands_everything(
        kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path) -> None:
    topic, dlq = new_topic("lw-away"), new_topic("lw-away-dlq")
    root, var = tmp_path / "lake", tmp_path / "var"
    var.mkdir()
    produced = produce(kafka_bootstrap, topic, 500, 1)
    away = _Forwarder(kafka_bootstrap)
    proc = start_writer(f"127.0.0.1:{away.port}", topic, dlq, f"test-lw-away-{uuid.uuid4().hex[:8]}", "away", root, var)
    log_path = var / "away.log"
    try:
        # nothing listens at its bootstrap address: the writer must log its retries and stay up, not exit
        wait_for(lambda: "Kafka unreachable" in log_path.read_text(errors="replace") or proc.poll() is not None, 60,
                 "the writer's first retry")
        time.sleep(3)
        assert proc.poll() is None, f"the writer exited (rc {proc.returncode}) while the broker was away:\n" \
                                    f"{log_path.read_text(errors='replace')[-3000:]}"
        away.open()  # the broker is back
        wait_for(lambda: landed(root, topic) >= len(produced) or proc.poll() is not None, 120, "the lake to fill")
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        check_exact(root, topic, produced, 1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        away.close()
    assert rc == 0, log_path.read_text(errors="replace")[-3000:]
