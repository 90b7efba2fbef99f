"""A 3-node KRaft cluster loses a broker while the SDK logs and the lake writer lands.

The cluster is private (free ports, its own var dir under tmp_path) and is started and stopped by the
code of `flywheel infra up --kafka-brokers 3` (flywheel.stack), so killing a node disturbs nobody else.
Run it alone: `flock /tmp/heavy.lock .venv/bin/python -m pytest -q tests/integration/test_kafka_cluster.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from flywheel import stack as stack_mod
from flywheel.base.heartbeat import read_statuses
from flywheel.ingest import lake
from flywheel.ingest.sdk import SessionLogger
from tests.integration.test_sdk_kafka import _assert_never_blocked

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 4


def _free_port_block(n: int) -> int:
    """The first of n consecutive free ports: node i listens on base + 2i and base + 2i + 1."""
    rng = random.Random()
    # below the kernel's ephemeral range: a port there can be taken by any outgoing connection between this check
    # and the broker's bind (one run lost node 3 to "Address already in use" on 37766)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        base = rng.randrange(10_000, max(low, 10_200) - n, 2)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[stack_mod.StackConfig]:
    suffix = uuid.uuid4().hex[:8]
    base = _free_port_block(6)
    cfg = stack_mod.replace_config(stack_mod.load_stack_config([]), var_dir=tmp_path / "var", kafka_brokers=3,
                                   kafka_port=base, kafka_controller_port=base + 1, kafka_partitions=PARTITIONS,
                                   kafka_topics=[f"test.cluster.{suffix}", f"test.cluster-dlq.{suffix}"],
                                   kafka_heap="256m", parts=["kafka"])
    try:
        t0 = time.monotonic()
        stack_mod.start_kafka(cfg)
        print(f"cluster of 3 up in {time.monotonic() - t0:.1f}s at {cfg.kafka_bootstrap}")
        yield cfg
    finally:
        t0 = time.monotonic()
        stack_mod.stop_kafka(cfg)  # every node still running, also when the test failed
        print(f"cluster stopped in {time.monotonic() - t0:.1f}s")


def _wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.3)


def _start_writer(cfg: stack_mod.StackConfig, root: Path, var: Path) -> subprocess.Popen:
    events, dlq = cfg.kafka_topics
    args = [sys.executable, "-m", "flywheel.cli", "lake-writer", "--kafka-bootstrap", cfg.kafka_bootstrap,
            "--events-topic", events, "--outcomes-topic", "", "--dlq-topic", dlq, "--group-id", f"test-{events}",
            "--instance-id", "w1", "--lake-root", str(root), "--var-dir", str(var), "--roll-max-age-s", "0.5",
            "--roll-max-records", "2000", "--session-timeout-s", "6", "--log-level", "WARNING"]
    with open(var / "w1.log", "ab") as log_file:
        return subprocess.Popen(args, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)


def _layout(cfg: stack_mod.StackConfig, topic: str) -> tuple[int, dict[int, int], dict[int, int]]:
    """(the quorum's leader, partition -> leader, partition -> replica count) of the topic."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=cfg.kafka_bootstrap, client_id="tests")
    try:
        quorum_leader = int(admin.describe_metadata_quorum()["topics"][0]["partitions"][0]["leader_id"])
        (described,) = admin.describe_topics([topic])
    finally:
        admin.close()
    parts = described["partitions"]
    return (quorum_leader, {p["partition_index"]: p["leader_id"] for p in parts},
            {p["partition_index"]: len(p["replica_nodes"]) for p in parts})


def _layout_once_listed(cfg: stack_mod.StackConfig, topic: str, timeout_s: float = 30.0
                        ) -> tuple[int, dict[int, int], dict[int, int]]:
    """_layout, once the broker it asks lists every partition (or after timeout_s): a broker's metadata can trail
    the topic's creation, and one describe right after the cluster start found no partitions (CI)."""
    deadline = time.monotonic() + timeout_s
    while True:
        layout = _layout(cfg, topic)
        if len(layout[2]) == PARTITIONS or time.monotonic() >= deadline:
            return layout
        time.sleep(0.3)


def _end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, client_id="tests")
    try:
        ends = consumer.end_offsets([TopicPartition(topic, p) for p in range(PARTITIONS)])
    finally:
        consumer.close()
    return {tp.partition: offset for tp, offset in ends.items()}


def _kill_node(cfg: stack_mod.StackConfig, node_id: int) -> None:
    record = stack_mod._read_pid(cfg, stack_mod.kafka_node_name(cfg, node_id))
    assert record is not None, f"kafka node {node_id} is not running before the kill"
    os.killpg(int(record["pid"]), signal.SIGKILL)  # a crash, not a controlled shutdown


def _log_through_kill(log: SessionLogger, cfg: stack_mod.StackConfig, victim: int, rate: float, seconds: float,
                      kill_at_s: float) -> tuple[list[tuple[float, float]], float, int]:
    """An agent calling llm_call at a steady rate for `seconds`; node `victim` is SIGKILLed at kill_at_s, between
    two calls (not inside a timed one). Returns (start, duration) per timed call, the kill's instant and the
    count of all calls (request ids 0..count-1), the untimed warm-up's included."""
    sessions = [log.attach(f"sess-{k}") for k in range(50)]
    prompt, completion, logprobs = list(range(64)), list(range(100, 116)), [-0.5] * 16

    def call(i: int) -> None:
        sessions[i % 50].llm_call(model="policy-v1", policy_version=1, prompt_token_ids=prompt,
                                  completion_token_ids=completion, completion_logprobs=logprobs, request_id=str(i))

    # Untimed: the SDK's start-up (kafka-python's import and first metadata on its thread, holding the GIL
    # for tens of ms) is not what a broker's death costs the host.
    warm_up = 100
    for i in range(warm_up):
        call(i)
    assert log.flush(30), f"the warm-up was not delivered: {log.metrics()}"
    stamps: list[tuple[float, float]] = []
    killed_at = 0.0
    start, total = time.monotonic(), warm_up + int(rate * seconds)
    for i in range(warm_up, total):
        time.sleep(max(0.0, start + (i - warm_up) / rate - time.monotonic()))
        if not killed_at and time.monotonic() - start >= kill_at_s:
            _kill_node(cfg, victim)
            killed_at = time.monotonic()
        t0 = time.monotonic()
        call(i)
        stamps.append((t0, time.monotonic() - t0))
    return stamps, killed_at, total


def _topic_event_ids(bootstrap: str, topic: str, want: int) -> tuple[set[str], int]:
    """The distinct event ids in the topic and how many records hold them (the SDK is at-least-once)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, client_id="tests", consumer_timeout_ms=2000,
                             max_partition_fetch_bytes=8 * 1024 * 1024)
    partitions = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    consumer.assign(partitions)
    consumer.seek_to_beginning(*partitions)
    ids: set[str] = set()
    records, deadline = 0, time.monotonic() + 60
    while len(ids) < want and time.monotonic() < deadline:
        for message in consumer:
            ids.add(json.loads(message.value)["event_id"])
            records += 1
    consumer.close()
    return ids, records


def _check_lake(root: Path, topic: str, ends: dict[int, int], total: int, topic_ids: set[str]) -> None:
    """Every offset of the topic in one file, every call's event once, the same ids as the topic."""
    import duckdb

    files = lake.list_files(str(root), "events")
    for p in range(PARTITIONS):
        ranges = sorted((f.first, f.last) for f in files if f.partition == p)
        gaps = [(a, b) for a, b in zip(ranges, ranges[1:]) if b[0] != a[1] + 1]
        assert ranges and ranges[0][0] == 0 and ranges[-1][1] == ends[p] - 1 and not gaps, \
            f"partition {p}: files {ranges[:3]}..{ranges[-3:]} do not cover offsets 0..{ends[p] - 1} once (gaps {gaps[:5]})"
    con = duckdb.connect()
    rows = con.execute(f"SELECT event_id, request_id FROM read_parquet('{root}/events/**/*.parquet')").fetchall()
    ids = sorted(r[0] for r in rows)
    request_ids = sorted((r[1] for r in rows), key=int)
    assert (len(rows), len(set(ids))) == (total, total), \
        f"lake holds {len(rows)} rows, {len(set(ids))} distinct event_ids; the agent logged {total} calls"
    assert request_ids == [str(i) for i in range(total)], "some call landed under two event ids or not at all"
    want = hashlib.sha256("".join(sorted(topic_ids)).encode()).hexdigest()
    assert hashlib.sha256("".join(ids).encode()).hexdigest() == want, "the lake's event_id checksum differs from the topic's"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_broker_of_three_killed_every_event_lands_once_and_calls_never_block(
        cluster: stack_mod.StackConfig, tmp_path: Path) -> None:
    cfg = cluster
    topic = cfg.kafka_topics[0]
    quorum_leader, leaders, replicas = _layout_once_listed(cfg, topic)
    assert set(replicas.values()) == {3}, f"every partition on 3 replicas, got {replicas}"
    # The active controller: its death forces a controller election as well as moving its partitions' leaders.
    victim = quorum_leader
    assert victim in leaders.values(), f"node {victim} leads none of {leaders}: its kill would move no partition"
    root, var = tmp_path / "lake", tmp_path / "writer"
    var.mkdir()
    writer = _start_writer(cfg, root, var)
    try:
        _wait_for(lambda: read_statuses(var).get("lake-writer-w1", {}).get("partitions", 0) == PARTITIONS, 90,
                  "the lake writer to own every partition")
        log = SessionLogger(cfg.kafka_bootstrap, topic=topic, name="cluster", spool_dir=tmp_path / "spool")
        stamps, killed_at, total = _log_through_kill(log, cfg, victim, rate=200.0, seconds=20.0, kill_at_s=6.0)
        delivered = log.flush(timeout=120)
        metrics = log.metrics()
        log.close()
        assert delivered, f"flush did not finish with 2 of 3 brokers: {metrics}"
        ends = _end_offsets(cfg.kafka_bootstrap, topic)
        _wait_for(lambda: lake.next_offsets(str(root), "events", topic) == ends, 120,
                  f"the lake to reach the topic's end offsets {ends}")
        assert writer.poll() is None, f"the lake writer exited ({writer.returncode}); see {var / 'w1.log'}"
        # what `flywheel infra status` reports: the cluster serves, one node short
        live = stack_mod.kafka_live_brokers(cfg)
        assert live == 2 and not stack_mod.kafka_healthy(cfg), f"{live} brokers live after one of 3 was killed"
    finally:
        writer.send_signal(signal.SIGTERM)
        writer.wait(timeout=60)
    print(f"killed node {victim} (quorum leader; partition leaders {leaders}); sdk {metrics}")
    assert metrics["dropped"] == 0 and metrics["invalid"] == 0 and metrics["rejected"] == 0, metrics

    topic_ids, records = _topic_event_ids(cfg.kafka_bootstrap, topic, total)
    print(f"topic: {records} records for {len(topic_ids)} events ({records - len(topic_ids)} SDK replay duplicates)")
    _check_lake(root, topic, ends, total, topic_ids)

    # Last, since an oversubscribed machine turns the worst-case bound into an xfail (see _assert_never_blocked).
    # p99.9 gets 5 ms, not 2: this test runs three broker JVMs and a lake writer on the host's own cores, and
    # p99.9 measured 1.5-2.5 ms at load 3.8-5.9 on 2 cores with nothing blocking (a wait on the broker would
    # be the 9 s fencing stall this test provokes, thousands of times over the bound).
    after = [d for t, d in stamps if t >= killed_at]
    before = [d for t, d in stamps if t < killed_at]
    _assert_never_blocked([d for _, d in stamps], "with a broker killed mid-run",
                          f"before the kill: {len(before)} calls, worst {max(before, default=0) * 1e3:.2f} ms; "
                          f"after: {len(after)} calls, worst {max(after, default=0) * 1e3:.2f} ms", p999_limit_ms=5.0)
