"""Train/inference parity and the publish hand-off, against the real vLLM server and MLflow store.

Tokens are sampled from the served base model (policy-v0) with their behaviour logprobs; the
learner must score the same tokens within 1e-3 (fp32) at the unchanged version, publish a LoRA
version that vLLM then serves, and the served version's logprobs must again match the learner's.
"""

from __future__ import annotations

import dataclasses
import json
import random
import urllib.request
import uuid
from pathlib import Path

from bench.fixtures.episodes import sample_rows, write_episodes
from flywheel.base import tracking
from flywheel.learner import checkpoint
from flywheel.learner.config import LearnerConfig
from flywheel.learner.daemon import run
from flywheel.learner.data import parse_row
from flywheel.learner.model import load_policy
from flywheel.learner.parity import behaviour_gap


def _unload(vllm_url: str, name: str) -> None:
    body = json.dumps({"lora_name": name}).encode()
    req = urllib.request.Request(f"{vllm_url}/v1/unload_lora_adapter", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30).read()
    except Exception:
        pass  # already gone: nothing to free


def test_learner_matches_vllm_logprobs_and_publishes(tmp_path: Path, vllm_url: str, mlflow_uri: str,
                                                     base_model_dir: Path) -> None:
    rng = random.Random(7)
    start = 10**8 + uuid.uuid4().int % (9 * 10**8)  # unique adapter names on the shared server
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(5)] for _ in range(8)]
    rows = sample_rows(vllm_url, "policy-v0", prompts, n=4, max_tokens=8, policy_version=start,
                       reward_fn=lambda ids: float(ids[0] % 2))
    cfg = LearnerConfig(lake_root=str(tmp_path / "lake"), base_model=str(base_model_dir), run_dir=str(tmp_path / "run"),
                        policies_dir=str(tmp_path / "policies"), var_dir=str(tmp_path / "var"), device="cpu",
                        mlflow_tracking_uri=mlflow_uri, experiment=f"test-learner-parity-{uuid.uuid4().hex[:8]}",
                        registered_model=f"test-learner-parity-{start}", vllm_url=vllm_url, start_version=start,
                        batch_size=32, min_batch=32, micro_batch=16, max_steps=1, publish_every_steps=1, lr=1e-3,
                        parity_samples=8, idle_exit_s=30)
    cfg.check()

    # 1. unchanged version: the base weights score the served tokens as vLLM did
    policy = load_policy(cfg)
    episodes = [parse_row(r, policy.vocab_size, 2048) for r in rows]
    assert all(not isinstance(e, str) for e in episodes), episodes
    g = behaviour_gap(policy, episodes)  # type: ignore[arg-type]
    assert g.tokens == 32 * 8
    assert g.max_abs < 1e-3, f"learner vs vLLM logprobs at policy-v0: mean {g.mean_abs:.2e}, max {g.max_abs:.2e}"

    # 2. one step, publish: vLLM serves the new adapter and MLflow holds the metrics and the version
    write_episodes(tmp_path / "lake", rows, seq=0)
    try:
        assert run(cfg) == 0
        name = f"policy-v{start + 1}"
        served = [m["id"] for m in json.loads(urllib.request.urlopen(f"{vllm_url}/v1/models").read())["data"]]
        assert name in served, f"{name} not served after publish: {served}"
        client = tracking.client(mlflow_uri)
        exp = client.get_experiment_by_name(cfg.experiment)
        (mlrun,) = client.search_runs([exp.experiment_id])
        metrics = mlrun.data.metrics
        assert metrics["mismatch_behaviour_max"] < 1e-3, metrics
        assert metrics["parity_served_max"] < 1e-3, f"served adapter vs learner: {metrics['parity_served_max']:.2e}"
        for key in ("loss", "reward_mean", "ratio_mean", "clip_frac", "kl", "tokens_per_s", "staleness_lag_0",
                    "published_version"):
            assert key in metrics, f"{key} missing from MLflow run metrics {sorted(metrics)}"
        assert metrics["published_version"] == start + 1
        versions = client.search_model_versions(f"name='{cfg.registered_model}'")
        assert [v.tags.get("policy_version") for v in versions] == [str(start + 1)]
        state, _ = checkpoint.load_latest(Path(cfg.run_dir))  # type: ignore[misc]
        assert state.policy_version == start + 1 and state.published == [start + 1]
        meta = json.loads((Path(cfg.policies_dir) / name / "policy.json").read_text())
        assert meta["kind"] == "lora" and meta["learner_step"] == 1 and meta["parent_version"] == start

        # 3. a version that vanished from the server (kill between writing and pushing, server restart)
        #    is handed to serving again when the daemon restarts
        _unload(vllm_url, name)
        assert run(dataclasses.replace(cfg, idle_exit_s=1.0)) == 0
        served = [m["id"] for m in json.loads(urllib.request.urlopen(f"{vllm_url}/v1/models").read())["data"]]
        assert name in served, f"{name} not pushed again at restart: {served}"
    finally:
        _unload(vllm_url, f"policy-v{start + 1}")
