"""Two builders splitting a 4-partition lake make exactly the episodes one builder makes, kills included.

No service runs: the builders read the lake on disk, written as the lake writer writes it, with each
session's events and outcomes in the partition its session_id hashes to (as Kafka keys them).
Sessions lie two days in the past, so every maturity window is closed whenever the passes run; a
third of the outcomes land a round late, so relabels (label 2) are part of what must agree.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pyarrow as pa

from bench.fixtures import sessions as synthetic
from flywheel.ingest import lake
from flywheel.rewards import builder as episodes
from flywheel.rewards import config

TOML = """
[outcomes.task_success]
window_s = 600
missing = 0.0
lo = 0.0
hi = 1.0
[task_types.tool_use]
wait_for = ["task_success"]
"""
PARTITIONS = 4
ROUNDS = 6
PER_ROUND = 24
REPO = Path(__file__).resolve().parents[2]


def partition_of(session_id: str) -> int:
    return zlib.crc32(session_id.encode()) % PARTITIONS


def rounds() -> list[tuple[list[dict], list[dict]]]:
    """Per round, (events, outcomes) to land: a third of each round's outcomes land with the next round."""
    # 01:00 UTC two days back, so the rounds never cross midnight: a session split over two date partitions is read
    # in two passes and its second part counts as late (test_episodes_kill.py has the same start and the same why)
    start = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=2)).replace(hour=1, minute=0, second=0, microsecond=0)
    out: list[tuple[list[dict], list[dict]]] = []
    late: list[dict] = []
    for i in range(ROUNDS):
        events, outcomes = synthetic.generate(PER_ROUND, start + dt.timedelta(minutes=10 * i), seed=i, sub_agents=0.5)
        out.append((events, [o for j, o in enumerate(outcomes) if j % 3] + late))
        late = [o for j, o in enumerate(outcomes) if not j % 3]
    out.append(([], late))
    return out


def land(feed: synthetic.LakeFeeder, events: list[dict], outcomes: list[dict]) -> None:
    for p in range(PARTITIONS):
        feed.write("events", [e for e in events if partition_of(e["session_id"]) == p], partition=p)
        feed.write("outcomes", [o for o in outcomes if partition_of(o["session_id"]) == p], partition=p)


def episode_rows(root: Path) -> dict[tuple[str, str, int], dict]:
    """Every episode row by (session_id, episode_id = the llm_call's event id, label_version); asserts no key twice."""
    files = lake.list_files(str(root), "episodes")
    rows = pa.concat_tables([lake.read_file(str(root), f) for f in files]).drop(["emitted_ts"]).to_pylist()
    keyed = {(r["session_id"], r["episode_id"], r["label_version"]): r for r in rows}
    assert len(keyed) == len(rows), f"{len(rows) - len(keyed)} episode rows written twice in {root}"
    return keyed


def catch_up(builder: episodes.Builder, now: dt.datetime) -> None:
    while not builder.run_pass(now=now).idle:
        pass


def test_two_builders_make_the_episodes_of_one(tmp_path: Path) -> None:
    rewards = config.parse(TOML)
    one_lake, split_lake = tmp_path / "one", tmp_path / "split"
    feeds = synthetic.LakeFeeder(str(one_lake)), synthetic.LakeFeeder(str(split_lake))

    def cfg(root: Path, state: str, **kw: object) -> episodes.EpisodesConfig:
        return episodes.EpisodesConfig(lake_root=str(root), state_dir=str(tmp_path / state), var_dir=str(tmp_path / "var"),
                                       max_files_per_pass=3, **kw)

    one = episodes.Builder(cfg(one_lake, "state-one"), rewards)
    halves = [episodes.Builder(cfg(split_lake, f"state-{k}", member=k, members=2), rewards) for k in (0, 1)]
    now = dt.datetime.now(dt.timezone.utc)
    for i, (events, outcomes) in enumerate(rounds()):
        for feed in feeds:
            land(feed, events, outcomes)
        clock = now + dt.timedelta(minutes=i)  # the same clock for every builder: the same decisions
        for b in (one, *halves):
            catch_up(b, clock)

    single, split = episode_rows(one_lake), episode_rows(split_lake)
    labels = {k[2] for k in single}
    assert labels == {1, 2}, f"the lake should produce relabels; labels seen {labels}"
    streams = {f.partition for f in lake.list_files(str(split_lake), "episodes")}
    assert streams == {0, 1}, f"two builders should write streams 0 and 1, found {streams}"
    assert split.keys() == single.keys(), (f"{len(split)} keys split vs {len(single)} single: "
                                           f"{len(split.keys() - single.keys())} extra, {len(single.keys() - split.keys())} missing")
    differ = [k for k in single if split[k] != single[k]]
    assert not differ, f"{len(differ)} of {len(single)} rows differ, e.g. {differ[:3]}"
    for b in halves:  # an outcome that reached the other builder would be held, then dropped as unknown
        assert b.state.counters.get("dropped_unknown_session", 0) == 0, b.state.counters
    for b in (one, *halves):
        b.close()
    merged = {name: sum(b.state.counters.get(name, 0) for b in halves) for name in one.state.counters}
    assert merged == one.state.counters, f"lifetime counters: split {merged} vs single {one.state.counters}"


def flywheel(root: Path, state: Path, toml: Path, member: int) -> list[str]:
    return [sys.executable, "-m", "flywheel.cli", "episodes", "--lake-root", str(root), "--state-dir", str(state),
            "--rewards-toml", str(toml), "--member", str(member), "--members", "2", "--max-files-per-pass", "1",
            "--var-dir", str(state.parent / "var"), "--log-level", "INFO"]


def test_a_killed_builder_restarted_on_its_partitions_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    """Member 1 is SIGKILLed 6 times, each a random 0-100 ms after it commits a pass, and restarted with the same
    assignment and state (the takeover), while member 0 runs beside it; the table is the clean pair's."""
    toml = tmp_path / "rewards.toml"
    toml.write_text(TOML)
    feed = synthetic.LakeFeeder(str(tmp_path / "clean"))
    for events, outcomes in rounds():
        land(feed, events, outcomes)
    shutil.copytree(tmp_path / "clean", tmp_path / "killed")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(root: str, member: int) -> subprocess.Popen:
        return subprocess.Popen(flywheel(tmp_path / root, tmp_path / f"state-{root}-{member}", toml, member), env=env,
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    for member in (0, 1):
        _, err = (proc := run("clean", member)).communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    beside = run("killed", 0)
    rng = random.Random(22)
    current = tmp_path / "state-killed-1" / "CURRENT"
    kills, logs = 0, []
    for _attempt in range(40):
        proc = run("killed", 1)
        if kills < 6:
            before = current.read_text() if current.exists() else ""
            while proc.poll() is None and (current.read_text() if current.exists() else "") == before:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.1))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                logs.append(proc.communicate()[1])
                kills += 1
                continue
        _, err = proc.communicate(timeout=300)
        logs.append(err)
        assert proc.returncode == 0, err[-2000:]
        break
    _, err = beside.communicate(timeout=300)
    assert beside.returncode == 0, err[-2000:]
    assert kills == 6, f"only {kills} kills landed before member 1 finished; the test proved little"
    assert any("resuming the plan" in text for text in logs), "no kill landed inside a pass; the test proved little"

    clean, killed = episode_rows(tmp_path / "clean"), episode_rows(tmp_path / "killed")
    assert {k[2] for k in clean} == {1, 2}, "the lake should produce relabels"
    assert killed.keys() == clean.keys(), (f"after {kills} kills: {len(killed.keys() - clean.keys())} extra, "
                                           f"{len(clean.keys() - killed.keys())} missing of {len(clean)}")
    differ = [k for k in clean if killed[k] != clean[k]]
    assert not differ, f"{len(differ)} rows differ after {kills} kills, e.g. {differ[:3]}"
