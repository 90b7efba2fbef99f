"""`flywheel status`: one view of the whole loop, built from the daemons' heartbeat files.

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

from infra import defaults

STALE_AFTER_S = 30.0


def status_dir(var_dir: str | Path = defaults.VAR_DIR) -> Path:
    return Path(var_dir) / "run" / "status"


def write_status(name: str, fields: dict[str, Any], var_dir: str | Path = defaults.VAR_DIR) -> None:
    """Publish a daemon's current state (atomic replace; never raises into the daemon's loop)."""
    directory = status_dir(var_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        payload = {"name": name, "pid": os.getpid(), "updated": time.time(), **fields}
        tmp = directory / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(payload, default=str, sort_keys=True))
        os.replace(tmp, directory / f"{name}.json")
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


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from infra import stack

    console = Console()
    console.print(stack.status_table(stack.load_stack_config([])))
    statuses = read_statuses()
    table = Table(title="processes")
    table.add_column("process")
    table.add_column("state")
    table.add_column("details", overflow="fold")
    for name, record in statuses.items():
        details = ", ".join(f"{k}={v}" for k, v in record.items() if k not in ("name", "updated", "stale", "pid"))
        age = time.time() - float(record.get("updated", 0))
        table.add_row(name, f"[red]stale ({age:.0f}s)[/red]" if record["stale"] else f"up (pid {record.get('pid')})", details)
    if not statuses:
        table.add_row("-", "no daemon has reported yet", "")
    console.print(table)
    try:  # serving section (versions, aliases, shares, online reward); optional until serving is installed
        from serving import promote

        promote.print_status(console)
    except (ImportError, AttributeError):
        pass
    return 0
