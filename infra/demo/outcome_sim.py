"""`flywheel outcome-sim`: the demo's outcome sources, a verifier and a simulated user, as one process.

    flywheel outcome-sim --verifier-delay-s 2 --user-share 0.3

It follows the agent's hand-off file (`var/run/agent-sim/sessions.jsonl`) and reports through
OutcomeReporter, like any outcome source would:

* verifier: `verifier_delay_s` after a session ended, it recomputes the truth of every part
  from the task spec with `infra.tasks.check` (it never trusts the agent) and reports
  `task_success` 1.0 or 0.0; below the session it checks every well-formed tool call the agent
  made (`call_correct` with the call's call_id: the right tool with arguments that give the
  truth) and, for a split task, each sub-agent's part (`task_success` with its agent_id), so the
  episode builder can credit the turn that earned it (rewards/turns.py); for a swarm session
  also `parts_correct`, the share of its parts answered right (and, with a sub-agent's agent_id,
  that sub-agent's own part), the graded outcome the swarm's rows and gate use;
* simulated user: for `user_share` of sessions, `user_delay_s_min..max` later, reports
  `accepted` (1.0 accepted / 0.0 rejected): the verifier's verdict, flipped with probability
  `user_noise` (users are not perfect graders).

Crash safety: send, confirm, then commit. The cursor (the hand-off file's byte offset, in
`--cursor`) only moves past a hand-off line once every outcome that line scheduled was sent AND
confirmed by the reporter's `flush()` (`committable` is the rule; a line that scheduled nothing,
or a bad line, counts as done). A user signal due 40 s later therefore holds the cursor before its
line for 40 s, and the lines after it wait too: the cursor is a prefix, never a set. A process
killed anywhere re-reads from the committed cursor and schedules those lines again: an outcome
the killed process had scheduled but not sent (its in-memory queue) is sent by the next one. One it
had sent is sent again only if the kill came before the cursor write that recorded its
confirmation (it was in flight, or confirmed a moment earlier): the cursor file also lists the
confirmed outcomes of the lines it has not passed yet (`sent`), and a restart skips those.
Re-sends are harmless: every outcome is the same on each run (outcome_id from session and kind,
ts = its due time, the user's decision drawn from a per-session seed kept in the cursor file),
and the episode builder keeps the first copy of an outcome_id. Bad lines are skipped, counted and
logged. While Kafka is down, flush fails, nothing is committed and the next poll tries again.
SIGTERM sends every queued task_success (due or not), confirms, commits and exits 0; a queued
user signal is then still owed, and a restart sends it.
"""

from __future__ import annotations

import datetime as dt
import heapq
import json
import logging
import random
import secrets
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol

from flywheel.base import defaults
from flywheel.base.atomic import Durability, write_json
from flywheel.base.config import (
    ConfigError,
    load_config,
    setting,
    setup_logging,
    write_resolved,
)
from flywheel.base.heartbeat import write_status
from flywheel.base.stop import stop_on_signals
from flywheel.demo import swarm, tasks
from flywheel.demo.agent_sim import DEFAULT_HANDOFF

log = logging.getLogger(__name__)
# outcome ids are uuid5(session/kind/source) in this namespace: the same outcome has the same id on every run
OUTCOME_ID_NAMESPACE = uuid.UUID("3f0c6a52-8e1d-4c1e-9b7a-6d2f5e0a4c11")


@dataclass
class OutcomeSimConfig:
    """Simulated outcome sources: the verifier and the user, reading the agent's hand-off file."""

    handoff: Path = setting(DEFAULT_HANDOFF, "JSONL file of finished sessions written by agent-sim")
    cursor: Path = setting(Path(defaults.VAR_DIR) / "run" / "outcome-sim" / "cursor.json",
                           "byte offset into the hand-off file already handled")
    kafka_bootstrap: str = setting(defaults.KAFKA_BOOTSTRAP, "Kafka for the outcomes")
    outcomes_topic: str = setting("flywheel.outcomes", "topic of the outcomes")
    verifier_delay_s: float = setting(2.0, "seconds after session end the verifier reports task_success")
    user_share: float = setting(0.3, "share of sessions the simulated user reacts to")
    user_delay_s_min: float = setting(20.0, "earliest user reaction after session end, seconds")
    user_delay_s_max: float = setting(40.0, "latest user reaction after session end, seconds")
    user_noise: float = setting(0.1, "probability the user's accept/reject disagrees with the verifier")
    poll_s: float = setting(0.25, "how often the hand-off file is read")
    flush_timeout_s: float = setting(5.0, "how long a poll waits for Kafka to confirm what it sent (the cursor "
                                          "moves only after)")
    seed: int = setting(0, "seed of the user simulation (0: random, drawn once and kept in the cursor file)")
    var_dir: Path = setting(Path(defaults.VAR_DIR), "local state root; the heartbeat goes to <var_dir>/run/status/")
    status_name: str = setting("outcome-sim", "name of the heartbeat under var/run/status")
    spool_name: str = setting("outcome-sim", "the SDK's spill spool name")
    log_level: str = setting("INFO", "logging level")

    def check(self) -> None:
        if not 0.0 <= self.user_share <= 1.0 or not 0.0 <= self.user_noise <= 1.0:
            raise ConfigError("user_share and user_noise must be in [0, 1]")
        if self.user_delay_s_min > self.user_delay_s_max:
            raise ConfigError(f"user_delay_s_min ({self.user_delay_s_min}) must be <= user_delay_s_max "
                              f"({self.user_delay_s_max})")
        if self.verifier_delay_s < 0:
            raise ConfigError("verifier_delay_s must be >= 0")
        if self.flush_timeout_s <= 0:
            raise ConfigError(f"flush_timeout_s must be > 0, got {self.flush_timeout_s}")


@dataclass(order=True)
class Due:
    """One outcome to report at `at` (epoch seconds)."""

    at: float
    session_id: str
    kind: str
    value: float
    source: str
    outcome_id: str = ""
    line_end: int = 0  # byte offset just past the hand-off line that scheduled it
    agent_id: str | None = None  # a sub-agent's own part (narrower than the session)
    call_id: str | None = None  # one tool call (a turn-level check)


def outcome_id(session_id: str, kind: str, source: str) -> str:
    """The id of a session's outcome of one kind: the same on every run, so a re-send is a duplicate, not news."""
    return uuid.uuid5(OUTCOME_ID_NAMESPACE, f"{session_id}/{kind}/{source}").hex


def session_rng(seed: int, session_id: str) -> random.Random:
    """The user simulation's dice for one session: a re-read after a restart draws the same decisions."""
    return random.Random(f"{seed}/{session_id}")  # a str seed is hashed with sha512: stable across processes


def verdict(record: dict[str, Any]) -> bool:
    """Recompute the session's success from its task spec (raises ValueError on a malformed record)."""
    spec = tasks.TaskSpec.from_json(record["task"])
    answers = record.get("answers")
    if not isinstance(answers, list):
        raise ValueError(f"answers: expected a list, got {type(answers).__name__}")
    return tasks.check(spec, [a if isinstance(a, str) else None for a in answers])


def schedule(record: dict[str, Any], cfg: OutcomeSimConfig, rng: random.Random, line_end: int = 0) -> list[Due]:
    """The outcomes one finished session will produce, and when."""
    session_id = str(record["session_id"])
    ended = float(record["ended"])
    ok = verdict(record)

    def due(at: float, kind: str, value: float, source: str) -> Due:
        return Due(at, session_id, kind, value, source, outcome_id(session_id, kind, source), line_end)

    # the checks below the session a millisecond before its verdict: sent (and landed) first
    checks_at = ended + cfg.verifier_delay_s - 0.001
    out = part_checks(record, checks_at, line_end)
    out.append(due(ended + cfg.verifier_delay_s, "task_success", 1.0 if ok else 0.0, "verifier"))
    graded = swarm.parts_correct(record)  # swarm sessions: the share of parts right, and each sub-agent's own
    if graded is not None:
        share, mine = graded
        out.append(Due(checks_at, session_id, swarm.PARTS_CORRECT, share, "verifier",
                       outcome_id(session_id, swarm.PARTS_CORRECT, "verifier"), line_end))
        out += [Due(checks_at, session_id, swarm.PARTS_CORRECT, value, "verifier",
                    outcome_id(session_id, f"{swarm.PARTS_CORRECT}/{agent}", "verifier"), line_end, agent)
                for agent, value in sorted(mine.items())]
    for call_id, harmful in swarm.harmful_prunes(record, ok):  # swarm sessions: did a prune remove what was needed
        out.append(Due(checks_at, session_id, "prune_harmful", 1.0 if harmful else 0.0,
                       "verifier", outcome_id(session_id, f"prune_harmful/{call_id}", "verifier"), line_end, None,
                       call_id))
    if rng.random() < cfg.user_share:
        accepted = ok if rng.random() >= cfg.user_noise else not ok
        delay = rng.uniform(cfg.user_delay_s_min, cfg.user_delay_s_max)
        out.append(due(ended + delay, "accepted", 1.0 if accepted else 0.0, "user"))
    return out


def part_checks(record: dict[str, Any], at: float, line_end: int = 0) -> list[Due]:
    """The verifier's checks below the session: `call_correct` for every well-formed tool call (by its call_id),
    and, for a split task, `task_success` of each sub-agent's own part (by its agent_id).

    A call is right when it is the call the part still needed: the right tool and arguments, and no right
    call before it. Repeating a right call after its result is in the dialogue is no progress (1.0 for it
    would pay a policy for calling again instead of answering). Hand-off lines written before the agent
    recorded its parts (no "parts") get none. The caller schedules these just before the session's own
    verdict, so they reach the lake first and label 1 (which waits for the verdict) sees them."""
    spec = tasks.TaskSpec.from_json(record["task"])
    parts = record.get("parts")
    if not isinstance(parts, list) or len(parts) != len(spec.parts):
        return []
    session_id = str(record["session_id"])
    answers = record.get("answers") or []
    out: list[Due] = []
    for i, (part, done) in enumerate(zip(spec.parts, parts)):
        agent = done.get("agent_id") if isinstance(done, dict) else None
        if not isinstance(agent, str):
            continue
        solved = False
        for call in done.get("calls") or []:
            right = not solved and tasks.call_matches(part, call.get("tool"), call.get("arguments"))
            solved = solved or right
            value = 1.0 if right else 0.0
            cid = str(call["call_id"])
            out.append(Due(at, session_id, "call_correct", value, "verifier",
                           outcome_id(session_id, f"call_correct/{cid}", "verifier"), line_end, agent, cid))
        # a swarm orchestrator that solved the parts itself is checked by the session's verdict, not part by part
        if spec.multi and agent != record.get("main_agent_id"):
            answer = tasks.recorded_answer(answers, i)
            out.append(Due(at, session_id, "task_success", 1.0 if tasks.check_part(part, answer) else 0.0, "verifier",
                           outcome_id(session_id, f"task_success/{agent}", "verifier"), line_end, agent))
    return out


def committable(cursor: int, lines: Iterable[tuple[int, int]]) -> int:
    """The furthest the cursor may move: past each leading line whose outcomes are all confirmed sent.

    `lines`: (byte offset just past the line, outcomes it scheduled not yet confirmed) for the
    lines past `cursor`, in file order. The first line still owing an outcome stops the cursor,
    whatever the lines after it owe: a restart re-reads from the cursor, so passing a line early
    would lose what it still owes.
    """
    for end, unconfirmed in lines:
        if unconfirmed > 0:
            break
        cursor = end
    return cursor


@dataclass
class Line:
    """A hand-off line past the committed cursor: the outcomes it scheduled and which are confirmed sent."""

    end: int
    ids: list[str]
    sent: set[str] = field(default_factory=set)


class Progress:
    """The committed cursor and the hand-off lines past it that the cursor has not passed yet."""

    def __init__(self, offset: int, sent: Iterable[str] = ()) -> None:
        self.offset = offset
        self.lines: list[Line] = []
        # confirmed by an earlier process for lines past `offset`: not sent again when those lines are re-read
        self.sent_before = set(sent)

    def add(self, end: int, ids: list[str]) -> list[str]:
        """Track a newly read line; returns its outcome ids still to send."""
        line = Line(end, ids, {i for i in ids if i in self.sent_before})
        self.lines.append(line)
        return [i for i in ids if i not in line.sent]

    def confirm(self, items: Iterable[Due]) -> None:
        by_end = {line.end: line for line in self.lines}
        for item in items:
            by_end[item.line_end].sent.add(item.outcome_id)

    def advance(self) -> bool:
        """Move the cursor as far as `committable` allows; True when it moved."""
        new = committable(self.offset, ((line.end, len(set(line.ids) - line.sent)) for line in self.lines))
        if new == self.offset:
            return False
        for line in self.lines:
            if line.end <= new:
                self.sent_before.difference_update(line.ids)
        self.lines = [line for line in self.lines if line.end > new]
        self.offset = new
        return True

    def sent_ahead(self) -> list[str]:
        """Confirmed outcomes of lines the cursor has not passed (a restart must not send them again)."""
        return sorted(self.sent_before.union(*(line.sent for line in self.lines)))


class HandoffReader:
    """Reads whole new lines of the hand-off file from a byte offset (a half-written last line waits)."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path = path
        self.offset = offset

    def read(self) -> list[tuple[int, str]]:
        """New complete lines with the offset just past each."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        out: list[tuple[int, str]] = []
        pos = self.offset
        for raw in data.splitlines(keepends=True):
            if not raw.endswith(b"\n"):
                break
            pos += len(raw)
            out.append((pos, raw.decode("utf-8", "replace").strip()))
        return out


def _load(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def load_offset(path: Path) -> int:
    try:
        return int(_load(path)["offset"])
    except (KeyError, TypeError, ValueError):
        return 0


def load_cursor(path: Path) -> tuple[int, int | None, list[str]]:
    """(offset, seed or None when none was saved, outcome ids already confirmed past the offset)."""
    record = _load(path)
    seed = record.get("seed")
    sent = record.get("sent")
    return (load_offset(path), seed if isinstance(seed, int) else None,
            [str(i) for i in sent] if isinstance(sent, list) else [])


def save_offset(path: Path, offset: int, seed: int = 0, sent: Iterable[str] = ()) -> None:
    # durable: a cursor a restart resumes from; the sent ids go in the same atomic write as the offset
    write_json(path, {"offset": offset, "seed": seed, "sent": list(sent)}, Durability.DURABLE)


class Reporter(Protocol):
    """What the simulator needs of flywheel.ingest.sdk.OutcomeReporter."""

    def report(self, session_id: str, kind: str, value: float, agent_id: str | None = None,
               source: str | None = None, ts: str | None = None, outcome_id: str | None = None,
               call_id: str | None = None) -> str: ...

    def flush(self, timeout: float = 10.0) -> bool: ...

    def metrics(self) -> dict[str, Any]: ...


def _wire_ts(epoch_s: float) -> str:
    return dt.datetime.fromtimestamp(epoch_s, dt.timezone.utc).isoformat(timespec="microseconds")


class OutcomeSim:
    """The simulator between polls: hand-off reader, queue of scheduled outcomes, what is confirmed, the cursor."""

    def __init__(self, cfg: OutcomeSimConfig, reporter: Reporter) -> None:
        offset, seed, sent = load_cursor(cfg.cursor)
        self.cfg = cfg
        self.reporter = reporter
        # with seed 0 a random seed is drawn once and kept in the cursor file, so a restart re-draws
        # the same user decisions for the lines it re-reads
        self.seed = cfg.seed or seed or secrets.randbits(48)
        self.reader = HandoffReader(cfg.handoff, offset)
        self.progress = Progress(offset, sent)
        self.queue: list[Due] = []  # scheduled, not sent (a heap by due time)
        self.unconfirmed: list[Due] = []  # sent, not yet confirmed by a flush
        # a count for every kind `schedule` can produce (a swarm run crashed on the first prune_harmful without it)
        self.counts = {"sessions": 0, "bad_lines": 0, "task_success": 0, "call_correct": 0, "accepted": 0,
                       "prune_harmful": 0, swarm.PARTS_CORRECT: 0, "successes": 0, "resent": 0}
        self._dropped = self._reporter_drops()
        self._dirty = seed != self.seed  # the cursor file lacks what a restart needs: write it at the next commit

    def read_new(self) -> int:
        """Schedule the outcomes of the hand-off lines written since the last read; how many lines were read."""
        lines = self.reader.read()
        for end_offset, line in lines:
            items: list[Due] = []
            if line:
                try:
                    record = json.loads(line)
                    items = schedule(record, self.cfg, session_rng(self.seed, str(record["session_id"])), end_offset)
                    self.counts["sessions"] += 1
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    self.counts["bad_lines"] += 1
                    log.warning("outcome-sim: hand-off line at byte %d is not a session record (%s); skipped",
                                end_offset - len(line) - 1, exc)
            todo = set(self.progress.add(end_offset, [i.outcome_id for i in items]))
            for item in items:
                if item.outcome_id in todo:
                    heapq.heappush(self.queue, item)
            self.reader.offset = end_offset
        return len(lines)

    def send_due(self, now: float, kinds: tuple[str, ...] = ()) -> int:
        """Send what is due at `now`, and every queued outcome of `kinds` due or not; how many were sent."""
        batch: list[Due] = []
        while self.queue and self.queue[0].at <= now:
            batch.append(heapq.heappop(self.queue))
        if kinds:
            batch += sorted((q for q in self.queue if q.kind in kinds), key=lambda q: q.at)  # checks before verdicts
            self.queue = [q for q in self.queue if q.kind not in kinds]
            heapq.heapify(self.queue)
        for item in batch:
            # our outcome_id, not a fresh one: a re-send after a crash is then a duplicate the builder drops
            self.reporter.report(item.session_id, item.kind, item.value, agent_id=item.agent_id, source=item.source,
                                 ts=_wire_ts(item.at), outcome_id=item.outcome_id, call_id=item.call_id)
            self.unconfirmed.append(item)
            self.counts[item.kind] += 1
            self.counts["successes"] += int(item.kind == "task_success" and item.agent_id is None and item.value > 0)
        return len(batch)

    def confirm(self, timeout: float) -> bool:
        """Wait for the reporter to confirm delivery of what was sent; True when nothing sent is unconfirmed."""
        if not self.unconfirmed:
            return True
        if not self.reporter.flush(timeout):
            return False  # Kafka did not confirm (down, slow): they stay unconfirmed, the next poll asks again
        dropped = self._reporter_drops()
        if dropped > self._dropped:
            # the SDK dropped records (queue or spool full) and cannot say which: send the whole batch again
            log.warning("outcome-sim: the reporter dropped %d records; re-sending this batch of %d outcomes",
                        dropped - self._dropped, len(self.unconfirmed))
            self._dropped = dropped
            self.counts["resent"] += len(self.unconfirmed)
            for item in self.unconfirmed:
                heapq.heappush(self.queue, item)
            self.unconfirmed = []
            return False
        self.progress.confirm(self.unconfirmed)
        self.unconfirmed = []
        self._dirty = True
        return True

    def commit(self) -> None:
        """Move the cursor as far as the confirmed outcomes allow and save it with them, in one atomic write."""
        if self.progress.advance() or self._dirty:
            save_offset(self.cfg.cursor, self.progress.offset, self.seed, self.progress.sent_ahead())
            self._dirty = False

    def step(self, now: float) -> None:
        """One poll: read, send what is due, confirm, then commit (the order is the crash safety)."""
        self.read_new()
        self.send_due(now)
        self.confirm(self.cfg.flush_timeout_s)
        self.commit()

    def status(self) -> dict[str, Any]:
        return {**self.counts, "pending": len(self.queue), "unconfirmed": len(self.unconfirmed),
                "offset": self.progress.offset, "read_offset": self.reader.offset}

    def _reporter_drops(self) -> int:
        return int(self.reporter.metrics().get("dropped", 0))


def run(cfg: OutcomeSimConfig) -> int:
    from flywheel.ingest.sdk import OutcomeReporter

    cfg.cursor.parent.mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, cfg.cursor.parent / "outcome-sim.toml")
    reporter = OutcomeReporter(cfg.kafka_bootstrap, cfg.outcomes_topic, name=cfg.spool_name)
    sim = OutcomeSim(cfg, reporter)
    log.info("outcome-sim: following %s from byte %d (%d outcomes past it already sent); outcomes to %s (%s)",
             cfg.handoff, sim.reader.offset, len(sim.progress.sent_before), cfg.kafka_bootstrap, cfg.outcomes_topic)
    sim.commit()  # the seed goes to disk before any outcome drawn from it is sent
    stop = stop_on_signals("sending the outcomes due, then exiting", signals=(signal.SIGTERM,))
    last_status = 0.0
    try:
        while not stop.is_set():
            now = time.time()
            sim.step(now)
            if now - last_status >= 2.0:
                write_status(cfg.status_name, sim.status(), cfg.var_dir)
                last_status = now
            stop.wait(cfg.poll_s)
    except KeyboardInterrupt:
        pass
    # the verifier's verdicts go out now, due or not; a user signal still queued is owed to the next
    # run (the cursor stays before its line), as a user who has not answered yet may still answer
    sim.read_new()
    sim.send_due(time.time(), kinds=("task_success", "call_correct", "prune_harmful", swarm.PARTS_CORRECT))
    confirmed = sim.confirm(30.0)
    sim.commit()
    reporter.close()
    write_status(cfg.status_name, sim.status(), cfg.var_dir)
    c = sim.counts
    log.info("outcome-sim: stopped; %d sessions, %d task_success, %d accepted, %d bad lines; cursor at byte %d, "
             "%d outcomes still queued%s", c["sessions"], c["task_success"], c["accepted"], c["bad_lines"],
             sim.progress.offset, len(sim.queue),
             "" if confirmed else ", the last batch unconfirmed (a restart re-sends it)")
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(OutcomeSimConfig, argv, prog="flywheel outcome-sim")
    setup_logging(cfg.log_level)
    return run(cfg)
