"""`flywheel bench ingest --vs quixstreams`: the lake writer against what a Python team would use instead, a
Quix Streams application whose file sink writes Parquet (bench/quix/app.py), on the same records, in one run.

    flywheel bench ingest --vs quixstreams [--events 20000] [--rounds 3] [--lakes local,s3]
                          [--live-rate 300] [--live-seconds 10] [--kill-seconds 30] [--kills 3]

For each destination (a local folder; the stack's S3-compatible server):
1. Rate: one prefilled topic per wire format (v3 packed, as the SDK emits; and JSON lists) is read to the end by
   each side in turn, in alternated rounds (writer first in even rounds, Quix first in odd ones). Each side is a
   fresh process pinned to one core (the same core for both), with a fresh consumer group and output. Its clock
   and its CPU time (the process's, all threads: kafka-python's and librdkafka's too) run from its first record
   to the moment its output holds all N rows; start-up, imports and the group join are outside both. Quix writes
   at each checkpoint (every 5 s by default), so its wall time includes up to one checkpoint's wait: compare
   CPU per event, which waits do not touch. `writer_vs_quix` is Quix's CPU per event over the writer's
   (above 1: the writer needs less CPU per event), pooled over the rounds.
2. Visibility: each side follows a fresh topic while this process produces v3 events at --live-rate; a watcher
   lists the output every 50 ms and notes when each event became readable (a file it cannot read yet is
   tried again). p95 over all events; one never seen counts as infinite.
3. Kills: each side follows a fresh topic while v3 events are produced at --live-rate for --kill-seconds, and is
   SIGKILLed --kills times at the same seeded moments, restarted at once as a supervisor would. After the last
   event the final process runs until every event is readable (or 90 s pass). lost = produced events not in the
   output; duplicated = rows beyond one per event; unreadable = output files a reader cannot open.

The lake writer runs twice, on each of its Kafka clients (--writer-clients): kafka-python, its default, and
librdkafka (`--kafka-client confluent`, the rdkafka extra); the JSON keys are writer_* and writer_rdkafka_*.

Both sides run with their defaults except where stated: the group session timeout is 10 s on both (the writer's
default; librdkafka's 45 s would stall every kill run by 45 s a kill), and Quix's packed fields become numpy
arrays (the lake's list<int32> / list<float32>), which cost it less CPU than Python lists (--quix-lists measures
those). The Quix side runs in its own virtual environment under var/venvs/ (built on first use from
bench/quix/requirements.txt, pinned: quixstreams 3.28.1 on confluent-kafka 2.12).

Starts Kafka (and the S3 server) when not running. Prints a table, then the JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from bench.ingest import (
    _percentile,
    _producer,
    _stack_takes_flag,
    encoded,
    environment,
    produce_prefilled,
    realistic_event,
)

ROOT = Path(__file__).resolve().parents[1]
QUIX_APP = ROOT / "bench" / "quix" / "app.py"
QUIX_REQUIREMENTS = ROOT / "bench" / "quix" / "requirements.txt"
LABELS = {"writer": "lake writer, kafka-python", "writer_rdkafka": "lake writer, librdkafka",
          "quix": "Quix Streams FileSink"}
CLIENTS = {"writer": "kafka-python", "writer_rdkafka": "confluent"}  # side -> LakeWriterConfig.kafka_client
FORMATS = {"v3": "v3 packed", "v1": "JSON lists"}
SESSION_TIMEOUT_MS = 10_000


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flywheel bench ingest --vs quixstreams",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--vs", choices=("quixstreams",), required=True)
    parser.add_argument("--events", type=int, default=20_000, help="events per rate round and format")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rate rounds per destination and format")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--lakes", default="local,s3", help="destinations, comma-separated: local, s3")
    parser.add_argument("--live-rate", type=float, default=300.0, help="events/s in the visibility and kill runs")
    parser.add_argument("--live-seconds", type=float, default=10.0)
    parser.add_argument("--kill-seconds", type=float, default=30.0, help="how long events flow in a kill run")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs per side and destination (0: no kill run)")
    parser.add_argument("--writer-clients", default="kafka-python,confluent",
                        help="the lake writer's Kafka clients to measure, comma-separated: kafka-python (the "
                             "default client), confluent (librdkafka, the rdkafka extra)")
    parser.add_argument("--quix-lists", action="store_true",
                        help="Quix decodes packed fields to Python lists (list<int64>/list<double>), not numpy")
    parser.add_argument("--kafka-bootstrap", default=os.environ.get("FLYWHEEL_KAFKA_BOOTSTRAP", "127.0.0.1:9092"))
    parser.add_argument("--var-dir", default=os.environ.get("FLYWHEEL_VAR_DIR", str(ROOT / "var")),
                        help="where the Quix virtual environment is kept (venvs/quixstreams-...)")
    parser.add_argument("--writer-rate", default=None, help=argparse.SUPPRESS)  # one writer round (JSON spec)
    args = parser.parse_args(argv)
    args.lakes = [lake.strip() for lake in args.lakes.split(",") if lake.strip()]
    by_client = {client: side for side, client in CLIENTS.items()}
    clients = [c.strip() for c in args.writer_clients.split(",") if c.strip()]
    if not clients or any(c not in by_client for c in clients):
        parser.error(f"--writer-clients takes kafka-python and/or confluent, not {clients}")
    args.sides = [*(by_client[c] for c in clients), "quix"]
    bad = [lake for lake in args.lakes if lake not in ("local", "s3")]
    if bad or not args.lakes:
        parser.error(f"--lakes takes local and/or s3, not {bad or args.lakes}")
    return args


# ---- the Quix side's environment ---------------------------------------------------------------------------

def quix_python(var_dir: Path, console: Any) -> Path:
    """The Quix virtual environment's python, built on first use (and again when the requirements change)."""
    spec = QUIX_REQUIREMENTS.read_bytes()
    tag = hashlib.sha256(spec).hexdigest()[:12]
    venv = var_dir / "venvs" / f"quixstreams-{tag}"
    python = venv / "bin" / "python"
    if (venv / "ready").is_file():
        return python
    console.print(f"building the Quix Streams environment in {venv} (once; about a minute) ...")
    scratch = venv.with_name(venv.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(scratch)], check=True)
    pip = subprocess.run([str(scratch / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                          "-r", str(QUIX_REQUIREMENTS)], capture_output=True, text=True)
    if pip.returncode != 0:
        raise SystemExit(f"flywheel bench ingest --vs quixstreams: could not install {QUIX_REQUIREMENTS.name} into "
                         f"{scratch} (no package index?):\n{pip.stderr[-1500:]}")
    shutil.rmtree(venv, ignore_errors=True)
    scratch.rename(venv)  # the venv's scripts name the scratch path; the app runs as `python app.py`, never those
    (venv / "ready").write_text(spec.decode())
    return python


def wire_shim(tmp: Path) -> Path:
    """A folder for the Quix process's PYTHONPATH holding only flywheel.ingest.wire and .schema (standard library
    only): the records' decoder, without the project's dependencies in the peer's environment."""
    root = tmp / "quix_path"
    pkg = root / "flywheel" / "ingest"
    pkg.mkdir(parents=True, exist_ok=True)
    (root / "flywheel" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    for name in ("wire.py", "schema.py"):
        shutil.copyfile(ROOT / "ingest" / name, pkg / name)
    return root


# ---- outputs: what a reader of each side's destination sees -----------------------------------------------

def output_files(side: str, out: str, sizes: bool = True) -> list[tuple[str, int]]:
    """(path, bytes) of each data file a reader would read: the lake's published files for the writer, every
    .parquet file under the sink's folder for Quix. `sizes=False` gives the writer's files size 0 without asking the
    store (a HEAD each on S3): they are immutable, so a watcher needs only their names."""
    from flywheel.ingest import lake

    fs, base = lake.filesystem(out)
    if side in CLIENTS:
        files = [f.path for f in lake.list_files(out, "events")]
        if not sizes:
            return [(path, 0) for path in files]
        return [(info.path, info.size or 0) for info in fs.get_file_info(files)]
    import pyarrow.fs as pafs

    if fs.get_file_info(base).type == pafs.FileType.NotFound:
        return []
    selector = pafs.FileSelector(base, recursive=True)
    return [(i.path, i.size or 0) for i in fs.get_file_info(selector)
            if i.type == pafs.FileType.File and i.path.endswith(".parquet")]


def read_ids(out: str, path: str) -> list[str] | None:
    """The event ids of one output file; None when it cannot be read (yet: a file still being written)."""
    import pyarrow.parquet as pq

    from flywheel.ingest import lake

    fs, _ = lake.filesystem(out)
    try:
        return [str(x) for x in pq.read_table(path, columns=["event_id"], filesystem=fs).column("event_id").to_pylist()]
    except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError: a truncated or half-written file
        return None


# ---- the two sides as processes ----------------------------------------------------------------------------

class Sides:
    """Starts either side on one core: a rate round that ends by itself, or a follower that runs until killed."""

    def __init__(self, args: argparse.Namespace, python: Path, shim: Path, core: int, tmp: Path) -> None:
        self.args, self.python, self.shim, self.core, self.tmp = args, python, shim, core, tmp

    def _pin(self) -> None:
        os.sched_setaffinity(0, {self.core})

    def _quix_cmd(self, topic: str, group: str, out: str, extra: list[str]) -> list[str]:
        return [str(self.python), str(QUIX_APP), "--bootstrap", self.args.kafka_bootstrap, "--topic", topic,
                "--group", group, "--out", out, "--state-dir", str(self.tmp / "quix_state" / group),
                "--session-timeout-ms", str(SESSION_TIMEOUT_MS),
                *([] if self.args.quix_lists else ["--numpy"]), *extra]

    def _quix_env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.shim)}

    def rate(self, side: str, topic: str, n: int, out: str) -> dict[str, float]:
        """One rate round: wall and CPU seconds from the side's first record to all n rows written."""
        group = f"bench-{side}-{uuid.uuid4().hex[:8]}"
        if side in CLIENTS:
            spec = {"bootstrap": self.args.kafka_bootstrap, "topic": topic, "n": n, "out": out,
                    "var": str(self.tmp / "var" / group), "client": CLIENTS[side]}
            proc = subprocess.run([sys.executable, "-m", "bench.ingest_peer", "--vs", "quixstreams",
                                   "--writer-rate", json.dumps(spec)], cwd=ROOT, capture_output=True, text=True,
                                  preexec_fn=self._pin, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"the lake writer's round failed ({proc.returncode}): {proc.stderr[-2000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            report = self.tmp / f"{group}.json"
            proc = subprocess.run(self._quix_cmd(topic, group, out, ["--events", str(n), "--report", str(report)]),
                                  cwd=ROOT, env=self._quix_env(), capture_output=True, text=True,
                                  preexec_fn=self._pin, timeout=600)
            if proc.returncode != 0 or not report.is_file():
                raise RuntimeError(f"the Quix round failed ({proc.returncode}): {proc.stderr[-2000:]}")
            result = json.loads(report.read_text())
        files = output_files(side, out)
        return {"wall_s": result["wall_s"], "cpu_s": result["cpu_s"], "files": len(files),
                "bytes": sum(size for _, size in files)}

    def follower(self, side: str, topic: str, group: str, out: str) -> subprocess.Popen[bytes]:
        """The side following `topic` into `out` until SIGTERM (or SIGKILL), under consumer group `group`."""
        if side in CLIENTS:
            cmd = [sys.executable, "-m", "flywheel.ingest.lake_writer", "--kafka-bootstrap", self.args.kafka_bootstrap,
                   "--kafka-client", CLIENTS[side],
                   "--events-topic", topic, "--outcomes-topic", "", "--dlq-topic", f"{topic}.dlq", "--group-id", group,
                   "--writer-id", group, "--lake-root", out, "--var-dir", str(self.tmp / "var" / group),
                   "--log-level", "WARNING"]
            return subprocess.Popen(cmd, cwd=ROOT, preexec_fn=self._pin, stdout=subprocess.DEVNULL)
        return subprocess.Popen(self._quix_cmd(topic, group, out, []), cwd=ROOT, env=self._quix_env(),
                                preexec_fn=self._pin, stdout=subprocess.DEVNULL)


def writer_round(spec: dict[str, Any]) -> dict[str, float]:
    """The lake writer's side of one rate round, in its own (pinned) process."""
    from bench.ingest import writer_rate

    cpu: dict[str, float] = {}
    wall, _ = writer_rate(spec["bootstrap"], spec["topic"], spec["n"], spec["out"], spec["var"], cpu,
                          client=spec["client"])
    return {"wall_s": wall, "cpu_s": cpu["cpu_s"]}


# ---- visibility and kills ----------------------------------------------------------------------------------

class Watcher:
    """Lists one side's output every 50 ms and notes when each event id first became readable, and how many rows
    of each id the output holds (a file rewritten under the same name is counted once, as a reader sees it)."""

    def __init__(self, side: str, out: str) -> None:
        self.side, self.out = side, out
        self.visible: dict[str, float] = {}
        self._sizes: dict[str, int] = {}  # path -> size when read: a Quix file rewritten in place is read again
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"watch-{side}")

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def scan(self) -> None:
        now = time.time()
        for path, size in output_files(self.side, self.out, sizes=False):
            if self._sizes.get(path) == size:
                continue
            ids = read_ids(self.out, path)
            if ids is None:
                continue  # not readable yet: next scan
            self._sizes[path] = size
            for eid in ids:
                self.visible.setdefault(eid, now)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.scan()
            time.sleep(0.05)

    def final(self) -> tuple[dict[str, int], int]:
        """Rows per event id in the output as it stands, and how many of its files cannot be read."""
        rows: dict[str, int] = {}
        unreadable = 0
        for path, _ in output_files(self.side, self.out, sizes=False):
            ids = read_ids(self.out, path)
            if ids is None:
                unreadable += 1
                continue
            for eid in ids:
                rows[eid] = rows.get(eid, 0) + 1
        return rows, unreadable


def wait_member(bootstrap: str, group: str, proc: subprocess.Popen[bytes], timeout_s: float = 90.0) -> None:
    """Until `group` is stable with a member holding partitions (either side's readiness, from the broker's view)."""
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            assert proc.poll() is None, f"the follower of group {group} exited ({proc.returncode})"
            assert time.monotonic() < deadline, f"group {group} got no stable member in {timeout_s:.0f} s"
            described = admin.describe_groups([group]).get(group) or {}
            members = described.get("members") or []
            if described.get("group_state") == "Stable" and any(_assigned(m) for m in members):
                return
            time.sleep(0.2)
    finally:
        admin.close()


def _assigned(member: dict[str, Any]) -> bool:
    """Whether a described group member holds partitions (kafka-python 3's admin returns plain dicts)."""
    assignment = member.get("member_assignment")
    if isinstance(assignment, dict):
        return any(p.get("partitions") for p in assignment.get("assigned_partitions") or [])
    return bool(assignment)


def produce_live(bootstrap: str, topic: str, rate: float, seconds: float, seed: int,
                 during: Callable[[float], None] | None = None) -> dict[str, float]:
    """Produce v3 events at `rate`/s for `seconds`, stamping each at send time; `during(elapsed)` is called
    between sends (the kill schedule). Returns event id -> send time."""
    rng = random.Random(seed)
    producer = _producer(bootstrap)
    sent: dict[str, float] = {}
    n = int(rate * seconds)
    t0 = time.time()
    for i in range(n):
        time.sleep(max(0.0, t0 + i / rate - time.time()))
        if during is not None:
            during(time.time() - t0)
        event = realistic_event(rng, i)
        sent[event["event_id"]] = time.time()
        producer.send(topic, key=event["session_id"].encode(), value=encoded("v3", event))
        if i % 10 == 0:
            producer.flush()  # the SDK's linger is milliseconds: keep sends prompt
    producer.flush()
    producer.close()
    return sent


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def visibility(sides: Sides, side: str, topic: str, out: str) -> list[float]:
    """Produce-to-readable seconds of every live event (inf for one never seen)."""
    args = sides.args
    group = f"bench-live-{side}-{uuid.uuid4().hex[:6]}"
    proc = sides.follower(side, topic, group, out)
    try:
        wait_member(args.kafka_bootstrap, group, proc)
        with Watcher(side, out) as watcher:
            sent = produce_live(args.kafka_bootstrap, topic, args.live_rate, args.live_seconds, seed=7)
            deadline = time.monotonic() + 30
            while not set(sent) <= set(watcher.visible) and time.monotonic() < deadline:
                time.sleep(0.1)
        return [watcher.visible[e] - t if e in watcher.visible else float("inf") for e, t in sent.items()]
    finally:
        _stop(proc)


def kill_schedule(seconds: float, kills: int, seed: int = 11) -> list[float]:
    """Seeded kill moments (seconds after the first event), the same for both sides: spread over the run, at least
    4 s apart so each incarnation gets to work (a checkpoint, a published file) before the next kill."""
    if kills == 0:
        return []
    rng = random.Random(seed)
    span = seconds / kills
    return [round(k * span + rng.uniform(min(4.0, span / 2), max(min(4.0, span / 2), span - 1.0)), 2)
            for k in range(kills)]


def kill_run(sides: Sides, side: str, topic: str, out: str, schedule: list[float]) -> dict[str, Any]:
    """Events flow at the live rate while the side is SIGKILLed at `schedule` and restarted at once; then the last
    process runs until every event is readable (or 90 s). Lost, duplicated and unreadable, as a reader sees them."""
    args = sides.args
    group = f"bench-kill-{side}-{uuid.uuid4().hex[:6]}"
    procs = [sides.follower(side, topic, group, out)]
    wait_member(args.kafka_bootstrap, group, procs[0])
    pending = list(schedule)

    def during(elapsed: float) -> None:
        if pending and elapsed >= pending[0]:
            pending.pop(0)
            procs[-1].kill()
            procs[-1].wait()
            procs.append(sides.follower(side, topic, group, out))

    t0 = time.monotonic()
    watcher = Watcher(side, out)
    try:
        sent = produce_live(args.kafka_bootstrap, topic, args.live_rate, args.kill_seconds, seed=13, during=during)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            watcher.scan()
            if set(sent) <= set(watcher.visible):
                break
            time.sleep(0.5)
        settle_s = time.monotonic() - t0 - args.kill_seconds
    finally:
        _stop(procs[-1])
    rows, unreadable = watcher.final()
    return {"events": len(sent), "kills": len(procs) - 1,
            "lost": sum(1 for e in sent if e not in rows),
            "duplicated": sum(count - 1 for e, count in rows.items() if e in sent and count > 1),
            "unreadable_files": unreadable, "caught_up_s": round(settle_s, 1)}


# ---- the run -----------------------------------------------------------------------------------------------

def run_lake(sides: Sides, dest: str, out_base: str, topics: dict[str, str], console: Any) -> dict[str, Any]:
    """Every measurement for one destination."""
    args = sides.args
    sides_run = args.sides
    rounds: dict[str, dict[str, list[dict[str, float]]]] = {s: {f: [] for f in topics} for s in sides_run}
    for r in range(args.rounds):
        order = sides_run if r % 2 == 0 else sides_run[::-1]
        for fmt, topic in topics.items():
            for side in order:
                out = f"{out_base}/rate_{side}_{fmt}_{r}"
                rounds[side][fmt].append(sides.rate(side, topic, args.events, out))
            console.print(f"{dest} round {r + 1}/{args.rounds} {fmt}: CPU s per {args.events} events: " + ", ".join(
                f"{s} {rounds[s][fmt][-1]['cpu_s']:.2f}" for s in sides_run))
    live: dict[str, list[float]] = {}
    kills: dict[str, dict[str, Any]] = {}
    schedule = kill_schedule(args.kill_seconds, args.kills)
    admin_topics = []
    for side in sides_run:
        live_topic = f"bench.peer-live.{side}.{uuid.uuid4().hex[:6]}"
        kill_topic = f"bench.peer-kill.{side}.{uuid.uuid4().hex[:6]}"
        admin_topics += [live_topic, kill_topic]
        _create_topics(args, [live_topic, kill_topic])
        console.print(f"{dest} {side}: {args.live_rate:.0f} events/s for {args.live_seconds:.0f} s, produce -> readable ...")
        live[side] = visibility(sides, side, live_topic, f"{out_base}/live_{side}")
        if schedule:
            console.print(f"{dest} {side}: {args.kills} SIGKILLs at {schedule} s while events flow ...")
            kills[side] = kill_run(sides, side, kill_topic, f"{out_base}/kill_{side}", schedule)
    return {"rounds": rounds, "live": live, "kills": kills, "schedule": schedule, "topics": admin_topics}


def _create_topics(args: argparse.Namespace, names: list[str]) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=args.kafka_bootstrap)
    try:
        admin.create_topics([NewTopic(t, args.partitions, 1) for t in names]
                            + [NewTopic(f"{t}.dlq", 1, 1) for t in names])
    finally:
        admin.close()


def _delete_topics(args: argparse.Namespace, names: list[str]) -> None:
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=args.kafka_bootstrap)
    try:
        admin.delete_topics(names + [f"{t}.dlq" for t in names])
    except Exception as e:  # noqa: BLE001 (clean-up: say it, do not hide the run's result)
        print(f"could not delete the bench's topics: {e}", file=sys.stderr)
    finally:
        admin.close()


def summarize(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON line: per side and destination (and format for the rates)."""
    out: dict[str, Any] = {"vs": "quixstreams", "quixstreams_version": _quix_version(), "events": args.events,
                           "rounds": args.rounds, "quix_packed_as": "lists" if args.quix_lists else "numpy",
                           "session_timeout_ms": SESSION_TIMEOUT_MS}
    for dest, res in results.items():
        for side in args.sides:
            for fmt in FORMATS:
                rs = res["rounds"][side][fmt]
                key = f"{side}_{dest}" + ("" if fmt == "v3" else "_json")
                cpu, wall = sum(r["cpu_s"] for r in rs), sum(r["wall_s"] for r in rs)
                n = args.events * len(rs)
                out[f"{key}_events_per_s"] = round(n / wall, 1)
                out[f"{key}_cpu_s_per_10k"] = round(cpu / n * 1e4, 3)
                out[f"{key}_events_per_cpu_s"] = round(n / cpu, 1)
                out[f"{key}_bytes_per_event"] = round(statistics.fmean(r["bytes"] for r in rs) / args.events, 1)
                out[f"{key}_files"] = rs[-1]["files"]
            lat = res["live"][side]
            out[f"{side}_{dest}_p50_visible_s"] = round(_percentile(lat, 0.5), 3)
            out[f"{side}_{dest}_p95_visible_s"] = round(_percentile(lat, 0.95), 3)
            if side in res["kills"]:
                k = res["kills"][side]
                out[f"{side}_{dest}_lost_after_kills"] = k["lost"]
                out[f"{side}_{dest}_duplicated_after_kills"] = k["duplicated"]
                out[f"{side}_{dest}_unreadable_files_after_kills"] = k["unreadable_files"]
                out[f"{side}_{dest}_kills"] = k["kills"]
                out[f"{side}_{dest}_kill_events"] = k["events"]
        for fmt in FORMATS:
            suffix = "" if fmt == "v3" else "_json"
            for side in (s for s in args.sides if s in CLIENTS):
                per_round = [q["cpu_s"] / w["cpu_s"] for w, q in zip(res["rounds"][side][fmt],
                                                                       res["rounds"]["quix"][fmt])]
                out[f"{side}_vs_quix_{dest}{suffix}"] = round(
                    out[f"{side}_{dest}{suffix}_events_per_cpu_s"] / out[f"quix_{dest}{suffix}_events_per_cpu_s"], 3)
                out[f"{side}_vs_quix_{dest}{suffix}_rounds"] = [round(x, 3) for x in per_round]
        out["kill_schedule_s"] = res["schedule"]
    out["cpu_count"] = os.cpu_count()
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return out


def _quix_version() -> str:
    for line in QUIX_REQUIREMENTS.read_text().splitlines():
        if line.startswith("quixstreams"):
            return line.split("==")[-1].strip()
    return "?"


def print_table(args: argparse.Namespace, r: dict[str, Any], dests: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ingest: lake writer vs Quix Streams {r['quixstreams_version']} FileSink, {args.events} "
                        f"events x {args.rounds} rounds a format, each side on one core")
    for name in ("destination", "side", "v3 events/s", "v3 CPU s\nper 10k", "JSON CPU s\nper 10k",
                 "v3 bytes\nper event", f"p50 / p95 s\nreadable\n(at {args.live_rate:.0f}/s)",
                 f"after {args.kills} kills:\nlost / dup /\nunreadable"):
        table.add_column(name, justify="left" if name in ("destination", "side") else "right")
    for dest in dests:
        for side in args.sides:
            k = f"{side}_{dest}"
            kills = (f"{r[f'{k}_lost_after_kills']} / {r[f'{k}_duplicated_after_kills']} / "
                     f"{r[f'{k}_unreadable_files_after_kills']}") if f"{k}_lost_after_kills" in r else "-"
            table.add_row(dest, LABELS[side], f"{r[f'{k}_events_per_s']:,.0f}", f"{r[f'{k}_cpu_s_per_10k']:.3f}",
                          f"{r[f'{k}_json_cpu_s_per_10k']:.3f}", f"{r[f'{k}_bytes_per_event']:,.0f}",
                          f"{r[f'{k}_p50_visible_s']} / {r[f'{k}_p95_visible_s']}", kills)
        writers = [s for s in args.sides if s in CLIENTS]
        for i, side in enumerate(writers):
            table.add_row(dest, f"{LABELS[side]} / Quix, events per CPU s (target >= 1.0)", "",
                          f"{r[f'{side}_vs_quix_{dest}']:.2f}", f"{r[f'{side}_vs_quix_{dest}_json']:.2f}", "", "", "",
                          end_section=i == len(writers) - 1)
    Console(width=180).print(table)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.writer_rate:
        print(json.dumps(writer_round(json.loads(args.writer_rate))))
        return 0

    import tempfile

    from rich.console import Console

    from flywheel import stack

    console = Console(stderr=True)
    # a SIGTERM (a timeout, a user's kill) unwinds like Ctrl-C: the followers are stopped and the topics deleted
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    python = quix_python(Path(args.var_dir), console)
    scfg = stack.load_stack_config(["--kafka-bootstrap", args.kafka_bootstrap] if _stack_takes_flag() else [])
    started = stack.ensure_up(scfg, parts=["kafka", "s3"] if "s3" in args.lakes else ["kafka"])
    if started:
        console.print(f"started {started} for this benchmark")
    # both sides on the last core; this process (the producer and the watcher) on the others where there are any
    cores = sorted(os.sched_getaffinity(0))
    core = cores[-1]
    if len(cores) > 1:
        os.sched_setaffinity(0, set(cores[:-1]))
    suffix = uuid.uuid4().hex[:8]
    topics = {fmt: f"bench.peer.{fmt}.{suffix}" for fmt in FORMATS}
    made = list(topics.values())
    _create_topics(args, made)
    s3_root = f"s3://{scfg.s3_bucket}/bench_peer_{suffix}"
    results: dict[str, dict[str, Any]] = {}
    try:
        # underscores only: Quix's FileSink refuses a folder name with any other punctuation
        with tempfile.TemporaryDirectory(prefix="bench_peer_") as tmp_s:
            tmp = Path(tmp_s)
            sides = Sides(args, python, wire_shim(tmp), core, tmp)
            console.print(f"producing {args.events} events into {', '.join(topics.values())} ...")
            produce_prefilled(args.kafka_bootstrap, topics, args.events, seed=1)
            for dest in args.lakes:
                with environment(stack.s3_env(scfg) if dest == "s3" else {}):
                    results[dest] = run_lake(sides, dest, s3_root if dest == "s3" else str(tmp / "out"), topics,
                                             console)
                made += results[dest]["topics"]
    finally:
        _delete_topics(args, made)
        if "s3" in args.lakes:
            from bench.ingest import _delete_s3_lake

            _delete_s3_lake(s3_root, stack.s3_env(scfg))
        if started:
            stack.down(scfg, parts=started)
    result = summarize(args, results)
    print_table(args, result, list(results))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
