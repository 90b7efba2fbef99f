"""`flywheel status`: one view of the whole loop, built from the daemons' heartbeat files
(flywheel.base.heartbeat), the local stack and the serving registry."""

from __future__ import annotations

import time

from flywheel.base.heartbeat import read_statuses


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from flywheel import stack

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
        from flywheel.serving import promote

        promote.print_status(console)
    except (ImportError, AttributeError):
        pass
    return 0
