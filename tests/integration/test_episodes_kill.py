"""A builder killed with SIGKILL at random moments, restarted each time, ends with a clean run's table.

The builder runs as `flywheel episodes` subprocesses (one input file per pass); each is killed a
random 0-100 ms after it commits a pass, so the kills land inside the next pass's reads, writes
and commit; the reference is one uninterrupted run over a copy of the same lake.
Sessions lie two days in the past, so every maturity window is closed whenever the passes run and
both builds make the same decisions; a third of the outcomes arrive several files late, so
relabels (label 2) are part of what must survive the kills. Event files also hold re-sent copies
(the SDK's replay after an outage), of events in the same file and of sessions labelled three
files earlier: both must count as duplicates, never as late events, and change no row.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa

from bench.fixtures import sessions as synthetic
from flywheel.ingest import lake

TOML = """
[outcomes.task_success]
window_s = 600
missing = 0.0
lo = 0.0
hi = 1.0
[task_types.tool_use]
wait_for = ["task_success"]
"""
FILES = 24
PER_FILE = 10


def build_lake(root: Path) -> int:
    """Write the lake; returns how many event copies it holds."""
    # 01:00 UTC two days back: the 24 files span 4 hours of one day. A start that lets them cross midnight splits a
    # session's events into two date partitions, hence two files read in two passes (`--max-files-per-pass 1`), and
    # the second part counts as late events: the test then failed when run between 20:00 and 24:00 UTC
    start = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=2)).replace(hour=1, minute=0, second=0, microsecond=0)
    feed = synthetic.LakeFeeder(str(root))
    late: list[dict] = []
    written: list[list[dict]] = []
    copies = 0
    for i in range(FILES):
        events, outcomes = synthetic.generate(PER_FILE, start + dt.timedelta(minutes=10 * i), seed=i, sub_agents=0.5)
        replay = events[:3] + (written[i - 3][::5] if i >= 3 else [])
        written.append(events)
        copies += len(replay)
        feed.write("events", events + replay)
        on_time = [o for j, o in enumerate(outcomes) if j % 3]
        late.extend(o for j, o in enumerate(outcomes) if not j % 3)
        if i >= 4:  # outcomes of sessions four files back: their label 1 went out with task_success missing
            on_time += late[:PER_FILE // 3 + 1]
            del late[:PER_FILE // 3 + 1]
        feed.write("outcomes", on_time)
    feed.write("outcomes", late)
    return copies


def flywheel(lake_root: Path, state: Path, toml: Path) -> list[str]:
    return [sys.executable, "-m", "flywheel.cli", "episodes", "--lake-root", str(lake_root), "--state-dir", str(state),
            "--rewards-toml", str(toml), "--max-files-per-pass", "1", "--var-dir", str(state.parent / "var"),
            "--log-level", "INFO"]


def table(root: Path) -> tuple[list[tuple[int, int]], list[dict]]:
    files = lake.list_files(str(root), "episodes")
    rows = pa.concat_tables([lake.read_file(str(root), f) for f in files]).drop(["emitted_ts"]).to_pylist()
    return [(f.first, f.last) for f in files], sorted(rows, key=lambda r: (r["episode_id"], r["label_version"]))


def counters(state: Path) -> dict[str, int]:
    """The committed lifetime counters of a builder's state."""
    return json.loads((state / (state / "CURRENT").read_text().strip() / "state.json").read_text())["counters"]


def test_sigkill_mid_pass_gives_the_clean_table(tmp_path: Path) -> None:
    toml = tmp_path / "rewards.toml"
    toml.write_text(TOML)
    copies = build_lake(tmp_path / "clean")
    shutil.copytree(tmp_path / "clean", tmp_path / "killed")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cwd = Path(__file__).resolve().parents[2]

    clean = subprocess.run(flywheel(tmp_path / "clean", tmp_path / "state-clean", toml), env=env, cwd=cwd,
                           capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr[-2000:]

    rng = random.Random(5)
    kills = 0
    logs: list[str] = []
    current = tmp_path / "state-killed" / "CURRENT"
    for attempt in range(40):
        proc = subprocess.Popen(flywheel(tmp_path / "killed", tmp_path / "state-killed", toml), env=env, cwd=cwd,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if kills < 8:
            # wait for this process to commit a pass, then kill it a random moment into the next one
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
    assert kills == 8, f"only {kills} kills landed before the build finished; the test proved little"
    resumed = sum(text.count("resuming the plan") for text in logs)
    assert resumed >= 1, "no kill landed between a pass's intent and its commit; the test proved little"

    clean_files, clean_rows = table(tmp_path / "clean")
    killed_files, killed_rows = table(tmp_path / "killed")
    labels = {r["label_version"] for r in clean_rows}
    assert labels == {1, 2}, f"the lake should produce relabels; labels seen {labels}"
    assert killed_files == clean_files, f"file ranges differ after {kills} kills"
    assert len(killed_rows) == len(clean_rows), f"{len(killed_rows)} rows after {kills} kills vs {len(clean_rows)} clean"
    assert killed_rows == clean_rows, f"row contents differ after {kills} kills"
    keys = [(r["episode_id"], r["label_version"]) for r in killed_rows]
    assert len(set(keys)) == len(keys), f"{len(keys) - len(set(keys))} episode labels written twice"
    for name in ("clean", "killed"):
        c = counters(tmp_path / f"state-{name}")
        assert c.get("dropped_duplicate_event") == copies and "dropped_late_event" not in c, (
            f"{name}: {copies} re-sent copies should all count as duplicate_event: {c}")


def test_a_second_builder_on_the_same_state_is_refused(tmp_path: Path) -> None:
    """Two `flywheel episodes` processes on one state dir: the second exits 1 naming the dir and the first's pid."""
    toml = tmp_path / "rewards.toml"
    toml.write_text(TOML)
    build_lake(tmp_path / "lake")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cwd = Path(__file__).resolve().parents[2]
    state = tmp_path / "state"
    first = subprocess.Popen(flywheel(tmp_path / "lake", state, toml) + ["--follow"], env=env, cwd=cwd,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (state / "CURRENT").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # a committed pass: the first builder holds the lock and works on the state
        assert first.poll() is None and (state / "CURRENT").exists(), "the first builder did not start passing"
        second = subprocess.run(flywheel(tmp_path / "lake", state, toml), env=env, cwd=cwd, capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 1, f"exit {second.returncode}: {second.stderr[-2000:]}"
        assert str(state) in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr[-2000:]
    finally:
        first.send_signal(signal.SIGTERM)  # finishes its pass, exits 0 and releases the lock
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    third = subprocess.run(flywheel(tmp_path / "lake", state, toml), env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=300)
    assert third.returncode == 0, third.stderr[-2000:]
