"""`flywheel demo --minutes N` (`make demo`): the whole closed loop on this machine, a live view, a report.

What it does, in order (each step logged):
1. set-up: the tiny base model (`flywheel model init`) and its warm-started copy
   (`infra.warm_start`), unless they exist;
2. the stack (`infra.stack`): Kafka and MLflow started beside a warm start still to build, and one
   vLLM server per live version (control, champion, challenger), each serving the WARM-STARTED
   model as policy-v0: started after the build on a machine without cores for both
   (`servers_beside_build`), else beside it on the base and reloaded with policy-v0's weights;
   a vLLM this stack started on another model is restarted;
3. this run's own topics, consumer group, lake, registered model and policy folder (named by
   the run id), so a demo never reads another run's data;
4. the loop as separate processes, each the ordinary `flywheel` sub-command: capture proxy
   (routing by the serving router), lake writer, episode builder (--follow), learner (full
   weights, published by reload_weights), promotion gate (--auto), outcome sources and the
   simulated agent;
5. a live view (rich) from the processes' heartbeats and the lake: sessions/s, lake lag,
   episodes, learner step, served versions and traffic shares, success per version;
6. the final window, measure_s seconds of traffic from minutes*60 - measure_s on: the learner and
   the gate are stopped and the challenger alias is cleared, so the champion and the control arm
   serve the same sessions, none of which the gate saw; it starts when the proxy's router has
   re-read the aliases and lasts its full measure_s, so the traffic runs past N minutes by the
   time stopping took (run_dir/final_window.json says since when); with final_after_sessions (a
   smoke run's setting, the suite's) it starts earlier, once a published version has that many sessions;
7. after the final window (N minutes of traffic without one): the agent stops, the outcomes and the lake catch up, every
   process it started is stopped (SIGTERM, then SIGKILL), the stack parts it started are
   stopped, and the report is written to var/report/ (report.md, PNGs, summary.json).

What each process is started with (paths, topics, flags) is decided up front in
infra/demo/plan.py; this module runs it. The last line printed is summary.json as one JSON object.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from flywheel.base.atomic import Durability, write_json
from flywheel.base.config import load_config, setup_logging, write_resolved
from flywheel.base.heartbeat import read_statuses, status_dir
from flywheel.base.versions import version_name
from flywheel.demo.plan import (
    CONTROL_VERSION,
    HEARTBEATS,
    SUBAGENT_SERVED,
    DemoConfig,
    Endpoints,
    RunPlan,
    agent_sim_command,
    episodes_command,
    lake_writer_command,
    learner_command,
    outcome_sim_command,
    plan_run,
    policy_v0,
    promote_command,
    proxy_command,
    scenario_flags,
    tier_env,
)
from flywheel.ingest.sdk_spools import LEGACY_SPOOL_ROOT, SPOOL_DIR_ENV

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]


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
        # The demo's SDK spools stay in the checkout's var/spool (the SDK's own default is the user's state directory).
        child_env = {SPOOL_DIR_ENV: str(REPO_ROOT / LEGACY_SPOOL_ROOT), **os.environ, **(env or {})}
        self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            cwd=str(REPO_ROOT), env=child_env, start_new_session=True)

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

    def terminate(self, name: str) -> None:
        """SIGTERM without waiting for the exit (stop() waits): to stop several processes at once."""
        proc = self.procs.get(name)
        if proc is None:
            return
        self.stopped.add(name)
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def wait_until(self, name: str, done: Callable[[], bool], timeout_s: float) -> bool:
        """Until the process has exited or done() holds (False: neither within timeout_s)."""
        proc = self.procs.get(name)
        deadline = time.time() + timeout_s
        while proc is not None and proc.poll() is None and not done():
            if time.time() >= deadline:
                return False
            time.sleep(0.2)
        return True

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
def ensure_models(cfg: DemoConfig) -> dict[str, Any]:
    """The base model, then its warm start and the frozen sub-agents' model (each built unless current); returns
    the warm start's record."""
    ensure_base(cfg)
    build = warm_start_build(cfg)
    warm = build() if build is not None else recorded_warm(cfg)
    ensure_subagents(cfg)
    return warm


def recorded_warm(cfg: DemoConfig) -> dict[str, Any]:
    """The record of the warm start on disk ({} with the warm start off)."""
    return json.loads((Path(cfg.warm_model) / "warm_start.json").read_text()) if cfg.warm_start else {}


def ensure_base(cfg: DemoConfig) -> None:
    """The base model: a real one fetched and converted once (reused while current), else the tiny one built."""
    from flywheel.demo.model_init import ensure_base_model

    if cfg.fetch_model:
        from flywheel.models import ModelFetchConfig, fetch

        fetch(ModelFetchConfig(name=cfg.fetch_model, out=Path(cfg.base_model)))
    else:
        ensure_base_model(cfg.base_model)


def warm_start_build(cfg: DemoConfig) -> Callable[[], dict[str, Any]] | None:
    """The build of the warm start that `run` still has to do (None: off, or the one on disk is current)."""
    from flywheel.demo import warm_start

    if not cfg.warm_start:
        return None
    build: Callable[[Path, Path], dict[str, Any]]
    if cfg.scenario == "swarm":  # its own policy-v0: the tools' format taught on a minority of demonstrations
        from flywheel.demo import swarm

        rule, build, settings = swarm.warm_rule(), swarm.warm_start_model, None
    else:
        rule, settings = warm_start.RULE, cfg.warm
        build = functools.partial(warm_start.run, settings=cfg.warm)
    if warm_start.is_current(Path(cfg.warm_model), Path(cfg.base_model), rule, settings):
        return None

    def go() -> dict[str, Any]:
        log.info("demo: warm-starting %s into %s (rule %s)", cfg.base_model, cfg.warm_model, rule)
        return build(cfg.base_model, cfg.warm_model)

    return go


def ensure_stack(cfg: DemoConfig, topics: list[str], on_base: bool = False,
                 with_vllm: bool = True) -> tuple[Any, list[str]]:
    """The stack up with this run's topics, every vLLM server on policy-v0's weights, or (on_base) on the base
    model's until `load_policy_v0` (the warm start is still being built); with_vllm False, Kafka and MLflow only
    (the servers come with a later call)."""
    from flywheel import stack

    # with load_policy_v0_weights (or on_base) the servers run on base_model and get policy-v0's weights by a reload
    # (load_policy_v0; same architecture and tokenizer): a shared stack is not restarted for another model dir
    served_dir = cfg.base_model if cfg.load_policy_v0_weights or on_base else policy_v0(cfg)
    # a full-weight learner publishes no adapter: its servers run without vLLM's LoRA layers
    scfg = stack.replace_config(stack.load_stack_config([]), base_model=served_dir, vllm_servers=cfg.vllm_servers,
                                vllm_lora=cfg.learner.mode == "lora", vllm_nice=cfg.vllm_nice)
    started = stack.ensure_up(scfg, None if with_vllm else [p for p in scfg.parts if p != "vllm"])
    if with_vllm and not stack.vllm_serves_base(scfg):
        raise stack.StackError(f"vLLM at {scfg.vllm_urls} does not serve {served_dir} as {scfg.served_model_name}")
    stack.ensure_topics(stack.replace_config(scfg, kafka_topics=topics))
    if with_vllm and not on_base:
        load_policy_v0(cfg, scfg)
    return scfg, started


def load_policy_v0(cfg: DemoConfig, scfg: Any) -> None:
    """Every server onto exactly policy-v0's weights, as the publisher does when it restores a version: an earlier
    run may have left its trained weights in place (full reloads keep the served name), and a server started while
    the warm start was built serves the base's. (no pause: the demo's own traffic has not started yet)"""
    from flywheel.serving.publisher import reload_full

    for url in scfg.vllm_urls:
        reload_full(url, policy_v0(cfg).resolve(), 0)


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
    top = Table(title=f"flywheel demo: {elapsed / 60:.1f} / {total / 60:.0f} min of "
                      f"traffic{': ' + phase if phase else ''}",
                expand=True)
    for col in ("sessions", "sessions/s", "lake files (ev/out/epi)", "episodes", "learner step", "policy version",
                "gate"):
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
        versions.add_row(version_name(v), str(n), f"{n / total_sessions:.0%}", f"{s / max(1, n):.1%}",
                         f"{lo:.0%}-{hi:.0%}")
    procs = Table(title="processes (heartbeats)", expand=True)
    procs.add_column("process")
    procs.add_column("state")
    procs.add_column("details", overflow="fold")
    for name, record in sorted(statuses.items()):
        details = ", ".join(f"{k}={v}" for k, v in record.items()
                            if k not in ("name", "updated", "stale", "pid") and not isinstance(v, dict))
        procs.add_row(name, "[red]stale[/red]" if record.get("stale") else "up", details[:160])
    return Group(top, versions, procs)


# ---------------------------------------------------------------------------------------------
# the traffic phase
# ---------------------------------------------------------------------------------------------
SCAN_EVERY_S = 60.0  # between the live view's lake scans (Traffic.success_now)
# while final_after_sessions waits for a published version's sessions: a short run's lake takes a second or two to scan
EARLY_SCAN_EVERY_S = 15.0


class Traffic:
    """The traffic phase: the learner and the gate run (from the first session, or after policy-v0 served
    base_sessions), and in the final window (measure_s seconds at the end, or from final_after_sessions' event on)
    the champion is measured against the control; tick() moves between these, render() draws them."""

    def __init__(self, cfg: DemoConfig, plan: RunPlan, ends: Endpoints, procs: Processes, started_at: float) -> None:
        self.cfg, self.plan, self.ends, self.procs = cfg, plan, ends, procs
        self.started_at = started_at  # the live view counts the lake's sessions from here
        self.traffic_start = time.time()  # the agent has just started
        self.training = False
        self.final_since: float | None = None  # the final window's start, once it began
        self._success: dict[int, tuple[int, int]] = {}
        self._success_at = 0.0
        self._scanning: threading.Thread | None = None

    def elapsed(self) -> float:
        return time.time() - self.traffic_start

    def start_training(self) -> None:
        self.procs.start("learner", learner_command(self.cfg, self.plan, self.ends),
                         env=tier_env(self.cfg, self.plan, self.ends))
        self.procs.start("promote", promote_command(self.cfg, self.plan, self.ends))
        self.training = True

    def success_now(self) -> dict[int, tuple[int, int]]:
        """The live view's success by version: the last scan's, refreshed in the background every SCAN_EVERY_S
        (EARLY_SCAN_EVERY_S while final_after_sessions waits for a published version's sessions).

        A full lake scan takes 13 s on a quiet machine by the end of a run and about a minute beside the learner and
        three vLLM servers. Run inline every 20 s (runs 1-8), the scans ran back to back on one core, and each
        delayed the loop's checks, so the final window and the end of the traffic came up to 70 s late."""
        busy = self._scanning is not None and self._scanning.is_alive()
        every = EARLY_SCAN_EVERY_S if self.waiting_for_new_version() else SCAN_EVERY_S
        if not busy and time.time() - self._success_at >= every:
            self._success_at = time.time()

            def scan() -> None:
                self._success = success_by_version(self.plan.lake_root, self.started_at)

            self._scanning = threading.Thread(target=scan, name="live-view-scan", daemon=True)
            self._scanning.start()
        return self._success

    def waiting_for_new_version(self) -> bool:
        return self.cfg.final_after_sessions > 0 and self.training and self.final_since is None

    def new_version_served(self) -> tuple[int, int] | None:
        """final_after_sessions > 0: (version, sessions) of a version the learner published that has that many
        sessions with an outcome in the lake (the last background scan's count, so it lags by up to
        EARLY_SCAN_EVERY_S and a scan); None while there is none, or nothing to wait for."""
        if not self.waiting_for_new_version():
            return None
        ready = [(v, n) for v, (n, _) in self.success_now().items() if v > 0 and n >= self.cfg.final_after_sessions]
        return max(ready) if ready else None

    def start_final_window(self, early: tuple[int, int] | None = None) -> None:
        """Stop the learner and the gate, then clear the challenger alias: every session outside the control
        arm goes to the champion, so the two are compared on the same sessions, none of which the gate saw.

        The window starts when the proxy's router says it routes by aliases read after the clear, not at a
        guessed delay: its background refresh can run late on a busy machine, and a session routed by the
        old aliases would put the last challenger into the champion's window."""
        from flywheel.serving.registry import CHALLENGER, CHAMPION, Registry

        log.info("demo: stopping the learner and the gate for the final window (%.0f s of traffic)", self.cfg.measure_s)
        # both at once: the learner finishes its step (and a publish due in it) and checkpoints; the gate finishes its
        # round, which may still decide the last challenger (a round with the offline evaluation took over 30 s in
        # run 8, and a kill at 30 s landed between moving the alias and recording the decision)
        self.procs.terminate("learner")
        self.procs.terminate("promote")
        # the learner's heartbeat says "stopped" once it trains and publishes no more; its interpreter took another
        # 30 s to exit in run 9, which the final window need not wait for (stop_all reaps it)
        if not self.procs.wait_until("learner", self.learner_stopped, timeout_s=60.0):
            self.procs.stop("learner")  # SIGKILL after its grace
        self.procs.stop("promote", timeout_s=120.0)
        registry = Registry(self.ends.tracking_uri, self.plan.registered_model)
        registry.clear_alias(CHALLENGER)
        cleared_at = time.time()
        champion = registry.aliases().get(CHAMPION, 0)
        confirmed = wait_for_router(self.ends.proxy_port, cleared_at)
        self.final_since = time.time()
        write_json(self.plan.final_window_path,
                   {"since": self.final_since, "champion": champion, "challenger_cleared_at": cleared_at,
                    "router_confirmed": confirmed,
                    "early": None if early is None else {"version": early[0], "sessions": early[1]}},
                   Durability.ADVISORY)
        log.info("demo: final window from %.0f (%.1f s after the clear): %s against the control %s", self.final_since,
                 self.final_since - cleared_at, version_name(champion), version_name(CONTROL_VERSION))

    def learner_stopped(self) -> bool:
        return read_statuses(self.plan.var_dir).get("learner", {}).get("phase") == "stopped"

    def traffic_ends_at(self) -> float:
        """The final window gets its full measure_s however long stopping the learner and the gate took, so the
        traffic runs past `minutes` by that long; without a final window it ends after `minutes`."""
        if self.final_since is not None:
            return self.final_since + self.cfg.measure_s
        return self.traffic_start + self.plan.traffic_s

    def phase(self) -> str:
        return ("final window (learner and gate stopped, champion vs control)" if self.final_since is not None else
                "training" if self.training else "measuring the base")

    def render(self) -> Any:
        return view(read_statuses(self.plan.var_dir), lake_counts(self.plan.lake_root), self.success_now(),
                    self.elapsed(), self.plan.traffic_s, self.phase())

    def tick(self) -> bool:
        """One refresh; False when the traffic phase is over."""
        cfg, procs, traffic_s = self.cfg, self.procs, self.plan.traffic_s
        if not self.training:
            # base_sessions > 0: the learner starts once policy-v0 served that many sessions
            done = int(read_statuses(self.plan.var_dir).get("agent-sim", {}).get("sessions", 0))
            if done >= cfg.base_sessions or self.elapsed() > traffic_s / 2:
                log.info("demo: %d sessions served by policy-v0; starting the learner and the promotion gate", done)
                self.start_training()
        elif cfg.measure_s > 0 and self.final_since is None:
            early = self.new_version_served()
            if early is not None and self.elapsed() < traffic_s - cfg.measure_s:
                log.info("demo: %s has %d sessions with an outcome at %.0f s of traffic: the final window starts "
                         "early (final_after_sessions %d)", version_name(early[0]), early[1], self.elapsed(),
                         cfg.final_after_sessions)
                self.start_final_window(early)
            elif self.elapsed() >= traffic_s - cfg.measure_s:
                self.start_final_window()
        dead = [(n, rc) for n, rc in procs.dead() if n != "agent-sim"]
        if dead:
            name, rc = dead[0]
            raise RuntimeError(f"{name} exited with status {rc} during the run; last lines of its "
                               f"log:\n{procs.tail(name)}")
        if time.time() >= self.traffic_ends_at():
            procs.stop("agent-sim")  # SIGTERM: it finishes the sessions in flight
            return False
        return procs.procs["agent-sim"].poll() is None


def watch(live: bool, console: Any, traffic: Traffic) -> None:
    """Refresh the live view (or log a line every 30 s) until traffic.tick() says the traffic phase is over."""
    from rich.live import Live

    if live and console.is_terminal:
        with Live(traffic.render(), console=console, refresh_per_second=1, transient=False) as screen:
            while traffic.tick():
                time.sleep(3.0)
                screen.update(traffic.render())
        return
    last_log = 0.0
    while traffic.tick():
        time.sleep(3.0)
        if time.time() - last_log >= 30.0:
            statuses = read_statuses(traffic.plan.var_dir)
            log.info("demo: %.1f min: %s sessions; learner step %s; success by version %s",
                     traffic.elapsed() / 60, statuses.get("agent-sim", {}).get("sessions", 0),
                     statuses.get("learner", {}).get("step", "-"), traffic.success_now())
            last_log = time.time()


# ---------------------------------------------------------------------------------------------
# the phases of a run
# ---------------------------------------------------------------------------------------------
def set_up(cfg: DemoConfig, now: float) -> RunPlan:
    """This run's folder, with its resolved config beside it."""
    plan = plan_run(cfg, now)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, plan.run_dir / "demo.toml")
    log.info("demo: run %s under %s", plan.run_id, plan.run_dir)
    return plan


def log_warm(warm: dict[str, Any]) -> dict[str, Any]:
    log.info("demo: warm-started base ready (%s steps, held-out success %.0f%%)", warm.get("steps", "?"),
             100 * float(warm.get("final_success", 0.0)))
    return warm


def start_stack(cfg: DemoConfig, plan: RunPlan, on_base: bool = False,
                with_vllm: bool = True) -> tuple[Any, list[str], Endpoints]:
    """The stack with this run's topics; returns its config, the parts started here and where it all listens."""
    scfg, started = ensure_stack(cfg, list(plan.topics.values()), on_base, with_vllm)
    log.info("demo: stack up (started here: %s); %s", ", ".join(started) or "nothing",
             "vLLM once the warm start is built" if not with_vllm else f"vLLM serves {cfg.base_model} until the "
             "warm start is built" if on_base else f"vLLM serves {policy_v0(cfg)} as policy-v0")
    ends = Endpoints(kafka_bootstrap=scfg.kafka_bootstrap, vllm_url=scfg.vllm_url,
                     tracking_uri=scfg.mlflow_tracking_uri,
                     proxy_port=_free_port(), vllm_urls=scfg.vllm_urls)
    return scfg, started, ends


FROZEN_PART = "vllm-frozen"  # in the started parts when this run started the frozen sub-agents' server


def ensure_subagents(cfg: DemoConfig) -> None:
    """The frozen sub-agents' model, when the run has them (built unless current)."""
    if cfg.subagent_model is not None:
        from flywheel.demo import swarm

        swarm.ensure_subagent_model(cfg.base_model, cfg.subagent_model)


def start_subagents(cfg: DemoConfig, scfg: Any, ends: Endpoints, started: list[str]) -> Endpoints:
    """The frozen sub-agents' server, when the run has them; ends then names it, and `started` gets
    FROZEN_PART when this call started it (stop_everything stops only that)."""
    if cfg.subagent_model is None:
        return ends
    from flywheel import stack

    url, new = stack.ensure_frozen_vllm(scfg, SUBAGENT_SERVED, Path(cfg.subagent_model), cfg.subagent_port)
    if new:
        started.append(FROZEN_PART)
    return dataclasses.replace(ends, subagent_url=url)


def servers_beside_build(cfg: DemoConfig) -> bool:
    """Whether the vLLM servers start while the warm start is built, or after it.

    Beside it only where the build's pinned threads and the servers each have cores of their own. On two cores the
    servers' start (~100-150 s of compiling on both cores) all but stopped the build: its first 100 steps took 225 s
    against 55 s alone (run 25), and the build ended ~540 s in against ~315 s alone, so the traffic began ~2 minutes
    later than with the servers started after it (~315 + ~100 s, docs/experiments.md)."""
    from flywheel.demo import warm_start

    return (os.cpu_count() or 1) >= warm_start.THREADS + cfg.vllm_servers


def models_and_stack(cfg: DemoConfig, plan: RunPlan) -> tuple[dict[str, Any], Any, list[str], Endpoints]:
    """The models and the stack; the builds still to do run beside the stack's start.

    The warm start (~5.5 minutes, pinned numerics: the same weights whatever else runs) runs beside Kafka's and
    MLflow's start. The vLLM servers start beside it too where there are cores enough (`servers_beside_build`), on
    the base model (same architecture and tokenizer), and are reloaded with policy-v0's weights once it is built, the
    path a restored version takes; elsewhere they start after it, on policy-v0. The swarm's frozen sub-agents (when
    configured) get their model built after policy-v0's and a server of their own once it is."""
    ensure_base(cfg)
    warm_build = warm_start_build(cfg)
    result: dict[str, Any] = {}

    def build_all() -> None:
        try:
            if warm_build is not None:
                result["warm"] = warm_build()
            ensure_subagents(cfg)
        except BaseException as exc:  # re-raised in the caller's thread, below
            result["error"] = exc

    builder = threading.Thread(target=build_all, name="warm-start", daemon=True)
    builder.start()
    beside = warm_build is None or servers_beside_build(cfg)
    scfg, started, ends = start_stack(cfg, plan, on_base=warm_build is not None, with_vllm=beside)
    try:
        builder.join()
        if "error" in result:
            raise result["error"]
        warm = log_warm(result["warm"] if warm_build is not None else recorded_warm(cfg))
        if not beside:
            scfg, more, ends = start_stack(cfg, plan)
            started += more
        elif warm_build is not None:
            load_policy_v0(cfg, scfg)
        ends = start_subagents(cfg, scfg, ends, started)
    except BaseException:
        if not cfg.keep_stack and started:
            from flywheel import stack

            stack.down(scfg, started)
        raise
    return warm, scfg, started, ends


def clear_heartbeats(var_dir: Path) -> None:
    for stale in status_dir(var_dir).glob("*.json"):
        if stale.stem.startswith(HEARTBEATS):
            stale.unlink(missing_ok=True)  # an earlier run's heartbeats would show in this run's view


def start_processes(cfg: DemoConfig, plan: RunPlan, ends: Endpoints, procs: Processes, started_at: float) -> Traffic:
    """The loop's processes up to the agent, whose start begins the traffic phase.

    With base_sessions 0 the learner and the gate start first and the agent waits until the learner is
    ready to train: its start-up (imports, model, MLflow run; about a minute on a busy 2-core machine)
    would otherwise leave a backlog that a newest-first learner, barely faster than the traffic, trains
    minutes late. With base_sessions > 0 they start later, from Traffic.tick."""
    procs.start("lake-writer", lake_writer_command(plan, ends))
    procs.start("episodes", episodes_command(plan, ends) + scenario_flags(cfg, "episodes"))
    procs.start("proxy", proxy_command(plan, ends), env=tier_env(cfg, plan, ends))
    procs.start("outcome-sim", outcome_sim_command(plan, ends))
    traffic = Traffic(cfg, plan, ends, procs, started_at)
    if cfg.base_sessions <= 0:
        traffic.start_training()
        wait_for_learner(plan.var_dir, procs)
    _wait_for_proxy(ends.proxy_port, procs)
    procs.start("agent-sim", agent_sim_command(cfg, plan, ends) + scenario_flags(cfg, "agent-sim"))
    traffic.traffic_start = time.time()  # the agent has just started
    return traffic


def wait_for_learner(var_dir: Path, procs: Processes, timeout_s: float = 600.0) -> None:
    """Until the learner's heartbeat says it waits for episodes (set up, MLflow run open); a learner that
    exits first fails the run with its log's last lines."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if read_statuses(var_dir).get("learner", {}).get("phase") in ("waiting", "training"):
            return
        dead = [(n, rc) for n, rc in procs.dead() if n in ("learner", "promote")]
        if dead:
            name, rc = dead[0]
            raise RuntimeError(f"{name} exited with status {rc} before the traffic started; last lines of its "
                               f"log:\n{procs.tail(name)}")
        time.sleep(1.0)
    raise RuntimeError(f"the learner was not ready within {timeout_s:.0f} s; last lines of its log:\n"
                       f"{procs.tail('learner')}")


def run_traffic(cfg: DemoConfig, console: Any, traffic: Traffic) -> None:
    """The live view until the agent is done (or Ctrl-C), then time for the loop to catch up."""
    try:
        watch(cfg.live, console, traffic)
    except KeyboardInterrupt:
        log.warning("demo: interrupted; stopping everything and writing the report for the traffic so far")
    log.info("demo: traffic done; %.0fs for the verifier, the lake and the episodes to catch up", cfg.drain_s)
    time.sleep(cfg.drain_s)


def stop_everything(cfg: DemoConfig, procs: Processes, scfg: Any, stack_started: list[str]) -> None:
    codes = procs.stop_all()
    log.info("demo: processes stopped: %s", codes)
    if not cfg.keep_stack and stack_started:
        from flywheel import stack

        if FROZEN_PART in stack_started:  # not a stack part: its own server, started by start_subagents
            stack.stop_frozen_vllm(scfg, SUBAGENT_SERVED)
        stack.down(scfg, stack_started)
        log.info("demo: stopped the stack parts it started: %s", ", ".join(stack_started))


def final_since(plan: RunPlan) -> float | None:
    """When the final window began (None: the run had none, or ended before it)."""
    window = plan.final_window()
    return float(window["since"]) if window else None


def report_run(cfg: DemoConfig, plan: RunPlan, ends: Endpoints, console: Any, warm: dict[str, Any],
               t_setup: float, started_at: float) -> dict[str, Any]:
    """Write the report, show it, and print summary.json as the last line."""
    from flywheel.demo import report

    context = {"run_id": plan.run_id, "minutes": cfg.minutes, "final_early": plan.final_window().get("early"),
               "started": time.strftime("%H:%M:%S", time.gmtime(started_at)),
               "ended": time.strftime("%H:%M:%S", time.gmtime()), "total_s": round(time.time() - t_setup, 1),
               "warm_start": {k: warm.get(k) for k in ("steps", "final_success", "seconds")}}
    summary = report.write_run_report(cfg.report_dir, cfg, plan, ends.tracking_uri, context, final_since(plan),
                                      since=started_at)
    if cfg.scenario == "swarm":
        summary = swarm_section(cfg, plan, summary, started_at)
    record_evidence(cfg, summary, warm, started_at)
    console.print(Path(cfg.report_dir, "report.md").read_text())
    print(json.dumps(summary))
    return summary


def swarm_section(cfg: DemoConfig, plan: RunPlan, summary: dict[str, Any], started_at: float) -> dict[str, Any]:
    """The swarm scenario's section of report.md and its summary.json keys (infra/demo/swarm_report.py)."""
    from flywheel.demo import swarm_report

    return swarm_report.write_for_run(Path(cfg.report_dir), plan, summary, started_at)


def record_evidence(cfg: DemoConfig, summary: dict[str, Any], warm: dict[str, Any], started_at: float) -> Path:
    """The run file: under docs/runs/ for a run on the checkout's own var/ (`make demo`), else under the run's
    var_dir/runs/ (tests and benches run on a temporary var_dir and must not add to the committed evidence)."""
    from flywheel.demo import experiments

    own = Path(cfg.var_dir).resolve() == (REPO_ROOT / "var").resolve()
    return experiments.record_run(summary, cfg, warm, started_at, runs_dir=experiments.RUNS_DIR if own
                                  else Path(cfg.var_dir) / "runs", repo_root=REPO_ROOT)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def run(cfg: DemoConfig) -> int:
    from rich.console import Console

    console = Console()
    t_setup = time.time()
    plan = set_up(cfg, t_setup)
    warm, scfg, stack_started, ends = models_and_stack(cfg, plan)
    procs = Processes(plan.log_dir)
    clear_heartbeats(plan.var_dir)
    started_at = time.time()
    try:
        traffic = start_processes(cfg, plan, ends, procs, started_at)
        run_traffic(cfg, console, traffic)
    finally:
        stop_everything(cfg, procs, scfg, stack_started)
    report_run(cfg, plan, ends, console, warm, t_setup, started_at)
    return 0


def _wait_for_proxy(port: int, procs: Processes, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2.0):
                return
        except OSError:
            if procs.procs["proxy"].poll() is not None:
                raise RuntimeError(f"proxy exited during start-up:\n{procs.tail('proxy')}") from None
            time.sleep(0.5)
    raise RuntimeError(f"proxy on port {port} did not answer /health within {timeout_s:.0f}s")


def wait_for_router(proxy_port: int, since: float, timeout_s: float = 60.0) -> bool:
    """Wait until the proxy's router routes by aliases it began reading after `since` (GET /stats, "router");
    False, with a warning, when it did not within timeout_s."""
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{proxy_port}/stats", timeout=2.0) as resp:
                router = json.loads(resp.read()).get("router") or {}
            if (router.get("read_at") or 0.0) > since:
                return True
        except (OSError, ValueError):
            pass  # a busy proxy: ask again
        time.sleep(0.5)
    log.warning("demo: the proxy's router did not re-read the aliases within %.0f s of clearing the challenger; "
                "the final window starts anyway", timeout_s)
    return False


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(DemoConfig, argv, prog="flywheel demo")
    setup_logging()
    # `kill PID` (and a background job, where the shell ignores SIGINT) gets the Ctrl-C path: every
    # process the demo started is stopped and the report is written for the traffic so far
    signal.signal(signal.SIGTERM, _interrupt)
    return run(cfg)
