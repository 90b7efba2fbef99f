"""Tied input/output embeddings (Qwen2.5 0.5-3B, Llama 3.2 1-3B): full-weight training, export and publish checks.

vLLM's in-place reload is exact for a tied model only when the file holds lm_head.weight equal to
the embeddings (flywheel.learner.model.write_tied_head says why; tests/integration/test_tied_reload.py
measures it against a real server). These tests hold the pure parts: the export, the learner's one
shared matrix, and the publisher's refusals.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.fixtures.models import write_policy_json
from flywheel.demo import model_init
from flywheel.learner.config import LearnerConfig
from flywheel.learner.data import Episode
from flywheel.learner.model import (
    EMBED_KEY,
    HEAD_KEY,
    Packed,
    load_policy,
    pack,
    token_logprobs,
    write_tied_head,
)
from flywheel.serving import publisher, vllm_client
from flywheel.serving.publisher import PublishError
from flywheel.serving.tier import TierConfig


def _build(out: Path, tied: bool) -> Path:
    cfg = model_init.ModelInitConfig(out=out, force=True, vocab_size=300, hidden_size=64, num_layers=1, num_heads=1,
                                     num_kv_heads=1, intermediate_size=128, max_position_embeddings=128,
                                     corpus_lines=300, tie_word_embeddings=tied)
    cfg.check()
    return model_init.init_model(cfg)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("tied") / "base", tied=True)


def _ep(prompt: list[int], completion: list[int]) -> Episode:
    return Episode("e", 1, "t", None, 0, tuple(prompt), tuple(completion), tuple([-1.0] * len(completion)),
                   tuple([1] * len(completion)), 1.0)


def _head_only_loss(model: torch.nn.Module, packed: Packed) -> torch.Tensor:
    """The summed completion logprobs with the input lookup detached: only the head's use of the matrix has a gradient."""
    inputs = model.get_input_embeddings()(packed.input_ids).detach()  # [B, L, H]
    logits = model(inputs_embeds=inputs, attention_mask=packed.attention_mask).logits  # [B, L, V]
    picked = logits.gather(1, packed.gather_pos[:, :, None].expand(-1, -1, logits.shape[-1])).log_softmax(-1)
    return picked.gather(2, packed.targets[:, :, None]).sum()


def test_model_init_tied_option_writes_the_head_and_the_default_stays_untied(tied_dir: Path, tmp_path: Path) -> None:
    assert json.loads((tied_dir / "config.json").read_text())["tie_word_embeddings"] is True
    tensors = load_file(str(tied_dir / "model.safetensors"))
    assert torch.equal(tensors[HEAD_KEY], tensors[EMBED_KEY]), "the tied base must carry lm_head.weight == embeddings"
    untied = _build(tmp_path / "untied", tied=False)
    assert json.loads((untied / "config.json").read_text())["tie_word_embeddings"] is False
    assert model_init.ModelInitConfig().tie_word_embeddings is False, "the demo's model must stay untied"
    u = load_file(str(untied / "model.safetensors"))
    assert not torch.equal(u[HEAD_KEY], u[EMBED_KEY]), "an untied model has a head of its own"


def test_write_tied_head_adds_a_bitwise_copy_once_and_refuses_a_different_head(tied_dir: Path, tmp_path: Path,
                                                                               caplog: pytest.LogCaptureFixture) -> None:
    hf_style = tmp_path / "hf"
    shutil.copytree(tied_dir, hf_style)
    tensors = load_file(str(hf_style / "model.safetensors"))
    del tensors[HEAD_KEY]  # what transformers' save_pretrained writes for a tied model
    save_file(tensors, str(hf_style / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="flywheel.learner.model"):
        load_policy(LearnerConfig(base_model=str(hf_style), device="cpu", mode="full"))
    assert "write_tied_head" in caplog.text, "a tied base without the head must be named at start-up"
    assert write_tied_head(hf_style) is True
    after = load_file(str(hf_style / "model.safetensors"))
    assert set(after) == set(tensors) | {HEAD_KEY}
    assert torch.equal(after[HEAD_KEY], after[EMBED_KEY])
    assert write_tied_head(hf_style) is False, "a file that already carries the head is left alone"
    after[HEAD_KEY] = after[HEAD_KEY] + 1.0
    save_file(after, str(hf_style / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="differs"):
        write_tied_head(hf_style)


def test_full_mode_trains_one_shared_matrix_and_saves_it_tied(tied_dir: Path, tmp_path: Path) -> None:
    policy = load_policy(LearnerConfig(base_model=str(tied_dir), device="cpu", mode="full"))
    model = policy.module
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed is head, "the HF model must share one Parameter between embeddings and head"
    assert sum(p is embed for p in policy.trainable_parameters()) == 1, "the optimizer must see the matrix once"
    packed = pack([_ep([5, 6, 7, 8], [9, 10, 11])], policy.device)
    (both,) = torch.autograd.grad(token_logprobs(model, packed).sum(), embed)
    (head_only,) = torch.autograd.grad(_head_only_loss(model, packed), embed)
    lookup = both - head_only  # [V, H] the gradient through the input lookup
    assert float(head_only[200].abs().sum()) > 0, "no gradient from the head's use of the matrix"
    assert float(lookup[5].abs().sum()) > 1e-6, "no gradient from the embedding lookup of an input token"
    assert float(lookup[200].abs().max()) < 1e-6, "an id never looked up got a lookup gradient"
    token_logprobs(model, packed).sum().backward()
    opt = torch.optim.SGD(policy.trainable_parameters(), lr=0.1)
    before = embed.detach().clone()
    opt.step()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "the step untied them"
    assert not torch.equal(before, embed.detach())
    out = tmp_path / "policy-v1"
    out.mkdir()
    assert policy.save_weights(out) == "full"
    saved = load_file(str(out / "model.safetensors"))
    assert torch.equal(saved[HEAD_KEY], saved[EMBED_KEY]) and torch.equal(saved[EMBED_KEY], embed.detach())
    fresh = load_policy(LearnerConfig(base_model=str(tied_dir), device="cpu", mode="full"))
    fresh.load_published(out)
    f = fresh.module
    assert f.get_input_embeddings().weight is f.get_output_embeddings().weight
    assert torch.equal(f.get_input_embeddings().weight.detach(), embed.detach())


def _version_dir(src: Path, out: Path, version: int) -> Path:
    shutil.copytree(src, out)
    write_policy_json(out, version, "full", src)
    return out


def test_publisher_accepts_a_tied_version_with_its_head_and_refuses_one_without(tied_dir: Path, tmp_path: Path) -> None:
    tier = TierConfig(base_model=str(tied_dir), policies_dir=str(tmp_path))
    good = _version_dir(tied_dir, tmp_path / "policy-v1", 1)
    assert publisher.load_version(good, tier).kind == "full"
    bad = _version_dir(tied_dir, tmp_path / "policy-v2", 2)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors[HEAD_KEY]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PublishError, match="lacks lm_head.weight"):
        publisher.load_version(bad, tier)
    # the same refusal before any request on a reload (a restore of a base saved by transformers):
    # port 9 answers nothing, so a request would fail with a connection error instead
    with pytest.raises(vllm_client.ServerError, match="lacks lm_head.weight"):
        publisher.reload_full("http://127.0.0.1:9", bad, 2, timeout=1.0)
    differing = _version_dir(tied_dir, tmp_path / "policy-v3", 3)
    tensors = load_file(str(differing / "model.safetensors"))
    tensors[HEAD_KEY] = tensors[HEAD_KEY] * 2
    save_file(tensors, str(differing / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PublishError, match="differs from"):
        publisher.load_version(differing, tier)
