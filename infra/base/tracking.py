"""MLflow access shared by every process: one absolute tracking URI, experiments whose artifacts
land under var/mlflow/artifacts (a sqlite store otherwise defaults them to ./mlruns of whatever
directory the process happened to start in)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flywheel.base import defaults

REPO_ROOT = Path(__file__).resolve().parents[2]


def absolute_uri(uri: str) -> str:
    """sqlite:///relative/path -> sqlite:////absolute/path (relative to the repo), so every process,
    whatever its working directory, opens the same store."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        path = (REPO_ROOT / uri[len(prefix):]).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return prefix + str(path)
    return uri


def artifacts_root(uri: str) -> Path:
    """Artifact folder beside a sqlite store (var/mlflow/artifacts for the default store)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        return Path(absolute_uri(uri)[len(prefix):]).parent / "artifacts"
    return (REPO_ROOT / defaults.MLFLOW_ARTIFACTS_DIR).resolve()


def client(uri: str = defaults.MLFLOW_TRACKING_URI) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=absolute_uri(uri), registry_uri=absolute_uri(uri))


def experiment_id(name: str, uri: str = defaults.MLFLOW_TRACKING_URI) -> str:
    """Id of the named experiment, created with its artifacts under the store's artifact folder."""
    c = client(uri)
    found = c.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = (artifacts_root(uri) / name).resolve()
    location.mkdir(parents=True, exist_ok=True)
    try:
        return c.create_experiment(name, artifact_location=location.as_uri())
    except Exception:  # created concurrently by another process: use theirs
        found = c.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id
