"""`flywheel learner`: the continuous training daemon.

    flywheel learner                                   # LoRA on var/models/tiny-base, var/lake episodes
    flywheel learner --mode full --lr 1e-4             # full weights (untied models)
    torchrun --nproc-per-node 2 -m flywheel.learner.daemon ...  # data parallel, gloo on CPU (learner/dist.py)

One loop: wait for a batch of matured episodes (backpressure: at least min_batch fresh rows,
sleeping with back-off while the stream is empty) -> one optimizer step of the
importance-corrected policy gradient -> log the step's episode ids -> every N steps or T seconds
write var/policies/policy-v<N>/ and hand it to serving -> checkpoint (atomic) at each version and
every checkpoint_every_steps steps. SIGTERM/SIGINT finish the current step, checkpoint, exit 0; a
SIGKILL sends the learner back to its last checkpoint, and the steps after it (up to
checkpoint_every_steps) are trained again from its weights (learner/checkpoint.py).

`Learner` owns the shared state (weights, optimizer, TrainerState, episode stream) and composes
the parts that act on it:
    learner/trainer.py   the step: batch -> micro-batches -> loss (learner/loss.py) -> optimizer
    learner/gate.py      following the promotion gate: when it rejects or rolls back the newest
                         version, continue from the champion's weights
    learner/versions.py  when a version is due (with publish_wait_for_gate, after the gate's
                         verdict on the last), writing policy-v<N>/, handing it to serving, parity
    learner/metrics.py   the step's metrics and the MLflow run they go to
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.base.config import load_config, setup_logging, write_resolved
from flywheel.base.metrics import Metrics, Reading
from flywheel.base.stop import stop_on_signals
from flywheel.learner.config import LearnerConfig
from flywheel.learner.gate import GateFollower, gate_ruled, rebase_onto
from flywheel.learner.metrics import Tracker, step_metrics
from flywheel.learner.versions import Versions

if TYPE_CHECKING:  # torch-backed: loaded in Learner(), after the config is parsed and checked
    from flywheel.learner.checkpoint import TrainerState
    from flywheel.learner.data import Episode
    from flywheel.learner.trainer import BatchPlan, StepResult

log = logging.getLogger("learner")


class Learner:
    """Model, optimizer and training state of one rank; rank 0 also owns the data stream.

    Every rank trains (`trainer`) and rebases with rank 0; rank 0 alone reads the stream, follows
    the gate (`gate`), writes and pushes versions (`versions`) and checkpoints.
    """

    def __init__(self, cfg: LearnerConfig, world: Any | None = None) -> None:
        import torch

        from flywheel.learner import dist
        from flywheel.learner.data import EpisodeStream
        from flywheel.learner.loss import Baseline
        from flywheel.learner.model import load_policy, resolve_device
        from flywheel.learner.trainer import Trainer

        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.shaping_scale_trained = 1.0  # the PARL shaping weight of the last planned step (trained.jsonl)
        self.shaping_clock_warned = False
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
        self.optimizer = torch.optim.AdamW(self.policy.trainable_parameters(), lr=cfg.lr,
                                           weight_decay=cfg.weight_decay)
        self.state = self._resume()
        # the running mean is still kept under "batch": it is what a checkpoint shows as the reward level
        self.baseline = Baseline(cfg.baseline_momentum, dict(self.state.baseline)) if cfg.baseline != "none" else None
        self.trainer = Trainer(cfg, self.world, self.policy, self.optimizer, self.state)
        self.stream: EpisodeStream | None = None
        if self.world.is_main:
            self.stream = EpisodeStream(cfg.lake_root, self.policy.vocab_size, cfg.max_seq_len,
                                        cursor=self.state.cursor, trained=self.state.trained,
                                        abandoned=set(self.state.abandoned))
        self.gate = GateFollower(cfg, self.state)
        self.versions = Versions(cfg, self.state, self.policy, self.stream)
        self.steps_this_run = 0
        self.rebased: tuple[int, str | None] | None = None  # rank 0's rebase since the last broadcast
        self.last_batch: list[Episode] = []
        self.run_id: str | None = None  # the learner's MLflow run (run() sets it): each version names it
        self._last_beat = 0.0
        self._publish_checked = 0.0
        self.checkpointed_step = self.state.step  # the newest checkpoint's step (at start: the one resumed from)
        self.unsaved = False  # a step or a rebase since that checkpoint
        self.prom: LearnerMetrics | None = None  # rank 0's Prometheus metrics (run() makes them)

    def _resume(self) -> TrainerState:
        """The newest checkpoint's state, its weights and optimizer loaded; else a fresh state at start_version."""
        from flywheel.learner import checkpoint
        from flywheel.learner.checkpoint import TrainerState

        found = checkpoint.load_latest(self.run_dir, map_location=self.policy.device)
        if found is None:
            log.info("setup: no checkpoint under %s; starting at policy_version %d", self.run_dir,
                     self.cfg.start_version)
            return TrainerState(step=0, policy_version=self.cfg.start_version)
        state, tensors = found
        self.policy.load_weights_state(tensors["weights"])
        self.optimizer.load_state_dict(tensors["optimizer"])
        return state

    # -- every rank ---------------------------------------------------------------------------
    def train_step(self, plan: BatchPlan) -> StepResult:
        """One optimizer step on the global batch `plan` [(episode, advantage)] (learner/trainer.py)."""
        return self.trainer.step(plan)

    def rebase(self, version: int, source: str | None) -> None:
        """Continue from policy-v<version>'s weights (source: its directory or the registry's file:// URI of it;
        None for policy-v0)."""
        from flywheel.serving.publisher import local_source

        rebase_onto(self.policy, self.optimizer, self.state, self.stream, version,
                    local_source(source) if source else None)
        self.versions.adopt(version)  # the champion's weights get their own steps before the next version
        self.unsaved = True

    # -- rank 0: data -------------------------------------------------------------------------
    def plan(self, batch: list[Episode]) -> BatchPlan:
        """Advantages over the whole global batch (so every rank trains the same objective)."""
        from flywheel.learner.loss import advantages

        scale = self.shaping_scale_trained = self.shaping_scale()
        self.check_shaping_clock(batch)
        adv = advantages([e.trained_reward(scale) for e in batch], [e.task_type for e in batch],
                         [e.group_id for e in batch], self.baseline, group_relative=self.cfg.group_relative,
                         normalize=self.cfg.normalize_advantages, batch_baseline=self.cfg.baseline == "batch",
                         positive_only=self.cfg.positive_only, penalties=[e.r_penalty for e in batch])
        return list(zip(batch, adv))

    def check_shaping_clock(self, batch: list[Episode]) -> None:
        """Warn once when the builder left the annealing to this learner ([parl] anneal_clock = learner_step: rows
        carry the full lambdas) and this learner does not anneal (shaping_anneal_end_step 0): the shaping would
        then be trained at full weight for the whole run, which no one asked for."""
        if self.cfg.shaping_anneal_end_step or self.shaping_clock_warned:
            return
        shaped = sum(1 for e in batch if e.shaping_clock == "learner_step")
        if shaped:
            self.shaping_clock_warned = True
            log.warning("learner: %d rows of this batch carry PARL shaping at full lambdas for the learner to anneal "
                        "([parl] anneal_clock = learner_step) but shaping_anneal_end_step is 0: the shaping is trained "
                        "at full weight for the whole run; set --shaping-anneal-end-step", shaped)

    def shaping_scale(self) -> float:
        """The weight of the rows' PARL shaping at this step (1 unless shaping_anneal_end_step is set)."""
        from flywheel.learner.data import shaping_scale

        return shaping_scale(self.state.step, self.cfg.shaping_anneal_start_step, self.cfg.shaping_anneal_end_step)

    def next_batch(self, stop: threading.Event) -> tuple[list[Episode], Counter] | None:
        """Block until min_batch fresh episodes are pending (back-off sleep), then take a batch."""
        assert self.stream is not None
        cfg = self.cfg
        sleep_s, last_note, idle_since = 0.1, 0.0, time.monotonic()
        seen = self.stream.trainable(self.state.lags(), cfg.max_staleness_steps)
        while not stop.is_set():
            self.follow_gate()  # also while starving: after a rejection only the champion's rows arrive
            self.publish_while_waiting()
            self.stream.poll()
            lags = self.state.lags()  # after the rebase or publish just now, if any
            self.stream.drop_stale(lags, cfg.max_staleness_steps)
            ready = self.stream.trainable(lags, cfg.max_staleness_steps)
            if ready >= cfg.min_batch:
                batch, stats = self.stream.take(cfg.batch_size, lags, cfg.max_staleness_steps,
                                                 newest_first=cfg.newest_first,
                                                 openings=round(cfg.opening_share * cfg.batch_size))
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

    # -- rank 0: the gate and versions --------------------------------------------------------
    def follow_gate(self, aliases: dict[str, int] | None = None) -> None:
        """When the gate abandoned our newest version, continue from the champion (rebase).

        aliases: as the caller just read them; None: read them here, at most every follow_gate_every_s.
        """
        champion = self.gate.champion_to_follow(aliases)
        if champion is not None:
            self.rebase(*champion)
            self.rebased = champion  # run() broadcasts it: the other ranks rebase too

    def publish_while_waiting(self) -> None:
        """Write and push a version that fell due while no batch can form (checked every follow_gate_every_s).

        Rows go stale max_staleness_steps steps after the version that served them, so a learner that trained
        on while the gate judged its newest version runs out of fresh rows and stops stepping; the version
        then due (the gate ruled, or publish_supersede_s passed) must not wait for a step that cannot come.
        """
        now = time.monotonic()
        if (self.state.step == self.state.last_published_step
                or now - self._publish_checked < self.cfg.follow_gate_every_s):
            return  # nothing trained since the current version (or checked just now)
        self._publish_checked = now
        aliases = self.gate.read_aliases() if self.cfg.publish_wait_for_gate else None
        if aliases is not None:
            self.follow_gate(aliases)  # a rejection first: then there is nothing of the refused line to publish
        if self.publish_due(aliases):
            self.versions.write(self.run_id)
            self.save_checkpoint()
            self.versions.push(self.last_batch)

    def publish_due(self, aliases: dict[str, int] | None) -> bool:
        """A version is due by step count or by time. aliases: gate.read_aliases() as finish_step read it (only
        consulted with publish_wait_for_gate; never read again here, so an outage costs one failed read)."""
        return self.versions.due(gate_ruled(self.state.published, aliases))

    # -- rank 0: bookkeeping ------------------------------------------------------------------
    def finish_step(self, batch: list[Episode], lags: Counter, result: StepResult, tracker: Tracker) -> None:
        """After a step: log its episode ids, maybe write a version, checkpoint, push, report."""
        from flywheel.learner import checkpoint

        assert self.stream is not None
        self.steps_this_run += 1
        self.stream.mark_trained(batch)
        self.versions.trained(batch)
        # the shaping weight and KL coefficient this step trained with, and when: the swarm report draws them on the
        # run's time axis
        checkpoint.append_trained(self.run_dir, self.state.step, self.state.policy_version,
                                  [e.episode_id for e in batch],
                                  extra={"t": round(time.time(), 3), "shaping_scale": self.shaping_scale_trained,
                                         "kl": result.kl, "kl_coef": result.kl_coef})
        self.unsaved = True
        # the aliases only matter here when a version may be due: a rejection is followed before it is written (or
        # the next version would grow out of the refused line and take the challenger slot), and the verdict may be
        # what makes it due. Between versions next_batch follows the gate every follow_gate_every_s, as it does
        # without publish_wait_for_gate, instead of a registry read per step.
        may_publish = self.cfg.publish_wait_for_gate and self.versions.due(gate_ruled=True)
        aliases = self.gate.read_aliases() if may_publish else None
        if aliases is not None:
            self.follow_gate(aliases)
        published = self.publish_due(aliases)
        if published:
            self.versions.write(tracker.run_id)
        # a version written always has its checkpoint (a restart resumes on its line); between versions one every
        # checkpoint_every_steps steps
        if published or self.state.step - self.checkpointed_step >= self.cfg.checkpoint_every_steps:
            self.save_checkpoint()
        self.last_batch = batch
        counters = self.stream.counters
        metrics = step_metrics(batch, lags, result, self.state, counters, self.cfg.max_staleness_steps)
        if published:
            metrics.update(self.versions.push(batch))
        tracker.log(self.state.step, metrics, flush=published)
        if self.prom is not None:
            self.prom.observe_step(lags, result.tokens_per_s)
        mean_r, mean_lag = metrics["reward_mean"], metrics["policy_lag_mean"]
        self.heartbeat("training", policy_lag=round(mean_lag, 2), reward=round(mean_r, 4),
                       tokens_per_s=round(result.tokens_per_s), dropped_stale=counters["stale"],
                       dropped_corrupt=counters["corrupt"])
        gap = (f", logprob gap {result.behaviour_gap_mean:.1e}" if result.behaviour_gap_mean is not None else "")
        log.info("step %d v%d: reward %.3f, policy lag %.2f steps (max %d), loss %+.4f, ratio %.3f clip %.1f%%, "
                 "kl %.4f (coef %.3g), %.0f tokens/s, %d episodes (stale %d, corrupt %d total)%s", self.state.step,
                 self.state.policy_version, mean_r, mean_lag, int(metrics["policy_lag_max"]), result.loss,
                 result.ratio_mean, 100 * result.clip_frac, result.kl, result.kl_coef, result.tokens_per_s,
                 result.episodes, counters["stale"], counters["corrupt"], gap)

    def save_checkpoint(self) -> None:
        from flywheel.learner import checkpoint

        assert self.stream is not None
        self.state.cursor = dict(self.stream.cursor)
        self.state.trained = dict(self.stream.trained)
        self.state.baseline = self.baseline.state() if self.baseline is not None else {}
        checkpoint.save(self.run_dir, self.state, self.policy.weights_state(), self.optimizer.state_dict(),
                        keep=self.cfg.keep_checkpoints)
        self.checkpointed_step, self.unsaved = self.state.step, False

    def save_at_stop(self) -> None:
        """A graceful stop keeps what was trained (or rebased onto) since the last checkpoint."""
        if self.unsaved:
            log.info("checkpoint: stopping at step %d (last checkpoint at step %d); saving", self.state.step,
                     self.checkpointed_step)
            self.save_checkpoint()

    def heartbeat(self, phase: str, **extra: Any) -> None:
        from flywheel.base.heartbeat import write_status

        now = time.monotonic()
        if phase == "waiting" and now - self._last_beat < self.cfg.status_every_s:
            return
        self._last_beat = now
        write_status(self.cfg.status_name, {
            "phase": phase, "step": self.state.step, "policy_version": self.state.policy_version,
            "pending": len(self.stream.pending) if self.stream else 0,
            "trained_episodes": len(self.stream.trained) if self.stream else 0, **extra,
        }, var_dir=self.cfg.var_dir)


# Policy lag in learner steps: 0 is on-policy; max_staleness_steps (LearnerConfig) is where rows stop being trained.
LAG_BUCKETS_STEPS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)


class LearnerMetrics:
    """flywheel_learner_*: per step the tokens/s and each trained row's policy lag; the state and the stream's
    counts read at scrape."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        self.metrics = Metrics("learner")
        self.throughput = self.metrics.gauge("training_throughput", "tokens_per_second", "tokens/s of the last step")
        self.steps = self.metrics.counter("trained", "steps", "optimizer steps of this process")
        self.lag = self.metrics.histogram("policy_lag", "steps", "each trained row: learner steps since the version "
                                          "that sampled it", LAG_BUCKETS_STEPS)
        self.metrics.read(self.readings)

    def observe_step(self, lags: Counter, tokens_per_s: float) -> None:
        """lags: policy lag -> rows of the step's batch."""
        self.throughput.set(tokens_per_s)
        for lag, rows in lags.items():
            for _ in range(rows):
                self.lag.observe(lag)
        self.steps.inc()  # last: a scrape that sees the step sees its lags too

    def readings(self) -> list[Reading]:
        learner, stream = self.learner, self.learner.stream
        return [
            Reading("gauge", "policy", "version", "the policy version the weights are at",
                    learner.state.policy_version),
            Reading("counter", "published", "versions", "versions this learner's state has published",
                    len(learner.state.published)),
            Reading("counter", "trained", "episodes", "episodes trained (the state's lifetime)",
                    len(stream.trained) if stream else 0),
            Reading("counter", "dropped", "episodes", "episodes not trained, by reason (stale, corrupt, duplicate ...)",
                    dict(stream.counters) if stream else {}, "reason"),
            Reading("gauge", "pending", "episodes", "episodes read and waiting for a batch",
                    len(stream.pending) if stream else 0),
        ]


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
        learner.run_id = tracker.run_id
        learner.versions.republish_latest()
        learner.prom = LearnerMetrics(learner)
        learner.prom.metrics.serve(cfg.metrics_port)  # rank 0 only: the other ranks' would share its port
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
        if world.is_main:
            learner.save_at_stop()
    except BaseException:
        status = "FAILED"
        raise
    finally:
        tracker.end(status)
        if world.is_main:
            learner.heartbeat("stopped")
        if learner.prom is not None:
            learner.prom.metrics.close()
        step, version = learner.state.step, learner.state.policy_version
        del learner  # the model, optimizer and trainer hold the process group: gone before it is (dist.shutdown)
        dist.shutdown(world, clean=status == "FINISHED")
    log.info("learner: stopped at step %d, policy_version %d", step, version)
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(LearnerConfig, argv, "flywheel learner")
    setup_logging()
    from flywheel.ingest.lake import LakeReadError

    try:
        return run(cfg)
    except LakeReadError as exc:  # a damaged lake file: stop before it, saying which (lake.read_file)
        log.error("%s", exc)
        return 1


if __name__ == "__main__":  # torchrun -m flywheel.learner.daemon
    sys.exit(main())
