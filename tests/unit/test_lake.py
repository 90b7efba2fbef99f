"""ingest/lake.py: layout, atomic publish, listing hand-off, recovery and range claims."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pyarrow as pa
import pytest

from flywheel.ingest import lake

SRC = "flywheel.events"


def table(offsets: list[int]) -> pa.Table:
    return pa.table({"_offset": pa.array(offsets, pa.int64()), "x": pa.array([o * 10 for o in offsets])})


def put(root: Path | str, first: int, last: int, partition: int = 0, date: str = "2026-11-30") -> lake.LakeFile:
    return lake.write_file(str(root), "events", date, SRC, partition, first, last, table(list(range(first, last + 1))))


def test_file_names_round_trip_and_reject_strangers() -> None:
    name = lake.file_name(SRC, 3, 7, 42)
    assert name == "flywheel.events-0003-00000000000000000007-00000000000000000042.parquet"
    assert lake.parse_file_name(name) == (SRC, 3, 7, 42)
    assert lake.parse_file_name("part-0.parquet") is None
    with pytest.raises(AssertionError):
        lake.file_name(SRC, 0, 5, 4)


def test_publish_leaves_no_temp_and_readers_ignore_hidden_names(tmp_path: Path) -> None:
    f = put(tmp_path, 0, 9)
    directory = Path(f.path).parent
    assert [p.name for p in directory.iterdir()] == [Path(f.path).name]
    (directory / ".abc.tmp").write_bytes(b"half a file")
    (directory / "_SUCCESS").write_bytes(b"")
    assert lake.list_files(str(tmp_path), "events") == [f]
    assert lake.read_file(str(tmp_path), f).column("_offset").to_pylist() == list(range(10))


def test_read_file_gives_the_columns_a_file_has_and_names_a_damaged_or_vanished_file(tmp_path: Path) -> None:
    f = put(tmp_path, 0, 4)
    root = str(tmp_path)
    # a column that joined the schema after the file was written is absent, not an error: the caller conforms
    assert lake.read_file(root, f, ["x", "added_later"]).column_names == ["x"]
    assert lake.read_file(root, f, filters=[("_offset", ">=", 3)]).column("_offset").to_pylist() == [3, 4]
    Path(f.path).write_bytes(b"PAR1 truncated")
    with pytest.raises(lake.LakeReadError, match="restore or remove the file") as damaged:
        lake.read_file(root, f)
    assert Path(f.path).name in str(damaged.value) and not isinstance(damaged.value, lake.LakeFileGone)
    Path(f.path).unlink()
    with pytest.raises(lake.LakeFileGone):  # a compaction replaced it: the reader lists again
        lake.read_file(root, f, ["x"])


def test_covered_files_are_hidden_mid_compaction(tmp_path: Path) -> None:
    small = [put(tmp_path, 0, 4), put(tmp_path, 5, 9)]
    wide = put(tmp_path, 0, 9)
    assert lake.list_files(str(tmp_path), "events") == [wide]
    assert sorted(lake.list_all_files(str(tmp_path), "events")) == sorted(small + [wide])
    assert lake.delete_files(str(tmp_path), small) == 2
    assert lake.list_all_files(str(tmp_path), "events") == [wide]


def test_next_offsets_per_partition_across_dates(tmp_path: Path) -> None:
    put(tmp_path, 0, 9, partition=0, date="2026-11-29")
    put(tmp_path, 10, 12, partition=0, date="2026-11-30")
    put(tmp_path, 0, 3, partition=2)
    assert lake.next_offsets(str(tmp_path), "events", SRC) == {0: 13, 2: 4}
    assert lake.next_offsets(str(tmp_path), "events", "other") == {}
    assert lake.next_offsets(str(tmp_path / "missing"), "events", SRC) == {}


def test_cursor_hand_off(tmp_path: Path) -> None:
    put(tmp_path, 0, 4)
    put(tmp_path, 5, 9)
    cursor: lake.Cursor = {}
    new = lake.files_since(str(tmp_path), "events", cursor)
    cursor = lake.advance(cursor, new[:1])
    assert cursor == {f"{SRC}/0": 4}
    assert [(f.first, f.last) for f in lake.files_since(str(tmp_path), "events", cursor)] == [(5, 9)]
    # mid-compaction (merged file published, originals not yet deleted) the reader keeps to the originals
    originals = lake.list_all_files(str(tmp_path), "events")
    wide = put(tmp_path, 0, 9)
    assert [(f.first, f.last) for f in lake.files_since(str(tmp_path), "events", cursor)] == [(5, 9)]
    # after compaction the merged file straddles the cursor: only rows past it are new
    lake.delete_files(str(tmp_path), originals)
    (straddling,) = lake.files_since(str(tmp_path), "events", cursor)
    assert straddling == wide
    rows = lake.rows_after_cursor(lake.read_file(str(tmp_path), wide), wide, cursor)
    assert rows.column("_offset").to_pylist() == [5, 6, 7, 8, 9]
    lake.save_cursor(tmp_path / "c" / "cursor.json", cursor)
    assert lake.load_cursor(tmp_path / "c" / "cursor.json") == cursor
    assert lake.load_cursor(tmp_path / "none.json") == {}


def test_uri_roots_go_through_pyarrow_filesystems(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/lake"
    f = put(root, 0, 2)
    assert lake.list_files(root, "events") == [f]
    assert lake.next_offsets(root, "events", SRC) == {0: 3}
    assert lake.claim_range(root, "events", SRC, 0, 3, 5, "2026-11-30") == lake.Claim(3, 5, "2026-11-30")
    assert lake.claim_range(root, "events", SRC, 0, 3, 9, "2026-12-01") == lake.Claim(3, 5, "2026-11-30")


def test_the_first_claim_wins_and_later_ones_read_it(tmp_path: Path) -> None:
    assert lake.read_claim(str(tmp_path), "events", SRC, 0, 100) is None
    first = lake.claim_range(str(tmp_path), "events", SRC, 0, 100, 150, "2026-11-30")
    assert first == lake.Claim(100, 150, "2026-11-30")
    assert lake.claim_range(str(tmp_path), "events", SRC, 0, 100, 130, "2026-12-01") == first
    assert lake.read_claim(str(tmp_path), "events", SRC, 0, 100) == first
    assert lake.claim_range(str(tmp_path), "events", SRC, 1, 100, 130, "2026-11-30").last == 130, "per partition"
    assert not [p for p in (tmp_path / lake.CLAIMS_DIR).rglob("*") if p.name.endswith(".tmp")]
    assert lake.list_files(str(tmp_path), "events") == [], "claims are not lake files"


def _claim(args: tuple[str, int]) -> int:
    root, last = args
    return lake.claim_range(root, "events", SRC, 0, 0, last, "2026-11-30").last


def test_concurrent_claims_have_exactly_one_winner(tmp_path: Path) -> None:
    lasts = list(range(10, 26))
    with mp.get_context("spawn").Pool(4) as pool:
        results = pool.map(_claim, [(str(tmp_path), last) for last in lasts])
    assert len(set(results)) == 1, f"processes saw different claims: {results}"
    assert results[0] in lasts


def test_stream_tail_reads_the_last_rows_of_a_stream_in_offset_order(tmp_path: Path) -> None:
    files = [put(tmp_path, 0, 4), put(tmp_path, 5, 9), put(tmp_path, 10, 11, date="2026-12-01")]
    empty = lake.write_file(str(tmp_path), "events", "2026-12-01", SRC, 0, 12, 13,
                            table([]).cast(table([0]).schema))  # a range of dead letters only
    files.append(empty)
    assert lake.stream_tail(str(tmp_path), files, "x", 4) == [80, 90, 100, 110]
    assert lake.stream_tail(str(tmp_path), files, "x", 100) == [o * 10 for o in range(12)], "fewer rows than asked"
    assert lake.stream_tail(str(tmp_path), [], "x", 5) == []
    assert lake.offsets_after(files, SRC) == {0: 14} == lake.next_offsets(str(tmp_path), "events", SRC)


def test_stream_identity_keeps_the_first(tmp_path: Path) -> None:
    assert lake.stream_identity(str(tmp_path), "events", SRC, "a") == "a"
    assert lake.stream_identity(str(tmp_path), "events", SRC, "b") == "a"
    assert lake.stream_identity(str(tmp_path), "outcomes", SRC, "b") == "b", "per table"
    uri = f"file://{tmp_path}/remote"
    assert [lake.stream_identity(uri, "events", SRC, i) for i in ("c", "d")] == ["c", "c"], "object-store branch"
    assert lake.list_files(str(tmp_path), "events") == [], "identity files are not lake files"


def test_stream_tail_reads_only_the_newest_files_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.parquet as pq

    files = [put(tmp_path, o, o) for o in range(200)]  # a quiet partition: one row per 1 s roll, long history
    other = put(tmp_path, 0, 0, partition=1)
    read: list[str] = []
    real = pq.read_table

    def counting(path: str, **kwargs: object) -> pa.Table:
        read.append(path)
        return real(path, **kwargs)

    monkeypatch.setattr(pq, "read_table", counting)
    assert lake.stream_tail(str(tmp_path), files, "x", 5) == [o * 10 for o in range(195, 200)]
    assert read == [f.path for f in reversed(files[-5:])], f"read {len(read)} files for a window of 5 rows"
    with pytest.raises(AssertionError, match="one stream"):
        lake.stream_tail(str(tmp_path), [files[0], other], "x", 5)


def test_stream_tail_lists_again_when_a_compaction_deletes_a_listed_file(tmp_path: Path) -> None:
    root = str(tmp_path)
    listed = [put(tmp_path, 0, 4), put(tmp_path, 5, 9), put(tmp_path, 10, 11)]
    # what `flywheel compact` does after the listing: publish the covering file, then delete the originals
    lake.write_file(root, "events", "2026-11-30", SRC, 0, 5, 11, table(list(range(5, 12))))
    lake.delete_files(root, listed[1:])
    assert lake.stream_tail(root, listed, "x", 4) == [80, 90, 100, 110]
    assert lake.stream_tail(root, listed, "x", 100) == [o * 10 for o in range(12)]


def test_s3_claim_signature_matches_the_aws_documented_example() -> None:
    """The claim's PUT is signed by hand (pyarrow cannot send If-None-Match): check the signer against the
    SigV4 example in the S3 API reference (GET /test.txt, Range bytes=0-9, 2013-05-24)."""
    import datetime as dt

    ep = lake.S3Endpoint("https://examplebucket.s3.amazonaws.com", "us-east-1", "AKIAIOSFODNN7EXAMPLE",
                         "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    headers = lake._sigv4_headers(ep, "GET", "/test.txt", {"Range": "bytes=0-9"}, b"",
                                  dt.datetime(2013, 5, 24, tzinfo=dt.timezone.utc))
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"), headers["authorization"]


def test_s3_endpoint_comes_from_the_variables_pyarrow_reads() -> None:
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000/", "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9100",
           "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "eu-west-1"}
    assert lake.s3_endpoint(env) == lake.S3Endpoint("http://127.0.0.1:9100", "eu-west-1", "k", "s", None)
    assert lake.s3_endpoint({"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}).url == \
        "https://s3.us-east-1.amazonaws.com"
    with pytest.raises(RuntimeError, match="AWS_SECRET_ACCESS_KEY"):
        lake.s3_endpoint({"AWS_ACCESS_KEY_ID": "k"})


def _no_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("files_since walked the whole table on a cursor that knows every stream")

    monkeypatch.setattr(lake, "_walk_table", refuse)


def test_listing_by_cursor_follows_the_claims_and_never_walks_the_table(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path)
    for o in range(0, 300, 3):  # a long history in two dates and two partitions
        put(tmp_path, o, o + 2, date="2026-11-29" if o < 150 else "2026-11-30")
        put(tmp_path, o, o + 2, partition=1)
    everything = lake.files_since(root, "events", {})  # a fresh reader lists the table once
    assert len(everything) == 200
    cursor = lake.advance({}, everything)
    new = [put(tmp_path, 300, 304), put(tmp_path, 305, 305, date="2026-12-01"), put(tmp_path, 300, 301, partition=1)]
    _no_walk(monkeypatch)
    assert lake.files_since(root, "events", cursor) == sorted(new, key=lambda f: (f.source, f.partition, f.first))
    assert lake.files_since(root, "events", lake.advance(cursor, new)) == []
    # a cursor in the middle gets exactly what the full listing gives past it
    middle = lake.advance({}, [f for f in everything if f.first < 120])
    monkeypatch.undo()
    expected = [f for f in lake.list_files(root, "events") if f.last > middle.get(f.key, -1)]
    _no_walk(monkeypatch)
    assert lake.files_since(root, "events", middle) == expected
    assert lake.files_since(root, "events", middle, owns=lambda p: p == 1, limit=2) == \
        [f for f in expected if f.partition == 1][:2]


def test_a_claimed_range_is_listed_only_once_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path)
    cursor = lake.advance({}, [put(tmp_path, 0, 4)])
    # the lake writer claims, then publishes: a reader in between must wait, not skip the range
    lake.claim_range(root, "events", SRC, 0, 5, 9, "2026-11-30")
    _no_walk(monkeypatch)
    assert lake.files_since(root, "events", cursor) == []
    published = lake.write_file(root, "events", "2026-11-30", SRC, 0, 5, 9, table(list(range(5, 10))), claimed=True)
    assert lake.files_since(root, "events", cursor) == [published]


def test_a_gap_and_a_dead_letter_range_stay_on_the_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path)
    cursor = lake.advance({}, [put(tmp_path, 0, 4)])
    # offsets 5..7 were deleted by retention (the writer's next file starts where the last ended anyway),
    # and 10..11 were all dead-lettered (a file of zero rows)
    gap = lake.write_file(root, "events", "2026-11-30", SRC, 0, 5, 9, table([8, 9]))
    dead = lake.write_file(root, "events", "2026-11-30", SRC, 0, 10, 11, table([]).cast(table([0]).schema))
    after = put(tmp_path, 12, 12, date="2026-12-01")
    _no_walk(monkeypatch)
    assert lake.files_since(root, "events", cursor) == [gap, dead, after]


def test_a_new_stream_or_one_without_claims_is_found_by_listing(tmp_path: Path) -> None:
    root = str(tmp_path)
    cursor = lake.advance({}, [put(tmp_path, 0, 4)])
    other = put(tmp_path, 0, 2, partition=3)  # a partition the cursor has not seen
    assert lake.files_since(root, "events", cursor) == [other]
    # a file written before every table was claimed (no claim): the start-up listing (full) finds it
    import pyarrow.parquet as pq

    legacy = Path(root) / "events" / "date=2026-11-30" / lake.file_name(SRC, 0, 5, 6)
    pq.write_table(table([5, 6]), legacy)
    assert [(f.partition, f.first) for f in lake.files_since(root, "events", cursor, full=True)] == [(0, 5), (3, 0)]


def test_write_file_refuses_a_range_its_claim_does_not_allow(tmp_path: Path) -> None:
    put(tmp_path, 0, 9)
    put(tmp_path, 0, 19)  # wider, same date: a compaction's merged file
    with pytest.raises(ValueError, match="conflicts with the claim"):
        put(tmp_path, 0, 4)
    with pytest.raises(ValueError, match="conflicts with the claim"):
        put(tmp_path, 0, 9, date="2026-12-01")
