"""The learner's model side on a tiny random Qwen2: exact-token scoring, LoRA, checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.fixtures.models import tiny_model
from flywheel.learner import checkpoint
from flywheel.learner.checkpoint import TrainerState
from flywheel.learner.config import LearnerConfig
from flywheel.learner.data import Episode
from flywheel.learner.model import load_policy, pack, token_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _ep(prompt: list[int], completion: list[int]) -> Episode:
    return Episode("e", 1, "t", None, 0, tuple(prompt), tuple(completion), tuple([-1.0] * len(completion)),
                   tuple([1] * len(completion)), 1.0)


def test_padded_batch_scores_each_row_as_alone(model_dir: Path) -> None:
    policy = load_policy(LearnerConfig(base_model=str(model_dir), device="cpu"))
    a, b = _ep([5, 6, 7, 8, 9], [10, 11]), _ep([12], [13, 14, 15, 16])
    with torch.no_grad():
        both = token_logprobs(policy.module, pack([a, b], policy.device))  # [2, 4]
        alone_a = token_logprobs(policy.module, pack([a], policy.device))
        alone_b = token_logprobs(policy.module, pack([b], policy.device))
        # reference: plain HF forward on the unpadded sequence, logits at position P-1+t
        ids = torch.tensor([[12, 13, 14, 15, 16]])
        logits = policy.module(input_ids=ids).logits.log_softmax(-1)[0]
        manual = torch.stack([logits[t, ids[0, t + 1]] for t in range(0, 4)])
    assert torch.allclose(both[0, :2], alone_a[0], atol=1e-5), (both[0], alone_a)
    assert torch.allclose(both[1], alone_b[0], atol=1e-5)
    assert torch.allclose(alone_b[0], manual, atol=1e-5)


def test_lora_starts_as_the_base_and_saves_vllm_layout(model_dir: Path, tmp_path: Path) -> None:
    policy = load_policy(LearnerConfig(base_model=str(model_dir), device="cpu", lora_rank=4))
    packed = pack([_ep([5, 6, 7], [8, 9, 10])], policy.device)
    with torch.no_grad():
        adapted = token_logprobs(policy.module, packed)
        with policy.reference() as ref:
            base = token_logprobs(ref, packed)
    assert torch.equal(adapted, base), "LoRA B starts at zero: the adapter is the identity"
    assert policy.save_weights(tmp_path) == "lora"
    assert (tmp_path / "adapter_model.safetensors").is_file() and (tmp_path / "adapter_config.json").is_file()


def test_checkpoint_round_trip_restores_weights_and_optimizer(model_dir: Path, tmp_path: Path) -> None:
    cfg = LearnerConfig(base_model=str(model_dir), device="cpu", lora_rank=4)
    policy = load_policy(cfg)
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    loss = token_logprobs(policy.module, pack([_ep([5, 6], [7, 8])], policy.device)).sum()
    loss.backward()
    opt.step()
    state = TrainerState(step=3, policy_version=2, cursor={"x/0": 4}, trained={"a": 1}, baseline={"t": 0.5})
    checkpoint.save(tmp_path, state, policy.weights_state(), opt.state_dict())
    # a half-written checkpoint of a later step (killed writer) must be ignored
    (tmp_path / "checkpoints" / ".tmp-step-00000004-dead").mkdir()
    fresh = load_policy(cfg)
    fresh_opt = torch.optim.AdamW(fresh.trainable_parameters(), lr=1e-2)
    got = checkpoint.load_latest(tmp_path)
    assert got is not None
    st, tensors = got
    assert st == state
    fresh.load_weights_state(tensors["weights"])
    fresh_opt.load_state_dict(tensors["optimizer"])
    for (k, v), (k2, v2) in zip(policy.weights_state().items(), fresh.weights_state().items()):
        assert k == k2 and torch.equal(v, v2), k
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
