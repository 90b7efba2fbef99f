"""Following the promotion gate: the registry's aliases, whether they abandon the learner's line, the rebase.

The gate (serving/promote.py) judges each published version and moves the registry's champion
and challenger aliases. The learner reads them (GateFollower, rank 0): while the newest version
it published is champion or challenger it keeps training its own weights, and also when the gate let
it expire undecided (the evidence ran out, which is not evidence that it is worse); once the gate rejected
or rolled it back (`rebase_target`, a pure function) it continues from the champion's weights
(`rebase_onto`, every rank) and drops the rows the abandoned versions served. `gate_ruled` tells
publish_wait_for_gate whether the gate has decided on the newest version yet.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.base.versions import version_name
from flywheel.learner.config import LearnerConfig
from flywheel.learner.versions import serving_tier

if TYPE_CHECKING:  # torch-backed types: the daemon imports this module before it loads torch
    import torch

    from flywheel.learner.checkpoint import TrainerState
    from flywheel.learner.data import EpisodeStream
    from flywheel.learner.model import Policy

log = logging.getLogger(__name__)


def rebase_target(published: list[int], current: int, aliases: dict[str, int]) -> int | None:
    """The champion to continue from when the gate abandoned the learner's line, else None.

    The line is abandoned when the newest published version is neither champion nor challenger:
    the gate rejected it (and cleared the challenger alias) or rolled it back. Serving then runs
    the champion. A learner that kept its own weights would publish more of what the gate refused,
    and in a full-weight tier it would see only the champion's rows, more than max_staleness
    behind it after a few rejections in a row: dropped as stale, so it never stepped again.
    """
    from flywheel.serving.registry import CHALLENGER, CHAMPION

    if not published:
        return None
    champion = aliases.get(CHAMPION, 0)  # no alias yet: policy-v0 is the champion, as the gate reads it
    if published[-1] in (champion, aliases.get(CHALLENGER)) or current == champion:
        return None
    return champion


def gate_ruled(published: list[int], aliases: dict[str, int] | None) -> bool:
    """The gate has decided on the newest of `published` (promoted, rejected, rolled back), or there is none.

    aliases: as GateFollower.read_aliases returned them. None (nothing published, or the registry
    unreadable) counts as ruled, so a registry outage cannot stop publishing (publish reports the
    outage itself).
    """
    from flywheel.serving.registry import CHALLENGER, CHAMPION

    if aliases is None or not published:
        return True
    latest = published[-1]
    return aliases.get(CHALLENGER) != latest or aliases.get(CHAMPION) == latest


def abandoned_above(published: list[int], abandoned: list[int], version: int) -> list[int]:
    """The published versions a rebase onto `version` abandons (those above it, not abandoned before)."""
    return [v for v in published if v > version and v not in abandoned]


def rebase_onto(policy: Policy, optimizer: torch.optim.Optimizer, state: TrainerState,
                stream: EpisodeStream | None, version: int, source: str | None) -> None:
    """Load policy-v<version>'s weights (source: its directory; None for policy-v0) and abandon the line above it.

    The new line starts as a new run does: Adam's state is dropped (both moments describe gradients
    of the abandoned line) and the learning-rate warm-up runs again from this step
    (state.line_start_step). Keeping the second moment without a warm-up garbled the tool calls the
    batches rarely reinforce: in demo run 3 of issue 38 the version trained after a rebase onto policy-v0
    wrote malformed add calls 48% of the time (the warm start: 0.5%). Replayed offline on that run's rows
    (40 steps, a rebase onto policy-v0, 20 steps), 12.0% / 8.0% of sampled add / mul calls were malformed
    with the old rule, 5.3% / 2.2% with Adam's state dropped but no warm-up, 4.0% / 1.7% with this rule,
    which is a fresh start on those rows (600 calls each; docs/experiments.md, session 26).
    The line (state.lineage, which the staleness filter reads) becomes the champion and its ancestors.
    The caller makes `version` the current one (Versions.adopt).
    """
    abandoned = abandoned_above(state.published, state.abandoned, version)
    policy.load_published(Path(source) if source else None)
    optimizer.state.clear()  # AdamW creates each parameter's moments (and its step count) again at its next step
    if policy.sharded is not None:
        policy.sharded.optimizer_state = {}  # rank 0's gathered copy, which a checkpoint before the next step writes
    state.line_start_step = state.step
    state.abandoned.extend(abandoned)
    state.rebase_line(version)  # the champion's rows are lag 0 for the new line, its ancestors' as far behind as before
    if stream is not None:
        stream.abandoned.update(abandoned)
    log.warning("gate: policy-v%d was not kept (the champion is policy-v%d); continuing from the champion's "
                "weights, rows served by %s dropped", state.policy_version, version,
                ", ".join(version_name(v) for v in abandoned) or "none")


class GateFollower:
    """Rank 0's reads of the registry: the aliases, and the champion to rebase onto when our line was abandoned."""

    def __init__(self, cfg: LearnerConfig, state: TrainerState) -> None:
        self.cfg = cfg
        self.state = state
        self._registry: Any = None
        self._read_at = 0.0

    def registry(self) -> Any:
        from flywheel.serving.registry import Registry

        if self._registry is None:
            tier = serving_tier(self.cfg)
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

    def champion_to_follow(self, aliases: dict[str, int] | None = None) -> tuple[int, str | None] | None:
        """(version, source) of the champion to rebase onto when the gate abandoned our newest version, else None.

        aliases: as the caller just read them; None: read them here, at most every follow_gate_every_s.
        source is the champion's directory (None for policy-v0, the base weights).
        """
        cfg = self.cfg
        if not cfg.follow_gate:
            return None
        if aliases is None:
            if time.monotonic() - self._read_at < cfg.follow_gate_every_s:
                return None
            self._read_at = time.monotonic()
            aliases = self.read_aliases()
            if aliases is None:
                return None
        target = rebase_target(self.state.published, self.state.policy_version, aliases)
        if target is None:
            return None
        try:
            # a version whose publish failed before it was registered was never judged: keep training it
            newest = self.registry().find(self.state.published[-1])
            if newest is None:
                return None
            champion_lag = self.state.lags().get(target)
            if newest.tags.get("gate_decision") in ("expire", "halt") and champion_lag is not None \
                    and champion_lag <= cfg.max_staleness_steps:
                # undecided at the gate's sample cap, or a void test (halt): not shown worse, so the line goes on
                # (a new challenger follows); but once the weights are more than max_staleness_steps past the
                # champion (or the champion is off the line), the champion's rows are all stale and only a rebase
                # lets the learner step again
                return None
            found = self.registry().find(target) if target != 0 else None
        except Exception as exc:  # MLflow unreachable: keep training; the next read decides
            log.warning("gate: registry %s unreadable (%s: %s); not following the gate this time",
                        cfg.registered_model, type(exc).__name__, exc)
            return None
        source = found.source if found is not None else None
        if target != 0 and source is None:
            source = str(Path(cfg.policies_dir) / version_name(target))
        return target, source
