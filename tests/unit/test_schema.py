"""The one schema: validation names the problem; Arrow schemas derive from the same columns."""

from __future__ import annotations

import uuid

import pytest

from flywheel.ingest import schema


def _llm_call(**over):
    event = {
        "schema_version": 1, "event_id": uuid.uuid4().hex, "session_id": "s1", "agent_id": "a1", "seq": 0,
        "ts": schema.now_ts(), "type": "llm_call", "model": "policy-v0", "policy_version": 0,
        "prompt_token_ids": [1, 2], "completion_token_ids": [3, 4], "completion_logprobs": [-0.1, -0.2],
    }
    event.update(over)
    return event


def test_valid_event_passes():
    assert schema.validate_event(_llm_call())["type"] == "llm_call"


@pytest.mark.parametrize("change, message", [
    ({"schema_version": 99}, "unsupported schema_version"),
    ({"session_id": None}, "missing required field 'session_id'"),
    ({"seq": "7"}, "field 'seq' should be int"),
    ({"completion_logprobs": [-0.1]}, "1 values for 2 completion tokens"),
    ({"type": "nope"}, "unknown event type"),
    ({"surprise": 1}, "unknown field"),
    ({"ts": "yesterday"}, "field 'ts' should be ts"),
])
def test_invalid_events_name_the_problem(change, message):
    with pytest.raises(schema.SchemaError, match=message):
        schema.validate_event(_llm_call(**change))


def test_arrow_schemas_derive_from_columns():
    events = schema.event_arrow_schema()
    assert [f.name for f in events] == [c.name for c in schema.EVENT_COLUMNS + schema.LAKE_META_COLUMNS]
    assert len({c.name for c in schema.EVENT_COLUMNS}) == len(schema.EVENT_COLUMNS), "duplicate column names"
    episodes = schema.episode_arrow_schema()
    assert episodes.field("completion_logprobs").type.value_type.bit_width == 32


# ---- any JSON value: validation raises SchemaError and nothing else ----------------------------------
@pytest.mark.parametrize("change", [
    {"schema_version": [1]}, {"schema_version": {"v": 1}}, {"type": ["llm_call"]}, {"type": {"a": 1}},
    {"latency_s": 10**400}, {"completion_logprobs": [-0.1, 10**400]}, {"session_id": [[[[[[[[[["x"]]]]]]]]]]},
    {"ts": "0001-01-01T00:00:00+01:00-garbage"},
])
def test_validation_of_any_json_value_raises_only_schema_errors(change):
    # each of these raised TypeError or OverflowError before, which stopped the lake writer at that offset
    with pytest.raises(schema.SchemaError):
        schema.validate_event(_llm_call(**change))


def test_messages_stay_short_at_any_depth():
    deep = 1
    for _ in range(5000):
        deep = [deep]
    assert len(schema.short_repr(deep)) <= 60
    with pytest.raises(schema.SchemaError, match="should be str"):
        schema.validate_event(_llm_call(session_id=deep))


def test_parse_ts_of_a_valid_string_outside_utc_raises_a_schema_error():
    with pytest.raises(schema.SchemaError, match="representable"):
        schema.parse_ts("0001-01-01T00:00:00+01:00")


# ---- limits -------------------------------------------------------------------------------------------
def _nest(depth):
    value = 1
    for _ in range(depth):
        value = {"k": value}
    return value


@pytest.mark.parametrize("change, reason", [
    ({"sampling": _nest(schema.MAX_JSON_DEPTH + 1)}, "too_deep"),
    ({"completion_text": "x" * (schema.MAX_STRING_CHARS + 1)}, "string_too_long"),
    ({"sampling": {"stop": ["y" * (schema.MAX_STRING_CHARS + 1)]}}, "string_too_long"),
    ({"truncated": ["z" * (schema.MAX_STRING_CHARS + 1)]}, "string_too_long"),
    ({"prompt_token_ids": [1] * (schema.MAX_TOKENS + 1)}, "too_many_tokens"),
    ({"ts": "1999-12-31T23:59:59.999999+00:00"}, "ts_out_of_range"),
    ({"ts": "2100-01-01T00:00:00+00:00"}, "ts_out_of_range"),
    ({"ts": "0001-01-01T00:00:00+01:00"}, "ts_out_of_range"),
    ({"seq": schema.MAX_INT + 1}, "int_out_of_range"),
    ({"latency_s": schema.MIN_INT - 1}, "int_out_of_range"),
    ({"completion_logprobs": [-0.1, -1e39]}, "float_out_of_range"),
    ({"sampling": {"t": float("inf")}}, "float_out_of_range"),
])
def test_limits_name_the_limit(change, reason):
    with pytest.raises(schema.LimitError) as info:
        schema.check_limits(_llm_call(**change))
    assert info.value.reason == reason and info.value.reason in schema.LIMIT_REASONS, str(info.value)


def test_values_at_the_limits_pass():
    schema.check_limits(_llm_call(
        sampling=_nest(schema.MAX_JSON_DEPTH), completion_text="x" * schema.MAX_STRING_CHARS,
        prompt_token_ids=[1] * schema.MAX_TOKENS, ts="2099-12-31T23:59:59.999999+00:00", seq=schema.MAX_INT,
        completion_logprobs=[-schema.MAX_FLOAT32, 0.0]))
    schema.check_limits({"schema_version": 1, "value": 2.5, "ts": "2000-01-01T00:00:00+00:00", "kind": "k"},
                        schema.OUTCOME_COLUMNS)
    # wrong types are validation's business: the limits neither raise on them nor judge them
    schema.check_limits(_llm_call(completion_logprobs=["a", 1], seq="7", ts=5, sampling=object()))


def test_a_tool_calls_malformed_token_needs_schema_v4():
    """v4 adds one optional field; a v3 record that holds it is rejected like any unknown field, and the JSON wire
    format keeps v4 for a record that uses it (an older writer dead-letters it instead of landing it without)."""
    from flywheel.ingest import wire

    call = {"schema_version": 4, "event_id": uuid.uuid4().hex, "session_id": "s1", "agent_id": "a1", "seq": 0,
            "ts": schema.now_ts(), "type": "tool_call", "call_id": "c1", "name": "spawn", "malformed": True,
            "malformed_token": 7}
    assert schema.validate_event(call)["malformed_token"] == 7
    with pytest.raises(schema.SchemaError, match=r"malformed_token.*schema_version >= 4"):
        schema.validate_event(call | {"schema_version": 3})
    assert schema.version_needed(call, "tool_call") == 4
    assert schema.version_needed(call | {"malformed_token": None}, "tool_call") == 1
    import json
    assert json.loads(wire.encode(call, "json"))["schema_version"] == 4
    assert json.loads(wire.encode(call | {"malformed_token": None}, "json"))["schema_version"] == wire.JSON_VERSION
