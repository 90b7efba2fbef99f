"""What a `flywheel demo` run is, decided before anything starts: its config, its paths and names, and
the command line of every process it starts.

Everything here is pure (no process, no network, no file written), so a unit test can check that
each command is one the sub-command accepts and that it carries the demo's settings
(tests/unit/test_demo_plan.py). infra/demo/closed_loop.py runs the plan.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from flywheel.base import defaults
from flywheel.base.config import ConfigError, check_choices, from_recipe, setting, to_flags
from flywheel.demo.warm_start import WarmStartSettings
from flywheel.learner.config import LearnerConfig
from flywheel.serving.decision import GateRule

Scenario = Literal["tool_use", "swarm"]
# `flywheel demo` without --recipe: infra/recipes/tool_use.toml
DEFAULT_RECIPE = "tool_use"

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

    RECIPE_SECTION: ClassVar[str] = ""  # --recipe: the whole recipe (its top-level keys, [learner], [gate])

    minutes: float = setting(15.0, "minutes of agent traffic (set-up and the report come on top)")
    var_dir: Path = setting(Path(defaults.VAR_DIR), "state directory; the run lives under <var_dir>/demo/<run id>")
    report_dir: Path = setting(Path(defaults.VAR_DIR) / "report", "where report.md, the PNGs and summary.json go")
    base_model: Path = setting(Path(defaults.BASE_MODEL_DIR), "the base model: the tiny one (built when missing), or "
                                                              "where fetch_model writes a real one")
    warm_model: Path = setting(Path("var/models/tiny-warm"), "the warm-started model vLLM serves as policy-v0 (built "
                                                             "when missing)")
    warm_start: bool = setting(True, "serve the warm-started model (False: serve base_model as it is; for "
                                     "quick loop tests)")
    fetch_model: str = setting("", "a real model `flywheel model fetch` writes to base_model before anything starts "
                                   "(the smollm2 recipe: smollm2-135m-instruct); empty: base_model is the tiny one, "
                                   "built when missing")
    warm: WarmStartSettings = field(default_factory=WarmStartSettings, metadata={
        "help": "how the tool-use warm start trains (flywheel.demo.warm_start; a recipe's [warm] table; the swarm "
                "scenario's warm start has its own, infra/demo/swarm.py)"})
    gate_eval_tasks: str = setting("flywheel.demo.tasks:eval_tasks", "the gate's offline eval set (module:function; "
                                                                      "flywheel promote --eval-tasks)")
    learning_claim: bool = setting(True, "false for a smoke run (the smollm2 recipe on CPU: minutes, a handful of "
                                         "learner steps): the report then says it makes no learning claim")
    concurrency: int = setting(3, "agent sessions in flight (about what the learner keeps up with on 2 cores; more "
                                  "only starves it of CPU)")
    multi_share: float = setting(0.1, "share of tasks split across two sub-agents (their rows share the session's "
                                      "reward, which a sibling's failure zeroes: at 0.2 a third of the learner's "
                                      "rows were such)")
    vllm_servers: int = setting(3, "one vLLM server per live version: control, champion, challenger (full weights: a "
                              "new version goes only to a server no live version holds)")
    vllm_nice: int = setting(10, "the servers' niceness (flywheel infra --vllm-nice): the learner is the loop's "
                                 "bottleneck on shared cores; at 0 three servers left its step ~10x its time alone "
                                 "(a step every 18 s in runs 15-17, 2.0 s alone); they take the cores back while it "
                                 "waits")
    control_share: float = setting(0.2, "share of sessions always served by policy-v0, for the whole run: the "
                                        "concurrent baseline the final champion is measured against")
    challenger_share: float = setting(0.4, "share of sessions the challenger gets while there is one (the champion "
                                           "gets the rest: 0.4)")
    spare_to_control: bool = setting(True, "while no challenger is live (the final window above all), its share goes "
                                           "to the control: the window's control then gets 0.6 of the sessions, "
                                           "enough for 200+ in 300 s, where 0.2 gave about 85")
    gate_interval_s: float = setting(10.0, "seconds between promotion-gate rounds (each version waits for a verdict)")
    base_sessions: int = setting(0, "sessions policy-v0 serves before the learner starts (0: the learner and the "
                                    "gate start first and the traffic once the learner is ready; the control arm "
                                    "measures the base for the whole run)")
    measure_s: float = setting(150.0, "the final window, the seconds of traffic at the end: the learner and the gate "
                                      "are stopped, the challenger alias is cleared, and the champion and the control "
                                      "serve the same sessions to be compared on")
    final_after_sessions: int = setting(0, "0: the final window starts at minutes*60 - measure_s. n > 0: as soon as a "
                                           "version the learner published has n sessions with an outcome in the lake, "
                                           "at minutes*60 - measure_s at the latest; the learner and the gate stop "
                                           "then, so only a smoke run (learning_claim false) may set it, as the "
                                           "suite's demo test does")
    drain_s: float = setting(25.0, "after traffic stops: seconds for outcomes, lake and episodes to catch up")
    keep_stack: bool = setting(False, "leave running the stack parts the demo started (default: stop "
                                      "everything it started)")
    live: bool = setting(True, "show the rich live view (off: a log line every 30 s)")
    run_id: str = setting("", "name of this run (default: demo-<utc time>)")
    load_policy_v0_weights: bool = setting(False, "start vLLM on base_model and load policy-v0's weights into it (same "
                                                  "architecture) instead of serving the warm model's folder: a shared "
                                                  "stack is not restarted (the swarm integration test)")
    subagent_model: Path | None = setting(None, "swarm: frozen sub-agents (Kimi K2.5's PARL trains the orchestrator "
                                                "only): the model that does the spawned pieces, built by "
                                                "swarm.subagent_model unless current and served by a server of its "
                                                "own; none: the policy does its own pieces")
    subagent_port: int = setting(8010, "port of the frozen sub-agents' server: apart from the tier's (vllm_port and "
                                       "up), whatever its server count")
    scenario: Scenario = setting("tool_use", "tool_use (the default loop) or swarm (infra/demo/swarm.py: the policy "
                                             "decides to spawn sub-agents, summarise or prune; docs/swarm.md); set "
                                             "by the recipe")
    # The processes' own configs, from the recipe (infra/recipes/tool_use.toml unless --recipe names another):
    # the demo renders each child's command from them (to_flags), so `flywheel learner --recipe tool_use` is the
    # demo's learner and `--learner.lr` on the demo is `--lr` on the learner.
    learner: LearnerConfig = field(default_factory=lambda: from_recipe(LearnerConfig, DEFAULT_RECIPE),
                                   metadata={"help": "the learner's config (flywheel learner --help)"})
    gate: GateRule = field(default_factory=lambda: from_recipe(GateRule, DEFAULT_RECIPE),
                           metadata={"help": "the promotion gate's rule (flywheel promote --help)"})

    def check(self) -> None:
        check_choices(self)
        if self.minutes <= 0:
            raise ConfigError(f"minutes: must be > 0, got {self.minutes}")
        if self.concurrency < 1:
            raise ConfigError("concurrency: must be >= 1")
        if not 0 <= self.measure_s < self.minutes * 60:
            raise ConfigError(f"measure_s: must be >= 0 and shorter than the traffic ({self.minutes * 60:.0f} s), "
                              f"got {self.measure_s}")
        if self.final_after_sessions < 0:
            raise ConfigError(f"final_after_sessions: must be >= 0, got {self.final_after_sessions}")
        if self.final_after_sessions and not self.measure_s:
            raise ConfigError("final_after_sessions: starts the final window early, and measure_s is 0 (no window)")
        if self.final_after_sessions and self.learning_claim:
            raise ConfigError("final_after_sessions: stops the learner and the gate at the first published version's "
                              "first sessions, which a run that claims learning cannot do; set learning_claim false")
        if self.vllm_servers < 2:
            raise ConfigError(f"vllm_servers: {self.vllm_servers}; full weights need a server per live version (the "
                              "control and the champion share policy-v0's server until a promotion, a challenger needs "
                              "another; with 2 servers publishing stops at the first promotion)")
        if not 0 <= self.control_share < 1 or not 0 <= self.challenger_share <= 1 - self.control_share:
            raise ConfigError(f"control_share ({self.control_share}) and challenger_share ({self.challenger_share}): "
                              "each must be a share within [0, 1) and the two must sum to at most 1")
        if self.fetch_model:
            from flywheel.models import KNOWN

            if self.fetch_model not in KNOWN:
                raise ConfigError(f"fetch_model: {self.fetch_model!r} is not a known model ({', '.join(KNOWN)})")
            if Path(self.base_model) == Path(defaults.BASE_MODEL_DIR):
                raise ConfigError(f"fetch_model: {self.fetch_model} would be written over the tiny model at "
                                  f"{self.base_model}; set base_model (e.g. {defaults.MODELS_DIR}/{self.fetch_model})")
        if self.warm.lora_rank < 0 or self.warm.max_steps < 1 or self.warm.eval_every < 1:
            raise ConfigError(f"warm: lora_rank must be >= 0, max_steps and eval_every >= 1 (got {self.warm})")
        if ":" not in self.gate_eval_tasks:
            raise ConfigError(f"gate_eval_tasks: {self.gate_eval_tasks!r} is not module:function")
        self.gate.check_rule()
        self.learner.check()
        if self.scenario == "swarm" and self.learner.shaping_anneal_end_step < 1:
            # the swarm's settings are its recipe's: scenario=swarm over the tool-use values never anneals the shaping
            raise ConfigError(f"scenario swarm needs learner.shaping_anneal_end_step >= 1 (got "
                              f"{self.learner.shaping_anneal_end_step}): run it from its recipe, --recipe swarm")
        if self.subagent_model is not None and self.scenario != "swarm":
            raise ConfigError("subagent_model: frozen sub-agents are the swarm scenario's (--recipe swarm)")


SWARM_REWARDS = Path(__file__).with_name("swarm_rewards.toml")
SWARM_MAX_TOKENS = 96  # a spawn of 4 sub-tasks is about 60 tokens of the tiny model's BPE


def scenario_flags(cfg: DemoConfig, process: str) -> list[str]:
    """Flags a scenario adds to the agent's and the episode builder's commands (after the command's own: the last
    of a repeated flag wins); the learner's and the gate's come from the recipe."""
    if cfg.scenario != "swarm":
        return []
    frozen = ["--subagent-model", SUBAGENT_SERVED] if cfg.subagent_model is not None else []
    return {"agent-sim": ["--scenario", "swarm", "--max-tokens", str(SWARM_MAX_TOKENS), *frozen],
            "episodes": ["--rewards-toml", str(SWARM_REWARDS)]}.get(process, [])


# the served name of the frozen sub-agents' model: what the agent asks for, and the proxy's frozen_models key
SUBAGENT_SERVED = "subagent"


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
    def final_window_path(self) -> Path:
        """Written when the final window starts: since, champion, challenger_cleared_at, router_confirmed, early."""
        return self.run_dir / "final_window.json"

    def final_window(self) -> dict[str, Any]:
        """final_window.json's facts; {} when the run had no final window (or has not reached it)."""
        path = self.final_window_path
        return dict(json.loads(path.read_text())) if path.exists() else {}

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
    subagent_url: str = ""  # the frozen sub-agents' server (cfg.subagent_model), "" without one

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
            "FLYWHEEL_CONTROL_VERSION": str(CONTROL_VERSION), "FLYWHEEL_CHALLENGER_SHARE": str(cfg.challenger_share),
            "FLYWHEEL_SPARE_TO_CONTROL": str(cfg.spare_to_control).lower()}


def lake_writer_command(run: RunPlan, ends: Endpoints) -> list[str]:
    return ["lake-writer", "--kafka-bootstrap", ends.kafka_bootstrap, "--events-topic", run.topics["events"],
            "--outcomes-topic", run.topics["outcomes"], "--dlq-topic", run.topics["dlq"],
            "--group-id", f"{run.run_id}-lake", "--lake-root", str(run.lake_root),
            "--roll-max-age-s", "2", "--var-dir", str(run.var_dir)]


def episodes_command(run: RunPlan, ends: Endpoints | None = None) -> list[str]:
    # the shadow judge asks the first server: the publisher keeps policy-v0 (the control's) on the first holder
    judge = ["--judge-url", ends.vllm_url] if ends is not None else []
    return ["episodes", "--lake-root", str(run.lake_root), "--state-dir", str(run.run_dir / "episodes-state"),
            "--follow", "--poll-interval-s", "2", "--var-dir", str(run.var_dir), "--rewards-toml", str(DEMO_REWARDS),
            *judge]


def proxy_command(run: RunPlan, ends: Endpoints) -> list[str]:
    # the prompt text carries the user's request, which the shadow judge reads
    frozen = ["--frozen-models", f"{SUBAGENT_SERVED}={ends.subagent_url}"] if ends.subagent_url else []
    return ["proxy", "--port", str(ends.proxy_port), "--upstream", ends.vllm_url,
            "--kafka-bootstrap", ends.kafka_bootstrap,
            "--events-topic", run.topics["events"], "--router", "serving", "--spool-name", f"{run.run_id}-proxy",
            "--log-prompt-text", *frozen]


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
    """The learner's own config (the recipe's, with the demo's changes), with this run's paths and endpoints."""
    learner = dataclasses.replace(
        cfg.learner, lake_root=str(run.lake_root), base_model=str(policy_v0(cfg).resolve()),
        run_dir=str(run.learner_dir),
        policies_dir=str(run.policies_dir), vllm_url=ends.vllm_url, registered_model=run.registered_model,
        mlflow_tracking_uri=ends.tracking_uri, experiment=f"{run.run_id}-learner", var_dir=str(run.var_dir))
    return ["learner", *to_flags(learner)]


def promote_command(cfg: DemoConfig, run: RunPlan, ends: Endpoints) -> list[str]:
    """The gate: its rule is the demo's `gate` section, the tier this run's."""
    return ["promote", "--auto", "--interval-s", str(cfg.gate_interval_s),
            "--servers", ",".join(ends.vllm_urls), "--base-model", str(policy_v0(cfg).resolve()),
            "--policies-dir", str(run.policies_dir), "--registered-model", run.registered_model,
            "--mlflow-tracking-uri", ends.tracking_uri, "--lake-root", str(run.lake_root),
            "--control-share", str(cfg.control_share), "--control-version", str(CONTROL_VERSION),
            "--challenger-share", str(cfg.challenger_share), *to_flags(cfg.gate),
            "--eval-tasks", cfg.gate_eval_tasks,
            "--experiment", f"{run.run_id}-promotion", "--var-dir", str(run.var_dir)]
