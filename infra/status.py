"""`flywheel status`: one view of the whole loop, built from the daemons' heartbeat files
(flywheel.base.heartbeat), the local stack and the serving registry.

It runs on a base install: rich (the `lake`, `serve` and `dev` extras) draws the tables when it is
there, and plain aligned text stands in when it is not; the serving section needs the `serve` extra.
"""

from __future__ import annotations

import time
from typing import Any

from flywheel.base.heartbeat import read_statuses


def process_rows(statuses: dict[str, dict[str, Any]], now: float) -> list[tuple[str, bool, str, str]]:
    """(process, stale?, state, details) per heartbeat; one placeholder row when none has reported."""
    rows = []
    for name, record in statuses.items():
        details = ", ".join(f"{k}={v}" for k, v in record.items() if k not in ("name", "updated", "stale", "pid"))
        age = now - float(record.get("updated", 0))
        state = f"stale ({age:.0f}s)" if record["stale"] else f"up (pid {record.get('pid')})"
        rows.append((name, bool(record["stale"]), state, details))
    return rows or [("-", False, "no daemon has reported yet", "")]


def plain_table(title: str, columns: list[str], rows: list[list[str]]) -> str:
    """A table as aligned text, for a terminal without rich."""
    widths = [max(len(str(c)) for c in column) for column in zip(columns, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([title, line(columns), line(["-" * w for w in widths]), *map(line, rows)])


def print_plain(stack_health: dict[str, tuple[bool, str]], addresses: dict[str, str],
                rows: list[tuple[str, bool, str, str]]) -> None:
    stack_rows = [[part, addresses[part], "healthy" if ok else "down", owner]
                  for part, (ok, owner) in stack_health.items()]
    print(plain_table("flywheel stack", ["part", "address", "health", "process"], stack_rows))
    print()
    print(plain_table("processes", ["process", "state", "details"], [[n, s, d] for n, _, s, d in rows]))


def print_rich(console: Any, stack_view: Any, rows: list[tuple[str, bool, str, str]]) -> None:
    from rich.table import Table

    console.print(stack_view)
    table = Table(title="processes")
    table.add_column("process")
    table.add_column("state")
    table.add_column("details", overflow="fold")
    for name, stale, state, details in rows:
        table.add_row(name, f"[red]{state}[/red]" if stale else state, details)
    console.print(table)
    try:  # serving section (versions, aliases, shares, online reward): needs the serve extra
        from flywheel.serving import promote

        promote.print_status(console)
    except (ImportError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    import argparse

    from flywheel import stack

    argparse.ArgumentParser(prog="flywheel status", description=(__doc__ or "").splitlines()[0]).parse_args(argv or [])
    cfg = stack.load_stack_config([])  # the stack's own settings: flags of `flywheel infra`, FLYWHEEL_INFRA_*
    rows = process_rows(read_statuses(), time.time())
    try:
        from rich.console import Console
    except ImportError:
        health = stack.health(cfg)
        print_plain(health, {part: cfg.address_of(part) for part in health}, rows)
        print("\n(install the serve extra for the serving section: versions, aliases, shares)")
        return 0
    print_rich(Console(), stack.status_table(cfg), rows)
    return 0
