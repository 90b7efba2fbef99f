"""MLflow registry helpers: one registered model, one model version per policy version, two aliases.

Aliases `champion` and `challenger` name the routed versions (MLflow stages are deprecated and not
used). The registered model's tag `champion_history` keeps the champions in order (a JSON list of
policy versions), so a rollback knows where to go back to. Model version numbers are MLflow's own;
the policy version lives in the tag `policy_version`, and every function here speaks policy versions.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from flywheel.base import tracking

log = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"
HISTORY_TAG = "champion_history"
VERSION_TAGS = ("policy_version", "kind", "base_model", "learner_step", "data_window", "parent_version",
                "learner_run_id")


@dataclass(frozen=True)
class RegisteredVersion:
    """One policy version as the registry knows it."""

    policy_version: int
    model_version: str  # MLflow's model version number
    kind: str
    source: str
    tags: dict[str, str]


class Registry:
    """Policy versions, aliases and the champion history of one registered model."""

    def __init__(self, uri: str, name: str, client: Any | None = None) -> None:
        self.uri = uri
        self.name = name
        self.client = client if client is not None else tracking.client(uri)

    # -- registered model ---------------------------------------------------------------------
    def ensure_model(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            try:
                self.client.create_registered_model(
                    self.name, description="agent-flywheel policy versions (tag policy_version = served policy-v<N>)")
            except MlflowException:  # created concurrently: fine
                self.client.get_registered_model(self.name)

    def aliases(self) -> dict[str, int]:
        """alias -> policy version, for every alias set on the model (empty when none or no model)."""
        return {alias: rv.policy_version for alias, rv in self.alias_versions().items()}

    def alias_versions(self) -> dict[str, RegisteredVersion]:
        """alias -> the registered version it points at (empty when none or no model)."""
        from mlflow.exceptions import MlflowException

        try:
            model = self.client.get_registered_model(self.name)
        except MlflowException:
            return {}
        out: dict[str, RegisteredVersion] = {}
        for alias, model_version in (model.aliases or {}).items():
            mv = self.client.get_model_version(self.name, str(model_version))
            out[alias] = RegisteredVersion(int(mv.tags["policy_version"]), str(mv.version), mv.tags.get("kind", ""),
                                           mv.source, dict(mv.tags))
        return out

    # -- versions -----------------------------------------------------------------------------
    def register(self, policy_version: int, source: str, tags: dict[str, str], description: str = "",
                 run_id: str | None = None) -> RegisteredVersion:
        """Create the model version of a policy version, or return the existing one (publish is retryable).

        run_id: the MLflow run that produced the weights (the learner's), which MLflow links the version to.
        """
        self.ensure_model()
        found = self.find(policy_version)
        if found is not None:
            return found
        tags = {**tags, "policy_version": str(policy_version)}
        mv = self.client.create_model_version(self.name, source=source, run_id=run_id, tags=tags,
                                              description=description)
        log.info("registry: %s version %s <- policy-v%d (%s)", self.name, mv.version, policy_version, source)
        return RegisteredVersion(policy_version, str(mv.version), tags.get("kind", ""), source, tags)

    def find(self, policy_version: int) -> RegisteredVersion | None:
        found = self.client.search_model_versions(f"name='{self.name}' and tags.policy_version='{policy_version}'")
        if not found:
            return None
        mv = sorted(found, key=lambda m: int(m.version))[0]
        return RegisteredVersion(policy_version, str(mv.version), mv.tags.get("kind", ""), mv.source, dict(mv.tags))

    def versions(self) -> list[RegisteredVersion]:
        """Every registered policy version, oldest first."""
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.search_model_versions(f"name='{self.name}'")
        except MlflowException:
            return []
        out = [RegisteredVersion(int(mv.tags["policy_version"]), str(mv.version), mv.tags.get("kind", ""), mv.source,
                                 dict(mv.tags)) for mv in found if "policy_version" in mv.tags]
        return sorted(out, key=lambda v: v.policy_version)

    def tag_version(self, policy_version: int, tags: dict[str, Any]) -> None:
        found = self.find(policy_version)
        if found is None:
            log.warning("registry: policy-v%d is not registered in %s; tags %s not written", policy_version, self.name,
                        sorted(tags))
            return
        for key, value in tags.items():
            self.client.set_model_version_tag(self.name, found.model_version, key, str(value))

    # -- aliases ------------------------------------------------------------------------------
    def set_alias(self, alias: str, policy_version: int) -> None:
        found = self.find(policy_version)
        if found is None:
            raise KeyError(f"policy-v{policy_version} is not registered in {self.name}; publish it first")
        self.client.set_registered_model_alias(self.name, alias, found.model_version)

    def clear_alias(self, alias: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.delete_registered_model_alias(self.name, alias)
        except MlflowException:
            pass  # not set: nothing to clear

    def champion_history(self) -> list[int]:
        from mlflow.exceptions import MlflowException

        try:
            tags = self.client.get_registered_model(self.name).tags or {}
        except MlflowException:
            return []
        return [int(v) for v in json.loads(tags.get(HISTORY_TAG, "[]"))]

    def make_champion(self, policy_version: int) -> None:
        """Move `champion` to a version, remember it in the history, and clear `challenger` if it pointed there."""
        self.ensure_model()
        history = self.champion_history()
        current = self.aliases().get(CHAMPION)
        if current is not None and (not history or history[-1] != current):
            history.append(current)  # a champion set by hand still becomes a rollback target
        if not history or history[-1] != policy_version:
            history.append(policy_version)
        self.set_alias(CHAMPION, policy_version)
        self.client.set_registered_model_tag(self.name, HISTORY_TAG, json.dumps(history))
        if self.aliases().get(CHALLENGER) == policy_version:
            self.clear_alias(CHALLENGER)

    def previous_champion(self) -> int | None:
        """The champion before the current one, or None when there was none."""
        history = self.champion_history()
        current = self.aliases().get(CHAMPION)
        if current is None:
            return history[-1] if history else None
        while history and history[-1] == current:
            history.pop()
        return history[-1] if history else None

    def rollback(self) -> tuple[int | None, int]:
        """Move `champion` back to the previous champion. Returns (from, to); raises when there is none.

        The rolled-back version leaves the history, so a second rollback goes one further back.
        Version 0 (the base model, never registered) is a valid target: the alias is then cleared
        and the router falls back to policy-v0.
        """
        history = self.champion_history()
        current = self.aliases().get(CHAMPION)
        while history and history[-1] == current:
            history.pop()
        if not history:
            if current is None:
                raise LookupError(f"{self.name}: no champion to roll back")
            target = 0  # before the first promotion the base model served
        else:
            target = history[-1]
        if target == 0:
            self.clear_alias(CHAMPION)
        else:
            self.set_alias(CHAMPION, target)
        self.client.set_registered_model_tag(self.name, HISTORY_TAG, json.dumps(history))
        if current is not None:
            self.tag_version(current, {"rolled_back": "true"})
        return current, target
