"""On-policy importance ratios under real sampling settings, against the real vLLM server.

Completions are sampled from the served base model (policy-v0) at temperature 0.7 and top_p 0.9
with the request parameters the capture proxy sends (`logprobs`, `return_token_ids`), and become
episode rows carrying those settings as their `sampling` column. The learner's scoring path on the
same weights must give exp(logp_new - logp_old) within 1e-3 of 1 for every token; the plain
log-softmax (what the learner did before, and what vLLM returns without
`--logprobs-mode processed_logprobs`) must not, so the test can tell the two apart.
"""

from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path
from typing import Any

import torch

from bench.fixtures.episodes import episode_row
from flywheel.learner.config import LearnerConfig
from flywheel.learner.data import Episode, parse_row, unsupported_sampling
from flywheel.learner.model import load_policy, pack, token_logprobs

SETTINGS = [{"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20}]


def _sample(vllm_url: str, prompt: list[int], sampling: dict[str, Any]) -> list[dict[str, Any]]:
    """Episode rows of 4 completions of `prompt`, with the proxy's request parameters (serving/proxy.py)."""
    body = {"model": "policy-v0", "prompt": prompt, "max_tokens": 12, "n": 4, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True, **sampling}
    request = urllib.request.Request(f"{vllm_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        choices = json.loads(response.read())["choices"]
    rows = []
    for choice in choices:
        row = episode_row(prompt=prompt, completion=[int(t) for t in choice["token_ids"]],
                          logprobs=[float(x) for x in choice["logprobs"]["token_logprobs"]], reward=1.0)
        rows.append(row | {"sampling": json.dumps(sampling)})  # as the lake holds it: JSON text
    return rows


def _ratio_error(logp: torch.Tensor, logp_old: torch.Tensor, full: torch.Tensor) -> float:
    """max over tokens of |exp(logp - logp_old) - 1|."""
    return float(((logp - logp_old).exp() - 1.0).abs().mul(full).max())


def test_on_policy_ratios_are_1_at_temperature_07_top_p_09(vllm_url: str, base_model_dir: Path) -> None:
    rng = random.Random(11)
    policy = load_policy(LearnerConfig(base_model=str(base_model_dir), device="cpu"))
    for sampling in SETTINGS:
        rows = []
        for _ in range(6):
            rows += _sample(vllm_url, [1] + [rng.randrange(3, 512) for _ in range(6)], sampling)
        episodes = [parse_row(r, policy.vocab_size, 2048) for r in rows]
        assert all(isinstance(e, Episode) for e in episodes), episodes
        assert all(unsupported_sampling(e.sampling) is None and e.sampling == sampling for e in episodes)  # type: ignore[union-attr]
        packed = pack(episodes, policy.device)  # type: ignore[arg-type]
        with torch.no_grad():
            processed = token_logprobs(policy.module, packed)
            raw = token_logprobs(policy.module, packed, processed=False)
        full = torch.zeros_like(packed.mask)
        for i, e in enumerate(episodes):
            full[i, : len(e.completion_ids)] = 1.0  # type: ignore[union-attr]
        err, err_raw = _ratio_error(processed, packed.logp_old, full), _ratio_error(raw, packed.logp_old, full)
        print(f"{sampling}: {int(full.sum())} tokens, max |ratio - 1| {err:.2e} processed, {err_raw:.2e} raw")
        assert err < 1e-3, (
            f"{sampling}: on-policy ratios off by up to {err:.2e} over {int(full.sum())} tokens (raw log-softmax: "
            f"{err_raw:.2e}); a server started without --logprobs-mode processed_logprobs returns raw logprobs")
        assert err_raw > 1e-3, f"{sampling}: the raw log-softmax gives ratios within {err_raw:.2e} of 1: the test cannot fail"
