"""Data parallelism: the daemon under `torchrun --nproc-per-node 2` (gloo, CPU), with DDP and with the
weights sharded by FSDP2, reaches the same weights and Adam moments as one process on the same global
batches (real processes, real MLflow store), and checkpoints them in the one-process form."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from bench.fixtures.episodes import random_rows, write_episodes
from bench.fixtures.models import tiny_model
from flywheel.base.config import write_resolved
from flywheel.learner import checkpoint
from flywheel.learner.config import LearnerConfig

REPO = Path(__file__).resolve().parents[2]


def _metric(mlflow_uri: str, config: Path, key: str) -> list[float]:
    """The per-step history of one metric of the (single) run logged under a config's experiment."""
    import tomllib

    from flywheel.base import tracking

    name = tomllib.loads(config.read_text())["experiment"]
    client = tracking.client(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]


def _config(tmp: Path, name: str, mlflow_uri: str, shard: str = "ddp") -> Path:
    cfg = LearnerConfig(lake_root=str(tmp / "lake"), base_model=str(tmp / "model"), run_dir=str(tmp / name),
                        policies_dir=str(tmp / f"{name}-policies"), var_dir=str(tmp / "var"), device="cpu",
                        mlflow_tracking_uri=mlflow_uri, experiment=f"test-learner-dist-{uuid.uuid4().hex[:8]}",
                        publish=False, batch_size=16, min_batch=16, micro_batch=3, lora_rank=4, lr=1e-3,
                        max_steps=3, publish_every_steps=0, idle_exit_s=5.0, poll_s=0.5, seed=3, shard=shard)
    cfg.check()
    return write_resolved(cfg, tmp / f"{name}.toml")


@pytest.mark.parametrize("shard", ["ddp", "fsdp2"])
def test_two_gloo_ranks_reach_the_weights_of_one_rank(tmp_path: Path, mlflow_uri: str, shard: str) -> None:
    tiny_model(tmp_path / "model")
    # rows of different lengths and rewards, so shards differ in padding and token counts
    for i, (p, c) in enumerate([(8, 24), (30, 5), (12, 40)]):
        write_episodes(tmp_path / "lake", random_rows(16, seed=i, prompt_len=p, completion_len=c), seq=i)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    one_cfg, two_cfg = _config(tmp_path, "one", mlflow_uri), _config(tmp_path, "two", mlflow_uri, shard)
    one = subprocess.run([sys.executable, "-m", "flywheel.learner.daemon", "--config", str(one_cfg)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                "flywheel.learner.daemon", "--config", str(two_cfg)]
    two = subprocess.run(torchrun, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "dist: rank 1 of 2 (gloo)" in two.stdout + two.stderr
    sharded = "dist: fsdp2 sharded 2 Qwen2DecoderLayer blocks and the root over 2 ranks" in two.stdout + two.stderr
    assert sharded == (shard == "fsdp2"), two.stderr[-3000:]

    s1, t1 = checkpoint.load_latest(tmp_path / "one")  # type: ignore[misc]
    s2, t2 = checkpoint.load_latest(tmp_path / "two")  # type: ignore[misc]
    assert s1.step == s2.step == 3 and s1.trained == s2.trained
    # what each step trained (its episodes, version, shaping weight), less "t", the wall-clock time it finished
    trained = [[{k: v for k, v in r.items() if k != "t"} for r in checkpoint.read_trained(tmp_path / run)]
               for run in ("one", "two")]
    assert trained[0] == trained[1] and len(trained[0]) == 3, trained
    w1, w2 = t1["weights"], t2["weights"]
    assert w1.keys() == w2.keys()
    worst = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    moved = max(float(w1[k].abs().max()) for k in w1 if "lora_B" in k)
    print(f"2 ranks ({shard}) vs 1 rank after 3 steps: max |dw| {worst:.2e}, max |lora_B| {moved:.2e}")
    assert moved > 1e-4, "the weights did not move: the comparison would be empty"
    # Adam is blind to a constant gradient scale, so compare the (all-reduced) gradient norms and losses too:
    # a wrong world-size factor or a missing shard shows there even when the weights agree
    for key in ("grad_norm", "loss"):
        a, b = _metric(mlflow_uri, one_cfg, key), _metric(mlflow_uri, two_cfg, key)
        assert len(a) == len(b) == 3 and all(abs(x - y) <= 1e-4 * max(abs(x), 1e-3) for x, y in zip(a, b)), (key, a, b)
    # FSDP2's reduce-scatter averages the same per-rank sums as DDP's all-reduce: only the order of float32
    # additions differs, so sharded or not, the tolerance is the same
    assert worst < 2e-5, f"2-rank weights differ from 1-rank by up to {worst:.2e} (lora_B magnitude {moved:.2e})"
    # the sharded moments were gathered into the one-process numbering: a 1-rank learner resumes from them
    o1, o2 = t1["optimizer"], t2["optimizer"]
    assert o1["state"].keys() == o2["state"].keys() and o1["param_groups"] == o2["param_groups"]
    for i, slot in o1["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = slot[key], o2["state"][i][key]
            assert type(b) is torch.Tensor and a.shape == b.shape, (i, key, type(b), a.shape, b.shape)
            gap = float((a - b).abs().max())
            assert gap <= 1e-4 * max(float(a.abs().max()), 1e-8), f"{key} of param {i}: 2-rank vs 1-rank by {gap:.2e}"
