"""`flywheel bench chaos`: the whole closed loop under SIGKILLs and a broker outage, then an audit of
what the lake, Kafka, the learner and the registry hold.

    flywheel bench chaos [--seed 1] [--minutes 4] [--kills 14] [--outage-s 50]

1. Set-up: the tiny base model (no warm start), vLLM and the MLflow store of the shared stack
   (flywheel.stack.ensure_up), and a PRIVATE Kafka broker (flywheel.stack.start_kafka on free ports,
   data under the run folder), so the outage stops no one else's broker. Everything of the run lives
   under var/bench/chaos-<id>/: lake, topics <id>.events/.outcomes/.dlq, episode state, learner,
   policies, logs, the agent's hand-off file and event ledger.
2. The demo's processes, with the demo's own commands (flywheel.demo.plan) and process runner
   (flywheel.demo.closed_loop.Processes): lake writer, episode builder, capture proxy, outcome-sim,
   learner, promotion gate, and agent-sim with `--durable-handoff --event-ledger` (infra/demo/agent_sim.py).
3. For --minutes of traffic, on a schedule drawn from --seed: --kills SIGKILLs, each process in turn
   (a shuffled round of all seven, then the next round), each restarted at once with the same
   command and state, as a supervisor would; a process that exits on its own is restarted too (with
   back-off) and counted as a crash. Once, the broker is stopped (stop_kafka) for --outage-s and started
   again on the same data dir (start_kafka). One line per kill, restart, crash and outage.
4. The load stops (agent, then outcome-sim, then proxy: SIGTERM, so each delivers what it holds), the
   lake writer and the episode builder get up to --drain-s to catch up, everything else is stopped.
5. The audit (docs/reliability.md says how to read it): its items (each lost, duplicated or twice-trained event,
   where its trail stops, the faults around it) go to <run folder>/audit.json; then a table and, as the LAST
   line, one JSON object of counts. Exit status 0 when every check holds, 1 when one does not, 130 when
   interrupted.

Processes, the private broker and the vLLM weights are cleaned up on every exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime as dt
import fcntl
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from flywheel.demo.closed_loop import (
    REPO_ROOT,
    Processes,
    _free_port,
    _wait_for_proxy,
    ensure_models,
    lake_counts,
)
from flywheel.demo.plan import (
    DemoConfig,
    Endpoints,
    RunPlan,
    agent_sim_command,
    episodes_command,
    lake_writer_command,
    learner_command,
    outcome_sim_command,
    policy_v0,
    promote_command,
    proxy_command,
    tier_env,
)

log = logging.getLogger("bench.chaos")

# The loop's processes, in start order (the proxy before the agent, which needs it).
PROCESSES = ("lake-writer", "episodes", "proxy", "outcome-sim", "learner", "promote", "agent-sim")
# Stopped first at the end of traffic, in this order: the agent finishes its sessions through the proxy,
# the verifier then reports on the agent's last sessions, and the proxy delivers the last llm_calls.
LOAD = ("agent-sim", "outcome-sim", "proxy")
KILL_WINDOW = (20.0, 15.0)  # no kill in the first 20 s (processes still importing) or the last 15 s of traffic
# A kill waits until its target has run this long, so it hits a process at work rather than one still importing
# (the learner loads torch and the model before its first step).
MIN_UPTIME_S = {"learner": 25.0}
DEFAULT_MIN_UPTIME_S = 8.0
# A lost llm_call of a session that had a call answered this long before a proxy kill is attributed to that kill
# (the proxy logs a call just before replying; its SDK had not delivered it yet). Still counted in events_lost.
PROXY_KILL_WINDOW_S = 2.0
# The proxy's warnings for calls it answered but deliberately did not log (serving/proxy.py)
NOT_LOGGED = re.compile(r"proxy: session ([0-9a-f]{32})\b.*llm_call not logged")
AUDIT_FILE = "audit.json"  # in the run folder: the items behind the summary's counts
# An audit item lists the faults from 30 s before its event to 60 s after: a loss is caused after the hand-off
# (a kill of the SDK's host, the writer's catch-up after the outage), a duplicate by a replay after a kill before it.
FAULT_WINDOW_S = (30.0, 60.0)
MAX_LISTED = 1000  # items per category in the audit file (the count is always whole): a broken run stays readable


# ---------------------------------------------------------------------------------------------
# the plan: the demo's, with every path under var/bench/chaos-<id>
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChaosPlan(RunPlan):
    """The demo's RunPlan with the run folder as its var dir: heartbeats, lake, state and logs all under it."""

    @property
    def run_dir(self) -> Path:
        return self.var_dir

    @property
    def ledger(self) -> Path:
        return self.run_dir / "agent-ledger.jsonl"


def demo_config(args: argparse.Namespace, run_dir: Path, run_id: str) -> DemoConfig:
    """Small settings that fit a few minutes on 2 cores: the tiny base (no warm start), small learner batches,
    a gate that decides after a handful of sessions."""
    tuned = DemoConfig()  # the tool_use recipe
    learner = dataclasses.replace(tuned.learner, batch_size=args.learner_batch, min_batch=args.learner_batch,
                                  micro_batch=min(32, args.learner_batch), publish_every_steps=2, publish_every_s=30.0)
    cfg = DemoConfig(minutes=args.minutes, var_dir=run_dir, base_model=_in_repo(args.base_model), warm_start=False,
                     concurrency=args.concurrency, multi_share=0.2, learner=learner,
                     gate=dataclasses.replace(tuned.gate, min_sessions=5), gate_interval_s=5.0,
                     base_sessions=0, measure_s=0.0, live=False, run_id=run_id,
                     # two servers (champion and challenger), no control arm: the chaos run checks data, not lift
                     vllm_servers=2, control_share=0.0, challenger_share=0.5,
                     vllm_nice=0)  # the servers as `flywheel infra up` leaves them: a niceness cannot be lowered again
    cfg.check()
    return cfg


def _in_repo(path: str | Path) -> Path:
    """Relative paths are the repository's (every process runs there), whatever the bench's working directory."""
    return Path(path) if Path(path).is_absolute() else REPO_ROOT / path


Command = tuple[list[str], dict[str, str]]


def commands(cfg: DemoConfig, plan: ChaosPlan, ends: Endpoints, durable_timeout_s: float, seed: int) -> dict[str, Command]:
    """Each process's argv (the demo plan's) and extra environment; the agent also gets the chaos switches."""
    tier = tier_env(cfg, plan, ends)
    agent = [*agent_sim_command(cfg, plan, ends), "--durable-handoff", "--durable-timeout-s", str(durable_timeout_s),
             "--event-ledger", str(plan.ledger), "--seed", str(seed)]
    return {
        "lake-writer": (lake_writer_command(plan, ends), {}),
        "episodes": (episodes_command(plan), {}),
        "proxy": (proxy_command(plan, ends), tier),
        "outcome-sim": (outcome_sim_command(plan, ends), {}),
        "learner": (learner_command(cfg, plan, ends), tier),
        "promote": (promote_command(cfg, plan, ends), {}),
        "agent-sim": (agent, {}),
    }


# ---------------------------------------------------------------------------------------------
# the schedule (pure, seeded)
# ---------------------------------------------------------------------------------------------
@dataclass(order=True)
class Fault:
    at: float  # seconds after the traffic started
    kind: str  # "kill" or "outage"
    target: str = ""
    tries: int = 0  # times a kill was put off (target not up long enough)


def schedule(seed: int, traffic_s: float, kills: int, outage_s: float,
             processes: tuple[str, ...] = PROCESSES) -> list[Fault]:
    """`kills` SIGKILLs spread evenly over the traffic (one at a random moment of each slot), targets in
    shuffled rounds of every process, and one broker outage that ends at least 60 s before the traffic does."""
    rng = random.Random(seed)
    lo, hi = KILL_WINDOW[0], traffic_s - KILL_WINDOW[1]
    if hi <= lo or traffic_s < outage_s + 120:
        raise ValueError(f"--minutes {traffic_s / 60:g} is too short: the traffic must last at least outage_s + 120 s "
                         f"({(outage_s + 120) / 60:.1f} min) to hold the outage and the kills around it")
    order: list[str] = []
    while len(order) < kills:
        round_ = list(processes)
        rng.shuffle(round_)
        order.extend(round_)
    slot = (hi - lo) / max(1, kills)
    faults = [Fault(lo + i * slot + rng.uniform(0.1, 0.9) * slot, "kill", name) for i, name in enumerate(order[:kills])]
    start = rng.uniform(0.25 * traffic_s, traffic_s - outage_s - 60.0)
    faults.append(Fault(max(lo, start), "outage"))
    return sorted(faults)


# ---------------------------------------------------------------------------------------------
# the supervisor
# ---------------------------------------------------------------------------------------------
class Supervisor:
    """Runs the loop's processes as a supervisor would: a SIGKILLed process is started again at once, one that
    exits on its own after a back-off (1, 2, 4, 8 s), both with the same command and state dirs."""

    def __init__(self, procs: Processes, cmds: dict[str, Command], say: Callable[[str], None]) -> None:
        self.procs, self.cmds, self.say = procs, cmds, say
        self.kills: Counter[str] = Counter()
        self.kill_times: dict[str, list[float]] = defaultdict(list)
        self.timeline: list[tuple[float, str, str]] = []  # (epoch s, "kill" or "crash", process): the audit's faults
        self.restarts: Counter[str] = Counter()
        self.crashes: Counter[str] = Counter()
        self.exit_codes: dict[str, int | None] = {}
        self.started_at: dict[str, float] = {}
        self._retry_at: dict[str, float] = {}
        self._streak: Counter[str] = Counter()
        self.retired: set[str] = set()  # stopped on purpose at the end: not restarted

    def start(self, name: str) -> None:
        argv, env = self.cmds[name]
        self.procs.start(name, argv, env=env)
        self.started_at[name] = time.time()

    def uptime(self, name: str) -> float:
        return time.time() - self.started_at.get(name, time.time())

    def alive(self, name: str) -> bool:
        proc = self.procs.procs.get(name)
        return proc is not None and proc.poll() is None

    def kill(self, name: str) -> None:
        """SIGKILL the process group (torch and vLLM clients spawn helpers) and start it again at once."""
        proc = self.procs.procs[name]
        old, up = proc.pid, self.uptime(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it died a moment ago: the wait below reaps it, and the restart is the same
        proc.wait()
        self.kills[name] += 1
        self.kill_times[name].append(time.time())
        self.timeline.append((time.time(), "kill", name))
        self.start(name)
        self.restarts[name] += 1
        self.say(f"kill {sum(self.kills.values())}: {name} (pid {old}, up {up:.1f} s) SIGKILLed; "
                 f"restarted as pid {self.procs.procs[name].pid}")

    def tick(self) -> None:
        """Restart what exited on its own (after its back-off)."""
        now = time.time()
        for name, proc in list(self.procs.procs.items()):
            if name in self.retired or proc.poll() is None:
                continue
            if name not in self._retry_at:
                self.crashes[name] += 1
                self.timeline.append((now, "crash", name))
                self._streak[name] = 0 if self.uptime(name) > 30 else self._streak[name] + 1
                delay = float(min(8, 2 ** max(0, self._streak[name] - 1)))
                self._retry_at[name] = now + delay
                last = self.procs.tail(name, 1).strip()[:160]
                self.say(f"crash: {name} (pid {proc.pid}) exited with status {proc.returncode} on its own "
                         f"[{last}]; restarting in {delay:.0f} s")
            elif now >= self._retry_at[name]:
                del self._retry_at[name]
                self.start(name)
                self.restarts[name] += 1
                self.say(f"restart: {name} as pid {self.procs.procs[name].pid} (after {self.crashes[name]} crash(es))")

    def retire(self, name: str, timeout_s: float) -> int | None:
        """Stop on purpose (SIGTERM, SIGKILL after timeout_s); returns the exit status."""
        self.retired.add(name)
        self._retry_at.pop(name, None)
        rc = self.procs.stop(name, timeout_s)
        self.exit_codes[name] = rc
        return rc

    def retire_all(self, timeout_s: float) -> None:
        for name in reversed(list(self.procs.procs)):
            if name not in self.retired:
                self.retire(name, timeout_s)


# ---------------------------------------------------------------------------------------------
# the private broker and its outage
# ---------------------------------------------------------------------------------------------
class Broker:
    """A broker of this run only (same code as `flywheel infra up`), and the one outage, run in a thread so the
    supervisor keeps restarting and killing while the broker is away."""

    def __init__(self, kcfg: Any, say: Callable[[str], None]) -> None:
        self.kcfg, self.say = kcfg, say
        self.stopping_at: float | None = None  # the outage as the clients see it starts here, before down_at
        self.down_at: float | None = None
        self.up_at: float | None = None
        self.error: BaseException | None = None
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        from flywheel import stack

        stack.start_kafka(self.kcfg)

    def outage(self, seconds: float) -> None:
        self._thread = threading.Thread(target=self._outage, args=(seconds,), name="chaos-outage", daemon=True)
        self._thread.start()

    def _outage(self, seconds: float) -> None:
        from flywheel import stack

        try:
            self.say("broker: stopping (stop_kafka)")
            self.stopping_at = time.time()
            stack.stop_kafka(self.kcfg)
            self.down_at = time.time()
            self.say(f"broker: down; back in {seconds:.0f} s")
            if self._abort.wait(seconds):
                return  # interrupted: the clean-up stops this broker anyway
            self.say("broker: starting again on the same data dir (start_kafka)")
            stack.start_kafka(self.kcfg)
            self.up_at = time.time()
            self.say(f"broker: back after {self.up_at - self.down_at:.1f} s down")
        except BaseException as exc:  # reported by the main loop, which stops the run
            self.error = exc

    @property
    def outage_s(self) -> float:
        return round(self.up_at - self.down_at, 1) if self.up_at and self.down_at else 0.0

    @property
    def in_outage(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_outage(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def abort(self) -> None:
        """An outage in progress ends without starting the broker again (the clean-up stops it anyway)."""
        self._abort.set()

    def stop(self) -> None:
        from flywheel import stack

        self._abort.set()
        self.wait_outage(180.0)  # a start in progress finishes (or times out) first, then it is stopped
        stack.stop_kafka(self.kcfg)
        shutil.rmtree(Path(self.kcfg.var_dir) / "kafka" / "data", ignore_errors=True)  # the lake holds the data


# ---------------------------------------------------------------------------------------------
# what the run left behind, read back
# ---------------------------------------------------------------------------------------------
@dataclass
class Ledger:
    """The agent's ledger: the events it handed to the SDK per session and how each finished session ended."""

    expected: dict[str, Counter[tuple[str, str]]] = field(default_factory=lambda: defaultdict(Counter))
    done: dict[str, tuple[str, bool | None]] = field(default_factory=dict)  # session -> (status, durable)
    llm_times: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # when each reply arrived
    # (session, agent, type) -> when each event was handed to the SDK, in ledger order: the audit's handed_at
    times: dict[tuple[str, str, str], list[float]] = field(default_factory=lambda: defaultdict(list))


def read_ledger(path: Path) -> Ledger:
    out = Ledger()
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a kill (os.write of one short line makes this all but impossible)
        if rec["type"] == "done":
            out.done[rec["session_id"]] = (str(rec.get("status")), rec.get("durable"))
        else:
            out.expected[rec["session_id"]][(rec["agent_id"], rec["type"])] += 1
            out.times[(rec["session_id"], rec["agent_id"], rec["type"])].append(float(rec.get("t", 0.0)))
            if rec["type"] == "llm_call":
                out.llm_times[rec["session_id"]].append(float(rec.get("t", 0.0)))
    return out


def not_logged_calls(proxy_log: Path) -> Counter[str]:
    """Per session, the calls the proxy answered but deliberately did not log (a weight reload during the call,
    or vLLM returned no token ids): the agent counted them, the lake must not have them."""
    out: Counter[str] = Counter()
    try:
        text = proxy_log.read_text(errors="replace")
    except FileNotFoundError:
        return out
    for m in NOT_LOGGED.finditer(text):
        out[m.group(1)] += 1
    return out


def read_table(lake_root: Path, table: str, columns: list[str]) -> list[dict[str, Any]]:
    """Rows of every visible lake file of a table (lake.list_files hides files a compaction covers)."""
    import pyarrow.parquet as pq

    from flywheel.ingest import lake

    rows: list[dict[str, Any]] = []
    for f in lake.list_files(str(lake_root), table):
        data = pq.read_table(f.path, columns=columns)
        rows.extend(data.to_pylist())
    return rows


def lake_ranges(lake_root: Path, table: str, source: str) -> dict[int, list[tuple[int, int]]]:
    from flywheel.ingest import lake

    out: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for f in lake.list_files(str(lake_root), table):
        if f.source == source:
            out[f.partition].append((f.first, f.last))
    return {p: sorted(r) for p, r in out.items()}


def read_topic(bootstrap: str, topic: str, timeout_s: float = 60.0) -> tuple[list[tuple[int, int, bytes | None]], dict[int, int]]:
    """Every record of a topic as (partition, offset, value), and each partition's end offset."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                             max_partition_fetch_bytes=8 * 1024 * 1024, fetch_max_bytes=64 * 1024 * 1024)
    try:
        deadline = time.time() + timeout_s
        parts = consumer.partitions_for_topic(topic)
        while not parts and time.time() < deadline:
            consumer.topics()  # fetches metadata
            parts = consumer.partitions_for_topic(topic)
        tps = [TopicPartition(topic, p) for p in sorted(parts or [])]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        records: list[tuple[int, int, bytes | None]] = []
        while time.time() < deadline and any(consumer.position(tp) < ends[tp] for tp in tps):
            for batch in consumer.poll(timeout_ms=1000, max_records=5000).values():
                records.extend((r.partition, r.offset, r.value) for r in batch)
        return records, {tp.partition: int(ends[tp]) for tp in tps}
    finally:
        consumer.close()


def trained_log(learner_dir: Path) -> list[dict[str, Any]]:
    from flywheel.learner.checkpoint import read_trained

    return read_trained(learner_dir)


def checkpoint_step(learner_dir: Path) -> int | None:
    """The step of the learner's newest checkpoint (None: none yet): where its weights stand once it stopped."""
    from flywheel.learner.checkpoint import latest_state

    found = latest_state(learner_dir)
    return found[1].step if found is not None else None


def registered_versions(tracking_uri: str, model: str) -> set[int]:
    from flywheel.serving.registry import Registry

    return {v.policy_version for v in Registry(tracking_uri, model).versions()}


def spool_records(run_id: str) -> dict[str, int]:
    """Records still in each SDK spool of this run once every process stopped (-1: unreadable)."""
    return read_spools(run_id, records=False)[0]


def read_spools(run_id: str, records: bool = True) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """What each SDK spool of this run still holds once every process stopped: its record count (-1: unreadable),
    and (`records`) the events among the records, which Kafka never acknowledged: their trail fields and the
    spool's name."""
    from flywheel.ingest.spool import Spool

    counts: dict[str, int] = {}
    events: list[dict[str, Any]] = []
    root = REPO_ROOT / "var" / "spool"
    for directory in sorted(root.glob(f"{run_id}-*")) if root.is_dir() else []:
        try:
            spool = Spool(directory)
            try:
                counts[directory.name] = len(spool)
                values = spool.peek(len(spool)) if records else []  # from the head, nothing consumed
            finally:
                spool.close()
        except Exception as exc:  # a spool format of another SDK version: say so instead of guessing
            log.warning("chaos: spool %s unreadable (%s)", directory, exc)
            counts[directory.name] = -1
            continue
        events.extend({**e, "spool": directory.name} for e in map(wire_event, values) if e is not None)
    return counts, events


@dataclass
class Facts:
    """Everything the checks read, as plain data (so the checks are pure and unit-tested)."""

    ledger: Ledger
    not_logged: Counter[str]
    events: list[dict[str, Any]]  # lake events: EVENT_COLUMNS below
    outcomes: list[dict[str, Any]]  # lake outcomes: session_id, agent_id, kind, _ingest_ts
    episodes: list[dict[str, Any]]  # lake episodes: episode_id, label_version, session_id
    trained: list[dict[str, Any]]  # learner trained.jsonl lines
    registered: set[int] | None  # None: the registry could not be read
    kafka: list[tuple[int, int, bytes | None]]  # events topic (empty while draining: only its end offsets are read)
    kafka_ends: dict[str, dict[int, int]]  # table (events, outcomes) -> partition -> end offset of its topic
    lake_ranges: dict[str, dict[int, list[tuple[int, int]]]]  # table -> partition -> file ranges
    dlq: list[bytes | None]
    spools: dict[str, int]
    horizon: float  # epoch seconds: when the episode builder was last given the chance to label
    proxy_kills: list[float] = field(default_factory=list)  # epoch seconds of each SIGKILL of the proxy
    rewards: Any = None  # flywheel.rewards.config.RewardConfig the builder ran with
    spooled: list[dict[str, Any]] = field(default_factory=list)  # events left in the SDK spools: TRAIL_FIELDS + spool
    faults: list[dict[str, Any]] = field(default_factory=list)  # the faults as done: ChaosRun.fault_timeline()
    checkpoint_step: int | None = None  # the learner's newest checkpoint: trained lines above it are of lost weights


EVENT_COLUMNS = ["event_id", "session_id", "agent_id", "type", "seq", "ts", "task_type", "policy_version", "model",
                 "_partition", "_offset"]
TRAIL_FIELDS = ("event_id", "session_id", "agent_id", "type", "seq", "ts")  # what an audit item says of its event


def wire_event(value: bytes | None) -> dict[str, Any] | None:
    """The trail fields of an event as it travels (a Kafka value, a spool record, a DLQ original), or None for
    anything else (an outcome, bytes that are not JSON). Every encoding of ingest/wire.py is JSON at the top."""
    try:
        record = json.loads(value or b"")
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("event_id") is None:
        return None
    return {**{k: record.get(k) for k in TRAIL_FIELDS}, "event_id": str(record["event_id"])}


def topic_ends(bootstrap: str, topic: str) -> dict[int, int]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        ends = consumer.end_offsets([TopicPartition(topic, p) for p in parts])
        return {tp.partition: int(n) for tp, n in ends.items()}
    finally:
        consumer.close()


def gather(plan: ChaosPlan, ends: Endpoints, horizon: float, full: bool = True,
           proxy_kills: list[float] | None = None, faults: list[dict[str, Any]] | None = None) -> Facts:
    """Read everything back; `full=False` (the drain's polls) skips the topic contents, the spools' records and
    the registry."""
    from flywheel.rewards import config as reward_config

    registered: set[int] | None = None
    if full:
        try:
            registered = registered_versions(ends.tracking_uri, plan.registered_model)
        except Exception as exc:
            log.warning("chaos: registry %s unreadable (%s)", ends.tracking_uri, exc)
    kafka: list[tuple[int, int, bytes | None]] = []
    dlq: list[bytes | None] = []
    kafka_ends = {"outcomes": topic_ends(ends.kafka_bootstrap, plan.topics["outcomes"])}
    if full:
        kafka, kafka_ends["events"] = read_topic(ends.kafka_bootstrap, plan.topics["events"])
        dlq = [v for _, _, v in read_topic(ends.kafka_bootstrap, plan.topics["dlq"])[0]]
    else:
        kafka_ends["events"] = topic_ends(ends.kafka_bootstrap, plan.topics["events"])
    spools, spooled = read_spools(plan.run_id) if full else ({}, [])
    return Facts(
        ledger=read_ledger(plan.ledger), not_logged=not_logged_calls(plan.log_dir / "proxy.log"),
        events=read_table(plan.lake_root, "events", EVENT_COLUMNS),
        outcomes=read_table(plan.lake_root, "outcomes", ["session_id", "agent_id", "kind", "_ingest_ts"]),
        episodes=read_table(plan.lake_root, "episodes", ["episode_id", "label_version", "session_id"]),
        trained=trained_log(plan.learner_dir), checkpoint_step=checkpoint_step(plan.learner_dir),
        registered=registered, kafka=kafka, kafka_ends=kafka_ends,
        lake_ranges={t: lake_ranges(plan.lake_root, t, plan.topics[t]) for t in ("events", "outcomes")}, dlq=dlq,
        spools=spools, horizon=horizon, proxy_kills=list(proxy_kills or []), rewards=reward_config.load(None),
        spooled=spooled, faults=list(faults or []))


# ---------------------------------------------------------------------------------------------
# the checks (pure)
# ---------------------------------------------------------------------------------------------
def _dead_letters(dlq: Iterable[bytes | None]) -> tuple[Counter[str], Counter[tuple[str, str, str]]]:
    """DLQ reasons, and per (session, agent, type) the events of the run the lake writer refused."""
    reasons: Counter[str] = Counter()
    refused: Counter[tuple[str, str, str]] = Counter()
    for value in dlq:
        try:
            letter = json.loads(value or b"")
            reasons[str(letter.get("reason"))] += 1
            event = json.loads(base64.b64decode(letter.get("original_b64") or ""))
            refused[(str(event["session_id"]), str(event.get("agent_id", "main")), str(event["type"]))] += 1
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a letter whose original is not an event: counted by reason only
    return reasons, refused


def _dead_letter_events(dlq: Iterable[bytes | None]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each DLQ letter whose original is an event: its reason and the event's trail fields."""
    for value in dlq:
        try:
            letter = json.loads(value or b"")
            event = wire_event(base64.b64decode(letter.get("original_b64") or ""))
        except (ValueError, TypeError, AttributeError):
            continue
        if event is not None:
            yield str(letter.get("reason")), event


def _dead_letter_ids(dlq: Iterable[bytes | None]) -> set[str]:
    return {event["event_id"] for _, event in _dead_letter_events(dlq)}


@dataclass(frozen=True)
class Shortfall:
    """Events of one session's (agent, type) that the ledger lists and the lake lacks."""

    session_id: str
    agent_id: str | None  # None for llm_calls: counted per session (the proxy logs them under the caller's agent id)
    type: str
    missing: int  # in neither the lake (distinct event_ids) nor the DLQ; llm_calls less those the proxy did not log
    dead: int  # in the DLQ instead


def shortfalls(f: Facts) -> Iterator[tuple[str, list[Shortfall]]]:
    """Per session of the ledger, its shortfalls: one per (agent, type), and one for all its llm_calls."""
    got: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    seen: set[str] = set()
    for e in f.events:
        if e["event_id"] not in seen:
            seen.add(e["event_id"])
            got[e["session_id"]][(e["agent_id"], e["type"])] += 1
    _, refused = _dead_letters(f.dlq)
    for sid, want in f.ledger.expected.items():
        gaps = []
        for (agent, etype), n in want.items():
            if etype == "llm_call":
                continue
            have = got[sid][(agent, etype)]
            dead = min(refused[(sid, agent, etype)], max(0, n - have))
            gaps.append(Shortfall(sid, agent, etype, max(0, n - have - dead), dead))
        # the proxy logs llm_calls under the caller's agent id; compare per session, less the calls the proxy said it
        # did not log
        want_llm = sum(n for (_, t), n in want.items() if t == "llm_call") - f.not_logged[sid]
        got_llm = sum(n for (_, t), n in got[sid].items() if t == "llm_call")
        gaps.append(Shortfall(sid, None, "llm_call", max(0, want_llm - got_llm), 0))
        yield sid, gaps


def event_checks(f: Facts) -> dict[str, Any]:
    """Ledger vs lake: each event the agent logged is in the lake once by event_id (or in the DLQ, counted apart)."""
    rows_per_id = Counter(e["event_id"] for e in f.events)
    ids_of: dict[str, set[str]] = defaultdict(set)
    for e in f.events:
        ids_of[e["session_id"]].add(e["event_id"])
    out: dict[str, Any] = {"events_lost": 0, "events_lost_near_proxy_kill": 0, "events_lost_uncompleted": 0,
                           "events_dead_lettered": 0,
                           "sessions_in_lake": 0, "sessions_incomplete_in_lake": 0, "sessions_with_duplicates": 0,
                           "sessions_lost_entirely": 0}
    lost_by_type: Counter[str] = Counter()
    for sid, gaps in shortfalls(f):
        completed = sid in f.ledger.done
        missing = sum(g.missing for g in gaps)
        out["events_dead_lettered"] += sum(g.dead for g in gaps)
        for g in gaps:
            lost_by_type[g.type] += g.missing if completed else 0
        short = sum(g.missing for g in gaps if g.agent_id is None)  # the llm_calls
        if completed and short and any(k - PROXY_KILL_WINDOW_S <= t <= k for t in f.ledger.llm_times.get(sid, ())
                                       for k in f.proxy_kills):
            out["events_lost_near_proxy_kill"] += short
        out["events_lost" if completed else "events_lost_uncompleted"] += missing
        if not completed:
            continue
        duplicated = any(rows_per_id[i] > 1 for i in ids_of.get(sid, ()))
        out["sessions_with_duplicates"] += int(duplicated)
        out["sessions_lost_entirely"] += int(sid not in ids_of)
        if missing == 0 and not duplicated:
            out["sessions_in_lake"] += 1
        else:
            out["sessions_incomplete_in_lake"] += int(missing > 0)
    out["events_lost_by_type"] = {k: v for k, v in sorted(lost_by_type.items()) if v}
    out["llm_calls_not_logged_by_proxy"] = sum(f.not_logged.values())
    out["events_duplicated_in_lake"] = sum(n - 1 for n in rows_per_id.values())
    out["events_duplicated_by_content"] = len(_content_duplicates(f.events))
    out["lake_events"] = len(f.events)
    return out


def _content_duplicates(events: list[dict[str, Any]]) -> dict[str, str]:
    """Second copies of one event under a NEW event_id (same session, agent, type, seq and ts): their event_id ->
    the first copy's."""
    first: dict[tuple[Any, ...], str] = {}
    dups: dict[str, str] = {}
    for e in events:
        key = (e["session_id"], e["agent_id"], e["type"], e["seq"], str(e["ts"]))
        if first.setdefault(key, e["event_id"]) != e["event_id"]:
            dups[e["event_id"]] = first[key]
    return dups


def session_counts(f: Facts) -> dict[str, Any]:
    done = f.ledger.done
    return {"sessions_completed": len(done), "sessions_completed_ok": sum(1 for s, _ in done.values() if s == "ok"),
            "sessions_not_confirmed": sum(1 for _, d in done.values() if d is False),
            "sessions_uncompleted": sum(1 for s in f.ledger.expected if s not in done)}


def matured_sessions(f: Facts) -> tuple[dict[str, set[str]], int]:
    """Completed ok sessions whose label 1 is due by the horizon, as the episode builder decides it (every
    outcome kind its task type waits for is in the lake, or the longest window of those kinds has passed), each
    with its llm_call event_ids; and how many more have their outcomes in the lake but are not due by the horizon
    yet (the drain waits for them). Sessions with no llm_call in the lake have nothing to train on (the builder
    drops them) and are left out."""
    kinds: dict[str, set[str]] = defaultdict(set)
    landed: dict[str, set[str]] = defaultdict(set)
    for o in f.outcomes:
        if o.get("agent_id"):
            continue  # about one sub-agent or one tool call (demo verifier): only the session's own satisfy wait_for
        landed[o["session_id"]].add(o["kind"])
        if _epoch(o["_ingest_ts"]) <= f.horizon:  # landed in time for the builder's passes before the horizon
            kinds[o["session_id"]].add(o["kind"])
    task_type: dict[str, str | None] = {}
    end_ts: dict[str, float] = {}
    llm: dict[str, set[str]] = defaultdict(set)
    for e in f.events:
        if e["type"] == "session_start":
            task_type[e["session_id"]] = e["task_type"]
        elif e["type"] == "session_end":
            end_ts[e["session_id"]] = _epoch(e["ts"])
        elif e["type"] == "llm_call":
            llm[e["session_id"]].add(e["event_id"])
    out: dict[str, set[str]] = {}
    waiting = 0
    for sid, (status, _) in f.ledger.done.items():
        if status != "ok" or not llm.get(sid) or sid not in end_ts:
            continue
        task = f.rewards.task(task_type.get(sid))
        windows = [f.rewards.kind(k).window_s for k in task.wait_for if f.rewards.kind(k) is not None]
        grace = f.rewards.join.end_grace_s
        arrived = set(task.wait_for) <= kinds.get(sid, set()) and end_ts[sid] + grace <= f.horizon
        closed = end_ts[sid] + max(windows, default=0.0) + grace <= f.horizon
        if arrived or closed:
            out[sid] = llm[sid]
        elif set(task.wait_for) <= landed.get(sid, set()):
            waiting += 1
    return out, waiting


def _epoch(ts: Any) -> float:
    return ts.timestamp() if hasattr(ts, "timestamp") else float(ts)


def episode_checks(f: Facts) -> dict[str, Any]:
    """Episodes: no event twice in a label, every matured session labelled with every llm_call it has in the lake."""
    per_label = Counter((r["episode_id"], r["label_version"]) for r in f.episodes)
    dup_events = _content_duplicates(f.events)
    from_dups = sum(1 for r in f.episodes if r["episode_id"] in dup_events)
    label1: dict[str, set[str]] = defaultdict(set)
    for r in f.episodes:
        if r["label_version"] == 1:
            label1[r["session_id"]].add(r["episode_id"])
    matured, waiting = matured_sessions(f)
    without = [s for s in matured if not label1.get(s)]
    short = {s: len(ids - label1[s]) for s, ids in matured.items() if label1.get(s) and ids - label1[s]}
    judged = {o["session_id"] for o in f.outcomes}
    sessions_without_outcome = sum(1 for s, (status, _) in f.ledger.done.items() if status == "ok" and s not in judged)
    return {"events_duplicated_in_episodes": sum(n - 1 for n in per_label.values()) + from_dups,
            "episode_rows": len(f.episodes), "matured_sessions": len(matured), "sessions_not_matured_yet": waiting,
            "matured_sessions_without_episodes": len(without), "matured_sessions_incomplete_episodes": len(short),
            "episode_rows_missing": sum(short.values()) + sum(len(matured[s]) for s in without),
            "sessions_without_outcome": sessions_without_outcome}


def trained_checks(lines: list[dict[str, Any]], checkpoint_step: int | None = None) -> dict[str, Any]:
    """The trained log read along the weights' lineage (learner.checkpoint.trained_lineage): a SIGKILL sends the learner
    back to its last checkpoint, which may be up to checkpoint_every_steps steps old, and the steps after it are
    logged again under the same numbers, trained from the checkpoint's weights; the lines of the weights the kill
    lost count as redone, not as training. checkpoint_step: the newest checkpoint once the learner stopped (lines
    above it are of lost weights too). An episode in two steps of the lineage was trained twice."""
    by_step, steps_of = _trained_steps(lines, checkpoint_step)
    return {"episodes_trained_twice": sum(1 for s in steps_of.values() if len(s) > 1), "learner_steps": len(by_step),
            "episodes_trained": len(steps_of), "learner_steps_redone": len(lines) - len(by_step)}


def _trained_steps(lines: list[dict[str, Any]],
                   checkpoint_step: int | None = None) -> tuple[dict[int, dict[str, Any]], dict[str, list[int]]]:
    """The lineage's line of each step, and per episode id the steps of the lineage that trained it, in order."""
    from flywheel.learner.checkpoint import trained_lineage

    by_step = {int(line["step"]): line for line in trained_lineage(lines, checkpoint_step)}
    steps_of: dict[str, list[int]] = defaultdict(list)
    for step, line in sorted(by_step.items()):
        for episode_id in set(line["episode_ids"]):
            steps_of[episode_id].append(step)
    return by_step, steps_of


def served_checks(f: Facts) -> dict[str, Any]:
    """Every policy version the proxy logged on an llm_call is registered (0, the base, is what the registered
    model starts from and is never a model version of its own)."""
    served = sorted({int(e["policy_version"]) for e in f.events if e["type"] == "llm_call" and e["policy_version"] is not None})
    models = sorted({str(e["model"]) for e in f.events if e["type"] == "llm_call" and e["model"] is not None})
    unregistered = [v for v in served if v != 0 and (f.registered is None or v not in f.registered)]
    return {"served_versions": served, "served_models": models, "unregistered_served_versions": unregistered,
            "registry_readable": f.registered is not None}


def kafka_checks(f: Facts) -> dict[str, Any]:
    """The topics against the lake: every record's offset of the events and outcomes topics is covered by a lake
    file (no gap, nothing left behind), and every event_id the events topic holds is in the lake unless it was
    dead-lettered."""
    lake_ids = {e["event_id"] for e in f.events}
    reasons, _ = _dead_letters(f.dlq)
    refused_ids = _dead_letter_ids(f.dlq)
    # a record that is not an event is counted by the DLQ
    kafka_ids = Counter(e["event_id"] for e in map(wire_event, (v for _, _, v in f.kafka)) if e is not None)
    gaps, behind = 0, 0
    for table, partitions in f.kafka_ends.items():
        for p, end in partitions.items():
            reach = 0
            for first, last in f.lake_ranges.get(table, {}).get(p, []):
                gaps += int(first > reach)
                reach = max(reach, last + 1)
            behind += max(0, end - reach)
    return {"kafka_records": len(f.kafka), "kafka_events_duplicated": sum(n - 1 for n in kafka_ids.values()),
            "kafka_events_not_in_lake": len(set(kafka_ids) - lake_ids - refused_ids), "lake_offset_gaps": gaps,
            "lake_behind_kafka": behind, "dlq_records": sum(reasons.values()), "dlq_reasons": dict(reasons)}


def audit(f: Facts) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in (session_counts(f), event_checks(f), episode_checks(f), trained_checks(f.trained, f.checkpoint_step),
                 served_checks(f), kafka_checks(f) if f.kafka_ends else {}):
        out.update(part)
    out["spool_records_left"] = sum(n for n in f.spools.values() if n > 0)
    out["spools"] = f.spools
    return out


# ---------------------------------------------------------------------------------------------
# the audit's items (pure): each lost, duplicated or twice-trained event, where its trail stops, the faults around it
# ---------------------------------------------------------------------------------------------
STAGES = {
    "sdk": "handed to an SDK: the agent's ledger lists it (an llm_call: the proxy answered it, so its SDK had it)",
    "spool": "still in an SDK spool on disk when the audit ran: not replayed, or replayed without an acknowledgement",
    "kafka": "in the events topic",
    "dlq": "in the DLQ topic: the lake writer refused it",
    "lake": "in the lake's events table",
    "episodes": "in an episode row (an llm_call: the episode_id is its event_id)",
}
TRAIL = ("sdk", "spool", "kafka", "lake", "episodes")  # the way an event goes; its trail stops at the last it reached


@dataclass
class Trails:
    """Every copy of every event the run left, by event_id and stage (read once from the Facts), so an item can
    say which stages saw its event."""

    lake: dict[str, list[dict[str, Any]]]  # lake rows, with _partition and _offset
    kafka: dict[str, list[dict[str, Any]]]  # topic records: TRAIL_FIELDS, partition and offset
    spool: dict[str, list[dict[str, Any]]]  # spool records: TRAIL_FIELDS and spool
    dlq: dict[str, list[dict[str, Any]]]  # DLQ originals: TRAIL_FIELDS and reason
    episodes: dict[str, list[int]]  # episode_id -> the label versions of its rows
    lake_files: dict[int, list[tuple[int, int]]]  # events topic partition -> offset ranges of the lake's files
    by_session: dict[str, list[dict[str, Any]]]  # session -> one copy of each of its events, lake copies first

    @classmethod
    def of(cls, f: Facts) -> "Trails":
        def index(copies: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
            out: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for c in copies:
                out[c["event_id"]].append(c)
            return dict(out)

        kafka = ({**e, "partition": p, "offset": o} for p, o, v in f.kafka if (e := wire_event(v)) is not None)
        episodes: dict[str, list[int]] = defaultdict(list)
        for r in f.episodes:
            episodes[r["episode_id"]].append(int(r["label_version"]))
        trails = cls(lake=index(f.events), kafka=index(kafka), spool=index(f.spooled),
                     dlq=index({**e, "reason": reason} for reason, e in _dead_letter_events(f.dlq)),
                     episodes=dict(episodes), lake_files=f.lake_ranges.get("events", {}), by_session={})
        by_session: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
        for stage in (trails.lake, trails.kafka, trails.spool, trails.dlq):
            for event_id, copies in stage.items():
                by_session[str(copies[0]["session_id"])].setdefault(event_id, copies[0])
        trails.by_session = {sid: list(events.values()) for sid, events in by_session.items()}
        return trails

    def first(self, event_id: str) -> dict[str, Any]:
        """The event's fields from the furthest stage that holds it (a bare event_id when none does)."""
        for stage in (self.lake, self.kafka, self.spool, self.dlq):
            if event_id in stage:
                return stage[event_id][0]
        return {"event_id": event_id}

    def where(self, event_id: str) -> dict[str, Any]:
        """The stages that hold the event (STAGES order, "sdk" aside) and its copies in each."""
        out: dict[str, Any] = {"seen_in": [s for s in STAGES if s != "sdk" and event_id in getattr(self, s)]}
        if event_id in self.spool:
            out["spool"] = sorted({c["spool"] for c in self.spool[event_id]})
        if event_id in self.kafka:
            out["kafka"] = [{"partition": c["partition"], "offset": c["offset"],
                             "lake_file_covers": self.covers(c["partition"], c["offset"])} for c in self.kafka[event_id]]
        if event_id in self.dlq:
            out["dlq"] = [c["reason"] for c in self.dlq[event_id]]
        if event_id in self.lake:
            out["lake"] = [{"partition": r.get("_partition"), "offset": r.get("_offset")} for r in self.lake[event_id]]
        if event_id in self.episodes:
            out["episodes"] = sorted(self.episodes[event_id])
        return out

    def covers(self, partition: int, offset: int) -> bool:
        """Whether a lake file claims this offset: if so, the writer passed the record and the lake lacks it anyway."""
        return any(first <= offset <= last for first, last in self.lake_files.get(partition, ()))


def _ts_epoch(ts: Any) -> float | None:
    """Epoch seconds of a timestamp as the lake (datetime) or the wire (ISO-8601 text) holds it."""
    if ts is None:
        return None
    if hasattr(ts, "timestamp"):
        return float(ts.timestamp())
    if isinstance(ts, (int, float)):
        return float(ts)
    try:
        return dt.datetime.fromisoformat(str(ts).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _fields(e: dict[str, Any]) -> dict[str, Any]:
    out = {k: e.get(k) for k in TRAIL_FIELDS}
    out["ts"] = e["ts"].isoformat() if hasattr(e.get("ts"), "isoformat") else e.get("ts")
    return out


def _order(e: dict[str, Any]) -> tuple[float, int]:
    return _ts_epoch(e.get("ts")) or 0.0, int(e.get("seq") or 0)


def _stops_at(seen: list[str]) -> str:
    reached = [s for s in TRAIL if s in seen]
    return reached[-1] if reached else "dlq" if "dlq" in seen else "nowhere"


def faults_around(faults: list[dict[str, Any]], lo: float | None, hi: float | None = None) -> list[dict[str, Any]]:
    """The faults from FAULT_WINDOW_S[0] before lo to FAULT_WINDOW_S[1] after hi (an outage when any of it falls in),
    by time, each with dt_s: its start less lo (negative: before the event)."""
    if lo is None:
        return []
    hi = lo if hi is None else hi
    before, after = FAULT_WINDOW_S
    out = []
    for x in sorted(faults, key=lambda x: x["t"]):
        end = x.get("until", x["t"])
        if (math.inf if end is None else end) >= lo - before and x["t"] <= hi + after:
            out.append({**x, "dt_s": round(x["t"] - lo, 1)})
    return out


def _item(e: dict[str, Any], tr: Trails, faults: list[dict[str, Any]], at: float | None = None,
          handed: bool = False, **extra: Any) -> dict[str, Any]:
    """One event's audit item: its fields, `extra`, the stages that saw it, where its trail stops, and the faults
    around `at` (default: its ts). `handed`: the ledger lists it, so its trail starts at the SDK."""
    where = tr.where(e["event_id"])
    seen = (["sdk"] if handed else []) + where.pop("seen_in")
    at = _ts_epoch(e.get("ts")) if at is None else at
    return {**_fields(e), **extra, "seen_in": seen, "stops_at": _stops_at(seen), **where,
            "faults": faults_around(faults, at)}


def _ledger_lines(ledger: Ledger, gap: Shortfall) -> list[tuple[float, str]]:
    """When each event of a shortfall's group was handed to the SDK, with its agent (llm_calls: of every agent)."""
    agents = [gap.agent_id] if gap.agent_id is not None else sorted(
        {a for a, t in ledger.expected.get(gap.session_id, {}) if t == gap.type})
    return [(t, a) for a in agents for t in ledger.times.get((gap.session_id, a, gap.type), ())]


def _handed(lines: list[tuple[float, str]], known: list[dict[str, Any]]) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """Pairs each known event of a group with the ledger line nearest its ts (the agent notes an event just before the
    SDK call that stamps ts; the proxy stamps an llm_call just before the reply the agent notes), and returns the
    lines left over: the unseen events' hand-offs."""
    free = sorted(lines)
    handed: dict[str, float] = {}
    for e in sorted(known, key=_order):
        ts = _ts_epoch(e.get("ts"))
        if ts is None or not free:
            continue
        i = min(range(len(free)), key=lambda j: abs(free[j][0] - ts))
        handed[e["event_id"]] = free.pop(i)[0]
    return handed, free


def _content_key(e: dict[str, Any]) -> tuple[Any, ...]:
    ts = _ts_epoch(e.get("ts"))
    return e["session_id"], e["agent_id"], e["type"], e.get("seq"), None if ts is None else round(ts, 6)


def _lost_of(f: Facts, tr: Trails, gap: Shortfall) -> list[dict[str, Any]]:
    """One shortfall's lost events: first those a spool or the topic holds (the lake and the DLQ do not, nor a copy of
    the same content under another event_id), then as many never seen anywhere as are still missing. Each gets its
    hand-off time where the ledger pins it; an unseen one whose line is ambiguous gets the candidate times."""
    group: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in tr.by_session.get(gap.session_id, ()):  # lake copies first: a re-issued copy is not a lost event
        if e["type"] == gap.type and (gap.agent_id is None or e["agent_id"] == gap.agent_id):
            group.setdefault(_content_key(e), e)
    known = list(group.values())
    found = sorted((e for e in known if e["event_id"] not in tr.lake and e["event_id"] not in tr.dlq),
                   key=_order)[:gap.missing]
    handed, free = _handed(_ledger_lines(f.ledger, gap), known)
    status, durable = f.ledger.done.get(gap.session_id, (None, None))
    session = {"session_completed": gap.session_id in f.ledger.done, "session_status": status, "durable": durable}
    items = [_item(e, tr, f.faults, at=handed.get(e["event_id"]), handed=True,
                   handed_at=handed.get(e["event_id"]), **session) for e in found]
    unseen = gap.missing - len(found)
    pinned = len(free) == unseen  # more lines than events: the proxy did not log some calls, which is which is unknown
    for i in range(unseen):
        line = free[i] if pinned else None
        item = {"event_id": None, "session_id": gap.session_id, "agent_id": line[1] if line else gap.agent_id,
                "type": gap.type, "seq": None, "ts": None, "handed_at": line[0] if line else None, **session,
                "seen_in": ["sdk"], "stops_at": "sdk"}
        if line is None and free:
            item["handed_at_candidates"] = [t for t, _ in free[:20]]
        times = [line[0]] if line else [t for t, _ in free]
        item["faults"] = faults_around(f.faults, min(times), max(times)) if times else []
        items.append(item)
    return items


def lost_items(f: Facts, tr: Trails) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ledger's events the lake lacks, as event_checks counts them: of completed sessions (events_lost), and of
    sessions in flight when the agent was killed (events_lost_uncompleted)."""
    lost: list[dict[str, Any]] = []
    uncompleted: list[dict[str, Any]] = []
    for sid, gaps in shortfalls(f):
        into = lost if sid in f.ledger.done else uncompleted
        for gap in gaps:
            if gap.missing:
                into.extend(_lost_of(f, tr, gap))
    return lost, uncompleted


def duplicate_items(f: Facts, tr: Trails) -> dict[str, list[dict[str, Any]]]:
    """Events in the lake twice (by event_id, or the same content under a new id), and episode rows twice."""
    in_lake = [_item(copies[0], tr, f.faults, lake_rows=len(copies)) for copies in tr.lake.values() if len(copies) > 1]
    reissued = _content_duplicates(f.events)
    by_content = [_item(tr.first(dup), tr, f.faults, same_as=first) for dup, first in reissued.items()]
    rows = Counter((r["episode_id"], r["label_version"]) for r in f.episodes)
    in_episodes = [_item(tr.first(eid), tr, f.faults, episode_id=eid, label_version=lv, episode_rows=n,
                         reissued_of=reissued.get(eid))
                   for (eid, lv), n in rows.items() if n > 1 or eid in reissued]
    return {"duplicated_in_lake": in_lake, "duplicated_by_content": by_content, "duplicated_in_episodes": in_episodes}


def trained_twice_items(f: Facts, tr: Trails) -> list[dict[str, Any]]:
    """Episode ids trained in two steps, each with those steps (policy version, when) and the faults around them."""
    by_step, steps_of = _trained_steps(f.trained, f.checkpoint_step)
    out = []
    for episode_id, steps in steps_of.items():
        if len(steps) < 2:
            continue
        lines = [{"step": s, "policy_version": by_step[s].get("policy_version"), "t": by_step[s].get("t")} for s in steps]
        times = [float(x["t"]) for x in lines if x["t"] is not None]
        item = _item(tr.first(episode_id), tr, f.faults, episode_id=episode_id, steps=lines)
        item["faults"] = faults_around(f.faults, min(times), max(times)) if times else item["faults"]
        out.append(item)
    return out


def _listed(items: list[dict[str, Any]], by_stop: bool = False) -> dict[str, Any]:
    """A category of the audit file: its whole count, and its first MAX_LISTED items."""
    out: dict[str, Any] = {"count": len(items), "listed": min(len(items), MAX_LISTED)}
    if by_stop:
        out["stops_at"] = dict(Counter(x["stops_at"] for x in items))
    out["items"] = items[:MAX_LISTED]
    return out


def audit_items(f: Facts) -> dict[str, Any]:
    """The items behind the audit's counts, for audit.json: what each stage means, the faults as done, and per
    category its events with their trails and the faults around them."""
    tr = Trails.of(f)
    lost, uncompleted = lost_items(f, tr)
    dead = [_item(copies[0], tr, f.faults) for copies in tr.dlq.values()]
    unlanded = [_item(copies[0], tr, f.faults) for eid, copies in tr.kafka.items()
                if eid not in tr.lake and eid not in tr.dlq]
    return {"stages": STAGES, "fault_window_s": {"before": FAULT_WINDOW_S[0], "after": FAULT_WINDOW_S[1]},
            "faults": sorted(f.faults, key=lambda x: x["t"]),
            "lost": _listed(lost, by_stop=True), "lost_uncompleted": _listed(uncompleted, by_stop=True),
            "dead_lettered": _listed(dead), "in_kafka_not_in_lake": _listed(unlanded),
            **{k: _listed(v) for k, v in duplicate_items(f, tr).items()},
            "trained_twice": _listed(trained_twice_items(f, tr))}


def write_audit(path: Path, summary: dict[str, Any], items: dict[str, Any]) -> Path:
    """audit.json: the summary line's object, then the items (advisory durability: a report, read after the run)."""
    from flywheel.base.atomic import Durability, write_json

    return write_json(path, {"summary": summary, **items}, Durability.ADVISORY, indent=1, default=str)


def failures(result: dict[str, Any], min_kills: int = 12, min_outage_s: float = 45.0) -> list[str]:
    """The checks that did not hold, each with its numbers."""
    out = []
    for key in ("events_lost", "events_duplicated_in_episodes", "episodes_trained_twice",
                "matured_sessions_without_episodes", "lake_behind_kafka", "lake_offset_gaps"):
        if result.get(key, 0):
            out.append(f"{key} = {result[key]}")
    if result.get("sessions_in_lake") != result.get("sessions_completed"):
        out.append(f"sessions_in_lake {result.get('sessions_in_lake')} != sessions_completed {result.get('sessions_completed')}")
    if result.get("unregistered_served_versions"):
        out.append(f"served but not registered: {result['unregistered_served_versions']}")
    if not result.get("sessions_completed"):
        out.append("no session completed: nothing was checked")
    if result.get("kills", 0) < min_kills:
        out.append(f"kills {result.get('kills')} < {min_kills}")
    if result.get("broker_outage_s", 0.0) < min_outage_s:
        out.append(f"broker_outage_s {result.get('broker_outage_s')} < {min_outage_s}")
    return out


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
class ChaosRun:
    """One chaos run: set-up, traffic with faults, drain, audit; clean_up() undoes the set-up whatever happened."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.time()
        self.traffic_start: float | None = None
        run_id = args.run_id or time.strftime(f"chaos-%Y%m%d-%H%M%S-s{args.seed}", time.gmtime(self.t0))
        run_dir = (_in_repo(args.var_dir) / "bench" / run_id).resolve()
        self.cfg = demo_config(args, run_dir, run_id)
        self.plan = ChaosPlan(run_id=run_id, var_dir=run_dir, traffic_s=0.0)  # agent duration 0: until SIGTERM
        self.traffic_s = args.minutes * 60.0
        # the agent's flush may wait out the whole outage plus the broker's own restart (30-50 s on a loaded machine)
        self.durable_timeout_s = args.outage_s + 90.0
        self.faults = schedule(args.seed, self.traffic_s, args.kills, args.outage_s)
        self.procs = Processes(self.plan.log_dir)
        self.sup: Supervisor | None = None
        self.broker: Broker | None = None
        self.ends: Endpoints | None = None
        self.scfg: Any = None
        self.stack_started: list[str] = []
        self._weights_lock: Any = None
        self.drain_s = 0.0

    def say(self, msg: str) -> None:
        at = time.time() - (self.traffic_start or self.t0)
        print(f"[{'traffic' if self.traffic_start else 'setup'} {at:6.1f}s] {msg}", flush=True)

    # -- set-up -------------------------------------------------------------------------------
    def set_up(self) -> None:
        from flywheel import stack
        from flywheel.serving.publisher import reload_full

        self.plan.run_dir.mkdir(parents=True, exist_ok=True)
        (self.plan.run_dir / "chaos.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(self.args).items()}, "demo": {k: str(v) for k, v in dataclasses.asdict(self.cfg).items()},
             "schedule": [dataclasses.asdict(x) for x in self.faults]}, indent=1))
        self.say(f"run {self.plan.run_id} under {self.plan.run_dir}")
        ensure_models(self.cfg)
        self.scfg = stack.replace_config(stack.load_stack_config([]), base_model=policy_v0(self.cfg),
                                         vllm_servers=self.cfg.vllm_servers, vllm_lora=self.cfg.learner.mode == "lora")
        stack.init_mlflow_store(self.scfg)  # the processes use the sqlite store itself; the UI server is not needed
        self.stack_started = stack.ensure_up(self.scfg, ["vllm"])
        if not stack.vllm_serves_base(self.scfg):
            raise stack.StackError(f"vLLM at {self.scfg.vllm_url} does not serve {policy_v0(self.cfg)} as policy-v0")
        self._weights_lock = _lock(Path(self.scfg.var_dir) / "run" / "vllm-weights.lock")  # the learner reloads it
        for url in self.scfg.vllm_urls:
            reload_full(url, policy_v0(self.cfg).resolve(), 0)  # start from exactly policy-v0
        kcfg = stack.replace_config(self.scfg, var_dir=self.plan.run_dir / "stack", kafka_port=_free_port(),
                                    kafka_controller_port=_free_port(), kafka_topics=list(self.plan.topics.values()),
                                    kafka_partitions=4, kafka_heap="256m", parts=["kafka"])
        self.broker = Broker(kcfg, self.say)
        self.broker.start()
        self.ends = Endpoints(kafka_bootstrap=kcfg.kafka_bootstrap, vllm_url=self.scfg.vllm_url,
                              tracking_uri=self.scfg.mlflow_tracking_uri, proxy_port=_free_port(),
                              vllm_urls=list(self.scfg.vllm_urls))
        self.say(f"stack: vLLM {self.ends.vllm_url} (started here: {self.stack_started or 'none'}), "
                 f"private broker {self.ends.kafka_bootstrap}, MLflow {self.ends.tracking_uri}")
        cmds = commands(self.cfg, self.plan, self.ends, self.durable_timeout_s, self.args.seed)
        self.sup = Supervisor(self.procs, cmds, self.say)
        for name in PROCESSES:
            if name == "agent-sim":
                _wait_for_proxy(self.ends.proxy_port, self.procs)
            self.sup.start(name)
        self.traffic_start = time.time()
        self.say(f"traffic: {self.traffic_s:.0f} s; faults: " + ", ".join(
            f"{x.kind}{':' + x.target if x.target else ''}@{x.at:.0f}s" for x in self.faults))

    # -- traffic with faults ------------------------------------------------------------------
    def traffic(self) -> None:
        assert self.sup is not None and self.broker is not None and self.traffic_start is not None
        pending = list(self.faults)
        last_status = time.time()
        while time.time() - self.traffic_start < self.traffic_s:
            if self.broker.error is not None:
                raise RuntimeError(f"the broker did not come back: {self.broker.error}")
            now = time.time() - self.traffic_start
            while pending and pending[0].at <= now:
                self._fault(pending.pop(0), pending, now)
            self.sup.tick()
            if time.time() - last_status >= 30.0:
                self.say(self._progress())
                last_status = time.time()
            time.sleep(0.25)
        if self.broker.in_outage:
            self.say("traffic over while the broker is away: waiting for it to come back")
            self.broker.wait_outage(300.0)
        for fault in pending:
            self.say(f"fault not done (traffic over): {fault.kind} {fault.target}")

    def _fault(self, fault: Fault, pending: list[Fault], now: float) -> None:
        assert self.sup is not None and self.broker is not None
        if fault.kind == "outage":
            self.broker.outage(self.args.outage_s)
            return
        min_up = MIN_UPTIME_S.get(fault.target, DEFAULT_MIN_UPTIME_S)
        if not self.sup.alive(fault.target) or self.sup.uptime(fault.target) < min_up:
            if fault.tries < 40:  # put off by 1 s; a target that never stays up is reported, not killed
                pending.append(dataclasses.replace(fault, at=now + 1.0, tries=fault.tries + 1))
                pending.sort()
            else:
                self.say(f"kill of {fault.target} given up: it did not stay up for {min_up:.0f} s")
            return
        self.sup.kill(fault.target)

    def _progress(self) -> str:
        from flywheel.base.heartbeat import read_statuses

        ledger = read_ledger(self.plan.ledger)
        files = lake_counts(self.plan.lake_root)
        learner = read_statuses(self.plan.var_dir).get("learner", {})
        return (f"progress: {len(ledger.done)} sessions completed; lake files {files['events']} events, "
                f"{files['outcomes']} outcomes, {files['episodes']} episodes; learner step {learner.get('step', '-')}")

    # -- the end ------------------------------------------------------------------------------
    def stop_load(self) -> None:
        assert self.sup is not None
        for name in LOAD:
            t = time.time()
            # the agent finishes its sessions in flight, each flushed (durable_timeout_s) before its hand-off
            rc = self.sup.retire(name, self.durable_timeout_s + 60.0 if name == "agent-sim" else 60.0)
            self.say(f"stop: {name} exited with status {rc} after {time.time() - t:.1f} s")

    def drain(self) -> float:
        """Up to drain_s for the lake to hold both topics and every matured session to have its episodes; returns
        the horizon of the last poll (a session counts as matured if it was due 10 s before it: two builder polls)."""
        assert self.sup is not None and self.ends is not None
        t = time.time()
        deadline = t + self.args.drain_s
        while True:
            self.sup.tick()
            horizon = time.time() - 10.0
            facts = gather(self.plan, self.ends, horizon=horizon, full=False)
            result = {**kafka_checks(facts), **episode_checks(facts)}
            caught_up = result["lake_behind_kafka"] == 0
            labelled = result["matured_sessions_without_episodes"] == 0 and result["sessions_not_matured_yet"] == 0
            if caught_up and labelled:
                self.say(f"drain: lake holds both topics and {result['matured_sessions']} matured sessions have "
                         f"episodes after {time.time() - t:.0f} s")
                break
            if time.time() >= deadline:
                self.say(f"drain: gave up after {self.args.drain_s:.0f} s: lake {result['lake_behind_kafka']} records "
                         f"behind, {result['matured_sessions_without_episodes']} matured sessions without episodes, "
                         f"{result['sessions_not_matured_yet']} not due yet")
                break
            time.sleep(5.0)
        self.drain_s = time.time() - t
        return horizon

    def finish(self) -> dict[str, Any]:
        assert self.sup is not None and self.ends is not None and self.broker is not None
        self.stop_load()
        horizon = self.drain()
        self.sup.retire_all(60.0)
        self.say(f"stop: the rest exited with {dict((n, self.sup.exit_codes.get(n)) for n in PROCESSES)}")
        facts = gather(self.plan, self.ends, horizon, proxy_kills=self.sup.kill_times["proxy"],
                       faults=self.fault_timeline())
        result = audit(facts)
        result.update(self.summary())
        result["failed"] = failures(result, self.args.min_kills, self.args.min_outage_s)
        self.write_items(facts, result)
        return result

    def write_items(self, facts: Facts, result: dict[str, Any]) -> None:
        """audit.json in the run folder, its path in `result` (audit_path); a failure to build it is logged and the
        summary line still comes (audit_path null), since the counts are checked without it."""
        try:
            items = audit_items(facts)
            result["events_lost_stop_at"] = items["lost"]["stops_at"]
            path = write_audit(self.plan.run_dir / AUDIT_FILE, result, items)
        except Exception:
            log.exception("chaos: audit: the items could not be written; the summary line has the counts only")
            result["audit_path"] = None
            return
        result["audit_path"] = str(path)
        self.say(f"audit: {items['lost']['count']} lost, {items['lost_uncompleted']['count']} lost in flight, "
                 f"{items['duplicated_in_lake']['count']} duplicated in the lake, {items['trained_twice']['count']} "
                 f"trained twice: each with its trail and the faults around it in {path}")

    def fault_timeline(self) -> list[dict[str, Any]]:
        """The faults as they were done (a kill waits for its target to be up long enough, so the schedule's times
        are only plans): kills, exits on their own and the outage, in epoch seconds and seconds into the traffic."""
        start = self.traffic_start or self.t0
        out: list[dict[str, Any]] = [{"kind": kind, "target": name, "t": round(t, 3), "at_s": round(t - start, 1)}
                                     for t, kind, name in (self.sup.timeline if self.sup else [])]
        broker = self.broker
        if broker is not None and broker.stopping_at is not None:
            out.append({"kind": "outage", "target": "kafka", "t": round(broker.stopping_at, 3),
                        "at_s": round(broker.stopping_at - start, 1),
                        "until": round(broker.up_at, 3) if broker.up_at else None,  # None: it never came back
                        "down_s": round(broker.up_at - broker.stopping_at, 1) if broker.up_at else None})
        return sorted(out, key=lambda x: x["t"])

    def summary(self) -> dict[str, Any]:
        sup, broker = self.sup, self.broker
        return {"seed": self.args.seed, "minutes": self.args.minutes,
                "kills": sum(sup.kills.values()) if sup else 0,
                "restarts": sum(sup.restarts.values()) if sup else 0,
                "crashes": dict(sup.crashes) if sup else {},
                "broker_outage_s": broker.outage_s if broker else 0.0, "drain_s": round(self.drain_s, 1),
                "run_dir": str(self.plan.run_dir),
                "elapsed_s": round(time.time() - self.t0, 1)}

    def clean_up(self) -> None:
        """Stop every process and the private broker, put policy-v0 back on the shared vLLM, stop what we started."""
        from flywheel import stack

        # a second Ctrl-C (or kill) must not leave processes or the broker behind
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.broker is not None:
                self.broker.abort()  # an interrupted run does not wait for the broker to come back
            if self.sup is not None:
                self.sup.retire_all(10.0)  # after a finished run they are all stopped already
            else:
                self.procs.stop_all()
            if self.broker is not None:
                _quietly(self.broker.stop, "stopping the private broker")
            if self.scfg is not None and stack.vllm_healthy(self.scfg):
                from flywheel.serving.publisher import reload_full

                for url in self.scfg.vllm_urls:
                    _quietly(lambda url=url: reload_full(url, policy_v0(self.cfg).resolve(), 0),
                             f"restoring policy-v0 on {url}")
            if self._weights_lock is not None:
                self._weights_lock.close()
            if self.ends is not None:  # the proxy's heartbeat goes to the shared var dir (it has no --var-dir)
                (REPO_ROOT / "var" / "run" / "status" / f"proxy-{self.ends.proxy_port}.json").unlink(missing_ok=True)
            if not self.args.keep_weights:  # the audit is done; the lake, logs, ledger and trained log stay
                for heavy in (self.plan.policies_dir, self.plan.learner_dir / "checkpoints"):
                    shutil.rmtree(heavy, ignore_errors=True)
            for name, n in gather_spools(self.plan.run_id).items():
                if n == 0:  # delivered: nothing to keep; a spool still holding records stays for inspection
                    shutil.rmtree(REPO_ROOT / "var" / "spool" / name, ignore_errors=True)
            if self.stack_started and os.environ.get("FLYWHEEL_KEEP_STACK") != "1":
                stack.down(self.scfg, self.stack_started)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def gather_spools(run_id: str) -> dict[str, int]:
    try:
        return spool_records(run_id)
    except Exception as exc:
        return {"error": -1, "detail": str(exc)}  # type: ignore[dict-item]


def _lock(path: Path) -> Any:
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "w")
    fcntl.flock(fh, fcntl.LOCK_EX)  # released when fh is closed (or the process dies)
    return fh


def _quietly(fn: Callable[[], Any], what: str) -> None:
    try:
        fn()
    except Exception as exc:  # clean-up goes on with the next step
        log.warning("chaos: clean-up: %s failed (%s: %s)", what, type(exc).__name__, exc)


# ---------------------------------------------------------------------------------------------
# the output
# ---------------------------------------------------------------------------------------------
CHECKS = (
    ("sessions_completed", "sessions the agent completed (its events confirmed by Kafka, or the flush timed out)"),
    ("sessions_in_lake", "  of which in the lake exactly once, every event (must equal sessions_completed)"),
    ("sessions_not_confirmed", "  of which the SDK did not confirm within the flush timeout"),
    ("events_lost", "events of completed sessions missing from the lake (must be 0)"),
    ("events_lost_near_proxy_kill", "  of which llm_calls answered under 2 s before a proxy SIGKILL (its SDK's loss window)"),
    ("events_lost_uncompleted", "events missing from sessions in flight when the agent was killed (SDK loss window)"),
    ("events_dead_lettered", "events of the agent's sessions the lake writer sent to the DLQ"),
    ("llm_calls_not_logged_by_proxy", "answered calls the proxy logged a warning for instead (a weight reload "
                                      "during the call): not expected in the lake"),
    ("events_duplicated_in_lake", "extra lake rows of an event_id already there"),
    ("events_duplicated_in_episodes", "an event twice in one label, or an episode from a re-issued event (must be 0)"),
    ("matured_sessions", "completed sessions whose label 1 was due"),
    ("sessions_not_matured_yet", "  outcome in the lake but label 1 not due when the drain ended"),
    ("matured_sessions_without_episodes", "  of which without episodes (must be 0)"),
    ("matured_sessions_incomplete_episodes", "  of which missing some llm_call rows"),
    ("sessions_without_outcome", "completed ok sessions with no outcome in the lake"),
    ("episodes_trained_twice", "episode ids trained in two learner steps (must be 0)"),
    ("learner_steps_redone", "steps logged of weights a kill lost (trained again from the last checkpoint; allowed)"),
    ("unregistered_served_versions", "served policy versions missing from the registry (must be none)"),
    ("kafka_events_not_in_lake", "event_ids in the topic, not in the lake, not dead-lettered"),
    ("lake_behind_kafka", "topic records no lake file covers"),
    ("lake_offset_gaps", "holes between lake files of a partition"),
    ("spool_records_left", "records left in the run's SDK spools after the clean stop"),
)


def print_table(run: ChaosRun, result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(150, Console().width))  # a log file is 80 columns wide by default
    procs = Table(title=f"chaos run {run.plan.run_id}: seed {run.args.seed}, {run.args.minutes:g} min of traffic, "
                        f"broker down {result.get('broker_outage_s', 0.0)} s")
    for col in ("process", "kills", "restarts", "exited on its own", "final exit status"):
        procs.add_column(col, justify="left" if col == "process" else "right")
    sup = run.sup
    for name in PROCESSES:
        procs.add_row(name, str(sup.kills[name] if sup else 0), str(sup.restarts[name] if sup else 0),
                      str(sup.crashes[name] if sup else 0), str(sup.exit_codes.get(name, "-") if sup else "-"))
    console.print(procs)
    checks = Table(title="audit (lake, Kafka, learner trained log, MLflow registry)")
    checks.add_column("check")
    checks.add_column("value", justify="right")
    checks.add_column("meaning")
    for key, meaning in CHECKS:
        if key in result:
            checks.add_row(key, str(result[key]), meaning)
    console.print(checks)
    if result.get("events_lost_by_type"):
        console.print(f"events lost by type: {result['events_lost_by_type']}")
    if result.get("events_lost_stop_at"):
        console.print(f"events lost, the stage where each one's trail stops: {result['events_lost_stop_at']}")
    if result.get("audit_path"):
        console.print(f"audit items (each lost, duplicated and twice-trained event, its trail, the faults around it): "
                      f"{result['audit_path']}")
    for line in result.get("failed", []):
        console.print(f"[red]FAILED[/red] {line}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flywheel bench chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault schedule and of the agent's tasks")
    parser.add_argument("--minutes", type=float, default=4.0, help="minutes of traffic (set-up, drain and audit come on top)")
    parser.add_argument("--kills", type=int, default=14, help="SIGKILLs, in shuffled rounds of the seven processes (>= 12 to pass)")
    parser.add_argument("--outage-s", type=float, default=50.0, help="seconds the broker stays stopped (>= 45 to pass)")
    parser.add_argument("--min-kills", type=int, default=12,
                        help="the pass bar: a run with fewer kills fails (lower it only for a smoke run, e.g. the suite's)")
    parser.add_argument("--min-outage-s", type=float, default=45.0,
                        help="the pass bar: a run whose broker was down for less fails (lower it only for a smoke run)")
    parser.add_argument("--drain-s", type=float, default=150.0, help="most seconds for the lake and episodes to catch up")
    parser.add_argument("--concurrency", type=int, default=3, help="agent sessions in flight")
    parser.add_argument("--learner-batch", type=int, default=16, help="episodes per learner step")
    parser.add_argument("--base-model", default="var/models/tiny-base", help="the tiny base model (built when missing)")
    parser.add_argument("--var-dir", default="var", help="the run goes to <var-dir>/bench/chaos-<id>")
    parser.add_argument("--run-id", default="", help="name of the run (default chaos-<utc time>-s<seed>)")
    parser.add_argument("--keep-weights", action="store_true",
                        help="keep the policy versions and learner checkpoints (about 150 MB) after the audit")
    args = parser.parse_args(argv)
    if args.kills < 1 or args.outage_s <= 0:
        parser.error("--kills must be >= 1 and --outage-s > 0")
    return args


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    from flywheel.base.config import setup_logging

    args = parse_args(argv)
    setup_logging("INFO")
    logging.getLogger("flywheel.demo.closed_loop").setLevel(logging.WARNING)  # this bench prints each (re)start itself
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` cleans up like Ctrl-C
    try:
        run = ChaosRun(args)
    except ValueError as exc:
        print(f"flywheel bench chaos: {exc}", file=sys.stderr)
        return 2
    rc, result = 1, {}
    try:
        run.set_up()
        run.traffic()
        result = run.finish()
        rc = 0 if not result["failed"] else 1
    except KeyboardInterrupt:
        run.say("interrupted: cleaning up (processes, private broker, vLLM weights)")
        result, rc = {"error": "interrupted", **run.summary()}, 130
    except Exception as exc:
        log.exception("chaos: the run failed")
        result, rc = {"error": f"{type(exc).__name__}: {exc}", **run.summary()}, 1
    finally:
        run.clean_up()
    print_table(run, result)
    print(json.dumps(result, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
