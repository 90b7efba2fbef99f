"""The learner's behaviour distribution under sampling settings: processed log-softmax, refusal rule, fast path."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import torch

from bench.fixtures.episodes import episode_row, random_rows, write_episodes
from bench.fixtures.models import tiny_model
from flywheel.learner import dist, model
from flywheel.learner.checkpoint import TrainerState
from flywheel.learner.config import LearnerConfig
from flywheel.learner.data import Episode, EpisodeStream, unsupported_sampling
from flywheel.learner.model import (
    Sampling,
    load_policy,
    pack,
    processed_log_softmax,
    token_logprobs,
)
from flywheel.learner.trainer import Trainer


def brute_force(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Log-probabilities by the definition, one position, in float64: logits / T, top-k, nucleus, renormalise."""
    z = [x / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept = set(order[:top_k]) if 0 < top_k < len(z) else set(order)
    m = max(z)
    total = sum(math.exp(z[i] - m) for i in kept)
    probs = {i: math.exp(z[i] - m) / total for i in kept}
    if top_p < 1.0:
        nucleus, mass = set(), 0.0
        for i in sorted(kept, key=lambda i: -probs[i]):  # the smallest most-probable set reaching top_p
            nucleus.add(i)
            mass += probs[i]
            if mass >= top_p:
                break
        kept = nucleus
    total = sum(math.exp(z[i] - m) for i in kept)
    return [z[i] - m - math.log(total) if i in kept else -math.inf for i in range(len(z))]


CASES = {  # (temperature, top_k, top_p) per row of one micro-batch: rows differ, as traffic does
    "temperature only": [(0.7, 0, 1.0), (1.3, 0, 1.0)],
    "top-k only": [(1.0, 3, 1.0), (1.0, 7, 1.0)],
    "top-p only": [(1.0, 0, 0.9), (1.0, 0, 0.5)],
    "both": [(0.7, 5, 0.9), (0.5, 8, 0.8)],
    "mixed with a neutral row": [(1.0, 0, 1.0), (0.7, 0, 0.9)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_processed_log_softmax_matches_the_definition(case: str) -> None:
    rows = CASES[case]
    logits = torch.randn(len(rows), 4, 12, generator=torch.Generator().manual_seed(3)) * 2.0  # [B, T, V]
    sampling = Sampling(torch.tensor([t for t, _, _ in rows]), torch.tensor([k for _, k, _ in rows]),
                        torch.tensor([p for _, _, p in rows]))
    got = processed_log_softmax(logits, sampling)
    for b, (t, k, p) in enumerate(rows):
        for pos in range(logits.shape[1]):
            want = torch.tensor(brute_force(logits[b, pos].tolist(), t, k, p), dtype=torch.float32)
            assert torch.equal(torch.isinf(got[b, pos]), torch.isinf(want)), \
                f"{case} row {b} pos {pos}: kept {(~torch.isinf(got[b, pos])).nonzero().flatten().tolist()}, " \
                f"definition keeps {(~torch.isinf(want)).nonzero().flatten().tolist()}"
            finite = ~torch.isinf(want)
            err = float((got[b, pos][finite] - want[finite]).abs().max())
            assert err < 1e-5, f"{case} row {b} pos {pos}: max |error| {err:.2e}"


def test_a_served_token_outside_the_new_nucleus_keeps_a_finite_logprob_and_gradient() -> None:
    logits = torch.tensor([[[5.0, 4.0, 0.0, -3.0]]], requires_grad=True)  # [1, 1, 4]
    sampling = Sampling(torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.5]))
    assert torch.isinf(processed_log_softmax(logits, sampling)[0, 0, 3]), "token 3 lies outside top_p 0.5"
    logp = processed_log_softmax(logits, sampling, keep=torch.tensor([[3]]))[0, 0, 3]
    logp.backward()
    assert math.isfinite(float(logp.detach())) and torch.isfinite(logits.grad).all(), (float(logp.detach()), logits.grad)


@pytest.mark.parametrize("sampling,reason", [
    (None, None),
    ({"temperature": 0.7, "top_p": 0.9, "top_k": 40, "max_tokens": 64, "seed": 1, "stop": ["\n"]}, None),
    ({"temperature": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "logit_bias": {}}, None),
    ({"temperature": 0.0}, "temperature 0 (greedy sampling)"),
    ({"temperature": 0.7, "min_p": 0.05}, "min_p != 0.0"),
    ({"presence_penalty": 0.5}, "presence_penalty != 0.0"),
    ({"frequency_penalty": 0.1}, "frequency_penalty != 0.0"),
    ({"repetition_penalty": 1.1}, "repetition_penalty != 1.0"),
    ({"logit_bias": {"42": -100}}, "logit_bias set"),
    ({"top_p": 0.0}, "top_p outside (0, 1]"),
    ({"top_k": 2.5}, "top_k is not a valid number"),
    ({"temperature": "hot"}, "temperature is not a valid number"),
    ({"typical_p": 0.9}, "unknown sampling parameter 'typical_p'"),
])
def test_unsupported_sampling_names_what_cannot_be_corrected(sampling: dict | None, reason: str | None) -> None:
    assert unsupported_sampling(sampling) == reason


def test_the_stream_refuses_and_counts_unsupported_rows_logging_each_reason_once(tmp_path: Path, caplog) -> None:
    def row(i: int, sampling: dict) -> dict:
        r = episode_row(prompt=[5, 6], completion=[7, 8], logprobs=[-1.0, -1.0], reward=1.0, episode_id=f"e{i}")
        return r | {"sampling": json.dumps(sampling)}

    refused = write_episodes(tmp_path, [row(1, {"temperature": 0.0}), row(2, {"temperature": 0.0}),
                                        row(3, {"min_p": 0.1})], seq=0)
    write_episodes(tmp_path, [row(0, {"temperature": 0.7, "top_p": 0.9})], seq=1)
    s = EpisodeStream(str(tmp_path), vocab_size=512, max_seq_len=256)
    with caplog.at_level(logging.WARNING, logger="flywheel.learner.data"):
        assert s.poll() == 1
    assert s.counters["unsupported_sampling"] == 3, s.counters
    assert caplog.text.count("greedy") == 1 and caplog.text.count("min_p") == 1, caplog.text
    assert [(p.episode.episode_id, p.episode.sampling) for p in s.pending] == [("e0", {"temperature": 0.7, "top_p": 0.9})]
    assert s.cursor == {refused.key: 0}, "a file of refused rows must not hold the cursor back"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _episodes(sampling: dict | None, n: int = 3) -> list[Episode]:
    out = []
    for i, r in enumerate(random_rows(n, seed=5, prompt_len=6, completion_len=5)):
        r = r | {"completion_token_ids": r["completion_token_ids"][: 3 + i], "completion_logprobs":
                 r["completion_logprobs"][: 3 + i], "loss_mask": r["loss_mask"][: 3 + i]}
        e = Episode(r["episode_id"], 1, "t", None, 0, tuple(r["prompt_token_ids"]),
                          tuple(r["completion_token_ids"]), tuple(r["completion_logprobs"]), tuple(r["loss_mask"]), 1.0)
        out.append(dataclasses.replace(e, sampling=sampling))
    return out


@pytest.mark.parametrize("sampling", [None, {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8}])
def test_temperature_1_without_truncation_is_the_old_path_bit_for_bit(model_dir: Path, sampling: dict | None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    policy = load_policy(LearnerConfig(base_model=str(model_dir), device="cpu"))
    packed = pack(_episodes(sampling), policy.device)
    assert packed.sampling is None
    with torch.no_grad():
        # the code of token_logprobs before sampling settings existed, verbatim
        logits = policy.module(input_ids=packed.input_ids, attention_mask=packed.attention_mask, use_cache=False).logits
        idx = packed.gather_pos[:, :, None].expand(-1, -1, logits.shape[-1])
        old = torch.gather(torch.log_softmax(torch.gather(logits, 1, idx).float(), dim=-1), 2,
                           packed.targets[:, :, None]).squeeze(-1)
        monkeypatch.setattr(model, "truncation_mask", lambda *a: pytest.fail("the fast path sorted the vocabulary"))
        new = token_logprobs(policy.module, packed)
    assert torch.equal(new, old), f"max |new - old| {float((new - old).abs().max()):.3e}"


def test_a_step_on_policy_at_t07_top_p_09_has_ratio_1_and_a_kl_of_raw_logprobs(model_dir: Path) -> None:
    """On-policy rows (behaviour logprobs = the learner's processed ones) at an identity adapter: ratio 1, KL 0."""
    cfg = LearnerConfig(base_model=str(model_dir), device="cpu", lora_rank=4, kl_coef=0.1, micro_batch=2)
    policy = load_policy(cfg)
    episodes = _episodes({"temperature": 0.7, "top_p": 0.9})
    with torch.no_grad():
        processed = token_logprobs(policy.module, pack(episodes, policy.device))
        raw = token_logprobs(policy.module, pack(episodes, policy.device), processed=False)
    assert float((processed - raw).abs().max()) > 0.05, "T 0.7 / top_p 0.9 must change the logprobs"
    on_policy = [dataclasses.replace(e, behaviour_logprobs=tuple(processed[i, : len(e.completion_ids)].tolist()))
                 for i, e in enumerate(episodes)]
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
    trainer = Trainer(cfg, dist.World(0, 1), policy, optimizer, TrainerState())
    result = trainer.step([(e, 1.0) for e in on_policy])
    assert abs(result.ratio_mean - 1.0) < 1e-5 and abs(result.ratio_max - 1.0) < 1e-5, result
    assert result.behaviour_gap_max is not None and result.behaviour_gap_max < 1e-5, result
    assert result.kl == 0.0, f"policy == base: the KL of raw logprobs is 0, got {result.kl}"
