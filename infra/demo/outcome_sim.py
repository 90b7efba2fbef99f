"""`flywheel outcome-sim`: the demo's outcome sources, a verifier and a simulated user, as one process.

    flywheel outcome-sim --verifier-delay-s 2 --user-share 0.3

It follows the agent's hand-off file (`var/run/agent-sim/sessions.jsonl`) and reports through
OutcomeReporter, like any outcome source would:

* verifier: `verifier_delay_s` after a session ended, it recomputes the truth of every part
  from the task spec with `infra.tasks.check` (it never trusts the agent) and reports
  `task_success` 1.0 or 0.0;
* simulated user: for `user_share` of sessions, `user_delay_s_min..max` later, reports
  `accepted` (1.0 accepted / 0.0 rejected): the verifier's verdict, flipped with probability
  `user_noise` (users are not perfect graders).

Progress through the hand-off file is kept in a cursor (byte offset, saved after each batch
of reports), so a restart neither re-reports nor skips sessions; user signals still pending at
a restart are lost, as they are when a real user walks away. Bad lines are skipped, counted
and logged. SIGTERM reports what is due, flushes and exits 0.
"""

from __future__ import annotations

import heapq
import json
import logging
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from flywheel.demo import tasks
from flywheel.demo.agent_sim import DEFAULT_HANDOFF

log = logging.getLogger(__name__)


@dataclass
class OutcomeSimConfig:
    """Simulated outcome sources: the verifier and the user, reading the agent's hand-off file."""

    handoff: Path = setting(DEFAULT_HANDOFF, "JSONL file of finished sessions written by agent-sim")
    cursor: Path = setting(Path(defaults.VAR_DIR) / "run" / "outcome-sim" / "cursor.json", "byte offset into the hand-off file already handled")
    kafka_bootstrap: str = setting(defaults.KAFKA_BOOTSTRAP, "Kafka for the outcomes")
    outcomes_topic: str = setting("flywheel.outcomes", "topic of the outcomes")
    verifier_delay_s: float = setting(2.0, "seconds after session end the verifier reports task_success")
    user_share: float = setting(0.3, "share of sessions the simulated user reacts to")
    user_delay_s_min: float = setting(20.0, "earliest user reaction after session end, seconds")
    user_delay_s_max: float = setting(40.0, "latest user reaction after session end, seconds")
    user_noise: float = setting(0.1, "probability the user's accept/reject disagrees with the verifier")
    poll_s: float = setting(0.25, "how often the hand-off file is read")
    seed: int = setting(0, "seed of the user simulation (0: random)")
    var_dir: Path = setting(Path(defaults.VAR_DIR), "local state root; the heartbeat goes to <var_dir>/run/status/")
    status_name: str = setting("outcome-sim", "name of the heartbeat under var/run/status")
    spool_name: str = setting("outcome-sim", "the SDK's spill spool name")
    log_level: str = setting("INFO", "logging level")

    def check(self) -> None:
        if not 0.0 <= self.user_share <= 1.0 or not 0.0 <= self.user_noise <= 1.0:
            raise ConfigError("user_share and user_noise must be in [0, 1]")
        if self.user_delay_s_min > self.user_delay_s_max:
            raise ConfigError(f"user_delay_s_min ({self.user_delay_s_min}) must be <= user_delay_s_max ({self.user_delay_s_max})")
        if self.verifier_delay_s < 0:
            raise ConfigError("verifier_delay_s must be >= 0")


@dataclass(order=True)
class Due:
    """One outcome to report at `at` (epoch seconds)."""

    at: float
    session_id: str
    kind: str
    value: float
    source: str


def verdict(record: dict[str, Any]) -> bool:
    """Recompute the session's success from its task spec (raises ValueError on a malformed record)."""
    spec = tasks.TaskSpec.from_json(record["task"])
    answers = record.get("answers")
    if not isinstance(answers, list):
        raise ValueError(f"answers: expected a list, got {type(answers).__name__}")
    return tasks.check(spec, [a if isinstance(a, str) else None for a in answers])


def schedule(record: dict[str, Any], cfg: OutcomeSimConfig, rng: random.Random) -> list[Due]:
    """The outcomes one finished session will produce, and when."""
    session_id = str(record["session_id"])
    ended = float(record["ended"])
    ok = verdict(record)
    due = [Due(ended + cfg.verifier_delay_s, session_id, "task_success", 1.0 if ok else 0.0, "verifier")]
    if rng.random() < cfg.user_share:
        accepted = ok if rng.random() >= cfg.user_noise else not ok
        delay = rng.uniform(cfg.user_delay_s_min, cfg.user_delay_s_max)
        due.append(Due(ended + delay, session_id, "accepted", 1.0 if accepted else 0.0, "user"))
    return due


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


def load_offset(path: Path) -> int:
    try:
        return int(json.loads(path.read_text())["offset"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def save_offset(path: Path, offset: int) -> None:
    write_json(path, {"offset": offset}, Durability.DURABLE)  # a cursor a restart resumes from


def run(cfg: OutcomeSimConfig) -> int:
    from flywheel.ingest.sdk import OutcomeReporter

    cfg.cursor.parent.mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, cfg.cursor.parent / "outcome-sim.toml")
    reporter = OutcomeReporter(cfg.kafka_bootstrap, cfg.outcomes_topic, name=cfg.spool_name)
    rng = random.Random(cfg.seed or None)
    reader = HandoffReader(cfg.handoff, load_offset(cfg.cursor))
    log.info("outcome-sim: following %s from byte %d; outcomes to %s (%s)", cfg.handoff, reader.offset,
             cfg.kafka_bootstrap, cfg.outcomes_topic)
    stop = stop_on_signals("sending the outcomes due, then exiting", signals=(signal.SIGTERM,))
    queue: list[Due] = []
    counts = {"sessions": 0, "bad_lines": 0, "task_success": 0, "accepted": 0, "successes": 0}
    last_status = 0.0
    try:
        while not stop.is_set():
            lines = reader.read()
            for end_offset, line in lines:
                if line:
                    try:
                        record = json.loads(line)
                        for item in schedule(record, cfg, rng):
                            heapq.heappush(queue, item)
                        counts["sessions"] += 1
                    except (ValueError, KeyError, TypeError) as exc:
                        counts["bad_lines"] += 1
                        log.warning("outcome-sim: hand-off line at byte %d is not a session record (%s); skipped",
                                    end_offset - len(line) - 1, exc)
                reader.offset = end_offset
            now = time.time()
            while queue and queue[0].at <= now:
                item = heapq.heappop(queue)
                reporter.report(item.session_id, item.kind, item.value, source=item.source)
                counts[item.kind] += 1
                counts["successes"] += int(item.kind == "task_success" and item.value > 0)
            if lines:
                # the verifier's outcomes for these lines are queued; a restart before they are due loses
                # them only if it also loses this process's memory, which is why the delay is short
                save_offset(cfg.cursor, reader.offset)
            if now - last_status >= 2.0:
                write_status(cfg.status_name, {**counts, "pending": len(queue), "offset": reader.offset}, cfg.var_dir)
                last_status = now
            stop.wait(cfg.poll_s)
    except KeyboardInterrupt:
        pass
    # report what is due now; later user signals are dropped, as a user who leaves never answers
    now = time.time()
    for item in [q for q in queue if q.kind == "task_success"]:
        reporter.report(item.session_id, item.kind, item.value, source=item.source)
        counts["task_success"] += 1
    reporter.flush(30.0)
    reporter.close()
    write_status(cfg.status_name, {**counts, "pending": 0, "offset": reader.offset}, cfg.var_dir)
    log.info("outcome-sim: stopped; %d sessions, %d task_success, %d accepted, %d bad lines", counts["sessions"],
             counts["task_success"], counts["accepted"], counts["bad_lines"])
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(OutcomeSimConfig, argv, prog="flywheel outcome-sim")
    setup_logging(cfg.log_level)
    return run(cfg)
