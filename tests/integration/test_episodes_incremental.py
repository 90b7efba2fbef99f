"""Incremental cost: with a lake ten times larger and the same new data, a pass costs no more than 1.5x.

Both lakes are built the same way (files of 20 sessions, consumed by passes of 5 files, so the
10x builder also carries ten times the index segments and lake files); then the same 60 new
sessions with their outcomes land and one pass is timed, best of five (each repeat on a fresh
copy of lake and state).
"""

from __future__ import annotations

import datetime as dt
import shutil
import time
from pathlib import Path

from bench.fixtures import sessions as synthetic
from flywheel.rewards import builder as episodes
from flywheel.rewards import config

TOML = """
[outcomes.task_success]
window_s = 600
missing = 0.0
[task_types.tool_use]
wait_for = ["task_success"]
"""
PER_FILE = 20
BASE_FILES = 5
NEW_FILES = 3


def build(base: Path, n_files: int, rewards: config.RewardConfig) -> tuple[synthetic.LakeFeeder, episodes.EpisodesConfig]:
    # 01:00 UTC: the files never cross midnight, which would split a session over two date partitions
    start = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3)).replace(hour=1, minute=0, second=0, microsecond=0)
    feed = synthetic.LakeFeeder(str(base / "lake"))
    for i in range(n_files):
        ev, oc = synthetic.generate(PER_FILE, start + dt.timedelta(minutes=i), seed=i, spacing_s=1.0)
        feed.write("events", ev)
        feed.write("outcomes", oc)
    cfg = episodes.EpisodesConfig(lake_root=str(base / "lake"), state_dir=str(base / "state"), var_dir=str(base / "var"),
                                  max_files_per_pass=5)
    builder = episodes.Builder(cfg, rewards)
    while not builder.run_pass().idle:
        pass
    return feed, cfg


def timed_pass(base: Path, rep: Path, rewards: config.RewardConfig, new: list[tuple[list, list]]) -> tuple[float, int]:
    shutil.copytree(base, rep)
    feed = synthetic.LakeFeeder(str(rep / "lake"))
    feed.next_offset = {("events", 0): 10**9, ("outcomes", 0): 10**9}  # past anything the base lake holds
    for ev, oc in new:
        feed.write("events", ev)
        feed.write("outcomes", oc)
    cfg = episodes.EpisodesConfig(lake_root=str(rep / "lake"), state_dir=str(rep / "state"), var_dir=str(rep / "var"),
                                  max_files_per_pass=NEW_FILES * 2)
    builder = episodes.Builder(cfg, rewards)
    t0 = time.perf_counter()
    res = builder.run_pass()
    return time.perf_counter() - t0, res.sessions_emitted


def test_incremental_pass_cost_does_not_grow_with_the_lake(tmp_path: Path) -> None:
    rewards = config.parse(TOML)
    build(tmp_path / "x1", BASE_FILES, rewards)
    build(tmp_path / "x10", BASE_FILES * 10, rewards)
    start = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=1)).replace(hour=1, minute=0, second=0, microsecond=0)
    new = [synthetic.generate(PER_FILE, start + dt.timedelta(minutes=i), seed=1000 + i, spacing_s=1.0) for i in range(NEW_FILES)]
    times: dict[str, list[float]] = {"x1": [], "x10": []}
    for rep in range(5):
        for size in ("x1", "x10"):  # interleaved, so machine noise hits both sizes alike
            seconds, emitted = timed_pass(tmp_path / size, tmp_path / f"{size}-rep{rep}", rewards, new)
            assert emitted == PER_FILE * NEW_FILES, f"{size}: the pass emitted {emitted} sessions"
            times[size].append(seconds)
    t1, t10 = min(times["x1"]), min(times["x10"])
    assert t10 <= 1.5 * t1, f"incremental pass {t10:.3f}s on the 10x lake vs {t1:.3f}s on 1x (ratio {t10 / t1:.2f} > 1.5); all {times}"
