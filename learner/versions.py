"""Policy versions of the learner: when one is due, writing policy-v<N>/, handing it to serving.

A version is due every publish_every_steps steps or publish_every_s seconds (with
publish_wait_for_gate, the step count waits for the gate's verdict on the previous one, at most
publish_supersede_s). It is
written as var/policies/policy-v<N>/ (weights + policy.json) into a temp directory renamed in
place (flywheel.base.atomic), becomes the learner's current version, and is handed to
`flywheel.serving.publisher.publish`, which pushes it to every vLLM server and registers it in
MLflow. After a push, vLLM scores a sample of the last batch to measure the served artifact's
logprob gap to the learner (learner/parity.py). Rank 0 alone versions and pushes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from flywheel.base import defaults
from flywheel.base.atomic import Durability, publish, temp_path
from flywheel.base.versions import parse_version, version_name
from flywheel.learner.config import LearnerConfig

if TYPE_CHECKING:  # torch-backed types: the daemon imports this module before it loads torch
    from flywheel.learner.checkpoint import TrainerState
    from flywheel.learner.data import Episode, EpisodeStream
    from flywheel.learner.model import Policy
    from flywheel.serving.tier import TierConfig

log = logging.getLogger(__name__)


def serving_tier(cfg: LearnerConfig) -> TierConfig:
    """The serving tier to publish to: the tier's own FLYWHEEL_* settings (FLYWHEEL_SERVERS lists every
    server of a multi-server tier), with this learner's model, directories and registry winning."""
    from flywheel.base.config import resolve
    from flywheel.serving.tier import TierConfig

    mine: dict[str, Any] = {"base_model": cfg.base_model, "policies_dir": cfg.policies_dir,
                            "registered_model": cfg.registered_model,
                            "mlflow_tracking_uri": cfg.mlflow_tracking_uri or defaults.MLFLOW_TRACKING_URI}
    if "FLYWHEEL_SERVERS" not in os.environ:
        mine["servers"] = [cfg.vllm_url]
    return resolve(TierConfig, {}, os.environ, mine)


def next_version(policies_dir: str | Path, current: int) -> int:
    """One past both `current` and any directory already there (a crash may have left one unrecorded)."""
    existing = [v for p in Path(policies_dir).glob("policy-v*") if (v := parse_version(p.name)) is not None]
    return max([current, *existing]) + 1


def version_meta(version: int, kind: str, base_model: str, state: TrainerState,
                 data_window: dict[str, Any], learner_run_id: str | None = None) -> dict[str, Any]:
    """policy.json of a new version; `state` is the learner's before the version becomes current.

    Lineage: parent_version is the version these weights continued from (the one published before, or the
    champion the learner rebased onto: both become state.policy_version through Versions.adopt);
    data_window.since_parent is the range of episodes trained since then (episode_range); learner_run_id
    is the MLflow run of the learner (None with tracking off).
    """
    return {
        "policy_version": version, "kind": kind, "base_model": str(Path(base_model).resolve()),
        "created_ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "learner_step": state.step,
        "data_window": {**data_window, "since_parent": dict(state.since_parent)},
        "parent_version": state.policy_version, "learner_run_id": learner_run_id,
    }


def episode_range(window: dict[str, Any], batch: Sequence[Episode], step: int) -> dict[str, Any]:
    """`window` (episodes trained since the parent version; {} for none) with one more step's `batch` added.

    Running counts and bounds, O(batch) per step: count, steps, first_step/last_step (the learner steps,
    whose episode ids trained.jsonl lists), first_call_ts/last_call_ts (when the episodes were served) and
    min/max_policy_version (which versions served them).
    """
    if not batch:
        return dict(window)

    def bound(pick: Callable[[list[Any]], Any], key: str, values: list[Any]) -> Any:
        known = [*values, *([window[key]] if window.get(key) is not None else [])]
        return pick(known) if known else None

    stamps = [e.call_ts for e in batch if e.call_ts is not None]
    served = [e.policy_version for e in batch]
    return {
        "count": window.get("count", 0) + len(batch), "steps": window.get("steps", 0) + 1,
        "first_step": window.get("first_step", step), "last_step": step,
        "first_call_ts": bound(min, "first_call_ts", stamps), "last_call_ts": bound(max, "last_call_ts", stamps),
        "min_policy_version": bound(min, "min_policy_version", served),
        "max_policy_version": bound(max, "max_policy_version", served),
    }


class Versions:
    """The learner's line of versions: the publish clock, writing the next one, pushing it to serving."""

    def __init__(self, cfg: LearnerConfig, state: TrainerState, policy: Policy,
                 stream: EpisodeStream | None) -> None:
        self.cfg = cfg
        self.state = state
        self.policy = policy
        self.stream = stream
        self.last_publish_time = time.monotonic()
        self.version_dir: Path | None = None  # the newest directory written (or found at start-up)

    def due(self, gate_ruled: bool) -> bool:
        """A version is due by step count or by time; gate_ruled: the gate has judged the newest one
        (only consulted with publish_wait_for_gate)."""
        cfg = self.cfg
        by_steps = (cfg.publish_every_steps > 0
                    and self.state.step - self.state.last_published_step >= cfg.publish_every_steps)
        by_time = cfg.publish_every_s > 0 and time.monotonic() - self.last_publish_time >= cfg.publish_every_s
        if by_steps and not by_time and cfg.publish_wait_for_gate and not gate_ruled and not self.supersedes():
            return False  # the steps go on; the version waits until the gate has judged the one before
        return by_steps or by_time

    def supersedes(self) -> bool:
        """The gate has had publish_supersede_s to judge the newest version and has not: the next may replace it.

        Ending an undecided test promotes nothing, so it cannot add a false promotion (each challenger's
        sequential test holds its alpha whenever it stops); what it saves is the champion's slot being held
        by an early version the gate cannot tell apart from the champion while better ones wait.
        """
        limit = self.cfg.publish_supersede_s
        return limit > 0 and time.monotonic() - self.last_publish_time >= limit

    def next_version(self) -> int:
        return next_version(self.cfg.policies_dir, self.state.policy_version)

    def adopt(self, version: int) -> None:
        """Make `version` current: the next version is due publish_every_steps / _s from now, and its episode
        range starts empty (after a rebase too: the steps before it trained weights the learner left)."""
        self.state.policy_version = version
        self.state.last_published_step = self.state.step
        # its rows lag 0 now (a rebase cut the line first: gate.rebase_onto)
        self.state.lineage[version] = self.state.step
        self.state.since_parent = {}
        self.last_publish_time = time.monotonic()

    def trained(self, batch: Sequence[Episode]) -> None:
        """Add a finished step's batch to the episode range the next version records."""
        self.state.since_parent = episode_range(self.state.since_parent, batch, self.state.step)

    def write(self, learner_run_id: str | None = None) -> Path:
        """Write policy-v<N>/ atomically (temp dir + rename) and make N the current version.

        learner_run_id: the learner's MLflow run, recorded in policy.json (the registry links the version to it).
        """
        assert self.stream is not None
        version = self.next_version()
        root = Path(self.cfg.policies_dir)
        root.mkdir(parents=True, exist_ok=True)
        final = root / version_name(version)
        tmp = temp_path(final)
        tmp.mkdir()
        kind = self.policy.save_weights(tmp)
        meta = version_meta(version, kind, self.cfg.base_model, self.state, self.stream.data_window(), learner_run_id)
        (tmp / "policy.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        publish(tmp, final, Durability.DURABLE)  # serving may read it from another host right away
        log.info("publish: wrote %s (%s, step %d, parent policy-v%d)", final, kind, self.state.step,
                 self.state.policy_version)
        self.state.published.append(version)
        self.adopt(version)
        self.version_dir = final
        return final

    def republish_latest(self) -> None:
        """At start-up, hand the newest version to serving again: a kill between writing a version and
        pushing it would otherwise leave it unserved (publish is idempotent, so this is cheap when it was)."""
        if not (self.cfg.publish and self.state.published):
            return
        path = Path(self.cfg.policies_dir) / version_name(self.state.published[-1])
        if path.is_dir():
            self.version_dir = path
            log.info("setup: making sure serving has %s", path.name)
            self.push([])

    def push(self, batch: list[Episode]) -> dict[str, float]:
        """Hand the newest directory to serving and measure the served artifact's parity on a sample of `batch`."""
        from flywheel.serving import publisher

        out: dict[str, float] = {"published_version": float(self.state.policy_version)}
        if not self.cfg.publish:
            return out
        start = time.perf_counter()
        try:
            # the one hand-off owned by serving: push to every vLLM server and register in MLflow
            assert self.version_dir is not None, "a version is written before it is handed to serving"
            result = publisher.publish(self.version_dir, serving_tier(self.cfg),
                                       artifact_source=self.cfg.publish_artifacts)
            served = result.served_name
            # full weights go only to the free servers: score parity where the version is, not on vllm_url
            server = result.pushed[0] if result.pushed else self.cfg.vllm_url
            out["publish_s"] = time.perf_counter() - start
            log.info("publish: policy-v%d handed to serving in %.2f s (served as %s)", self.state.policy_version,
                     out["publish_s"], served)
        except Exception as exc:  # serving keeps the old version; the directory stays for `flywheel publish`
            log.error("publish: policy-v%d NOT pushed (%s: %s); retry with `flywheel publish %s`",
                      self.state.policy_version, type(exc).__name__, exc, self.version_dir)
            return out
        if served is not None and self.cfg.parity_samples > 0 and batch:
            out.update(self.served_parity(batch, served, server))
        return out

    def served_parity(self, batch: list[Episode], served: str, server: str) -> dict[str, float]:
        """Learner vs vLLM logprobs of the served version on a sample of `batch` ({} when vLLM cannot score)."""
        from flywheel.learner.parity import served_gap

        sample = random.Random(self.state.step).sample(batch, min(self.cfg.parity_samples, len(batch)))
        try:
            g = served_gap(self.policy, sample, server, served)
        except Exception as exc:
            log.warning("parity: vLLM scoring of %s failed (%s); mismatch not measured", served, exc)
            return {}
        log.info("parity: policy-v%d learner vs vLLM logprobs on %d tokens: mean |diff| %.2e, max %.2e",
                 self.state.policy_version, g.tokens, g.mean_abs, g.max_abs)
        return {"parity_served_mean": g.mean_abs, "parity_served_max": g.max_abs}
