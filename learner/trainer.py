"""One optimizer step of the learner, on every rank: global batch plan -> micro-batches -> loss -> AdamW.

The plan is rank 0's global batch with its advantages [(episode, advantage)], the same on every
rank (learner/dist.py broadcasts it). Each rank runs its shard in micro-batches of micro_batch
rows, accumulating gradients (DDP or FSDP2 averages them over ranks at the last backward), then steps
AdamW with the warm-up lr. With epochs > 1 (ppo only) the same micro-batches are passed again,
one optimizer step per pass. The figures a step reports (StepResult) are reduced over ranks, so
every rank returns the same ones; the loss itself is learner/loss.py.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from flywheel.learner import dist
from flywheel.learner.checkpoint import TrainerState
from flywheel.learner.config import LearnerConfig
from flywheel.learner.data import Episode
from flywheel.learner.loss import LossStats, policy_loss
from flywheel.learner.model import (
    Packed,
    Policy,
    pack,
    reference_log_softmax,
    token_logprobs,
    token_logprobs_and_exact_kl,
    token_logprobs_and_raw,
)

BatchPlan = list[tuple[Episode, float]]  # the global batch: (episode, advantage)


@dataclass
class StepResult:
    """What one optimizer step did (global figures, identical on every rank)."""

    episodes: int
    tokens: int  # prompt + completion tokens forwarded
    trained_tokens: int  # completion tokens with loss_mask 1
    loss: float
    ratio_mean: float
    ratio_max: float
    clip_frac: float
    kl: float
    grad_norm: float
    seconds: float
    behaviour_gap_mean: float | None = None  # only on rows of the unchanged current version
    behaviour_gap_max: float | None = None
    kl_coef: float = 0.0  # the KL coefficient this step trained with (kl_target adapts it)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class MicroBatch:
    """Rows forwarded together, with what every pass over them reuses."""

    episodes: list[Episode]
    packed: Packed
    adv: torch.Tensor  # [B]
    logp_ref: torch.Tensor | None  # [B, T] the base model's plain logprobs of the served tokens (k3's KL term only)
    filler: bool = False  # a zero-weight pass: a sharded rank with fewer rows still joins every all-gather
    # kl_estimator exact: the reference's [B, T, V] log-softmax is computed in the pass that uses it, one micro-batch
    # at a time. Kept for a whole step it was [rows, T, vocab]: ~16 MB on the tiny model, tens of GB for a real
    # vocabulary (64 rows of 1,000 tokens at 49,152: 12.6 GB). With epochs > 1 each pass recomputes it (no grad).
    exact_ref: bool = False


@dataclass
class BehaviourGap:
    """|logp_new - logp_old| sums over the tokens of rows that `version` served, before the step changes it."""

    version: int
    total: float = 0.0
    tokens: float = 0.0
    max: float = 0.0

    def add(self, logp: torch.Tensor, mb: MicroBatch) -> None:
        """logp: [B, T] the learner's logprobs of mb's completion tokens."""
        same = torch.tensor([e.policy_version == self.version for e in mb.episodes], device=logp.device)  # [B]
        m = mb.packed.mask * same[:, None]  # [B, T]
        d = (logp.detach() - mb.packed.logp_old).abs() * m  # [B, T]
        self.total += float(d.sum())
        self.tokens += float(m.sum())
        self.max = max(self.max, float(d.max()) if m.any() else 0.0)


def warmup_factor_at(step: int, warmup_steps: int) -> float:
    """lr multiplier of the step after `step` of a line: linear over its first warmup_steps."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def adapt_kl_coef(coef: float, kl: float, target: float, start: float) -> float:
    """The KL coefficient after a step whose per-token KL was `kl`: PPO's adaptive penalty (Schulman et al. 2017,
    sec. 4), doubled above 1.5x the target and halved below target/1.5, kept within [start, start*1000]. The floor
    is the start: a learner's first steps leave its base by construction (the first step's KL is 0), and run h's
    floor at start/100 let those quiet steps halve the anchor to 0.001 before the policy had moved at all, so the
    first version trained unanchored; the cap keeps a run of loud steps from freezing the policy."""
    if kl > 1.5 * target:
        coef *= 2.0
    elif kl < target / 1.5:
        coef /= 2.0
    return min(max(coef, start), start * 1000.0)


def rows_worth_running(plan: BatchPlan, kl_coef: float, world_size: int) -> BatchPlan:
    """The rows worth a forward/backward: without a KL term a row of advantage 0 adds exactly 0 to the gradient.
    (With --kl-rows trained the trainer passes kl_coef 0 here: the KL term is then computed on these rows only.)

    Under `--positive-only` that is every row at or below its baseline (70-80% of the rows in the
    positive-only demo runs), so the step costs about a quarter; a penalised row has a negative
    advantage there (loss.advantages) and is run. The normalizer still counts every row of `plan`, so the
    gradient is the same as running them all; the step's ratio/clip/gap stats cover the rows run.
    Rows of advantage 0 pad the list to one per rank: DDP needs a backward on every rank.
    """
    if kl_coef > 0:
        return plan
    nonzero = [(e, a) for e, a in plan if a != 0.0]
    zero = [(e, a) for e, a in plan if a == 0.0]
    return nonzero + zero[: max(0, world_size - len(nonzero))]


class Trainer:
    """The optimizer steps of one rank over the weights, optimizer and TrainerState the learner shares."""

    def __init__(self, cfg: LearnerConfig, world: dist.World, policy: Policy, optimizer: torch.optim.Optimizer,
                 state: TrainerState) -> None:
        self.cfg = cfg
        self.world = world
        self.policy = policy
        self.optimizer = optimizer
        self.state = state
        self.ddp = dist.wrap(policy.module, world)
        if policy.sharded is not None:
            policy.sharded.adopt(optimizer)  # moments resumed from a checkpoint become this rank's shards
            policy.sharded.gather(optimizer)  # rank 0 may write a version before the first step

    def warmup_factor(self) -> float:
        """lr multiplier of the coming step: the warm-up counts from the start of the line (a rebase starts one)."""
        return warmup_factor_at(self.state.step - self.state.line_start_step, self.cfg.warmup_steps)

    def rows_to_run(self, plan: BatchPlan) -> BatchPlan:
        return rows_worth_running(plan, self.cfg.kl_coef if self.cfg.kl_rows == "all" else 0.0, self.world.size)

    @property
    def kl_coef(self) -> float:
        """The KL coefficient of the coming step: kl_coef, or where kl_target steered it (state.kl_coef)."""
        return self.state.kl_coef or self.cfg.kl_coef

    def step(self, plan: BatchPlan) -> StepResult:
        """Train on the global batch `plan` [(episode, advantage)]; this rank takes its shard."""
        cfg, world = self.cfg, self.world
        start = time.perf_counter()
        global_trained = sum(e.trained_tokens for e, _ in plan)
        normalizer = global_trained if cfg.loss_agg == "token" else sum(1 for e, _ in plan if e.trained_tokens)
        # rows the current weights produced, before this step changes them: the pure train/inference gap
        measure_gap = self.state.step == self.state.last_published_step
        gap = BehaviourGap(self.state.policy_version)
        rows = self.rows_to_run(plan)
        micro = self.micro_batches(rows)
        for epoch in range(cfg.epochs):
            # one optimizer step per pass; the stats reported are the last pass's (its ratio and clip
            # fraction show how far the earlier passes moved the policy from the behaviour one)
            stats, loss_sum = self.backward_pass(micro, normalizer, gap if measure_gap and epoch == 0 else None)
            grad_norm = self.optimizer_step()
        # counted here, on every rank, not in rank 0's bookkeeping: the warm-up lr follows state.step,
        # and ranks stepping with different lrs drift apart (DDP syncs gradients, not weights)
        self.state.step += 1
        sums, maxes = dist.all_reduce_figures(
            [stats.tokens, stats.ratio_sum, stats.clipped, stats.kl_sum, loss_sum, gap.total, gap.tokens],
            [stats.ratio_max, gap.max], world)
        tokens, ratio_sum, clipped, kl_sum, loss_total, gap_sum, gap_n = sums
        kl_coef = self.kl_coef
        if cfg.kl_target > 0:
            # every rank adapts from the same all-reduced KL, so the ranks' coefficients stay equal
            self.state.kl_coef = adapt_kl_coef(kl_coef, kl_sum / max(tokens, 1.0), cfg.kl_target, cfg.kl_coef)
        if self.policy.sharded is not None:
            self.policy.sharded.gather(self.optimizer)  # what rank 0 checkpoints and publishes after this step
        if self.policy.device.type == "cuda":
            torch.cuda.synchronize()
        return StepResult(
            episodes=len(plan),
            tokens=cfg.epochs * sum(e.seq_len for e, _ in rows),
            trained_tokens=global_trained,
            loss=loss_total,
            ratio_mean=ratio_sum / max(tokens, 1.0),
            ratio_max=maxes[0],
            clip_frac=clipped / max(tokens, 1.0),
            kl=kl_sum / max(tokens, 1.0),
            kl_coef=kl_coef,
            grad_norm=grad_norm,
            seconds=time.perf_counter() - start,
            behaviour_gap_mean=gap_sum / gap_n if gap_n else None,
            behaviour_gap_max=maxes[1] if gap_n else None,
        )

    def micro_batches(self, rows: BatchPlan) -> list[MicroBatch]:
        """This rank's shard of `rows`, packed in micro-batches (with base-model logprobs for the KL term)."""
        cfg, device = self.cfg, self.policy.device
        # sorted by length: a micro-batch is padded to its longest row, and demo rows run from 30 to 120
        # tokens (64 of them: 2.2 s as they came, 1.2 s sorted, one thread)
        mine = sorted(dist.shard(rows, self.world), key=lambda row: row[0].seq_len)
        chunks = [mine[i:i + cfg.micro_batch] for i in range(0, len(mine), cfg.micro_batch)]
        if self.policy.sharded is not None:
            # every forward all-gathers each block's shards: a rank with fewer micro-batches than another
            # would leave it waiting in a collective, so it repeats one row at weight 0
            chunks += [mine[:1]] * (dist.most_micro_batches(len(rows), self.world, cfg.micro_batch) - len(chunks))
        out = []
        for j, chunk in enumerate(chunks):
            packed = pack([e for e, _ in chunk], device)
            adv = torch.tensor([a for _, a in chunk], dtype=torch.float32, device=device)  # [B]
            logp_ref = None
            exact = cfg.kl_coef > 0 and cfg.kl_estimator == "exact"
            if cfg.kl_coef > 0 and not exact:
                # the anchor compares the models themselves, not their truncated sampling
                # distributions: a served token outside the base's top-p set would make it infinite
                with torch.no_grad(), self.policy.reference() as ref:
                    logp_ref = token_logprobs(ref, packed, processed=False)  # [B, T]
            out.append(MicroBatch([e for e, _ in chunk], packed, adv, logp_ref,
                                  filler=j * cfg.micro_batch >= len(mine), exact_ref=exact))
        return out

    def reference_full(self, mb: MicroBatch) -> torch.Tensor:
        """[B, T, V] the reference's plain log-softmax at mb's completion positions (kl_estimator exact): plain, as
        k3's anchor, so a served token outside the base's top-p set cannot make the KL infinite."""
        with torch.no_grad(), self.policy.reference() as ref:
            return reference_log_softmax(ref, mb.packed)

    def backward_pass(self, micro: list[MicroBatch], normalizer: float,
                      gap: BehaviourGap | None) -> tuple[LossStats, float]:
        """Accumulate one pass's gradients over `micro`; returns its loss stats and loss (this rank's share)."""
        cfg, world = self.cfg, self.world
        self.optimizer.zero_grad(set_to_none=True)
        stats = LossStats()
        loss_sum = 0.0
        for j, mb in enumerate(micro):
            # DDP all-reduces (FSDP2 reduce-scatters) at the last micro-batch's backward only: the earlier ones
            # just accumulate
            accumulate = world.distributed and j < len(micro) - 1
            with dist.no_sync(self.ddp) if accumulate else contextlib.nullcontext():
                # logp under each row's sampling settings (the behaviour logprobs' terms); logp_raw,
                # the plain log-softmax, is what the KL term compares with logp_ref
                kl_exact = None
                if mb.exact_ref:
                    logp, kl_exact = token_logprobs_and_exact_kl(self.ddp, mb.packed, self.reference_full(mb))
                    logp_raw = None  # logp, kl_exact: [B, T] each; the [B, T, V] reference is freed with this pass
                elif mb.logp_ref is not None:
                    logp, logp_raw = token_logprobs_and_raw(self.ddp, mb.packed)  # [B, T] each
                else:
                    logp, logp_raw = token_logprobs(self.ddp, mb.packed), None
                # DDP averages gradients over ranks; dividing by tokens/world makes the average a global sum/tokens
                loss, s = policy_loss(logp, mb.packed.logp_old, mb.packed.mask, mb.adv, kind=cfg.loss,
                                      tis_cap=cfg.tis_cap, ppo_eps=cfg.ppo_eps,
                                      token_normalizer=normalizer / world.size,
                                      logp_ref=None if kl_exact is not None else mb.logp_ref, kl_coef=self.kl_coef,
                                      agg=cfg.loss_agg, logp_kl=logp_raw, kl_exact=kl_exact)
                if mb.filler:
                    loss = loss * 0.0  # [] a gradient of exactly 0: the row counts once, on the rank that owns it
                loss.backward()
            if mb.filler:
                continue
            stats.add(s)
            loss_sum += float(loss.detach()) / world.size
            if gap is not None:
                gap.add(logp, mb)
        return stats, loss_sum

    def optimizer_step(self) -> float:
        """Clip, set the warm-up lr and step AdamW; returns the gradient norm before clipping."""
        cfg = self.cfg
        params = self.policy.trainable_parameters()
        if cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        grad_norm = float(dist.full(norm))  # sharded gradients give a sharded norm: every rank computes the total
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr * self.warmup_factor()
        self.optimizer.step()
        return grad_norm
