"""What a learner step reports: its metrics, and the MLflow run of one daemon lifetime that records them."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from flywheel.learner.config import LearnerConfig

if TYPE_CHECKING:  # torch-backed types: the daemon imports this module before it loads torch
    from flywheel.learner.checkpoint import TrainerState
    from flywheel.learner.data import Episode
    from flywheel.learner.trainer import StepResult

log = logging.getLogger(__name__)


# MLflow's LogBatch request limit (mlflow.utils.validation.MAX_METRICS_PER_BATCH): a flush sends chunks of this size
MAX_METRICS_PER_CALL = 1000
# metrics kept while the store refuses them (about 200 steps at the default max_staleness_steps); the oldest go first
MAX_KEPT_METRICS = 10_000


class Tracker:
    """Metrics of one daemon lifetime in one MLflow run ('' tracking URI: logging only).

    A step's metrics are kept and sent in one log_batch call every mlflow_flush_every_steps steps or
    mlflow_flush_every_s seconds, when the caller asks (a version), and at end(): each metric keeps its own
    step and the time it was logged, so the run reads as if each step were sent at once.
    """

    def __init__(self, cfg: LearnerConfig) -> None:
        self.client: Any = None
        self.run_id: str | None = None
        self.flush_every_steps = cfg.mlflow_flush_every_steps
        self.flush_every_s = cfg.mlflow_flush_every_s
        self.kept: list[Any] = []  # mlflow.entities.Metric, oldest first
        self.kept_steps = 0  # steps logged since the last flush
        self.flushed_at = time.monotonic()
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

    def log(self, step: int, metrics: dict[str, float], flush: bool = False) -> None:
        """Keep one step's metrics; send what is kept when it is due (or `flush`)."""
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.kept.extend(Metric(k, float(v), now, step) for k, v in metrics.items()
                         if v is not None and math.isfinite(v))
        self.kept_steps += 1
        due = (self.kept_steps >= self.flush_every_steps
               or (self.flush_every_s > 0 and time.monotonic() - self.flushed_at >= self.flush_every_s))
        if flush or due:
            self.flush()

    def flush(self) -> None:
        """Send the kept metrics. A refused send keeps what was not sent for the next flush (tracking is advisory:
        a locked sqlite file must not stop training), up to MAX_KEPT_METRICS."""
        if self.client is None or not self.kept:
            return
        self.flushed_at, self.kept_steps = time.monotonic(), 0  # a failed send waits for the next due flush too
        sent = 0
        try:
            while sent < len(self.kept):
                chunk = self.kept[sent:sent + MAX_METRICS_PER_CALL]
                self.client.log_batch(self.run_id, metrics=chunk)
                sent += len(chunk)
        except Exception as exc:
            self.kept = self.kept[sent:]
            dropped = max(0, len(self.kept) - MAX_KEPT_METRICS)
            self.kept = self.kept[dropped:]
            log.warning("mlflow: %d metrics not logged (%s); kept for the next flush%s", len(self.kept), exc,
                        f", the oldest {dropped} dropped" if dropped else "")
            return
        self.kept = []

    def tag(self, key: str, value: str) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.set_tag(self.run_id, key, value)

    def end(self, status: str) -> None:
        """Send what is kept, then close the run."""
        self.flush()
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.set_terminated(self.run_id, status)


def step_metrics(batch: list[Episode], lags: Counter, result: StepResult, state: TrainerState,
                 counters: Counter, max_staleness: int) -> dict[str, float]:
    """The metrics of one finished step. lags: policy lag -> rows of the batch; counters: the stream's drop counts."""
    rewards = [e.reward for e in batch]
    mean_r = sum(rewards) / len(rewards)
    std_r = math.sqrt(sum((r - mean_r) ** 2 for r in rewards) / max(len(rewards) - 1, 1))
    lag_rows = sum(lags.values())
    mean_lag = sum(k * v for k, v in lags.items()) / max(lag_rows, 1)
    metrics: dict[str, float] = {
        "loss": result.loss, "reward_mean": mean_r, "reward_std": std_r, "episodes": result.episodes,
        "ratio_mean": result.ratio_mean, "ratio_max": result.ratio_max, "clip_frac": result.clip_frac,
        "kl": result.kl, "kl_coef": result.kl_coef, "grad_norm": result.grad_norm, "tokens_per_s": result.tokens_per_s,
        "trained_tokens": result.trained_tokens, "policy_lag_mean": mean_lag,
        "session_openings": float(sum(1 for e in batch if e.opens_session)),
        "policy_lag_max": float(max(lags) if lags else 0), "policy_version": state.policy_version,
        "dropped_stale_total": counters["stale"], "dropped_corrupt_total": counters["corrupt"],
        "relabel_after_train_total": counters["relabel_after_train"],
        "abandoned_versions_total": float(len(state.abandoned)),
    }
    for lag in range(max_staleness + 1):
        metrics[f"staleness_lag_{lag}"] = float(lags.get(lag, 0))
    if result.behaviour_gap_mean is not None:
        metrics["mismatch_behaviour_mean"] = result.behaviour_gap_mean
        metrics["mismatch_behaviour_max"] = result.behaviour_gap_max or 0.0
    metrics.update(result.extra)
    return metrics
