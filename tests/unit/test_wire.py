"""The wire format (ingest/wire.py): schema v3's packed token ids and logprobs, and the lake writer's decoding
of every version into the same lake rows, with malformed packed records dead-lettered with a reason."""

from __future__ import annotations

import array
import base64
import json
import math
import struct
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flywheel.ingest import lake, schema, wire
from flywheel.ingest.lake_writer import (
    DeadLetters,
    LakeWriter,
    LakeWriterConfig,
    Rejected,
    decode_record,
    rows_to_table,
)

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def llm_call(version: int = 1, **extra: object) -> dict:
    record = {
        "schema_version": version, "event_id": "e1", "session_id": "s1", "agent_id": "main", "seq": 0,
        "ts": "2026-11-30T10:00:00.000001+00:00", "type": "llm_call", "model": "policy-v0", "policy_version": 0,
        "prompt_token_ids": [0, 1, INT32_MAX, INT32_MIN, 151_643], "completion_token_ids": [7, 8, 9],
        "completion_logprobs": [-0.5, -1e-30, -87.25], "sampling": {"temperature": 1.0},
    }
    record.update(extra)
    return record


def f32(values: list[float]) -> list[float]:
    return list(array.array("f", values))


def b64(fmt: str, values: list) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}{fmt}", *values)).decode()


def v3_json(**fields: object) -> bytes:
    """A v3 record written by hand (not by wire.encode), so a malformed field is exactly what the test says."""
    record = llm_call(3)
    record.update(prompt_token_ids=b64("i", [1, 2, 3]), completion_token_ids=b64("i", [7, 8]),
                  completion_logprobs=b64("f", [-0.5, -0.25]))
    record.update(fields)
    return json.dumps(record).encode()


def reject(value: bytes) -> Rejected:
    with pytest.raises(Rejected) as info:
        decode_record("events", value)
    return info.value


# ---- round trip ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["packed", "binary"])
def test_v3_round_trip_is_exact_for_int32_ids_and_float32_logprobs(fmt: str) -> None:
    record = llm_call(3, summary_token_ids=None)
    value = wire.encode({k: v for k, v in record.items() if v is not None}, fmt)
    decoded = wire.decode(value)
    assert decoded["schema_version"] == 3
    assert isinstance(decoded["prompt_token_ids"], memoryview), "packed ids decode without a Python int per item"
    back = wire.as_lists(decoded)
    assert back["prompt_token_ids"] == record["prompt_token_ids"], "int32 ids, both ends of the range, exactly"
    assert back["completion_logprobs"] == f32(record["completion_logprobs"]), "logprobs as float32, bit for bit"
    assert {k: v for k, v in back.items() if k not in schema.PACKED_FIELDS} == \
        {k: v for k, v in record.items() if k not in schema.PACKED_FIELDS and v is not None}
    schema.validate_event(decoded)
    schema.check_limits(decoded)


def test_packed_is_json_whose_list_fields_are_base64_of_little_endian_items() -> None:
    value = wire.encode(llm_call(3), "packed")
    raw = json.loads(value)  # every reader that json.loads a record (event_id, session_id ...) still can
    assert raw["schema_version"] == 3 and raw["event_id"] == "e1"
    assert base64.b64decode(raw["completion_token_ids"]) == struct.pack("<3i", 7, 8, 9)
    assert base64.b64decode(raw["completion_logprobs"]) == struct.pack("<3f", -0.5, -1e-30, -87.25)


def test_json_format_keeps_lists_and_writes_v2_at_most() -> None:
    raw = json.loads(wire.encode(llm_call(3), "json"))
    assert raw["schema_version"] == wire.JSON_VERSION and raw["prompt_token_ids"] == llm_call()["prompt_token_ids"]
    assert json.loads(wire.encode(llm_call(1), "json"))["schema_version"] == 1


def test_a_v3_record_with_plain_json_lists_is_still_read() -> None:
    """v3 adds an encoding, it does not take one away: a producer that sets schema.SCHEMA_VERSION and sends lists."""
    row, _ = decode_record("events", json.dumps(llm_call(3)).encode())
    assert row["prompt_token_ids"] == llm_call()["prompt_token_ids"] and row["schema_version"] == 3


def test_encoding_refuses_an_id_beyond_int32() -> None:
    with pytest.raises(OverflowError):
        wire.encode(llm_call(3, prompt_token_ids=[INT32_MAX + 1]), "packed")


# ---- every version lands as the same lake row ------------------------------------------------------
@pytest.mark.parametrize("version", [1, 2])
def test_v1_and_v2_still_decode_and_land_as_the_v3_row(version: int) -> None:
    rows = {}
    for name, value in (("json", json.dumps(llm_call(version)).encode()), ("v3", wire.encode(llm_call(3), "packed"))):
        row, date = decode_record("events", value)
        assert date == "2026-11-30"
        row.update(_topic="t", _partition=0, _offset=0, _ingest_ts=row["ts"])
        rows[name] = rows_to_table("events", [row])
    assert rows["json"].drop_columns(["schema_version"]).equals(rows["v3"].drop_columns(["schema_version"]))
    assert rows["v3"].column("prompt_token_ids").to_pylist() == [llm_call()["prompt_token_ids"]]
    assert rows["v3"].schema == schema.event_arrow_schema(), "the lake schema is the one derived from schema.py"


def context_edit(version: int, **extra: object) -> dict:
    record = {k: v for k, v in llm_call(version).items() if k not in schema.PACKED_FIELDS and k not in
              ("model", "policy_version", "sampling")}
    return {**record, "type": "context_edit", "edit_kind": "summarize", "tokens_removed": 3, **extra}


def test_a_chunk_mixing_versions_and_missing_lists_converts_in_one_pass() -> None:
    values = [json.dumps(llm_call(1)).encode(), wire.encode(llm_call(3), "packed"),
              json.dumps(context_edit(1)).encode(), wire.encode(context_edit(3, summary_token_ids=[5, 6]), "packed")]
    rows = []
    for i, value in enumerate(values):
        row, _ = decode_record("events", value)
        row.update(_topic="t", _partition=0, _offset=i, _ingest_ts=row["ts"])
        rows.append(row)
    table = rows_to_table("events", rows)
    table.validate(full=True)
    ids = llm_call()["prompt_token_ids"]
    assert table.column("prompt_token_ids").to_pylist() == [ids, ids, None, None]
    assert table.column("summary_token_ids").to_pylist() == [None, None, None, [5, 6]]
    assert table.column("completion_logprobs").to_pylist()[1] == f32(llm_call()["completion_logprobs"])


# ---- malformed packed records: to the DLQ with a reason ---------------------------------------------
@pytest.mark.parametrize(("value", "reason", "words"), [
    (v3_json(completion_token_ids=base64.b64encode(b"\x01\x00\x00\x00\x02\x00").decode()), "malformed_packed",
     "6 bytes is not a whole number of 4-byte items"),
    (v3_json(prompt_token_ids="not base64!"), "malformed_packed", "not base64"),
    (v3_json(prompt_token_ids="AQAAAA"), "malformed_packed", "not base64"),  # padding cut
    (v3_json(prompt_token_ids={"a": 1}), "malformed_packed", "base64 of little-endian int32 (or a JSON list), got dict"),
    (v3_json(prompt_token_ids=[1, "2"]), "invalid", "field 'prompt_token_ids' should be ints"),
    (v3_json(completion_token_ids=b64("i", [7, 8, 9])), "invalid", "completion_logprobs has 2 values for 3"),
    (v3_json(completion_logprobs=b64("f", [-0.5, math.nan])), "invalid", "float32 items holding NaN"),
    (v3_json(completion_logprobs=b64("f", [-math.inf, -0.5])), "float_out_of_range", "infinity"),
])
def test_a_malformed_packed_field_is_rejected_with_a_reason_naming_it(value: bytes, reason: str, words: str) -> None:
    rejected = reject(value)
    assert rejected.reason == reason and words in rejected.detail, (rejected.reason, rejected.detail)


def test_binary_envelopes_with_wrong_lengths_are_rejected() -> None:
    good = wire.encode(llm_call(3), "binary")
    assert decode_record("events", good)[0]["event_id"] == "e1"
    for value, words in ((good[:-2], "run past the value's end"), (good + b"\0\0\0\0", "4 bytes after the last"),
                         (good[:6], "shorter than its fixed header"),
                         (good[:4] + struct.pack("<I", 10**6) + good[8:], "runs past the value's")):
        rejected = reject(value)
        assert rejected.reason == "malformed_packed" and words in rejected.detail, (rejected.reason, rejected.detail)


def test_logprob_count_must_match_the_completion_in_every_version() -> None:
    for value in (json.dumps(llm_call(1, completion_logprobs=[-0.5])).encode(),
                  wire.encode(llm_call(3, completion_logprobs=[-0.5]), "packed")):
        rejected = reject(value)
        assert rejected.reason == "invalid" and "completion_logprobs has 1 values for 3" in rejected.detail, rejected.detail


def test_the_writer_lands_good_records_of_every_version_and_dead_letters_the_bad(tmp_path: Path) -> None:
    cfg = LakeWriterConfig(events_topic="t", outcomes_topic="", lake_root=str(tmp_path))
    writer = LakeWriter(cfg, DeadLetters(None, cfg.dlq_topic, str(tmp_path)))
    writer.assign([("t", 0)])
    values = [json.dumps(llm_call(1, event_id="a")).encode(), wire.encode(llm_call(3, event_id="b"), "packed"),
              v3_json(event_id="c", prompt_token_ids="AQAAAA"), wire.encode(llm_call(3, event_id="d"), "packed"),
              json.dumps(llm_call(1, event_id="e", prompt_token_ids=[2**40])).encode()]  # beyond the int32 column
    for offset, value in enumerate(values):
        writer.add("t", 0, offset, value)
    writer.flush_all()
    files = lake.list_files(str(tmp_path), "events")
    assert [(f.first, f.last) for f in files] == [(0, 4)], "one file covers every offset, dead letters included"
    table = pq.read_table(files[0].path)
    assert table.column("event_id").to_pylist() == ["a", "b", "d"]
    assert table.column("prompt_token_ids").to_pylist() == [llm_call()["prompt_token_ids"]] * 3
    dead = {(e["offset"], e["reason"]) for e in writer.dlq.sent}
    assert dead == {(2, "malformed_packed"), (4, "unstorable")}, writer.dlq.sent
    assert base64.b64decode(next(e for e in writer.dlq.sent if e["offset"] == 2)["original_b64"]) == values[2]


# ---- the SDK's switch ------------------------------------------------------------------------------
@pytest.mark.parametrize(("wire_format", "version", "packed"), [("packed", 3, True), ("json", 2, False)])
def test_the_sdk_emits_the_wire_format_it_is_given(tmp_path: Path, wire_format: str, version: int, packed: bool) -> None:
    import socket

    from flywheel.ingest.sdk import SessionLogger
    from flywheel.ingest.spool import Spool

    with socket.socket() as sock:  # a port nobody listens on: every record goes to the spool
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    log = SessionLogger(dead, name="w", spool_dir=tmp_path / "spool", retry_s=0.2, wire_format=wire_format)
    s = log.attach("sess-w")
    s.llm_call(model="m", policy_version=0, prompt_token_ids=[1, INT32_MAX], completion_token_ids=[2, 3],
               completion_logprobs=[-0.5, -0.1])
    s.llm_call(model="m", policy_version=0, prompt_token_ids=[INT32_MAX + 1], completion_token_ids=[2],
               completion_logprobs=[-0.5])  # beyond the lake's int32 column: dropped before it leaves
    log.close(timeout=5)
    spool = Spool(tmp_path / "spool")
    values = spool.peek(10)
    spool.close()
    assert len(values) == 1 and log.metrics()["limited"] == 1, (values, log.metrics())
    raw = json.loads(values[0])
    assert raw["schema_version"] == version and isinstance(raw["prompt_token_ids"], str) == packed, raw
    row, _ = decode_record("events", values[0])
    assert wire.as_lists(row)["prompt_token_ids"] == [1, INT32_MAX]
    assert f32(wire.as_lists(row)["completion_logprobs"]) == f32([-0.5, -0.1]), "the lake column is float32 either way"
