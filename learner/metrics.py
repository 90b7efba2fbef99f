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
