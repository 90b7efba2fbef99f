"""The serving tier as configuration: which vLLM servers exist and how versions are kept on them.

One `TierConfig` is shared by the publisher, the router, the promoter and `flywheel bench weights`,
so a single `--servers` flag (or FLYWHEEL_SERVERS) moves all of them to a real deployment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from flywheel.base import defaults
from flywheel.base.config import ConfigError, check_choices, setting
from flywheel.base.versions import version_name


@dataclass
class TierConfig:
    """The vLLM servers of the tier and the MLflow registry that records their versions."""

    servers: list[str] = setting([defaults.VLLM_URL], "base URLs of every vLLM server in the tier (comma separated)")
    base_served_name: str = setting(version_name(0), "name each server serves its full weights under")
    base_model: str = setting(defaults.BASE_MODEL_DIR, "base model directory: version 0, restored on a "
                                                       "failed full reload")
    policies_dir: str = setting(defaults.POLICIES_DIR, "where policy-v<N> directories live")
    keep_loras: int = setting(2, "newest LoRA versions kept resident besides champion and challenger")
    max_loras: int = setting(4, "LoRA slots per server (vLLM --max-loras); publish never exceeds it")
    max_lora_rank: int = setting(32, "largest LoRA rank the servers accept (vLLM --max-lora-rank)")
    replace_live: bool = setting(False, "full weights only: let a publish replace a live version (champion, control) "
                                        "when no server is free, as a one-server tier must; champion and challenger "
                                        "are then never served at the same time, so the gate has no concurrent "
                                        "sessions to compare")
    transport: Literal["http", "nccl"] = setting(
        "http", "full-weight transport: http (reload_weights from a shared path) or nccl (GPU tier, untested here)")
    challenger_share: float = setting(0.1, "share of all sessions routed to the challenger while there is one (sticky "
                                           "per session)")
    control_share: float = setting(0.0, "share of all sessions always served by control_version, for the whole run: "
                                        "the concurrent baseline every version is compared with (0: no control arm)")
    control_version: int = setting(0, "the fixed version the control arm serves (0: the base model, policy-v0)")
    spare_to_control: bool = setting(False, "while there is no challenger, its share goes to the control arm instead "
                                            "of the champion: a larger concurrent control when the champion is "
                                            "measured alone (the demo's final window), at no cost to a gate test, "
                                            "which compares challenger with champion while one is live")
    control_kind: Literal["lora", "full"] = setting(
        "full", "lora or full: how a registered control_version is served (version 0 is always full)")
    alias_refresh_s: float = setting(2.0, "how often the router re-reads the aliases (a rollback re-routes "
                                          "within this)")
    http_timeout_s: float = setting(60.0, "timeout of one admin request to a server")
    pause_timeout_s: float = setting(600.0, "longest a full push waits for in-flight requests to finish "
                                            "(pause mode=wait)")
    mlflow_tracking_uri: str = setting(defaults.MLFLOW_TRACKING_URI, "MLflow tracking/registry URI")
    registered_model: str = setting(defaults.REGISTERED_MODEL, "MLflow registered model holding every policy version")

    def check(self) -> None:
        if not self.servers:
            raise ConfigError("servers: at least one vLLM server URL is required")
        check_choices(self)  # transport, control_kind
        if not 0.0 <= self.challenger_share <= 1.0:
            raise ConfigError(f"challenger_share: {self.challenger_share} is not within [0, 1]")
        if not 0.0 <= self.control_share < 1.0:
            raise ConfigError(f"control_share: {self.control_share} is not within [0, 1)")
        if self.control_share + self.challenger_share >= 1.0 and self.challenger_share > 0:
            raise ConfigError(f"control_share ({self.control_share}) + challenger_share ({self.challenger_share}) "
                              "exceeds 1: the champion would get no sessions")
        if self.control_version < 0:
            raise ConfigError(f"control_version: {self.control_version} is not a version")
        lora_control = self.control_share > 0 and self.control_version != 0 and self.control_kind == "lora"
        if self.keep_loras + 2 + lora_control > self.max_loras:
            raise ConfigError(f"keep_loras ({self.keep_loras}) + champion + "
                              f"challenger{' + control' if lora_control else ''} exceeds max_loras ({self.max_loras})")

    def live_versions(self, champion: int, challenger: int | None) -> set[int]:
        """The versions that must stay served: the champion, the challenger and (with a control arm) the control."""
        return {champion} | ({challenger} if challenger is not None else set()) | (
            {self.control_version} if self.control_share > 0 else set())

    def with_changes(self, **changes: Any) -> "TierConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.check()
        return cfg
