"""Token-level policy gradient on logged tokens, with an importance correction for staleness.

Shapes (named once, used throughout):
    B  rows in a micro-batch          T  completion positions (right-padded)
    logp_new   [B, T]  learner logprob of each served completion token (requires grad)
    logp_old   [B, T]  behaviour logprob the serving policy reported for that token
    logp_ref   [B, T]  base-model logprob (KL anchor), no grad
    logp_kl    [B, T]  learner logprob in logp_ref's terms (plain log-softmax) where logp_new is
                       taken under sampling settings (temperature, top-p); logp_new otherwise
    kl_exact   [B, T]  the full-vocabulary KL(new || ref) at each position (kl_estimator exact), in place of k3
    mask       [B, T]  1.0 on trained completion tokens (loss_mask), 0.0 on padding/masked tokens
    adv        [B]     advantage of the row, broadcast over its tokens

The data were sampled by an older policy (the behaviour policy, whose logprobs were logged),
so each token's gradient is weighted by the ratio pi_new / pi_old = exp(logp_new - logp_old):
- "tis": truncated importance sampling, weight min(ratio, c) detached, times adv * grad logp_new
  (unbiased up to the truncation; bounded variance);
- "ppo": the clipped surrogate -min(ratio * adv, clip(ratio, 1-eps, 1+eps) * adv).
KL to the base model uses the k3 estimator exp(ref - new) - (ref - new) - 1 (>= 0; unbiased for KL(new || ref) when
the tokens were sampled by the current policy), or the exact per-position KL the caller computed over the vocabulary.

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
                agg: str = "token", logp_kl: torch.Tensor | None = None,
                kl_exact: torch.Tensor | None = None) -> tuple[torch.Tensor, LossStats]:
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
    if kl_exact is not None and kl_coef > 0:
        assert kl_exact.shape == logp_new.shape, f"kl_exact {kl_exact.shape} vs {logp_new.shape}"
        kl_tok = torch.clamp(kl_exact.masked_fill(mask == 0, 0.0), max=KL_CLAMP)  # the same cap as k3's
        per_token = per_token + kl_coef * kl_tok
    elif logp_ref is not None and kl_coef > 0:
        d = (logp_ref - (logp_new if logp_kl is None else logp_kl)).masked_fill(mask == 0, 0.0)  # [B, T]
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
    return {t: total / count for t, (total, count) in key_sums(rewards, task_types).items()}


def key_sums(rewards: Sequence[float], keys: Sequence[str | None]) -> dict[str, tuple[float, int]]:
    """key -> (sum of its rows' rewards, row count); rows whose key is None are left out."""
    sums: dict[str, tuple[float, int]] = {}
    for r, k in zip(rewards, keys):
        if k is not None:
            total, count = sums.get(k, (0.0, 0))
            sums[k] = (total + r, count + 1)
    return sums


def row_baselines(rewards: Sequence[float], task_types: Sequence[str], group_ids: Sequence[str | None],
                  running: Baseline | None, *, group_relative: bool, batch_baseline: bool) -> list[float]:
    """Each row's baseline, by the rule `advantages` states (the running mean as it was before this batch)."""
    n = len(rewards)
    groups = key_sums(rewards, group_ids) if group_relative else {}
    types = key_sums(rewards, task_types)
    total = sum(rewards)
    base: list[float] = []
    for r, t, g in zip(rewards, task_types, group_ids):
        g_sum, g_n = groups.get(g, (0.0, 0)) if g is not None else (0.0, 0)
        t_sum, t_n = types[t]
        if g_n >= 2:
            base.append((g_sum - r) / (g_n - 1))  # the other members of its group
        elif not batch_baseline:
            base.append(running.means.get(t, t_sum / t_n) if running is not None else 0.0)
        elif t_n >= 2:
            base.append((t_sum - r) / (t_n - 1))  # the other rows of its task_type
        elif running is not None and t in running.means:
            base.append(running.means[t])  # alone in its task_type: what earlier batches of it earned
        elif n >= 2:
            base.append((total - r) / (n - 1))  # ... and never seen before: every other row of the batch
        else:
            base.append(r)  # the only row of the batch: nothing to compare it with
    return base


def std_scale(adv: Sequence[float]) -> float:
    """The sample std of the advantages (>= 2 rows), or 1.0 when it is (nearly) 0 or there is one row."""
    n = len(adv)
    if n < 2:
        return 1.0
    mean = sum(adv) / n
    std = math.sqrt(sum((a - mean) ** 2 for a in adv) / (n - 1))
    # scale only: the baseline already centres the advantages, and re-centring would undo it.
    # Equal rewards (std 0) are not scaled: dividing by 1e-6 turned a batch of all-failed rows
    # (a collapsing run) into advantages of -2e5, a full-size step of "push everything down".
    return std if std > 1e-3 else 1.0


def advantages(rewards: Sequence[float], task_types: Sequence[str], group_ids: Sequence[str | None],
               baseline: Baseline | None, *, group_relative: bool, normalize: bool,
               batch_baseline: bool = False, positive_only: bool = False,
               penalties: Sequence[float] | None = None) -> list[float]:
    """Per-row advantages of one global batch; updates the running baseline with this batch.

    Baselines, all leave-one-out where they come from the batch: a row whose group_id is shared by
    >= 2 rows uses the mean of the OTHER members of its group (group-relative, as in GRPO); the others,
    with batch_baseline, the mean of the other rows of their task_type. A row alone in its task_type
    takes that task_type's running mean (when `baseline` has seen it), else the mean of every other row
    of the batch; the only row of a batch gets advantage 0. Without batch_baseline: the running mean of
    the task_type (the batch mean the first time it is seen), or 0 without a baseline.
    Why leave-one-out: with the row inside its own baseline, its reward pulls the baseline toward
    itself (the baseline is then correlated with the row, and the gradient biased); without it the
    baseline is independent of the row. With n rows the LOO advantage is n/(n-1) times the
    mean-centred one, and a task_type's advantages still sum to zero in every step.
    Why a batch baseline: a running mean lags a policy that changes. When success fell after a bad
    step, the lagging mean made nearly every advantage negative, the next step pushed every sampled
    token down, success fell further: on the demo's task, sampled on-policy at lr 1e-3, from 31% to
    6% in 3 steps.

    penalties: each row's r_penalty (<= 0; the part of its reward that is penalties; positive values
    are ignored). The baseline advantage A is computed on the reward WITHOUT the penalty (the others'
    baselines too); a penalised row then gets min(A, 0) + r_penalty, so it is never reinforced, however
    well its session ended (a malformed first call of a session that succeeds).
    normalize: every advantage is divided by the one std of the A's (penalties included afterwards).
    positive_only: advantages below 0 become 0, so only rows better than their baseline are
    reinforced (and the learner skips the rest); a penalised row keeps its penalty (its min(A, 0)
    part is dropped like every negative A). Pushing down the tokens of failed rows is what
    collapsed the demo's tiny policy: with few successes the push-downs dominated, malformed calls
    rose from 15% to 47% of rows in ten versions and success fell from 21% to 0%.
    """
    n = len(rewards)
    pen = [min(float(p), 0.0) for p in penalties] if penalties is not None else [0.0] * n
    assert n == len(task_types) == len(group_ids) == len(pen), \
        "rewards, task_types, group_ids and penalties differ in length"
    earned = [r - p for r, p in zip(rewards, pen)]  # the reward without its penalties
    base = row_baselines(earned, task_types, group_ids, baseline, group_relative=group_relative,
                         batch_baseline=batch_baseline)
    adv = [r - b for r, b in zip(earned, base)]
    if baseline is not None:
        baseline.update(task_means(earned, task_types))  # after the rows read it: theirs is that of earlier batches
    scale = std_scale(adv) if normalize else 1.0
    out: list[float] = []
    for a, p in zip(adv, pen):
        kept = max(a, 0.0) if positive_only else a
        if p < 0:
            kept = min(kept, 0.0) + p  # never reinforced; under positive_only kept is already >= 0, so 0 + p
        out.append(kept / scale)
    return out
