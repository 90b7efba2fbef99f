"""Episode building split by partition: who owns what, and every clash refused before a row is read.

Lakes are written as the lake writer writes them (bench.fixtures.sessions.LakeFeeder), with each
session's events and outcomes in the partition its session_id hashes to.
"""

from __future__ import annotations

import datetime as dt
import zlib
from pathlib import Path

import pytest

from bench.fixtures import sessions as synthetic
from flywheel.base.config import ConfigError
from flywheel.ingest import lake
from flywheel.rewards import builder as episodes
from flywheel.rewards import config

T0 = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)
TOML = """
[outcomes.task_success]
window_s = 600
missing = 0.0
[task_types.tool_use]
wait_for = ["task_success"]
"""


def partition_of(session_id: str, count: int) -> int:
    return zlib.crc32(session_id.encode()) % count


def feed(root: str, n: int, event_partitions: int, outcome_partitions: int, seed: int = 0) -> None:
    """`n` finished sessions with one outcome each, keyed by session_id into the given partition counts."""
    events, outcomes = synthetic.generate(n, T0, seed=seed)
    feeder = synthetic.LakeFeeder(root)
    for p in range(event_partitions):
        feeder.write("events", [e for e in events if partition_of(e["session_id"], event_partitions) == p], partition=p)
    for p in range(outcome_partitions):
        feeder.write("outcomes", [o for o in outcomes if partition_of(o["session_id"], outcome_partitions) == p],
                     partition=p)


def cfg_for(tmp: Path, state: str, **kw: object) -> episodes.EpisodesConfig:
    cfg = episodes.EpisodesConfig(lake_root=str(tmp / "lake"), state_dir=str(tmp / state), var_dir=str(tmp / "var"), **kw)
    cfg.check()
    return cfg


def build(cfg: episodes.EpisodesConfig) -> episodes.PassResult:
    with episodes.Builder(cfg, config.parse(TOML)) as b:
        return b.run_pass(now=T0 + dt.timedelta(days=1))


def test_assignment_owns_streams_and_names() -> None:
    member = episodes.Assignment(member=1, members=3)
    static = episodes.Assignment(partitions=frozenset({5, 2}))
    whole = episodes.Assignment()
    assert [p for p in range(8) if member.owns(p)] == [1, 4, 7]
    assert [p for p in range(8) if static.owns(p)] == [2, 5]
    assert all(whole.owns(p) for p in range(8)) and not whole.split
    assert (member.stream, static.stream, whole.stream) == (1, 2, 0)
    assert (member.describe(), static.describe(), whole.describe()) == ("member 1 of 3", "partitions 2,5",
                                                                         "all partitions")


@pytest.mark.parametrize("kw, field", [
    ({"member": 2, "members": 2}, "member"),
    ({"partitions": [0, 1], "members": 2}, "members"),
    ({"partitions": [1, 1]}, "distinct"),
    ({"partitions": [4], "partition_count": 4}, "partition_count"),
])
def test_config_refuses_inconsistent_assignments(tmp_path: Path, kw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        cfg_for(tmp_path, "state", **kw)


def test_each_builder_reads_only_its_partitions_and_writes_its_own_stream(tmp_path: Path) -> None:
    feed(str(tmp_path / "lake"), 40, 4, 4)
    results = [build(cfg_for(tmp_path, f"state-{k}", member=k, members=2)) for k in (0, 1)]
    assert all(r.sessions_emitted > 0 for r in results), [r.sessions_emitted for r in results]
    assert sum(r.sessions_emitted for r in results) == 40, [r.sessions_emitted for r in results]
    assert all(not r.drops.get("unknown_session") for r in results), [r.drops for r in results]
    for f in lake.list_files(str(tmp_path / "lake"), "episodes"):
        owner = episodes.Assignment(member=f.partition, members=2)
        sids = set(lake.read_file(str(tmp_path / "lake"), f).column("session_id").to_pylist())
        wrong = [s for s in sids if not owner.owns(partition_of(s, 4))]
        assert not wrong, f"stream {f.partition} holds sessions of partitions it does not own: {wrong}"
    assert {f.partition for f in lake.list_files(str(tmp_path / "lake"), "episodes")} == {0, 1}


def test_a_split_over_unequal_partition_counts_is_refused(tmp_path: Path) -> None:
    feed(str(tmp_path / "lake"), 40, 4, 2)
    with pytest.raises(episodes.AssignmentError, match=r"events span partitions 0\.\.3 and its outcomes 0\.\.1"):
        build(cfg_for(tmp_path, "state-0", member=0, members=2))
    with pytest.raises(episodes.AssignmentError, match=r"--partition-count 2 .*'events': \[2, 3\]"):
        build(cfg_for(tmp_path, "state-1", partitions=[1], partition_count=2))
    assert not lake.list_files(str(tmp_path / "lake"), "episodes"), "a refused builder wrote episodes"
    assert build(cfg_for(tmp_path, "state-all")).sessions_emitted > 0, "one builder owns every partition: no split"


def test_a_declared_count_lets_a_sparse_lake_split(tmp_path: Path) -> None:
    """Outcomes so far only in partitions 0..1 of 4: inferred counts differ, the declared count says they do not."""
    feed(str(tmp_path / "lake"), 40, 4, 4)
    for f in lake.list_files(str(tmp_path / "lake"), "outcomes"):
        if f.partition >= 2:
            Path(f.path).unlink()
    with pytest.raises(episodes.AssignmentError, match="partition-count"):
        build(cfg_for(tmp_path, "state-a", member=0, members=2))
    assert build(cfg_for(tmp_path, "state-b", member=0, members=2, partition_count=4)).sessions_emitted > 0


def test_overlapping_and_resplit_builders_are_refused(tmp_path: Path) -> None:
    feed(str(tmp_path / "lake"), 40, 4, 4)
    build(cfg_for(tmp_path, "state-m0", member=0, members=2))
    with pytest.raises(episodes.AssignmentError, match="partition 0 is built by the builder with 'member 0 of 2'"):
        build(cfg_for(tmp_path, "state-p0", partitions=[0]))
    with pytest.raises(episodes.AssignmentError, match="'all partitions'"):
        build(cfg_for(tmp_path, "state-all"))  # one builder after two would re-emit member 0's sessions
    with pytest.raises(episodes.AssignmentError, match="partition 2 is built .*'member 0 of 2', not 'partitions 1,2'"):
        build(cfg_for(tmp_path, "state-p12", partitions=[1, 2]))  # free partition 1 must stay free
    streams = {f.partition for f in lake.list_files(str(tmp_path / "lake"), "episodes")}
    assert streams == {0}, f"refused builders wrote episode streams {streams - {0}}"
    build(cfg_for(tmp_path, "state-m1", member=1, members=2))  # the other half is free


def test_a_state_refuses_another_assignment(tmp_path: Path) -> None:
    feed(str(tmp_path / "lake"), 20, 4, 4)
    build(cfg_for(tmp_path, "state", member=1, members=2))
    with pytest.raises(episodes.AssignmentError, match="holds the cursors.*'member 1 of 2'.*'partitions 1,3'"):
        build(cfg_for(tmp_path, "state", partitions=[1, 3]))
    assert build(cfg_for(tmp_path, "state", member=1, members=2)).idle, "same assignment: resumes from its cursor"
