"""Heartbeat files: each daemon publishes its state; `flywheel status` and the demo read them.

Each daemon calls `write_status(name, fields)` every few seconds; the file is replaced
atomically, so a reader never sees half of one. Status files carry their own write time, so
a dead daemon shows up as stale instead of looking healthy forever.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from flywheel.base import defaults
from flywheel.base.atomic import Durability, write_json

STALE_AFTER_S = 30.0


def status_dir(var_dir: str | Path = defaults.VAR_DIR) -> Path:
    return Path(var_dir) / "run" / "status"


def write_status(name: str, fields: dict[str, Any], var_dir: str | Path = defaults.VAR_DIR) -> None:
    """Publish a daemon's current state (atomic replace; never raises into the daemon's loop)."""
    payload = {"name": name, "pid": os.getpid(), "updated": time.time(), **fields}
    try:
        write_json(status_dir(var_dir) / f"{name}.json", payload, Durability.ADVISORY, default=str, sort_keys=True)
    except OSError:
        pass  # status is advisory: a full disk must not stop training or ingest


def read_statuses(var_dir: str | Path = defaults.VAR_DIR) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    directory = status_dir(var_dir)
    if not directory.is_dir():
        return out
    for path in sorted(directory.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        record["stale"] = time.time() - float(record.get("updated", 0)) > STALE_AFTER_S
        out[path.stem] = record
    return out

