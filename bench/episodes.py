"""`flywheel bench episodes`: the episode builder's full-build rate, its incremental pass cost at lake sizes 1x and
10x, and its listing by cursor at 1x and 100x files.

    flywheel bench episodes [--sessions 400] [--new 100] [--reps 3] [--listing-files 20] [--workdir DIR]

Generates a lake of synthetic sessions (about 13 events each, a third with sub-agents, one
outcome each) through the lake writer's own decoding, then measures side by side:
* full build: every session of the 10x lake through a fresh builder (sessions/s);
* incremental pass: the same `--new` sessions landing on a built 1x and a built 10x lake, one
  pass each, best of `--reps` (each repeat on a fresh copy of lake and state);
* the alternative it replaces: rebuilding the whole 10x lake plus the new data from scratch;
* listing (issue 21): a built lake of `--listing-files` files per table and one of 100 times as many, the
  same sessions in both (the extra files are ranges whose records were all dead-lettered: zero rows, so the
  builder's index is the same size and only the file count differs); one running builder per lake, then
  per repeat the same new files land on both and one pass is timed (best of `--reps`), beside the listing
  alone: by cursor (`plan_until`) and the whole-table walk it replaced (`lake.list_files`).
Every timed pass is a running builder's (its first pass, which lists the whole lake once, is not timed).
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
from flywheel.ingest import lake, lake_writer
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


def write_lake(root: Path, n_sessions: int, seed0: int, start: dt.datetime, progress: Progress, label: str,
               padding: int = 0) -> int:
    """Sessions in files of PER_FILE, each table's offsets going on from what the lake holds (as a lake writer's do),
    each real file followed by `padding` files of zero rows (offsets whose records were all dead-lettered)."""
    feed = synthetic.LakeFeeder(str(root))
    feed.next_offset = {(t, 0): lake.next_offsets(str(root), t, feed.topics[t]).get(0, 0) for t in ("events", "outcomes")}
    files = max(1, n_sessions // PER_FILE)
    task = progress.add_task(label, total=files)
    events = 0
    for i in range(files):
        ev, oc = synthetic.generate(PER_FILE, start + dt.timedelta(minutes=i), seed=seed0 + i, spacing_s=1.0)
        feed.write("events", ev)
        feed.write("outcomes", oc)
        for table in ("events", "outcomes"):
            pad(feed, table, padding)
        events += len(ev)
        progress.advance(task)
    return events


def pad(feed: synthetic.LakeFeeder, table: str, n: int) -> None:
    """n files of zero rows after the feeder's last, each covering one offset."""
    empty = lake_writer.rows_to_table(table, [])
    date = feed.files[-1].date
    for _ in range(n):
        first = feed.next_offset[(table, 0)]
        feed.files.append(lake.write_file(feed.root, table, date, feed.topics[table], 0, first, first, empty))
        feed.next_offset[(table, 0)] = first + 1


def build_all(base: Path, rewards: config.RewardConfig, max_files: int = 256) -> tuple[float, int]:
    cfg = episodes.EpisodesConfig(lake_root=str(base / "lake"), state_dir=str(base / "state"), var_dir=str(base / "var"),
                                  max_files_per_pass=max_files)
    with episodes.Builder(cfg, rewards) as builder:
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
    cfg = episodes.EpisodesConfig(lake_root=str(rep_dir / "lake"), state_dir=str(rep_dir / "state"),
                                  var_dir=str(rep_dir / "var"))
    with episodes.Builder(cfg, rewards) as builder:
        assert builder.run_pass().idle, "the built lake had more to build"  # the running builder's first pass
        write_lake(rep_dir / "lake", n_new, 10**6, start, progress, f"new data -> {rep_dir.name}")
        t0 = time.perf_counter()
        res = builder.run_pass()
        return time.perf_counter() - t0, res.sessions_emitted


def listing_test(work: Path, rewards: config.RewardConfig, files_1x: int, n_new: int, reps: int, start: dt.datetime,
                 new_start: dt.datetime, progress: Progress) -> dict[str, float | int]:
    """Incremental passes and listings on lakes of files_1x and 100 * files_1x files per table (same sessions)."""
    sessions = 2 * PER_FILE  # two real files per table; the rest are zero-row files between them
    builders: dict[str, episodes.Builder] = {}
    counts: dict[str, int] = {}
    for size, total in (("x1", files_1x), ("x100", 100 * files_1x)):
        root = work / f"listing-{size}"
        write_lake(root / "lake", sessions, 0, start, progress, f"listing lake {size}", padding=max(0, total // 2 - 1))
        counts[size] = len(lake.list_files(str(root / "lake"), "events"))
        build_all(root, rewards)
        cfg = episodes.EpisodesConfig(lake_root=str(root / "lake"), state_dir=str(root / "state"),
                                      var_dir=str(root / "var"))
        builders[size] = episodes.Builder(cfg, rewards)
        assert builders[size].run_pass().idle, f"listing lake {size}: the built lake had more to build"
    times: dict[str, list[float]] = {k: [] for k in ("pass_x1", "pass_x100", "cursor_x1", "cursor_x100",
                                                     "walk_x1", "walk_x100")}
    try:
        for rep in range(reps):
            for size, builder in builders.items():  # interleaved, so machine noise hits both sizes alike
                root = builder.cfg.lake_root
                write_lake(Path(root), n_new, 10**6 + 1000 * rep, new_start + dt.timedelta(hours=rep), progress,
                           f"new data -> listing {size}")
                t0 = time.perf_counter()
                episodes.plan_until(root, "events", builder.state.events_cursor, builder.cfg.max_files_per_pass)
                times[f"cursor_{size}"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                lake.list_files(root, "events")
                times[f"walk_{size}"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                res = builder.run_pass()
                times[f"pass_{size}"].append(time.perf_counter() - t0)
                want = (n_new // PER_FILE) * PER_FILE
                assert res.sessions_emitted == want, \
                    f"listing {size} rep {rep}: the pass emitted {res.sessions_emitted}, want {want}"
    finally:
        for builder in builders.values():
            builder.close()
    best = {k: min(v) for k, v in times.items()}
    return {
        "listing_files_1x": counts["x1"],
        "listing_files_100x": counts["x100"],
        "listing_pass_1x_s": round(best["pass_x1"], 4),
        "listing_pass_100x_s": round(best["pass_x100"], 4),
        "listing_ratio": round(best["pass_x100"] / best["pass_x1"], 3),
        "listing_by_cursor_1x_s": round(best["cursor_x1"], 5),
        "listing_by_cursor_100x_s": round(best["cursor_x100"], 5),
        "full_listing_1x_s": round(best["walk_x1"], 5),
        "full_listing_100x_s": round(best["walk_x100"], 5),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flywheel bench episodes", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=400, help="sessions in the 1x lake (the 10x lake has ten times as many)")
    parser.add_argument("--new", type=int, default=100, help="sessions of new data per incremental pass")
    parser.add_argument("--reps", type=int, default=5, help="repeats of each incremental pass (the best is reported)")
    parser.add_argument("--listing-files", type=int, default=20,
                        help="files per table in the listing test's 1x lake (its 100x lake has 100 times as many)")
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
            ev1 = write_lake(work / "x1" / "lake", args.sessions, 0, old, progress, "1x lake")
            ev10 = write_lake(work / "x10" / "lake", args.sessions * 10, 0, old, progress, "10x lake")
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
            write_lake(rebuild / "lake", args.new, 10**6, new_start, progress, "new data -> rebuild")
        rebuild_s, _ = build_all(rebuild, rewards)
        with Progress(console=console, transient=True) as progress:
            listing = listing_test(work, rewards, args.listing_files, args.new, args.reps, old, new_start, progress)
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
        **listing,
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
    listed = Table(title="listing by cursor (same sessions, 1x and 100x files per table)")
    for col in ("lake", "files per table", "incremental pass s", "listing by cursor s", "whole-table walk s"):
        listed.add_column(col, justify="right" if col != "lake" else "left")
    for size in ("1x", "100x"):
        listed.add_row(size, str(result[f"listing_files_{size}"]), f"{result[f'listing_pass_{size}_s']:.4f}",
                       f"{result[f'listing_by_cursor_{size}_s']:.5f}", f"{result[f'full_listing_{size}_s']:.5f}")
    Console().print(listed)
    print(f"listing ratio (100x / 1x files, incremental pass): {result['listing_ratio']}")
    print(f"scaling ratio (10x / 1x incremental): {result['scaling_ratio']}; incremental is "
          f"{result['incremental_speedup_vs_rebuild']}x faster than a rebuild")
    print(json.dumps(result))
    return 0
