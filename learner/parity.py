"""Train/inference parity: does the learner score served tokens as the server does?

Two measurements, both logged to MLflow:
- `behaviour_gap`: on rows the current weights produced (policy_version == current version and
  no step since it was published), |learner logprob - logged behaviour logprob| per token.
  At an unchanged version this is the pure train/inference mismatch (fp32: < 1e-3).
- `served_gap`: at each publish, a sample of recent episodes is scored by vLLM under the new
  version's served name (`prompt_logprobs` of prompt + completion ids) and by the learner;
  this checks the published artifact itself, not just the learner's copy.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from dataclasses import dataclass
from typing import Sequence

import torch

from flywheel.learner.data import Episode
from flywheel.learner.model import Policy, pack, token_logprobs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gap:
    """|a - b| over the compared tokens."""

    tokens: int
    mean_abs: float
    max_abs: float


def gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> Gap:
    """Mean and max |a - b| over mask == 1 ([B, T] each)."""
    d = (a.float() - b.float()).abs() * mask
    n = int(mask.sum())
    if n == 0:
        return Gap(0, 0.0, 0.0)
    return Gap(n, float(d.sum()) / n, float(d.max()))


@torch.no_grad()
def behaviour_gap(policy: Policy, episodes: Sequence[Episode]) -> Gap:
    """Learner vs logged behaviour logprobs for `episodes` (callers pass only current-version rows)."""
    if not episodes:
        return Gap(0, 0.0, 0.0)
    packed = pack(episodes, policy.device)
    logp = token_logprobs(policy.module, packed)
    # every completion token counts here, trained or masked: the server produced all of them
    full = torch.zeros_like(packed.mask)
    for i, e in enumerate(episodes):
        full[i, : len(e.completion_ids)] = 1.0
    return gap(logp, packed.logp_old, full)


def served_logprobs(vllm_url: str, model: str, episode: Episode, timeout: float = 30.0) -> list[float]:
    """vLLM's logprob of each completion token of `episode` under the served `model`."""
    ids = list(episode.prompt_ids) + list(episode.completion_ids)
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    request = urllib.request.Request(f"{vllm_url.rstrip('/')}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        choice = json.loads(response.read())["choices"][0]
    entries = choice["prompt_logprobs"]  # one per prompt position; None for the first token
    out: list[float] = []
    for pos, token in enumerate(ids[len(episode.prompt_ids):], start=len(episode.prompt_ids)):
        out.append(float(entries[pos][str(token)]["logprob"]))
    return out


@torch.no_grad()
def served_gap(policy: Policy, episodes: Sequence[Episode], vllm_url: str, model: str) -> Gap:
    """Learner vs vLLM (serving `model`) logprobs of the same served tokens."""
    if not episodes:
        return Gap(0, 0.0, 0.0)
    packed = pack(episodes, policy.device)
    logp = token_logprobs(policy.module, packed, processed=False)  # prompt_logprobs are the plain log-softmax
    served = torch.zeros_like(logp)
    full = torch.zeros_like(packed.mask)
    for i, e in enumerate(episodes):
        values = served_logprobs(vllm_url, model, e)
        served[i, : len(values)] = torch.tensor(values, device=served.device)
        full[i, : len(values)] = 1.0
    return gap(logp, served, full)
