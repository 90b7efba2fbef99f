"""A tied-embedding model (the shape of Qwen2.5 0.5-3B and Llama 3.2 1-3B) through the learner's full mode and
vLLM's in-place reload, on a private vLLM server of its own.

Why the export carries lm_head.weight: flywheel.learner.model.write_tied_head. The check is the project's
own parity measure (learner/parity.py served_gap: vLLM's prompt_logprobs vs the learner's fp32 scoring):
after a publish the server matches the learner's new weights within 1e-4 and no longer the old ones.
"""

from __future__ import annotations

import random
import shutil
import socket
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.fixtures.models import write_policy_json
from flywheel import stack as stack_mod
from flywheel.demo import model_init
from flywheel.learner.config import LearnerConfig
from flywheel.learner.data import Episode
from flywheel.learner.model import HEAD_KEY, Policy, load_policy, pack, token_logprobs
from flywheel.learner.parity import served_gap
from flywheel.serving import publisher, vllm_client
from flywheel.serving.publisher import PublishError
from flywheel.serving.tier import TierConfig

TOLERANCE = 1e-4
SERVED = "policy-v0"  # the base served name: full weights are served under it, whatever their version


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def tied_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = model_init.ModelInitConfig(out=tmp_path_factory.mktemp("tied") / "base", force=True, vocab_size=512,
                                     hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=384,
                                     max_position_embeddings=512, corpus_lines=2000, tie_word_embeddings=True)
    cfg.check()
    return model_init.init_model(cfg)


@pytest.fixture(scope="module")
def tied_server(tied_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A vLLM server of this module's own on the tied base (the shared servers serve the untied demo model)."""
    cfg = stack_mod.replace_config(stack_mod.load_stack_config([]), vllm_port=_free_port(), vllm_servers=1,
                                   base_model=tied_base, var_dir=tmp_path_factory.mktemp("tied-var"),
                                   vllm_max_model_len=512)
    stack_mod.start_vllm(cfg)
    try:
        yield cfg.vllm_url
    finally:
        stack_mod.stop_part(cfg, "vllm")


def _episodes(n: int = 4, seed: int = 0) -> list[Episode]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(8, 40))]
        completion = [rng.randrange(3, 500) for _ in range(rng.randint(4, 16))]
        out.append(Episode(f"e{i}", 1, "t", None, 0, tuple(prompt), tuple(completion),
                           tuple([-1.0] * len(completion)), tuple([1] * len(completion)), 1.0))
    return out


def _train(policy: Policy, episodes: list[Episode], steps: int = 3) -> None:
    """A few full-weight steps that raise the episodes' logprobs (the loss itself is tested elsewhere)."""
    opt = torch.optim.Adam(policy.trainable_parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        (-token_logprobs(policy.module, pack(episodes, policy.device)).sum()).backward()
        opt.step()


def test_tied_full_weights_reload_exactly_and_the_old_weights_are_gone(tied_base: Path, tied_server: str,
                                                                       tmp_path: Path) -> None:
    episodes = _episodes()
    base = load_policy(LearnerConfig(base_model=str(tied_base), device="cpu", mode="full"))
    start = served_gap(base, episodes, tied_server, SERVED)
    assert start.max_abs < TOLERANCE, f"the fresh server differs from the tied base by {start.max_abs:.2e}"

    policy = load_policy(LearnerConfig(base_model=str(tied_base), device="cpu", mode="full"))
    _train(policy, episodes)
    vdir = tmp_path / "policy-v1"
    vdir.mkdir()
    assert policy.save_weights(vdir) == "full"
    write_policy_json(vdir, 1, "full", tied_base)
    tier = TierConfig(servers=[tied_server], base_model=str(tied_base), policies_dir=str(tmp_path), replace_live=True)
    result = publisher.publish(vdir, tier, register=False)
    assert result.pushed == [tied_server] and vllm_client.weight_version(tied_server) == 1, result

    new = served_gap(policy, episodes, tied_server, SERVED)
    old = served_gap(base, episodes, tied_server, SERVED)
    assert new.max_abs < TOLERANCE, f"after the reload vLLM differs from the trained tied weights by {new.max_abs:.2e} " \
                                    f"(mean {new.mean_abs:.2e} over {new.tokens} tokens; limit {TOLERANCE})"
    assert old.max_abs > 1e-2, f"the trained weights are within {old.max_abs:.2e} of the base: the check proves nothing"

    # a tied export without the head (what transformers' own save writes) is refused; the server keeps v1
    hf_style = tmp_path / "policy-v2"
    shutil.copytree(vdir, hf_style)
    write_policy_json(hf_style, 2, "full", tied_base)
    tensors = load_file(str(hf_style / "model.safetensors"))
    del tensors[HEAD_KEY]
    save_file(tensors, str(hf_style / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PublishError, match="lacks lm_head.weight"):
        publisher.publish(hf_style, tier, register=False)
    assert vllm_client.weight_version(tied_server) == 1
    kept = served_gap(policy, episodes, tied_server, SERVED)
    assert kept.max_abs < TOLERANCE, f"a refused publish changed the served weights ({kept.max_abs:.2e})"

    publisher.reload_full(tied_server, tied_base, 0)  # the base is a reload target too (restore, rollback)
    back = served_gap(base, episodes, tied_server, SERVED)
    assert back.max_abs < TOLERANCE, f"after restoring the tied base vLLM differs from it by {back.max_abs:.2e}"
