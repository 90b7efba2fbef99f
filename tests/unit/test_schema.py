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
