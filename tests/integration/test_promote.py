"""The promotion gate, rollback and status against the real MLflow registry and vLLM (LoRA versions).

Online outcomes come from a tmp lake of synthetic sessions (events with the router's arm and the
verifier's task_success, in the lake writer's exact schema and file layout); offline scores from a
small arithmetic set run through vLLM. Each test has its own
registered model, experiment and policy version numbers.
"""

from __future__ import annotations

import datetime as dt
import random
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from bench.fixtures import models as synthetic
from bench.fixtures.sessions import write_arm_sessions
from flywheel.base import tracking
from flywheel.serving import evaluate, promote, publisher, vllm_client
from flywheel.serving.registry import Registry
from flywheel.serving.router import Router, bucket
from flywheel.serving.vllm_client import http

TASKS = evaluate.arithmetic_tasks(n=8)


@pytest.fixture
def cfg(vllm_url: str, mlflow_uri: str, base_model_dir: Path, tmp_path: Path) -> Iterator[promote.PromoteConfig]:
    tag = uuid.uuid4().hex[:10]
    config = promote.PromoteConfig(servers=[vllm_url], mlflow_tracking_uri=mlflow_uri, base_model=str(base_model_dir),
                                   policies_dir=str(tmp_path), registered_model=f"test-gate-{tag}",
                                   experiment=f"test-gate-{tag}", lake_root=str(tmp_path / "lake"), min_sessions=30,
                                   alias_refresh_s=1.0, challenger_share=0.5,
                                   # the gate's mechanics on a few dozen sessions, which cannot show a guardrail
                                   # within its margin: the guardrails' own test is below (and in tests/unit)
                                   guardrails={})
    yield config
    resident = set(vllm_client.served_models(vllm_url))
    for rv in Registry(mlflow_uri, config.registered_model).versions():
        if f"policy-v{rv.policy_version}" in resident:
            http("POST", f"{vllm_url}/v1/unload_lora_adapter", {"lora_name": f"policy-v{rv.policy_version}"})


def _publish(cfg: promote.PromoteConfig, base: Path, tmp_path: Path, seed: int) -> int:
    v = random.randint(7_000_000, 7_999_999)
    publisher.publish(synthetic.make_lora_version(base, tmp_path / f"policy-v{v}", v, seed=seed), cfg)
    return v


def _rates(rate: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [float(rng.random() < rate) for _ in range(n)]


def _served_gap(server: str, model: str, base: Path, version_dir: Path) -> float:
    """Largest gap between the server's greedy-decoded logprobs and the version's own weights."""
    prompt = [5, 17, 33, 60, 61, 62, 100, 7]
    out = http("POST", f"{server}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                    "logprobs": 1, "return_token_ids": True, "ignore_eos": True})
    choice = out["choices"][0]
    ref = synthetic.reference_logprobs(synthetic.load_reference(base, version_dir), prompt, choice["token_ids"])
    return max(abs(x - y) for x, y in zip(choice["logprobs"]["token_logprobs"], ref))


def _runs(cfg: promote.PromoteConfig) -> list[dict[str, str]]:
    client = tracking.client(cfg.mlflow_tracking_uri)
    runs = client.search_runs([tracking.experiment_id(cfg.experiment, cfg.mlflow_tracking_uri)])
    return [dict(r.data.tags) | {"metrics": r.data.metrics} for r in runs]


def test_gate_promotes_rejects_and_holds_with_decisions_in_mlflow(cfg: promote.PromoteConfig, base_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    registry = Registry(cfg.mlflow_tracking_uri, cfg.registered_model)
    a = _publish(cfg, base_model_dir, tmp_path, 1)
    registry.make_champion(a)
    b = _publish(cfg, base_model_dir, tmp_path, 2)
    write_arm_sessions(cfg.lake_root, a, "champion", _rates(0.3, 60, 1))
    write_arm_sessions(cfg.lake_root, b, "challenger", _rates(0.8, 60, 2))

    decision = promote.gate_once(cfg, registry, tasks=TASKS)[0]
    assert decision.action == "promote", decision.reason
    assert registry.aliases() == {"champion": b}, registry.aliases()
    assert registry.find(b).tags["gate_decision"] == "promote"
    assert "offline_challenger" in decision.numbers, "the offline eval ran through vLLM for both versions"

    c = _publish(cfg, base_model_dir, tmp_path, 3)  # clearly worse online
    # b's sessions as champion, concurrent with c's and after b became champion (the sessions that
    # promoted it were its challenger sessions); the gate looks 10 minutes later, when they are mature
    after = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=1)
    write_arm_sessions(cfg.lake_root, b, "champion", _rates(0.8, 60, 31), start=after)
    write_arm_sessions(cfg.lake_root, c, "challenger", _rates(0.2, 60, 3), start=after)
    decision = promote.gate_once(cfg, registry, tasks=TASKS, now=time.time() + 600)[0]
    assert decision.action == "reject" and decision.numbers["online_p_worse"] < cfg.alpha, decision
    assert decision.numbers["online_log_lr_worse"] >= decision.numbers["online_threshold_log_lr"], decision.numbers
    assert registry.aliases() == {"champion": b}, "a rejected challenger must lose its traffic"

    d = _publish(cfg, base_model_dir, tmp_path, 4)  # clearly better but only 10 sessions, after b's last
    write_arm_sessions(cfg.lake_root, d, "challenger", [1.0] * 10, start=after + dt.timedelta(seconds=10))
    decision = promote.gate_once(cfg, registry, tasks=TASKS, now=time.time() + 600)[0]
    assert decision.action == "hold" and "too few" in decision.reason, decision
    assert registry.aliases() == {"champion": b, "challenger": d}

    runs = _runs(cfg)
    assert sorted(r["decision"] for r in runs) == ["hold", "promote", "reject"], runs
    promoted = next(r for r in runs if r["decision"] == "promote")
    assert promoted["metrics"]["online_mean_b"] > promoted["metrics"]["online_mean_a"], promoted
    for key in ("online_n_a", "online_n_b", "online_log_lr_better", "online_threshold_log_lr", "online_errored_b"):
        assert key in promoted["metrics"], (key, sorted(promoted["metrics"]))


def test_regressed_champion_is_rolled_back_and_router_follows_within_seconds(cfg: promote.PromoteConfig,
                                                                             base_model_dir: Path, tmp_path: Path) -> None:
    registry = Registry(cfg.mlflow_tracking_uri, cfg.registered_model)
    old = _publish(cfg, base_model_dir, tmp_path, 5)
    registry.make_champion(old)
    new = _publish(cfg, base_model_dir, tmp_path, 6)
    registry.make_champion(new)
    cfg = cfg.with_changes(control_share=0.2)  # the rollback test compares the champion with the control arm
    router = Router(cfg)
    session = next(f"session-{i}" for i in range(100) if bucket(f"session-{i}") >= 0.2)  # not in the control arm
    assert router.route(session).policy_version == new
    write_arm_sessions(cfg.lake_root, 0, "control", _rates(0.8, 60, 5))
    write_arm_sessions(cfg.lake_root, new, "champion", _rates(0.2, 60, 6))

    start = time.monotonic()
    decisions = promote.gate_once(cfg, registry, tasks=TASKS)
    assert [d.action for d in decisions] == ["none", "rollback"], [(d.action, d.reason) for d in decisions]
    assert registry.aliases()["champion"] == old
    while router.route(session).policy_version != old:
        assert time.monotonic() - start < 10, "router still routes to the rolled-back version after 10 s"
        time.sleep(0.2)
    assert registry.find(new).tags.get("rolled_back") == "true"
    assert "rollback" in [r["decision"] for r in _runs(cfg)]


def test_manual_rollback_command_and_status(cfg: promote.PromoteConfig, base_model_dir: Path, tmp_path: Path,
                                            vllm_weights_lock: None) -> None:
    # the lock: rolling back to version 0 makes sure the servers hold the base weights (a full reload)
    registry = Registry(cfg.mlflow_tracking_uri, cfg.registered_model)
    first = _publish(cfg, base_model_dir, tmp_path, 7)
    registry.make_champion(first)
    second = _publish(cfg, base_model_dir, tmp_path, 8)
    registry.make_champion(second)
    argv = ["--registered-model", cfg.registered_model, "--mlflow-tracking-uri", cfg.mlflow_tracking_uri,
            "--experiment", cfg.experiment, "--servers", cfg.servers[0], "--base-model", cfg.base_model]
    assert promote.rollback_main(argv) == 0
    assert registry.aliases()["champion"] == first
    assert promote.rollback_main(argv) == 0, "a second rollback goes back to the base model"
    assert "champion" not in registry.aliases()
    assert promote.rollback_main(argv) == 1, "nothing left to roll back"

    from rich.console import Console

    write_arm_sessions(cfg.lake_root, first, "champion", _rates(0.5, 40, 9))
    console = Console(record=True, width=200)
    promote.print_status(console, cfg)
    text = console.export_text()
    assert f"policy-v{first}" in text and f"policy-v{second}" in text and "rolled back" in text, text
    assert "[" in text, f"no confidence interval in the status table:\n{text}"


def test_full_weight_champion_and_challenger_are_served_at_once_and_a_reject_moves_no_weights(
        cfg: promote.PromoteConfig, vllm_urls: list[str], base_model_dir: Path, tmp_path: Path,
        vllm_weights_lock: None) -> None:
    # two servers: a full-weight version takes a server of its own, the champion's is never replaced
    cfg = cfg.with_changes(servers=list(vllm_urls))
    first, second = vllm_urls
    registry = Registry(cfg.mlflow_tracking_uri, cfg.registered_model)
    versions = [random.randint(7_000_000, 7_999_999) for _ in range(3)]
    dirs = [synthetic.make_full_version(base_model_dir, tmp_path / f"policy-v{v}", v, seed=40 + i)
            for i, v in enumerate(versions)]
    a, b, c = versions
    try:
        assert publisher.publish(dirs[0], cfg).pushed == [second], "the base (champion) keeps the first server"
        registry.make_champion(a)
        assert publisher.publish(dirs[1], cfg).pushed == [first], "A is champion: B takes the free server"
        held = {u: vllm_client.weight_version(u) for u in vllm_urls}
        assert held == {first: b, second: a}, held
        router = Router(cfg)
        routes = [router.route(f"s-{i}") for i in range(200)]
        assert {(r.arm, r.policy_version, r.server) for r in routes} == {("champion", a, second), ("challenger", b, first)}
        for server, vdir in ((second, dirs[0]), (first, dirs[1])):  # each arm's requests decode on its own weights
            gap = _served_gap(server, cfg.base_served_name, base_model_dir, vdir)
            assert gap < 1e-4, f"{server} differs from {vdir.name} by {gap:.2e}"
        write_arm_sessions(cfg.lake_root, a, "champion", _rates(0.3, 60, 41))
        write_arm_sessions(cfg.lake_root, b, "challenger", _rates(0.8, 60, 42))
        decision = promote.gate_once(cfg, registry, tasks=TASKS)[0]
        assert decision.action == "promote", decision.reason
        assert "offline_challenger" in decision.numbers, "both versions were scored where they are served"

        assert publisher.publish(dirs[2], cfg).pushed == [second], "C replaces the old champion A, not B"
        after = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=1)  # B's time as champion
        write_arm_sessions(cfg.lake_root, b, "champion", _rates(0.8, 60, 43), start=after)
        write_arm_sessions(cfg.lake_root, c, "challenger", _rates(0.1, 60, 44), start=after)
        decision = promote.gate_once(cfg, registry, tasks=TASKS, now=time.time() + 600)[0]
        assert decision.action == "reject", decision.reason
        assert vllm_client.weight_version(first) == b, "the champion's server was touched"
        assert Router(cfg).route("s").policy_version == b
    finally:
        for url in vllm_urls:
            publisher.reload_full(url, base_model_dir.resolve(), 0, cfg.http_timeout_s)


def test_promote_auto_loop_from_the_command_line(cfg: promote.PromoteConfig, base_model_dir: Path,
                                                 tmp_path: Path) -> None:
    registry = Registry(cfg.mlflow_tracking_uri, cfg.registered_model)
    a = _publish(cfg, base_model_dir, tmp_path, 50)
    registry.make_champion(a)
    b = _publish(cfg, base_model_dir, tmp_path, 51)
    write_arm_sessions(cfg.lake_root, a, "champion", _rates(0.2, 40, 50))
    write_arm_sessions(cfg.lake_root, b, "challenger", _rates(0.9, 40, 51))
    argv = ["--auto", "--rounds", "2", "--var-dir", str(tmp_path / "var"), "--interval-s", "0.1", "--registered-model", cfg.registered_model,
            "--mlflow-tracking-uri", cfg.mlflow_tracking_uri, "--experiment", cfg.experiment,
            "--lake-root", cfg.lake_root, "--servers", cfg.servers[0], "--eval-tasks", f"{__file__}:small_tasks",
            "--challenger-share", "0.5", "--guardrails", ""]
    assert promote.main(argv) == 0
    assert registry.aliases() == {"champion": b}
    assert [r["decision"] for r in _runs(cfg)] == ["promote"], "round 2 has no challenger: nothing to record"


def small_tasks() -> list[evaluate.EvalTask]:
    """A pluggable task set, as the demo passes its own."""
    return evaluate.arithmetic_tasks(n=8, seed=1)


def test_a_challenger_arm_that_lost_sessions_voids_its_test(cfg: promote.PromoteConfig, base_model_dir: Path,
                                                            tmp_path: Path) -> None:
    """The router splits sessions 20 / 40 / 40 (control, challenger, champion); the capture loses half of the
    challenger arm's. The gate must not compare what is left (it would be biased): it halts, says why in MLflow and
    in its heartbeat, and ends the test as void (the challenger is cleared, tagged halt, not rejected)."""
    from flywheel.base.heartbeat import read_statuses
    from flywheel.serving.decision import DEFAULT_GUARDRAILS

    split = cfg.with_changes(control_share=0.2, challenger_share=0.4, guardrails=dict(DEFAULT_GUARDRAILS))
    registry = Registry(split.mlflow_tracking_uri, split.registered_model)
    a = _publish(split, base_model_dir, tmp_path, 60)
    registry.make_champion(a)
    b = _publish(split, base_model_dir, tmp_path, 61)
    router = Router(split)  # the real router, hashing session ids into arms with the configured shares
    routed: dict[str, int] = {}
    for i in range(700):  # fixed ids: the hash's split is the same at every run
        arm = router.route(f"lost-arm-{i}").arm
        routed[arm] = routed.get(arm, 0) + 1
    start = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    lost = routed["challenger"] // 2
    write_arm_sessions(split.lake_root, 0, "control", _rates(0.3, routed["control"], 62), start=start)
    write_arm_sessions(split.lake_root, a, "champion", _rates(0.3, routed["champion"], 63), start=start)
    write_arm_sessions(split.lake_root, b, "challenger", _rates(0.8, routed["challenger"] - lost, 64), start=start)
    var = tmp_path / "var"
    argv = ["--auto", "--rounds", "1", "--var-dir", str(var), "--registered-model", split.registered_model,
            "--mlflow-tracking-uri", split.mlflow_tracking_uri, "--experiment", split.experiment,
            "--lake-root", split.lake_root, "--servers", split.servers[0], "--eval-tasks", f"{__file__}:small_tasks",
            "--control-share", "0.2", "--challenger-share", "0.4"]
    assert promote.main(argv) == 0
    runs = _runs(split)
    assert [r["decision"] for r in runs] == ["halt"], [(r["decision"], r["reason"]) for r in runs]
    assert "sample ratio mismatch" in runs[0]["reason"], runs[0]["reason"]
    metrics = runs[0]["metrics"]
    assert metrics["online_srm_mismatch"] == 1.0 and metrics["online_srm_expected_b"] == pytest.approx(0.5), metrics
    assert metrics["online_srm_n_b"] == routed["challenger"] - lost, metrics
    status = read_statuses(var)["promote"]
    assert status["last"] == "halt" and status["srm"]["mismatch"] == 1.0, status
    assert registry.aliases() == {"champion": a}, "a void test ends as an expired one: the challenger is cleared"
    assert registry.find(b).tags["gate_decision"] == "halt"  # type: ignore[union-attr]
