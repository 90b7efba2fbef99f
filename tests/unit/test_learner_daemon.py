"""The learner daemon in-process on a tmp lake and a tiny random model (no services: MLflow and publish off)."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest
import torch

from bench.fixtures.episodes import random_rows, write_episodes
from bench.fixtures.models import tiny_model
from flywheel.base.config import ConfigError
from flywheel.ingest import lake
from flywheel.learner import checkpoint
from flywheel.learner.config import LearnerConfig
from flywheel.learner.daemon import run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _cfg(tmp_path: Path, model_dir: Path, **kw: object) -> LearnerConfig:
    base = dict(lake_root=str(tmp_path / "lake"), base_model=str(model_dir), run_dir=str(tmp_path / "run"),
                policies_dir=str(tmp_path / "policies"), var_dir=str(tmp_path / "var"), mlflow_tracking_uri="",
                publish=False, batch_size=8, min_batch=8, micro_batch=4, lora_rank=4, lr=1e-3, device="cpu",
                poll_s=0.2, idle_exit_s=1.5, publish_every_steps=2)
    base.update(kw)
    cfg = LearnerConfig(**base)  # type: ignore[arg-type]
    cfg.check()
    return cfg


def test_trains_every_episode_once_publishes_and_resumes(tmp_path: Path, model_dir: Path) -> None:
    rows = [random_rows(8, seed=i, vocab_size=512) for i in range(3)]
    for i, r in enumerate(rows):
        write_episodes(tmp_path / "lake", r, seq=i)
    cfg = _cfg(tmp_path, model_dir)
    assert run(cfg) == 0
    log = checkpoint.read_trained(tmp_path / "run")
    assert [line["step"] for line in log] == [1, 2, 3]
    trained = [i for line in log for i in line["episode_ids"]]
    assert sorted(trained) == sorted(r["episode_id"] for rs in rows for r in rs)
    assert (tmp_path / "policies" / "policy-v1" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "policies" / "policy-v1" / "policy.json").is_file()
    state, _ = checkpoint.load_latest(tmp_path / "run")  # type: ignore[misc]
    assert state.step == 3 and state.policy_version == 1 and state.cursor == {"synthetic/0": 2}
    assert (tmp_path / "run" / "learner-config.toml").is_file()
    meta = json.loads((tmp_path / "policies" / "policy-v1" / "policy.json").read_text())
    since = meta["data_window"]["since_parent"]
    assert (meta["parent_version"], meta["learner_run_id"]) == (0, None), "tracking off: no learner run to link"
    assert (since["count"], since["steps"], since["first_step"], since["last_step"]) == (16, 2, 1, 2), since
    assert (since["min_policy_version"], since["max_policy_version"]) == (0, 0), since
    assert since["first_call_ts"] <= since["last_call_ts"] and since["last_call_ts"].endswith("Z"), since
    assert state.since_parent["count"] == 8 and state.since_parent["first_step"] == 3, \
        f"step 3 came after policy-v1 and waits in the checkpoint for policy-v2: {state.since_parent}"
    # a restart with nothing new trains nothing again; new rows are picked up after the cursor
    write_episodes(tmp_path / "lake", random_rows(8, seed=9), seq=3)
    assert run(cfg) == 0
    log = checkpoint.read_trained(tmp_path / "run")
    assert [line["step"] for line in log] == [1, 2, 3, 4]
    assert len({i for line in log for i in line["episode_ids"]}) == 32


def test_a_version_names_the_learner_run_that_produced_it(tmp_path: Path, model_dir: Path) -> None:
    from flywheel.base import tracking

    write_episodes(tmp_path / "lake", random_rows(16, seed=6, vocab_size=512), seq=0)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert run(_cfg(tmp_path, model_dir, mlflow_tracking_uri=uri, experiment="lineage")) == 0
    meta = json.loads((tmp_path / "policies" / "policy-v1" / "policy.json").read_text())
    runs = tracking.client(uri).search_runs([tracking.experiment_id("lineage", uri)])
    assert [r.info.run_id for r in runs] == [meta["learner_run_id"]], (meta["learner_run_id"], runs)


def test_empty_stream_waits_with_backoff_and_stops_on_request(tmp_path: Path, model_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    listings: list[float] = []
    real = lake.files_since

    def counting(*args: object, **kw: object) -> list[lake.LakeFile]:
        listings.append(time.monotonic())
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(lake, "files_since", counting)
    cfg = _cfg(tmp_path, model_dir, idle_exit_s=0.0, poll_s=1.0)
    stop = threading.Event()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(run(cfg, stop)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not listings and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(4.0)
    assert thread.is_alive(), "an empty stream must not end or crash the daemon"
    first = listings[0]
    recent = [t for t in listings if t > first]
    assert len(listings) <= 8, f"{len(listings)} lake listings in ~4 s: the wait is spinning"
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive() and result == [0]
    assert recent, "it kept polling while waiting"
    status = (tmp_path / "var" / "run" / "status" / "learner.json").read_text()
    assert '"phase": "stopped"' in status


def test_stale_episodes_never_reach_a_step(tmp_path: Path, model_dir: Path) -> None:
    # v9 is not on this learner's line (it starts at v10); v10's rows lag 0, 1, 2, 3 learner steps at steps 1-4
    write_episodes(tmp_path / "lake", random_rows(8, seed=1, policy_version=9), seq=0)
    for seq in range(1, 5):
        write_episodes(tmp_path / "lake", random_rows(8, seed=1 + seq, policy_version=10), seq=seq)
    cfg = _cfg(tmp_path, model_dir, start_version=10, max_staleness_steps=2)
    assert run(cfg) == 0
    log = checkpoint.read_trained(tmp_path / "run")
    trained = {i for line in log for i in line["episode_ids"]}
    expected = {r["episode_id"] for seed in (2, 3, 4) for r in random_rows(8, seed=seed)}
    assert [line["step"] for line in log] == [1, 2, 3] and trained == expected, \
        "v10's rows while they lag <= 2 steps (policy-v11 at step 2 does not reset their lag); v9's never"
    state, _ = checkpoint.load_latest(tmp_path / "run")  # type: ignore[misc]
    # file 0's rows were all dropped, files 1-3 trained, and file 4's dropped while the learner waited after step 3:
    # the graceful stop's checkpoint holds all of it
    assert state.cursor == {"synthetic/0": 4}, "dropped rows are consumed: the cursor moves past them"
    assert state.lineage == {10: 0, 11: 2}, state.lineage


@pytest.mark.parametrize("variant", [dict(loss="ppo", kl_coef=0.1), dict(mode="full", lr=1e-4),
                                     dict(mode="full", lr=1e-4, kl_coef=0.1),
                                     dict(mode="full", lr=1e-4, kl_coef=0.1, kl_estimator="exact")])
def test_ppo_with_kl_and_full_weights_train_and_write_servable_versions(tmp_path: Path, model_dir: Path,
                                                                        variant: dict) -> None:
    import torch

    write_episodes(tmp_path / "lake", random_rows(16, seed=5), seq=0)
    cfg = _cfg(tmp_path, model_dir, publish_every_steps=2, **variant)
    assert run(cfg) == 0
    state, tensors = checkpoint.load_latest(tmp_path / "run")  # type: ignore[misc]
    assert state.step == 2 and state.policy_version == 1
    assert all(torch.isfinite(v).all() for v in tensors["weights"].values())
    version = tmp_path / "policies" / "policy-v1"
    if variant.get("mode") == "full":
        assert (version / "model.safetensors").is_file() and (version / "config.json").is_file()
        from safetensors.torch import load_file

        base = load_file(str(model_dir / "model.safetensors"))
        new = load_file(str(version / "model.safetensors"))
        assert base.keys() == new.keys(), "full weights must fit the served architecture key for key"
        assert any(not torch.equal(base[k], new[k]) for k in base), "full-weight training changed nothing"
    else:
        assert (version / "adapter_model.safetensors").is_file()


def test_learning_rate_warms_up_linearly_from_the_start_of_the_line(tmp_path: Path, model_dir: Path) -> None:
    from flywheel.learner.daemon import Learner

    learner = Learner(_cfg(tmp_path, model_dir, lr=1e-3, warmup_steps=4))
    factors = []
    for step in range(6):
        learner.state.step = step
        factors.append(learner.trainer.warmup_factor())
    assert factors == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    learner.state.step = 0
    rows = random_rows(8, seed=3, vocab_size=512)
    write_episodes(tmp_path / "lake", rows, seq=0)
    learner.stream.poll()  # type: ignore[union-attr]
    batch, _ = learner.stream.take(8, learner.state.lags(), 4)  # type: ignore[union-attr]
    learner.train_step(learner.plan(batch))
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4), "the first step runs at lr / warmup_steps"
    assert Learner(_cfg(tmp_path / "b", model_dir, warmup_steps=0)).trainer.warmup_factor() == 1.0
    learner.state.step, learner.state.line_start_step = 40, 37  # a rebase at step 37 started a new line
    assert learner.trainer.warmup_factor() == pytest.approx(1.0), "three steps into the line: (3 + 1) / 4"
    learner.state.line_start_step = 39
    assert learner.trainer.warmup_factor() == pytest.approx(0.5), "the warm-up runs again after a rebase"


def test_rows_of_advantage_zero_are_skipped_without_changing_the_gradient(tmp_path: Path, model_dir: Path) -> None:
    from flywheel.learner.daemon import Learner

    rows = random_rows(8, seed=5, vocab_size=512)
    write_episodes(tmp_path / "lake", rows, seq=0)
    grads = []
    for name, skip in (("skip", True), ("all", False)):
        learner = Learner(_cfg(tmp_path / name, model_dir, lake_root=str(tmp_path / "lake"), loss_agg="sequence"))
        learner.stream.poll()  # type: ignore[union-attr]
        batch, _ = learner.stream.take(8, learner.state.lags(), 4)  # type: ignore[union-attr]
        plan = [(e, a if i % 3 else 0.0) for i, (e, a) in enumerate(zip(batch, [0.5, -1.0, 2.0, 1.5] * 2))]
        if not skip:
            learner.trainer.rows_to_run = lambda p: p  # type: ignore[method-assign]
        run_rows = learner.trainer.rows_to_run(plan)
        assert len(run_rows) == (5 if skip else 8), "rows 0, 3 and 6 have advantage 0"
        learner.train_step(plan)
        grads.append([p.grad.clone() for p in learner.policy.trainable_parameters()])
    assert any(g.abs().sum() > 0 for g in grads[0])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6), "skipping advantage-0 rows changed the gradient"
    with_kl = Learner(_cfg(tmp_path / "kl", model_dir, lake_root=str(tmp_path / "lake"), kl_coef=0.1))
    assert with_kl.trainer.rows_to_run(plan) == plan, "with a KL term every row has a gradient"
    trained = Learner(_cfg(tmp_path / "kl-trained", model_dir, lake_root=str(tmp_path / "lake"), kl_coef=0.1,
                           kl_rows="trained"))
    assert len(trained.trainer.rows_to_run(plan)) == 5, "--kl-rows trained: the KL term on the trained rows only"


def test_the_exact_kl_is_the_full_vocabulary_kl_zero_at_the_reference_and_trains(tmp_path: Path,
                                                                                  model_dir: Path) -> None:
    from flywheel.learner.daemon import Learner
    from flywheel.learner.model import completion_logits, token_logprobs_and_exact_kl

    write_episodes(tmp_path / "lake", random_rows(8, seed=6, vocab_size=512), seq=0)
    learner = Learner(_cfg(tmp_path, model_dir, mode="full", lr=1e-3, warmup_steps=0, kl_coef=0.1,
                           kl_estimator="exact", loss_agg="sequence"))
    learner.stream.poll()  # type: ignore[union-attr]
    batch, _ = learner.stream.take(8, learner.state.lags(), 4)  # type: ignore[union-attr]
    plan = [(e, a) for e, a in zip(batch, [1.0, 0.0, 0.5, 0.0] * 2)]
    mb = learner.trainer.micro_batches(plan)[0]
    assert mb.exact_ref and mb.logp_ref is None, "the [B, T, V] reference is computed in the pass, not kept per step"
    ref_full = learner.trainer.reference_full(mb)
    assert ref_full.dim() == 3 and not ref_full.requires_grad, "the reference's whole distribution, [B, T, V]"
    with torch.no_grad():
        logp, kl = token_logprobs_and_exact_kl(learner.policy.module, mb.packed, ref_full)
        assert float((kl * mb.packed.mask).abs().max()) < 1e-5, "the policy is still the reference"
        # against a uniform reference the KL is log V minus the policy's entropy, position by position
        full = torch.log_softmax(completion_logits(learner.policy.module, mb.packed), dim=-1)
        vocab = full.shape[-1]
        _, kl_uniform = token_logprobs_and_exact_kl(learner.policy.module, mb.packed,
                                                    torch.full_like(full, -math.log(vocab)))
        entropy = -(full.exp() * full).sum(-1)
        assert torch.allclose(kl_uniform, math.log(vocab) - entropy, atol=1e-4)
    first = learner.train_step(plan)
    second = learner.train_step(plan)
    assert first.kl == pytest.approx(0.0, abs=1e-5) and second.kl > 0, (first.kl, second.kl)
    assert learner.trainer.rows_to_run(plan) == plan, "a KL term gives every row a gradient, exact or not"


def test_adaptive_kl_doubles_above_the_target_halves_below_and_stays_in_its_range() -> None:
    from flywheel.learner.trainer import adapt_kl_coef

    assert adapt_kl_coef(0.1, kl=0.2, target=0.1, start=0.1) == 0.2, "above 1.5x the target: doubled"
    assert adapt_kl_coef(0.1, kl=0.05, target=0.1, start=0.01) == 0.05, "below target/1.5: halved"
    assert adapt_kl_coef(0.1, kl=0.12, target=0.1, start=0.1) == 0.1, "within the band: unchanged"
    assert adapt_kl_coef(90.0, kl=5.0, target=0.1, start=0.1) == 100.0, "capped at 1000x the start"
    assert adapt_kl_coef(0.15, kl=0.0, target=0.1, start=0.1) == 0.1, "floored at the start"
    assert adapt_kl_coef(0.4, kl=0.0, target=0.1, start=0.1) == 0.2, "above the start it halves"


def test_kl_target_steers_the_coefficient_step_by_step_and_a_restart_keeps_it(tmp_path: Path, model_dir: Path) -> None:
    from flywheel.learner.trainer import adapt_kl_coef

    for i in range(3):
        write_episodes(tmp_path / "lake", random_rows(8, seed=20 + i, vocab_size=512), seq=i)
    cfg = _cfg(tmp_path, model_dir, kl_coef=0.1, kl_target=1e-7)
    assert run(cfg) == 0
    log = checkpoint.read_trained(tmp_path / "run")
    coefs, kls = [line["kl_coef"] for line in log], [line["kl"] for line in log]
    assert coefs[0] == 0.1, "the first step trains with kl_coef"
    for i in range(1, len(log)):
        assert coefs[i] == adapt_kl_coef(coefs[i - 1], kls[i - 1], 1e-7, 0.1), (coefs, kls)
    assert len(set(coefs)) > 1, f"the coefficient never moved: {coefs}, kl {kls}"
    state, _ = checkpoint.load_latest(tmp_path / "run")  # type: ignore[misc]
    assert state.kl_coef == adapt_kl_coef(coefs[-1], kls[-1], 1e-7, 0.1)
    write_episodes(tmp_path / "lake", random_rows(8, seed=30, vocab_size=512), seq=3)
    assert run(cfg) == 0
    assert checkpoint.read_trained(tmp_path / "run")[-1]["kl_coef"] == state.kl_coef, "a restart resumes the coefficient"
    with pytest.raises(ConfigError, match="kl_target"):
        _cfg(tmp_path, model_dir, kl_coef=0.0, kl_target=0.1)


def test_the_learner_follows_the_gate_only_when_its_newest_version_was_abandoned() -> None:
    from flywheel.learner.gate import rebase_target

    assert rebase_target([], 0, {}) is None, "nothing published: nothing to abandon"
    assert rebase_target([1, 2], 2, {"challenger": 2}) is None, "v2 still waits for the gate"
    assert rebase_target([1, 2], 2, {"champion": 2}) is None, "v2 was promoted"
    assert rebase_target([1, 2], 2, {}) == 0, "v2 rejected before any promotion: policy-v0 is the champion"
    assert rebase_target([1, 2, 3], 3, {"champion": 1}) == 1, "v3 rejected (challenger alias cleared)"
    assert rebase_target([1, 2, 3], 1, {"champion": 1}) is None, "already rebased onto the champion"
    assert rebase_target([4, 5], 5, {"champion": 3, "challenger": 4}) == 3, "v5 gone, an older v4 is challenger"


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_rebase_loads_the_champion_and_drops_the_abandoned_line(tmp_path: Path, model_dir: Path, mode: str) -> None:
    from flywheel.learner.daemon import Learner

    write_episodes(tmp_path / "lake", random_rows(16, seed=5, vocab_size=512), seq=0)
    learner = Learner(_cfg(tmp_path, model_dir, mode=mode, lr=1e-3, warmup_steps=0))
    learner.stream.poll()  # type: ignore[union-attr]
    batch, _ = learner.stream.take(8, learner.state.lags(), 4)  # type: ignore[union-attr]
    learner.train_step(learner.plan(batch))
    champion = {k: v.clone() for k, v in learner.policy.weights_state().items()}
    learner.versions.write()  # policy-v1: the champion-to-be
    learner.train_step(learner.plan(batch))
    learner.versions.write()  # policy-v2, which the gate will refuse
    learner.train_step(learner.plan(batch))
    assert any(not torch.equal(champion[k], v) for k, v in learner.policy.weights_state().items())

    learner.rebase(1, (tmp_path / "policies" / "policy-v1").resolve().as_uri())  # the source as the registry holds it
    now = learner.policy.weights_state()
    for key, value in champion.items():
        assert torch.allclose(now[key], value, atol=1e-6), f"{key} is not policy-v1's after the rebase"
    assert learner.state.policy_version == 1 and learner.state.abandoned == [2]
    assert learner.stream is not None and learner.stream.abandoned == {2}
    assert learner.state.lags() == {0: 1, 1: 0}, "the champion's rows lag 0; v0 stays 1 step behind it; v2 is off the line"
    assert not learner.optimizer.state, "Adam's moments of the abandoned line survived the rebase"
    assert learner.state.line_start_step == learner.state.step == 3
    assert learner.trainer.warmup_factor() == 1.0  # warmup_steps 0 here; the warm-up's restart is tested above
    assert learner.versions.next_version() == 3, "a version number is never reused"

    learner.rebase(0, None)  # the champion may be policy-v0 itself
    if mode == "full":
        from safetensors.torch import load_file

        base = load_file(str(model_dir / "model.safetensors"))
        assert all(torch.equal(learner.policy.weights_state()[k], v) for k, v in base.items())
    else:
        assert all(float(v.abs().sum()) == 0.0 for k, v in learner.policy.weights_state().items() if "lora_B" in k)
    assert learner.state.abandoned == [2, 1], "back at v0 (a rollback), the weights descend from neither"
    assert learner.state.lags() == {0: 0}, learner.state.lineage


def test_with_wait_for_gate_a_version_is_published_only_after_the_gate_ruled_on_the_last(tmp_path: Path,
                                                                                      model_dir: Path) -> None:
    from flywheel.learner.daemon import Learner
    from flywheel.serving.registry import Registry

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    learner = Learner(_cfg(tmp_path, model_dir, publish=True, mlflow_tracking_uri=uri, registered_model="m",
                           publish_every_steps=2, publish_every_s=3600.0, publish_wait_for_gate=True))
    registry = Registry(uri, "m")
    for version in (1, 2):
        registry.register(version, str(learner.versions.write()), {"kind": "lora"})
    registry.set_alias("challenger", 1)
    learner.state.published, learner.state.policy_version = [1], 1
    learner.state.step, learner.state.last_published_step = 5, 2
    assert not learner.publish_due(learner.gate.read_aliases()), "policy-v1 is still the challenger: the gate has not ruled"
    registry.make_champion(1)
    assert learner.publish_due(learner.gate.read_aliases()), "promoted"
    registry.set_alias("challenger", 2)
    learner.state.published, learner.state.policy_version = [1, 2], 2
    assert not learner.publish_due(learner.gate.read_aliases())
    learner.versions.last_publish_time -= 3601.0
    assert learner.publish_due(learner.gate.read_aliases()), "publish_every_s publishes even without a verdict (a stopped gate must not stop the loop)"
    learner.versions.last_publish_time += 3601.0
    learner.cfg.publish_wait_for_gate = False
    assert learner.publish_due(learner.gate.read_aliases()), "without wait_for_gate the step count alone decides"
    learner.cfg.publish_wait_for_gate = True

    registry.clear_alias("challenger")  # policy-v2 rejected
    assert learner.publish_due(learner.gate.read_aliases()), "a rejection is a ruling too"
    learner.follow_gate(learner.gate.read_aliases())  # what finish_step does before asking publish_due
    assert learner.state.policy_version == 1 and learner.state.abandoned == [2], "back on the champion"
    assert not learner.publish_due(learner.gate.read_aliases()), "the champion's weights get their own steps before the next version"


def test_epochs_reuse_each_batch_under_the_clipped_ratio_only(tmp_path: Path, model_dir: Path) -> None:
    from flywheel.base.config import ConfigError
    from flywheel.learner.daemon import Learner

    with pytest.raises(ConfigError, match="needs loss=ppo"):
        _cfg(tmp_path, model_dir, epochs=2)  # tis: a detached weight gives later passes no trust region
    with pytest.raises(ConfigError, match="epochs"):
        _cfg(tmp_path, model_dir, epochs=0)
    write_episodes(tmp_path / "lake", random_rows(8, seed=4, vocab_size=512), seq=0)
    results, weights = {}, {}
    for epochs in (1, 3):
        learner = Learner(_cfg(tmp_path / f"e{epochs}", model_dir, lake_root=str(tmp_path / "lake"), loss="ppo",
                               epochs=epochs, mode="full", lr=1e-3, warmup_steps=0))
        learner.stream.poll()  # type: ignore[union-attr]
        batch, _ = learner.stream.take(8, learner.state.lags(), 4)  # type: ignore[union-attr]
        results[epochs] = learner.train_step(learner.plan(batch))
        weights[epochs] = learner.policy.weights_state()
        adam_steps = {int(s["step"]) for s in learner.optimizer.state.values()}
        assert adam_steps == {epochs}, "one optimizer step per pass"
        assert learner.state.step == 1, "a learner step is one batch, however many passes"
    assert results[3].tokens == 3 * results[1].tokens
    # the last pass sees a policy the first two moved: its ratios are off 1 and the clip engages
    assert abs(results[3].ratio_mean - results[1].ratio_mean) > 1e-3
    assert results[3].clip_frac > results[1].clip_frac
    assert any(not torch.equal(weights[1][k], weights[3][k]) for k in weights[1])


def test_a_version_due_while_every_row_is_stale_is_published_without_a_step(tmp_path: Path, model_dir: Path) -> None:
    from flywheel.learner.daemon import Learner

    # the learner stepped past the served version while the gate judged the last one: its rows are stale,
    # no step can come, and the version now due must not wait for one
    learner = Learner(_cfg(tmp_path, model_dir, publish_every_steps=2, max_staleness_steps=2))
    learner.state.step = 3
    learner.publish_while_waiting()
    assert learner.state.policy_version == 1 and learner.state.lags() == {0: 3, 1: 0}, learner.state.lineage
    assert (tmp_path / "policies" / "policy-v1" / "policy.json").is_file()
    assert checkpoint.load_latest(tmp_path / "run")[0].policy_version == 1, "checkpointed with the new version"  # type: ignore[index]
    learner._publish_checked = 0.0
    learner.publish_while_waiting()
    assert learner.state.published == [1], "nothing trained since: nothing to publish"


def test_checkpoints_every_n_steps_at_each_version_and_at_a_graceful_stop(tmp_path: Path, model_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    saved: list[int] = []
    real = checkpoint.save

    def recording(run_dir: Path, state: checkpoint.TrainerState, *args: object, **kw: object) -> Path:
        saved.append(state.step)
        return real(run_dir, state, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoint, "save", recording)
    for i in range(7):
        write_episodes(tmp_path / "lake", random_rows(8, seed=40 + i, vocab_size=512), seq=i)
    assert run(_cfg(tmp_path, model_dir, checkpoint_every_steps=2, publish_every_steps=3)) == 0
    assert [line["step"] for line in checkpoint.read_trained(tmp_path / "run")] == [1, 2, 3, 4, 5, 6, 7]
    # 2: two steps since the start; 3 and 6: versions (a version always has its checkpoint); 5: two since 3;
    # 7: the graceful stop after it
    assert saved == [2, 3, 5, 6, 7], saved
    state, _ = checkpoint.load_latest(tmp_path / "run")  # type: ignore[misc]
    assert (state.step, state.policy_version) == (7, 2)


def test_a_kill_between_checkpoints_trains_the_steps_after_the_last_one_again_from_its_weights(
        tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flywheel.learner.daemon import Learner

    for i in range(5):
        write_episodes(tmp_path / "lake", random_rows(8, seed=50 + i, vocab_size=512), seq=i)
    common = dict(lake_root=str(tmp_path / "lake"), checkpoint_every_steps=3, publish_every_steps=0)
    assert run(_cfg(tmp_path / "clean", model_dir, **common)) == 0
    # a SIGKILL after step 4 was logged: no checkpoint after step 3's (the graceful stop's save left out)
    with monkeypatch.context() as m:
        m.setattr(Learner, "save_at_stop", lambda self: None)
        assert run(_cfg(tmp_path / "killed", model_dir, max_steps=4, **common)) == 0
    assert checkpoint.load_latest(tmp_path / "killed" / "run")[0].step == 3  # type: ignore[index]
    assert run(_cfg(tmp_path / "killed", model_dir, **common)) == 0

    clean = checkpoint.read_trained(tmp_path / "clean" / "run")
    log = checkpoint.read_trained(tmp_path / "killed" / "run")
    assert [line["step"] for line in log] == [1, 2, 3, 4, 4, 5], "step 4 trained again, from step 3's weights"
    assert log[3]["episode_ids"] == log[4]["episode_ids"], "the same batch: the cursor came from step 3's checkpoint"
    along = checkpoint.trained_lineage(log, upto=5)
    assert [(x["step"], x["episode_ids"]) for x in along] == [(x["step"], x["episode_ids"]) for x in clean], \
        "along the weights, the same steps with the same episodes as a run never killed"
    ids = [i for line in along for i in line["episode_ids"]]
    assert len(ids) == len(set(ids)) == 40, "each episode once in the weights"
    _, killed = checkpoint.load_latest(tmp_path / "killed" / "run")  # type: ignore[misc]
    _, never = checkpoint.load_latest(tmp_path / "clean" / "run")  # type: ignore[misc]
    worst = max(float((killed["weights"][k] - never["weights"][k]).abs().max()) for k in never["weights"])
    assert worst < 1e-6, f"the weights after the kill and restart differ from the clean run's by {worst:.2e}"
