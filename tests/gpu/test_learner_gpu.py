"""The learner's bf16 path on CUDA (skipped without a GPU by tests/gpu/conftest.py).

One daemon step in bfloat16 on the GPU: finite loss, weights that move, and bf16 token logprobs
close to the fp32 ones of the same weights (bf16 cannot meet the fp32 1e-3 parity bound; it must
still be close enough for importance ratios near 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.fixtures.episodes import random_rows, write_episodes
from bench.fixtures.models import tiny_model
from flywheel.learner import checkpoint
from flywheel.learner.config import LearnerConfig
from flywheel.learner.daemon import run
from flywheel.learner.data import parse_row
from flywheel.learner.model import load_policy, pack, token_logprobs


@pytest.mark.gpu
def test_bf16_step_on_cuda(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "model", hidden=256, layers=4)
    rows = random_rows(16, seed=0, prompt_len=64, completion_len=32)
    write_episodes(tmp_path / "lake", rows, seq=0)
    cfg = LearnerConfig(lake_root=str(tmp_path / "lake"), base_model=str(model), run_dir=str(tmp_path / "run"),
                        policies_dir=str(tmp_path / "policies"), var_dir=str(tmp_path / "var"), device="cuda",
                        dtype="bfloat16", mlflow_tracking_uri="", publish=False, batch_size=16, min_batch=16,
                        micro_batch=8, lr=1e-3, max_steps=1, publish_every_steps=1, idle_exit_s=5)
    cfg.check()
    assert run(cfg) == 0
    state, tensors = checkpoint.load_latest(tmp_path / "run")  # type: ignore[misc]
    assert state.step == 1 and state.policy_version == 1
    b = [v for k, v in tensors["weights"].items() if "lora_B" in k]
    assert b and all(torch.isfinite(v).all() for v in b) and max(float(v.abs().max()) for v in b) > 0
    assert (tmp_path / "policies" / "policy-v1" / "adapter_model.safetensors").is_file()

    episodes = [parse_row(r, 512, 2048) for r in rows]
    bf16 = load_policy(cfg)
    fp32 = load_policy(LearnerConfig(base_model=str(model), device="cuda", dtype="float32"))
    with torch.no_grad():
        lp16 = token_logprobs(bf16.module, pack(episodes, bf16.device))  # type: ignore[arg-type]
        lp32 = token_logprobs(fp32.module, pack(episodes, fp32.device))  # type: ignore[arg-type]
    gap = float((lp16 - lp32).abs().max())
    assert gap < 0.1, f"bf16 vs fp32 logprobs differ by up to {gap:.3f}"
