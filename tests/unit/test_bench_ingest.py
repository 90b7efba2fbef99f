"""`flywheel bench ingest` without the stack: its --lake option and the JSON line it builds from the timings."""

from __future__ import annotations

import os

import pytest

from bench import ingest

# the default run's JSON fields, in order, as dashboards that parse the last line read them
DEFAULT_FIELDS = ["events", "mean_event_bytes", "raw_consume_events_per_s", "events_per_s", "mb_per_s", "ratio",
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
    local = ingest.summarize(args, 2_000_000, 0.5, 1.0, 3, [0.1, 0.2, 0.3], costs)
    assert list(local) == DEFAULT_FIELDS, f"the default JSON fields changed: {list(local)}"
    assert (local["raw_consume_events_per_s"], local["events_per_s"], local["ratio"]) == (2000.0, 1000.0, 0.5)
    # s3 writer 4 s, local writer 1 s on the same 1000 records, raw 0.5 s: ratios 0.125 and 0.5
    on_s3 = ingest.summarize(args, 2_000_000, 0.5, 4.0, 3, [0.1, 0.2, 0.3], costs, local_writer_s=1.0)
    assert [k for k in on_s3 if k != "ratio_local"] == DEFAULT_FIELDS
    assert list(on_s3).index("ratio_local") == list(on_s3).index("ratio") + 1, "ratio_local goes beside ratio"
    assert (on_s3["ratio"], on_s3["ratio_local"], on_s3["mb_per_s"]) == (0.125, 0.5, 0.5), on_s3


def test_environment_sets_the_s3_variables_for_the_block_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with ingest.environment({"AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}):
        assert (os.environ["AWS_REGION"], os.environ["AWS_ENDPOINT_URL"]) == ("us-east-1", "http://127.0.0.1:9000")
    assert os.environ["AWS_REGION"] == "eu-west-1", "a variable set before the block must be restored"
    assert "AWS_ENDPOINT_URL" not in os.environ, "a variable absent before the block must be removed"
