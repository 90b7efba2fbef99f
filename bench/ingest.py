"""`flywheel bench ingest`: the lake writer's rate against kafka-python's raw consume rate, and
how long an event takes from produce to visible in the lake.

    flywheel bench ingest [--events 20000] [--partitions 4] [--live-rate 500] [--live-seconds 10] [--lake local|s3]
                          [--binary] [--profile]
    flywheel bench ingest --vs quixstreams ...   (the lake writer against a Quix Streams app: bench/ingest_peer.py)

1. Produce N realistic session events (llm_calls of several KB with prompt/completion token
   ids and logprobs, plus tool calls) into fresh topics, the same events once per wire format
   (ingest/wire.py): v1 (token lists as JSON) and v3 (packed: base64 of int32/float32), and with
   --binary also the binary envelope v3 was measured against.
2. For each format's topic: (a) raw: a kafka-python consumer reads the records with no processing;
   (b) writer: the lake writer (in this process) reads them and publishes Parquet, with the same
   fetch settings. Both rates run from the first record received to the last record handled
   (consumed, resp. published), so group join and connection set-up are not counted for either.
   `ratio` is the v3 writer over the raw consume of the v3 records, `ratio_v1` the same for v1.
3. Live: a lake writer subprocess follows another topic while this process produces v3 records
   at a steady rate, stamping each event's ts at send time; a watcher lists the lake every 50 ms
   and records when each event became visible. p95_visible_s is over all events.
4. Per event, without Kafka: the writer's steps (decode, validate, Arrow, Parquet) for v1 and v3, the
   record-by-record reference beside what the writer runs (decode_batch: decode to Arrow by column);
   with --profile, the top of a cProfile of decode_batch + LakeWriter.add_batch + publish for each format.

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
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from flywheel.ingest import lake, schema, wire

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


# the formats a run compares: v1 is the JSON lists every SDK before v3 sent; `packed` is v3 as emitted
FORMATS = {"v1": "json", "v3": "packed", "binary": "binary"}


def encoded(fmt: str, event: dict[str, Any]) -> bytes:
    return wire.encode(event, FORMATS[fmt])


def produce_prefilled(bootstrap: str, topics: dict[str, str], n: int, seed: int) -> dict[str, int]:
    """Produce the same n events into each format's topic; return each topic's total wire bytes."""
    from rich.progress import Progress

    rng = random.Random(seed)
    producer = _producer(bootstrap)
    total = dict.fromkeys(topics, 0)
    with Progress(transient=True) as progress:
        task = progress.add_task(f"produce {n} events x {len(topics)} formats", total=n)
        for i in range(n):
            event = realistic_event(rng, i)
            for fmt, topic in topics.items():
                value = encoded(fmt, event)
                total[fmt] += len(value)
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


def writer_rate(bootstrap: str, topic: str, n: int, lake_root: str, var_dir: str,
                cpu: dict[str, float] | None = None, client: str = "kafka-python") -> tuple[float, int]:
    """Seconds the lake writer (on Kafka client `client`) takes from its first record to n records published; and
    its file count. With `cpu`, its "cpu_s" is this process's CPU time (all threads) over the same span."""
    from flywheel.ingest.lake_writer import LakeWriter, LakeWriterConfig, run

    cfg = LakeWriterConfig(kafka_bootstrap=bootstrap, events_topic=topic, outcomes_topic="",
                           dlq_topic=f"{topic}.dlq", group_id=f"bench-{uuid.uuid4().hex[:8]}", lake_root=lake_root,
                           var_dir=var_dir, log_level="WARNING", kafka_client=client)
    marks: dict[str, float] = {"prev": time.perf_counter()}

    def stop(writer: LakeWriter) -> bool:
        # stop() runs after each poll: the previous call's time is the start of this poll
        if "first" not in marks and writer.stats.records:
            marks["first"], marks["first_cpu"] = marks["prev"], marks["prev_cpu"]
        marks["prev"], marks["prev_cpu"] = time.perf_counter(), time.process_time()
        if sum(last + 1 for last in writer.published.values()) >= n:
            marks["done"], marks["done_cpu"] = time.perf_counter(), time.process_time()
            return True
        return False

    marks["prev_cpu"] = time.process_time()
    code = run(cfg, stop=stop)
    assert code == 0 and "done" in marks, f"the lake writer stopped early (exit {code})"
    if cpu is not None:
        cpu["cpu_s"] = marks["done_cpu"] - marks["first_cpu"]
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
        from bench.ingest_peer import Watcher, produce_live  # the peer comparison's watcher and paced producer

        with Watcher("writer", lake_root) as watcher:
            sent = produce_live(bootstrap, topic, rate, seconds, seed=7)
            deadline = time.monotonic() + 30
            while not set(sent) <= set(watcher.visible) and time.monotonic() < deadline:
                time.sleep(0.1)
        return [watcher.visible[e] - t if e in watcher.visible else float("inf") for e, t in sent.items()]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def cost_breakdown(n: int = 2000, seed: int = 3) -> dict[str, float]:
    """Microseconds per event of each step of the writer, on the same kind of events, without Kafka:
    where the writer's time goes (decode, schema validation and limits, Arrow conversion, Parquet write),
    for v3 records and (prefixed v1_) for v1 records. `json_decode_us` is v1's JSON decode, as before."""
    rng = random.Random(seed)
    events = [realistic_event(rng, i) for i in range(n)]
    out: dict[str, float] = {}
    for fmt, prefix in (("v1", "v1_"), ("v3", "")):
        out.update({prefix + k: v for k, v in _step_costs([encoded(fmt, e) for e in events]).items()})
    out["json_decode_us"] = out.pop("v1_decode_us")
    return out


def _step_costs(values: list[bytes]) -> dict[str, float]:
    import io

    import pyarrow.parquet as pq

    from flywheel.ingest.decode import _b64decode, _loads, decode_batch, decode_record, rows_to_table

    out: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        t = time.perf_counter()
        result = fn()
        out[name] = round((time.perf_counter() - t) / len(values) * 1e6, 1)
        return result

    records = timed("decode_us", lambda: [wire.decode(v, _loads, _b64decode) for v in values])
    timed("validate_us", lambda: [schema.check_limits(schema.validate_event(r)) for r in records])
    rows = timed("decode_validate_convert_us", lambda: [decode_record("events", v)[0] for v in values])
    for i, row in enumerate(rows):
        row.update(_topic="t", _partition=0, _offset=i, _ingest_ts=row["ts"])
    data = timed("arrow_us", lambda: rows_to_table("events", rows))
    # what the writer runs: decode, validation, limits and Arrow for runs of 1,000 records, column by column
    timed("batch_decode_us", lambda: [decode_batch("events", "t", 0, list(range(k, min(k + 1000, len(values)))),
                                                   values[k:k + 1000]) for k in range(0, len(values), 1000)])
    timed("parquet_zstd_us", lambda: pq.write_table(data, io.BytesIO(), compression="zstd"))
    return out


def profile_writer(fmts: list[str], n: int = 4000, seed: int = 5, top: int = 15) -> str:
    """cProfile of the writer's own part (decode_batch, LakeWriter.add_batch, publish into a temp lake; no Kafka) for
    each format: the table docs/lake.md's "where the time went" is read from."""
    import cProfile
    import io
    import pstats
    from types import SimpleNamespace

    from flywheel.ingest.decode import decode_batch
    from flywheel.ingest.lake_writer import DeadLetters, LakeWriter, LakeWriterConfig, _rare_gc

    rng = random.Random(seed)
    events = [realistic_event(rng, i) for i in range(n)]
    report = io.StringIO()
    for fmt in fmts:
        values = [encoded(fmt, e) for e in events]
        with tempfile.TemporaryDirectory(prefix="bench-ingest-profile-") as root:
            cfg = LakeWriterConfig(events_topic="t", outcomes_topic="", lake_root=root, log_level="WARNING")
            writer = LakeWriter(cfg, DeadLetters(None, cfg.dlq_topic, root))
            writer.assign([("t", 0)])
            profiler = cProfile.Profile()
            with _rare_gc():  # as run() does
                t = time.perf_counter()
                profiler.enable()
                for k in range(0, n, 1000):  # as the loop hands over polled runs: decode_batch, then add_batch
                    run = [SimpleNamespace(offset=i, value=values[i], key=None, timestamp=None)
                           for i in range(k, min(k + 1000, n))]
                    writer.add_batch("t", 0, run, decode_batch("events", "t", 0, [m.offset for m in run],
                                                               [m.value for m in run]))
                writer.flush_all()
                profiler.disable()
                elapsed = time.perf_counter() - t
        report.write(f"\n--- {fmt}: {elapsed / n * 1e6:.1f} us/event under cProfile ({n} events) ---\n")
        pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(top)
    return report.getvalue()


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
    parser.add_argument("--binary", action="store_true",
                        help="also measure the binary envelope v3 was chosen against (ratio_binary)")
    parser.add_argument("--profile", action="store_true",
                        help="print a cProfile of the writer's own part per format before the JSON line")
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


def summarize(args: argparse.Namespace, wire_bytes: dict[str, int], raw_s: dict[str, float],
              writer_s: dict[str, float], files: int, latencies: list[float], costs: dict[str, float],
              local_writer_s: float | None = None) -> dict[str, Any]:
    """The JSON line. The dicts hold one value per format ("v3", "v1", and "binary" with --binary); writer_s
    and files are for the lake under test, local_writer_s (s3 runs) the local disk's, v3 records."""
    n = args.events
    raw_rate, rate = n / raw_s["v3"], n / writer_s["v3"]
    local = {} if local_writer_s is None else {"ratio_local": round(n / local_writer_s / raw_rate, 3)}
    binary = {} if "binary" not in writer_s else {
        "ratio_binary": round(raw_s["binary"] / writer_s["binary"], 3),
        "events_per_s_binary": round(n / writer_s["binary"], 1),
        "raw_consume_binary_events_per_s": round(n / raw_s["binary"], 1),
        "mean_event_bytes_binary": round(wire_bytes["binary"] / n)}
    return {
        "events": n,
        "mean_event_bytes": round(wire_bytes["v3"] / n),
        "mean_event_bytes_v1": round(wire_bytes["v1"] / n),
        "raw_consume_events_per_s": round(raw_rate, 1),
        "raw_consume_v1_events_per_s": round(n / raw_s["v1"], 1),
        "events_per_s": round(rate, 1),
        "events_per_s_v1": round(n / writer_s["v1"], 1),
        "mb_per_s": round(wire_bytes["v3"] / writer_s["v3"] / 1e6, 2),
        "ratio": round(rate / raw_rate, 3),
        "ratio_v1": round(raw_s["v1"] / writer_s["v1"], 3),
        **local,
        **binary,
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


def print_table(args: argparse.Namespace, result: dict[str, Any], on_s3: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    r = result
    table = Table(title="ingest: Kafka -> Parquet lake" + (" on S3 (S3Proxy)" if on_s3 else ""))
    table.add_column("measure")
    table.add_column("v1 (JSON lists)", justify="right")
    table.add_column("v3 (packed)", justify="right")
    if "ratio_binary" in r:
        table.add_column("binary envelope", justify="right")
    b = "ratio_binary" in r

    def row(name: str, v1: str, v3: str, binary: str = "") -> None:
        table.add_row(name, v1, v3, *([binary] if b else []))

    row("events (mean bytes)", f"{args.events} ({r['mean_event_bytes_v1']} B)", f"{args.events} ({r['mean_event_bytes']} B)",
        f"{args.events} ({r.get('mean_event_bytes_binary')} B)")
    row("raw kafka-python consume, events/s", f"{r['raw_consume_v1_events_per_s']:,.0f}",
        f"{r['raw_consume_events_per_s']:,.0f}", f"{r.get('raw_consume_binary_events_per_s', 0):,.0f}")
    row("lake writer to published Parquet" + (" on s3" if on_s3 else "") + ", events/s",
        f"{r['events_per_s_v1']:,.0f}", f"{r['events_per_s']:,.0f} ({r['mb_per_s']} MB/s, {r['files']} files)",
        f"{r.get('events_per_s_binary', 0):,.0f}")
    row("ratio writer / raw (target >= 0.8)", f"{r['ratio_v1']:.2f}", f"{r['ratio']:.2f}"
        + (f" (local disk {r['ratio_local']:.2f})" if on_s3 else ""), f"{r.get('ratio_binary', 0):.2f}")
    row("per event (us): decode / validate+limits / Arrow / Parquet",
        f"{r['json_decode_us']} / {r['v1_validate_us']} / {r['v1_arrow_us']} / {r['v1_parquet_zstd_us']}",
        f"{r['decode_us']} / {r['validate_us']} / {r['arrow_us']} / {r['parquet_zstd_us']}")
    row("per event (us): raw consume", f"{1e6 / r['raw_consume_v1_events_per_s']:.1f}", f"{r['raw_consume_us_per_event']}")
    table.add_row(f"produce -> visible at {args.live_rate:.0f}/s (v3): p50 / p95 / max (target p95 < 5 s)", "",
                  f"{r['p50_visible_s']} / {r['p95_visible_s']} / {r['max_visible_s']} s", *([""] if b else []))
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--vs" or a.startswith("--vs=") for a in argv):  # the peer comparison: bench/ingest_peer.py
        from bench import ingest_peer

        return ingest_peer.main(argv)
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
    fmts = ["v1", "v3"] + (["binary"] if args.binary else [])
    rate_topics = {fmt: f"bench.ingest.{fmt}.{suffix}" for fmt in fmts}
    live_topic = f"bench.ingest-live.{suffix}"
    data_topics = [*rate_topics.values(), live_topic]
    topics = data_topics + [f"{t}.dlq" for t in data_topics]
    s3_root = f"s3://{scfg.s3_bucket}/bench-ingest-{suffix}"
    admin = KafkaAdminClient(bootstrap_servers=args.kafka_bootstrap)
    admin.create_topics([NewTopic(t, args.partitions if t in data_topics else 1, 1) for t in topics])
    local_writer_s = None
    raw_s: dict[str, float] = {}
    writer_s: dict[str, float] = {}
    files: dict[str, int] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp, \
                environment(stack.s3_env(scfg) if on_s3 else {}):
            lake_base = s3_root if on_s3 else tmp
            live_lake = f"{lake_base}/live-lake"
            console.print(f"producing {args.events} events into {', '.join(rate_topics.values())} ...")
            wire_bytes = produce_prefilled(args.kafka_bootstrap, rate_topics, args.events, seed=1)
            # formats alternate raw, writer, raw, writer ...: a change in the machine's load hits both of a format
            for fmt, topic in rate_topics.items():
                console.print(f"{fmt}: raw kafka-python consume ...")
                raw_s[fmt] = raw_consume(args.kafka_bootstrap, topic, args.events)
                if on_s3 and fmt == "v3":
                    console.print("v3: lake writer, local disk ...")
                    local_writer_s, _ = writer_rate(args.kafka_bootstrap, topic, args.events, f"{tmp}/lake-local-{fmt}",
                                                    f"{tmp}/var-local-{fmt}")
                console.print(f"{fmt}: lake writer{' into ' + lake_base if on_s3 else ''} ...")
                writer_s[fmt], files[fmt] = writer_rate(args.kafka_bootstrap, topic, args.events,
                                                        f"{lake_base}/lake-{fmt}", f"{tmp}/var-{fmt}")
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

    result = summarize(args, wire_bytes, raw_s, writer_s, files["v3"], latencies, costs, local_writer_s)
    print_table(args, result, on_s3)
    if args.profile:
        print(profile_writer(fmts))
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
