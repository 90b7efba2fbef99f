"""decode_batch (column by column) against the reference, decode_record + convert_rows (record by record).

The lake writer decodes every polled run of records with decode_batch. It must land exactly the rows the
reference lands, with the same values and dates, and dead-letter every other record with the reason and detail
the reference gives: a fast path that accepted a record the reference refuses would let a bad record into the
lake, and one that refused differently would change the DLQ. Only `_ingest_ts` may differ (one per run).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import random
import struct
from typing import Any

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.ingest import encoded, realistic_event
from flywheel.ingest import wire as wire_format
from flywheel.ingest.decode import Rejected, convert_rows, decode_batch, decode_record
from tests.unit.test_lake_writer_fuzz import EVENTS, OUTCOME, good_event, json_values, mutated_events, timestamps, wire

TOPIC = "flywheel.events"
NOW = dt.datetime(2026, 12, 2, 8, 0, tzinfo=dt.timezone.utc)


def reference(table: str, values: list[Any]) -> tuple[pa.Table, list[int], list[str], dict[int, tuple[str, str]]]:
    rows, good, dates, rejected = [], [], [], {}
    for i, value in enumerate(values):
        try:
            row, date = decode_record(table, value)
        except Rejected as rej:
            rejected[i] = (rej.reason, rej.detail)
            continue
        rows.append({**row, "_topic": TOPIC, "_partition": 3, "_offset": 100 + i, "_ingest_ts": NOW})
        good.append(i)
        dates.append(date)
    out, bad = convert_rows(table, rows)
    for k, detail in bad:
        rejected[good[k]] = ("unstorable", detail)
    keep = [k for k in range(len(good)) if k not in {k for k, _ in bad}]
    return out, [good[k] for k in keep], [dates[k] for k in keep], rejected


def assert_same(table: str, values: list[Any]) -> None:
    got = decode_batch(table, TOPIC, 3, [100 + i for i in range(len(values))], values, NOW)
    want, good, dates, rejected = reference(table, values)
    assert got.rejected == rejected, f"rejections differ:\n got {got.rejected}\nwant {rejected}"
    assert (got.good, got.dates) == (good, dates), f"good rows {got.good} / {good}, dates {got.dates} / {dates}"
    assert got.table.schema == want.schema, got.table.schema
    assert got.table.to_pylist() == want.to_pylist(), "rows differ"


def test_realistic_v1_and_v3_runs_land_as_the_reference_lands_them() -> None:
    rng = random.Random(11)
    events = [realistic_event(rng, i) for i in range(300)]
    for fmt in ("v1", "v3"):
        assert_same("events", [encoded(fmt, e) for e in events])


def test_every_event_type_and_an_outcome() -> None:
    for etype in EVENTS:
        assert_same("events", [wire(good_event(etype))])
        assert_same("events", [encoded("v3", good_event(etype, schema_version=3))])
    assert_same("outcomes", [wire(OUTCOME), wire({**OUTCOME, "schema_version": 2, "call_id": "c1"})])


def packed(kind: str, items: list[Any]) -> str:
    return base64.b64encode(b"".join(struct.pack("<i" if kind == "ints" else "<f", x) for x in items)).decode()


POISON = [
    None, b"", b"\xff\xfe", b"[1,2]", b'{"schema_version": 9}', wire(good_event(seq=-1)),
    wire(good_event(seq=2**63)), wire(good_event(latency_s=2**60)), wire(good_event(latency_s=True)),
    wire(good_event(ts="2026-02-30T10:00:00Z")), wire(good_event(ts="1999-12-31T23:59:59Z")),
    wire(good_event(ts="2026-11-30T10:00:00.1234567Z")), wire(good_event(ts="2026-11-30 10:00:00Z")),
    wire(good_event(ts="2026-11-30T10:00:00+05:30")), wire(good_event(completion_text="é" * 70_000)),
    wire(good_event(schema_version=3, prompt_token_ids=packed("ints", [1, 2]) + "=")),
    wire(good_event(schema_version=3, prompt_token_ids="AAA")),
    wire(good_event(schema_version=3, completion_logprobs=packed("floats", [float("nan"), 0.0]))),
    wire(good_event(schema_version=3, completion_logprobs=packed("floats", [float("inf"), 0.0]))),
    wire(good_event(schema_version=3, completion_logprobs=packed("floats", [-1.0]))),
    wire(good_event(schema_version=1, prompt_token_ids=packed("ints", [1, 2]))),
    wire(good_event(schema_version=3, prompt_token_ids=[2**31, 1])),
    wire(good_event(prompt_token_ids=[2**31, 1])), wire(good_event("context_edit", edit_kind="rewrite")),
    # JSON lists, which the fast path now packs itself: every item the reference refuses or names goes to it
    wire(good_event(prompt_token_ids=[1, True])), wire(good_event(prompt_token_ids=[1, 2.0])),
    wire(good_event(prompt_token_ids=[-2**31 - 1])), wire(good_event(prompt_token_ids=["1"])),
    wire(good_event(prompt_token_ids=[1, None])), wire(good_event(completion_logprobs=[-1.0, True])),
    wire(good_event(completion_logprobs=[-1e39, -1.0])), wire(good_event(completion_logprobs=[3.5e38, -1.0])),
    wire(good_event(completion_logprobs=[-1, 0])), wire(good_event(completion_logprobs=[-1.0])),
    wire(good_event(completion_logprobs=["-1.0", -1.0])), wire(good_event(prompt_token_ids=list(range(262_145)))),
    wire(good_event(schema_version=3, prompt_token_ids=[5, 6], completion_logprobs=[-0.1, -2.0])),
    wire(good_event("tool_call", arguments={"a": [[[[1]]]]})), wire(good_event(surprise=1)),
    wire(good_event(model=None)), wire(good_event("tool_result", ok=1)), wire(good_event(truncated=["output"])),
    wire({**OUTCOME, "call_id": "c1"}), wire({**OUTCOME, "value": 1}),
]


def test_json_lists_alone_are_checked_as_the_reference_checks_them() -> None:
    """Runs of JSON records only (no v3 record beside them, whose packed columns the reference converts another
    way): an int among logprobs beyond what float32 holds exactly is dead-lettered by Arrow in the reference."""
    for over in ({"completion_logprobs": [2**24 + 1]}, {"completion_logprobs": [-(2**24) - 1]},
                 {"completion_logprobs": [2**24]}, {"completion_logprobs": [-1, 0.5]},
                 {"prompt_token_ids": [2**31 - 1, -2**31]}):
        n = len(over.get("completion_logprobs", [0.0]))
        record = good_event(**over, **({"completion_token_ids": list(range(n))} if "completion_logprobs" in over
                                       else {}))
        assert_same("events", [wire(record)])
        assert_same("events", [wire(record), wire(good_event())])


def test_poison_between_good_records_is_rejected_as_the_reference_rejects_it() -> None:
    good = [encoded("v3", good_event(schema_version=3, event_id=f"g{i}")) for i in range(3)]
    assert_same("events", good + POISON + good)
    assert_same("events", [v for p in POISON for v in (p, good[0])])
    assert_same("outcomes", POISON)


FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.lists(mutated_events() | st.just(wire(good_event())) | st.just(encoded("v3", good_event())), max_size=10))
def test_runs_of_mutated_events_decode_as_the_reference(values: list[bytes]) -> None:
    assert_same("events", values)


@FUZZ
@given(st.lists(st.sampled_from(sorted(OUTCOME) + ["surprise"]), max_size=4), st.lists(json_values | timestamps))
def test_runs_of_mutated_outcomes_decode_as_the_reference(fields: list[str], values: list[Any]) -> None:
    records = [wire({**OUTCOME, f: v}) for f, v in zip(fields, values)] + [wire(OUTCOME)]
    assert_same("outcomes", records)


@FUZZ
@given(st.lists(st.binary(max_size=60) | json_values.map(wire), max_size=6))
def test_runs_of_arbitrary_values_decode_as_the_reference(values: list[bytes]) -> None:
    assert_same("events", values)


def test_the_fast_path_takes_the_common_records() -> None:
    # not a behaviour a user sees, but the reason decode_batch exists: v3 records must not fall back
    import flywheel.ingest.decode as decode

    rng = random.Random(2)
    values = [encoded("v3", realistic_event(rng, i)) for i in range(50)]
    fast, idx, _ = decode._decode_fast("events", TOPIC, 0, list(range(50)), values, NOW, {})
    assert fast is not None and idx == list(range(50)), f"only {len(idx)} of 50 v3 records took the fast path"
    assert json.loads(values[0])["schema_version"] == wire_format.PACKED_VERSION
    # JSON lists (the v1/v2 wire, or lists in a v3 record) too: their items are checked and packed in C
    values = [encoded("v1", realistic_event(rng, i)) for i in range(50)]
    fast, idx, _ = decode._decode_fast("events", TOPIC, 0, list(range(50)), values, NOW, {})
    assert fast is not None and idx == list(range(50)), f"only {len(idx)} of 50 v1 records took the fast path"
