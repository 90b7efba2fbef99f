"""The serving tier as configuration: which vLLM servers exist and how versions are kept on them.

One `TierConfig` is shared by the publisher, the router, the promoter and `flywheel bench weights`,
so a single `--servers` flag (or FLYWHEEL_SERVERS) moves all of them to a real deployment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flywheel.base import defaults
from flywheel.base.config import ConfigError, setting
from flywheel.base.versions import version_name


@dataclass
class TierConfig:
    """The vLLM servers of the tier and the MLflow registry that records their versions."""

    servers: list[str] = setting([defaults.VLLM_URL], "base URLs of every vLLM server in the tier (comma separated)")
    base_served_name: str = setting(version_name(0), "name each server serves its full weights under")
    base_model: str = setting(defaults.BASE_MODEL_DIR, "base model directory: version 0, restored on a failed full reload")
    policies_dir: str = setting(defaults.POLICIES_DIR, "where policy-v<N> directories live")
    keep_loras: int = setting(2, "newest LoRA versions kept resident besides champion and challenger")
    max_loras: int = setting(4, "LoRA slots per server (vLLM --max-loras); publish never exceeds it")
    max_lora_rank: int = setting(32, "largest LoRA rank the servers accept (vLLM --max-lora-rank)")
    transport: str = setting("http", "full-weight transport: http (reload_weights from a shared path) or nccl (GPU tier, untested here)")
    challenger_share: float = setting(0.1, "share of sessions routed to the challenger (sticky per session)")
    alias_refresh_s: float = setting(2.0, "how often the router re-reads the aliases (a rollback re-routes within this)")
    http_timeout_s: float = setting(60.0, "timeout of one admin request to a server")
    pause_timeout_s: float = setting(600.0, "longest a full push waits for in-flight requests to finish (pause mode=wait)")
    mlflow_tracking_uri: str = setting(defaults.MLFLOW_TRACKING_URI, "MLflow tracking/registry URI")
    registered_model: str = setting(defaults.REGISTERED_MODEL, "MLflow registered model holding every policy version")

    def check(self) -> None:
        if not self.servers:
            raise ConfigError("servers: at least one vLLM server URL is required")
        if self.transport not in ("http", "nccl"):
            raise ConfigError(f"transport: {self.transport!r} is not http or nccl")
        if not 0.0 <= self.challenger_share <= 1.0:
            raise ConfigError(f"challenger_share: {self.challenger_share} is not within [0, 1]")
        if self.keep_loras + 2 > self.max_loras:
            raise ConfigError(
                f"keep_loras ({self.keep_loras}) + champion + challenger exceeds max_loras ({self.max_loras})")

    def with_changes(self, **changes: object) -> "TierConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.check()
        return cfg
