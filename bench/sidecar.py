"""`flywheel bench sidecar`: what logging an llm_call costs the agent, next to an OpenTelemetry span.

    flywheel bench sidecar [--calls 20000] [--rate 2000] [--burst-calls 10000] [--prompt-tokens 1024]

Four variants run in one process, one after the other, with the same payload and pacing:

* sdk      `s.llm_call(...)` with the broker up (a fresh topic on the local broker);
* parked   control: `s.llm_call(...)` with the SDK's background thread parked, i.e. the call alone
           on this machine; sdk minus parked is what the background work costs the host (GIL);
* otel     an OpenTelemetry SDK span start+end with the call's metadata as attributes, through a
           BatchSpanProcessor whose exporter encodes OTLP protobuf (the work an OTLP exporter does
           before the network) and discards it;
* outage   `s.llm_call(...)` while the broker is down: a private broker (own ports, own data dir)
           is started, the logger connects to it, the broker is SIGKILLed, and the calls are
           measured while the SDK spills to its spool.

sdk and otel also run back-to-back (no pacing): the usual tight-loop micro-benchmark, where
the background threads compete with every call.

Each call is timed with perf_counter_ns around the call only. Calls are paced (--rate per
second, far above a real agent's few calls per second) so the background threads run while
the host calls, as they do in production. Prints a table and, last, one JSON line.
Starts the shared Kafka broker only if it is not running, and stops only what it started.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

TARGET_P99_US = 50.0


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    n = len(ordered)

    def pick(q: float) -> float:
        return ordered[min(n - 1, int(q * n))] / 1e3

    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "p999": pick(0.999), "max": ordered[-1] / 1e3,
            "mean": statistics.fmean(ordered) / 1e3}


def _paced(call: Callable[[int], None], calls: int, rate: float, progress: Any, task: Any) -> list[int]:
    """Time each call; between calls wait until the next slot so the rate is `rate` per second."""
    samples: list[int] = []
    interval = 1.0 / rate if rate > 0 else 0.0
    next_slot = time.perf_counter()
    for i in range(calls):
        t0 = time.perf_counter_ns()
        call(i)
        samples.append(time.perf_counter_ns() - t0)
        if interval:
            next_slot += interval
            delay = next_slot - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        if i % 1000 == 999:
            progress.update(task, advance=1000)
    return samples


def _payload(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    import random

    rng = random.Random(0)
    return {
        "model": "policy-v3", "policy_version": 3,
        "prompt_token_ids": [rng.randrange(512) for _ in range(prompt_tokens)],
        "completion_token_ids": [rng.randrange(512) for _ in range(completion_tokens)],
        "completion_logprobs": [-rng.random() * 3 for _ in range(completion_tokens)],
        "finish_reason": "stop", "latency_s": 0.734, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 256},
        "completion_text": "I will call the search tool with the query 'kafka idempotent producer'. " * 4,
    }


def _sdk_call(logger: Any, payload: dict[str, Any], sessions: int = 64) -> Callable[[int], None]:
    handles = [logger.attach(f"bench-{uuid.uuid4().hex[:8]}-{k}") for k in range(sessions)]

    def call(i: int) -> None:
        handles[i % sessions].llm_call(**payload, request_id=str(i))

    return call


def _otel_call(payload: dict[str, Any]) -> tuple[Callable[[int], None], Callable[[], None]]:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class EncodingExporter(SpanExporter):
        """Does what OTLPSpanExporter does up to the network call: encode the batch to protobuf."""

        def __init__(self) -> None:
            self.spans = 0
            self.bytes = 0

        def export(self, spans: Any) -> SpanExportResult:
            self.bytes += len(encode_spans(spans).SerializeToString())
            self.spans += len(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    exporter = EncodingExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracer = provider.get_tracer("agent")
    attrs = {"gen_ai.request.model": payload["model"], "policy_version": payload["policy_version"],
             "gen_ai.usage.input_tokens": len(payload["prompt_token_ids"]),
             "gen_ai.usage.output_tokens": len(payload["completion_token_ids"]),
             "gen_ai.response.finish_reasons": (payload["finish_reason"],), "latency_s": payload["latency_s"],
             "gen_ai.request.temperature": 1.0}

    def call(i: int) -> None:
        span = tracer.start_span("llm_call", attributes=attrs)
        span.end()

    def close() -> None:
        provider.shutdown()
        assert exporter.spans > 0, "the OpenTelemetry exporter never ran"

    return call, close


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flywheel bench sidecar", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000, help="timed calls per variant")
    parser.add_argument("--rate", type=float, default=2000.0, help="calls per second (0: as fast as possible)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--completion-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2000, help="untimed calls before each variant")
    parser.add_argument("--burst-calls", type=int, default=10_000, help="timed back-to-back calls (no pacing)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    import logging

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from flywheel import stack as stack_mod
    from flywheel.base.config import setup_logging
    from flywheel.ingest.sdk import SessionLogger

    setup_logging("WARNING")
    for noisy in ("flywheel.ingest.sdk", "kafka"):  # connection-refused errors and outage warnings are expected here
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    console = Console(stderr=True, width=120)
    cfg = stack_mod.load_stack_config([])
    started = stack_mod.ensure_up(cfg, parts=["kafka"])
    if started:
        console.print("started the local Kafka broker for this benchmark (stopped at the end)")
    payload = _payload(args.prompt_tokens, args.completion_tokens)
    results: dict[str, dict[str, float]] = {}
    extra: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="bench-sidecar-"))
    private = None
    try:
        from kafka.admin import KafkaAdminClient, NewTopic

        topic = f"bench.sidecar.{uuid.uuid4().hex[:8]}"
        admin = KafkaAdminClient(bootstrap_servers=cfg.kafka_bootstrap, client_id="bench")
        admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)])
        with Progress(console=console, transient=True) as progress:
            # --- sdk, broker up
            logger = SessionLogger(cfg.kafka_bootstrap, topic=topic, name="bench-sdk", spool_dir=tmp / "sdk")
            task = progress.add_task("sdk llm_call (broker up)", total=args.calls)
            call = _sdk_call(logger, payload)
            for i in range(args.warmup):
                call(i)
            logger.flush(60)
            gc.collect()
            results["sdk"] = _percentiles(_paced(call, args.calls, args.rate, progress, task))
            logger.flush(120)
            task = progress.add_task("sdk llm_call back-to-back", total=args.burst_calls)
            results["sdk_burst"] = _percentiles(_paced(call, args.burst_calls, 0, progress, task))
            extra["delivered"] = logger.flush(120)
            extra["sdk_metrics"] = logger.metrics()
            logger.close()

            # --- control: the same calls with the background thread parked (it never wakes during the run):
            # what the call itself costs on this machine, so the difference to "sdk" is what the
            # background work (encoding, Kafka I/O) costs the host through the GIL.
            task = progress.add_task("sdk llm_call (background parked)", total=args.calls)
            parked = SessionLogger(cfg.kafka_bootstrap, topic=topic, name="bench-parked", spool_dir=tmp / "parked",
                                   linger_s=3600.0, batch_max=10**9, max_queue=10**9)
            pcall = _sdk_call(parked, payload)
            for i in range(args.warmup):
                pcall(i)
            gc.collect()
            results["parked"] = _percentiles(_paced(pcall, args.calls, args.rate, progress, task))
            parked.close(timeout=30)

            # --- OpenTelemetry span
            task = progress.add_task("otel span start+end", total=args.calls)
            ocall, oclose = _otel_call(payload)
            for i in range(args.warmup):
                ocall(i)
            gc.collect()
            results["otel"] = _percentiles(_paced(ocall, args.calls, args.rate, progress, task))
            time.sleep(6)  # let the BatchSpanProcessor (5 s schedule) empty its queue
            task = progress.add_task("otel span back-to-back", total=args.burst_calls)
            results["otel_burst"] = _percentiles(_paced(ocall, args.burst_calls, 0, progress, task))
            oclose()

            # --- outage: a private broker, connected to, then killed
            task = progress.add_task("sdk llm_call (broker down)", total=args.calls)
            private = stack_mod.replace_config(cfg, var_dir=tmp / "var", kafka_port=_free_port(),
                                               kafka_controller_port=_free_port(), kafka_topics=[topic],
                                               kafka_partitions=4, kafka_heap="256m", parts=["kafka"])
            stack_mod.start_kafka(private)
            down_logger = SessionLogger(private.kafka_bootstrap, topic=topic, name="bench-outage", spool_dir=tmp / "outage",
                                        outage_after_s=0.5)
            dcall = _sdk_call(down_logger, payload)
            for i in range(args.warmup):
                dcall(i)
            down_logger.flush(60)
            record = json.loads((Path(private.var_dir) / "run" / "kafka.pid.json").read_text())
            os.killpg(int(record["pid"]), signal.SIGKILL)
            for i in range(args.warmup):  # until the SDK has noticed and spills
                dcall(i)
            time.sleep(1.0)
            gc.collect()
            results["outage"] = _percentiles(_paced(dcall, args.calls, args.rate, progress, task))
            down_logger.close(timeout=30)  # nothing can be delivered: close spills the backlog, then count
            extra["outage_metrics"] = down_logger.metrics()
        admin.delete_topics([topic])
        admin.close()
    finally:
        if private is not None:
            stack_mod.stop_kafka(private)
        if started:
            stack_mod.down(cfg, parts=started)
        shutil.rmtree(tmp, ignore_errors=True)  # the private broker's data and the spools

    table = Table(title=f"hot-path cost per call, {args.calls} calls at {args.rate:.0f}/s "
                        f"(prompt {args.prompt_tokens} tokens, completion {args.completion_tokens})")
    table.add_column("variant")
    for col in ("p50 µs", "p90 µs", "p99 µs", "p99.9 µs", "max µs", "mean µs"):
        table.add_column(col, justify="right")
    labels = {"sdk": "SessionLogger.llm_call, broker up", "sdk_burst": "  same, back-to-back",
              "parked": "  control: paced, background thread parked",
              "otel": "OpenTelemetry span start+end (BatchSpanProcessor)", "otel_burst": "  same, back-to-back",
              "outage": "SessionLogger.llm_call, broker killed"}
    for name, r in results.items():
        table.add_row(labels[name], *(f"{r[k]:.1f}" for k in ("p50", "p90", "p99", "p999", "max", "mean")))
    console.print(table)
    sdk, otel, outage = results["sdk"], results["otel"], results["outage"]
    m, om = extra["sdk_metrics"], extra["outage_metrics"]
    console.print(f"broker up: sent {m['sent']} of {m['enqueued']} (delivered: {extra['delivered']}); "
                  f"broker down: spilled {om['spilled']}, dropped {om['dropped']}")
    summary = {
        "p50_us": round(sdk["p50"], 2), "p99_us": round(sdk["p99"], 2), "p999_us": round(sdk["p999"], 2),
        "otel_p50_us": round(otel["p50"], 2), "otel_p99_us": round(otel["p99"], 2),
        "outage_p50_us": round(outage["p50"], 2), "outage_p99_us": round(outage["p99"], 2),
        "parked_p50_us": round(results["parked"]["p50"], 2), "parked_p99_us": round(results["parked"]["p99"], 2),
        "burst_p50_us": round(results["sdk_burst"]["p50"], 2), "burst_p99_us": round(results["sdk_burst"]["p99"], 2),
        "otel_burst_p50_us": round(results["otel_burst"]["p50"], 2),
        "otel_burst_p99_us": round(results["otel_burst"]["p99"], 2),
        "load_average": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
        "calls": args.calls, "rate_per_s": args.rate, "prompt_tokens": args.prompt_tokens,
        "completion_tokens": args.completion_tokens, "delivered": bool(extra["delivered"]),
        "sent": m["sent"], "outage_spilled": om["spilled"], "outage_dropped": om["dropped"],
        "p99_under_50us": sdk["p99"] < TARGET_P99_US, "burst_p99_under_50us": results["sdk_burst"]["p99"] < TARGET_P99_US, "p99_not_slower_than_otel": sdk["p99"] <= otel["p99"],
        "outage_p99_within_2x": outage["p99"] <= 2 * sdk["p99"],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
