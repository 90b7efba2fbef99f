"""SessionLogger and OutcomeReporter against real Kafka brokers.

The outage test runs its own private broker (own ports, own data dir under tmp_path) through
infra.stack's Kafka functions, so killing it disturbs nobody else.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from flywheel import stack as stack_mod
from flywheel.ingest import schema, wire
from flywheel.ingest.sdk import OutcomeReporter, SessionLogger

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _consume(bootstrap: str, topic: str, want: int, timeout_s: float = 60.0) -> list[bytes]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, consumer_timeout_ms=1000, client_id="tests",
                             max_partition_fetch_bytes=8 * 1024 * 1024)
    partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or {0})]
    consumer.assign(partitions)
    consumer.seek_to_beginning(*partitions)
    values: list[bytes] = []
    deadline = time.time() + timeout_s
    while time.time() < deadline and len(values) < want:
        values += [m.value for m in consumer]
    consumer.close()
    return values


def test_every_event_type_and_outcome_round_trips(kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path) -> None:
    events_topic, outcomes_topic = new_topic("events", partitions=2), new_topic("outcomes")
    log = SessionLogger(kafka_bootstrap, topic=events_topic, name="rt", spool_dir=tmp_path / "spool")
    reporter = OutcomeReporter(kafka_bootstrap, topic=outcomes_topic, name="rt-o", spool_dir=tmp_path / "spool-o")
    with log.session(task_type="code_edit", tags={"team": "ml"}) as s:
        s.llm_call(model="policy-v2", policy_version=2, prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5, 6],
                   completion_logprobs=[-0.5, -0.25, -1.5], finish_reason="stop", latency_s=0.2,
                   sampling={"temperature": 1.0}, completion_text="ok")
        call = s.tool_call("read_file", {"path": "a.py"})
        s.tool_result(call, ok=False, output="FileNotFoundError")
        with s.spawn_subagent(subtask="search docs") as child:
            child.tool_call("search", {"q": "kafka"}, malformed=True)
        s.context_edit("prune", tokens_removed=300)
        s.traced_llm_call("gpt-x", provider="openai", input_tokens=40, output_tokens=7, completion_text="fine")
    outcome_id = reporter.report(s.session_id, kind="tests_passed", value=1.0, source="ci")
    assert log.flush(30) and reporter.flush(30), f"not delivered: {log.metrics()} {reporter.metrics()}"

    events = [wire.decode(v) for v in _consume(kafka_bootstrap, events_topic, 10)]
    for event in events:
        schema.validate_event(event)  # as the lake writer sees a v3 record: token lists as packed views
    llm_call = next(e for e in events if e["type"] == "llm_call")
    assert llm_call["schema_version"] == 3 and llm_call["prompt_token_ids"].tolist() == [1, 2, 3]
    assert llm_call["completion_logprobs"].tolist() == [-0.5, -0.25, -1.5], "exact in float32"
    assert {e["type"] for e in events} == set(schema.EVENT_TYPES), sorted(e["type"] for e in events)
    assert len(events) == 10 and len({e["event_id"] for e in events}) == 10
    traced = next(e for e in events if e["type"] == "traced_llm_call")
    assert traced["schema_version"] == 5 and (traced["input_tokens"], traced["output_tokens"]) == (40, 7)
    # One key per session: the whole session is in one partition, in the order it was logged.
    assert [e["type"] for e in events][0] == "session_start" and events[-1]["type"] == "session_end"
    outcomes = [json.loads(v) for v in _consume(kafka_bootstrap, outcomes_topic, 1)]
    assert len(outcomes) == 1 and schema.validate_outcome(outcomes[0])["outcome_id"] == outcome_id
    assert outcomes[0]["session_id"] == s.session_id
    log.close()
    reporter.close()
    m = log.metrics()
    assert m["sent"] == 10 and m["spilled"] == 0 and m["dropped"] == 0, m


def test_bad_input_never_reaches_the_agent_and_the_rest_arrives(kafka_bootstrap: str, new_topic: Callable[..., str],
                                                                tmp_path: Path) -> None:
    topic = new_topic("bad")
    log = SessionLogger(kafka_bootstrap, topic=topic, name="bad", spool_dir=tmp_path / "spool")
    s = log.attach(f"sess-{uuid.uuid4().hex}")
    s.tool_call("f", {"handle": threading.Lock()})  # not JSON serialisable: stored as repr text
    s.tool_result("c", ok=True, output="y" * (schema.MAX_TEXT_CHARS * 2))  # capped and flagged
    s.llm_call(model="m", policy_version="v1", prompt_token_ids=[1], completion_token_ids=[2],  # type: ignore[arg-type]
               completion_logprobs=[-1.0])  # wrong type: dropped
    s.llm_call(model="m", policy_version=1, prompt_token_ids=["a"], completion_token_ids=[2],  # type: ignore[list-item]
               completion_logprobs=[-1.0])  # wrong element type: dropped
    s.context_edit("prune", tokens_removed=5, reason="too long")  # unknown field: left out
    s.llm_call(model="m", policy_version=1, prompt_token_ids=[1], completion_token_ids=[2], completion_logprobs=[-1.0])
    assert log.flush(30), log.metrics()
    events = [wire.decode(v) for v in _consume(kafka_bootstrap, topic, 4)]  # packed views, as the lake writer decodes them
    for event in events:
        schema.validate_event(event)
    assert [e["type"] for e in events] == ["tool_call", "tool_result", "context_edit", "llm_call"]
    assert events[0]["arguments"]["handle"].startswith("<unlocked _thread.lock")
    assert events[1]["truncated"] == ["output"] and len(events[1]["output"]) == schema.MAX_TEXT_CHARS
    assert "reason" not in events[2]
    m = log.metrics()
    log.close()
    assert m["invalid"] == 2 and m["coerced"] == 1 and m["truncated"] == 1 and m["sent"] == 4, m


@pytest.fixture
def private_kafka(tmp_path: Path) -> stack_mod.StackConfig:
    topic = f"test.outage.{uuid.uuid4().hex[:8]}"
    base = stack_mod.load_stack_config([])
    cfg = stack_mod.replace_config(base, var_dir=tmp_path / "var", kafka_port=_free_port(),
                                   kafka_controller_port=_free_port(), kafka_topics=[topic], kafka_partitions=2,
                                   kafka_heap="256m", parts=["kafka"])
    stack_mod.start_kafka(cfg)
    yield cfg
    stack_mod.stop_kafka(cfg)


# Runs in its own process: a thread of this process doing the kill and the restart's health polling
# would compete with the agent's thread for the GIL and add its own stalls to what is measured.
CHAOS = """
import json, os, signal, socket, sys, time
from pathlib import Path
from flywheel import stack
cfg = stack.load_stack_config(json.loads(sys.argv[1]))
record = json.loads((Path(cfg.var_dir) / "run" / "kafka.pid.json").read_text())
print("down", time.monotonic(), flush=True)
os.killpg(int(record["pid"]), signal.SIGKILL)  # a crash, not a clean shutdown
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 5.0)
print("restarting", time.monotonic(), flush=True)
stack.start_kafka(cfg)  # same data dir: the broker comes back with everything it had acknowledged
print("up", time.monotonic(), flush=True)
"""


def _chaos_args(cfg: stack_mod.StackConfig) -> list[str]:
    return ["--var-dir", str(cfg.var_dir), "--kafka-port", str(cfg.kafka_port), "--kafka-controller-port",
            str(cfg.kafka_controller_port), "--kafka-topics", ",".join(cfg.kafka_topics), "--kafka-partitions",
            str(cfg.kafka_partitions), "--kafka-heap", cfg.kafka_heap, "--parts", "kafka"]


@pytest.mark.slow
def test_broker_killed_mid_run_every_event_arrives_once_and_calls_never_block(private_kafka: stack_mod.StackConfig,
                                                                              tmp_path: Path) -> None:
    cfg = private_kafka
    topic = cfg.kafka_topics[0]
    total, kill_at = 50_000, 10_000
    log = SessionLogger(cfg.kafka_bootstrap, topic=topic, name="outage", spool_dir=tmp_path / "spool",
                        outage_after_s=1.0, retry_s=0.5)
    sessions = [log.attach(f"sess-{k}") for k in range(50)]
    prompt = list(range(64))
    completion, logprobs = list(range(100, 116)), [-0.5] * 16
    stamps: list[tuple[float, float]] = []  # (start, duration) of each call
    for i in range(total):
        s = sessions[i % 50]
        t0 = time.monotonic()  # the chaos process stamps the outage with the same clock
        s.llm_call(model="policy-v1", policy_version=1, prompt_token_ids=prompt, completion_token_ids=completion,
                   completion_logprobs=logprobs, request_id=str(i))
        stamps.append((t0, time.monotonic() - t0))
        if i == kill_at:
            chaos = subprocess.Popen([sys.executable, "-c", CHAOS, json.dumps(_chaos_args(cfg))], cwd=REPO,
                                     stdout=subprocess.PIPE, text=True)
        if i % 100 == 99:
            time.sleep(0.02)  # an agent between calls: ~5,000 calls/s, so the run spans the outage
    out, _ = chaos.communicate(timeout=180)
    window = {line.split()[0]: float(line.split()[1]) for line in out.splitlines() if line.strip()}
    assert chaos.returncode == 0 and "up" in window, f"the private broker did not come back: {out}"
    delivered = log.flush(timeout=180)
    metrics = log.metrics()
    log.close()

    # The bound is asserted while the broker is down and not yet restarting: the restart runs a JVM on the
    # same two cores as this test, which says nothing about the SDK (in production the broker is elsewhere).
    during = [d for t, d in stamps if window["down"] <= t <= window["restarting"]]
    restart = [d for t, d in stamps if window["restarting"] <= t <= window["up"]]
    assert len(during) > 5_000, f"only {len(during)} calls fell inside the outage; the test did not test it"
    assert delivered, f"flush did not finish after the broker returned: {metrics}"
    assert metrics["spilled"] > 0 and metrics["replayed"] > 0 and metrics["dropped"] == 0, metrics

    raw = _consume(cfg.kafka_bootstrap, topic, total, timeout_s=120)
    by_event: dict[str, str] = {}
    for value in raw:
        event = json.loads(value)
        by_event[event["event_id"]] = event["request_id"]
    request_ids = sorted(by_event.values(), key=int)
    assert len(by_event) == total, (f"{len(by_event)} distinct events arrived for {total} logged "
                                    f"({len(raw)} records before de-duplication); metrics {metrics}")
    assert request_ids == [str(i) for i in range(total)], "some call arrived under two event ids or not at all"
    print(f"outage: {len(raw)} records for {total} events ({len(raw) - total} replay duplicates); {metrics}")

    # The agent's calls never blocked (the bounds: `_assert_never_blocked`). While the broker restarted is
    # reported, not asserted: a JVM starting on the test's two cores.
    _assert_never_blocked(during, "during the outage",
                          f"while the broker restarted: {len(restart)} calls, worst {max(restart, default=0) * 1e3:.2f} ms")


def test_a_short_lived_process_delivers_at_exit_without_close(kafka_bootstrap: str, new_topic: Callable[..., str],
                                                              tmp_path: Path) -> None:
    topic = new_topic("exit")
    script = (
        "import sys\n"
        "from flywheel import SessionLogger\n"
        f"log = SessionLogger({kafka_bootstrap!r}, topic={topic!r}, name='exit', spool_dir={str(tmp_path / 'spool')!r})\n"
        "s = log.attach('sess-exit')\n"
        "for i in range(200):\n"
        "    s.tool_call('t', {'i': i})\n"
        "sys.exit(0)  # no flush, no close: the atexit hook delivers\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    events = [json.loads(v) for v in _consume(kafka_bootstrap, topic, 200, timeout_s=20)]
    assert sorted(e["arguments"]["i"] for e in events) == list(range(200)), f"{len(events)} of 200 arrived"


def test_missing_topic_spills_then_delivers_once_it_exists(kafka_bootstrap: str, tmp_path: Path) -> None:
    """A broker that is up but cannot take the records (no topic yet) is an outage too, not a stall."""
    from kafka.admin import KafkaAdminClient, NewTopic

    topic = f"test.late.{uuid.uuid4().hex[:10]}"
    log = SessionLogger(kafka_bootstrap, topic=topic, name="late", spool_dir=tmp_path / "spool", retry_s=0.5)
    s = log.attach("sess-late")
    started = time.monotonic()
    for i in range(300):
        s.tool_call("t", {"i": i})
    assert time.monotonic() - started < 0.5, "logging must not wait for Kafka"
    assert not log.flush(5), "nothing can be delivered before the topic exists"
    assert log.metrics()["spilled"] == 300, log.metrics()
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="tests")
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    try:
        assert log.flush(60), f"not replayed after the topic appeared: {log.metrics()}"
        events = [json.loads(v) for v in _consume(kafka_bootstrap, topic, 300)]
        seen: set[str] = set()
        first = [e["arguments"]["i"] for e in events if not (e["event_id"] in seen or seen.add(e["event_id"]))]
        assert first == list(range(300)), "every record once after de-duplication, in the order it was logged"
    finally:
        log.close()
        admin.delete_topics([topic])
        admin.close()


def test_a_record_kafka_refuses_is_dropped_and_counted_not_retried_forever(kafka_bootstrap: str,
                                                                          new_topic: Callable[..., str],
                                                                          tmp_path: Path) -> None:
    topic = new_topic("poison")
    log = SessionLogger(kafka_bootstrap, topic=topic, name="poison", spool_dir=tmp_path / "spool",
                        producer_config={"max_request_size": 4096})  # stands in for a broker's message.max.bytes
    s = log.attach("sess-poison")
    s.tool_call("before", {})
    s.tool_result("c", ok=True, output="z" * 10_000)  # within the SDK's caps, over this Kafka's limit
    s.tool_call("after", {})
    assert log.flush(30), log.metrics()
    m = log.metrics()
    log.close()
    events = [json.loads(v) for v in _consume(kafka_bootstrap, topic, 2)]
    assert [e.get("name") for e in events] == ["before", "after"]
    assert m["rejected"] == 1 and m["spilled"] == 0 and not m["broker_down"], m


def test_a_record_over_the_topics_max_message_bytes_is_named_on_the_dlq_not_silently_dropped(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    """A default cluster's topic takes 1 MiB; the schema allows 4 MiB. The SDK reads the topic's
    max.message.bytes once connected and caps below it: a record over the cap is not sent whole (the broker
    would refuse it) but counted and named in a notice on the DLQ topic, and the records around it arrive."""
    from kafka.admin import KafkaAdminClient, NewTopic

    topic = f"test.capped.{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="tests")
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1,
                                  topic_configs={"max.message.bytes": "16384"})])
    if schema.DLQ_TOPIC not in admin.list_topics():
        admin.create_topics([NewTopic(schema.DLQ_TOPIC, num_partitions=1, replication_factor=1)])
    admin.close()
    session_id = f"sess-capped-{uuid.uuid4().hex[:8]}"
    log = SessionLogger(kafka_bootstrap, topic=topic, name="capped", spool_dir=tmp_path / "spool")
    s = log.attach(session_id)
    s.tool_call("before", {})
    deadline = time.time() + 30
    while log.metrics()["record_cap"] >= 16384 and time.time() < deadline:
        time.sleep(0.2)
    assert log.metrics()["record_cap"] < 16384, f"the SDK never learned the topic's limit: {log.metrics()}"
    big = list(range(5000))  # ~25 KB of token ids: within the schema's caps, over this topic's 16 KiB
    s.llm_call(model="policy-v0", policy_version=0, prompt_token_ids=big, completion_token_ids=[1, 2],
               completion_logprobs=[-0.1, -0.2], request_id="too-big")
    s.tool_call("after", {})
    assert log.flush(30), log.metrics()
    deadline = time.time() + 15
    while log.metrics()["oversized_noticed"] < 1 and time.time() < deadline:
        time.sleep(0.2)  # the notice's acknowledgement lands on the SDK's thread
    m = log.metrics()
    log.close()
    events = [json.loads(v) for v in _consume(kafka_bootstrap, topic, 2)]
    assert [e.get("name") for e in events] == ["before", "after"], events
    assert m["oversized"] == 1 and m["oversized_noticed"] == 1 and m["dropped"] == 0, m
    notices = [json.loads(v) for v in _consume(kafka_bootstrap, schema.DLQ_TOPIC, 10**6, timeout_s=10)]
    ours = [n for n in notices if isinstance(n, dict) and n.get("session_id") == session_id]
    assert len(ours) == 1 and ours[0]["reason"] == "oversized" and ours[0]["type"] == "llm_call", ours
    assert ours[0]["bytes"] > m["record_cap"] and ours[0]["topic"] == topic, ours


def _paced_through_outage(log: SessionLogger, cfg: stack_mod.StackConfig, outage_s: float, rate: float,
                          after_up_s: float) -> tuple[list[tuple[float, float]], list[tuple[float, int, int, bool]],
                                                      dict[str, float], int]:
    """An agent calling llm_call at a steady `rate` from 5 s before the broker is killed until `after_up_s` after
    it is healthy again. Returns (start, duration) per call, (time, sent, spool_records, broker_down) samples, the
    chaos process's window (down / restarting / up, on this process's monotonic clock) and the call count."""
    sessions = [log.attach(f"sess-{k}") for k in range(50)]
    prompt, completion, logprobs = list(range(64)), list(range(100, 116)), [-0.5] * 16
    stamps: list[tuple[float, float]] = []
    samples: list[tuple[float, int, int, bool]] = []
    window: dict[str, float] = {}
    chaos: subprocess.Popen | None = None
    start, i = time.monotonic(), 0
    try:
        while not window or time.monotonic() < window["up"] + after_up_s:
            now = time.monotonic()
            assert now - start < 5.0 + outage_s + 240, f"the private broker did not come back: {window}"
            if chaos is None and now - start >= 5.0:
                chaos = subprocess.Popen([sys.executable, "-c", CHAOS, json.dumps(_chaos_args(cfg)), str(outage_s)],
                                         cwd=REPO, stdout=subprocess.PIPE, text=True)
            if chaos is not None and not window and chaos.poll() is not None:
                out = chaos.stdout.read() if chaos.stdout else ""
                window = {line.split()[0]: float(line.split()[1]) for line in out.splitlines() if line.strip()}
                assert chaos.returncode == 0 and "up" in window, f"the private broker did not come back: {out}"
            due = start + i / rate
            if now < due:
                time.sleep(due - now)
                continue
            t0 = time.monotonic()
            sessions[i % 50].llm_call(model="policy-v1", policy_version=1, prompt_token_ids=prompt,
                                      completion_token_ids=completion, completion_logprobs=logprobs, request_id=str(i))
            stamps.append((t0, time.monotonic() - t0))
            if i % 50 == 0:
                m = log.metrics()
                samples.append((time.monotonic(), m["sent"], m["spool_records"], m["broker_down"]))
            i += 1
    finally:
        if chaos is not None and chaos.poll() is None:
            chaos.kill()
    return stamps, samples, window, i


# What "never blocks its host" means in numbers. A call that waits on the broker (a send, a flush, a lock
# held across one) takes a network timeout or a reconnect backoff: 50 ms and up. A call that never waits can
# still wait for the GIL while the SDK's own thread runs Python (spilling, replaying the spool): CPython hands
# the GIL over every switch interval, 5 ms, so the worst call gets a bound of four switch intervals (20 ms) and 999 of 1,000
# calls one of 2 ms. Tighter bounds (5 ms worst, 1 ms p99.9) failed on loaded CI machines
# with nothing blocking (7.3 ms worst; p99.9 1.09 ms during a replay).
WORST_CALL_MS = 4 * sys.getswitchinterval() * 1e3
P999_CALL_MS = 2.0


def _assert_never_blocked(calls: list[float], what: str, also: str = "", p999_limit_ms: float = P999_CALL_MS) -> None:
    calls = sorted(calls)
    worst_ms, p999_ms = calls[-1] * 1e3, calls[int(0.999 * len(calls))] * 1e3
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    message = (f"worst llm_call {what} {worst_ms:.2f} ms (limit {WORST_CALL_MS:.0f} ms), p99.9 {p999_ms:.3f} ms "
               f"(limit {p999_limit_ms:.0f} ms), {len(calls)} calls, load average {load:.1f} on {cores} cores"
               + (f"; {also}" if also else ""))
    print(message)
    if load > cores:
        # Oversubscribed: the p99.9 of a few thousand calls is their few worst, which time-slicing reaches too (CI,
        # 2026-12-03: 6.9 ms at load 3.7, the 4th worst of 4,000 calls, with the three-broker test's JVMs on 2 cores).
        # A wait on the broker would stall every call for as long as the broker does (the 9 s fencing stall, the
        # 60 s outage): hundreds of calls, so the p99 still catches it at the same bound, and the p99.9 at the worst
        # call's.
        p99_ms = calls[int(0.99 * len(calls))] * 1e3
        assert p99_ms < p999_limit_ms and p999_ms < WORST_CALL_MS, f"p99 {p99_ms:.3f} ms; " + message
    else:
        assert p999_ms < p999_limit_ms, message  # no systematic waiting
    over = sum(1 for c in calls if c * 1e3 >= WORST_CALL_MS)
    if worst_ms >= WORST_CALL_MS and over * 10_000 <= len(calls):
        # One call in ten thousand or fewer over the bound, with the p99.9 within its own: a lone stall (a GC
        # pause, a missed time slice; CI 2026-12-03: 20.5 ms once in 30,001 calls at load 0.7, p99.9 0.14 ms).
        # A wait on the broker stalls every call while the broker is away, thousands of them.
        pytest.xfail(f"a lone stall, not a wait ({over} of {len(calls)} calls over the bound): " + message)
    if worst_ms >= WORST_CALL_MS and load > cores:
        # More runnable threads than cores: the kernel time-slices them, and a thread waits several ms for its
        # slice (Linux CFS), whatever it runs. A bound on the single worst call is not measurable then.
        pytest.xfail("machine oversubscribed, worst-case bound not measurable: " + message)
    assert worst_ms < WORST_CALL_MS, message


@pytest.mark.slow
def test_a_60s_outage_delivery_resumes_within_10s_of_the_broker_and_every_event_arrives_once(
        private_kafka: stack_mod.StackConfig, tmp_path: Path) -> None:
    """Longer than the producer's 30 s delivery timeout: kafka-python then never resolves some sends
    (design.md), and before issue 19 the SDK waited for them forever. It must resume by itself."""
    cfg = private_kafka
    topic = cfg.kafka_topics[0]
    outage_s, rate, after_up_s = 60.0, 500.0, 30.0
    log = SessionLogger(cfg.kafka_bootstrap, topic=topic, name="long-outage", spool_dir=tmp_path / "spool",
                        outage_after_s=1.0, retry_s=0.5)
    stamps, samples, window, total = _paced_through_outage(log, cfg, outage_s, rate, after_up_s)
    delivered = log.flush(timeout=120)
    metrics = log.metrics()
    log.close()

    # Delivery resumed: the first sample after the restart began whose `sent` moved, measured from the broker's
    # health (start_kafka returned); and the outage over: the first sample after that with nothing spooled and
    # the SDK sending straight to Kafka again, while the agent keeps logging.
    sent_at_restart = max((sent for t, sent, _, _ in samples if t <= window["restarting"]), default=0)
    resumed = next((t for t, sent, _, _ in samples if t > window["restarting"] and sent > sent_at_restart), None)
    drained = next((t for t, _, spooled, down in samples
                    if resumed is not None and t >= resumed and spooled == 0 and not down), None)
    resume_s = None if resumed is None else max(0.0, resumed - window["up"])
    drain_s = None if drained is None else max(0.0, drained - window["up"])
    summary = (f"outage {window['restarting'] - window['down']:.1f}s, restart {window['up'] - window['restarting']:.1f}s, "
               f"delivery resumed {resume_s}s and spool drained {drain_s}s after the broker was healthy; {metrics}")
    print("long outage:", summary)
    assert resume_s is not None and resume_s <= 10.0, f"delivery did not resume within 10 s: {summary}"
    assert drain_s is not None, f"the spool was not drained {after_up_s:.0f} s after the broker came back: {summary}"
    assert delivered, f"flush did not finish after the broker returned: {summary}"
    assert metrics["spilled"] > 0 and metrics["replayed"] > 0 and metrics["dropped"] == 0, summary

    raw = _consume(cfg.kafka_bootstrap, topic, total, timeout_s=120)
    by_event = {event["event_id"]: event["request_id"] for event in map(json.loads, raw)}
    assert len(by_event) == total, (f"{len(by_event)} distinct events arrived for {total} logged "
                                    f"({len(raw)} records before de-duplication); {summary}")
    assert sorted(by_event.values(), key=int) == [str(i) for i in range(total)], "a call under two event ids or none"
    print(f"long outage: {len(raw)} records for {total} events ({len(raw) - total} replay duplicates)")

    # The host's calls never blocked, with the outage test's bound: while the broker was down (not while its
    # JVM restarted on this machine's cores) and while the spool was replayed after it came back.
    during = [d for t, d in stamps if window["down"] <= t <= window["restarting"]]
    replaying = [d for t, d in stamps if window["up"] <= t]
    assert len(during) > 0.9 * rate * outage_s, f"only {len(during)} calls fell inside the outage"
    _assert_never_blocked(during, "during the outage")
    _assert_never_blocked(replaying, "during the replay")


KILLED_AGENT = """
import sys, time
from flywheel import SessionLogger
log = SessionLogger(sys.argv[1], topic=sys.argv[2], name="restarted", linger_s=0.01, retry_s=0.2)
s = log.attach("sess-restart")
for i in range(300):
    s.tool_call("t", {"i": i})
while log.metrics()["spilled"] < 300:
    time.sleep(0.01)
print("spooled", flush=True)
time.sleep(120)
"""


def test_a_restarted_agent_replays_its_predecessors_spool(kafka_bootstrap: str, new_topic: Callable[..., str],
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Default spool (per name and topic, no pid): a SIGKILLed process, then a logger closed without delivery,
    then a logger that reaches Kafka: it delivers all of their records, each once, in the order logged."""
    topic = new_topic("restart")
    unreachable = f"127.0.0.1:{_free_port()}"
    monkeypatch.setenv("FLYWHEEL_SPOOL_DIR", str(tmp_path / "spool"))  # the default layout, under a root of our own
    killed = subprocess.Popen([sys.executable, "-c", KILLED_AGENT, unreachable, topic], cwd=tmp_path,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = killed.stdout.readline().strip() if killed.stdout else ""
        assert line == "spooled", f"the first agent did not spool its 300 records: {line!r}"
    finally:
        killed.kill()  # SIGKILL: no close, no atexit; only what reached the spool survives
        killed.wait(10)
    second = SessionLogger(unreachable, topic=topic, name="restarted", linger_s=0.01, retry_s=0.2)
    s = second.attach("sess-restart")
    for i in range(300, 400):
        s.tool_call("t", {"i": i})
    second.close(timeout=2)
    third = SessionLogger(kafka_bootstrap, topic=topic, name="restarted")
    delivered = third.flush(60)
    metrics = third.metrics()
    third.close()
    assert delivered and metrics["replayed"] == 400, f"the predecessors' spool was not replayed: {metrics}"
    events = [json.loads(v) for v in _consume(kafka_bootstrap, topic, 400)]
    seen: set[str] = set()
    first = [e["arguments"]["i"] for e in events if not (e["event_id"] in seen or seen.add(e["event_id"]))]
    assert first == list(range(400)), f"{len(first)} distinct events; every record once, in the order logged"
    assert not (tmp_path / "var" / "spool" / f"restarted@{topic}").exists(), "a replayed spool is removed"
