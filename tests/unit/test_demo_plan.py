"""The demo's plan: each process's command is one its sub-command accepts, and carries the demo's settings."""

from __future__ import annotations

import calendar
import dataclasses
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from flywheel.base.config import SHARED_FIELDS, ConfigError, build_parser, from_recipe, process_parser, resolve
from flywheel.cli import COMMANDS
from flywheel.demo import plan as demo_plan
from flywheel.demo.agent_sim import AgentSimConfig
from flywheel.demo.outcome_sim import OutcomeSimConfig
from flywheel.demo.plan import DemoConfig, Endpoints, RunPlan
from flywheel.ingest.lake_writer import LakeWriterConfig
from flywheel.learner.config import LearnerConfig
from flywheel.learner.versions import serving_tier
from flywheel.rewards.builder import EpisodesConfig
from flywheel.serving.decision import GateRule
from flywheel.serving.promote import PromoteConfig
from flywheel.serving.proxy import ProxyConfig
from flywheel.serving.router import RouterConfig

SERVERS = ["http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://127.0.0.1:8002"]
ENDS = Endpoints(kafka_bootstrap="127.0.0.1:19092", vllm_url=SERVERS[0], tracking_uri="http://127.0.0.1:5000",
                 proxy_port=8123, vllm_urls=SERVERS)


def _parse(cls: type, argv: list[str]) -> Any:
    """argv as the sub-command's own config reads it (an unknown flag exits, as the process would)."""
    args = build_parser(cls, "test", "test").parse_args(argv)
    return resolve(cls, {}, {}, {k: v for k, v in vars(args).items() if k not in ("config", "recipe")})


def _plan(tmp_path: Path, learner: dict[str, Any] | None = None, gate: dict[str, Any] | None = None,
          **changes: Any) -> tuple[DemoConfig, RunPlan]:
    """The default demo (the tool_use recipe) with `changes`, and `learner` / `gate` changes in those sections."""
    tuned = DemoConfig()
    cfg = DemoConfig(var_dir=tmp_path / "var", base_model=tmp_path / "base", warm_model=tmp_path / "warm",
                     run_id="demo-t", learner=dataclasses.replace(tuned.learner, **(learner or {})),
                     gate=dataclasses.replace(tuned.gate, **(gate or {})), **changes)
    return cfg, demo_plan.plan_run(cfg, time.time())


def test_a_run_keeps_its_state_and_names_under_its_run_id(tmp_path: Path) -> None:
    cfg, run = _plan(tmp_path, minutes=2.5)
    assert run.run_dir == tmp_path / "var" / "demo" / "demo-t"
    for path in (run.lake_root, run.policies_dir, run.learner_dir, run.log_dir, run.handoff):
        assert path.parent == run.run_dir, f"{path} is outside the run's folder {run.run_dir}"
    assert run.topics == {"events": "demo-t.events", "outcomes": "demo-t.outcomes", "dlq": "demo-t.dlq"}
    assert run.registered_model == "flywheel-demo-t"
    assert run.traffic_s == 150.0
    unnamed = demo_plan.plan_run(DemoConfig(var_dir=tmp_path), calendar.timegm((2024, 5, 6, 7, 8, 9, 0, 0, 0)))
    assert unnamed.run_id == "demo-20240506-070809", unnamed.run_id


def test_policy_v0_is_the_warm_model_unless_warm_start_is_off(tmp_path: Path) -> None:
    assert demo_plan.policy_v0(DemoConfig(warm_model=tmp_path / "w", base_model=tmp_path / "b")) == tmp_path / "w"
    assert demo_plan.policy_v0(DemoConfig(warm_model=tmp_path / "w", base_model=tmp_path / "b", warm_start=False)) == tmp_path / "b"


def test_every_command_is_a_flywheel_sub_command_its_config_accepts(tmp_path: Path) -> None:
    cfg, run = _plan(tmp_path)
    commands = [(LakeWriterConfig, demo_plan.lake_writer_command(run, ENDS)),
                (EpisodesConfig, demo_plan.episodes_command(run)),
                (ProxyConfig, demo_plan.proxy_command(run, ENDS)),
                (OutcomeSimConfig, demo_plan.outcome_sim_command(run, ENDS)),
                (AgentSimConfig, demo_plan.agent_sim_command(cfg, run, ENDS)),
                (LearnerConfig, demo_plan.learner_command(cfg, run, ENDS)),
                (PromoteConfig, demo_plan.promote_command(cfg, run, ENDS))]
    for cls, argv in commands:
        assert argv[0] in COMMANDS, f"{argv[0]!r} is not a flywheel sub-command"
        assert all(isinstance(a, str) for a in argv), f"{argv[0]}: non-string arguments in {argv}"
        _parse(cls, argv[1:])
    env = demo_plan.tier_env(cfg, run, ENDS)
    not_shared = sorted(k for k in env if k.removeprefix("FLYWHEEL_").lower() not in SHARED_FIELDS)
    assert not not_shared, f"tier_env sets {not_shared}, which no process reads flat (flywheel.base.config)"
    router = resolve(RouterConfig, {}, env, {})
    assert (router.servers, router.registered_model, router.policies_dir) == \
        (SERVERS, run.registered_model, str(run.policies_dir)), router
    assert (router.control_share, router.control_version, router.challenger_share) == (0.2, 0, 0.4), router


def test_the_learners_publisher_sees_the_same_tier_as_the_router_and_the_gate(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, run = _plan(tmp_path, control_share=0.15, challenger_share=0.35)
    for key, value in demo_plan.tier_env(cfg, run, ENDS).items():
        monkeypatch.setenv(key, value)  # the learner's environment (closed_loop starts it with tier_env)
    learner = _parse(LearnerConfig, demo_plan.learner_command(cfg, run, ENDS)[1:])
    tier = serving_tier(learner)
    gate = _parse(PromoteConfig, demo_plan.promote_command(cfg, run, ENDS)[1:])
    seen = {name: (t.servers, t.control_share, t.control_version, t.challenger_share, t.registered_model)
            for name, t in (("learner", tier), ("gate", gate))}
    assert seen["learner"] == seen["gate"] == (SERVERS, 0.15, 0, 0.35, run.registered_model), seen
    # with the control arm, the publisher keeps the control's server: policy-v0 stays live beside a champion
    assert tier.live_versions(3, None) == {0, 3}, tier.live_versions(3, None)


def test_the_pipeline_processes_share_this_runs_topics_lake_and_heartbeats(tmp_path: Path) -> None:
    cfg, run = _plan(tmp_path)
    writer = _parse(LakeWriterConfig, demo_plan.lake_writer_command(run, ENDS)[1:])
    assert (writer.kafka_bootstrap, writer.events_topic, writer.outcomes_topic, writer.dlq_topic, writer.group_id) == \
        (ENDS.kafka_bootstrap, "demo-t.events", "demo-t.outcomes", "demo-t.dlq", "demo-t-lake"), writer
    assert (writer.lake_root, writer.roll_max_age_s, writer.var_dir) == (str(run.lake_root), 2.0, str(run.var_dir)), writer
    episodes = _parse(EpisodesConfig, demo_plan.episodes_command(run)[1:])
    assert (episodes.lake_root, episodes.follow, episodes.poll_interval_s) == (str(run.lake_root), True, 2.0), episodes
    proxy = _parse(ProxyConfig, demo_plan.proxy_command(run, ENDS)[1:])
    assert (proxy.port, proxy.upstream, proxy.events_topic, proxy.router) == (8123, ENDS.vllm_url, "demo-t.events", "serving")
    agent = _parse(AgentSimConfig, demo_plan.agent_sim_command(cfg, run, ENDS)[1:])
    # the duration is a cap: the demo stops the agent when the final window has had its measure_s
    assert (agent.proxy_url, agent.events_topic, agent.concurrency, agent.duration_s, agent.multi_share, agent.handoff) == \
        ("http://127.0.0.1:8123", "demo-t.events", 3, cfg.minutes * 60 + 600.0, 0.1, run.handoff), agent
    assert agent.tokenizer == str((tmp_path / "warm").resolve()), agent.tokenizer
    outcomes = _parse(OutcomeSimConfig, demo_plan.outcome_sim_command(run, ENDS)[1:])
    assert (outcomes.outcomes_topic, outcomes.handoff, outcomes.var_dir) == ("demo-t.outcomes", run.handoff, run.var_dir)


def test_the_learner_and_gate_carry_the_demos_measured_defaults(tmp_path: Path) -> None:
    cfg, run = _plan(tmp_path)
    learner = _parse(LearnerConfig, demo_plan.learner_command(cfg, run, ENDS)[1:])
    assert (learner.mode, learner.lr, learner.batch_size, learner.min_batch, learner.micro_batch) == \
        ("full", 4e-4, 64, 64, 32), learner
    assert (learner.cpu_threads, learner.newest_first, learner.loss_agg, learner.kl_coef, learner.baseline) == \
        (1, True, "sequence", 0.1, "batch"), learner
    assert learner.kl_rows == "all", "the KL holds the rows positive-only skips (add/mul's calls) too"
    assert (learner.positive_only, learner.max_staleness_steps, learner.epochs, learner.loss) == (True, 60, 1, "tis"), learner
    assert (learner.publish_every_steps, learner.publish_wait_for_gate, learner.publish_every_s, learner.publish_supersede_s) == \
        (20, True, 0.0, 420.0), learner
    assert (learner.base_model, learner.lake_root, learner.policies_dir, learner.registered_model) == \
        (str((tmp_path / "warm").resolve()), str(run.lake_root), str(run.policies_dir), "flywheel-demo-t"), learner
    gate = _parse(PromoteConfig, demo_plan.promote_command(cfg, run, ENDS)[1:])
    assert (gate.auto, gate.interval_s, gate.eval_tasks) == (True, 10.0, "flywheel.demo.tasks:eval_tasks"), gate
    assert (gate.alpha, gate.tau, gate.margin, gate.min_sessions, gate.max_sessions, gate.maturity_s) == \
        (0.05, 0.1, 0.0, 30, 240, 10.0), gate
    assert (gate.test, gate.looks, gate.spending, gate.look_sizes()) == ("group-sequential", 3, "obf", [80, 160, 240]), gate
    assert (gate.servers, gate.policies_dir, gate.registered_model, gate.lake_root) == \
        (SERVERS, str(run.policies_dir), "flywheel-demo-t", str(run.lake_root)), gate
    assert (gate.control_share, gate.control_version, gate.challenger_share) == (0.2, 0, 0.4), gate


def test_the_gate_runs_exactly_the_demos_rule(tmp_path: Path) -> None:
    cfg, run = _plan(tmp_path, gate=dict(alpha=0.01, tau=0.2, margin=0.02, min_sessions=40, max_sessions=700,
                                         maturity_s=15.0, test="msprt", looks=5, spending="pocock"))
    rule = cfg.gate
    gate = _parse(PromoteConfig, demo_plan.promote_command(cfg, run, ENDS)[1:])
    differ = {f.name: (getattr(gate, f.name), getattr(rule, f.name)) for f in dataclasses.fields(GateRule)
              if getattr(gate, f.name) != getattr(rule, f.name)}
    assert not differ, f"the gate's rule differs from the demo's (gate, demo): {differ}"
    assert (rule.alpha, rule.tau, rule.margin, rule.min_sessions, rule.max_sessions, rule.maturity_s) == \
        (0.01, 0.2, 0.02, 40, 700, 15.0), rule
    assert (rule.test, rule.looks, rule.spending) == ("msprt", 5, "pocock"), rule


@pytest.mark.parametrize("changes, field", [({"vllm_servers": 1}, "vllm_servers"), ({"control_share": 0.7}, "control_share"),
                                            ({"gate": {"alpha": 0.7}}, "alpha"), ({"gate": {"max_sessions": 10}}, "max_sessions"),
                                            ({"gate": {"test": "t-test"}}, "test"), ({"gate": {"spending": "x"}}, "spending"),
                                            ({"gate": {"looks": 9}}, "looks"), ({"learner": {"loss": "x"}}, "loss"),
                                            ({"scenario": "swarm"}, "--recipe swarm")])
def test_a_demo_config_that_cannot_run_is_refused_naming_the_field(tmp_path: Path, changes: dict[str, Any],
                                                                   field: str) -> None:
    cfg, _ = _plan(tmp_path, **changes)
    with pytest.raises(ConfigError, match=field):
        cfg.check()


def test_endpoints_list_every_server_with_the_first_as_vllm_url() -> None:
    one = Endpoints("127.0.0.1:1", "http://a", "sqlite:///x.db", 1)
    assert one.vllm_urls == ["http://a"], one
    with pytest.raises(AssertionError, match="not the first"):
        Endpoints("127.0.0.1:1", "http://a", "sqlite:///x.db", 1, vllm_urls=["http://b", "http://a"])


@pytest.mark.parametrize("epochs, loss", [(1, "tis"), (2, "ppo")])
def test_learner_switches_toggles_and_loss_with_the_config(tmp_path: Path, epochs: int, loss: str) -> None:
    cfg, run = _plan(tmp_path, learner=dict(epochs=epochs, loss=loss, positive_only=False, publish_wait_for_gate=False,
                                            batch_size=16, min_batch=16, micro_batch=16), warm_start=False)
    learner = _parse(LearnerConfig, demo_plan.learner_command(cfg, run, ENDS)[1:])
    assert (learner.epochs, learner.loss, learner.positive_only, learner.publish_wait_for_gate) == (epochs, loss, False, False)
    assert (learner.batch_size, learner.micro_batch, learner.base_model) == (16, 16, str((tmp_path / "base").resolve()))


def test_the_demo_renders_the_learner_and_the_gate_from_their_own_configs(tmp_path: Path) -> None:
    """Every field of the learner's and the gate's config reaches the process as the demo holds it: the command
    is rendered from the config (to_flags), not written out flag by flag, so no knob can be left behind."""
    for recipe in ("tool_use", "swarm"):
        cfg = dataclasses.replace(from_recipe(DemoConfig, recipe), var_dir=tmp_path / "var", run_id="demo-t")
        run = demo_plan.plan_run(cfg, time.time())
        learner = _parse(LearnerConfig, demo_plan.learner_command(cfg, run, ENDS)[1:])
        own = {"lake_root", "base_model", "run_dir", "policies_dir", "vllm_url", "registered_model",
               "mlflow_tracking_uri", "experiment", "var_dir"}  # this run's paths and endpoints
        differ = {f.name: (getattr(learner, f.name), getattr(cfg.learner, f.name))
                  for f in dataclasses.fields(LearnerConfig) if f.name not in own
                  and getattr(learner, f.name) != getattr(cfg.learner, f.name)}
        assert not differ, f"{recipe}: the learner's command differs from the demo's learner config: {differ}"
        assert learner == from_recipe(LearnerConfig, recipe, **{k: getattr(learner, k) for k in own}), recipe
        gate = _parse(PromoteConfig, demo_plan.promote_command(cfg, run, ENDS)[1:])
        assert all(getattr(gate, f.name) == getattr(cfg.gate, f.name) for f in dataclasses.fields(GateRule)), recipe
        assert GateRule(**{f.name: getattr(gate, f.name) for f in dataclasses.fields(GateRule)}) == \
            from_recipe(GateRule, recipe), recipe


def _help_defaults(cls: type, argv: list[str], prefix: str = "") -> dict[str, str]:
    """field -> the default its `--help` line prints (from the parser the process parses argv with)."""
    parser, _ = process_parser(cls, argv, "flywheel test")
    found = {}
    for action in parser._actions:
        default = re.search(r"\(default: (.*?)(?:; one of|; env|; no env)", action.help or "")
        if default and action.dest.startswith(prefix) and action.dest not in ("config", "recipe"):
            found[action.dest[len(prefix):]] = default.group(1)
    return found


def test_learner_help_with_a_recipe_shows_the_demos_defaults_for_every_knob() -> None:
    """`flywheel learner --recipe R --help` and `flywheel demo --recipe R --help` print the same default for each
    learner knob (and the gate's for promote): one declaration, one recipe."""
    for recipe in ("tool_use", "swarm"):
        demo_learner = _help_defaults(DemoConfig, ["--recipe", recipe], "learner.")
        learner = _help_defaults(LearnerConfig, ["--recipe", recipe])
        assert demo_learner and demo_learner == {k: v for k, v in learner.items() if k in demo_learner}, recipe
        assert set(learner) == set(demo_learner) == {f.name for f in dataclasses.fields(LearnerConfig)}, recipe
        assert demo_learner["lr"] == "0.0004" and demo_learner["positive_only"] == "True", recipe
        demo_gate = _help_defaults(DemoConfig, ["--recipe", recipe], "gate.")
        promote = _help_defaults(PromoteConfig, ["--recipe", recipe])
        assert demo_gate and demo_gate == {k: promote[k] for k in demo_gate}, recipe
    assert _help_defaults(LearnerConfig, [])["lr"] == "0.0001", "without a recipe the learner keeps its own defaults"


def test_the_default_demo_is_its_recipe() -> None:
    """`flywheel demo` and `flywheel demo --recipe tool_use` run the same config: the recipe is the default."""
    assert DemoConfig() == from_recipe(DemoConfig, demo_plan.DEFAULT_RECIPE)


def test_the_live_views_lake_scan_never_holds_up_the_traffic_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan takes about a minute beside the learner and vLLM late in a run: it runs in the background, and the
    loop's checks (final window, end of traffic) read the last result at once."""
    import threading

    from flywheel.demo import closed_loop

    release = threading.Event()
    scans: list[float] = []

    def slow_scan(_root: Path, _since: float) -> dict[int, tuple[int, int]]:
        scans.append(time.time())
        release.wait(10)
        return {1: (10, 7)}

    monkeypatch.setattr(closed_loop, "success_by_version", slow_scan)
    cfg, run = _plan(tmp_path)
    traffic = closed_loop.Traffic(cfg, run, ENDS, closed_loop.Processes(tmp_path / "logs"), time.time())
    t0 = time.time()
    assert traffic.success_now() == {} and traffic.success_now() == {}, "no result before the first scan ends"
    assert time.time() - t0 < 1.0 and len(scans) == 1, "one scan at a time, and the caller does not wait for it"
    release.set()
    assert traffic._scanning is not None
    traffic._scanning.join(5)
    assert traffic.success_now() == {1: (10, 7)} and len(scans) == 1, "the next scan waits SCAN_EVERY_S"


def test_final_after_sessions_starts_the_final_window_once_a_published_version_has_its_sessions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's short run ends its training on an event, not the clock: tick() starts the final window once a
    version the learner published has final_after_sessions sessions in the lake; policy-v0's never count, and
    nothing starts it before the learner runs."""
    from flywheel.demo import closed_loop

    class Agent:
        def poll(self) -> None:
            return None  # still running

    class Procs:
        procs = {"agent-sim": Agent()}

        def dead(self) -> list[tuple[str, int]]:
            return []

    monkeypatch.setattr(closed_loop, "read_statuses", lambda _var: {"agent-sim": {"sessions": 0}})
    cfg, run = _plan(tmp_path, final_after_sessions=3, learning_claim=False)
    cfg.check()
    traffic = closed_loop.Traffic(cfg, run, ENDS, Procs(), time.time())  # type: ignore[arg-type]
    started: list[tuple[int, int] | None] = []

    def start_final_window(early: tuple[int, int] | None = None) -> None:
        started.append(early)
        traffic.final_since = time.time()

    monkeypatch.setattr(traffic, "start_training", lambda: setattr(traffic, "training", True))
    monkeypatch.setattr(traffic, "start_final_window", start_final_window)
    traffic._success_at = time.time()  # no background scan: the test sets what the last one found
    traffic._success = {0: (40, 20), 1: (5, 1)}
    assert traffic.new_version_served() is None, "before the learner starts there is nothing to wait for"
    assert traffic.tick() and traffic.training and not started, "the first tick starts the learner, not the window"
    traffic._success = {0: (40, 20), 1: (2, 1)}
    assert traffic.tick() and not started, "v1 has 2 sessions of 3; policy-v0's 40 do not count"
    traffic._success = {0: (40, 20), 1: (3, 0), 2: (4, 1)}
    assert traffic.tick() and started == [(2, 4)], f"v1 and v2 have their sessions: {started}"
    assert traffic.new_version_served() is None, "once the window began there is nothing to wait for"

    off = closed_loop.Traffic(_plan(tmp_path)[0], run, ENDS, Procs(), time.time())  # type: ignore[arg-type]
    off.training, off._success_at, off._success = True, time.time(), {1: (50, 10)}
    assert off.new_version_served() is None, "final_after_sessions 0 (the default): the clock decides"


def test_final_after_sessions_scans_the_lake_more_often_only_while_it_waits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flywheel.demo import closed_loop

    scans: list[float] = []

    def scan(_root: Path, _since: float) -> dict[int, tuple[int, int]]:
        scans.append(time.time())
        return {}

    monkeypatch.setattr(closed_loop, "success_by_version", scan)
    monkeypatch.setattr(closed_loop, "EARLY_SCAN_EVERY_S", 0.0)
    cfg, run = _plan(tmp_path, final_after_sessions=3, learning_claim=False)
    traffic = closed_loop.Traffic(cfg, run, ENDS, closed_loop.Processes(tmp_path / "logs"), time.time())
    traffic.training = True

    def look() -> None:
        traffic.success_now()
        assert traffic._scanning is not None
        traffic._scanning.join(5)

    look()
    look()
    assert len(scans) == 2, "waiting: EARLY_SCAN_EVERY_S (0 here) between scans"
    traffic.final_since = time.time()
    look()
    assert len(scans) == 2, "the window began: back to SCAN_EVERY_S"


def test_final_after_sessions_is_for_a_smoke_run_with_a_final_window(tmp_path: Path) -> None:
    cfg, _ = _plan(tmp_path, final_after_sessions=3, learning_claim=False)
    cfg.check()
    with pytest.raises(ConfigError, match="learning_claim"):
        dataclasses.replace(cfg, learning_claim=True).check()
    with pytest.raises(ConfigError, match="must be >= 0"):
        dataclasses.replace(cfg, final_after_sessions=-1).check()
    with pytest.raises(ConfigError, match="measure_s is 0"):
        dataclasses.replace(cfg, measure_s=0.0).check()


def test_the_smollm2_recipe_is_a_real_model_in_lora_mode_that_claims_no_learning(tmp_path: Path) -> None:
    cfg = from_recipe(DemoConfig, "smollm2")
    cfg.check()
    from flywheel.models import KNOWN

    assert cfg.fetch_model in KNOWN and cfg.base_model == Path("var/models/smollm2-135m-instruct")
    assert cfg.learner.mode == "lora" and cfg.warm.lora_rank > 0 and cfg.learning_claim is False
    assert cfg.learner.parity_samples == 0, "vLLM 0.32's CPU LoRA path dies on batched prompt_logprobs"
    run = demo_plan.plan_run(dataclasses.replace(cfg, var_dir=tmp_path, run_id="demo-s"), time.time())
    gate = demo_plan.promote_command(cfg, run, ENDS)
    assert gate[gate.index("--eval-tasks") + 1] == "flywheel.demo.tasks:eval_tasks_16"
    with pytest.raises(ConfigError, match="fetch_model"):
        dataclasses.replace(cfg, fetch_model="gpt-9").check()
    with pytest.raises(ConfigError, match="over the tiny model"):
        dataclasses.replace(cfg, base_model=DemoConfig().base_model).check()


def _stack_fakes(monkeypatch: pytest.MonkeyPatch, build: Any) -> list[str]:
    """closed_loop's set-up with its model builds and its stack replaced by recorders: the order of events."""
    from flywheel.demo import closed_loop

    events: list[str] = []

    def start_stack(cfg: DemoConfig, plan: RunPlan, on_base: bool = False,
                    with_vllm: bool = True) -> tuple[Any, list[str], Endpoints]:
        if not with_vllm:
            events.append("kafka and mlflow up")
            return object(), ["kafka", "mlflow"], ENDS
        up_already = "kafka and mlflow up" in events  # ensure_up starts only what is not healthy
        events.append(f"stack up on_base={on_base}")
        return object(), ["vllm"] if up_already else ["kafka", "mlflow", "vllm"], ENDS

    monkeypatch.setattr(closed_loop, "ensure_base", lambda cfg: events.append("base"))
    monkeypatch.setattr(closed_loop, "warm_start_build", lambda cfg: build)
    monkeypatch.setattr(closed_loop, "start_stack", start_stack)
    monkeypatch.setattr(closed_loop, "load_policy_v0", lambda cfg, scfg: events.append("policy-v0 loaded"))
    import flywheel.stack

    monkeypatch.setattr(flywheel.stack, "down", lambda scfg, parts: events.append(f"down {parts}"))
    return events


@pytest.mark.parametrize("beside", [True, False], ids=["cores-for-both", "two-cores"])
def test_a_warm_start_to_build_runs_beside_the_stacks_start_and_policy_v0_is_served_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, beside: bool) -> None:
    """The stack comes up while the warm start trains (not after it). With cores for both, the servers start then too,
    on the base, and get policy-v0's weights once the build has finished; without, Kafka and MLflow start beside the
    build and the servers after it, on policy-v0 (loaded by ensure_stack, inside the fake start_stack here)."""
    import threading

    from flywheel.demo import closed_loop

    stack_is_up = threading.Event()
    events: list[str] = []

    def build() -> dict[str, Any]:
        assert stack_is_up.wait(10), "the stack did not start while the warm start was being built"
        events.append("warm built")
        return {"steps": 600, "final_success": 0.1}

    recorded = _stack_fakes(monkeypatch, build)
    original = closed_loop.start_stack

    def start_stack(cfg: DemoConfig, plan: RunPlan, on_base: bool = False,
                    with_vllm: bool = True) -> tuple[Any, list[str], Endpoints]:
        out = original(cfg, plan, on_base, with_vllm)
        stack_is_up.set()
        return out

    monkeypatch.setattr(closed_loop, "start_stack", start_stack)
    monkeypatch.setattr(closed_loop, "servers_beside_build", lambda cfg: beside)
    cfg, run = _plan(tmp_path)
    warm, _, started, ends = closed_loop.models_and_stack(cfg, run)
    assert warm["steps"] == 600 and ends == ENDS
    order = [e for e in recorded if e != "base"]
    if beside:
        assert started == ["kafka", "mlflow", "vllm"] and order == ["stack up on_base=True", "policy-v0 loaded"], order
    else:
        assert order == ["kafka and mlflow up", "stack up on_base=False"], order
        assert started == ["kafka", "mlflow", "vllm"], started
    assert events == ["warm built"]


def test_the_servers_start_beside_the_build_only_where_each_has_cores_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flywheel.demo import closed_loop, warm_start

    cfg, _ = _plan(tmp_path)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert not closed_loop.servers_beside_build(cfg)
    monkeypatch.setattr(os, "cpu_count", lambda: warm_start.THREADS + cfg.vllm_servers)
    assert closed_loop.servers_beside_build(cfg)


def test_a_warm_start_already_built_serves_policy_v0_directly_and_a_failed_build_stops_the_stack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flywheel.demo import closed_loop

    cfg, run = _plan(tmp_path)
    warm_dir = tmp_path / "warm"
    warm_dir.mkdir()
    (warm_dir / "warm_start.json").write_text('{"steps": 600}')
    cfg = dataclasses.replace(cfg, warm_model=warm_dir, warm_start=True)
    events = _stack_fakes(monkeypatch, None)
    assert closed_loop.models_and_stack(cfg, run)[0] == {"steps": 600}
    assert events == ["base", "stack up on_base=False"], "a current warm start: the servers start on policy-v0"

    def broken() -> dict[str, Any]:
        raise RuntimeError("warm start out of its band")

    for beside, first, parts in ((True, "stack up on_base=True", "['kafka', 'mlflow', 'vllm']"),
                                 (False, "kafka and mlflow up", "['kafka', 'mlflow']")):
        events = _stack_fakes(monkeypatch, broken)
        monkeypatch.setattr(closed_loop, "servers_beside_build", lambda cfg, beside=beside: beside)
        with pytest.raises(RuntimeError, match="out of its band"):
            closed_loop.models_and_stack(cfg, run)
        assert events == ["base", first, f"down {parts}"], events


def test_the_final_window_stops_the_learner_and_the_gate_together_and_waits_for_the_learners_stopped_heartbeat(
        tmp_path: Path) -> None:
    """terminate signals without waiting; wait_until returns when the heartbeat-like condition holds (a process still
    exiting is not waited for) or when the process exits, and False after its timeout."""
    import subprocess
    import sys

    from flywheel.demo import closed_loop

    procs = closed_loop.Processes(tmp_path / "logs")
    stopped = tmp_path / "stopped"
    # exits 3 s after SIGTERM, having said "stopped" at once: the learner's slow interpreter exit of run 9
    code = ("import signal, time, pathlib, sys\n"
            "def on(*_): pathlib.Path(sys.argv[1]).write_text('x'); time.sleep(3); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, on)\n"
            "time.sleep(60)\n")
    for name in ("learner", "promote"):
        procs.procs[name] = subprocess.Popen([sys.executable, "-c", code, str(stopped) + name], start_new_session=True)
    time.sleep(1.0)  # the handlers are installed
    t0 = time.time()
    procs.terminate("learner")
    procs.terminate("promote")
    assert time.time() - t0 < 0.5, "terminate does not wait"
    assert procs.wait_until("learner", lambda: (tmp_path / "stoppedlearner").exists(), timeout_s=10)
    assert time.time() - t0 < 2.5 and procs.procs["learner"].poll() is None, "its exit was not waited for"
    assert procs.stop("promote", timeout_s=10) == 0 and time.time() - t0 < 5, "both were stopping at once"
    assert procs.wait_until("learner", lambda: False, timeout_s=10), "an exit ends the wait too"
    assert not procs.dead(), "stopped on purpose, not dead"
    procs.procs["sleeper"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                              start_new_session=True)
    assert not procs.wait_until("sleeper", lambda: False, timeout_s=0.5)
    procs.stop("sleeper", timeout_s=5)


def test_frozen_sub_agents_reach_the_agent_and_the_proxy_as_flags_they_accept(tmp_path: Path) -> None:
    """The swarm recipe's frozen sub-agents: the agent asks for SUBAGENT_SERVED for a child's calls, and the proxy
    sends that name to the sub-agents' server; without one (the tool-use demo) neither flag is there."""
    swarm_cfg = dataclasses.replace(from_recipe(DemoConfig, "swarm"), var_dir=tmp_path / "var", run_id="demo-s")
    swarm_cfg.check()
    assert swarm_cfg.subagent_model == Path("var/models/tiny-swarm-subagent")
    run = demo_plan.plan_run(swarm_cfg, time.time())
    ends = dataclasses.replace(ENDS, subagent_url="http://127.0.0.1:8003")
    proxy = _parse(ProxyConfig, demo_plan.proxy_command(run, ends)[1:])
    from flywheel.serving.proxy import parse_frozen_models

    assert parse_frozen_models(proxy.frozen_models) == {demo_plan.SUBAGENT_SERVED: "http://127.0.0.1:8003"}
    agent_argv = demo_plan.agent_sim_command(swarm_cfg, run, ends) + demo_plan.scenario_flags(swarm_cfg, "agent-sim")
    assert _parse(AgentSimConfig, agent_argv[1:]).subagent_model == demo_plan.SUBAGENT_SERVED
    cfg, plain = _plan(tmp_path)
    assert "--frozen-models" not in demo_plan.proxy_command(plain, ENDS)
    assert "--subagent-model" not in demo_plan.agent_sim_command(cfg, plain, ENDS) + demo_plan.scenario_flags(cfg, "agent-sim")
    with pytest.raises(ConfigError, match="swarm"):
        dataclasses.replace(cfg, subagent_model=tmp_path / "sub").check()
    for bad in ("subagent", "subagent=127.0.0.1:8003", "=http://h:1"):
        with pytest.raises(ConfigError, match="frozen_models"):
            parse_frozen_models(bad)
