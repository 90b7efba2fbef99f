"""`flywheel demo --minutes N` (`make demo`): the whole closed loop on this machine, a live view, a report.

What it does, in order (each step logged):
1. set-up: the tiny base model (`flywheel model init`) and its warm-started copy
   (`infra.warm_start`), unless they exist;
2. the stack (`infra.stack`): Kafka, MLflow, and vLLM serving the WARM-STARTED model as
   policy-v0 (a vLLM this stack started on another model is restarted);
3. this run's own topics, consumer group, lake, registered model and policy folder (named by
   the run id), so a demo never reads another run's data;
4. the loop as separate processes, each the ordinary `flywheel` sub-command: capture proxy
   (routing by the serving router), lake writer, episode builder (--follow), learner (full
   weights, published by reload_weights), promotion gate (--auto), outcome sources and the
   simulated agent;
5. a live view (rich) from the processes' heartbeats and the lake: sessions/s, lake lag,
   episodes, learner step, served versions and traffic shares, success per version;
6. after N minutes of traffic: the agent stops, the outcomes and the lake catch up, every
   process it started is stopped (SIGTERM, then SIGKILL), the stack parts it started are
   stopped, and the report is written to var/report/ (report.md, PNGs, summary.json).

The last line printed is summary.json as one JSON object.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.base import defaults
from flywheel.base.config import (
    ConfigError,
    load_config,
    setting,
    setup_logging,
    write_resolved,
)
from flywheel.base.versions import version_name

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class DemoConfig:
    """The closed-loop demo: how long to run traffic, and the knobs of its processes."""

    minutes: float = setting(20.0, "minutes of agent traffic (set-up and the report come on top)")
    var_dir: Path = setting(Path(defaults.VAR_DIR), "state directory; the run lives under <var_dir>/demo/<run id>")
    report_dir: Path = setting(Path(defaults.VAR_DIR) / "report", "where report.md, the PNGs and summary.json go")
    base_model: Path = setting(Path(defaults.BASE_MODEL_DIR), "the tiny base model (built when missing)")
    warm_model: Path = setting(Path("var/models/tiny-warm"), "the warm-started model vLLM serves as policy-v0 (built when missing)")
    warm_start: bool = setting(True, "serve the warm-started model (False: serve base_model as it is; for quick loop tests)")
    concurrency: int = setting(3, "agent sessions in flight (about what the learner keeps up with on 2 cores; more only starves it of CPU)")
    multi_share: float = setting(0.1, "share of tasks split across two sub-agents (their rows share the session's reward, "
                                      "which a sibling's failure zeroes: at 0.2 a third of the learner's rows were such)")
    learner_batch: int = setting(64, "episodes per learner step (64 with positive-only advantages: about 4 s a step on 2 cores, "
                                     "since rows at or below their baseline are not run)")
    learner_lr: float = setting(4e-4, "learner Adam learning rate (with sequence aggregation and warm-up: 4e-4 climbed, "
                                      "8e-4 and 1e-3 fell back within 10 steps)")
    learner_kl: float = setting(0.0, "learner KL coefficient to policy-v0 (0.1 kept signed advantages from drifting into broken "
                                     "JSON but halved the climb; positive-only advantages and the gate keep the policy sane without it)")
    learner_baseline: str = setting("batch", "learner reward baseline: batch (the batch mean per task type, tool_use.add ...), "
                                             "running or none")
    learner_positive_only: bool = setting(True, "reinforce only rows above their task type's batch mean; pushing failed rows "
                                                "down drove the tiny policy into broken calls (README runs b, g, l)")
    learner_epochs: int = setting(1, "learner passes over each batch (> 1 switches its loss to PPO's clipped ratio); the "
                                     "learner trains every episode as it arrives, so traffic, not compute, sets its pace")
    learner_max_staleness: int = setting(2, "versions an episode may lag before the learner drops it (it takes the newest first)")
    learner_threads: int = setting(1, "the learner's torch CPU threads (1: its cores are shared with vLLM; 2 threads ran 5-20x slower)")
    publish_every_steps: int = setting(3, "learner steps between published versions")
    publish_wait_for_gate: bool = setting(True, "a new version waits until the gate has ruled on the last (the server holds one "
                                                "version: with a fast learner the gate judged only 4 of 41 versions before the next replaced them)")
    publish_every_s: float = setting(120.0, "also publish after this many seconds")
    challenger_share: float = setting(0.5, "share of sessions the challenger gets (for LoRA tiers; full weights serve one version)")
    gate_interval_s: float = setting(10.0, "seconds between promotion-gate rounds (each version waits for a verdict)")
    gate_min_sessions: int = setting(100, "sessions the gate wants on each side (with 40 it promoted versions 6 points worse, "
                                          "p_worse 0.23)")
    gate_max_drop: float = setting(0.0, "the gate rejects a challenger whose mean online reward is below the champion's by more "
                                        "than this, significant or not (inf: only significant drops; then the champion line "
                                        "drifted from 34% to 28% success through promotions 6-9 points down, p_worse 0.055-0.17)")
    base_sessions: int = setting(330, "sessions policy-v0 serves before the learner starts (the base measurement)")
    measure_s: float = setting(150.0, "the last seconds of traffic: the learner is stopped, the gate decides on its last "
                                      "version, and the champion serves a few hundred sessions to be measured on")
    drain_s: float = setting(25.0, "after traffic stops: seconds for outcomes, lake and episodes to catch up")
    keep_stack: bool = setting(False, "leave running the stack parts the demo started (default: stop everything it started)")
    live: bool = setting(True, "show the rich live view (off: a log line every 30 s)")
    run_id: str = setting("", "name of this run (default: demo-<utc time>)")

    def check(self) -> None:
        if self.minutes <= 0:
            raise ConfigError(f"minutes: must be > 0, got {self.minutes}")
        if self.concurrency < 1:
            raise ConfigError("concurrency: must be >= 1")
        if not 0 <= self.measure_s < self.minutes * 60:
            raise ConfigError(f"measure_s: must be >= 0 and shorter than the traffic ({self.minutes * 60:.0f} s), got {self.measure_s}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Processes:
    """The processes the demo started: each in its own process group, stopped in reverse order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: set[str] = set()  # stopped on purpose: not a failure when found dead
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "flywheel.cli", *argv]
        out = open(self.log_dir / f"{name}.log", "ab")
        log.info("demo: starting %s: flywheel %s (log %s)", name, " ".join(argv), self.log_dir / f"{name}.log")
        self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            cwd=str(REPO_ROOT), env={**os.environ, **(env or {})}, start_new_session=True)

    def dead(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None and n not in self.stopped]

    def stop(self, name: str, timeout_s: float = 30.0) -> int | None:
        proc = self.procs.get(name)
        if proc is None:
            return None
        self.stopped.add(name)
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # each process finishes its unit of work and exits 0
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("demo: %s did not stop within %.0fs of SIGTERM; killing it", name, timeout_s)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def stop_all(self) -> dict[str, int | None]:
        return {name: self.stop(name) for name in reversed(list(self.procs))}

    def tail(self, name: str, lines: int = 8) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# ---------------------------------------------------------------------------------------------
# set-up
# ---------------------------------------------------------------------------------------------
def policy_v0(cfg: DemoConfig) -> Path:
    """The model vLLM serves as policy-v0 and the learner starts from."""
    return Path(cfg.warm_model if cfg.warm_start else cfg.base_model)


def ensure_models(cfg: DemoConfig) -> dict[str, Any]:
    from flywheel.demo import warm_start
    from flywheel.demo.model_init import ensure_base_model, is_model_dir

    ensure_base_model(cfg.base_model)
    if not cfg.warm_start:
        return {}
    if not is_model_dir(cfg.warm_model):
        log.info("demo: warm-starting %s into %s", cfg.base_model, cfg.warm_model)
        warm_start.run(cfg.base_model, cfg.warm_model)
    record_path = Path(cfg.warm_model) / "warm_start.json"
    return json.loads(record_path.read_text()) if record_path.exists() else {}


def ensure_stack(cfg: DemoConfig, topics: list[str]) -> tuple[Any, list[str]]:
    from flywheel import stack
    from flywheel.serving.publisher import reload_full

    scfg = stack.replace_config(stack.load_stack_config([]), base_model=policy_v0(cfg))
    started = stack.ensure_up(scfg)
    if not stack.vllm_serves_base(scfg):
        raise stack.StackError(f"vLLM at {scfg.vllm_url} does not serve {policy_v0(cfg)} as {scfg.served_model_name}")
    # An earlier run may have left its trained weights in place (full reloads keep the served name):
    # start from exactly policy-v0's weights, as the publisher does when it restores a version.
    # (no pause: the demo's own traffic has not started yet)
    reload_full(scfg.vllm_url, policy_v0(cfg).resolve(), 0)
    stack.ensure_topics(stack.replace_config(scfg, kafka_topics=topics))
    return scfg, started


# ---------------------------------------------------------------------------------------------
# the live view
# ---------------------------------------------------------------------------------------------
def lake_counts(lake_root: Path) -> dict[str, int]:
    return {table: sum(1 for _ in (lake_root / table).rglob("*.parquet")) if (lake_root / table).exists() else 0
            for table in ("events", "outcomes", "episodes")}


def success_by_version(lake_root: Path, since: float) -> dict[int, tuple[int, int]]:
    """{version: (sessions, successes)} from the lake, for the live view (the report uses infra.report)."""
    from flywheel.demo import report

    try:
        facts = report.lake_facts(str(lake_root), since)
    except Exception as exc:  # a file being compacted away mid-read: show the last view
        log.debug("demo: live lake read failed (%s)", exc)
        return {}
    return {v: (s.sessions, s.successes) for v, s in facts.by_version.items()}


def view(statuses: dict[str, dict[str, Any]], lake: dict[str, int], success: dict[int, tuple[int, int]],
         elapsed: float, total: float, phase: str = "") -> Any:
    from rich.console import Group
    from rich.table import Table

    from flywheel.serving.stats import wilson

    agent = statuses.get("agent-sim", {})
    top = Table(title=f"flywheel demo: {elapsed / 60:.1f} / {total / 60:.0f} min of traffic{': ' + phase if phase else ''}",
                expand=True)
    for col in ("sessions", "sessions/s", "lake files (ev/out/epi)", "episodes", "learner step", "policy version", "gate"):
        top.add_column(col)
    learner = statuses.get("learner", {})
    promote = statuses.get("promote", {})
    episodes = statuses.get("episodes", {})
    top.add_row(str(agent.get("sessions", 0)), str(agent.get("sessions_per_s", 0)),
                f"{lake['events']}/{lake['outcomes']}/{lake['episodes']}",
                str(episodes.get("episodes_emitted", episodes.get("episodes", "-"))),
                str(learner.get("step", "-")), str(learner.get("policy_version", "-")),
                str(promote.get("last_decision", promote.get("decision", "-")))[:40])
    versions = Table(title="success per served version (verifier, from the lake)", expand=True)
    for col in ("version", "sessions", "share of traffic", "success", "95% CI"):
        versions.add_column(col)
    total_sessions = sum(n for n, _ in success.values()) or 1
    for v, (n, s) in sorted(success.items()):
        lo, hi = wilson(s, n)
        versions.add_row(version_name(v), str(n), f"{n / total_sessions:.0%}", f"{s / max(1, n):.1%}", f"{lo:.0%}-{hi:.0%}")
    procs = Table(title="processes (heartbeats)", expand=True)
    procs.add_column("process")
    procs.add_column("state")
    procs.add_column("details", overflow="fold")
    for name, record in sorted(statuses.items()):
        details = ", ".join(f"{k}={v}" for k, v in record.items() if k not in ("name", "updated", "stale", "pid") and not isinstance(v, dict))
        procs.add_row(name, "[red]stale[/red]" if record.get("stale") else "up", details[:160])
    return Group(top, versions, procs)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def run(cfg: DemoConfig) -> int:
    from rich.console import Console

    from flywheel.base.heartbeat import read_statuses
    from flywheel.demo import report

    console = Console()
    t_setup = time.time()
    run_id = cfg.run_id or time.strftime("demo-%Y%m%d-%H%M%S", time.gmtime())
    run_dir = Path(cfg.var_dir) / "demo" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, run_dir / "demo.toml")
    lake_root = run_dir / "lake"
    policies_dir = run_dir / "policies"
    learner_dir = run_dir / "learner"
    handoff = run_dir / "sessions.jsonl"
    topics = {"events": f"{run_id}.events", "outcomes": f"{run_id}.outcomes", "dlq": f"{run_id}.dlq"}
    registered_model = f"flywheel-{run_id}"
    log.info("demo: run %s under %s", run_id, run_dir)

    warm = ensure_models(cfg)
    log.info("demo: warm-started base ready (%s steps, held-out success %.0f%%)", warm.get("steps", "?"),
             100 * float(warm.get("final_success", 0.0)))
    scfg, stack_started = ensure_stack(cfg, list(topics.values()))
    log.info("demo: stack up (started here: %s); vLLM serves %s as policy-v0", ", ".join(stack_started) or "nothing", policy_v0(cfg))
    tracking_uri = scfg.mlflow_tracking_uri
    proxy_port = _free_port()
    # The serving router inside the proxy reads its tier config from the environment (ingest/proxy.py).
    tier_env = {"FLYWHEEL_SERVERS": scfg.vllm_url, "FLYWHEEL_REGISTERED_MODEL": registered_model,
                "FLYWHEEL_MLFLOW_TRACKING_URI": tracking_uri, "FLYWHEEL_BASE_MODEL": str(policy_v0(cfg).resolve()),
                "FLYWHEEL_POLICIES_DIR": str(policies_dir), "FLYWHEEL_CHALLENGER_SHARE": str(cfg.challenger_share)}
    common_kafka = ["--kafka-bootstrap", scfg.kafka_bootstrap]
    status_dir = cfg.var_dir
    procs = Processes(run_dir / "logs")
    from flywheel.base.heartbeat import status_dir as heartbeat_dir

    for stale in heartbeat_dir(status_dir).glob("*.json"):
        if stale.stem.startswith(("agent-sim", "outcome-sim", "learner", "promote", "episodes", "lake-writer", "proxy")):
            stale.unlink(missing_ok=True)  # an earlier run's heartbeats would show in this run's view
    started_at = time.time()
    summary: dict[str, Any] = {}
    try:
        procs.start("lake-writer", ["lake-writer", *common_kafka, "--events-topic", topics["events"],
                                    "--outcomes-topic", topics["outcomes"], "--dlq-topic", topics["dlq"],
                                    "--group-id", f"{run_id}-lake", "--lake-root", str(lake_root),
                                    "--roll-max-age-s", "2", "--var-dir", str(status_dir)])
        procs.start("episodes", ["episodes", "--lake-root", str(lake_root), "--state-dir", str(run_dir / "episodes-state"),
                                 "--follow", "--poll-interval-s", "2", "--var-dir", str(status_dir)])
        procs.start("proxy", ["proxy", "--port", str(proxy_port), "--upstream", scfg.vllm_url, *common_kafka,
                              "--events-topic", topics["events"], "--router", "serving", "--spool-name", f"{run_id}-proxy"],
                    env=tier_env)
        procs.start("outcome-sim", ["outcome-sim", *common_kafka, "--outcomes-topic", topics["outcomes"],
                                    "--handoff", str(handoff), "--cursor", str(run_dir / "outcome-cursor.json"),
                                    "--spool-name", f"{run_id}-outcomes", "--var-dir", str(status_dir)])
        _wait_for_proxy(proxy_port, procs)
        traffic_s = cfg.minutes * 60.0
        procs.start("agent-sim", ["agent-sim", "--proxy-url", f"http://127.0.0.1:{proxy_port}", *common_kafka,
                                  "--events-topic", topics["events"], "--concurrency", str(cfg.concurrency),
                                  "--duration-s", str(traffic_s), "--multi-share", str(cfg.multi_share),
                                  "--handoff", str(handoff), "--tokenizer", str(policy_v0(cfg).resolve()),
                                  "--spool-name", f"{run_id}-agent", "--var-dir", str(status_dir)])
        traffic_start = time.time()
        training = {"started": False}

        def start_training() -> None:
            procs.start("learner", ["learner", "--lake-root", str(lake_root), "--base-model", str(policy_v0(cfg).resolve()),
                                    "--mode", "full", "--lr", str(cfg.learner_lr), "--batch-size", str(cfg.learner_batch),
                                    "--min-batch", str(cfg.learner_batch), "--micro-batch", str(min(32, cfg.learner_batch)),
                                    "--cpu-threads", str(cfg.learner_threads), "--newest-first", "--loss-agg", "sequence",
                                    "--kl-coef", str(cfg.learner_kl), "--baseline", cfg.learner_baseline,
                                    *(["--positive-only"] if cfg.learner_positive_only else ["--no-positive-only"]),
                                    "--max-staleness", str(cfg.learner_max_staleness),
                                    "--epochs", str(cfg.learner_epochs), "--loss", "ppo" if cfg.learner_epochs > 1 else "tis",
                                    "--run-dir", str(learner_dir), "--policies-dir", str(policies_dir),
                                    "--publish-every-steps", str(cfg.publish_every_steps),
                                    "--publish-wait-for-gate" if cfg.publish_wait_for_gate else "--no-publish-wait-for-gate",
                                    "--publish-every-s", str(cfg.publish_every_s), "--vllm-url", scfg.vllm_url,
                                    "--registered-model", registered_model, "--mlflow-tracking-uri", tracking_uri,
                                    "--experiment", f"{run_id}-learner", "--var-dir", str(status_dir)], env=tier_env)
            procs.start("promote", ["promote", "--auto", "--interval-s", str(cfg.gate_interval_s),
                                    "--servers", scfg.vllm_url, "--base-model", str(policy_v0(cfg).resolve()),
                                    "--policies-dir", str(policies_dir), "--registered-model", registered_model,
                                    "--mlflow-tracking-uri", tracking_uri, "--lake-root", str(lake_root),
                                    "--min-sessions", str(cfg.gate_min_sessions), "--max-drop", str(cfg.gate_max_drop),
                                    "--eval-tasks", "flywheel.demo.tasks:eval_tasks",
                                    "--experiment", f"{run_id}-promotion", "--var-dir", str(status_dir)])


        cache: dict[str, Any] = {"at": 0.0, "success": {}}

        def success_now() -> dict[int, tuple[int, int]]:
            # a full lake scan costs CPU the learner needs: refresh it every 20 s, not every frame
            if time.time() - cache["at"] >= 20.0:
                cache["success"], cache["at"] = success_by_version(lake_root, started_at), time.time()
            return cache["success"]

        def render() -> Any:
            phase = ("final measurement (learner stopped)" if "learner" in procs.stopped else
                     "training" if training["started"] else "measuring the base")
            return view(read_statuses(status_dir), lake_counts(lake_root), success_now(), time.time() - traffic_start,
                        traffic_s, phase)

        def tick() -> bool:
            """One refresh; False when the traffic phase is over."""
            if not training["started"]:
                # the base is measured first: the learner starts once policy-v0 served base_sessions sessions
                done = int(read_statuses(status_dir).get("agent-sim", {}).get("sessions", 0))
                if done >= cfg.base_sessions or time.time() - traffic_start > traffic_s / 2:
                    log.info("demo: %d sessions served by policy-v0; starting the learner and the promotion gate", done)
                    start_training()
                    training["started"] = True
            elif cfg.measure_s > 0 and "learner" not in procs.stopped and time.time() - traffic_start >= traffic_s - cfg.measure_s:
                # the final measurement: no new versions, so the gate's last decision stands and the
                # champion serves the rest of the traffic
                log.info("demo: %.0f s of traffic left; stopping the learner so the champion is measured", cfg.measure_s)
                procs.stop("learner")
            dead = [(n, rc) for n, rc in procs.dead() if n != "agent-sim"]
            if dead:
                name, rc = dead[0]
                raise RuntimeError(f"{name} exited with status {rc} during the run; last lines of its log:\n{procs.tail(name)}")
            return procs.procs["agent-sim"].poll() is None

        try:
            watch(cfg, console, tick, render, success_now, status_dir, traffic_start)
        except KeyboardInterrupt:
            log.warning("demo: interrupted; stopping everything and writing the report for the traffic so far")
        log.info("demo: traffic done; %.0fs for the verifier, the lake and the episodes to catch up", cfg.drain_s)
        time.sleep(cfg.drain_s)
    finally:
        codes = procs.stop_all()
        log.info("demo: processes stopped: %s", codes)
        if not cfg.keep_stack and stack_started:
            from flywheel import stack

            stack.down(scfg, stack_started)
            log.info("demo: stopped the stack parts it started: %s", ", ".join(stack_started))
    summary = report.write_report(cfg.report_dir, str(lake_root), started_at, str(learner_dir), str(policies_dir),
                                  tracking_uri, registered_model,
                                  context={"run_id": run_id, "minutes": cfg.minutes, "started": time.strftime("%H:%M:%S", time.gmtime(started_at)),
                                           "ended": time.strftime("%H:%M:%S", time.gmtime()), "total_s": round(time.time() - t_setup, 1),
                                           "warm_start": {k: warm.get(k) for k in ("steps", "final_success", "seconds")}})
    console.print(Path(cfg.report_dir, "report.md").read_text())
    print(json.dumps(summary))
    return 0


def watch(cfg: DemoConfig, console: Any, tick: Any, render: Any, success_now: Any, status_dir: Path,
          traffic_start: float) -> None:
    """Refresh the live view (or log a line every 30 s) until tick() says the traffic phase is over."""
    from rich.live import Live

    from flywheel.base.heartbeat import read_statuses

    if cfg.live and console.is_terminal:
        with Live(render(), console=console, refresh_per_second=1, transient=False) as live:
            while tick():
                time.sleep(3.0)
                live.update(render())
        return
    last_log = 0.0
    while tick():
        time.sleep(3.0)
        if time.time() - last_log >= 30.0:
            statuses = read_statuses(status_dir)
            log.info("demo: %.1f min: %s sessions; learner step %s; success by version %s",
                     (time.time() - traffic_start) / 60, statuses.get("agent-sim", {}).get("sessions", 0),
                     statuses.get("learner", {}).get("step", "-"), success_now())
            last_log = time.time()


def _wait_for_proxy(port: int, procs: Processes, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2.0):
                return
        except OSError:
            if procs.procs["proxy"].poll() is not None:
                raise RuntimeError(f"proxy exited during start-up:\n{procs.tail('proxy')}")
            time.sleep(0.5)
    raise RuntimeError(f"proxy on port {port} did not answer /health within {timeout_s:.0f}s")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(DemoConfig, argv, prog="flywheel demo")
    setup_logging()
    # `kill PID` (and a background job, where the shell ignores SIGINT) gets the Ctrl-C path: every
    # process the demo started is stopped and the report is written for the traffic so far
    signal.signal(signal.SIGTERM, _interrupt)
    return run(cfg)
