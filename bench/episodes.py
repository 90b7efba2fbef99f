"""`flywheel bench episodes`: the episode builder's full-build rate and incremental pass cost at lake sizes 1x and 10x.

    flywheel bench episodes [--sessions 400] [--new 100] [--reps 3] [--workdir DIR]

Generates a lake of synthetic sessions (about 13 events each, a third with sub-agents, one
outcome each) through the lake writer's own decoding, then measures side by side:
* full build: every session of the 10x lake through a fresh builder (sessions/s);
* incremental pass: the same `--new` sessions landing on a built 1x and a built 10x lake, one
  pass each, best of `--reps` (each repeat on a fresh copy of lake and state);
* the alternative it replaces: rebuilding the whole 10x lake plus the new data from scratch.
Needs no service (the judge is off in the generated deployment). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

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
PER_FILE = 50  # sessions per lake file, like a lake writer file closed on count


def write_lake(root: Path, n_sessions: int, seed0: int, start: dt.datetime, offset0: int, progress: Progress, label: str) -> int:
    feed = synthetic.LakeFeeder(str(root))
    feed.next_offset = {("events", 0): offset0, ("outcomes", 0): offset0}
    files = max(1, n_sessions // PER_FILE)
    task = progress.add_task(label, total=files)
    events = 0
    for i in range(files):
        ev, oc = synthetic.generate(PER_FILE, start + dt.timedelta(minutes=i), seed=seed0 + i, spacing_s=1.0)
        feed.write("events", ev)
        feed.write("outcomes", oc)
        events += len(ev)
        progress.advance(task)
    return events


def build_all(base: Path, rewards: config.RewardConfig, max_files: int = 256) -> tuple[float, int]:
    cfg = episodes.EpisodesConfig(lake_root=str(base / "lake"), state_dir=str(base / "state"), var_dir=str(base / "var"),
                                  max_files_per_pass=max_files)
    builder = episodes.Builder(cfg, rewards)
    t0 = time.perf_counter()
    emitted = 0
    while True:
        res = builder.run_pass()
        emitted += res.sessions_emitted
        if res.idle:
            break
    return time.perf_counter() - t0, emitted


def incremental(base: Path, rep_dir: Path, rewards: config.RewardConfig, n_new: int, start: dt.datetime,
                progress: Progress) -> tuple[float, int]:
    shutil.copytree(base, rep_dir)
    write_lake(rep_dir / "lake", n_new, 10**6, start, 10**9, progress, f"new data -> {rep_dir.name}")
    cfg = episodes.EpisodesConfig(lake_root=str(rep_dir / "lake"), state_dir=str(rep_dir / "state"),
                                  var_dir=str(rep_dir / "var"))
    builder = episodes.Builder(cfg, rewards)
    t0 = time.perf_counter()
    res = builder.run_pass()
    return time.perf_counter() - t0, res.sessions_emitted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flywheel bench episodes", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=400, help="sessions in the 1x lake (the 10x lake has ten times as many)")
    parser.add_argument("--new", type=int, default=100, help="sessions of new data per incremental pass")
    parser.add_argument("--reps", type=int, default=5, help="repeats of each incremental pass (the best is reported)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the lakes go (default: a temp dir, removed after)")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    rewards = config.parse(TOML)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-episodes-"))
    work.mkdir(parents=True, exist_ok=True)
    old = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3)
    new_start = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=1)
    try:
        with Progress(console=console, transient=True) as progress:
            ev1 = write_lake(work / "x1" / "lake", args.sessions, 0, old, 0, progress, "1x lake")
            ev10 = write_lake(work / "x10" / "lake", args.sessions * 10, 0, old, 0, progress, "10x lake")
        console.print(f"lakes: 1x {args.sessions} sessions ({ev1} events), 10x {args.sessions * 10} sessions ({ev10} events)")
        full_1x_s, n1 = build_all(work / "x1", rewards)
        full_10x_s, n10 = build_all(work / "x10", rewards)
        console.print(f"full builds: 1x {full_1x_s:.2f}s, 10x {full_10x_s:.2f}s")

        times: dict[str, list[float]] = {"x1": [], "x10": []}
        with Progress(console=console, transient=True) as progress:
            for rep in range(args.reps):
                for size in ("x1", "x10"):
                    seconds, emitted = incremental(work / size, work / f"{size}-rep{rep}", rewards, args.new, new_start, progress)
                    assert emitted == (args.new // PER_FILE) * PER_FILE, f"incremental pass on {size} emitted {emitted}"
                    times[size].append(seconds)
                    shutil.rmtree(work / f"{size}-rep{rep}")
        inc_1x, inc_10x = min(times["x1"]), min(times["x10"])

        # what a non-incremental builder pays for the same new data: everything again, from scratch
        rebuild = work / "rebuild"
        shutil.copytree(work / "x10" / "lake", rebuild / "lake", ignore=shutil.ignore_patterns("episodes"))
        with Progress(console=console, transient=True) as progress:
            write_lake(rebuild / "lake", args.new, 10**6, new_start, 10**9, progress, "new data -> rebuild")
        rebuild_s, _ = build_all(rebuild, rewards)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    result = {
        "sessions_per_s": round(n10 / full_10x_s, 1),
        "full_build_1x_s": round(full_1x_s, 3),
        "full_build_10x_s": round(full_10x_s, 3),
        "sessions_1x": n1,
        "sessions_10x": n10,
        "new_sessions": (args.new // PER_FILE) * PER_FILE,
        "incremental_1x_s": round(inc_1x, 4),
        "incremental_10x_s": round(inc_10x, 4),
        "scaling_ratio": round(inc_10x / inc_1x, 3),
        "full_rebuild_10x_plus_new_s": round(rebuild_s, 3),
        "incremental_speedup_vs_rebuild": round(rebuild_s / inc_10x, 1),
        "reps": args.reps,
    }
    table = Table(title="episode builder")
    table.add_column("variant")
    table.add_column("lake")
    table.add_column("sessions", justify="right")
    table.add_column("seconds", justify="right")
    table.add_column("sessions/s", justify="right")
    table.add_row("full build", "1x", str(n1), f"{full_1x_s:.3f}", f"{n1 / full_1x_s:.0f}")
    table.add_row("full build", "10x", str(n10), f"{full_10x_s:.3f}", f"{n10 / full_10x_s:.0f}")
    table.add_row("incremental pass (best)", "1x", str(result["new_sessions"]), f"{inc_1x:.4f}", f"{result['new_sessions'] / inc_1x:.0f}")
    table.add_row("incremental pass (best)", "10x", str(result["new_sessions"]), f"{inc_10x:.4f}", f"{result['new_sessions'] / inc_10x:.0f}")
    table.add_row("rebuild from scratch", "10x + new", str(n10 + result["new_sessions"]), f"{rebuild_s:.3f}", "-")
    Console().print(table)
    print(f"scaling ratio (10x / 1x incremental): {result['scaling_ratio']}; incremental is "
          f"{result['incremental_speedup_vs_rebuild']}x faster than a rebuild")
    print(json.dumps(result))
    return 0
