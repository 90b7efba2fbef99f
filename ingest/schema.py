"""The one definition of every record that crosses a process boundary.

Events (what a production agent did), outcomes (what happened afterwards) and episodes
(what the learner trains on) are each declared once here as a tuple of `Col`s. From that
one declaration come:

* validation of a decoded JSON record (`validate_event`, `validate_outcome`), with an error
  that names the field and the problem, used by the lake writer before anything lands;
* the Arrow schema of the lake tables (`EVENT_ARROW_SCHEMA` ...), built lazily so that the
  SDK's import path never imports pyarrow.

Evolution rule. `schema_version` is carried on every event and outcome. Within one version
the set of fields is closed: an unknown field is an error (it would otherwise be silently
lost in the lake). A new version may only ADD optional fields or event types, never
remove, rename or retype one, so the lake tables of all versions union into one schema
(missing columns read as null). Readers accept every version in SUPPORTED_SCHEMA_VERSIONS;
a record of any other version goes to the dead-letter topic, never half-parsed.

Versions: v1 the first; v2 adds an outcome's `call_id`; v3 changes only how the `ints` and
`floats` fields (PACKED_FIELDS: token ids, logprobs) may travel, as base64 of little-endian
int32 / float32 inside the same JSON object (ingest/wire.py encodes and decodes it; a JSON list
stays valid, so v3 only adds an encoding). Their
lake columns keep their types (list<int32>, list<float32>), so the rule holds where it
matters, in the lake: a v3 row is a v1 row. Base64 in JSON was measured against a binary
envelope on `flywheel bench ingest` (docs/lake.md, "Ingest throughput") and chosen because
it kept within a few percent of it while every record stays JSON for every tool that reads
one. A decoded v3 record holds such a field as a memoryview of its items, which validation
accepts beside the JSON list of v1 and v2. v4 adds a tool_call's `malformed_token`. v5 adds the event type
`traced_llm_call`: a model call known only from a trace (an OpenTelemetry GenAI span, ingest/otlp_receiver.py),
with its text and token counts but without token ids or behaviour logprobs.

This module imports only the standard library: it is on the SDK's hot import path.
"""

from __future__ import annotations

import array
import datetime as _dt
import math
import reprlib
import sys
from dataclasses import dataclass
from typing import Any, Mapping

SCHEMA_VERSION = 5
SUPPORTED_SCHEMA_VERSIONS = frozenset({1, 2, 3, 4, 5})
# Fields a version added (the first version carrying them), by event type ("outcome" for outcomes); a record
# of an older version that holds one is rejected like any unknown field. v2: an outcome may name the tool
# call it verifies (per-turn credit). v4: a malformed tool call may say where it stopped parsing.
ADDED_IN: dict[str, dict[str, int]] = {"outcome": {"call_id": 2}, "tool_call": {"malformed_token": 4}}
# Event types a version added: a record of such a type needs at least that version. v5: traced_llm_call.
TYPE_ADDED_IN: dict[str, int] = {"traced_llm_call": 5}

# Kafka topics (the transport contract); every process takes them from its config, these are the defaults.
EVENTS_TOPIC = "flywheel.events"
OUTCOMES_TOPIC = "flywheel.outcomes"
DLQ_TOPIC = "flywheel.dlq"

# Upper bounds the SDK enforces before an event leaves the host; the lake writer rejects larger records.
MAX_TEXT_CHARS = 64 * 1024  # tool output, completion text: longer values are cut and flagged in `truncated`
MAX_RECORD_BYTES = 4 * 1024 * 1024  # one serialised event, after truncation

# Limits on what a well-typed record may hold (`check_limits`). The lake writer dead-letters a record past
# any of them, with the LimitError's reason; the SDK checks the same constants before sending. Each bounds
# something that fails later otherwise: deep JSON breaks encoders (orjson stops at 254 levels, the stdlib
# at the recursion limit), a timestamp near the ends of the calendar overflows when converted to UTC, an
# int beyond int64 or a float beyond float32 does not fit its lake column (float32 would become inf).
MAX_JSON_DEPTH = 64  # nesting of one free-form JSON field's value (tags, sampling, arguments): 1 is {"a": 1}
MAX_STRING_CHARS = MAX_TEXT_CHARS  # any one string of a record, keys and strings nested in JSON fields included
MAX_TOKENS = 262_144  # items in one list field (prompt/completion/summary token ids, logprobs, truncated)
MIN_TS = _dt.datetime(2000, 1, 1, tzinfo=_dt.timezone.utc)  # every ts field lies in [MIN_TS, MAX_TS)
MAX_TS = _dt.datetime(2100, 1, 1, tzinfo=_dt.timezone.utc)
# int fields (int64 columns); token ids are int32, checked by the lake's Arrow conversion
MIN_INT, MAX_INT = -(2**63), 2**63 - 1
MAX_FLOAT32 = 3.4028234663852886e38  # |item| of a floats field (float32 column)
LIMIT_REASONS = ("too_deep", "string_too_long", "too_many_tokens", "ts_out_of_range", "int_out_of_range",
                 "float_out_of_range")

EVENT_TYPES = (
    "session_start",
    "llm_call",
    "traced_llm_call",
    "tool_call",
    "tool_result",
    "subagent_spawn",
    "subagent_finish",
    "context_edit",
    "session_end",
)
CONTEXT_EDIT_KINDS = ("summarize", "prune")


class SchemaError(ValueError):
    """A record does not match the schema; the message names the field and the problem."""


class LimitError(SchemaError):
    """A record past one of the limits above; `reason` (one of LIMIT_REASONS) names which."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class Col:
    """One column. `kind` is one of: str, int, float, bool, ts, ints, floats, strs, json.

    `ts` is an ISO-8601 UTC string on the wire and timestamp[us, UTC] in the lake; `json` is any
    JSON value on the wire, stored as its JSON text (free-form maps such as tags and tool
    arguments stay queryable with DuckDB's json functions without widening the schema).
    """

    name: str
    kind: str
    required: bool
    doc: str


# ---------------------------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------------------------
EVENT_COMMON: tuple[Col, ...] = (
    Col("schema_version", "int", True, "schema version of this record"),
    Col("event_id", "str", True, "uuid4 hex; the idempotency key (replays are de-duplicated by it)"),
    Col("session_id", "str", True, "one production session (the Kafka key, so a session stays ordered)"),
    Col("agent_id", "str", True, "the agent inside the session that emitted the event (main agent or sub-agent)"),
    Col("parent_agent_id", "str", False, "the spawning agent for a sub-agent, null for the main agent"),
    Col("seq", "int", True, "monotonic per (agent_id, emitting process); order inside an agent is (ts, seq)"),
    Col("ts", "ts", True, "when the event happened, UTC, microseconds"),
    Col("type", "str", True, "one of EVENT_TYPES"),
    Col("truncated", "strs", False, "names of fields the SDK cut to size (their values are prefixes)"),
)

# What a model call says beside its tokens: the captured llm_call and the traced one (v5) share these columns.
_CALL_DETAILS: tuple[Col, ...] = (
    Col("finish_reason", "str", False, "stop, length, tool_calls ..."),
    Col("latency_s", "float", False, "wall time of the call"),
    Col("sampling", "json", False, "sampling parameters (temperature, top_p, max_tokens ...)"),
    Col("prompt_text", "str", False, "optional rendered prompt (redacted)"),
    Col("completion_text", "str", False, "optional completion text (redacted)"),
)
_REQUEST_ID = Col("request_id", "str", False, "the serving request id, for tracing")
_ARM = Col("arm", "str", False, "the router's arm for the session: control, champion or challenger (null: no router)")

EVENT_FIELDS: dict[str, tuple[Col, ...]] = {
    "session_start": (
        Col("task_type", "str", True, "the task family, e.g. code_edit; baselines and rubrics are per task_type"),
        Col("tags", "json", False, "free-form string map"),
    ),
    "llm_call": (
        Col("model", "str", True, "the served model name the request was routed to, e.g. policy-v3"),
        Col("policy_version", "int", True, "integer version of the policy that produced the completion"),
        Col("prompt_token_ids", "ints", True, "the exact prompt token ids the server saw"),
        Col("completion_token_ids", "ints", True, "the exact sampled token ids"),
        Col("completion_logprobs", "floats", True, "behaviour logprob of each completion token"),
        *_CALL_DETAILS,
        Col("group_id", "str", False, "samples sharing a group id get group-relative advantages"),
        _REQUEST_ID,
        _ARM,
        Col("policy_version_alt", "int", False, "set when the server's weights changed during the call (a full-weight "
            "reload): the completion came from policy_version or this one. policy_version is then the older of the "
            "two, from which the learner counts staleness; the behaviour logprobs are exact per token either way"),
    ),
    # v5. What an OpenTelemetry GenAI span says of a model call: no token ids, no behaviour logprobs, so the
    # learner never trains on it; the gate counts its session (version, tokens), the lake keeps its text.
    "traced_llm_call": (
        Col("model", "str", True, "the model the span names (gen_ai.response.model, else gen_ai.request.model)"),
        Col("policy_version", "int", False, "the policy version, when the span says it (flywheel.policy_version, "
            "or a served name policy-v<N>)"),
        Col("provider", "str", False, "gen_ai.provider.name (gen_ai.system in older conventions)"),
        Col("input_tokens", "int", False, "gen_ai.usage.input_tokens"),
        Col("output_tokens", "int", False, "gen_ai.usage.output_tokens"),
        *_CALL_DETAILS,
        _REQUEST_ID,
        _ARM,
        Col("trace_id", "str", False, "the span's trace id (hex)"),
        Col("span_id", "str", False, "the span's id (hex)"),
    ),
    "tool_call": (
        Col("call_id", "str", True, "pairs the call with its result"),
        Col("name", "str", True, "tool name"),
        Col("arguments", "json", False, "tool arguments as given by the model"),
        Col("malformed", "bool", False, "the model's tool call did not parse or did not match the tool's signature"),
        Col("malformed_token", "int", False, "v4: of a malformed call, the index in its llm_call's "
            "completion_token_ids of the first token past the part that still read as a call; the malformed-call "
            "penalty is charged from there (absent: the whole completion)"),
    ),
    "tool_result": (
        Col("call_id", "str", True, "the tool_call this answers"),
        Col("name", "str", False, "tool name"),
        Col("ok", "bool", True, "whether the tool succeeded"),
        Col("output", "str", False, "tool output (size-capped, redacted)"),
    ),
    "subagent_spawn": (
        Col("child_agent_id", "str", True, "agent_id the child will log under"),
        Col("subtask", "str", False, "what the child was asked to do"),
    ),
    "subagent_finish": (
        Col("child_agent_id", "str", True, "the child that finished"),
        Col("ok", "bool", True, "whether the child finished its sub-task successfully"),
    ),
    "context_edit": (
        Col("edit_kind", "str", True, "summarize or prune"),
        Col("tokens_removed", "int", True, "how many context tokens the edit removed"),
        Col("summary_token_ids", "ints", False, "token ids of the summary that replaced them"),
    ),
    "session_end": (Col("status", "str", True, "how the session ended: ok, error, abandoned, timeout ..."),),
}

# The list fields that travel packed from v3 on (name -> kind), in the order a binary envelope holds them; the
# array typecode of a 4-byte int (the lake's token-id type) for packing and for decoded views.
PACKED_FIELDS: dict[str, str] = {
    c.name: c.kind for cols in EVENT_FIELDS.values() for c in cols if c.kind in ("ints", "floats")}
INT32_CODE = next(code for code in "il" if array.array(code).itemsize == 4)
_HIGH_BYTE = 3 if sys.byteorder == "little" else 0  # where a native float32's sign and exponent bits start

# Every per-type column, in declaration order, de-duplicated (ok is shared by two types).
_EVENT_TYPE_COLS: tuple[Col, ...] = tuple(
    {c.name: Col(c.name, c.kind, False, c.doc) for cols in EVENT_FIELDS.values() for c in cols}.values()
)
EVENT_COLUMNS: tuple[Col, ...] = EVENT_COMMON + _EVENT_TYPE_COLS
_EVENT_TYPE_FIELDS = {etype: EVENT_COMMON + cols for etype, cols in EVENT_FIELDS.items()}  # what validation checks

# ---------------------------------------------------------------------------------------------
# Outcomes
# ---------------------------------------------------------------------------------------------
OUTCOME_COLUMNS: tuple[Col, ...] = (
    Col("schema_version", "int", True, "schema version of this record"),
    Col("outcome_id", "str", True, "uuid4 hex; the idempotency key"),
    Col("session_id", "str", True, "the session this outcome is about"),
    Col("agent_id", "str", False, "the agent it is about, when narrower than the session"),
    Col("kind", "str", True, "outcome kind, e.g. task_success, tests_passed, accepted; rewards map kinds to values"),
    Col("call_id", "str", False, "v2: the tool_call this outcome verifies (a turn-level check), narrower "
                                 "than agent_id"),
    Col("value", "float", True, "the signal, e.g. 1.0 / 0.0"),
    Col("ts", "ts", True, "when the outcome was observed, UTC"),
    Col("source", "str", False, "who reported it (verifier, user, ci ...)"),
)

# Columns the lake writer adds to every event and outcome row (provenance and exactly-once bookkeeping).
LAKE_META_COLUMNS: tuple[Col, ...] = (
    Col("_topic", "str", True, "Kafka topic the record came from"),
    Col("_partition", "int", True, "Kafka partition"),
    Col("_offset", "int", True, "Kafka offset"),
    Col("_ingest_ts", "ts", True, "when the lake writer read it"),
)
# Hive partition column (the directory `date=YYYY-MM-DD`), derived from the record's ts.
LAKE_PARTITION_COLUMN = "date"

# ---------------------------------------------------------------------------------------------
# Episodes (written by rewards/, read by learner/ and serving/)
# ---------------------------------------------------------------------------------------------
EPISODE_COLUMNS: tuple[Col, ...] = (
    Col("episode_id", "str", True, "stable id of the trained sample: the llm_call's event_id"),
    Col("label_version", "int", True, "1 for the first label; a later outcome appends version 2, 3 ..."),
    Col("session_id", "str", True, "trace back to the session"),
    Col("agent_id", "str", True, "agent that made the call"),
    Col("parent_agent_id", "str", False, "parent agent for sub-agent calls"),
    Col("task_type", "str", True, "task family"),
    Col("group_id", "str", False, "group for group-relative advantages"),
    Col("model", "str", True, "served model name"),
    Col("policy_version", "int", True, "behaviour policy version"),
    Col("prompt_token_ids", "ints", True, "exact prompt ids as served"),
    Col("completion_token_ids", "ints", True, "exact completion ids as served"),
    Col("completion_logprobs", "floats", True, "behaviour logprobs, one per completion token"),
    Col("loss_mask", "ints", True, "1 where a completion token is trained, 0 where masked; same length"),
    Col("reward", "float", True, "the total scalar reward of this sample"),
    Col("r_outcome", "float", True, "verifiable outcome component"),
    Col("r_judge", "float", False, "generative judge component (null when not judged)"),
    Col("r_parallel", "float", True, "PARL parallelism shaping (already multiplied by its lambda)"),
    Col("r_finish", "float", True, "PARL sub-agent finish shaping (already multiplied by its lambda)"),
    Col("r_penalty", "float", True, "penalties, e.g. malformed tool calls (<= 0)"),
    Col("r_turn", "float", False, "this turn's own verified reward (replaces r_outcome in reward); null: nothing "
                                  "verified the turn"),
    Col("judge_score", "int", False, "the LLM judge's score of the session, 1..5 (null: not judged); stored in shadow "
                                     "mode (judge weight 0) too, where it is not in reward; reward_detail.judge "
                                     "names its version"),
    Col("sampling", "json", False, "the llm_call's sampling parameters (temperature, top_p, top_k ...): the learner "
                                   "scores its tokens under the same distribution"),
    Col("reward_detail", "json", False, "per outcome kind values, judge status, lambdas in force (for people and "
                                       "reports: no process reads a key inside it)"),
    Col("opens_session", "bool", False, "this row is the session's opening call (the main agent's first llm_call, "
                                        "where it decides how to go about the request); null in rows written "
                                        "before the column: read as false"),
    Col("shaping_clock", "str", False, "the clock the row's PARL shaping anneals by ([parl] anneal_clock: "
                                       "policy_version or learner_step); null on a row without shaping"),
    Col("critical_steps", "int", True, "longest chain of steps through the session's sub-agents"),
    Col("call_ts", "ts", True, "when the llm_call happened"),
    Col("session_end_ts", "ts", False, "when the session ended"),
    Col("last_outcome_ts", "ts", False, "arrival of the newest outcome in this label"),
    Col("emitted_ts", "ts", True, "when the builder wrote this row"),
)

# ---------------------------------------------------------------------------------------------
# Validation (pure Python, no third-party imports)
# ---------------------------------------------------------------------------------------------
_KIND_CHECK = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "ts": lambda v: isinstance(v, str) and _parse_ts(v) is not None,
    # token-id lists run to thousands of items per event: a C-level pass over the item types settles
    # the common case, the per-item check only runs for unusual items (the lake writer's hot path)
    # a v3 record's packed field decodes to a memoryview of int32 / float32 items (ingest/wire.py): its type
    # is settled by its format; NaN in it is looked for by _packed_nonfinite, like the limits
    "ints": lambda v: (type(v) is memoryview and v.format == INT32_CODE) or isinstance(v, list) and (
        set(map(type, v)) <= {int} or all(isinstance(x, int) and not isinstance(x, bool) for x in v)),
    "floats": lambda v: (type(v) is memoryview and v.format == "f" and not _packed_nonfinite(v)[0]) or (
        isinstance(v, list) and (
            (set(map(type, v)) <= {int, float} and not any(map(math.isnan, v)))
            or all(isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x) for x in v))),
    "strs": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "json": lambda v: True,
}


def _packed_nonfinite(items: memoryview) -> tuple[bool, bool]:
    """(holds NaN, holds an infinity) for float32 items, without a Python float per item in the common case.

    A float32 is NaN or infinite exactly when its 8 exponent bits are all set, which puts 0x7f or 0xff in its
    high byte (little-endian: every 4th byte, 3 onwards); a logprob's high byte is 0x80..0xc2. So two byte
    searches over the high bytes clear almost every array, and only a candidate is looked at item by item.
    """
    high = items.cast("B")[_HIGH_BYTE::4].tobytes() if items.nbytes else b""
    if b"\x7f" not in high and b"\xff" not in high:
        return False, False
    values = items.tolist()
    return any(map(math.isnan, values)), any(map(math.isinf, values))


def _packed_problem(value: memoryview) -> str:
    if value.format == "f" and _packed_nonfinite(value)[0]:
        return "packed float32 items holding NaN"
    return f"packed items of format {value.format!r}"


def _parse_ts(value: str) -> _dt.datetime | None:
    try:
        parsed = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def parse_ts(value: str) -> _dt.datetime:
    """Parse a wire timestamp into an aware UTC datetime (raises SchemaError)."""
    parsed = _parse_ts(value) if isinstance(value, str) else None
    if parsed is None:
        raise SchemaError(f"ts: {short_repr(value)} is not an ISO-8601 timestamp with a UTC offset")
    try:
        return parsed.astimezone(_dt.timezone.utc)
    except OverflowError:  # 0001-01-01T00:00+01:00 is a valid string whose UTC instant is before year 1
        raise SchemaError(f"ts: {short_repr(value)} is outside the representable UTC range") from None


def now_ts() -> str:
    """The current time as a wire timestamp (ISO-8601, UTC, microseconds)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


def _kind_ok(kind: str, value: Any) -> bool:
    try:
        return _KIND_CHECK[kind](value)
    except (ArithmeticError, TypeError, ValueError):  # math.isnan(10**400) overflows: not a float we can hold
        return False


# A value whose type is exactly this one needs no further kind check (bool is not int; JSON gives no subclasses).
_PLAIN_TYPE: dict[str, type] = {"str": str, "int": int, "bool": bool}
_SPECS: dict[int, tuple[tuple[Col, ...], tuple[tuple[str, str, bool, type | None], ...], frozenset[str]]] = {}


def _spec(cols: tuple[Col, ...]) -> tuple[tuple[tuple[str, str, bool, type | None], ...], frozenset[str]]:
    # cached by identity, as _kinds: the lake writer validates every record, so the per-column work is kept tiny
    cached = _SPECS.get(id(cols))
    if cached is None or cached[0] is not cols:
        spec = tuple((c.name, c.kind, c.required, _PLAIN_TYPE.get(c.kind)) for c in cols)
        cached = _SPECS[id(cols)] = (cols, spec, frozenset(c.name for c in cols))
    return cached[1], cached[2]


def _check(record: Mapping[str, Any], cols: tuple[Col, ...], what: str) -> None:
    spec, known = _spec(cols)
    for name, kind, required, plain in spec:
        value = record.get(name)
        if value is None:
            if required:
                raise SchemaError(f"{what}: missing required field {name!r}")
            continue
        if type(value) is not plain and not _kind_ok(kind, value):
            got = _packed_problem(value) if type(value) is memoryview else f"{type(value).__name__} {short_repr(value)}"
            raise SchemaError(f"{what}: field {name!r} should be {kind}, got {got}")
    if not known.issuperset(record):
        unknown = [k for k in record if k not in known]
        raise SchemaError(f"{what}: unknown field(s) {sorted(unknown)} (schema v{record.get('schema_version')} is "
                          "closed; add fields in a new version)")


def supported_version(version: Any) -> bool:
    """Whether a record's schema_version is one this code reads (any JSON value may come in: a list is unhashable)."""
    return type(version) is int and version in SUPPORTED_SCHEMA_VERSIONS


def _check_version(record: Mapping[str, Any]) -> None:
    version = record.get("schema_version")
    if not supported_version(version):
        raise SchemaError(f"unsupported schema_version {short_repr(version)} (supported: "
                          f"{sorted(SUPPORTED_SCHEMA_VERSIONS)})")


# reprlib stops at a few levels and items: repr() of a value nested 1,000 deep raises RecursionError
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 50, 50


def short_repr(value: Any) -> str:
    """A repr of any decoded JSON value for an error message: at most 60 chars, safe at any depth."""
    text = _REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_event(record: Any) -> dict[str, Any]:
    """Check a decoded event; return it unchanged or raise SchemaError naming the problem."""
    if not isinstance(record, dict):
        raise SchemaError(f"event is a JSON {type(record).__name__}, expected an object")
    _check_version(record)
    etype = record.get("type")
    if not isinstance(etype, str) or etype not in EVENT_FIELDS:
        raise SchemaError(f"unknown event type {short_repr(etype)} (known: {', '.join(EVENT_TYPES)})")
    _check(record, _EVENT_TYPE_FIELDS[etype], f"{etype} event")
    _check_added(record, etype)
    if record["seq"] < 0:
        raise SchemaError(f"{etype} event: seq must be >= 0, got {record['seq']}")
    if etype == "llm_call" and len(record["completion_logprobs"]) != len(record["completion_token_ids"]):
        raise SchemaError(
            "llm_call event: completion_logprobs has "
            f"{len(record['completion_logprobs'])} values for {len(record['completion_token_ids'])} completion tokens"
        )
    if etype == "context_edit" and record["edit_kind"] not in CONTEXT_EDIT_KINDS:
        raise SchemaError(f"context_edit event: edit_kind {record['edit_kind']!r} not in {CONTEXT_EDIT_KINDS}")
    return record


def validate_outcome(record: Any) -> dict[str, Any]:
    """Check a decoded outcome; return it unchanged or raise SchemaError naming the problem."""
    if not isinstance(record, dict):
        raise SchemaError(f"outcome is a JSON {type(record).__name__}, expected an object")
    _check_version(record)
    _check(record, OUTCOME_COLUMNS, "outcome")
    _check_added(record, "outcome")
    return record


def version_needed(record: Mapping[str, Any], what: str) -> int:
    """The oldest schema_version that has every field `record` holds (`what`: its event type, or "outcome")."""
    fields = (since for k, since in ADDED_IN.get(what, {}).items() if record.get(k) is not None)
    return max([TYPE_ADDED_IN.get(what, 1), *fields])


def _check_added(record: Mapping[str, Any], what: str) -> None:
    version = record["schema_version"]
    if version < TYPE_ADDED_IN.get(what, 1):
        raise SchemaError(f"unknown event type {what!r} in schema v{version} (it needs schema_version >= "
                          f"{TYPE_ADDED_IN[what]})")
    early = sorted(k for k, since in ADDED_IN.get(what, {}).items() if k in record and version < since)
    if early:
        raise SchemaError(f"{what}: unknown field(s) {early} (schema v{version} is closed; they need schema_version "
                          f">= {min(ADDED_IN[what][k] for k in early)})")


# ---------------------------------------------------------------------------------------------
# Limits (the constants at the top): checked after validation by the lake writer, before sending by the SDK
# ---------------------------------------------------------------------------------------------
_KINDS: dict[int, tuple[tuple[Col, ...], dict[str, str]]] = {}


def _kinds(cols: tuple[Col, ...]) -> dict[str, str]:
    # cached by identity: hashing the 35 frozen Cols on every record would cost more than the checks
    cached = _KINDS.get(id(cols))
    if cached is None or cached[0] is not cols:
        cached = _KINDS[id(cols)] = (cols, {c.name: c.kind for c in cols})
    return cached[1]


def check_limits(record: Mapping[str, Any], cols: tuple[Col, ...] = EVENT_COLUMNS) -> None:
    """Raise LimitError (its reason one of LIMIT_REASONS) when a field of `record` is past a limit.

    `cols` is EVENT_COLUMNS or OUTCOME_COLUMNS. Values of the wrong type and unknown fields are
    validation's business and pass here; on a validated record every check is a few C-level passes
    (the token-id lists are measured, not walked).
    """
    kinds = _kinds(cols)
    for name, value in record.items():
        kind = kinds.get(name)
        if value is None or kind is None:
            continue
        if type(value) is bool or (type(value) is int and MIN_INT <= value <= MAX_INT):
            continue  # the common small scalars: nothing to check
        if isinstance(value, str):
            _check_string(name, value)
            if kind == "ts":
                _check_ts(name, value)
        elif kind in ("int", "float") and type(value) is int and not MIN_INT <= value <= MAX_INT:
            raise LimitError("int_out_of_range", f"field {name!r}: {short_repr(value)} is outside int64")
        elif kind in ("ints", "floats", "strs") and isinstance(value, list):
            _check_list(name, kind, value)
        elif kind in ("ints", "floats") and type(value) is memoryview:
            _check_packed(name, kind, value)
        elif kind == "json":
            _check_json(name, value, 0)


def _check_string(name: str, value: str) -> None:
    if len(value) > MAX_STRING_CHARS:
        raise LimitError("string_too_long",
                         f"field {name!r}: a string of {len(value)} chars > schema.MAX_STRING_CHARS={MAX_STRING_CHARS}")


def _check_ts(name: str, value: str) -> None:
    parsed = _parse_ts(value)
    # aware datetimes compare by their UTC instant without converting, so year 1 at +01:00 cannot overflow here
    if parsed is not None and not MIN_TS <= parsed < MAX_TS:
        raise LimitError("ts_out_of_range", f"field {name!r}: {short_repr(value)} is outside "
                         f"[{MIN_TS.isoformat()}, {MAX_TS.isoformat()})")


def _check_list(name: str, kind: str, value: list[Any]) -> None:
    if len(value) > MAX_TOKENS:
        raise LimitError("too_many_tokens", f"field {name!r}: {len(value)} items > schema.MAX_TOKENS={MAX_TOKENS}")
    if kind == "floats" and value:
        try:  # min/max run in C: cheap enough for every llm_call's logprobs
            low, high = min(value), max(value)
            beyond = low < -MAX_FLOAT32 or high > MAX_FLOAT32
        except TypeError:  # mixed item types: validation's business
            return
        if beyond:
            raise LimitError("float_out_of_range",
                             f"field {name!r}: an item beyond float32 (min {short_repr(low)}, max {short_repr(high)})")
    if kind == "strs":
        for item in value:
            if isinstance(item, str):
                _check_string(name, item)


def _check_packed(name: str, kind: str, value: memoryview) -> None:
    """The limits of a list field on a v3 record's packed items: int32 token ids are in range by construction,
    a float32 within range is finite (NaN is validation's business: it fails the kind check)."""
    if len(value) > MAX_TOKENS:
        raise LimitError("too_many_tokens", f"field {name!r}: {len(value)} items > schema.MAX_TOKENS={MAX_TOKENS}")
    if kind == "floats" and _packed_nonfinite(value)[1]:
        raise LimitError("float_out_of_range", f"field {name!r}: an item beyond float32 (an infinity)")


def _check_json(name: str, value: Any, depth: int) -> None:
    """Walk a JSON field's value; `depth` is the number of containers around it."""
    if isinstance(value, str):
        _check_string(name, value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise LimitError("float_out_of_range", f"field {name!r}: {value} is not a finite number")
    elif isinstance(value, (dict, list)):
        if depth + 1 > MAX_JSON_DEPTH:
            raise LimitError("too_deep", f"field {name!r}: JSON nested deeper than "
                                         f"schema.MAX_JSON_DEPTH={MAX_JSON_DEPTH}")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_string(name, key)
            _check_json(name, item, depth + 1)


# ---------------------------------------------------------------------------------------------
# Arrow schemas, derived from the columns above (pyarrow imported only when asked for)
# ---------------------------------------------------------------------------------------------
def arrow_type(kind: str) -> Any:
    import pyarrow as pa

    return {
        "str": pa.string(),
        "int": pa.int64(),
        "float": pa.float64(),
        "bool": pa.bool_(),
        "ts": pa.timestamp("us", tz="UTC"),
        "ints": pa.list_(pa.int32()),
        "floats": pa.list_(pa.float32()),
        "strs": pa.list_(pa.string()),
        "json": pa.string(),
    }[kind]


def arrow_schema(cols: tuple[Col, ...]) -> Any:
    import pyarrow as pa

    return pa.schema(
        [pa.field(c.name, arrow_type(c.kind), nullable=not c.required, metadata={"doc": c.doc}) for c in cols]
    )


def event_arrow_schema() -> Any:
    """Lake schema of lake/events (without the hive `date` column, which is the directory)."""
    return arrow_schema(EVENT_COLUMNS + LAKE_META_COLUMNS)


def outcome_arrow_schema() -> Any:
    """Lake schema of lake/outcomes."""
    return arrow_schema(OUTCOME_COLUMNS + LAKE_META_COLUMNS)


def episode_arrow_schema() -> Any:
    """Lake schema of lake/episodes."""
    return arrow_schema(EPISODE_COLUMNS)


def episode_reward(r_outcome: float, r_turn: float | None, r_judge: float | None, r_parallel: float, r_finish: float,
                   r_penalty: float) -> float:
    """An episode row's `reward` from its parts: the turn's own check where one verified it, else the (session or
    agent) outcome, plus the judge, the PARL shaping and the penalties, in this order. The one definition: the
    builder writes it, and the learner calls it with the shaping at 0 for the reward an annealed step trains
    (adding 0.0 is exact, so that reward equals an unshaped twin's bit for bit)."""
    return (r_outcome if r_turn is None else r_turn) + (r_judge or 0.0) + r_parallel + r_finish + r_penalty


def session_sampled(session_id: str, rate: float, salt: str = "") -> bool:
    """Whether a session falls in a `rate` share, by a hash of its id: every process that sees the session (the SDK,
    the OutcomeReporter, the episode builder's judge) agrees without talking to the others.

    blake2b, not crc32: crc32 is linear, so sequential ids ("s1", "s2" ...) were sampled well off the rate. `salt`
    makes a draw independent of the others: the judge's share of the SDK's kept sessions would otherwise be all of
    them whenever the judge's rate is the larger (both keep the ids that hash low)."""
    if rate >= 1.0:
        return True
    import hashlib

    digest = hashlib.blake2b((salt + session_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < rate
