"""`flywheel learner`: the continuous training daemon.

    flywheel learner                                   # LoRA on var/models/tiny-base, var/lake episodes
    flywheel learner --mode full --lr 1e-4             # full weights (untied models)
    torchrun --nproc-per-node 2 -m learner.daemon ...  # data parallel, gloo on CPU (learner/dist.py)

One loop: wait for a batch of matured episodes (backpressure: at least min_batch fresh rows,
sleeping with back-off while the stream is empty) -> one optimizer step of the
importance-corrected policy gradient (learner/loss.py) -> log the step's episode ids ->
checkpoint (atomic) -> every N steps or T seconds write var/policies/policy-v<N>/ and hand it
to serving.publisher.publish. SIGTERM/SIGINT finish the current step, checkpoint, exit 0; a
SIGKILL loses at most the step in progress (learner/checkpoint.py).

It follows the promotion gate (follow_gate): when the gate rejects or rolls back its newest
version it continues from the champion's weights; with publish_wait_for_gate a new version
waits for the gate's verdict on the last.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.base import defaults
from flywheel.base.atomic import Durability, publish, temp_path
from flywheel.base.config import load_config, setup_logging, write_resolved
from flywheel.base.stop import stop_on_signals
from flywheel.base.versions import parse_version, version_name
from flywheel.learner.config import LearnerConfig

log = logging.getLogger("learner")


# ---------------------------------------------------------------------------------------------
# MLflow: one run per daemon lifetime
# ---------------------------------------------------------------------------------------------
class Tracker:
    """Metrics of one daemon lifetime in one MLflow run ('' tracking URI: logging only)."""

    def __init__(self, cfg: LearnerConfig) -> None:
        self.client: Any = None
        self.run_id: str | None = None
        if not cfg.mlflow_tracking_uri:
            log.warning("mlflow: tracking disabled (mlflow_tracking_uri is empty); metrics go to the log only")
            return
        from flywheel.base import tracking

        self.client = tracking.client(cfg.mlflow_tracking_uri)
        exp = tracking.experiment_id(cfg.experiment, cfg.mlflow_tracking_uri)
        run = self.client.create_run(exp, run_name=f"learner-{time.strftime('%Y%m%d-%H%M%S')}",
                                     tags={"process": "learner", "pid": str(os.getpid())})
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in sorted(vars(cfg).items())]
        self.client.log_batch(self.run_id, params=params)
        log.info("mlflow: run %s in experiment %s (%s)", self.run_id, cfg.experiment, cfg.mlflow_tracking_uri)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None and math.isfinite(v)]
        try:
            self.client.log_batch(self.run_id, metrics=items)
        except Exception as exc:  # tracking is advisory: a locked sqlite file must not stop training
            log.warning("mlflow: metrics of step %d not logged (%s)", step, exc)

    def tag(self, key: str, value: str) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.set_tag(self.run_id, key, value)

    def end(self, status: str) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.set_terminated(self.run_id, status)


# ---------------------------------------------------------------------------------------------
# The learner
# ---------------------------------------------------------------------------------------------
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
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Learner:
    """Model, optimizer and training state of one rank; rank 0 also owns the data stream."""

    def __init__(self, cfg: LearnerConfig, world: Any | None = None) -> None:
        import torch

        from flywheel.learner import checkpoint, dist
        from flywheel.learner.checkpoint import TrainerState
        from flywheel.learner.data import EpisodeStream
        from flywheel.learner.loss import Baseline
        from flywheel.learner.model import load_policy, resolve_device

        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        device = resolve_device(cfg.device)
        if device.type == "cpu" and cfg.cpu_threads:
            # each intra-op thread waits for the others at every op; when another process holds a core,
            # the waiting is what the step spends its time on, so one thread is faster on a busy machine
            torch.set_num_threads(cfg.cpu_threads)
        self.world = world if world is not None else dist.init(device)
        assert cfg.min_batch >= self.world.size, (
            f"min_batch ({cfg.min_batch}) < world size ({self.world.size}): a rank would get no rows")
        log.info("setup: loading %s model from %s", cfg.mode, cfg.base_model)
        self.policy = load_policy(cfg)
        params = self.policy.trainable_parameters()
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.state = TrainerState(step=0, policy_version=cfg.start_version)
        found = checkpoint.load_latest(self.run_dir, map_location=self.policy.device)
        if found is not None:
            self.state, tensors = found
            self.policy.load_weights_state(tensors["weights"])
            self.optimizer.load_state_dict(tensors["optimizer"])
        else:
            log.info("setup: no checkpoint under %s; starting at policy_version %d", self.run_dir, cfg.start_version)
        # the running mean is still kept under "batch": it is what a checkpoint shows as the reward level
        self.baseline = Baseline(cfg.baseline_momentum, dict(self.state.baseline)) if cfg.baseline != "none" else None
        self.ddp = dist.wrap(self.policy.module, self.world)
        self.stream: EpisodeStream | None = None
        if self.world.is_main:
            self.stream = EpisodeStream(cfg.lake_root, self.policy.vocab_size, cfg.max_seq_len,
                                        cursor=self.state.cursor, trained=self.state.trained,
                                        abandoned=set(self.state.abandoned))
        self.steps_this_run = 0
        self.rebased: tuple[int, str | None] | None = None  # rank 0's rebase since the last broadcast
        self._registry: Any = None
        self._gate_read_at = 0.0
        self.last_publish_time = time.monotonic()
        self.last_batch: list[Any] = []

    # -- one optimizer step (every rank) -----------------------------------------------------
    def train_step(self, plan: list[tuple[Any, float]]) -> StepResult:
        """Train on the global batch `plan` [(episode, advantage)]; this rank takes its shard."""
        import torch

        from flywheel.learner import dist
        from flywheel.learner.loss import LossStats, policy_loss
        from flywheel.learner.model import pack, token_logprobs

        cfg, world = self.cfg, self.world
        start = time.perf_counter()
        global_trained = sum(e.trained_tokens for e, _ in plan)
        normalizer = global_trained if cfg.loss_agg == "token" else sum(1 for e, _ in plan if e.trained_tokens)
        # rows the current weights produced, before this step changes them: the pure train/inference gap
        unchanged = self.state.step == self.state.last_published_step
        rows = self.rows_to_run(plan)
        # sorted by length: a micro-batch is padded to its longest row, and demo rows run from 30 to 120
        # tokens (64 of them: 2.2 s as they came, 1.2 s sorted, one thread)
        mine = sorted(dist.shard(rows, world), key=lambda row: row[0].seq_len)
        chunks = []
        for chunk in (mine[i:i + cfg.micro_batch] for i in range(0, len(mine), cfg.micro_batch)):
            packed = pack([e for e, _ in chunk], self.policy.device)
            adv = torch.tensor([a for _, a in chunk], dtype=torch.float32, device=self.policy.device)  # [B]
            logp_ref = None
            if cfg.kl_coef > 0:
                with torch.no_grad(), self.policy.reference() as ref:
                    logp_ref = token_logprobs(ref, packed)  # [B, T]
            chunks.append(([e for e, _ in chunk], packed, adv, logp_ref))
        gap_sum, gap_max, gap_n = 0.0, 0.0, 0.0
        for epoch in range(cfg.epochs):
            # one optimizer step per pass; the stats reported are the last pass's (its ratio and clip
            # fraction show how far the earlier passes moved the policy from the behaviour one)
            self.optimizer.zero_grad(set_to_none=True)
            stats = LossStats()
            loss_sum = 0.0
            for j, (episodes, packed, adv, logp_ref) in enumerate(chunks):
                sync = world.distributed and j < len(chunks) - 1
                with self.ddp.no_sync() if sync else contextlib.nullcontext():
                    logp = token_logprobs(self.ddp, packed)  # [B, T]
                    # DDP averages gradients over ranks; dividing by tokens/world makes the average a global sum/tokens
                    loss, s = policy_loss(logp, packed.logp_old, packed.mask, adv, kind=cfg.loss, tis_cap=cfg.tis_cap,
                                          ppo_eps=cfg.ppo_eps, token_normalizer=normalizer / world.size,
                                          logp_ref=logp_ref, kl_coef=cfg.kl_coef, agg=cfg.loss_agg)
                    loss.backward()
                stats.add(s)
                loss_sum += float(loss.detach()) / world.size
                if unchanged and epoch == 0:
                    same = torch.tensor([e.policy_version == self.state.policy_version for e in episodes],
                                        device=self.policy.device)
                    m = packed.mask * same[:, None]
                    d = (logp.detach() - packed.logp_old).abs() * m
                    gap_sum += float(d.sum())
                    gap_n += float(m.sum())
                    gap_max = max(gap_max, float(d.max()) if m.any() else 0.0)
            params = self.policy.trainable_parameters()
            if cfg.grad_clip > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
            else:
                grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.lr * self.warmup_factor()
            self.optimizer.step()
        # counted here, on every rank, not in rank 0's bookkeeping: the warm-up lr follows state.step,
        # and ranks stepping with different lrs drift apart (DDP syncs gradients, not weights)
        self.state.step += 1
        sums = [stats.tokens, stats.ratio_sum, stats.clipped, stats.kl_sum, loss_sum, gap_sum, gap_n]
        maxes = [stats.ratio_max, gap_max]
        if world.distributed:
            import torch.distributed as tdist

            t_sum = torch.tensor(sums, dtype=torch.float64)
            t_max = torch.tensor(maxes, dtype=torch.float64)
            tdist.all_reduce(t_sum)
            tdist.all_reduce(t_max, op=tdist.ReduceOp.MAX)
            sums, maxes = t_sum.tolist(), t_max.tolist()
        tokens, ratio_sum, clipped, kl_sum, loss_total, gap_sum, gap_n = sums
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
            grad_norm=grad_norm,
            seconds=time.perf_counter() - start,
            behaviour_gap_mean=gap_sum / gap_n if gap_n else None,
            behaviour_gap_max=maxes[1] if gap_n else None,
        )

    def rows_to_run(self, plan: list[tuple[Any, float]]) -> list[tuple[Any, float]]:
        """The rows worth a forward/backward: without a KL term a row of advantage 0 adds exactly 0 to the gradient.

        Under `--positive-only` that is every row at or below its baseline (70-80% of the rows in the
        positive-only demo runs), so the step costs about a quarter. The normalizer still counts every row of `plan`, so the
        gradient is the same as running them all; the step's ratio/clip/gap stats cover the rows run.
        Rows of advantage 0 pad the list to one per rank: DDP needs a backward on every rank.
        """
        if self.cfg.kl_coef > 0:
            return plan
        nonzero = [(e, a) for e, a in plan if a != 0.0]
        zero = [(e, a) for e, a in plan if a == 0.0]
        return nonzero + zero[: max(0, self.world.size - len(nonzero))]

    # -- following the promotion gate ---------------------------------------------------------
    def registry(self) -> Any:
        from flywheel.serving.registry import Registry

        if self._registry is None:
            tier = self.tier()
            self._registry = Registry(tier.mlflow_tracking_uri, tier.registered_model)
        return self._registry

    def read_aliases(self) -> dict[str, int] | None:
        """The registry's aliases once this learner has published (None: nothing published, no registry, unreadable)."""
        cfg = self.cfg
        if not (cfg.publish and cfg.mlflow_tracking_uri and self.state.published):
            return None
        try:
            return self.registry().aliases()
        except Exception as exc:  # MLflow unreachable: training and publishing go on; the next read decides
            log.warning("gate: registry %s unreadable (%s: %s); not waiting for or following the gate this time",
                        cfg.registered_model, type(exc).__name__, exc)
            return None

    def gate_ruled(self, aliases: dict[str, int] | None) -> bool:
        """The gate has decided on our newest version (promoted, rejected, rolled back), or there is none.

        aliases: as read_aliases returned them. None (nothing published, or the registry unreadable)
        counts as ruled, so a registry outage cannot stop publishing (publish reports the outage itself).
        """
        from flywheel.serving.registry import CHALLENGER, CHAMPION

        if aliases is None:
            return True
        latest = self.state.published[-1]
        return aliases.get(CHALLENGER) != latest or aliases.get(CHAMPION) == latest

    def follow_gate(self, aliases: dict[str, int] | None = None) -> None:
        """Rank 0: when the gate abandoned our newest version, continue from the champion (rebase).

        aliases: as the caller just read them; None: read them here, at most every follow_gate_every_s.
        """
        cfg = self.cfg
        if not cfg.follow_gate:
            return
        if aliases is None:
            if time.monotonic() - self._gate_read_at < cfg.follow_gate_every_s:
                return
            self._gate_read_at = time.monotonic()
            aliases = self.read_aliases()
            if aliases is None:
                return
        target = rebase_target(self.state.published, self.state.policy_version, aliases)
        if target is None:
            return
        try:
            # a version whose publish failed before it was registered was never judged: keep training it
            if self.registry().find(self.state.published[-1]) is None:
                return
            found = self.registry().find(target) if target != 0 else None
        except Exception as exc:  # MLflow unreachable: keep training; the next read decides
            log.warning("gate: registry %s unreadable (%s: %s); not following the gate this time",
                        cfg.registered_model, type(exc).__name__, exc)
            return
        source = found.source if found is not None else None
        if target != 0 and source is None:
            source = str(Path(cfg.policies_dir) / version_name(target))
        self.rebase(target, source)
        self.rebased = (target, source)

    def rebase(self, version: int, source: str | None) -> None:
        """Continue from policy-v<version>'s weights (source: its directory; None for policy-v0).

        The first moment of Adam points along the abandoned line, so it is zeroed; the second moment
        (the gradient scale) stays, so the first steps after a rebase are not full-size sign steps.
        """
        abandoned = [v for v in self.state.published if v > version and v not in self.state.abandoned]
        self.policy.load_published(Path(source) if source else None)
        for slot in self.optimizer.state.values():
            if "exp_avg" in slot:
                slot["exp_avg"].zero_()
        self.state.abandoned.extend(abandoned)
        if self.stream is not None:
            self.stream.abandoned.update(abandoned)
        log.warning("gate: policy-v%d was not kept (the champion is policy-v%d); continuing from the champion's "
                    "weights, rows served by %s dropped", self.state.policy_version, version,
                    ", ".join(version_name(v) for v in abandoned) or "none")
        self.state.policy_version = version
        self.state.last_published_step = self.state.step
        self.last_publish_time = time.monotonic()

    # -- batch plan (rank 0) -----------------------------------------------------------------
    def warmup_factor(self) -> float:
        """lr multiplier of the coming step: linear over the first warmup_steps of the run (from its checkpointed step)."""
        if self.cfg.warmup_steps <= 0:
            return 1.0
        return min(1.0, (self.state.step + 1) / self.cfg.warmup_steps)

    def plan(self, batch: list[Any]) -> list[tuple[Any, float]]:
        """Advantages over the whole global batch (so every rank trains the same objective)."""
        from flywheel.learner.loss import advantages

        adv = advantages([e.reward for e in batch], [e.task_type for e in batch], [e.group_id for e in batch],
                         self.baseline, group_relative=self.cfg.group_relative,
                         normalize=self.cfg.normalize_advantages, batch_baseline=self.cfg.baseline == "batch",
                         positive_only=self.cfg.positive_only)
        return list(zip(batch, adv))

    def next_batch(self, stop: threading.Event) -> tuple[list[Any], Counter] | None:
        """Block until min_batch fresh episodes are pending (back-off sleep), then take a batch."""
        assert self.stream is not None
        cfg = self.cfg
        sleep_s, last_note, idle_since = 0.1, 0.0, time.monotonic()
        seen = self.stream.trainable(self.state.policy_version, cfg.max_staleness)
        while not stop.is_set():
            self.follow_gate()  # also while starving: after a rejection only the champion's rows arrive
            self.stream.poll()
            self.stream.drop_stale(self.state.policy_version, cfg.max_staleness)
            ready = self.stream.trainable(self.state.policy_version, cfg.max_staleness)
            if ready >= cfg.min_batch:
                batch, stats = self.stream.take(cfg.batch_size, self.state.policy_version, cfg.max_staleness,
                                                 newest_first=cfg.newest_first)
                return batch, stats.lags
            if ready > seen:
                idle_since, sleep_s, seen = time.monotonic(), 0.1, ready
            idle = time.monotonic() - idle_since
            if cfg.idle_exit_s and idle >= cfg.idle_exit_s:
                log.info("data: no new episodes for %.0f s (idle_exit_s); stopping with %d pending", idle, ready)
                return None
            if time.monotonic() - last_note >= 30.0:
                log.info("data: waiting for episodes (%d of min_batch %d ready, policy_version %d)", ready,
                         cfg.min_batch, self.state.policy_version)
                last_note = time.monotonic()
            self.heartbeat("waiting", ready=ready)
            # back-off: an empty stream costs a lake listing every poll_s at most, never a busy loop
            stop.wait(sleep_s)
            sleep_s = min(sleep_s * 2, cfg.poll_s)
        return None

    # -- bookkeeping (rank 0) ----------------------------------------------------------------
    def finish_step(self, batch: list[Any], lags: Counter, result: StepResult, tracker: Tracker) -> None:
        from flywheel.learner import checkpoint

        assert self.stream is not None
        self.steps_this_run += 1
        self.stream.mark_trained(batch)
        checkpoint.append_trained(self.run_dir, self.state.step, self.state.policy_version,
                                  [e.episode_id for e in batch])
        aliases = self.read_aliases() if self.cfg.publish_wait_for_gate else None
        if aliases is not None:
            # the verdict that makes the next version due may be a rejection: follow it first, or
            # the next version would grow out of the refused line and take the challenger slot
            self.follow_gate(aliases)
        published = self.publish_due(aliases)
        if published:
            self.write_version()
        self.save_checkpoint()
        self.last_batch = batch
        rewards = [e.reward for e in batch]
        mean_r = sum(rewards) / len(rewards)
        std_r = math.sqrt(sum((r - mean_r) ** 2 for r in rewards) / max(len(rewards) - 1, 1))
        lag_rows = sum(lags.values())
        mean_lag = sum(k * v for k, v in lags.items()) / max(lag_rows, 1)
        counters = self.stream.counters
        metrics: dict[str, float] = {
            "loss": result.loss, "reward_mean": mean_r, "reward_std": std_r, "episodes": result.episodes,
            "ratio_mean": result.ratio_mean, "ratio_max": result.ratio_max, "clip_frac": result.clip_frac,
            "kl": result.kl, "grad_norm": result.grad_norm, "tokens_per_s": result.tokens_per_s,
            "trained_tokens": result.trained_tokens, "policy_lag_mean": mean_lag,
            "policy_lag_max": float(max(lags) if lags else 0), "policy_version": self.state.policy_version,
            "dropped_stale_total": counters["stale"], "dropped_corrupt_total": counters["corrupt"],
            "relabel_after_train_total": counters["relabel_after_train"],
            "abandoned_versions_total": float(len(self.state.abandoned)),
        }
        for lag in range(self.cfg.max_staleness + 1):
            metrics[f"staleness_lag_{lag}"] = float(lags.get(lag, 0))
        if result.behaviour_gap_mean is not None:
            metrics["mismatch_behaviour_mean"] = result.behaviour_gap_mean
            metrics["mismatch_behaviour_max"] = result.behaviour_gap_max or 0.0
        metrics.update(result.extra)
        if published:
            metrics.update(self.push_version())
        tracker.log(self.state.step, metrics)
        self.heartbeat("training", policy_lag=round(mean_lag, 2), reward=round(mean_r, 4),
                       tokens_per_s=round(result.tokens_per_s), dropped_stale=counters["stale"],
                       dropped_corrupt=counters["corrupt"])
        gap = (f", logprob gap {result.behaviour_gap_mean:.1e}" if result.behaviour_gap_mean is not None else "")
        log.info("step %d v%d: reward %.3f, policy lag %.2f (max %d), loss %+.4f, ratio %.3f clip %.1f%%, kl %.4f, "
                 "%.0f tokens/s, %d episodes (stale %d, corrupt %d total)%s", self.state.step,
                 self.state.policy_version, mean_r, mean_lag, int(metrics["policy_lag_max"]), result.loss,
                 result.ratio_mean, 100 * result.clip_frac, result.kl, result.tokens_per_s, result.episodes,
                 counters["stale"], counters["corrupt"], gap)

    def save_checkpoint(self) -> None:
        from flywheel.learner import checkpoint

        assert self.stream is not None
        self.state.cursor = dict(self.stream.cursor)
        self.state.trained = dict(self.stream.trained)
        self.state.baseline = self.baseline.state() if self.baseline is not None else {}
        checkpoint.save(self.run_dir, self.state, self.policy.weights_state(), self.optimizer.state_dict(),
                        keep=self.cfg.keep_checkpoints)

    def publish_due(self, aliases: dict[str, int] | None) -> bool:
        """A version is due by step count or by time. aliases: read_aliases() as finish_step read it (only
        consulted with publish_wait_for_gate; never read again here, so an outage costs one failed read)."""
        cfg = self.cfg
        by_steps = cfg.publish_every_steps > 0 and self.state.step - self.state.last_published_step >= cfg.publish_every_steps
        by_time = cfg.publish_every_s > 0 and time.monotonic() - self.last_publish_time >= cfg.publish_every_s
        if by_steps and not by_time and cfg.publish_wait_for_gate and not self.gate_ruled(aliases):
            return False  # the steps go on; the version waits until the gate has judged the one before
        return by_steps or by_time

    def next_version(self) -> int:
        """One past both our own and any directory already there (a crash may have left one unrecorded)."""
        existing = [v for p in Path(self.cfg.policies_dir).glob("policy-v*") if (v := parse_version(p.name)) is not None]
        return max([self.state.policy_version, *existing]) + 1

    def write_version(self) -> Path:
        """Write policy-v<N>/ atomically (temp dir + rename) and make N the current version."""
        assert self.stream is not None
        version = self.next_version()
        root = Path(self.cfg.policies_dir)
        root.mkdir(parents=True, exist_ok=True)
        final = root / version_name(version)
        tmp = temp_path(final)
        tmp.mkdir()
        kind = self.policy.save_weights(tmp)
        meta = {
            "policy_version": version, "kind": kind, "base_model": str(Path(self.cfg.base_model).resolve()),
            "created_ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "learner_step": self.state.step,
            "data_window": self.stream.data_window(), "parent_version": self.state.policy_version,
        }
        (tmp / "policy.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        publish(tmp, final, Durability.DURABLE)  # serving may read it from another host right away
        log.info("publish: wrote %s (%s, step %d, parent policy-v%d)", final, kind, self.state.step,
                 self.state.policy_version)
        self.state.policy_version = version
        self.state.last_published_step = self.state.step
        self.state.published.append(version)
        self.last_publish_time = time.monotonic()
        self.version_dir = final
        return final

    def tier(self) -> Any:
        """The serving tier to publish to: the tier's own FLYWHEEL_* settings (FLYWHEEL_SERVERS lists every
        server of a multi-server tier), with this learner's model, directories and registry winning."""
        from flywheel.base.config import resolve
        from flywheel.serving.tier import TierConfig

        mine: dict[str, Any] = {"base_model": self.cfg.base_model, "policies_dir": self.cfg.policies_dir,
                                "registered_model": self.cfg.registered_model,
                                "mlflow_tracking_uri": self.cfg.mlflow_tracking_uri or defaults.MLFLOW_TRACKING_URI}
        if "FLYWHEEL_SERVERS" not in os.environ:
            mine["servers"] = [self.cfg.vllm_url]
        return resolve(TierConfig, {}, os.environ, mine)

    def republish_latest(self) -> None:
        """At start-up, hand the newest version to serving again: a kill between writing a version and
        pushing it would otherwise leave it unserved (publish is idempotent, so this is cheap when it was)."""
        if not (self.cfg.publish and self.state.published):
            return
        path = Path(self.cfg.policies_dir) / version_name(self.state.published[-1])
        if path.is_dir():
            self.version_dir = path
            log.info("setup: making sure serving has %s", path.name)
            self.push_version()

    def push_version(self) -> dict[str, float]:
        """Hand the new directory to serving and measure the served artifact's parity."""
        out: dict[str, float] = {"published_version": float(self.state.policy_version)}
        if not self.cfg.publish:
            return out
        served = None
        start = time.perf_counter()
        try:
            # the one hand-off owned by serving: push to every vLLM server and register in MLflow
            from flywheel.serving.publisher import publish

            result = publish(self.version_dir, self.tier())
            served = result.served_name
            out["publish_s"] = time.perf_counter() - start
            log.info("publish: policy-v%d handed to serving in %.2f s (served as %s)", self.state.policy_version,
                     out["publish_s"], served)
        except Exception as exc:  # serving keeps the old version; the directory stays for `flywheel publish`
            log.error("publish: policy-v%d NOT pushed (%s: %s); retry with `flywheel publish %s`",
                      self.state.policy_version, type(exc).__name__, exc, self.version_dir)
            return out
        if served is not None and self.cfg.parity_samples > 0 and self.last_batch:
            from flywheel.learner.parity import served_gap

            sample = random.Random(self.state.step).sample(self.last_batch,
                                                           min(self.cfg.parity_samples, len(self.last_batch)))
            try:
                g = served_gap(self.policy, sample, self.cfg.vllm_url, served)
                out["parity_served_mean"], out["parity_served_max"] = g.mean_abs, g.max_abs
                log.info("parity: policy-v%d learner vs vLLM logprobs on %d tokens: mean |diff| %.2e, max %.2e",
                         self.state.policy_version, g.tokens, g.mean_abs, g.max_abs)
            except Exception as exc:
                log.warning("parity: vLLM scoring of %s failed (%s); mismatch not measured", served, exc)
        return out

    def heartbeat(self, phase: str, **extra: Any) -> None:
        from flywheel.base.heartbeat import write_status

        now = time.monotonic()
        if phase == "waiting" and now - getattr(self, "_last_beat", 0.0) < self.cfg.status_every_s:
            return
        self._last_beat = now
        write_status(self.cfg.status_name, {
            "phase": phase, "step": self.state.step, "policy_version": self.state.policy_version,
            "pending": len(self.stream.pending) if self.stream else 0,
            "trained_episodes": len(self.stream.trained) if self.stream else 0, **extra,
        }, var_dir=self.cfg.var_dir)


def rebase_target(published: list[int], current: int, aliases: dict[str, int]) -> int | None:
    """The champion to continue from when the gate abandoned the learner's line, else None.

    The line is abandoned when the newest published version is neither champion nor challenger:
    the gate rejected it (and cleared the challenger alias) or rolled it back. Serving then runs
    the champion. A learner that kept its own weights would publish more of what the gate refused,
    and in a full-weight tier it would see only the champion's rows, more than max_staleness
    versions behind it after a few rejections in a row: dropped as stale, so it never stepped again.
    """
    from flywheel.serving.registry import CHALLENGER, CHAMPION

    if not published:
        return None
    champion = aliases.get(CHAMPION, 0)  # no alias yet: policy-v0 is the champion, as the gate reads it
    if published[-1] in (champion, aliases.get(CHALLENGER)) or current == champion:
        return None
    return champion


def run(cfg: LearnerConfig, stop: threading.Event | None = None) -> int:
    """Set up (logging each phase), then loop: batch -> step -> checkpoint -> maybe publish."""
    from flywheel.learner import dist

    stop = stop_on_signals("finishing the current step, checkpointing, then exiting", stop)
    learner = Learner(cfg)
    world = learner.world
    tracker = Tracker(cfg) if world.is_main else Tracker(LearnerConfig(mlflow_tracking_uri=""))
    if world.is_main:
        write_resolved(cfg, Path(cfg.run_dir) / "learner-config.toml")
        tracker.tag("policy_version_start", str(learner.state.policy_version))
        learner.republish_latest()
    status = "FINISHED"
    try:
        while True:
            got = learner.next_batch(stop) if world.is_main else None
            plan = learner.plan(got[0]) if got is not None else None
            rebased, learner.rebased = learner.rebased, None
            # rank 0 decides; the others follow (None = stop): the same rebase onto the champion, if
            # rank 0 made one while waiting, then the same global batch on every rank
            plan, rebased = dist.broadcast((plan, rebased), world)
            if rebased is not None and not world.is_main:
                learner.rebase(*rebased)
            if plan is None:
                break
            result = learner.train_step(plan)
            if world.is_main:
                assert got is not None
                learner.finish_step(got[0], got[1], result, tracker)
            if cfg.max_steps and learner.steps_this_run >= cfg.max_steps:
                log.info("learner: max_steps %d reached", cfg.max_steps)
                stop.set()  # rank 0 then broadcasts the stop; the other ranks follow it
    except BaseException:
        status = "FAILED"
        raise
    finally:
        tracker.end(status)
        if world.is_main:
            learner.heartbeat("stopped")
        dist.shutdown(world)
    log.info("learner: stopped at step %d, policy_version %d", learner.state.step, learner.state.policy_version)
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(LearnerConfig, argv, "flywheel learner")
    setup_logging()
    return run(cfg)


if __name__ == "__main__":  # torchrun -m learner.daemon
    sys.exit(main())
