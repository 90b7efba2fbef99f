"""`flywheel otlp-receiver`: OpenTelemetry GenAI spans in, this project's events out, for agents already traced.

An agent instrumented with OpenTelemetry (the GenAI semantic conventions: model-call spans, `execute_tool` spans,
`invoke_agent` spans) points its OTLP/HTTP trace exporter here (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=
http://host:4318/v1/traces`); the receiver turns each export into session events on Kafka through the SDK (spool,
journal: nothing it acknowledged is lost), where the lake writer lands them like any other.

What a span gives and what it cannot (docs/ingest-sdk.md, "Agents traced with OpenTelemetry"):

* A model call becomes a `traced_llm_call` (schema v5): model, provider, token counts, finish reason, latency,
  sampling, the input and output messages as text, and the policy version when the span says it
  (`flywheel.policy_version`, or a served name `policy-v<N>`). A span has no token ids and no behaviour
  logprobs, so such calls never reach the policy gradient: the session feeds the lake and the gate (outcomes,
  versions, tokens), not the learner. A span that does carry them (`flywheel.prompt_token_ids`,
  `flywheel.completion_token_ids`, `flywheel.completion_logprobs`) and a version (as above) becomes a full
  `llm_call` and trains like a captured one.
* An `execute_tool` span becomes a `tool_call` at its start and a `tool_result` at its end (ok unless the span's
  status is ERROR).
* A session is one trace: `otel-<trace id in hex>` (report outcomes against that id). Its `session_start` and
  `session_end` come from the trace's root span (or, for a trace that came in from another service, the span
  whose parent is remote), once the trace has shown a GenAI span (the receiver remembers
  the last `remember_traces` such traces, so a root exported after its children still closes the session).
* Agents: the outermost `invoke_agent` span of a chain is the main agent; an `invoke_agent` span nested in it is
  one run of a sub-agent (`<gen_ai.agent.id>-<span id>`), with `subagent_spawn` / `subagent_finish` on its
  parent. The nesting is read within one export, so a sub-agent whose spans reach the receiver in another export
  than its own `invoke_agent` span is logged under the main agent.

Every event's id is derived from (trace, span, type), so an export the exporter sends again (a timeout, a retry)
is de-duplicated by the lake writer. Bodies: `application/x-protobuf` (needs the `otlp` extra,
opentelemetry-proto) or `application/json` (OTLP/JSON), optionally gzip. A body that does not decode gets 400
with the reason; the receiver goes on.

    flywheel otlp-receiver [--port 4318] [--kafka-bootstrap 127.0.0.1:9092]
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime as _dt
import gzip
import hashlib
import io
import json
import logging
import re
import sys
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

from flywheel.base import defaults
from flywheel.base.config import ConfigError, load_config, setting, setup_logging
from flywheel.ingest import schema
from flywheel.ingest.sdk import MAIN_AGENT, SessionLogger

log = logging.getLogger(__name__)

SESSION_PREFIX = "otel-"
INFERENCE_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})
TOOL_OPERATION = "execute_tool"
AGENT_OPERATION = "invoke_agent"
STATUS_ERROR = 2  # OTLP Status.StatusCode STATUS_CODE_ERROR
PARENT_IS_REMOTE = 0x300  # SpanFlags: CONTEXT_HAS_IS_REMOTE | CONTEXT_IS_REMOTE
_SERVED_NAME = re.compile(r"policy-v(\d+)$")
# gen_ai.request.* attributes that are sampling parameters, as the llm_call's `sampling` names them
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_tokens",
             "seed": "seed", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
             "stop_sequences": "stop"}


@dataclass
class OtlpReceiverConfig:
    """The OTLP/HTTP receiver: where it listens, where the events go."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(4318, "port to listen on (4318 is OTLP/HTTP's)")
    kafka_bootstrap: str = setting(defaults.KAFKA_BOOTSTRAP, "Kafka the events go to")
    events_topic: str = setting(schema.EVENTS_TOPIC, "topic of the events")
    remember_traces: int = setting(100_000, "traces with a GenAI span remembered, so a root span exported after its "
                                            "children still starts and ends the session")
    max_body_bytes: int = setting(16 * 1024 * 1024, "largest export body accepted (decompressed)")
    log_text: bool = setting(True, "log the input and output messages (redacted by the SDK) as prompt_text and "
                                   "completion_text")
    spool_name: str = setting("otlp-receiver", "name of the SDK's spill spool, stable so a restart replays it")
    journal: bool = setting(True, "journal each event before answering the export, so a SIGKILL loses nothing the "
                                  "receiver acknowledged")
    heartbeat_s: float = setting(5.0, "how often the status heartbeat (var/run/status/otlp-receiver.json) is "
                                      "written; 0: never")
    log_level: str = setting("INFO", "logging level")

    def check(self) -> None:
        if self.remember_traces < 1 or self.max_body_bytes < 1024:
            raise ConfigError(f"remember_traces ({self.remember_traces}) must be >= 1 and max_body_bytes "
                              f"({self.max_body_bytes}) >= 1024")


class ExportError(ValueError):
    """An export body that cannot be read; the message says why (the HTTP answer's 400 text)."""


# ---------------------------------------------------------------------------------------------
# Spans, from either encoding
# ---------------------------------------------------------------------------------------------
@dataclass
class Span:
    trace_id: str  # hex
    span_id: str  # hex
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    status_code: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    flags: int = 0  # OTLP SpanFlags: bits 8 and 9 say whether the parent is known and is remote

    @property
    def is_root(self) -> bool:
        """The top of this service's part of the trace: no parent, or a parent in another process (a trace that
        came in from an upstream service)."""
        return self.parent_span_id is None or self.flags & PARENT_IS_REMOTE == PARENT_IS_REMOTE

    @property
    def operation(self) -> str | None:
        op = self.attributes.get("gen_ai.operation.name")
        if isinstance(op, str):
            return op
        # conventions before gen_ai.operation.name (and OpenLLMetry): a call span names its system and model
        if ("gen_ai.system" in self.attributes and "gen_ai.request.model" in self.attributes
                and self.attributes.get("llm.request.type") in (None, "chat", "completion")):
            return "chat"
        return None


def _hex_id(value: Any, width: int) -> str:
    """A trace or span id as OTLP/JSON writes it (hex); base64, which some encoders write instead, is accepted."""
    if not isinstance(value, str) or not value:
        return ""
    text = value.strip()
    if len(text) == 2 * width and all(c in "0123456789abcdefABCDEF" for c in text):
        return text.lower()
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ExportError(f"id {text[:40]!r} is neither hex nor base64") from None
    if len(raw) != width:
        raise ExportError(f"id {text[:40]!r} is {len(raw)} bytes, expected {width}")
    return raw.hex()


def _json_value(value: Any) -> Any:
    """An OTLP/JSON AnyValue as a Python value."""
    if not isinstance(value, dict):
        return None
    for key, convert in (("stringValue", str), ("boolValue", bool), ("doubleValue", float)):
        if key in value:
            return convert(value[key])
    if "intValue" in value:
        return int(value["intValue"])  # int64 travels as a JSON string
    if "arrayValue" in value:
        return [_json_value(v) for v in (value["arrayValue"] or {}).get("values", [])]
    if "kvlistValue" in value:
        return _json_attributes((value["kvlistValue"] or {}).get("values", []))
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def _json_attributes(items: Any) -> dict[str, Any]:
    if not isinstance(items, list):
        return {}
    return {kv["key"]: _json_value(kv.get("value")) for kv in items if isinstance(kv, dict) and "key" in kv}


def _int(value: Any, what: str) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        raise ExportError(f"{what}: {str(value)[:40]!r} is not an integer") from None


def spans_from_json(body: Any) -> list[Span]:
    """The spans of an OTLP/JSON ExportTraceServiceRequest."""
    if not isinstance(body, dict):
        raise ExportError(f"the body is a JSON {type(body).__name__}, expected an ExportTraceServiceRequest object")
    spans: list[Span] = []
    for rs in body.get("resourceSpans") or []:
        if not isinstance(rs, dict):
            raise ExportError("a resourceSpans entry is not a JSON object")
        resource = _json_attributes((rs.get("resource") or {}).get("attributes"))
        for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []:
            for sp in (ss or {}).get("spans") or []:
                if not isinstance(sp, dict):
                    raise ExportError("a span is not a JSON object")
                status = sp.get("status") or {}
                code = status.get("code", 0)
                if isinstance(code, str):  # the enum's name is valid OTLP/JSON too
                    code = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}.get(code, 0)
                trace_id, span_id = _hex_id(sp.get("traceId"), 16), _hex_id(sp.get("spanId"), 8)
                if not trace_id or not span_id:
                    raise ExportError("a span without traceId or spanId")
                spans.append(Span(
                    trace_id, span_id, _hex_id(sp.get("parentSpanId"), 8) or None, str(sp.get("name", "")),
                    _int(sp.get("startTimeUnixNano"), "startTimeUnixNano"),
                    _int(sp.get("endTimeUnixNano"), "endTimeUnixNano"), _int(code, "status.code"),
                    _json_attributes(sp.get("attributes")), resource,
                    [(str(e.get("name", "")), _json_attributes(e.get("attributes")))
                     for e in sp.get("events") or [] if isinstance(e, dict)], _int(sp.get("flags"), "flags")))
    return spans


def _pb_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_pb_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _pb_attributes(value.kvlist_value.values)
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    return getattr(value, kind)


def _pb_attributes(items: Iterable[Any]) -> dict[str, Any]:
    return {kv.key: _pb_value(kv.value) for kv in items}


def spans_from_protobuf(data: bytes) -> list[Span]:
    """The spans of a binary ExportTraceServiceRequest (opentelemetry-proto: the `otlp` extra)."""
    try:
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    except ImportError:
        raise ExportError("application/x-protobuf needs opentelemetry-proto (pip install 'agent-flywheel[otlp]'); "
                          "or export OTLP/JSON") from None
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(data)
    except DecodeError as exc:
        raise ExportError(f"not an ExportTraceServiceRequest: {exc}") from None
    spans: list[Span] = []
    for rs in request.resource_spans:
        resource = _pb_attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for sp in ss.spans:
                if len(sp.trace_id) != 16 or len(sp.span_id) != 8:
                    raise ExportError("a span without a 16-byte trace_id or an 8-byte span_id")
                spans.append(Span(
                    sp.trace_id.hex(), sp.span_id.hex(), sp.parent_span_id.hex() or None, sp.name,
                    sp.start_time_unix_nano, sp.end_time_unix_nano, sp.status.code, _pb_attributes(sp.attributes),
                    resource, [(e.name, _pb_attributes(e.attributes)) for e in sp.events], sp.flags))
    return spans


def decode_body(body: bytes, content_type: str, content_encoding: str, max_bytes: int) -> tuple[list[Span], bool]:
    """(spans, is_protobuf) of an export request body; ExportError with the reason when it cannot be read."""
    encoding = (content_encoding or "").strip().lower()
    if encoding == "gzip":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(body)) as f:
                body = f.read(max_bytes + 1)
        except (OSError, EOFError, zlib.error) as exc:
            raise ExportError(f"Content-Encoding gzip, but the body does not decompress: {exc}") from None
    elif encoding not in ("", "identity"):
        raise ExportError(f"Content-Encoding {encoding!r} is not supported (gzip or none)")
    if len(body) > max_bytes:
        raise ExportError(f"the body is over {max_bytes} bytes")
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind == "application/x-protobuf":
        return spans_from_protobuf(body), True
    if kind == "application/json":
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ExportError(f"the body is not JSON: {exc}") from None
        return spans_from_json(parsed), False
    raise ExportError(f"Content-Type {kind or '(none)'!r}: send application/x-protobuf or application/json")


# ---------------------------------------------------------------------------------------------
# Spans -> events
# ---------------------------------------------------------------------------------------------
@dataclass
class Event:
    """One event to log: the SDK session it goes to (session, agent, parent agent) and what it holds."""

    session_id: str
    agent_id: str
    parent_agent_id: str | None
    type: str
    fields: dict[str, Any]
    ts: str
    event_id: str


@dataclass
class Converted:
    events: list[Event] = field(default_factory=list)
    genai_spans: int = 0
    ignored_spans: int = 0  # neither GenAI nor the root of a GenAI trace
    traced_calls: int = 0
    full_calls: int = 0  # spans that carried token ids, logprobs and a version


def _ts(ns: int) -> str:
    moment = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc) + _dt.timedelta(microseconds=ns // 1000)
    return moment.isoformat(timespec="microseconds")


def _event_id(span: Span, etype: str) -> str:
    return hashlib.sha256(f"{span.trace_id}/{span.span_id}/{etype}".encode()).hexdigest()[:32]


def session_id_of(trace_id_hex: str) -> str:
    """The session a trace is logged as: report its outcomes against this id."""
    return SESSION_PREFIX + trace_id_hex


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), default=str)


def _messages(value: Any) -> list[Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    return value if isinstance(value, list) else []


def completion_text(attributes: dict[str, Any], events: list[tuple[str, dict[str, Any]]]) -> str | None:
    """What the model answered, as text: the first output message's text parts, its tool calls as JSON lines.

    gen_ai.output.messages (current conventions), else OpenLLMetry's gen_ai.completion.0.content, else the older
    gen_ai.content.completion span event."""
    out = attributes.get("gen_ai.output.messages")
    if out is not None:
        messages = _messages(out)
        if not messages:
            return _text(out)
        first = messages[0] if isinstance(messages[0], dict) else {}
        pieces = []
        for part in first.get("parts") or []:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "text":
                pieces.append(str(part.get("content", "")))
            elif part.get("type") == "tool_call":
                pieces.append(json.dumps({"tool_call": {"name": part.get("name"), "arguments": part.get("arguments")}},
                                         separators=(",", ":"), default=str))
        return "\n".join(pieces)
    if "gen_ai.completion.0.content" in attributes:
        return _text(attributes["gen_ai.completion.0.content"])
    for name, attrs in events:
        if name == "gen_ai.content.completion" and "gen_ai.completion" in attrs:
            return _text(attrs["gen_ai.completion"])
    return None


def prompt_text(attributes: dict[str, Any], events: list[tuple[str, dict[str, Any]]]) -> str | None:
    """The input messages as JSON text (system instructions first when recorded apart)."""
    messages = attributes.get("gen_ai.input.messages")
    if messages is not None:
        system = attributes.get("gen_ai.system_instructions")
        if system is None:
            return _text(messages)
        return _text({"system_instructions": _messages(system) or system, "messages": _messages(messages) or messages})
    legacy = []
    i = 0
    while f"gen_ai.prompt.{i}.content" in attributes or f"gen_ai.prompt.{i}.role" in attributes:
        legacy.append({"role": attributes.get(f"gen_ai.prompt.{i}.role"),
                       "content": attributes.get(f"gen_ai.prompt.{i}.content")})
        i += 1
    if legacy:
        return _text(legacy)
    for name, attrs in events:
        if name == "gen_ai.content.prompt" and "gen_ai.prompt" in attrs:
            return _text(attrs["gen_ai.prompt"])
    return None


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else (None if isinstance(value, list) else value)


def _policy_version(attributes: dict[str, Any], model: str) -> int | None:
    version = attributes.get("flywheel.policy_version")
    if isinstance(version, int) and not isinstance(version, bool):
        return version
    served = _SERVED_NAME.search(model or "")
    return int(served.group(1)) if served else None


class Converter:
    """Turns spans into events; remembers which traces showed a GenAI span (bounded), so a root span that arrives
    in a later export than its children still opens and closes its session."""

    def __init__(self, remember_traces: int = 100_000, log_text: bool = True) -> None:
        self.remember = remember_traces
        self.log_text = log_text
        self._traces: OrderedDict[str, str] = OrderedDict()  # trace id -> task type seen in it

    def _note_trace(self, trace_id: str, task_type: str | None) -> None:
        known = self._traces.pop(trace_id, None)
        self._traces[trace_id] = task_type or known or ""
        while len(self._traces) > self.remember:
            self._traces.popitem(last=False)

    def convert(self, spans: list[Span]) -> Converted:
        out = Converted()
        by_id = {(s.trace_id, s.span_id): s for s in spans}
        for s in spans:  # traces with a GenAI span in this export, and the task type their agent spans name
            if s.operation is not None:
                self._note_trace(s.trace_id, _task_type(s) if s.operation == AGENT_OPERATION else None)
        for s in sorted(spans, key=lambda x: (x.start_ns, x.end_ns)):
            op = s.operation
            if s.is_root and s.trace_id in self._traces:
                out.events.extend(self._session_bounds(s))
            if op is None:
                if not s.is_root or s.trace_id not in self._traces:
                    out.ignored_spans += 1
                continue
            out.genai_spans += 1
            agent, parent = _agent_of(s, by_id)
            if op in INFERENCE_OPERATIONS:
                event = self._model_call(s, agent, parent)
                out.events.append(event)
                out.full_calls += event.type == "llm_call"
                out.traced_calls += event.type == "traced_llm_call"
            elif op == TOOL_OPERATION:
                out.events.extend(_tool(s, agent, parent))
            elif op == AGENT_OPERATION and parent is not None:  # a sub-agent: spawned and finished by its parent
                sid = session_id_of(s.trace_id)
                grand = _agent_of_parent(s, by_id)
                subtask = s.attributes.get("gen_ai.agent.description") or s.attributes.get("gen_ai.agent.name")
                out.events.append(Event(sid, parent, grand, "subagent_spawn",
                                        {"child_agent_id": agent, "subtask": _text(subtask)}, _ts(s.start_ns),
                                        _event_id(s, "subagent_spawn")))
                out.events.append(Event(sid, parent, grand, "subagent_finish",
                                        {"child_agent_id": agent, "ok": s.status_code != STATUS_ERROR},
                                        _ts(s.end_ns), _event_id(s, "subagent_finish")))
        return out

    def _session_bounds(self, root: Span) -> list[Event]:
        sid = session_id_of(root.trace_id)
        task = _task_type(root) or self._traces.get(root.trace_id) or _text(root.resource.get("service.name"))
        tags = {"source": "otlp", "trace_id": root.trace_id}
        for key, attr in (("service", "service.name"), ("conversation_id", "gen_ai.conversation.id")):
            value = root.attributes.get(attr, root.resource.get(attr))
            if value is not None:
                tags[key] = _text(value) or ""
        status = "error" if root.status_code == STATUS_ERROR else "ok"
        return [Event(sid, MAIN_AGENT, None, "session_start", {"task_type": task or "unknown", "tags": tags},
                      _ts(root.start_ns), _event_id(root, "session_start")),
                Event(sid, MAIN_AGENT, None, "session_end", {"status": status}, _ts(root.end_ns),
                      _event_id(root, "session_end"))]

    def _model_call(self, s: Span, agent: str, parent: str | None) -> Event:
        a = s.attributes
        model = _text(a.get("gen_ai.response.model") or a.get("gen_ai.request.model")) or "unknown"
        version = _policy_version(a, model)
        sampling = {name: a[f"gen_ai.request.{key}"] for key, name in _SAMPLING.items()
                    if a.get(f"gen_ai.request.{key}") is not None}
        common = {"model": model, "finish_reason": _text(_first(a.get("gen_ai.response.finish_reasons"))),
                  "latency_s": max(0.0, (s.end_ns - s.start_ns) / 1e9), "sampling": sampling or None,
                  "request_id": _text(a.get("gen_ai.response.id")), "arm": _text(a.get("flywheel.arm")),
                  "completion_text": completion_text(a, s.events) if self.log_text else None,
                  "prompt_text": prompt_text(a, s.events) if self.log_text else None}
        prompt_ids, completion_ids, logprobs = (a.get(f"flywheel.{k}") for k in (
            "prompt_token_ids", "completion_token_ids", "completion_logprobs"))
        sid = session_id_of(s.trace_id)
        if (version is not None and isinstance(prompt_ids, list) and isinstance(completion_ids, list)
                and isinstance(logprobs, list) and completion_ids):
            fields = {**common, "policy_version": version, "prompt_token_ids": prompt_ids,
                      "completion_token_ids": completion_ids, "completion_logprobs": [float(x) for x in logprobs]}
            return Event(sid, agent, parent, "llm_call", fields, _ts(s.start_ns), _event_id(s, "llm_call"))
        usage = {k: a.get(f"gen_ai.usage.{k}", a.get(f"gen_ai.usage.{legacy}"))
                 for k, legacy in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens"))}
        fields = {**common, "policy_version": version,
                  "provider": _text(a.get("gen_ai.provider.name") or a.get("gen_ai.system")),
                  "input_tokens": usage["input_tokens"] if isinstance(usage["input_tokens"], int) else None,
                  "output_tokens": usage["output_tokens"] if isinstance(usage["output_tokens"], int) else None,
                  "trace_id": s.trace_id, "span_id": s.span_id}
        return Event(sid, agent, parent, "traced_llm_call", fields, _ts(s.start_ns), _event_id(s, "traced_llm_call"))


def _task_type(s: Span) -> str | None:
    return _text(s.attributes.get("flywheel.task_type") or s.attributes.get("gen_ai.agent.name"))


def _agent_chain(s: Span, by_id: dict[tuple[str, str], Span]) -> list[Span]:
    """The invoke_agent spans above s (and s itself when it is one) in this export, innermost first."""
    chain: list[Span] = []
    cur: Span | None = s
    seen: set[str] = set()
    while cur is not None and cur.span_id not in seen:
        seen.add(cur.span_id)
        if cur.operation == AGENT_OPERATION:
            chain.append(cur)
        cur = by_id.get((cur.trace_id, cur.parent_span_id)) if cur.parent_span_id else None
    return chain


def _agent_name(chain: list[Span], i: int) -> str:
    """The agent id of chain[i]: the outermost agent is the main agent; a nested one is one run of an agent,
    `<gen_ai.agent.id>-<span id>` (the convention's id names the agent, not the run: two runs must not merge)."""
    if i == len(chain) - 1:
        return MAIN_AGENT
    span = chain[i]
    return f"{_text(span.attributes.get('gen_ai.agent.id')) or 'agent'}-{span.span_id}"


def _agent_of(s: Span, by_id: dict[tuple[str, str], Span]) -> tuple[str, str | None]:
    """(agent_id, parent_agent_id) of the agent s belongs to (s itself, for an invoke_agent span)."""
    chain = _agent_chain(s, by_id)
    if len(chain) <= 1:
        return MAIN_AGENT, None
    return _agent_name(chain, 0), _agent_name(chain, 1)


def _agent_of_parent(s: Span, by_id: dict[tuple[str, str], Span]) -> str | None:
    """The parent_agent_id of the agent that spawned s (an invoke_agent span): None when that is the main one."""
    chain = _agent_chain(s, by_id)
    return _agent_name(chain, 2) if len(chain) > 2 else None


def _tool(s: Span, agent: str, parent: str | None) -> list[Event]:
    a = s.attributes
    sid, name = session_id_of(s.trace_id), _text(a.get("gen_ai.tool.name")) or s.name or "unknown"
    call_id = _text(a.get("gen_ai.tool.call.id")) or s.span_id
    arguments = a.get("gen_ai.tool.call.arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # kept as the string the span gave
    result = a.get("gen_ai.tool.call.result")
    return [Event(sid, agent, parent, "tool_call", {"call_id": call_id, "name": name, "arguments": arguments},
                  _ts(s.start_ns), _event_id(s, "tool_call")),
            Event(sid, agent, parent, "tool_result", {"call_id": call_id, "name": name,
                                                      "ok": s.status_code != STATUS_ERROR, "output": _text(result)},
                  _ts(s.end_ns), _event_id(s, "tool_result"))]


# ---------------------------------------------------------------------------------------------
# The process
# ---------------------------------------------------------------------------------------------
class Receiver:
    """POST /v1/traces -> events through a SessionLogger; GET /health; counters for the heartbeat."""

    def __init__(self, cfg: OtlpReceiverConfig, logger: SessionLogger) -> None:
        self.cfg = cfg
        self.logger = logger
        self.converter = Converter(cfg.remember_traces, cfg.log_text)
        self.counters = {"exports": 0, "bad_exports": 0, "spans": 0, "rejected_spans": 0, "genai_spans": 0,
                         "ignored_spans": 0,
                         "events": 0, "traced_calls": 0, "full_calls": 0}

    def ingest(self, spans: list[Span]) -> Converted:
        done = self.converter.convert(spans)
        for e in done.events:
            self.logger.attach(e.session_id, e.agent_id, e.parent_agent_id).record(e.type, e.fields, ts=e.ts,
                                                                                    event_id=e.event_id)
        c = self.counters
        c["exports"] += 1
        c["spans"] += len(spans)
        c["genai_spans"] += done.genai_spans
        c["ignored_spans"] += done.ignored_spans
        c["events"] += len(done.events)
        c["traced_calls"] += done.traced_calls
        c["full_calls"] += done.full_calls
        return done

    async def traces(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.read()  # aiohttp has already undone a gzip Content-Encoding (its size capped too)
        try:
            spans, protobuf = decode_body(body, request.headers.get("Content-Type", ""), "", self.cfg.max_body_bytes)
            # a span without a start time (an event at 1970, which the SDK drops after the export was answered) or
            # ending before it is refused alone
            timed = [x for x in spans if 0 < x.start_ns <= x.end_ns]
            timeless = len(spans) - len(timed)
            self.ingest(timed)
        except (ExportError, ValueError, TypeError, AttributeError) as exc:  # a value of the wrong type: the body's
            self.counters["bad_exports"] += 1
            log.warning("otlp-receiver: export refused: %s", exc)
            return web.json_response({"error": f"{type(exc).__name__}: {exc}" if not isinstance(exc, ExportError)
                                      else str(exc)}, status=400)
        self.counters["rejected_spans"] += timeless
        message = f"{timeless} span(s) without a start time, or ending before it" if timeless else ""
        # ExportTraceServiceResponse: empty when everything was taken (spans that are not GenAI are not errors),
        # partial_success naming what was not
        if protobuf:
            return web.Response(body=_pb_response(timeless, message), content_type="application/x-protobuf")
        return web.json_response({"partialSuccess": {"rejectedSpans": str(timeless), "errorMessage": message}}
                                 if timeless else {})

    async def health(self, _request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"ok": True, **self.counters})

    async def heartbeat(self) -> None:
        from flywheel.base.heartbeat import write_status

        while self.cfg.heartbeat_s > 0:
            sdk = self.logger.metrics()
            write_status("otlp-receiver", {**self.counters, "sent": sdk.get("sent"),
                                           "spool_records": sdk.get("spool_records"),
                                           "broker_down": sdk.get("broker_down")})
            await asyncio.sleep(self.cfg.heartbeat_s)


def _pb_response(rejected: int, message: str) -> bytes:
    if not rejected:
        return b""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    response = ExportTraceServiceResponse()
    response.partial_success.rejected_spans = rejected
    response.partial_success.error_message = message
    return response.SerializeToString()


def make_app(receiver: Receiver) -> Any:
    from aiohttp import web

    app = web.Application(client_max_size=receiver.cfg.max_body_bytes)
    app.router.add_post("/v1/traces", receiver.traces)
    app.router.add_get("/health", receiver.health)

    async def on_startup(_app: Any) -> None:
        _app["tasks"] = [asyncio.get_running_loop().create_task(receiver.heartbeat())]

    async def on_cleanup(_app: Any) -> None:
        for task in _app["tasks"]:
            task.cancel()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def run(cfg: OtlpReceiverConfig) -> int:
    from aiohttp import web

    from flywheel.ingest.sdk_spools import default_journal_dir

    journal = default_journal_dir(cfg.spool_name, cfg.events_topic) if cfg.journal else None
    logger = SessionLogger(cfg.kafka_bootstrap, topic=cfg.events_topic, name=cfg.spool_name, journal_dir=journal)
    receiver = Receiver(cfg, logger)
    log.info("otlp-receiver: listening on http://%s:%d/v1/traces, events to %s on %s", cfg.host, cfg.port,
             cfg.events_topic, cfg.kafka_bootstrap)
    try:
        web.run_app(make_app(receiver), host=cfg.host, port=cfg.port, print=None, access_log=None)
    finally:
        logger.close(timeout=10)
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(OtlpReceiverConfig, argv, prog="flywheel otlp-receiver")
    setup_logging(cfg.log_level)
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
