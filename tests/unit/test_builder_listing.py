"""The episode builder and the learner's reader list the lake by cursor: a running builder's passes and a running
reader's polls find new files along the claims without walking the lake, and files of zero rows move the builder's
cursor (more of them than a pass reads do not stall it)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Callable

import pytest

from bench.episodes import TOML
from bench.fixtures import sessions as synthetic
from flywheel.ingest import lake, lake_writer
from flywheel.learner.data import EpisodeStream
from flywheel.rewards import builder as episodes
from flywheel.rewards import config

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc)


def dead_letters(feed: synthetic.LakeFeeder, table: str, n: int) -> None:
    """n files of zero rows (ranges whose records were all dead-lettered), as the lake writer publishes them."""
    for _ in range(n):
        first = feed.next_offset.get((table, 0), 0)
        lake.write_file(feed.root, table, "2026-11-30", feed.topics[table], 0, first, first,
                        lake_writer.rows_to_table(table, []))
        feed.next_offset[(table, 0)] = first + 1


def test_a_running_builder_and_learner_find_new_files_without_walking_the_lake(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path / "lake")
    feed = synthetic.LakeFeeder(root)
    for i in range(4):
        ev, oc = synthetic.generate(5, NOW - dt.timedelta(days=1, minutes=10 * i), seed=i)
        feed.write("events", ev)
        feed.write("outcomes", oc)
    cfg = episodes.EpisodesConfig(lake_root=root, state_dir=str(tmp_path / "state"), var_dir=str(tmp_path / "var"),
                                  max_files_per_pass=2)
    with episodes.Builder(cfg, config.parse(TOML)) as builder:
        emitted = 0
        while not (res := builder.run_pass(NOW)).idle:  # the first pass lists the lake once
            emitted += res.sessions_emitted
        assert emitted == 20
        learner = EpisodeStream(root, vocab_size=512, max_seq_len=4096)
        learner.poll()  # its first poll lists the episodes table once
        before = len(learner.pending)
        assert before > 0

        def refuse(*args: object) -> None:
            raise AssertionError("a running builder walked the whole lake")

        monkeypatch.setattr(lake, "_walk_table", refuse)
        ev, oc = synthetic.generate(5, NOW - dt.timedelta(hours=3), seed=99)
        feed.write("events", ev)
        feed.write("outcomes", oc)
        res = builder.run_pass(NOW)
        assert res.sessions_emitted == 5
        assert builder.run_pass(NOW).idle
        assert learner.poll() == res.rows_written > 0, "the learner's reader missed the new episode file"
        assert len(learner.pending) == before + res.rows_written


def zero_row_files_then_sessions(tmp_path: Path, write_zero_rows: Callable[..., None], max_files: int,
                                 why: str) -> episodes.Builder:
    """5-7 zero-row files per table, then 4 sessions; a builder passes until idle (at most 10 passes) and must have
    emitted all 4: `why` names what would have held it back."""
    root = str(tmp_path / "lake")
    feed = synthetic.LakeFeeder(root)
    for table in ("events", "outcomes"):
        write_zero_rows(feed, table)
    ev, oc = synthetic.generate(4, NOW - dt.timedelta(days=1), seed=1)
    feed.write("events", ev)
    feed.write("outcomes", oc)
    cfg = episodes.EpisodesConfig(lake_root=root, state_dir=str(tmp_path / "state"), var_dir=str(tmp_path / "var"),
                                  max_files_per_pass=max_files)
    with episodes.Builder(cfg, config.parse(TOML)) as builder:
        results = []
        while not (res := builder.run_pass(NOW)).idle and len(results) < 10:
            results.append(res)
    emitted = sum(r.sessions_emitted for r in results)
    assert emitted == 4, f"{emitted} sessions emitted in {len(results)} passes: {why}"
    return builder


def test_more_zero_row_files_than_a_pass_reads_do_not_stall_the_builder(tmp_path: Path) -> None:
    builder = zero_row_files_then_sessions(tmp_path, lambda feed, table: dead_letters(feed, table, 7), 3,
                                           "the zero-row files held the cursor")
    last = lake.list_files(str(tmp_path / "lake"), "events")[-1]
    assert builder.state.events_cursor == {last.key: last.last}


def legacy_dead_letters(feed: synthetic.LakeFeeder, table: str, n: int) -> None:
    """n zero-row files published without a claim, as a lake written before every file was claimed holds them."""
    import pyarrow.parquet as pq

    for _ in range(n):
        first = feed.next_offset.get((table, 0), 0)
        path = Path(feed.root) / table / "date=2026-11-30" / lake.file_name(feed.topics[table], 0, first, first)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(lake_writer.rows_to_table(table, []), path)
        feed.next_offset[(table, 0)] = first + 1


def test_unclaimed_files_past_one_pass_are_listed_until_the_builder_has_caught_up(tmp_path: Path) -> None:
    # the claim chain cannot cross a file nobody claimed: a first pass that lists the whole table but takes only
    # max_files_per_pass files must not hand the rest to the chain (it would stop at the first unclaimed file)
    zero_row_files_then_sessions(tmp_path, lambda feed, table: legacy_dead_letters(feed, table, 5), 2,
                                 "the builder stopped at unclaimed files")
