"""Learning works: the daemon, trained on episodes the real vLLM sampled, shifts the served behaviour.

Task: the reward of a completion is the fraction of its tokens drawn from a fixed set S of 32
token ids (1/16 of the vocabulary, so the random base model hits it about 6% of the time).
Episodes are sampled from policy-v0 through vLLM (exact token ids and behaviour logprobs),
written to a tmp lake, the daemon trains LoRA on them and publishes; we then sample again from
the published version through vLLM and compare the mean reward with a Welch t-test.
"""

from __future__ import annotations

import json
import logging
import math
import random
import urllib.request
import uuid
from pathlib import Path

from bench.fixtures.episodes import sample_rows, write_episodes
from flywheel.learner import checkpoint
from flywheel.learner.config import LearnerConfig
from flywheel.learner.daemon import run

log = logging.getLogger(__name__)
TARGET = frozenset(range(100, 132))


def reward(ids: list[int]) -> float:
    return sum(t in TARGET for t in ids) / len(ids)


def welch_t(a: list[float], b: list[float]) -> float:
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1)
    return (mb - ma) / math.sqrt(va / len(a) + vb / len(b))


def test_daemon_training_raises_the_rewarded_behaviour_in_vllm(tmp_path: Path, vllm_url: str, mlflow_uri: str,
                                                               base_model_dir: Path) -> None:
    rng = random.Random(11)
    start = 10**8 + uuid.uuid4().int % (9 * 10**8)  # unique adapter names on the shared server
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(6)] for _ in range(32)]
    before = sample_rows(vllm_url, "policy-v0", prompts, n=16, max_tokens=8, policy_version=start, reward_fn=reward)
    write_episodes(tmp_path / "lake", before, seq=0)
    cfg = LearnerConfig(lake_root=str(tmp_path / "lake"), base_model=str(base_model_dir), run_dir=str(tmp_path / "run"),
                        policies_dir=str(tmp_path / "policies"), var_dir=str(tmp_path / "var"), device="cpu",
                        mlflow_tracking_uri=mlflow_uri, experiment=f"test-learner-learning-{uuid.uuid4().hex[:8]}",
                        registered_model=f"test-learner-learning-{start}", vllm_url=vllm_url, start_version=start,
                        batch_size=64, min_batch=64, micro_batch=64, lr=3e-3, lora_rank=16, max_steps=8,
                        warmup_steps=0,  # 8 steps only: a warm-up would spend most of them ramping
                        publish_every_steps=8, parity_samples=4, idle_exit_s=30)
    cfg.check()
    name = f"policy-v{start + 1}"
    try:
        assert run(cfg) == 0
        state, _ = checkpoint.load_latest(Path(cfg.run_dir))  # type: ignore[misc]
        assert state.published == [start + 1], f"expected one published version, got {state.published}"
        after = sample_rows(vllm_url, name, prompts, n=16, max_tokens=8, policy_version=start + 1, reward_fn=reward)
    finally:
        body = json.dumps({"lora_name": name}).encode()
        req = urllib.request.Request(f"{vllm_url}/v1/unload_lora_adapter", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30).read()
        except Exception:
            pass
    r0 = [r["reward"] for r in before]
    r1 = [r["reward"] for r in after]
    m0, m1, t = sum(r0) / len(r0), sum(r1) / len(r1), welch_t(r0, r1)
    summary = (f"target-token fraction over {len(r0)} samples: policy-v0 {m0:.4f} -> {name} {m1:.4f} "
               f"({m1 / max(m0, 1e-9):.2f}x), Welch t = {t:.1f}")
    log.info("learning: %s", summary)
    print(summary)
    # t > 4 is p < 1e-4 one-sided; and the effect must be large, not just detectable
    assert t > 4 and m1 > 1.3 * m0, summary
