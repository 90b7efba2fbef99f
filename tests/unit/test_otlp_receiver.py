"""The OTLP receiver: OpenTelemetry GenAI spans, made by the real opentelemetry-sdk and encoded as its OTLP
exporter encodes them, become this project's events; bad bodies get a reason. The same with Kafka and the lake:
tests/integration/test_otlp_receiver_kafka.py."""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from flywheel.ingest import otlp_receiver as otlp
from flywheel.ingest import schema, wire
from flywheel.ingest.sdk import SessionLogger
from flywheel.ingest.spool import Spool
from tests.unit.test_sdk import _closed_port

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import Status, StatusCode  # noqa: E402

OUTPUT = [{"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "weather",
                                           "arguments": {"city": "paris"}}], "finish_reason": "tool_calls"}]
INPUT = [{"role": "user", "parts": [{"type": "text", "content": "weather in paris?"}]}]


def _agent_run(tracer: Any, *, with_ids: bool = False) -> None:
    """One agent run as an instrumented agent traces it: an invoke_agent root, a model call, a tool, a sub-agent."""
    with tracer.start_as_current_span("invoke_agent weather-bot") as root:
        root.set_attributes({"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather-bot",
                             "gen_ai.conversation.id": "conv-7"})
        with tracer.start_as_current_span("chat policy-v3") as chat:
            chat.set_attributes({
                "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": "policy-v3",
                "gen_ai.response.model": "policy-v3", "gen_ai.request.temperature": 1.0,
                "gen_ai.request.max_tokens": 64, "gen_ai.usage.input_tokens": 21, "gen_ai.usage.output_tokens": 9,
                "gen_ai.response.finish_reasons": ["tool_calls"], "gen_ai.response.id": "chatcmpl-1",
                "gen_ai.input.messages": json.dumps(INPUT), "gen_ai.output.messages": json.dumps(OUTPUT)})
            if with_ids:
                chat.set_attributes({"flywheel.prompt_token_ids": [1, 2, 3], "flywheel.completion_token_ids": [4, 5],
                                     "flywheel.completion_logprobs": [-0.5, -0.25], "flywheel.policy_version": 3})
        with tracer.start_as_current_span("execute_tool weather") as tool:
            tool.set_attributes({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "weather",
                                 "gen_ai.tool.call.id": "c1", "gen_ai.tool.call.arguments": '{"city": "paris"}',
                                 "gen_ai.tool.call.result": "sunny"})
        with tracer.start_as_current_span("invoke_agent checker") as sub:
            sub.set_attributes({"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.id": "checker",
                                "gen_ai.agent.description": "check the answer"})
            with tracer.start_as_current_span("chat gpt-x") as inner:
                inner.set_attributes({"gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-x"})
                inner.set_status(Status(StatusCode.ERROR, "rate limited"))
            sub.set_status(Status(StatusCode.ERROR))


@pytest.fixture
def traced() -> Iterator[tuple[Any, InMemorySpanExporter]]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "weather-svc"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield provider.get_tracer("test"), memory
    provider.shutdown()


def _pb(spans: Any) -> bytes:
    return encode_spans(spans).SerializeToString()


def _records(events: list[otlp.Event]) -> list[dict]:
    """The events as the SDK would send them (what the lake writer validates)."""
    out = []
    for i, e in enumerate(events):
        record = {"schema_version": schema.SCHEMA_VERSION, "event_id": e.event_id, "session_id": e.session_id,
                  "agent_id": e.agent_id, "parent_agent_id": e.parent_agent_id, "seq": i, "ts": e.ts, "type": e.type,
                  **{k: v for k, v in e.fields.items() if v is not None}}
        if record["parent_agent_id"] is None:
            del record["parent_agent_id"]
        out.append(schema.validate_event(record))
    return out


def test_an_agent_trace_becomes_one_session_with_calls_tools_and_a_sub_agent(traced: Any) -> None:
    tracer, memory = traced
    _agent_run(tracer)
    spans, protobuf = otlp.decode_body(_pb(memory.get_finished_spans()), "application/x-protobuf", "", 1 << 20)
    assert protobuf and len(spans) == 5
    done = otlp.Converter().convert(spans)
    records = _records(done.events)
    trace_id = spans[0].trace_id
    assert {r["session_id"] for r in records} == {otlp.session_id_of(trace_id)}
    by_type: dict[str, list[dict]] = {}
    for r in records:
        by_type.setdefault(r["type"], []).append(r)
    assert sorted(by_type) == ["session_end", "session_start", "subagent_finish", "subagent_spawn", "tool_call",
                               "tool_result", "traced_llm_call"]
    start = by_type["session_start"][0]
    assert start["task_type"] == "weather-bot"
    assert start["tags"] == {"source": "otlp", "trace_id": trace_id, "service": "weather-svc",
                             "conversation_id": "conv-7"}
    assert by_type["session_end"][0]["status"] == "ok"
    call, inner = by_type["traced_llm_call"]
    assert (call["agent_id"], call["model"], call["policy_version"], call["provider"]) == \
        ("main", "policy-v3", 3, "openai")
    assert (call["input_tokens"], call["output_tokens"], call["finish_reason"], call["request_id"]) == \
        (21, 9, "tool_calls", "chatcmpl-1")
    assert call["sampling"] == {"temperature": 1.0, "max_tokens": 64}
    assert json.loads(call["prompt_text"]) == INPUT
    assert json.loads(call["completion_text"]) == {"tool_call": {"name": "weather", "arguments": {"city": "paris"}}}
    assert call["latency_s"] >= 0 and (call["trace_id"], len(call["span_id"])) == (trace_id, 16)
    # the sub-agent's call is its own (one run of the agent "checker"), with no version (gpt-x is not a served name)
    sub_span = next(x for x in spans if x.name == "invoke_agent checker")
    run = f"checker-{sub_span.span_id}"
    assert (inner["agent_id"], inner["parent_agent_id"], inner["model"]) == (run, "main", "gpt-x")
    assert "policy_version" not in inner
    spawn, finish = by_type["subagent_spawn"][0], by_type["subagent_finish"][0]
    assert (spawn["agent_id"], spawn["child_agent_id"], spawn["subtask"]) == ("main", run, "check the answer")
    assert (finish["child_agent_id"], finish["ok"]) == (run, False)
    tool_call, result = by_type["tool_call"][0], by_type["tool_result"][0]
    assert (tool_call["call_id"], tool_call["name"], tool_call["arguments"]) == ("c1", "weather", {"city": "paris"})
    assert (result["call_id"], result["ok"], result["output"]) == ("c1", True, "sunny")
    # times are the spans': the session starts first and ends last
    assert start["ts"] == min(r["ts"] for r in records) and by_type["session_end"][0]["ts"] == max(r["ts"] for r in records)
    assert (done.genai_spans, done.traced_calls, done.full_calls, done.ignored_spans) == (5, 2, 0, 0)


def test_event_ids_are_stable_so_a_re_sent_export_is_a_duplicate(traced: Any) -> None:
    tracer, memory = traced
    _agent_run(tracer)
    body = _pb(memory.get_finished_spans())
    first = otlp.Converter().convert(otlp.decode_body(body, "application/x-protobuf", "", 1 << 20)[0])
    again = otlp.Converter().convert(otlp.decode_body(body, "application/x-protobuf", "", 1 << 20)[0])
    assert [e.event_id for e in first.events] == [e.event_id for e in again.events]
    assert len({e.event_id for e in first.events}) == len(first.events)


def test_a_span_with_token_ids_logprobs_and_a_version_is_a_full_llm_call(traced: Any) -> None:
    tracer, memory = traced
    _agent_run(tracer, with_ids=True)
    done = otlp.Converter().convert(otlp.decode_body(_pb(memory.get_finished_spans()), "application/x-protobuf", "",
                                                     1 << 20)[0])
    full = [r for r in _records(done.events) if r["type"] == "llm_call"]
    assert len(full) == 1 and done.full_calls == 1
    assert (full[0]["prompt_token_ids"], full[0]["completion_token_ids"], full[0]["completion_logprobs"],
            full[0]["policy_version"]) == ([1, 2, 3], [4, 5], [-0.5, -0.25], 3)


def test_a_root_exported_after_its_children_still_opens_and_closes_the_session(traced: Any) -> None:
    tracer, memory = traced
    _agent_run(tracer)
    spans = otlp.decode_body(_pb(memory.get_finished_spans()), "application/x-protobuf", "", 1 << 20)[0]
    root = [s for s in spans if s.parent_span_id is None]
    children = [s for s in spans if s.parent_span_id is not None]
    conv = otlp.Converter()
    early = conv.convert(children)
    assert "session_start" not in {e.type for e in early.events}
    late = conv.convert(root)
    assert [e.type for e in late.events] == ["session_start", "session_end"]
    # a trace with no GenAI span is not a session: its root is ignored
    memory.clear()
    with tracer.start_as_current_span("GET /health"):
        pass
    plain = conv.convert(otlp.decode_body(_pb(memory.get_finished_spans()), "application/x-protobuf", "", 1 << 20)[0])
    assert plain.events == [] and plain.ignored_spans == 1


def test_otlp_json_with_hex_ids_string_ints_and_gzip() -> None:
    trace, span = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    body = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "bot"}}]},
                               "scopeSpans": [{"spans": [{
                                   "traceId": trace, "spanId": span, "name": "chat m",
                                   "startTimeUnixNano": "1796400000000000000", "endTimeUnixNano": "1796400001500000000",
                                   "status": {"code": "STATUS_CODE_ERROR"},
                                   "attributes": [
                                       {"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}},
                                       {"key": "gen_ai.request.model", "value": {"stringValue": "m"}},
                                       {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "12"}},
                                       {"key": "gen_ai.response.finish_reasons",
                                        "value": {"arrayValue": {"values": [{"stringValue": "length"}]}}}]}]}]}]}
    raw = gzip.compress(json.dumps(body).encode())
    spans, protobuf = otlp.decode_body(raw, "application/json; charset=utf-8", "gzip", 1 << 20)
    assert not protobuf and (spans[0].trace_id, spans[0].span_id, spans[0].status_code) == (trace, span, 2)
    records = _records(otlp.Converter().convert(spans).events)
    assert [r["type"] for r in records] == ["session_start", "session_end", "traced_llm_call"]
    call = records[2]
    assert (call["input_tokens"], call["finish_reason"], call["latency_s"]) == (12, "length", 1.5)
    assert call["ts"] == "2026-12-04T16:00:00.000000+00:00"
    assert records[0]["task_type"] == "bot" and records[1]["status"] == "error"


def test_a_trace_that_came_in_from_another_service_is_a_session_from_its_remote_parented_span() -> None:
    trace = "5b8efff798038103d269b633813fc60c"
    span = {"traceId": trace, "spanId": "eee19b7ec3c1b174", "parentSpanId": "0102030405060708", "flags": 0x301,
            "name": "invoke_agent a", "startTimeUnixNano": "1796400000000000000",
            "endTimeUnixNano": "1796400002000000000",
            "attributes": [{"key": "gen_ai.operation.name", "value": {"stringValue": "invoke_agent"}},
                           {"key": "gen_ai.agent.name", "value": {"stringValue": "planner"}}]}
    spans, _ = otlp.decode_body(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode(),
                                "application/json", "", 1 << 20)
    records = _records(otlp.Converter().convert(spans).events)
    assert [(r["type"], r.get("task_type")) for r in records] == [("session_start", "planner"), ("session_end", None)]


@pytest.mark.parametrize(("body", "ctype", "encoding", "reason"), [
    (b"{}", "text/plain", "", "Content-Type 'text/plain'"),
    (b"{not json", "application/json", "", "not JSON"),
    (b"[1]", "application/json", "", "expected an ExportTraceServiceRequest"),
    (b"\x00\x01", "application/json", "gzip", "does not decompress"),
    (b"{}", "application/json", "br", "Content-Encoding 'br'"),
    (b"\xff\xff\xff", "application/x-protobuf", "", "not an ExportTraceServiceRequest"),
    (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "spanId": "ab"}]}]}]}).encode(),
     "application/json", "", "neither hex nor base64"),
    (b"{" + b" " * 5000 + b"}", "application/json", "", "over 1024 bytes"),
    (json.dumps({"resourceSpans": [None]}).encode(), "application/json", "", "not a JSON object"),
])
def test_bad_bodies_get_a_reason(body: bytes, ctype: str, encoding: str, reason: str) -> None:
    with pytest.raises(otlp.ExportError, match=reason):
        otlp.decode_body(body, ctype, encoding, 1024)


def test_the_receiver_takes_the_sdk_exporters_posts_and_logs_valid_events(traced: Any, tmp_path: Path) -> None:
    """The opentelemetry-sdk's own OTLP/HTTP exporter posts to the receiver process's app; with no broker the
    events land in the SDK's spool, valid, once each even when the exporter sends the export twice."""
    import asyncio

    from aiohttp import web
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    dead = f"127.0.0.1:{_closed_port()}"  # no broker there
    logger = SessionLogger(dead, name="otlp-test", spool_dir=tmp_path / "spool", retry_s=0.2, linger_s=0.01)
    cfg = otlp.OtlpReceiverConfig(port=_closed_port(), heartbeat_s=0, journal=False)
    receiver = otlp.Receiver(cfg, logger)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(otlp.make_app(receiver))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", cfg.port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        tracer, memory = traced
        _agent_run(tracer)
        from opentelemetry.exporter.otlp.proto.http import Compression

        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{cfg.port}/v1/traces")
        assert exporter.export(memory.get_finished_spans()) == SpanExportResult.SUCCESS
        zipped = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{cfg.port}/v1/traces", compression=Compression.Gzip)
        assert zipped.export(memory.get_finished_spans()) == SpanExportResult.SUCCESS  # sent again, gzip this time
        exporter.shutdown()
        zipped.shutdown()
        import urllib.request

        typed = {"resourceSpans": [{"scopeSpans": [{"spans": [{
            "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "startTimeUnixNano": "1",
            "endTimeUnixNano": "2", "attributes": [{"key": "gen_ai.usage.input_tokens", "value": {"intValue": "x"}}]}]}]}]}
        wrong = urllib.request.Request(f"http://127.0.0.1:{cfg.port}/v1/traces", data=json.dumps(typed).encode(),
                                       method="POST", headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused_type:
            urllib.request.urlopen(wrong, timeout=10)
        assert refused_type.value.code == 400, "a value of the wrong type is the body's fault, not a 500"
        timeless = {"resourceSpans": [{"scopeSpans": [{"spans": [{
            "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "chat m",
            "attributes": [{"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}}]}]}]}]}
        partial = urllib.request.Request(f"http://127.0.0.1:{cfg.port}/v1/traces", data=json.dumps(timeless).encode(),
                                         method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(partial, timeout=10) as answer:
            assert json.loads(answer.read())["partialSuccess"]["rejectedSpans"] == "1"

        bad = urllib.request.Request(f"http://127.0.0.1:{cfg.port}/v1/traces", data=b"{", method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad, timeout=10)
        assert refused.value.code == 400 and "not JSON" in refused.value.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{cfg.port}/health", timeout=10) as answer:
            health = json.loads(answer.read())
        assert (health["exports"], health["bad_exports"], health["genai_spans"], health["events"]) == (3, 2, 10, 16)
        assert health["rejected_spans"] == 1
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        logger.close(timeout=5)
    spool = Spool(tmp_path / "spool")
    records = [wire.as_lists(wire.decode(r)) for r in spool.peek(1_000_000)]
    spool.close()
    for r in records:
        schema.validate_event(r)
    assert len(records) == 16 and len({r["event_id"] for r in records}) == 8, "sent twice, the same eight ids"
    traced_calls = [r for r in records if r["type"] == "traced_llm_call"]
    assert {r["schema_version"] for r in traced_calls} == {5}, "a traced call needs v5; the rest travel as before"
    assert {r["schema_version"] for r in records if r["type"] != "traced_llm_call"} == {3}
