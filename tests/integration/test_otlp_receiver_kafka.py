"""`flywheel otlp-receiver` against the real broker: an agent traced with the opentelemetry-sdk exports its spans
with the SDK's own OTLP/HTTP exporter (BatchSpanProcessor, protobuf); the events are read back from Kafka, landed by
the lake writer, and the gate's session reader counts the session with its outcome, version and token usage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Callable

import pytest

from flywheel.ingest import lake, schema, wire
from flywheel.ingest.lake_writer import LakeWriterConfig
from flywheel.ingest.otlp_receiver import session_id_of
from flywheel.ingest.sdk import OutcomeReporter
from flywheel.serving.sessions import read_sessions
from tests.integration.test_lake_writer import run_until
from tests.integration.test_sdk_kafka import _consume, _free_port

pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")


def _traced_agent_run(endpoint: str) -> str:
    """One agent run traced with the opentelemetry-sdk, exported as an instrumented agent would; its trace id."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "weather-svc"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    tracer = provider.get_tracer("weather-bot")
    with tracer.start_as_current_span("invoke_agent weather-bot") as root:
        root.set_attributes({"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather-bot"})
        for turn in range(2):
            with tracer.start_as_current_span("chat policy-v3") as chat:
                chat.set_attributes({
                    "gen_ai.operation.name": "chat", "gen_ai.request.model": "policy-v3",
                    "gen_ai.usage.input_tokens": 20 + turn, "gen_ai.usage.output_tokens": 5,
                    "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [
                        {"type": "text", "content": f"turn {turn}"}]}])})
            if turn == 0:
                with tracer.start_as_current_span("execute_tool weather") as tool:
                    tool.set_attributes({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "weather",
                                         "gen_ai.tool.call.arguments": '{"city": "rome"}',
                                         "gen_ai.tool.call.result": "sunny"})
        trace_id = format(root.get_span_context().trace_id, "032x")
    assert provider.force_flush(30_000), "the exporter did not flush"
    provider.shutdown()
    return trace_id


def test_spans_from_the_otel_exporter_reach_kafka_the_lake_and_the_gate(
        kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path) -> None:
    events_topic, outcomes_topic, dlq = new_topic("otlp-ev"), new_topic("otlp-out"), new_topic("otlp-dlq")
    port = _free_port()
    env = {**os.environ, "FLYWHEEL_SPOOL_DIR": str(tmp_path / "spool")}
    log_path = tmp_path / "receiver.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "otlp-receiver", "--port", str(port),
                                 "--kafka-bootstrap", kafka_bootstrap, "--events-topic", events_topic,
                                 "--heartbeat-s", "0"], stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.3)
        trace_id = _traced_agent_run(f"http://127.0.0.1:{port}/v1/traces")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
            health = json.loads(answer.read())
        assert health["exports"] >= 1 and (health["genai_spans"], health["traced_calls"], health["events"]) == (4, 2, 6)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log_path.read_text()[-3000:]

    events = [wire.as_lists(wire.decode(v)) for v in _consume(kafka_bootstrap, events_topic, 6)]
    for e in events:
        schema.validate_event(e)
    session = session_id_of(trace_id)
    assert len(events) == 6 and {e["session_id"] for e in events} == {session}
    assert sorted(e["type"] for e in events) == ["session_end", "session_start", "tool_call", "tool_result",
                                                 "traced_llm_call", "traced_llm_call"]
    calls = [e for e in events if e["type"] == "traced_llm_call"]
    assert [c["completion_text"] for c in sorted(calls, key=lambda c: c["ts"])] == ["turn 0", "turn 1"]

    reporter = OutcomeReporter(kafka_bootstrap, topic=outcomes_topic, name="otlp-test-o",
                               spool_dir=tmp_path / "spool-o")
    reporter.report(session, kind="task_success", value=1.0, source="verifier")
    assert reporter.flush(30)
    reporter.close()
    root = tmp_path / "lake"
    cfg = LakeWriterConfig(kafka_bootstrap=kafka_bootstrap, events_topic=events_topic, outcomes_topic=outcomes_topic,
                           dlq_topic=dlq, group_id=f"test-otlp-{uuid.uuid4().hex[:8]}", lake_root=str(root),
                           var_dir=str(tmp_path / "var"), roll_max_age_s=0.5, session_timeout_s=6,
                           status_interval_s=0.5)
    run_until(cfg, lambda: sum(lake.next_offsets(str(root), "events", events_topic).values()) == 6
              and sum(lake.next_offsets(str(root), "outcomes", outcomes_topic).values()) == 1, timeout_s=90)
    (record,) = read_sessions(str(root))
    assert (record.session_id, record.task_type, record.version, record.status, record.outcome, record.tokens) == \
        (session, "weather-bot", 3, "ok", 1.0, 20 + 21 + 5 + 5)
    assert record.tool_calls == 1 and record.ended is not None
