"""`flywheel bench ingest`: the lake writer's rate against kafka-python's raw consume rate, and
how long an event takes from produce to visible in the lake.

    flywheel bench ingest [--events 20000] [--partitions 4] [--live-rate 500] [--live-seconds 10] [--lake local|s3]

1. Produce N realistic session events (llm_calls of several KB with prompt/completion token
   ids and logprobs, plus tool calls) into a fresh topic.
2. (a) raw: a kafka-python consumer reads the same records with no processing.
   (b) writer: the lake writer (in this process) reads them and publishes Parquet.
   Both rates run from the first record received to the last record handled (consumed,
   resp. published), so group join and connection set-up are not counted for either.
3. Live: a lake writer subprocess follows a second topic while this process produces at a
   steady rate, stamping each event's ts at send time; a watcher lists the lake every 50 ms
   and records when each event became visible. p95_visible_s is over all events.

With --lake s3 the writer and the live run publish into an s3:// lake on the stack's S3-compatible server
(S3Proxy, `flywheel infra up --parts s3`), configured through the AWS_* variables as any process of an s3 lake
is; the writer is also measured into a local-disk lake on the same records, and that ratio is reported beside
the s3 one as ratio_local, so the cost of object storage is read off one run.

Starts Kafka (and S3Proxy for --lake s3) when not running (and stops only those). Prints a table, then the JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from flywheel.ingest import lake, schema

ROOT = Path(__file__).resolve().parents[1]


def realistic_event(rng: random.Random, i: int, ts: str | None = None) -> dict[str, Any]:
    """An event as the SDK emits it: mostly llm_calls with ~1-2k token ids, some tool events."""
    base = {"schema_version": 1, "event_id": uuid.uuid4().hex, "session_id": f"sess-{i // 20:06d}",
            "agent_id": "main", "seq": i % 20, "ts": ts or schema.now_ts()}
    kind = i % 4
    if kind in (0, 1, 2):
        n_prompt, n_completion = rng.randint(600, 1400), rng.randint(60, 250)
        return {**base, "type": "llm_call", "model": "policy-v3", "policy_version": 3,
                "prompt_token_ids": [rng.randrange(512) for _ in range(n_prompt)],
                "completion_token_ids": [rng.randrange(512) for _ in range(n_completion)],
                "completion_logprobs": [round(-rng.random() * 3, 4) for _ in range(n_completion)],
                "finish_reason": "stop", "latency_s": 0.4, "sampling": {"temperature": 1.0, "max_tokens": 256},
                "completion_text": "x" * n_completion * 3, "request_id": uuid.uuid4().hex}
    return {**base, "type": "tool_result", "call_id": uuid.uuid4().hex, "name": "run_tests", "ok": rng.random() < 0.5,
            "output": "F" * rng.randint(200, 2000)}


def _producer(bootstrap: str) -> Any:
    from kafka import KafkaProducer

    return KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=1024 * 1024, acks=1,
                         compression_type="lz4", max_request_size=8 * 1024 * 1024)


def produce_prefilled(bootstrap: str, topic: str, n: int, seed: int) -> int:
    """Produce n events; return their total wire bytes."""
    from rich.progress import Progress

    rng = random.Random(seed)
    producer = _producer(bootstrap)
    total = 0
    with Progress(transient=True) as progress:
        task = progress.add_task(f"produce {n} events", total=n)
        for i in range(n):
            value = json.dumps(realistic_event(rng, i)).encode()
            total += len(value)
            producer.send(topic, key=f"sess-{i // 20}".encode(), value=value)
            if i % 500 == 0:
                progress.update(task, completed=i)
        producer.flush()
    producer.close()
    return total


def raw_consume(bootstrap: str, topic: str, n: int) -> float:
    """Seconds kafka-python takes to hand over n records (first to last), with the writer's fetch settings."""
    from kafka import KafkaConsumer, TopicPartition

    from flywheel.ingest.lake_writer import LakeWriterConfig

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                             max_partition_fetch_bytes=LakeWriterConfig.fetch_partition_bytes,
                             fetch_max_bytes=64 * 1024 * 1024)
    parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    for tp in parts:
        consumer.position(tp)  # resolve the start offsets before the clock starts, as the writer's assignment does
    seen, t_first = 0, None
    while seen < n:
        t_poll = time.perf_counter()
        batches = consumer.poll(timeout_ms=500, max_records=LakeWriterConfig.max_poll_records)
        if batches and t_first is None:
            t_first = t_poll  # from the start of the first poll that returned records, as for the writer
        seen += sum(len(m) for m in batches.values())
    elapsed = time.perf_counter() - (t_first or time.perf_counter())
    consumer.close()
    return elapsed


def writer_rate(bootstrap: str, topic: str, n: int, lake_root: str, var_dir: str) -> tuple[float, int]:
    """Seconds the lake writer takes from its first record to n records published; and its file count."""
    from flywheel.ingest.lake_writer import LakeWriter, LakeWriterConfig, run

    cfg = LakeWriterConfig(kafka_bootstrap=bootstrap, events_topic=topic, outcomes_topic="",
                           dlq_topic=f"{topic}.dlq", group_id=f"bench-{uuid.uuid4().hex[:8]}", lake_root=lake_root,
                           var_dir=var_dir, log_level="WARNING")
    marks: dict[str, float] = {"prev": time.perf_counter()}

    def stop(writer: LakeWriter) -> bool:
        # stop() runs after each poll: the previous call's time is the start of this poll
        if "first" not in marks and writer.stats.records:
            marks["first"] = marks["prev"]
        marks["prev"] = time.perf_counter()
        if sum(last + 1 for last in writer.published.values()) >= n:
            marks["done"] = time.perf_counter()
            return True
        return False

    code = run(cfg, stop=stop)
    assert code == 0 and "done" in marks, f"the lake writer stopped early (exit {code})"
    return marks["done"] - marks["first"], len(lake.list_files(lake_root, "events"))


def live_latency(bootstrap: str, topic: str, rate: float, seconds: float, lake_root: str, var_dir: str) -> list[float]:
    """Produce at `rate`/s for `seconds` while a writer subprocess follows; return produce-to-visible seconds."""
    from flywheel.base.heartbeat import read_statuses

    name = f"bench-{uuid.uuid4().hex[:6]}"
    args = [sys.executable, "-m", "flywheel.ingest.lake_writer", "--kafka-bootstrap", bootstrap, "--events-topic", topic,
            "--outcomes-topic", "", "--dlq-topic", f"{topic}.dlq", "--group-id", name, "--writer-id", name,
            "--lake-root", lake_root, "--var-dir", var_dir, "--log-level", "WARNING"]
    proc = subprocess.Popen(args, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while read_statuses(var_dir).get(f"lake-writer-{name}", {}).get("partitions", 0) == 0:
            assert proc.poll() is None and time.monotonic() < deadline, "the lake writer did not take its partitions"
            time.sleep(0.2)
        sent: dict[str, float] = {}  # event_id -> produce time
        visible: dict[str, float] = {}
        done = threading.Event()

        def watch() -> None:
            import pyarrow.parquet as pq

            fs, _ = lake.filesystem(lake_root)
            seen_files: set[str] = set()
            while not done.is_set():
                now = time.time()
                for f in lake.list_files(lake_root, "events"):
                    if f.path not in seen_files:
                        seen_files.add(f.path)
                        ids = pq.read_table(f.path, columns=["event_id"], filesystem=fs).column("event_id")
                        for eid in ids.to_pylist():
                            visible.setdefault(eid, now)
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        rng = random.Random(7)
        producer = _producer(bootstrap)
        n = int(rate * seconds)
        t0 = time.time()
        for i in range(n):
            time.sleep(max(0.0, t0 + i / rate - time.time()))
            event = realistic_event(rng, i)
            sent[event["event_id"]] = time.time()
            producer.send(topic, key=event["session_id"].encode(), value=json.dumps(event).encode())
            producer.flush() if i % 10 == 0 else None  # the SDK's linger is ms; keep sends prompt
        producer.flush()
        producer.close()
        deadline = time.monotonic() + 30
        while len(visible) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        done.set()
        watcher.join()
        return [visible[e] - t for e, t in sent.items() if e in visible] + [float("inf")] * (n - len(visible))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def cost_breakdown(n: int = 2000, seed: int = 3) -> dict[str, float]:
    """Microseconds per event of each step of the writer, on the same kind of events, without Kafka:
    where the writer's time goes (JSON decode, schema validation, Arrow conversion, Parquet write)."""
    import io

    import pyarrow.parquet as pq

    from flywheel.ingest.lake_writer import _loads, decode_record, rows_to_table

    rng = random.Random(seed)
    values = [json.dumps(realistic_event(rng, i)).encode() for i in range(n)]
    out: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        t = time.perf_counter()
        result = fn()
        out[name] = round((time.perf_counter() - t) / n * 1e6, 1)
        return result

    records = timed("json_decode_us", lambda: [_loads(v.decode()) for v in values])
    timed("validate_us", lambda: [schema.validate_event(r) for r in records])
    rows = timed("decode_validate_convert_us", lambda: [decode_record("events", v)[0] for v in values])
    for i, row in enumerate(rows):
        row.update(_topic="t", _partition=0, _offset=i, _ingest_ts=row["ts"])
    data = timed("arrow_us", lambda: rows_to_table("events", rows))
    timed("parquet_zstd_us", lambda: pq.write_table(data, io.BytesIO(), compression="zstd"))
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flywheel bench ingest", description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000, help="events for the rate comparison")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--live-rate", type=float, default=300.0, help="events/s in the visibility run")
    parser.add_argument("--live-seconds", type=float, default=10.0)
    parser.add_argument("--kafka-bootstrap", default=os.environ.get("FLYWHEEL_KAFKA_BOOTSTRAP", "127.0.0.1:9092"))
    parser.add_argument("--lake", choices=("local", "s3"), default="local",
                        help="where the writer publishes: a local folder, or an s3:// lake on the stack's S3 server "
                             "(then also measured into a local folder on the same records, as ratio_local)")
    return parser.parse_args(argv)


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for a block and restore them after: the s3 lake's clients (pyarrow, the lake's
    claims, the live writer subprocess) read their endpoint and keys only from the environment."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def summarize(args: argparse.Namespace, wire_bytes: int, raw_s: float, writer_s: float, files: int,
              latencies: list[float], costs: dict[str, float], local_writer_s: float | None = None) -> dict[str, Any]:
    """The JSON line; writer_s and files are for the lake under test, local_writer_s (s3 runs) the local disk's."""
    raw_rate, rate = args.events / raw_s, args.events / writer_s
    local = {} if local_writer_s is None else {"ratio_local": round(args.events / local_writer_s / raw_rate, 3)}
    return {
        "events": args.events,
        "mean_event_bytes": round(wire_bytes / args.events),
        "raw_consume_events_per_s": round(raw_rate, 1),
        "events_per_s": round(rate, 1),
        "mb_per_s": round(wire_bytes / writer_s / 1e6, 2),
        "ratio": round(rate / raw_rate, 3),
        **local,
        "files": files,
        "live_rate": args.live_rate,
        "p50_visible_s": round(_percentile(latencies, 0.5), 3),
        "p95_visible_s": round(_percentile(latencies, 0.95), 3),
        "max_visible_s": round(max(latencies), 3),
        "raw_consume_us_per_event": round(1e6 / raw_rate, 1),
        **costs,
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def print_table(args: argparse.Namespace, result: dict[str, Any], raw_s: float, writer_s: float,
                local_writer_s: float | None) -> None:
    from rich.console import Console
    from rich.table import Table

    raw_rate, rate, files = args.events / raw_s, args.events / writer_s, result["files"]
    on_s3 = local_writer_s is not None
    table = Table(title="ingest: Kafka -> Parquet lake" + (" on S3 (S3Proxy)" if on_s3 else ""))
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("events (mean bytes)", f"{args.events} ({result['mean_event_bytes']} B)")
    table.add_row("raw kafka-python consume", f"{raw_rate:,.0f} events/s")
    table.add_row("lake writer to published Parquet" + (" on s3" if on_s3 else ""),
                  f"{rate:,.0f} events/s, {result['mb_per_s']} MB/s, {files} files")
    if local_writer_s is not None:
        table.add_row("lake writer to local disk (same records)", f"{args.events / local_writer_s:,.0f} events/s")
        table.add_row("ratio writer / raw: s3 / local disk (target >= 0.7)",
                      f"{result['ratio']:.2f} / {result['ratio_local']:.2f}")
    else:
        table.add_row("ratio writer / raw (target >= 0.7)", f"{result['ratio']:.2f}")
    table.add_row("per event: raw consume / JSON decode / validate / Arrow / Parquet (us)",
                  f"{result['raw_consume_us_per_event']} / {result['json_decode_us']} / {result['validate_us']} / "
                  f"{result['arrow_us']} / {result['parquet_zstd_us']}")
    table.add_row(f"produce -> visible at {args.live_rate:.0f}/s: p50 / p95 / max (target p95 < 5 s)",
                  f"{result['p50_visible_s']} / {result['p95_visible_s']} / {result['max_visible_s']} s")
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from kafka.admin import KafkaAdminClient, NewTopic
    from rich.console import Console

    from flywheel import stack

    console = Console(stderr=True)
    on_s3 = args.lake == "s3"
    scfg = stack.load_stack_config(["--kafka-bootstrap", args.kafka_bootstrap]) if _stack_takes_flag() else stack.load_stack_config([])
    started = stack.ensure_up(scfg, parts=["kafka", "s3"] if on_s3 else ["kafka"])
    if started:
        console.print(f"started {started} for this benchmark")
    suffix = uuid.uuid4().hex[:8]
    rate_topic, live_topic = f"bench.ingest.{suffix}", f"bench.ingest-live.{suffix}"
    topics = [rate_topic, live_topic, f"{rate_topic}.dlq", f"{live_topic}.dlq"]
    s3_root = f"s3://{scfg.s3_bucket}/bench-ingest-{suffix}"
    admin = KafkaAdminClient(bootstrap_servers=args.kafka_bootstrap)
    admin.create_topics([NewTopic(t, args.partitions if i < 2 else 1, 1) for i, t in enumerate(topics)])
    local_writer_s = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp, \
                environment(stack.s3_env(scfg) if on_s3 else {}):
            lake_base = s3_root if on_s3 else tmp
            rate_lake, live_lake = f"{lake_base}/lake", f"{lake_base}/live-lake"
            console.print(f"producing {args.events} events into {rate_topic} ...")
            wire_bytes = produce_prefilled(args.kafka_bootstrap, rate_topic, args.events, seed=1)
            console.print("raw kafka-python consume ...")
            raw_s = raw_consume(args.kafka_bootstrap, rate_topic, args.events)
            if on_s3:
                console.print("lake writer, local disk ...")
                local_writer_s, _ = writer_rate(args.kafka_bootstrap, rate_topic, args.events, f"{tmp}/lake",
                                                f"{tmp}/var-local")
            console.print(f"lake writer{' into ' + rate_lake if on_s3 else ''} ...")
            writer_s, files = writer_rate(args.kafka_bootstrap, rate_topic, args.events, rate_lake, f"{tmp}/var")
            console.print("cost breakdown ...")
            costs = cost_breakdown()
            console.print(f"live: {args.live_rate:.0f} events/s for {args.live_seconds:.0f} s ...")
            latencies = live_latency(args.kafka_bootstrap, live_topic, args.live_rate, args.live_seconds,
                                     live_lake, f"{tmp}/var")
    finally:
        admin.delete_topics(topics)
        admin.close()
        if on_s3:
            _delete_s3_lake(s3_root, stack.s3_env(scfg))
        if started:
            stack.down(scfg, parts=started)

    result = summarize(args, wire_bytes, raw_s, writer_s, files, latencies, costs, local_writer_s)
    print_table(args, result, raw_s, writer_s, local_writer_s)
    print(json.dumps(result))
    return 0


def _delete_s3_lake(root: str, env: dict[str, str]) -> None:
    """Remove the bench's lakes from the bucket (a shared server keeps its data folder between runs)."""
    import pyarrow.fs as pafs

    with environment(env):
        fs, path = lake.filesystem(root)
        if fs.get_file_info(path).type != pafs.FileType.NotFound:
            fs.delete_dir(path)


def _stack_takes_flag() -> bool:
    import dataclasses

    from flywheel import stack

    return any(f.name == "kafka_bootstrap" for f in dataclasses.fields(stack.StackConfig))


if __name__ == "__main__":
    sys.exit(main())
