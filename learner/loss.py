"""Token-level policy gradient on logged tokens, with an importance correction for staleness.

Shapes (named once, used throughout):
    B  rows in a micro-batch          T  completion positions (right-padded)
    logp_new   [B, T]  learner logprob of each served completion token (requires grad)
    logp_old   [B, T]  behaviour logprob the serving policy reported for that token
    logp_ref   [B, T]  base-model logprob (KL anchor), no grad
    mask       [B, T]  1.0 on trained completion tokens (loss_mask), 0.0 on padding/masked tokens
    adv        [B]     advantage of the row, broadcast over its tokens

The data were sampled by an older policy (the behaviour policy, whose logprobs were logged),
so each token's gradient is weighted by the ratio pi_new / pi_old = exp(logp_new - logp_old):
- "tis": truncated importance sampling, weight min(ratio, c) detached, times adv * grad logp_new
  (unbiased up to the truncation; bounded variance);
- "ppo": the clipped surrogate -min(ratio * adv, clip(ratio, 1-eps, 1+eps) * adv).
KL to the base model uses the k3 estimator exp(ref - new) - (ref - new) - 1 (>= 0, unbiased).

Aggregation ("token" or "sequence"): "token" sums over tokens and divides by the token count of
the GLOBAL batch (all micro-batches, all ranks); "sequence" first averages each row over its own
tokens and divides by the global row count, so every row weighs the same whatever its length.
Either way gradient accumulation and data parallelism give the same gradient as one big batch.
Why "sequence" exists: the advantage is one number per row, so under "token" a row that rambled
to max_tokens pulls several times harder than a crisp 20-token tool call with the same advantage;
"sequence" keeps the advantages' zero sum (batch baseline) a zero sum of pulls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

KL_CLAMP = 10.0  # per-token cap of the k3 KL estimate (see policy_loss)


@dataclass
class LossStats:
    """Sums over the masked tokens of one micro-batch (the caller adds them up over the step)."""

    tokens: float = 0.0
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    clipped: float = 0.0  # tokens whose weight was truncated (tis) or clipped (ppo)
    kl_sum: float = 0.0
    mismatch_sum: float = 0.0  # |logp_new - logp_old|: the train/inference (and staleness) gap
    mismatch_max: float = 0.0

    def add(self, other: "LossStats") -> None:
        self.tokens += other.tokens
        self.ratio_sum += other.ratio_sum
        self.ratio_max = max(self.ratio_max, other.ratio_max)
        self.clipped += other.clipped
        self.kl_sum += other.kl_sum
        self.mismatch_sum += other.mismatch_sum
        self.mismatch_max = max(self.mismatch_max, other.mismatch_max)


def policy_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, *,
                kind: str, tis_cap: float, ppo_eps: float, token_normalizer: float,
                logp_ref: torch.Tensor | None = None, kl_coef: float = 0.0,
                agg: str = "token") -> tuple[torch.Tensor, LossStats]:
    """Scalar loss of one micro-batch and its stats.

    token_normalizer: the GLOBAL batch's trained-token count (agg "token") or row count ("sequence").
    """
    assert logp_new.shape == logp_old.shape == mask.shape, f"shapes {logp_new.shape} {logp_old.shape} {mask.shape}"
    assert adv.shape == logp_new.shape[:1], f"adv {adv.shape} vs batch {logp_new.shape[:1]}"
    assert token_normalizer > 0, "token_normalizer must count the global batch's trained tokens (or rows)"
    mask = mask.to(logp_new.dtype)
    adv_bt = adv.to(logp_new.dtype)[:, None].expand_as(logp_new)  # [B, T]
    log_ratio = (logp_new - logp_old).masked_fill(mask == 0, 0.0)  # [B, T]; padding may hold junk
    ratio = torch.exp(log_ratio)  # [B, T]
    if kind == "tis":
        weight = torch.clamp(ratio.detach(), max=tis_cap)  # [B, T]
        per_token = -weight * adv_bt * logp_new
        clipped = (ratio.detach() > tis_cap).to(mask.dtype)
    elif kind == "ppo":
        unclipped = ratio * adv_bt
        clipped_obj = torch.clamp(ratio, 1.0 - ppo_eps, 1.0 + ppo_eps) * adv_bt
        per_token = -torch.minimum(unclipped, clipped_obj)
        # the clip is active where the clipped branch is the (strictly) smaller objective
        clipped = (clipped_obj.detach() < unclipped.detach()).to(mask.dtype)
    else:
        raise ValueError(f"unknown loss kind {kind!r} (tis or ppo)")
    kl_tok = torch.zeros_like(logp_new)
    if logp_ref is not None and kl_coef > 0:
        d = (logp_ref - logp_new).masked_fill(mask == 0, 0.0)  # [B, T]
        # k3 grows like exp(d): one sampled token the policy has moved far below the base (d ~ 10)
        # outweighed the whole batch (a demo step logged kl 297 and loss +115). Clamped as verl's
        # low_var_kl does: beyond KL_CLAMP a token adds a constant and no gradient.
        kl_tok = torch.clamp(torch.exp(d) - d - 1.0, max=KL_CLAMP)
        per_token = per_token + kl_coef * kl_tok
    if agg == "token":
        loss = (per_token * mask).sum() / token_normalizer
    elif agg == "sequence":
        row_tokens = mask.sum(dim=1).clamp(min=1.0)  # [B]
        loss = ((per_token * mask).sum(dim=1) / row_tokens).sum() / token_normalizer
    else:
        raise ValueError(f"unknown loss aggregation {agg!r} (token or sequence)")
    with torch.no_grad():
        gap = (logp_new - logp_old).abs() * mask
        stats = LossStats(
            tokens=float(mask.sum()),
            ratio_sum=float((ratio * mask).sum()),
            ratio_max=float((ratio * mask).max()) if mask.any() else 0.0,
            clipped=float((clipped * mask).sum()),
            kl_sum=float((kl_tok * mask).sum()),
            mismatch_sum=float(gap.sum()),
            mismatch_max=float(gap.max()) if mask.any() else 0.0,
        )
    return loss, stats


@dataclass
class Baseline:
    """Running mean reward per task_type (persisted in the checkpoint)."""

    momentum: float
    means: dict[str, float]

    def state(self) -> dict[str, float]:
        return dict(self.means)

    def update(self, batch_means: dict[str, float]) -> None:
        """Move each task_type's mean toward this batch's (the batch mean the first time a task_type is seen)."""
        for t, batch_mean in batch_means.items():
            prev = self.means.get(t)
            self.means[t] = batch_mean if prev is None else self.momentum * prev + (1 - self.momentum) * batch_mean


def task_means(rewards: Sequence[float], task_types: Sequence[str]) -> dict[str, float]:
    """Mean reward of each task_type in the batch."""
    by_task: dict[str, list[float]] = {}
    for r, t in zip(rewards, task_types):
        by_task.setdefault(t, []).append(r)
    return {t: sum(rs) / len(rs) for t, rs in by_task.items()}


def group_means(rewards: Sequence[float], group_ids: Sequence[str | None]) -> dict[int, float]:
    """Row index -> its group's mean reward, for the rows whose group_id is shared by >= 2 rows."""
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        if g is not None:
            groups.setdefault(g, []).append(i)
    means: dict[int, float] = {}
    for members in groups.values():
        if len(members) >= 2:
            mean = sum(rewards[i] for i in members) / len(members)
            means.update(dict.fromkeys(members, mean))
    return means


def scaled_by_std(adv: list[float]) -> list[float]:
    """Advantages divided by their sample std (>= 2 rows), unchanged when that std is (nearly) 0."""
    n = len(adv)
    mean = sum(adv) / n
    std = math.sqrt(sum((a - mean) ** 2 for a in adv) / (n - 1))
    # scale only: the baseline already centres the advantages, and re-centring would undo it.
    # Equal rewards (std 0) are not scaled: dividing by 1e-6 turned a batch of all-failed rows
    # (a collapsing run) into advantages of -2e5, a full-size step of "push everything down".
    return [a / std for a in adv] if std > 1e-3 else adv


def advantages(rewards: Sequence[float], task_types: Sequence[str], group_ids: Sequence[str | None],
               baseline: Baseline | None, *, group_relative: bool, normalize: bool,
               batch_baseline: bool = False, positive_only: bool = False) -> list[float]:
    """Per-row advantages of one global batch; updates the running baseline with this batch.

    Rows whose group_id is shared by >= 2 rows of the batch use their group's mean reward as the
    baseline (group-relative, as in GRPO); the others use the batch mean of their task_type
    (batch_baseline), else the running mean of their task_type (the batch mean the first time it
    is seen), or 0 without a baseline.

    Why a batch baseline: a running mean lags a policy that changes. When success fell after a bad
    step, the lagging mean made nearly every advantage negative, the next step pushed every sampled
    token down, success fell further: on the demo's task, sampled on-policy at lr 1e-3, from 31% to
    6% in 3 steps.
    The batch mean makes the advantages of each task_type sum to zero in every step.

    positive_only: advantages below 0 become 0, so only rows better than their baseline are
    reinforced (and the learner skips the rest). Pushing down the tokens of failed rows is what
    collapsed the demo's tiny policy: with few successes the push-downs dominated, malformed calls
    rose from 15% to 47% of rows in ten versions and success fell from 21% to 0%.
    """
    n = len(rewards)
    assert n == len(task_types) == len(group_ids), "rewards, task_types and group_ids differ in length"
    batch_means = task_means(rewards, task_types)
    in_group = group_means(rewards, group_ids) if group_relative else {}
    base = [0.0] * n
    for i, t in enumerate(task_types):
        if i in in_group:
            base[i] = in_group[i]
        elif batch_baseline:
            base[i] = batch_means[t]
        elif baseline is not None:
            base[i] = baseline.means.get(t, batch_means[t])
    adv = [r - b for r, b in zip(rewards, base)]
    if baseline is not None:
        baseline.update(batch_means)  # after the rows read it: their running baseline is that of earlier batches
    if normalize and n > 1:
        adv = scaled_by_std(adv)
    if positive_only:
        adv = [max(a, 0.0) for a in adv]
    return adv
