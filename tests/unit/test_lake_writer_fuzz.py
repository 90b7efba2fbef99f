"""Property-based tests of the lake writer's decode path: no record, however odd, stops the writer.

Arbitrary bytes, arbitrary JSON values, and valid events with one field replaced by an arbitrary value
(deep nesting, huge numbers, timestamps at the ends of the calendar) go through `decode_record` and the
row -> Arrow conversion the writer does (`convert_rows`). Each must end as a lake row or as a rejection
with one of the writer's DLQ reasons and a detail; any other exception fails the test. Then the same
through `LakeWriter.add`: good records around poison land, the poison is dead-lettered, and the files
cover every offset.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flywheel.ingest import lake, schema
from flywheel.ingest.lake_writer import (
    DLQ_REASONS,
    DeadLetters,
    LakeWriter,
    LakeWriterConfig,
    Rejected,
    convert_rows,
    decode_record,
)

TOPIC = "flywheel.events"
# bounded so the whole file runs in seconds; no example database, so no .hypothesis/ folder in the tree
FUZZ = settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

COMMON = {"schema_version": 1, "event_id": "e0", "session_id": "s0", "agent_id": "main", "seq": 0,
          "ts": "2026-11-30T10:00:00.000001+00:00"}
EVENTS: dict[str, dict[str, Any]] = {
    "session_start": {"task_type": "code_edit", "tags": {"team": "a"}},
    "llm_call": {"model": "policy-v0", "policy_version": 0, "prompt_token_ids": [1, 2, 3],
                 "completion_token_ids": [4, 5], "completion_logprobs": [-0.5, -0.25], "finish_reason": "stop",
                 "latency_s": 0.1, "sampling": {"temperature": 1.0}, "completion_text": "hi", "group_id": "g"},
    "tool_call": {"call_id": "c1", "name": "grep", "arguments": {"pattern": "x", "paths": ["a"]}, "malformed": False},
    "tool_result": {"call_id": "c1", "name": "grep", "ok": True, "output": "a:1"},
    "subagent_spawn": {"child_agent_id": "a2", "subtask": "look"},
    "subagent_finish": {"child_agent_id": "a2", "ok": True},
    "context_edit": {"edit_kind": "prune", "tokens_removed": 10, "summary_token_ids": [7]},
    "session_end": {"status": "ok", "truncated": ["output"]},
}
OUTCOME = {"schema_version": 1, "outcome_id": "o0", "session_id": "s0", "agent_id": "main", "kind": "tests_passed",
           "value": 1.0, "ts": "2026-11-30T10:00:00+00:00", "source": "ci"}


def good_event(etype: str = "llm_call", **over: Any) -> dict[str, Any]:
    record = {**COMMON, "type": etype, **EVENTS[etype]}
    record.update(over)
    return record


def wire(record: Any) -> bytes:
    # allow_nan: NaN and Infinity are not JSON; the writer must reject them, not crash on them
    return json.dumps(record, allow_nan=True).encode()


# ---- strategies -----------------------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12))
json_values = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=25)
offsets_tz = st.integers(-1439, 1439).map(lambda m: dt.timezone(dt.timedelta(minutes=m)))
timestamps = st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 59),
                          timezones=offsets_tz).map(dt.datetime.isoformat)
numbers = st.sampled_from([2**31, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, 1e39, -1e39, 1e308, 5e-324])


def nested(depth: int, kind: str) -> str:
    """JSON text nested `depth` deep (built as text: the stdlib encoder itself stops near 1,000)."""
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"k":' * depth + "1" + "}" * depth)


@st.composite
def mutated_events(draw: st.DrawFn) -> bytes:
    """A valid event of any type with one field replaced, removed or added, or a JSON field nested deep."""
    etype = draw(st.sampled_from(sorted(EVENTS)))
    record = good_event(etype)
    field = draw(st.sampled_from(sorted(record) + ["surprise"]))
    how = draw(st.sampled_from(["value", "timestamp", "number", "drop", "deep"]))
    if how == "drop":
        record.pop(field, None)
        return wire(record)
    if how == "deep":
        record[field] = "@@deep@@"
        depth = draw(st.sampled_from([schema.MAX_JSON_DEPTH, schema.MAX_JSON_DEPTH + 1, 253, 254, 255, 1023, 1024,
                                      1025, 1100]))
        return wire(record).replace(b'"@@deep@@"', nested(depth, draw(st.sampled_from(["list", "dict"]))).encode())
    strategy = {"value": json_values, "timestamp": timestamps, "number": numbers}[how]
    record[field] = draw(strategy)
    return wire(record)


# ---- the decode path ------------------------------------------------------------------------
def land_or_reject(table: str, value: bytes | None) -> str:
    """Decode and convert one value as the writer does: "row", or the DLQ reason. Anything else raised fails."""
    try:
        row, date = decode_record(table, value)
    except Rejected as rej:
        assert rej.reason in DLQ_REASONS, f"reason {rej.reason!r} is not one of {DLQ_REASONS}"
        assert rej.detail, f"a {rej.reason} rejection without a detail"
        return rej.reason
    dt.date.fromisoformat(date)
    row.update(_topic=TOPIC, _partition=0, _offset=0, _ingest_ts=dt.datetime.now(dt.timezone.utc))
    table_out, bad = convert_rows(table, [row])
    assert table_out.num_rows + len(bad) == 1, f"{table_out.num_rows} rows and {len(bad)} rejections for one record"
    if bad:
        assert bad[0][0] == 0 and bad[0][1], bad
        return "unstorable"
    return "row"


def test_the_unmutated_events_land() -> None:
    # the strategies start from these: if they did not land, the properties below would test only rejections
    for etype in EVENTS:
        assert land_or_reject("events", wire(good_event(etype))) == "row", etype
    assert land_or_reject("outcomes", wire(OUTCOME)) == "row"


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_land_or_are_rejected(value: bytes) -> None:
    land_or_reject("events", value)


@FUZZ
@given(json_values)
def test_arbitrary_json_lands_or_is_rejected(value: Any) -> None:
    land_or_reject("events", wire(value))
    land_or_reject("outcomes", wire(value))


@FUZZ
@given(mutated_events())
def test_events_with_a_field_replaced_land_or_are_rejected(value: bytes) -> None:
    land_or_reject("events", value)


@FUZZ
@given(st.sampled_from(sorted(OUTCOME) + ["surprise"]), json_values | timestamps | numbers)
def test_outcomes_with_a_field_replaced_land_or_are_rejected(field: str, value: Any) -> None:
    land_or_reject("outcomes", wire({**OUTCOME, field: value}))


@settings(max_examples=150, deadline=None, database=None)
@given(st.lists(mutated_events() | st.just(wire(good_event())), min_size=1, max_size=12))
def test_a_batch_converts_to_its_good_rows(values: list[bytes]) -> None:
    # the writer converts 1,000 rows at a time: one bad row must cost only itself, never its chunk
    rows = []
    for i, value in enumerate(values):
        try:
            row, _ = decode_record("events", value)
        except Rejected:
            continue
        rows.append({**row, "_topic": TOPIC, "_partition": 0, "_offset": i,
                     "_ingest_ts": dt.datetime.now(dt.timezone.utc)})
    table, bad = convert_rows("events", rows)
    alone = sum(convert_rows("events", [r])[0].num_rows for r in rows)
    assert (table.num_rows, len(bad)) == (alone, len(rows) - alone), \
        f"batch kept {table.num_rows} rows and rejected {len(bad)}; one by one {alone} of {len(rows)} convert"


@pytest.mark.parametrize("value, reason", [
    (wire(good_event("session_start", tags="@@")).replace(b'"@@"', nested(300, "list").encode()), "too_deep"),  # orjson dumps stops at 254
    (wire(good_event("session_start", tags="@@")).replace(b'"@@"', nested(2000, "dict").encode()), "malformed_json"),  # orjson loads: 1024
    (wire(good_event(ts="0001-01-01T00:00:00+01:00")), "ts_out_of_range"),  # overflowed astimezone() before
    (wire(good_event(ts="9999-12-31T23:59:59-01:00")), "ts_out_of_range"),
    (wire(good_event(ts="1999-12-31T23:59:59+00:00")), "ts_out_of_range"),
    (wire(good_event(schema_version=[1])), "unsupported_schema_version"),  # unhashable: `in frozenset` raised
    (wire(good_event(type=["llm_call"])), "invalid"),  # unhashable: `in EVENT_FIELDS` raised
    (wire(good_event(type={"a": 1})), "invalid"),
    (wire(good_event(latency_s=10**400)), "malformed_json"),  # orjson: beyond a double (the stdlib: see test_schema)
    (wire(good_event(completion_logprobs=[-0.5, 10**30])), "row"),  # orjson reads it as a float within float32
    (wire(good_event(latency_s=2**64 - 1)), "int_out_of_range"),  # would not fit the float64 column via int64
    (wire(good_event(seq=2**64 - 1)), "int_out_of_range"),
    (wire(good_event(completion_logprobs=[-0.5, 1e39])), "float_out_of_range"),  # float32 would make it inf
    (wire(good_event(prompt_token_ids=[1] * (schema.MAX_TOKENS + 1))), "too_many_tokens"),
    (wire(good_event(completion_text="x" * (schema.MAX_STRING_CHARS + 1))), "string_too_long"),
    (wire(good_event("tool_call", arguments={"path": "y" * (schema.MAX_STRING_CHARS + 1)})), "string_too_long"),
    (wire(good_event("tool_call", arguments={"k" * (schema.MAX_STRING_CHARS + 1): 1})), "string_too_long"),
    (wire(good_event(session_id=[[[[[[[["deep"]]]]]]]])), "invalid"),
    (wire(good_event(truncated=["z" * (schema.MAX_STRING_CHARS + 1)])), "string_too_long"),
    (wire(good_event("session_start", tags={"x": float("nan")})), "malformed_json"),
])
def test_poison_gets_a_named_reason(value: bytes, reason: str) -> None:
    got = land_or_reject("events", value)
    assert got == reason, f"{value[:70]!r}... ended as {got}, expected {reason}"


def test_an_unexpected_exception_becomes_a_decode_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # a bug anywhere in decoding (here: in the timestamp conversion) must cost one record, not the writer
    def boom(value: str) -> dt.datetime:
        raise KeyError("surprise")

    monkeypatch.setattr(schema, "parse_ts", boom)
    with pytest.raises(Rejected) as info:
        decode_record("events", wire(good_event()))
    assert (info.value.reason, info.value.detail) == ("decode_error", "KeyError: 'surprise'"), info.value.detail


# ---- the writer -----------------------------------------------------------------------------
def make_writer(root: Path, **overrides: Any) -> LakeWriter:
    cfg = LakeWriterConfig(events_topic=TOPIC, outcomes_topic="", lake_root=str(root), **overrides)
    return LakeWriter(cfg, DeadLetters(None, cfg.dlq_topic, str(root)), clock=lambda: 0.0)


def lake_offsets(root: Path) -> tuple[list[int], list[tuple[int, int]]]:
    files = lake.list_files(str(root), "events")
    rows = sorted(o for f in files for o in pq.read_table(f.path).column("_offset").to_pylist())
    return rows, sorted((f.first, f.last) for f in files)


def assert_tiles(ranges: list[tuple[int, int]], n: int) -> None:
    covered = [o for first, last in ranges for o in range(first, last + 1)]
    assert covered == list(range(n)), f"files {ranges} do not tile offsets 0..{n - 1}"


POISON = [
    wire(good_event("session_start", tags="@@")).replace(b'"@@"', nested(300, "list").encode()),
    wire(good_event(ts="0001-01-01T00:00:00+01:00")),
    wire(good_event(schema_version=[1])),
    wire(good_event(prompt_token_ids=[2**40])),  # passes decoding, fails the Arrow conversion
    wire(good_event(completion_logprobs=[-0.5, 1e39])),
    b"\xff\xfe",
]


def test_poison_between_good_records_is_dead_lettered_and_the_rest_lands(tmp_path: Path) -> None:
    w = make_writer(tmp_path, roll_max_records=5)
    w.assign([(TOPIC, 0)])
    values: list[bytes] = []
    for poison in POISON:
        values += [wire(good_event(event_id=f"g{len(values)}")), poison]
    values.append(wire(good_event(event_id="last")))
    for offset, value in enumerate(values):
        w.add(TOPIC, 0, offset, value, key=b"s0")
    w.flush_all()
    rows, ranges = lake_offsets(tmp_path)
    assert rows == list(range(0, len(values), 2)), f"good records at even offsets must land, lake has {rows}"
    letters = {e["offset"]: e for e in w.dlq.sent}
    assert sorted(letters) == list(range(1, len(values), 2)), f"DLQ holds offsets {sorted(letters)}"
    for offset, letter in letters.items():
        assert base64.b64decode(letter["original_b64"]) == values[offset], f"offset {offset}: original bytes lost"
        assert letter["reason"] in DLQ_REASONS and letter["detail"], letter
    assert [letters[o]["reason"] for o in sorted(letters)] == [
        "too_deep", "ts_out_of_range", "unsupported_schema_version", "unstorable", "float_out_of_range", "not_utf8"]
    assert_tiles(ranges, len(values))
    assert lake.next_offsets(str(tmp_path), "events", TOPIC) == {0: len(values)}


# Kafka record timestamps as a broker may hand them over: none (-1), ms, microseconds sent as ms, any int, odd floats
kafka_timestamps = (st.none() | st.just(-1) | st.integers(0, 4_102_444_800_000) | st.integers(10**15, 10**17)
                    | st.integers() | st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(mutated_events() | st.binary(max_size=40) | st.just(wire(good_event())), kafka_timestamps),
                min_size=1, max_size=30),
       st.integers(1, 8))
def test_every_offset_lands_or_is_dead_lettered(records: list[tuple[bytes, Any]], roll: int) -> None:
    values = [value for value, _ in records]
    with tempfile.TemporaryDirectory() as tmp:
        w = make_writer(Path(tmp), roll_max_records=roll, dedup_window=0)  # copies of one event_id all land here
        w.assign([(TOPIC, 0)])
        for offset, (value, kafka_ts_ms) in enumerate(records):
            w.add(TOPIC, 0, offset, value, kafka_ts_ms=kafka_ts_ms)
        w.flush_all()
        rows, ranges = lake_offsets(Path(tmp))
        letters = sorted(e["offset"] for e in w.dlq.sent)
        assert sorted(rows + letters) == list(range(len(values))), f"rows {rows} + dead letters {letters}"
        assert_tiles(ranges, len(values))


# ---- the de-duplication window ------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.sampled_from("abcdef"), max_size=40), st.integers(1, 8), st.data())
def test_the_window_is_the_ids_of_the_last_n_rows_however_it_was_built(rows: list[str], n: int,
                                                                       data: st.DataObject) -> None:
    from flywheel.ingest.lake_writer import IdWindow

    split = data.draw(st.integers(0, len(rows)), label="rows in the lake when the window was built")
    kept = IdWindow(n, rows[:split])  # a writer that built its window then landed the rest itself
    for row_id in rows[split:]:
        kept.add(row_id)
    rebuilt = IdWindow(n, rows[-n:])  # the next owner, from the lake's last n rows
    members = {i for i in "abcdefg" if i in kept}
    assert members == {i for i in "abcdefg" if i in rebuilt} == set(rows[-n:]), (members, rows[-n:])
    assert len(kept) == len(rebuilt) == min(n, len(rows))
    following = data.draw(st.lists(st.sampled_from("abcdefg"), max_size=12), label="the rows that follow")
    decisions = []
    for window in (kept, rebuilt):
        seen = []
        for row_id in following:  # the writer's rule: a row whose id is in the window is dropped, others land
            seen.append(row_id in window)
            if not seen[-1]:
                window.add(row_id)
        decisions.append(seen)
    assert decisions[0] == decisions[1], f"the two windows decided {decisions[0]} and {decisions[1]} for {following}"
