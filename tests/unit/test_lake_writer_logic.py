"""Lake writer logic without Kafka: decoding, dead letters, rolls, claims, compaction."""

from __future__ import annotations

import datetime as dt
import functools
import json
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pyarrow.parquet as pq
import pytest
from kafka import TopicPartition

from flywheel.ingest import lake, schema
from flywheel.ingest.compact import CompactConfig, compact, plan_compaction
from flywheel.ingest.lake_writer import (
    DeadLetters,
    LakeWriter,
    LakeWriterConfig,
    Rejected,
    _commit_hint,
    _JoinWatch,
    _loop,
    _NeverJoined,
    _Rebalance,
    _StallWatch,
    decode_record,
)

TOPIC = "flywheel.events"


def event(i: int, ts: str = "2026-11-30T10:00:00.000001+00:00", **extra: object) -> dict:
    record = {
        "schema_version": 1, "event_id": f"e{i:08d}", "session_id": f"s{i % 7}", "agent_id": "main", "seq": i,
        "ts": ts, "type": "llm_call", "model": "policy-v0", "policy_version": 0,
        "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5], "completion_logprobs": [-0.5, -0.25],
        "sampling": {"temperature": 1.0},
    }
    record.update(extra)
    return record


def wire(record: object) -> bytes:
    return json.dumps(record).encode()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_writer(root: Path, clock: Clock | None = None, **overrides: object) -> LakeWriter:
    cfg = LakeWriterConfig(events_topic=TOPIC, outcomes_topic="", lake_root=str(root), **overrides)
    return LakeWriter(cfg, DeadLetters(None, cfg.dlq_topic, str(root)), clock=clock or Clock())


def lake_rows(root: Path) -> list[int]:
    offsets: list[int] = []
    for f in lake.list_files(str(root), "events"):
        offsets += pq.read_table(f.path).column("_offset").to_pylist()
    return offsets


def assert_exact(root: Path, expected: range) -> None:
    files = lake.list_files(str(root), "events")
    offsets = lake_rows(root)
    assert sorted(offsets) == list(expected), f"lake offsets {sorted(offsets)[:10]}... ({len(offsets)}) != {expected}"
    # files of one stream tile the consumed range: contiguous, never overlapping
    ranges = sorted((f.first, f.last) for f in files)
    for (a0, a1), (b0, b1) in zip(ranges, ranges[1:]):
        assert b0 == a1 + 1, f"files {a0}..{a1} and {b0}..{b1} are not contiguous"


# ---- decoding -------------------------------------------------------------------------------
def test_decode_converts_by_kind() -> None:
    row, date = decode_record("events", wire(event(1)))
    assert date == "2026-11-30"
    assert row["ts"] == dt.datetime(2026, 11, 30, 10, 0, 0, 1, tzinfo=dt.timezone.utc)
    assert json.loads(row["sampling"]) == {"temperature": 1.0}, "json columns are stored as their JSON text"


@pytest.mark.parametrize("value, reason", [
    (b"{not json", "malformed_json"),
    (b"\xff\xfe\x00garbage", "not_utf8"),
    (wire(event(1, schema_version=99)), "unsupported_schema_version"),
    (wire({k: v for k, v in event(1).items() if k != "session_id"}), "invalid"),
    (wire(event(1, surprise=1)), "invalid"),
    (b"[1, 2]", "invalid"),
    (b"x" * (schema.MAX_RECORD_BYTES + 1), "oversized"),
    (None, "empty"),
])
def test_decode_rejects_with_reason(value: bytes | None, reason: str) -> None:
    with pytest.raises(Rejected) as info:
        decode_record("events", value)
    assert info.value.reason == reason, f"{value!r:.40} rejected as {info.value.reason}: {info.value.detail}"


# ---- rolls and ranges -----------------------------------------------------------------------
def test_count_roll_names_files_by_range(tmp_path: Path) -> None:
    w = make_writer(tmp_path, roll_max_records=4)
    assert w.assign([(TOPIC, 0)]) == {(TOPIC, 0): None}
    for i in range(10):
        w.add(TOPIC, 0, i, wire(event(i)))
    w.flush_all()
    names = [Path(f.path).name for f in lake.list_files(str(tmp_path), "events")]
    assert names == [lake.file_name(TOPIC, 0, a, b) for a, b in ((0, 3), (4, 7), (8, 9))], names
    assert_exact(tmp_path, range(10))
    assert lake.next_offsets(str(tmp_path), "events", TOPIC) == {0: 10}


def test_rows_follow_the_lake_schema(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 2)])
    w.add(TOPIC, 2, 5, wire(event(5)))
    w.flush_all()
    (f,) = lake.list_files(str(tmp_path), "events")
    table = pq.read_table(f.path)
    assert table.schema.remove_metadata().equals(schema.event_arrow_schema().remove_metadata()), table.schema
    row = table.to_pylist()[0]
    assert (row["_topic"], row["_partition"], row["_offset"], row["event_id"]) == (TOPIC, 2, 5, "e00000005")
    assert (f.first, f.last) == (5, 5), "an empty lake starts at the first record's offset"


def test_age_roll_publishes_a_quiet_partition(tmp_path: Path) -> None:
    clock = Clock()
    w = make_writer(tmp_path, clock, roll_max_age_s=2.0)
    w.assign([(TOPIC, 0)])
    w.add(TOPIC, 0, 0, wire(event(0)))
    clock.t += 1.9
    w.roll_due()
    assert lake.list_files(str(tmp_path), "events") == [], "published before roll_max_age_s"
    clock.t += 0.2
    w.roll_due()
    assert len(lake.list_files(str(tmp_path), "events")) == 1, "not published after roll_max_age_s"


def test_date_change_rolls_the_file(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0)])
    dates = ["2026-11-29T23:59:59+00:00", "2026-11-29T23:59:59.5+00:00", "2026-11-30T00:00:00+00:00",
             "2026-11-29T23:00:00+00:00"]  # a late event of the previous day too
    for i, ts in enumerate(dates):
        w.add(TOPIC, 0, i, wire(event(i, ts=ts)))
    w.flush_all()
    files = lake.list_files(str(tmp_path), "events")
    assert [(f.date, f.first, f.last) for f in files] == [
        ("2026-11-29", 0, 1), ("2026-11-30", 2, 2), ("2026-11-29", 3, 3)], files
    assert lake.next_offsets(str(tmp_path), "events", TOPIC) == {0: 4}


def test_restart_resumes_from_the_lake(tmp_path: Path) -> None:
    w = make_writer(tmp_path, roll_max_records=3)
    w.assign([(TOPIC, 0)])
    for i in range(7):
        w.add(TOPIC, 0, i, wire(event(i)))
    # "killed": offsets 6 was buffered, never published
    w2 = make_writer(tmp_path, roll_max_records=3)
    assert w2.assign([(TOPIC, 0)]) == {(TOPIC, 0): 6}
    for i in range(4, 10):  # a fetch may replay records before the seek position; they are skipped
        w2.add(TOPIC, 0, i, wire(event(i)))
    w2.flush_all()
    assert_exact(tmp_path, range(10))


# ---- dead letters ---------------------------------------------------------------------------
def test_bad_records_go_to_the_dlq_and_stay_in_the_range(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0)])
    values = [wire(event(0)), b"{oops", wire(event(2)), b"\x80\x81", wire(event(4, schema_version=99))]
    for i, v in enumerate(values):
        w.add(TOPIC, 0, i, v, key=b"k")
    w.flush_all()
    assert [e["reason"] for e in w.dlq.sent] == ["malformed_json", "not_utf8", "unsupported_schema_version"]
    assert [e["offset"] for e in w.dlq.sent] == [1, 3, 4]
    import base64
    assert base64.b64decode(w.dlq.sent[1]["original_b64"]) == b"\x80\x81", "the DLQ must carry the original bytes"
    (f,) = lake.list_files(str(tmp_path), "events")
    assert (f.first, f.last) == (0, 4), "dead-lettered offsets still count as consumed"
    assert sorted(lake_rows(tmp_path)) == [0, 2]


def test_an_all_bad_range_is_a_zero_row_file(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0)])
    w.add(TOPIC, 0, 0, b"nope", kafka_ts_ms=1_764_460_800_000)  # 2025-11-30 00:00 UTC
    w.flush_all()
    (f,) = lake.list_files(str(tmp_path), "events")
    assert (f.date, f.first, f.last, pq.read_table(f.path).num_rows) == ("2025-11-30", 0, 0, 0)
    assert lake.next_offsets(str(tmp_path), "events", TOPIC) == {0: 1}


def test_a_row_arrow_cannot_hold_is_dead_lettered_alone(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0)])
    w.add(TOPIC, 0, 0, wire(event(0)))
    w.add(TOPIC, 0, 1, wire(event(1, prompt_token_ids=[2 ** 40])))  # valid JSON int, beyond the int32 column
    w.add(TOPIC, 0, 2, wire(event(2)))
    w.flush_all()
    assert [(e["reason"], e["offset"]) for e in w.dlq.sent] == [("unstorable", 1)]
    assert sorted(lake_rows(tmp_path)) == [0, 2]


# ---- several writers: claims keep ranges from overlapping ------------------------------------
def test_a_stale_writer_follows_the_new_owners_longer_claim(tmp_path: Path) -> None:
    stale, owner = make_writer(tmp_path), make_writer(tmp_path, roll_max_records=15)
    stale.assign([(TOPIC, 0)])
    owner.assign([(TOPIC, 0)])
    for i in range(10):
        stale.add(TOPIC, 0, i, wire(event(i)))
    for i in range(20):
        owner.add(TOPIC, 0, i, wire(event(i)))  # publishes 0..14 at the count roll
    stale.flush_all()  # it would publish 0..9: the claim says 0..14, so it waits
    assert_exact_after = [(f.first, f.last) for f in lake.list_files(str(tmp_path), "events")]
    assert assert_exact_after == [(0, 14)], assert_exact_after
    for i in range(10, 20):
        stale.add(TOPIC, 0, i, wire(event(i)))  # reaches 14: publishes the identical range 0..14
    stale.flush_all()
    owner.flush_all()
    assert stale.stats.conformed >= 1
    assert_exact(tmp_path, range(20))


def test_a_new_owner_follows_a_shorter_claim_of_a_writer_that_died(tmp_path: Path) -> None:
    owner = make_writer(tmp_path)
    # the dead writer claimed 0..9 and died before renaming its file
    lake.claim_range(str(tmp_path), "events", TOPIC, 0, 0, 9, "2026-11-30")
    owner.assign([(TOPIC, 0)])
    for i in range(25):
        owner.add(TOPIC, 0, i, wire(event(i, ts="2026-11-30T12:00:00+00:00")))
    owner.flush_all()
    assert [(f.first, f.last) for f in lake.list_files(str(tmp_path), "events")] == [(0, 9), (10, 24)]
    assert_exact(tmp_path, range(25))


def test_a_claimed_range_ends_before_a_log_gap(tmp_path: Path) -> None:
    lake.claim_range(str(tmp_path), "events", TOPIC, 0, 0, 5, "2026-11-30")
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0)])
    for i in (0, 1, 2, 8, 9):  # offsets 3..7 are absent from the log (compacted topic or transaction markers)
        w.add(TOPIC, 0, i, wire(event(i)))
    w.flush_all()
    assert [(f.first, f.last) for f in lake.list_files(str(tmp_path), "events")] == [(0, 5), (6, 9)]
    assert sorted(lake_rows(tmp_path)) == [0, 1, 2, 8, 9]


def test_revoke_publishes_open_files(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0), (TOPIC, 1)])
    w.add(TOPIC, 0, 0, wire(event(0)))
    w.add(TOPIC, 1, 0, wire(event(1)))
    w.revoke([(TOPIC, 1)])
    assert [(f.partition, f.first) for f in lake.list_files(str(tmp_path), "events")] == [(1, 0)]
    assert (TOPIC, 1) not in w.next_offset
    with pytest.raises(AssertionError):
        w.add(TOPIC, 1, 1, wire(event(2)))


# ---- the process: rebalance listener and loop, with a fake consumer --------------------------------
class FakeConsumer:
    """What the rebalance listener and the loop call on a KafkaConsumer; polls return `batches` in turn."""

    def __init__(self, batches: list[dict] | None = None, ends: dict[tuple[str, int], int] | None = None) -> None:
        self.batches = list(batches or [])
        self.seeks: dict[tuple[str, int], int | None] = {}
        self.commits: list[dict] = []
        self.ends = ends  # log end offsets; None: the broker does not answer
        self.paused: list[tuple[str, int]] = []
        self.end_offset_calls = 0

    def end_offsets(self, parts: list, timeout_ms: int) -> dict:
        self.end_offset_calls += 1
        if self.ends is None:
            raise TimeoutError("no answer")
        return {t: self.ends.get((t.topic, t.partition), 0) for t in parts}

    def pause(self, *parts: object) -> None:
        self.paused += [(t.topic, t.partition) for t in parts]

    def seek(self, tp: object, offset: int) -> None:
        self.seeks[(tp.topic, tp.partition)] = offset

    def seek_to_beginning(self, tp: object) -> None:
        self.seeks[(tp.topic, tp.partition)] = None

    def commit_async(self, offsets: dict) -> None:
        self.commits.append(offsets)

    def poll(self, timeout_ms: int, max_records: int) -> dict:
        return self.batches.pop(0) if self.batches else {}

    def group_metadata(self) -> object:
        from kafka.structs import ConsumerGroupMetadata, MemberState

        return ConsumerGroupMetadata(group_id="test", generation_id=1, state=MemberState.STABLE)


def tp(partition: int, topic: str = TOPIC) -> TopicPartition:
    return TopicPartition(topic, partition)


def messages(offsets: range) -> list[SimpleNamespace]:
    return [SimpleNamespace(offset=i, value=wire(event(i)), key=None, timestamp=None) for i in offsets]


def test_rebalance_resumes_assigned_partitions_from_the_lake(tmp_path: Path) -> None:
    first = make_writer(tmp_path, roll_max_records=3)
    first.assign([(TOPIC, 0)])
    for i in range(3):
        first.add(TOPIC, 0, i, wire(event(i)))
    consumer = FakeConsumer()
    w = make_writer(tmp_path)
    rebalance = _Rebalance(w, consumer)
    rebalance.on_partitions_assigned({tp(0), tp(1)})
    rebalance.raise_failure()
    assert consumer.seeks == {(TOPIC, 0): 3, (TOPIC, 1): None}, \
        f"partition 0 must resume after the lake's 0..2 and partition 1 from the beginning, got {consumer.seeks}"
    w.add(TOPIC, 0, 3, wire(event(3)))
    rebalance.on_partitions_revoked({tp(0)})
    assert [(f.first, f.last) for f in lake.list_files(str(tmp_path), "events")] == [(0, 2), (3, 3)]
    assert (TOPIC, 0) not in w.next_offset and (TOPIC, 1) in w.next_offset


def test_a_failed_assignment_is_raised_by_the_loop(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    rebalance = _Rebalance(w, FakeConsumer())
    rebalance.on_partitions_assigned({tp(0, topic="not.subscribed")})  # kafka-python would swallow a raise here
    assert len(rebalance.failures) == 1
    with pytest.raises(RuntimeError, match="could not resume assigned partitions"):
        rebalance.raise_failure()


def test_the_loop_writes_polled_records_and_publishes_open_files_on_stop(tmp_path: Path) -> None:
    consumer = FakeConsumer([{tp(0): messages(range(0, 4)), tp(1): messages(range(0, 2))},
                             {tp(0): messages(range(4, 6))}], ends={(TOPIC, 0): 6, (TOPIC, 1): 2})
    w = make_writer(tmp_path, roll_max_records=4, status_interval_s=3600.0)
    w.on_published = functools.partial(_commit_hint, consumer)
    rebalance = _Rebalance(w, consumer)
    rebalance.on_partitions_assigned({tp(0)})  # partition 1 is not ours: its records are skipped
    polls = iter(range(3))
    _loop(w.cfg, consumer, w, rebalance, "lake-writer-test", lambda: next(polls, None) is None)
    assert [(f.partition, f.first, f.last) for f in lake.list_files(str(tmp_path), "events")] == [(0, 0, 3), (0, 4, 5)]
    committed = [(t.partition, o.offset) for c in consumer.commits for t, o in c.items()]
    assert committed == [(0, 4), (0, 6)], f"a commit hint after each publish names the next offset, got {committed}"


# ---- compaction -----------------------------------------------------------------------------
def test_compaction_merges_closed_dates_and_keeps_every_row(tmp_path: Path) -> None:
    w = make_writer(tmp_path, roll_max_records=3)
    w.assign([(TOPIC, 0)])
    for i in range(10):
        w.add(TOPIC, 0, i, wire(event(i, ts="2026-11-28T08:00:00+00:00")))
    w.add(TOPIC, 0, 10, b"bad")
    for i in range(11, 14):
        w.add(TOPIC, 0, i, wire(event(i, ts="2026-11-30T08:00:00+00:00")))
    w.flush_all()
    before = lake.list_files(str(tmp_path), "events")
    totals = compact(CompactConfig(lake_root=str(tmp_path), before="2026-11-29"))
    after = lake.list_files(str(tmp_path), "events")
    assert [(f.date, f.first, f.last) for f in after if f.date == "2026-11-28"] == [("2026-11-28", 0, 10)], after
    assert [f for f in after if f.date == "2026-11-30"] == [f for f in before if f.date == "2026-11-30"], \
        "an open date partition must not be compacted"
    assert totals["merged_files"] == 4
    assert sorted(lake_rows(tmp_path)) == list(range(10)) + [11, 12, 13]
    assert lake.next_offsets(str(tmp_path), "events", TOPIC) == {0: 14}
    assert len(list(tmp_path.glob("events/date=2026-11-28/*.parquet"))) == 1, "originals were not deleted"


def test_compaction_cleans_up_after_a_crash_between_publish_and_delete(tmp_path: Path) -> None:
    import pyarrow as pa

    w = make_writer(tmp_path, roll_max_records=2)
    w.assign([(TOPIC, 0)])
    for i in range(4):
        w.add(TOPIC, 0, i, wire(event(i, ts="2026-11-28T08:00:00+00:00")))
    w.flush_all()
    originals = lake.list_files(str(tmp_path), "events")
    merged = pa.concat_tables([pq.read_table(f.path) for f in originals])
    lake.write_file(str(tmp_path), "events", "2026-11-28", TOPIC, 0, 0, 3, merged)  # the crash came here
    assert sorted(lake_rows(tmp_path)) == [0, 1, 2, 3], "readers must see one copy mid-compaction"
    totals = compact(CompactConfig(lake_root=str(tmp_path), before="2026-11-29"))
    assert totals["leftovers_deleted"] == 2
    assert len(list(tmp_path.glob("events/date=2026-11-28/*.parquet"))) == 1


def test_plan_compaction_respects_size_gaps_and_target() -> None:
    def f(first: int, last: int, date: str = "2026-11-01") -> lake.LakeFile:
        return lake.LakeFile("events", date, TOPIC, 0, first, last, f"/l/{first}")

    files = [f(0, 9), f(10, 19), f(20, 29), f(40, 49), f(50, 59), f(60, 69), f(70, 79, "2026-12-01")]
    sizes = {x.path: 10 for x in files}
    sizes["/l/20"] = 10_000  # big: stays as it is
    runs = plan_compaction(files, sizes, before="2026-11-30", small_file_bytes=1000, target_rows=20)
    assert [[(x.first, x.last) for x in r] for r in runs] == [[(0, 9), (10, 19)], [(40, 49), (50, 59)]]


def test_config_rejects_contradictions() -> None:
    from flywheel.base.config import ConfigError

    with pytest.raises(ConfigError, match="dlq_topic"):
        LakeWriterConfig(dlq_topic=schema.EVENTS_TOPIC).check()
    with pytest.raises(ConfigError, match="session_timeout_s"):
        LakeWriterConfig(session_timeout_s=1).check()


def test_compact_command_and_stale_temps(tmp_path: Path) -> None:
    import os
    import time

    from flywheel.ingest.compact import main as compact_main

    w = make_writer(tmp_path, roll_max_records=2)
    w.assign([(TOPIC, 0)])
    for i in range(6):
        w.add(TOPIC, 0, i, wire(event(i, ts="2026-11-28T08:00:00+00:00")))
    w.flush_all()
    day = tmp_path / "events" / "date=2026-11-28"
    old_tmp, new_tmp = day / ".dead.tmp", day / ".inflight.tmp"
    old_tmp.write_bytes(b"x")
    new_tmp.write_bytes(b"y")
    os.utime(old_tmp, (time.time() - 7200, time.time() - 7200))
    assert compact_main(["--lake-root", str(tmp_path), "--before", "2026-11-29", "--dry-run"]) == 0
    assert len(lake.list_files(str(tmp_path), "events")) == 3, "a dry run must not change the lake"
    assert compact_main(["--lake-root", str(tmp_path), "--before", "2026-11-29"]) == 0
    assert [(f.first, f.last) for f in lake.list_files(str(tmp_path), "events")] == [(0, 5)]
    assert not old_tmp.exists() and new_tmp.exists(), "only temps older than stale_temp_s may go"


class _TooLarge:
    """A producer whose broker refuses every record as too large."""

    def send(self, topic: str, key: bytes, value: bytes) -> object:
        from kafka.errors import MessageSizeTooLargeError

        raise MessageSizeTooLargeError(f"{len(value)} bytes")

    def flush(self) -> None:
        pass


def test_a_dead_letter_too_large_for_the_topic_is_kept_in_the_lake(tmp_path: Path) -> None:
    import base64

    dlq = DeadLetters(_TooLarge(), "flywheel.dlq", str(tmp_path))
    from flywheel.ingest.lake_writer import dlq_envelope

    dlq.send(dlq_envelope("oversized", "big", TOPIC, 3, 77, b"\x00" * 1000))
    dlq.flush()
    (kept,) = (tmp_path / "_dlq" / TOPIC).iterdir()
    envelope = json.loads(kept.read_text())
    assert (envelope["reason"], envelope["offset"]) == ("oversized", 77)
    assert base64.b64decode(envelope["original_b64"]) == b"\x00" * 1000
    assert lake.list_files(str(tmp_path), "events") == [], "spilled letters are not lake rows"


def test_a_writer_follows_a_chain_of_claims_and_publishes_the_remainder(tmp_path: Path) -> None:
    stale, owner = make_writer(tmp_path, roll_max_records=10), make_writer(tmp_path, roll_max_records=100)
    stale.assign([(TOPIC, 0)])
    owner.assign([(TOPIC, 0)])
    for i in range(20):
        stale.add(TOPIC, 0, i, wire(event(i)))  # publishes 0..9 and 10..19 at its count rolls
    for i in range(31):
        owner.add(TOPIC, 0, i, wire(event(i)))
    owner.flush_all()  # follows 0..9, then 10..19, then publishes its own 20..30
    assert [(f.first, f.last) for f in lake.list_files(str(tmp_path), "events")] == [(0, 9), (10, 19), (20, 30)]
    assert owner.buffers == {}, "the remainder after the followed claims must be published too"
    assert_exact(tmp_path, range(31))


def test_revoke_leaves_nothing_behind_for_the_partition(tmp_path: Path) -> None:
    lake.claim_range(str(tmp_path), "events", TOPIC, 0, 0, 4, "2026-11-30")
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0)])
    for i in range(8):
        w.add(TOPIC, 0, i, wire(event(i)))
    w.revoke([(TOPIC, 0)])
    assert [(f.first, f.last) for f in lake.list_files(str(tmp_path), "events")] == [(0, 4), (5, 7)]
    assert w.buffers == {} and w.next_offset == {}


def test_the_writer_has_no_local_only_logic(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/lake"
    w = make_writer(tmp_path, roll_max_records=3)
    w.cfg.lake_root = root
    w.assign([(TOPIC, 0)])
    for i in range(7):
        w.add(TOPIC, 0, i, wire(event(i)) if i != 4 else b"bad")
    w.flush_all()
    assert [(f.first, f.last) for f in lake.list_files(root, "events")] == [(0, 2), (3, 5), (6, 6)]
    assert lake.read_claim(root, "events", TOPIC, 0, 3) == lake.Claim(3, 5, "2026-11-30")
    assert sorted(lake_rows(tmp_path / "lake")) == [0, 1, 2, 3, 5, 6]


# ---- duplicates: the SDK is at-least-once; the writer drops ids it landed within its window ------------
def ids_in_lake(root: Path) -> list[tuple[int, str]]:
    rows = [r for f in lake.list_files(str(root), "events") for r in pq.read_table(f.path).to_pylist()]
    return sorted((r["_offset"], r["event_id"]) for r in rows)


def test_a_replayed_event_within_the_window_is_dropped_and_its_offset_covered(tmp_path: Path) -> None:
    w = make_writer(tmp_path, roll_max_records=4)
    w.assign([(TOPIC, 0)])
    ids = [0, 1, 2, 3, 4, 2, 3, 5]  # offsets 5 and 6 replay events 2 and 3 (one across a file boundary)
    for offset, i in enumerate(ids):
        w.add(TOPIC, 0, offset, wire(event(i)))
    w.flush_all()
    assert ids_in_lake(tmp_path) == [(o, f"e{i:08d}") for o, i in enumerate(ids) if o not in (5, 6)]
    assert (w.stats.duplicates, w.stats.dlq, w.dlq.sent) == (2, 0, []), "a duplicate is counted, not dead-lettered"
    assert_exact_ranges = [(f.first, f.last) for f in lake.list_files(str(tmp_path), "events")]
    assert assert_exact_ranges == [(0, 3), (4, 7)], f"the dropped offsets must stay covered: {assert_exact_ranges}"


def test_the_window_is_rebuilt_from_the_lake_after_a_restart(tmp_path: Path) -> None:
    first = make_writer(tmp_path, roll_max_records=5)
    first.assign([(TOPIC, 0)])
    for i in range(10):
        first.add(TOPIC, 0, i, wire(event(i)))  # publishes 0..4 and 5..9
    second = make_writer(tmp_path, dedup_window=6)
    assert second.assign([(TOPIC, 0)]) == {(TOPIC, 0): 10}
    assert len(second.windows[(TOPIC, 0)]) == 6, "the window holds the ids of the lake's last 6 rows"
    for offset, i in zip(range(10, 14), (9, 3, 5, 10)):  # 3 is 7 rows back: beyond a window of 6, so it lands
        second.add(TOPIC, 0, offset, wire(event(i)))
    second.flush_all()
    assert [i for o, i in ids_in_lake(tmp_path) if o >= 10] == ["e00000003", "e00000010"]
    assert second.stats.duplicates == 2


def test_a_redone_range_drops_the_same_duplicates(tmp_path: Path) -> None:
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 5, 8, 6, 9, 2, 10]

    def feed(w: LakeWriter, offsets: range) -> None:
        for o in offsets:
            w.add(TOPIC, 0, o, wire(event(ids[o])))

    whole = make_writer(tmp_path / "whole", roll_max_records=5, dedup_window=4)
    whole.assign([(TOPIC, 0)])
    feed(whole, range(len(ids)))
    whole.flush_all()
    killed = make_writer(tmp_path / "redo", roll_max_records=5, dedup_window=4)
    killed.assign([(TOPIC, 0)])
    feed(killed, range(8))  # publishes 0..4, then "dies" holding 5..7
    redo = make_writer(tmp_path / "redo", roll_max_records=5, dedup_window=4)
    redo.assign([(TOPIC, 0)])
    feed(redo, range(5, len(ids)))
    redo.flush_all()
    assert ids_in_lake(tmp_path / "redo") == ids_in_lake(tmp_path / "whole"), \
        "a range redone after a crash must hold the same rows as when written in one go"
    assert [(f.first, f.last) for f in lake.list_files(str(tmp_path / "redo"), "events")] == [(0, 4), (5, 9), (10, 13)]
    # 5 at offset 8 is 3 rows back, 6 at 10 is 4 rows back (both within the window of 4); 2 at 12 is beyond it
    assert (whole.stats.duplicates, redo.stats.duplicates) == (2, 2), (whole.stats, redo.stats)


def test_a_dead_lettered_copy_does_not_hide_the_next_one(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0)])
    w.add(TOPIC, 0, 0, wire(event(1, prompt_token_ids=[2 ** 40])))  # unstorable: never lands
    w.add(TOPIC, 0, 1, wire(event(1)))
    w.flush_all()
    assert ids_in_lake(tmp_path) == [(1, "e00000001")], "only ids that land may enter the window"
    assert (w.stats.dlq, w.stats.duplicates) == (1, 0)


def test_dedup_window_zero_lands_every_copy(tmp_path: Path) -> None:
    w = make_writer(tmp_path, dedup_window=0)
    w.assign([(TOPIC, 0)])
    for o in range(3):
        w.add(TOPIC, 0, o, wire(event(7)))
    w.flush_all()
    assert [o for o, _ in ids_in_lake(tmp_path)] == [0, 1, 2]
    with pytest.raises(Exception, match="dedup_window"):
        LakeWriterConfig(dedup_window=-1).check()


# ---- offset gaps and logs that went back ------------------------------------------------------------
def test_a_gap_is_logged_counted_and_covered(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0)])
    with caplog.at_level("WARNING", logger="flywheel.ingest.lake_writer"):
        for o in (0, 1, 5, 6):  # retention deleted 2..4 before they were read
            w.add(TOPIC, 0, o, wire(event(o)))
    w.flush_all()
    assert (w.stats.gaps, w.stats.gap_offsets) == (1, 3), vars(w.stats)
    assert any("offsets 2..4" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert [(f.first, f.last) for f in lake.list_files(str(tmp_path), "events")] == [(0, 6)]
    assert sorted(lake_rows(tmp_path)) == [0, 1, 5, 6]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob("events/**/*.parquet"))}


def test_a_log_that_goes_back_rewinds_only_its_partition(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0), (TOPIC, 1)])
    for o in range(5):
        w.add(TOPIC, 0, o, wire(event(o)))
    w.flush_all()
    before = snapshot(tmp_path)
    w.add(TOPIC, 0, 5, wire(event(5)))
    for o in range(0, 8):  # the topic was recreated: its new log starts again at 0
        w.add(TOPIC, 0, o, wire(event(100 + o)))
        w.add(TOPIC, 1, o, wire(event(200 + o)))
    w.flush_all()
    assert set(w.rewound) == {(TOPIC, 0)} and w.stats.rewound == 1, w.rewound
    assert w.take_unpaused() == [(TOPIC, 0)] and w.take_unpaused() == [], "the loop pauses each rewound partition once"
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before, "a rewound partition must not overwrite files"
    part0 = [(f.first, f.last) for f in lake.list_files(str(tmp_path), "events") if f.partition == 0]
    assert part0 == [(0, 4), (5, 5)], f"only the record before the log went back may land: {part0}"
    assert [f.last for f in lake.list_files(str(tmp_path), "events") if f.partition == 1] == [7], "partition 1 goes on"


def test_check_logs_rewinds_a_log_shorter_than_the_lake(tmp_path: Path) -> None:
    first = make_writer(tmp_path)
    first.assign([(TOPIC, 0), (TOPIC, 1)])
    for o in range(10):
        first.add(TOPIC, 0, o, wire(event(o)))
    first.flush_all()
    before = snapshot(tmp_path)
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0), (TOPIC, 1)])
    w.check_logs({(TOPIC, 0): 3, (TOPIC, 1): 0}, {TOPIC: None})
    assert list(w.rewound) == [(TOPIC, 0)] and "ends at offset 3" in w.rewound[(TOPIC, 0)], w.rewound
    for o in range(3):
        w.add(TOPIC, 0, o, wire(event(50 + o)))
    w.flush_all()
    assert snapshot(tmp_path) == before and w.unchecked == set()


def test_a_new_topic_id_rewinds_the_topic(tmp_path: Path) -> None:
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0)])
    w.check_logs({(TOPIC, 0): 0}, {TOPIC: "id-a"})
    assert w.rewound == {}
    restarted = make_writer(tmp_path)
    restarted.assign([(TOPIC, 0), (TOPIC, 1)])
    restarted.check_logs({(TOPIC, 0): 10**6, (TOPIC, 1): 10**6}, {TOPIC: "id-b"})  # the new log outgrew the lake
    assert sorted(restarted.rewound) == [(TOPIC, 0), (TOPIC, 1)], "offsets alone cannot see this recreation"
    assert "id-a" in restarted.rewound[(TOPIC, 0)]
    assert lake.stream_identity(str(tmp_path), "events", TOPIC, "id-c") == "id-a", "the first id seen is kept"
    unknown = make_writer(tmp_path)
    unknown.assign([(TOPIC, 0)])
    unknown.check_logs({(TOPIC, 0): 0}, {TOPIC: None})  # a broker without topic ids: offsets only
    assert unknown.rewound == {}


def test_the_loop_checks_new_assignments_before_writing_and_pauses_rewound_ones(tmp_path: Path) -> None:
    first = make_writer(tmp_path)
    first.assign([(TOPIC, 0)])
    for o in range(10):
        first.add(TOPIC, 0, o, wire(event(o)))
    first.flush_all()
    before = snapshot(tmp_path)
    # the topic was recreated and holds 3 records: the seek to 10 is out of range and the consumer resets to 0
    consumer = FakeConsumer([{tp(0): messages(range(0, 3)), tp(1): messages(range(0, 2))}],
                            ends={(TOPIC, 0): 3, (TOPIC, 1): 2})
    w = make_writer(tmp_path, status_interval_s=0.0, var_dir=str(tmp_path / "var"))
    rebalance = _Rebalance(w, consumer)
    rebalance.on_partitions_assigned({tp(0), tp(1)})
    polls = iter(range(2))
    _loop(w.cfg, consumer, w, rebalance, "lake-writer-test", lambda: next(polls, None) is None)
    assert consumer.paused == [(TOPIC, 0)], consumer.paused
    assert {k: v for k, v in snapshot(tmp_path).items() if k in before} == before
    assert [(f.partition, f.first, f.last) for f in lake.list_files(str(tmp_path), "events")] == [(0, 0, 9), (1, 0, 1)]
    status = json.loads((tmp_path / "var" / "run" / "status" / "lake-writer-test.json").read_text())
    assert status["rewound_partitions"] == [f"{TOPIC}/0"], status
    assert (status["duplicates"], status["gaps"], status["behind"]) == (0, 0, 0), status


def test_records_of_a_partition_whose_log_check_could_not_run_are_held_back_until_it_runs(tmp_path: Path) -> None:
    first = make_writer(tmp_path)
    first.assign([(TOPIC, 0)])
    first.check_logs({(TOPIC, 0): 0}, {TOPIC: str(uuid.UUID(int=1))})  # the lake records the topic's id
    for o in range(10):
        first.add(TOPIC, 0, o, wire(event(o)))
    first.flush_all()
    before = snapshot(tmp_path)

    class LateBroker(FakeConsumer):
        """A recreated topic (another id) whose log already outgrew the lake's; end_offsets does not answer
        for the first 3 polls."""

        _client = SimpleNamespace(cluster=SimpleNamespace(topic_id=lambda topic: uuid.UUID(int=2)))

        def poll(self, timeout_ms: int, max_records: int) -> dict:
            if len(self.batches) == 1:
                self.ends = {(TOPIC, 0): 15}
            return super().poll(timeout_ms, max_records)

    # the new log's records 10..14, delivered (and after each seek back, again) while the check cannot run
    consumer = LateBroker([{tp(0): messages(range(10, 15))}] * 4)
    w = make_writer(tmp_path, status_interval_s=3600.0)
    rebalance = _Rebalance(w, consumer)
    rebalance.on_partitions_assigned({tp(0)})
    polls = iter(range(5))
    _loop(w.cfg, consumer, w, rebalance, "lake-writer-test", lambda: next(polls, None) is None)
    calls = consumer.end_offset_calls
    assert calls == 4, f"the check must be retried at each poll until it runs, ran {calls} times in 4 polls"
    assert consumer.seeks[(TOPIC, 0)] == 10, f"held-back records are given back to the consumer: {consumer.seeks}"
    assert snapshot(tmp_path) == before, "nothing of a partition whose check has not run may be written"
    assert (w.stats.records, list(w.rewound), consumer.paused) == (0, [(TOPIC, 0)], [(TOPIC, 0)]), \
        (w.stats, w.rewound, consumer.paused)


def test_a_checked_partition_takes_the_records_held_back_before(tmp_path: Path) -> None:
    consumer = FakeConsumer([{tp(0): messages(range(0, 3))}, {tp(0): messages(range(0, 5))}])
    w = make_writer(tmp_path, status_interval_s=3600.0)
    rebalance = _Rebalance(w, consumer)
    rebalance.on_partitions_assigned({tp(0)})
    polls = iter(range(2))

    def stopped() -> bool:
        consumer.ends = {(TOPIC, 0): 5} if consumer.end_offset_calls else None  # answers from the second poll on
        return next(polls, None) is None

    _loop(w.cfg, consumer, w, rebalance, "lake-writer-test", stopped)
    assert consumer.end_offset_calls == 2 and w.unchecked == set(), (consumer.end_offset_calls, w.unchecked)
    assert lake_rows(tmp_path) == [0, 1, 2, 3, 4], f"the re-read records land once, in order: {lake_rows(tmp_path)}"
    assert (w.stats.behind, w.stats.gaps) == (0, 0), w.stats


# ---- a consumer that never joins its group gets replaced (_JoinWatch) ---------------------------------------
def test_the_join_watch_fires_only_for_a_member_holding_nothing_outside_a_stable_group() -> None:
    now = [0.0]
    watch = _JoinWatch(60.0, clock=lambda: now[0])
    now[0] = 59.0
    assert watch.due(0, "<rebalancing>") is None, "not before the timeout"
    now[0] = 61.0
    assert watch.due(0, "<rebalancing>") == "no partitions and group state <rebalancing> for 61 s"
    now[0] = 61.0 + 119.0
    assert watch.due(0, "<unjoined>") is None, "the second wait is twice the first"
    now[0] = 61.0 + 121.0
    assert watch.due(0, "<unjoined>") is not None
    for _ in range(10):  # the wait doubles up to 16x and stays there
        now[0] += 16 * 60.0 + 1
        assert watch.due(0, "<unjoined>") is not None
    assert watch.timeout_s == 16 * 60.0
    # a stable member with no partitions (the others hold them all) and a member holding partitions are healthy,
    # and each resets the clock
    for held, state in [(0, "<stable>"), (3, "<rebalancing>")]:
        now[0] += 10_000.0
        assert watch.due(held, state) is None
        now[0] += watch.timeout_s - 1
        assert watch.due(0, "<unjoined>") is None


def _one_second_per_pass(now: list[float]) -> Callable[[], bool]:
    """A loop's `stopped`: each pass is one second on the watches' clock `now` and a heartbeat; stops after 100."""
    def stopped() -> bool:
        time.sleep(0.002)
        now[0] += 1.0
        return now[0] > 100
    return stopped


def test_the_loop_hands_a_never_joined_consumer_back_with_nothing_open(tmp_path: Path) -> None:
    class NeverJoins(FakeConsumer):
        def group_metadata(self) -> object:
            from kafka.structs import ConsumerGroupMetadata

            return ConsumerGroupMetadata(group_id="test")  # UNJOINED, generation -1: what the stuck writer reported

    consumer = NeverJoins()
    w = make_writer(tmp_path, status_interval_s=0.001)
    now = [0.0]
    watch = _JoinWatch(5.0, clock=lambda: now[0])

    stopped = _one_second_per_pass(now)

    with pytest.raises(_NeverJoined, match="no partitions and group state <unjoined>"):
        _loop(w.cfg, consumer, w, _Rebalance(w, consumer), "lake-writer-test", stopped, watch=watch)
    assert 5 <= now[0] <= 8 and not w.buffers, (now[0], w.buffers)


# ---- a writer holding partitions with records waiting that publishes nothing gets a new consumer (_StallWatch) ---
def test_the_stall_watch_fires_only_while_records_wait_and_no_file_is_published() -> None:
    now = [0.0]
    watch = _StallWatch(300.0, clock=lambda: now[0])
    assert watch.due(2, 500, 7, 0) is None  # starts the clock
    now[0] = 299.0
    assert watch.due(2, 500, 7, 0) is None, "not before the timeout"
    now[0] = 301.0
    assert watch.due(2, 500, 7, 0) == "500 records waiting on 2 partitions and no file published for 301 s"
    # progress of any kind, or nothing to do, resets the clock: a file published, no lag, no partitions held, or a
    # partition paused on purpose (a rewound log waits for an operator)
    for held, lag, files, paused in [(2, 500, 8, 0), (2, 0, 8, 0), (0, 500, 8, 0), (2, 500, 8, 1)]:
        now[0] += 10_000.0
        assert watch.due(held, lag, files, paused) is None, (held, lag, files, paused)
        now[0] += watch.timeout_s - 1
        assert watch.due(2, 500, 8, 0) is None
    now[0] += 1e6
    assert watch.due(2, 500, 8, 0) is not None and watch.timeout_s == 1200.0, "each wait doubles the next"


def test_the_loop_publishes_what_a_stalled_writer_holds_and_gives_its_partitions_up(tmp_path: Path) -> None:
    # one record polled into an open file, then nothing more, while the log holds 50: nothing is published
    consumer = FakeConsumer([{tp(0): messages(range(0, 1))}], ends={(TOPIC, 0): 50})
    w = make_writer(tmp_path, status_interval_s=0.001, roll_max_age_s=1000.0, var_dir=str(tmp_path / "var"))
    rebalance = _Rebalance(w, consumer)
    rebalance.on_partitions_assigned({tp(0)})
    now = [0.0]
    stall = _StallWatch(5.0, clock=lambda: now[0])

    stopped = _one_second_per_pass(now)

    with pytest.raises(_NeverJoined, match="50 records waiting on 1 partitions"):
        _loop(w.cfg, consumer, w, rebalance, "lake-writer-test", stopped, stall=stall)
    assert lake_rows(tmp_path) == [0], "the open file must be published before the consumer is replaced"
    assert not w.next_offset and not w.buffers and w.stats.stalls == 1, (w.next_offset, w.stats)


# ---- the Kafka record timestamp: only the date of an all-bad range, never a reason to stop ------------------
@pytest.mark.parametrize("kafka_ts_ms", [1_700_000_000_000_000, 253_402_300_800_000, 10**30, -5, -1, 0,
                                         float("nan"), float("inf"), float("-inf")])
def test_an_absurd_kafka_timestamp_neither_stops_the_writer_nor_names_a_date(tmp_path: Path,
                                                                              kafka_ts_ms: float) -> None:
    w = make_writer(tmp_path)
    w.assign([(TOPIC, 0), (TOPIC, 1)])
    w.add(TOPIC, 0, 0, b"nope", kafka_ts_ms=kafka_ts_ms)  # microseconds sent as ms, NaN, ...: a dead letter
    w.add(TOPIC, 0, 1, wire(event(1)), kafka_ts_ms=kafka_ts_ms)
    w.add(TOPIC, 1, 0, b"nope", kafka_ts_ms=kafka_ts_ms)  # an all-bad range: dated by the publish day
    w.add(TOPIC, 1, 1, b"nope", kafka_ts_ms=1_764_460_800_000)
    w.flush_all()
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    files = [(f.partition, f.first, f.last, f.date) for f in lake.list_files(str(tmp_path), "events")]
    assert files == [(0, 0, 1, "2026-11-30"), (1, 0, 1, today)], files
    assert (w.stats.records, w.stats.dlq, sorted(lake_rows(tmp_path))) == (4, 3, [1]), w.stats


# ---- the window means "among the last n landed rows", so every writer rebuilding it decides alike ---------
def test_the_window_holds_exactly_the_ids_of_the_last_n_landed_rows() -> None:
    from flywheel.ingest.lake_writer import IdWindow

    rows = ["a", "x", "a", "y", "z"]  # "a" landed twice (written with de-duplication off)
    window = IdWindow(3, rows[:3])
    for row_id in rows[3:]:
        window.add(row_id)
    assert {i for i in "axyz" if i in window} == set(rows[-3:]) == {"a", "y", "z"}, \
        "the second 'a' is among the last 3 rows, 'x' is not"
    assert len(window) == 3
    window.add("q")
    assert "a" not in window and {"y", "z", "q"} == {i for i in "axyzq" if i in window}


def test_a_writer_that_rebuilt_its_window_decides_like_the_one_that_kept_it(tmp_path: Path) -> None:
    import shutil

    old = make_writer(tmp_path / "live", roll_max_records=3, dedup_window=0)  # rows from before de-duplication
    old.assign([(TOPIC, 0)])
    for o, i in enumerate((1, 2, 1)):
        old.add(TOPIC, 0, o, wire(event(i)))
    live = make_writer(tmp_path / "live", roll_max_records=2, dedup_window=3)
    live.assign([(TOPIC, 0)])  # window from the lake's tail 1, 2, 1
    for o, i in ((3, 3), (4, 4)):
        live.add(TOPIC, 0, o, wire(event(i)))  # publishes 3..4: the last 3 rows are now 1, 3, 4
    shutil.copytree(tmp_path / "live", tmp_path / "rebuilt")
    rebuilt = make_writer(tmp_path / "rebuilt", roll_max_records=2, dedup_window=3)
    assert rebuilt.assign([(TOPIC, 0)]) == {(TOPIC, 0): 5}
    following = [(5, 1), (6, 2), (7, 5), (8, 4)]  # 1 is among the last 3 rows, 2 is not; 4 still is at 8
    for w in (live, rebuilt):
        for o, i in following:
            w.add(TOPIC, 0, o, wire(event(i)))
        w.flush_all()
    kept = {name: [r for r in ids_in_lake(tmp_path / name) if r[0] >= 5] for name in ("live", "rebuilt")}
    assert kept["live"] == kept["rebuilt"] == [(6, "e00000002"), (7, "e00000005")], kept
    assert (live.stats.duplicates, rebuilt.stats.duplicates) == (2, 2), (live.stats, rebuilt.stats)


def test_a_broker_error_out_of_poll_is_retried_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """kafka-python's poll can raise a connection error while a broker of the cluster is down (its coordinator
    lookup awaits a metadata refresh that failed: the 3-broker test's victim). The writer kept nothing wrong,
    so the loop counts it, says so, and polls again; a non-retriable error still ends the process."""
    from kafka.errors import KafkaConnectionError, UnsupportedVersionError

    class FlakyBroker(FakeConsumer):
        def __init__(self, errors: list[Exception], batches: list[dict]) -> None:
            super().__init__(batches, ends={(TOPIC, 0): 4})
            self.errors = errors

        def poll(self, timeout_ms: int, max_records: int) -> dict:
            if self.errors:
                raise self.errors.pop(0)
            return super().poll(timeout_ms, max_records)

    consumer = FlakyBroker([KafkaConnectionError("111 ECONNREFUSED")] * 2, [{tp(0): messages(range(0, 4))}])
    w = make_writer(tmp_path, status_interval_s=3600.0)
    rebalance = _Rebalance(w, consumer)
    rebalance.on_partitions_assigned({tp(0)})
    polls = iter(range(4))
    _loop(w.cfg, consumer, w, rebalance, "lake-writer-test", lambda: next(polls, None) is None)
    assert lake_rows(tmp_path) == [0, 1, 2, 3], f"the records after the errors land: {lake_rows(tmp_path)}"
    assert w.stats.poll_errors == 2, w.stats
    assert any("poll failed" in r.getMessage() for r in caplog.records), "the error is said, not swallowed"
    fatal = FlakyBroker([UnsupportedVersionError("no")], [])
    w2 = make_writer(tmp_path / "b")
    with pytest.raises(UnsupportedVersionError):
        _loop(w2.cfg, fatal, w2, _Rebalance(w2, fatal), "lake-writer-test", lambda: False)
