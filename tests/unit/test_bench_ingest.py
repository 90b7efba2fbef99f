"""`flywheel bench ingest` without the stack: its --lake option and the JSON line it builds from the timings."""

from __future__ import annotations

import os

import pytest

from bench import ingest

# the default run's JSON fields, in order, as dashboards that parse the last line read them
DEFAULT_FIELDS = ["events", "mean_event_bytes", "mean_event_bytes_v1", "raw_consume_events_per_s",
                  "raw_consume_v1_events_per_s", "events_per_s", "events_per_s_v1", "mb_per_s", "ratio", "ratio_v1",
                  "files", "live_rate", "p50_visible_s", "p95_visible_s", "max_visible_s", "raw_consume_us_per_event",
                  "json_decode_us", "cpu_count", "load_avg_1m"]


def test_lake_defaults_to_local_and_accepts_only_local_or_s3() -> None:
    assert ingest.parse_args([]).lake == "local"
    assert ingest.parse_args(["--lake", "s3", "--events", "500"]).lake == "s3"
    with pytest.raises(SystemExit):
        ingest.parse_args(["--lake", "gcs"])


def test_the_local_run_keeps_its_fields_and_an_s3_run_adds_the_local_ratio_beside_its_own() -> None:
    args = ingest.parse_args(["--events", "1000"])
    costs = {"json_decode_us": 10.0}
    # v3: raw 0.5 s, writer 1 s; v1: raw 0.4 s, writer 2 s (ratio 0.2)
    raw, writer = {"v3": 0.5, "v1": 0.4}, {"v3": 1.0, "v1": 2.0}
    wire_bytes = {"v3": 2_000_000, "v1": 3_000_000}
    local = ingest.summarize(args, wire_bytes, raw, writer, 3, [0.1, 0.2, 0.3], costs)
    assert list(local) == DEFAULT_FIELDS, f"the default JSON fields changed: {list(local)}"
    assert (local["raw_consume_events_per_s"], local["events_per_s"], local["ratio"]) == (2000.0, 1000.0, 0.5)
    assert (local["raw_consume_v1_events_per_s"], local["events_per_s_v1"], local["ratio_v1"]) == (2500.0, 500.0, 0.2)
    assert (local["mean_event_bytes"], local["mean_event_bytes_v1"]) == (2000, 3000), local
    # s3 writer 4 s, local writer 1 s on the same 1000 records, raw 0.5 s: ratios 0.125 and 0.5
    on_s3 = ingest.summarize(args, wire_bytes, raw, {**writer, "v3": 4.0}, 3, [0.1, 0.2, 0.3], costs,
                             local_writer_s=1.0)
    assert [k for k in on_s3 if k != "ratio_local"] == DEFAULT_FIELDS
    assert list(on_s3).index("ratio_local") == list(on_s3).index("ratio_v1") + 1, "ratio_local goes beside the ratios"
    assert (on_s3["ratio"], on_s3["ratio_local"], on_s3["mb_per_s"]) == (0.125, 0.5, 0.5), on_s3


def test_binary_adds_its_ratio_against_its_own_raw_consume() -> None:
    args = ingest.parse_args(["--events", "1000", "--binary"])
    raw, writer = {"v3": 0.5, "v1": 0.4, "binary": 0.25}, {"v3": 1.0, "v1": 2.0, "binary": 1.0}
    result = ingest.summarize(args, {"v3": 1, "v1": 1, "binary": 1}, raw, writer, 3, [0.1], {})
    assert (result["ratio_binary"], result["events_per_s_binary"]) == (0.25, 1000.0), result


def test_the_same_event_is_produced_in_every_format_and_lands_as_the_same_row() -> None:
    """v1 and v3 (and the binary envelope) of one event decode to one lake row: the comparison is fair."""
    import random

    from flywheel.ingest.lake_writer import decode_record, rows_to_table

    event = ingest.realistic_event(random.Random(0), 0)
    values = {fmt: ingest.encoded(fmt, event) for fmt in ingest.FORMATS}
    assert values["v3"][:1] == b"{" and values["binary"][:4] == b"\xffFW\x03", "v3 is JSON, binary is the envelope"
    tables = {}
    for fmt, value in values.items():
        row, _ = decode_record("events", value)
        row.update(_topic="t", _partition=0, _offset=0, _ingest_ts=row["ts"])
        tables[fmt] = rows_to_table("events", [row]).drop_columns(["schema_version"])
    assert tables["v1"].equals(tables["v3"]) and tables["v1"].equals(tables["binary"])


def test_environment_sets_the_s3_variables_for_the_block_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with ingest.environment({"AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}):
        assert (os.environ["AWS_REGION"], os.environ["AWS_ENDPOINT_URL"]) == ("us-east-1", "http://127.0.0.1:9000")
    assert os.environ["AWS_REGION"] == "eu-west-1", "a variable set before the block must be restored"
    assert "AWS_ENDPOINT_URL" not in os.environ, "a variable absent before the block must be removed"
