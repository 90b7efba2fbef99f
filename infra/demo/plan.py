"""What a `flywheel demo` run is, decided before anything starts: its config, its paths and names, and
the command line of every process it starts.

Everything here is pure (no process, no network, no file written), so a unit test can check that
each command is one the sub-command accepts and that it carries the demo's settings
(tests/unit/test_demo_plan.py). infra/demo/closed_loop.py runs the plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.base import defaults
from flywheel.base.config import ConfigError, setting
from flywheel.demo import swarm
from flywheel.serving.decision import GateRule

# The control arm serves the base (policy-v0) for the whole run.
CONTROL_VERSION = 0
# The demo's reward rules: the packaged ones with the LLM judge in shadow mode on a sample of sessions.
DEMO_REWARDS = Path(__file__).with_name("rewards.toml")

# The heartbeat names of the demo's processes: an earlier run's heartbeats under these names are
# cleared, or they would show in this run's view.
HEARTBEATS = ("agent-sim", "outcome-sim", "learner", "promote", "episodes", "lake-writer", "proxy")


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
    learner_kl_rows: str = setting("all", "rows the learner's KL term is computed on: all, or trained (nonzero advantage)")
    learner_kl_target: float = setting(0.0, "the learner's adaptive-KL target per token (--kl-target; 0: learner_kl stays fixed)")
    learner_opening_share: float = setting(0.0, "share of each learner batch reserved for session openings (--opening-share)")
    learner_baseline: str = setting("batch", "learner reward baseline: batch (leave-one-out: the mean of the other rows of the "
                                             "task type in the batch, tool_use.add ...), running or none")
    learner_positive_only: bool = setting(True, "reinforce only rows above their task type's batch mean; pushing failed rows "
                                                "down drove the tiny policy into broken calls (README runs b, g, l)")
    learner_epochs: int = setting(1, "learner passes over each batch (> 1 switches its loss to PPO's clipped ratio); the "
                                     "learner trains every episode as it arrives, so traffic, not compute, sets its pace")
    learner_max_staleness_steps: int = setting(60, "learner steps an episode may lag the learner's weights, along its line, before "
                                                   "it is dropped (it takes the newest first; >= publish_every_steps). 60: the "
                                                   "champion's and the control's rows (60% of traffic) stay trainable through a "
                                                   "whole gate test (300 s is 20-30 steps). At 20 they went stale 20 steps in, the "
                                                   "learner trained on the challenger's 40% alone and idled until each supersede: "
                                                   "47 steps in 14 minutes, 2,152 rows dropped, no version promoted (run w)")
    learner_threads: int = setting(1, "the learner's torch CPU threads (1: its cores are shared with vLLM; 2 threads ran 5-20x slower)")
    publish_every_steps: int = setting(20, "learner steps between published versions (20 from a6484be, fixed before "
                                            "runs p-r: at 10 the first version was +0 to +3 points and held the "
                                            "challenger slot for half the learning time; docs/experiments.md)")
    publish_wait_for_gate: bool = setting(True, "a new version waits until the gate has ruled on the last (a new challenger "
                                                "replaces the last on the free server: with a fast learner the gate judged "
                                                "only 4 of 41 versions before the next replaced them)")
    publish_supersede_s: float = setting(420.0, "... but at most this long: a challenger still undecided after 420 s is "
                                                "replaced by the learner's newer version (ending a test undecided promotes "
                                                "nothing; 0: wait for the verdict). The group-sequential gate ends a test by "
                                                "its last look (240 a side, about 270 s at runs j-l's pace); 420 s is the "
                                                "safety net on a slower machine, not the pace (300 s before that gate)")
    publish_every_s: float = setting(0.0, "also publish after this many seconds, whatever the gate (0: never; a version "
                                          "published by time replaces the challenger under test, and the gate needs "
                                          "100-500 of its sessions to decide)")
    vllm_servers: int = setting(3, "one vLLM server per live version: control, champion, challenger (full weights: a new "
                              "version goes only to a server no live version holds)")
    control_share: float = setting(0.2, "share of sessions always served by policy-v0, for the whole run: the concurrent "
                                        "baseline the final champion is measured against")
    challenger_share: float = setting(0.4, "share of sessions the challenger gets while there is one (the champion gets the "
                                           "rest: 0.4)")
    gate_interval_s: float = setting(10.0, "seconds between promotion-gate rounds (each version waits for a verdict)")
    gate_alpha: float = setting(0.05, "the gate's error rate per one-sided sequential test (false promotion, false "
                                      "rejection, false rollback), valid however often it looks")
    gate_tau: float = setting(0.1, "the gate's mSPRT mixture scale: most sensitive to differences of about this size "
                                   "(ten points of success)")
    gate_margin: float = setting(0.0, "non-inferiority margin (0: a challenger is promoted only when better than the champion)")
    gate_outcome_kind: str = setting("task_success", "the session outcome the gate compares (the swarm scenario: "
                                                     "parts_correct, set by the scenario)")
    gate_min_sessions: int = setting(30, "mature concurrent sessions each side needs before the gate's first look")
    gate_max_sessions: int = setting(240, "challenger sessions after which an undecided challenger expires (not promoted); "
                                          "group-sequential: the last look's sessions a side. 240 fits the ~250-300 "
                                          "sessions a side a version got in 300 s in runs j, k, l")
    gate_test: str = setting("group-sequential", "the gate's promotion test: group-sequential (looks at 80, 160 and 240 "
                                                 "sessions a side, O'Brien-Fleming alpha spending) or msprt. Runs j, k, "
                                                 "l's versions were +4 to +6 points at ~280 a side, which the mSPRT "
                                                 "(about 3 standard errors) cannot separate from noise; the group-"
                                                 "sequential test's last look needs about 1.7 (flywheel bench gate: "
                                                 "power at +5 points 0.19 -> 0.51 at the same false-promotion bound)")
    gate_looks: int = setting(3, "group-sequential: planned looks, equally spaced up to gate_max_sessions")
    gate_spending: str = setting("obf", "group-sequential: alpha-spending function (obf or pocock)")
    gate_maturity_s: float = setting(10.0, "seconds after a session ends before the gate counts it (the demo's verifier "
                                           "reports 2 s after a session)")
    base_sessions: int = setting(330, "sessions policy-v0 serves before the learner starts (the base measurement)")
    # 300 s: at the 1.4+ sessions/s of earlier 20-minute runs (docs/experiments.md, run 12-01 m: 1,638
    # sessions of two versions alone) that is 400+ sessions, ~330 champion and ~85 control (80/20 once the
    # challenger alias is cleared). The final comparison against the control needs a few hundred: an
    # 18-point lift (that run's 16% -> 34%) is then ~4 standard errors, p ~ 1e-4.
    measure_s: float = setting(300.0, "the final window, the seconds of traffic at the end: the learner and the gate are stopped, "
                                      "the challenger alias is cleared, and the champion and the control serve the "
                                      "same sessions to be compared on")
    drain_s: float = setting(25.0, "after traffic stops: seconds for outcomes, lake and episodes to catch up")
    keep_stack: bool = setting(False, "leave running the stack parts the demo started (default: stop everything it started)")
    live: bool = setting(True, "show the rich live view (off: a log line every 30 s)")
    run_id: str = setting("", "name of this run (default: demo-<utc time>)")
    load_policy_v0_weights: bool = setting(False, "start vLLM on base_model and load policy-v0's weights into it (same "
                                                  "architecture) instead of serving the warm model's folder: a shared "
                                                  "stack is not restarted (the swarm integration test)")
    scenario: str = setting("tool_use", "tool_use (the default loop) or swarm (infra/demo/swarm.py: the policy decides to "
                                        "spawn sub-agents, summarise or prune; docs/swarm.md)")
    shaping_anneal_end_step: int = setting(50, "swarm: learner step from which the PARL shaping is exactly 0. Run d "
                                               "(2-3 part requests) trained 7-8 steps a minute from minute 2.5, so step "
                                               "50 falls near minute 9 of 20: the rest of training and the final window "
                                               "(more than the last third) run without shaping. Run c (3-4 parts) was "
                                               "slower: step 20 at minute 9.5")
    swarm_gate_margin: float = setting(0.01, "swarm: the gate's non-inferiority margin on parts_correct, in place of "
                                              "gate_margin (the scenario's aim is fewer critical steps at a share of "
                                              "parts right not lower than the champion's, docs/swarm.md). Run d's 0.05 "
                                              "was above the base's whole share (0.03) and let a broken version through")
    swarm_learner_kl_rows: str = setting("trained", "swarm: the rows the learner's KL term is computed on (--kl-rows). "
                                                   "Run e computed it on every row, 25-30 s a step instead of about 8: 27 "
                                                   "steps in 20 minutes, so the shaping (annealed by step 50) never reached 0")
    swarm_learner_kl: float = setting(0.1, "swarm: the learner's KL coefficient to policy-v0, in place of learner_kl: "
                                           "with a few percent of parts right a batch holds a handful of positive rows, "
                                           "and without it run d's policy collapsed into broken calls within 20 steps")
    swarm_learner_kl_target: float = setting(0.1, "swarm: the learner's adaptive-KL target per token, in place of "
                                                  "learner_kl_target (swarm_learner_kl is where the coefficient starts). "
                                                  "Run g's fixed 0.1 let the KL reach 2.0 per token by step 63, and v2 had "
                                                  "stopped spawning")
    swarm_opening_share: float = setting(0.5, "swarm: share of each learner batch reserved for session openings, in place "
                                              "of learner_opening_share. The spawn-or-serial decision is a session's "
                                              "opening; run g trained 3,584 of its 10,439 rows, so about two in three "
                                              "openings went stale untrained")

    def check(self) -> None:
        if self.minutes <= 0:
            raise ConfigError(f"minutes: must be > 0, got {self.minutes}")
        if self.concurrency < 1:
            raise ConfigError("concurrency: must be >= 1")
        if not 0 <= self.measure_s < self.minutes * 60:
            raise ConfigError(f"measure_s: must be >= 0 and shorter than the traffic ({self.minutes * 60:.0f} s), got {self.measure_s}")
        if self.vllm_servers < 2:
            raise ConfigError(f"vllm_servers: {self.vllm_servers}; full weights need a server per live version (the control and the "
                              "champion share policy-v0's server until a promotion, a challenger needs another; with 2 "
                              "servers publishing stops at the first promotion)")
        if not 0 <= self.control_share < 1 or not 0 <= self.challenger_share <= 1 - self.control_share:
            raise ConfigError(f"control_share ({self.control_share}) and challenger_share ({self.challenger_share}): each "
                              "must be a share within [0, 1) and the two must sum to at most 1")
        gate_rule(self).check_rule()
        if self.scenario not in SCENARIOS:
            raise ConfigError(f"scenario: {self.scenario!r} is not one of {SCENARIOS}")
        for name in ("learner_kl_rows", "swarm_learner_kl_rows"):
            if getattr(self, name) not in ("all", "trained"):
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not one of ('all', 'trained')")
        if min(self.learner_kl_target, self.swarm_learner_kl_target) < 0:
            raise ConfigError("learner_kl_target and swarm_learner_kl_target: must be >= 0")
        if not (0 <= self.learner_opening_share <= 1 and 0 <= self.swarm_opening_share <= 1):
            raise ConfigError("learner_opening_share and swarm_opening_share: must be in [0, 1]")
        if self.swarm_learner_kl < 0:
            raise ConfigError(f"swarm_learner_kl: must be >= 0, got {self.swarm_learner_kl}")
        if self.swarm_gate_margin < 0:
            raise ConfigError(f"swarm_gate_margin: must be >= 0, got {self.swarm_gate_margin}")
        if self.shaping_anneal_end_step < 1:
            raise ConfigError(f"shaping_anneal_end_step: must be >= 1, got {self.shaping_anneal_end_step}")


def gate_rule(cfg: DemoConfig) -> GateRule:
    """The demo's promotion rule: the one place it is built (the gate's flags and the report read it)."""
    return GateRule(alpha=cfg.gate_alpha, tau=cfg.gate_tau, margin=cfg.gate_margin, min_sessions=cfg.gate_min_sessions,
                    max_sessions=cfg.gate_max_sessions, maturity_s=cfg.gate_maturity_s, outcome_kind=cfg.gate_outcome_kind,
                    test=cfg.gate_test, looks=cfg.gate_looks, spending=cfg.gate_spending)


SCENARIOS = ("tool_use", "swarm")
SWARM_REWARDS = Path(__file__).with_name("swarm_rewards.toml")
SWARM_WARM_MODEL = Path("var/models/tiny-swarm-warm")
SWARM_GATE_OUTCOME = swarm.PARTS_CORRECT  # task_success is ~0 for nearly every swarm session
SWARM_MAX_TOKENS = 96  # a spawn of 4 sub-tasks is about 60 tokens of the tiny model's BPE


def for_scenario(cfg: DemoConfig) -> DemoConfig:
    """The config a scenario runs with: the swarm's policy-v0 is its own warm start (the tools' format), unless
    warm_model was set to something other than the default; its gate's margin is swarm_gate_margin and its learner's
    KL coefficient starts at swarm_learner_kl and steers to swarm_learner_kl_target, computed on the rows
    swarm_learner_kl_rows, with swarm_opening_share of each batch reserved for session openings."""
    import dataclasses

    if cfg.scenario != "swarm":
        return cfg
    cfg = dataclasses.replace(cfg, gate_margin=cfg.swarm_gate_margin, gate_outcome_kind=SWARM_GATE_OUTCOME,
                              learner_kl=cfg.swarm_learner_kl, learner_kl_rows=cfg.swarm_learner_kl_rows,
                              learner_kl_target=cfg.swarm_learner_kl_target,
                              learner_opening_share=cfg.swarm_opening_share)
    if Path(cfg.warm_model) == Path("var/models/tiny-warm"):
        return dataclasses.replace(cfg, warm_model=SWARM_WARM_MODEL)
    return cfg


def scenario_flags(cfg: DemoConfig, process: str) -> list[str]:
    """Flags a scenario adds to a process's command (after the command's own: the last of a repeated flag wins)."""
    if cfg.scenario != "swarm":
        return []
    return {"agent-sim": ["--scenario", "swarm", "--max-tokens", str(SWARM_MAX_TOKENS)],
            "episodes": ["--rewards-toml", str(SWARM_REWARDS)],
            "learner": ["--shaping-anneal-start-step", "0", "--shaping-anneal-end-step", str(cfg.shaping_anneal_end_step)],
            }.get(process, [])


def policy_v0(cfg: DemoConfig) -> Path:
    """The model vLLM serves as policy-v0 and the learner starts from."""
    return Path(cfg.warm_model if cfg.warm_start else cfg.base_model)


@dataclass(frozen=True)
class RunPlan:
    """One run's own state and names: a folder, topics, a consumer group, a registered model, all named
    by the run id, so a demo never reads another run's data."""

    run_id: str
    var_dir: Path  # heartbeats go to the shared var dir, so `flywheel status` shows the demo too
    traffic_s: float

    @property
    def run_dir(self) -> Path:
        return self.var_dir / "demo" / self.run_id

    @property
    def lake_root(self) -> Path:
        return self.run_dir / "lake"

    @property
    def policies_dir(self) -> Path:
        return self.run_dir / "policies"

    @property
    def learner_dir(self) -> Path:
        return self.run_dir / "learner"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def handoff(self) -> Path:
        """The agent's finished sessions, which the verifier (outcome-sim) judges."""
        return self.run_dir / "sessions.jsonl"

    @property
    def topics(self) -> dict[str, str]:
        return {"events": f"{self.run_id}.events", "outcomes": f"{self.run_id}.outcomes", "dlq": f"{self.run_id}.dlq"}

    @property
    def registered_model(self) -> str:
        return f"flywheel-{self.run_id}"


def plan_run(cfg: DemoConfig, now: float) -> RunPlan:
    """The run's plan; `now` (epoch seconds) names the run when the config does not."""
    run_id = cfg.run_id or time.strftime("demo-%Y%m%d-%H%M%S", time.gmtime(now))
    return RunPlan(run_id=run_id, var_dir=Path(cfg.var_dir), traffic_s=cfg.minutes * 60.0)


@dataclass(frozen=True)
class Endpoints:
    """Where the stack and the capture proxy listen, known once the stack is up."""

    kafka_bootstrap: str
    vllm_url: str  # the first server
    tracking_uri: str
    proxy_port: int
    vllm_urls: list[str] = field(default_factory=list)  # every server, the first first (empty: vllm_url alone)

    def __post_init__(self) -> None:
        if not self.vllm_urls:
            object.__setattr__(self, "vllm_urls", [self.vllm_url])
        assert self.vllm_urls[0] == self.vllm_url, f"vllm_url {self.vllm_url} is not the first of {self.vllm_urls}"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"


# ---------------------------------------------------------------------------------------------
# the commands: each a `flywheel` sub-command's argv (without the leading `flywheel`)
# ---------------------------------------------------------------------------------------------
def tier_env(cfg: DemoConfig, run: RunPlan, ends: Endpoints) -> dict[str, str]:
    """The serving tier's config for the router inside the proxy, which reads it from the environment
    (serving/proxy.py); the learner's publisher reads it too (learner/versions.py serving_tier), so it
    knows every server and keeps the control's and the champion's. Every key is a shared field
    (flywheel.base.config.SHARED_FIELDS), so the flat names mean the same to each child that has them."""
    return {"FLYWHEEL_SERVERS": ",".join(ends.vllm_urls), "FLYWHEEL_REGISTERED_MODEL": run.registered_model,
            "FLYWHEEL_MLFLOW_TRACKING_URI": ends.tracking_uri, "FLYWHEEL_BASE_MODEL": str(policy_v0(cfg).resolve()),
            "FLYWHEEL_POLICIES_DIR": str(run.policies_dir), "FLYWHEEL_CONTROL_SHARE": str(cfg.control_share),
            "FLYWHEEL_CONTROL_VERSION": str(CONTROL_VERSION), "FLYWHEEL_CHALLENGER_SHARE": str(cfg.challenger_share)}


def lake_writer_command(run: RunPlan, ends: Endpoints) -> list[str]:
    return ["lake-writer", "--kafka-bootstrap", ends.kafka_bootstrap, "--events-topic", run.topics["events"],
            "--outcomes-topic", run.topics["outcomes"], "--dlq-topic", run.topics["dlq"],
            "--group-id", f"{run.run_id}-lake", "--lake-root", str(run.lake_root),
            "--roll-max-age-s", "2", "--var-dir", str(run.var_dir)]


def episodes_command(run: RunPlan, ends: Endpoints | None = None) -> list[str]:
    # the shadow judge asks the first server: the publisher keeps policy-v0 (the control's) on the first holder
    judge = ["--judge-url", ends.vllm_url] if ends is not None else []
    return ["episodes", "--lake-root", str(run.lake_root), "--state-dir", str(run.run_dir / "episodes-state"),
            "--follow", "--poll-interval-s", "2", "--var-dir", str(run.var_dir), "--rewards-toml", str(DEMO_REWARDS), *judge]


def proxy_command(run: RunPlan, ends: Endpoints) -> list[str]:
    # the prompt text carries the user's request, which the shadow judge reads
    return ["proxy", "--port", str(ends.proxy_port), "--upstream", ends.vllm_url, "--kafka-bootstrap", ends.kafka_bootstrap,
            "--events-topic", run.topics["events"], "--router", "serving", "--spool-name", f"{run.run_id}-proxy",
            "--log-prompt-text"]


def outcome_sim_command(run: RunPlan, ends: Endpoints) -> list[str]:
    return ["outcome-sim", "--kafka-bootstrap", ends.kafka_bootstrap, "--outcomes-topic", run.topics["outcomes"],
            "--handoff", str(run.handoff), "--cursor", str(run.run_dir / "outcome-cursor.json"),
            "--spool-name", f"{run.run_id}-outcomes", "--var-dir", str(run.var_dir)]


def agent_sim_command(cfg: DemoConfig, run: RunPlan, ends: Endpoints) -> list[str]:
    return ["agent-sim", "--proxy-url", ends.proxy_url, "--kafka-bootstrap", ends.kafka_bootstrap,
            "--events-topic", run.topics["events"], "--concurrency", str(cfg.concurrency),
            # a safety cap: the demo stops the agent (SIGTERM) when the final window has had its measure_s;
            # traffic_s 0 (the chaos bench): until stopped
            "--duration-s", str(run.traffic_s + 600.0 if run.traffic_s else 0.0), "--multi-share", str(cfg.multi_share),
            "--handoff", str(run.handoff), "--tokenizer", str(policy_v0(cfg).resolve()),
            "--spool-name", f"{run.run_id}-agent", "--var-dir", str(run.var_dir)]


def learner_command(cfg: DemoConfig, run: RunPlan, ends: Endpoints) -> list[str]:
    return ["learner", "--lake-root", str(run.lake_root), "--base-model", str(policy_v0(cfg).resolve()),
            "--mode", "full", "--lr", str(cfg.learner_lr), "--batch-size", str(cfg.learner_batch),
            "--min-batch", str(cfg.learner_batch), "--micro-batch", str(min(32, cfg.learner_batch)),
            "--cpu-threads", str(cfg.learner_threads), "--newest-first", "--loss-agg", "sequence",
            "--kl-coef", str(cfg.learner_kl), "--kl-rows", cfg.learner_kl_rows, "--kl-target", str(cfg.learner_kl_target),
            "--opening-share", str(cfg.learner_opening_share), "--baseline", cfg.learner_baseline,
            *(["--positive-only"] if cfg.learner_positive_only else ["--no-positive-only"]),
            "--max-staleness-steps", str(cfg.learner_max_staleness_steps),
            "--epochs", str(cfg.learner_epochs), "--loss", "ppo" if cfg.learner_epochs > 1 else "tis",
            "--run-dir", str(run.learner_dir), "--policies-dir", str(run.policies_dir),
            "--publish-every-steps", str(cfg.publish_every_steps),
            "--publish-wait-for-gate" if cfg.publish_wait_for_gate else "--no-publish-wait-for-gate",
            "--publish-supersede-s", str(cfg.publish_supersede_s),
            "--publish-every-s", str(cfg.publish_every_s), "--vllm-url", ends.vllm_url,
            "--registered-model", run.registered_model, "--mlflow-tracking-uri", ends.tracking_uri,
            "--experiment", f"{run.run_id}-learner", "--var-dir", str(run.var_dir)]


RULE_FLAGS = ("alpha", "tau", "margin", "min_sessions", "max_sessions", "maturity_s", "outcome_kind", "test", "looks",
              "spending")  # the GateRule fields the demo sets


def promote_command(cfg: DemoConfig, run: RunPlan, ends: Endpoints) -> list[str]:
    rule = gate_rule(cfg)
    return ["promote", "--auto", "--interval-s", str(cfg.gate_interval_s),
            "--servers", ",".join(ends.vllm_urls), "--base-model", str(policy_v0(cfg).resolve()),
            "--policies-dir", str(run.policies_dir), "--registered-model", run.registered_model,
            "--mlflow-tracking-uri", ends.tracking_uri, "--lake-root", str(run.lake_root),
            "--control-share", str(cfg.control_share), "--control-version", str(CONTROL_VERSION),
            "--challenger-share", str(cfg.challenger_share),
            *[a for name in RULE_FLAGS for a in (f"--{name.replace('_', '-')}", str(getattr(rule, name)))],
            "--eval-tasks", "flywheel.demo.tasks:eval_tasks",
            "--experiment", f"{run.run_id}-promotion", "--var-dir", str(run.var_dir)]
