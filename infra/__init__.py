"""flywheel (this folder, infra/, is the package root): online reinforcement learning from production agent traffic.

The agent-facing API is importable from here on a base install (kafka-python only):

    from flywheel import SessionLogger, OutcomeReporter, current_session, wrap_openai

Sub-packages follow the data: flywheel.base (config, heartbeats, atomic writes, stop signal,
version names) <- flywheel.ingest (schema, SDK, lake writer) <- flywheel.rewards (episode
builder) <- flywheel.learner <- flywheel.serving (publisher, router, capture proxy, gate);
flywheel.demo (the simulated production side), flywheel.stack and flywheel.cli sit on top.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

try:
    __version__ = metadata.version("agent-flywheel")
except metadata.PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = ["OutcomeReporter", "Session", "SessionLogger", "__version__", "current_session", "wrap_openai"]
_SDK_NAMES = frozenset({"OutcomeReporter", "Session", "SessionLogger", "current_session", "wrap_openai"})


def __getattr__(name: str) -> Any:
    # Lazy, so `import flywheel.base` (every daemon) does not pay for the SDK's kafka-python import.
    if name in _SDK_NAMES:
        from flywheel.ingest import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'flywheel' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names are not module globals until first use; list them so completion and dir() find them.
    return sorted(set(globals()) | _SDK_NAMES)
