"""Lab pytest plugin: each test's start and end (epoch seconds) into the file $TLOG, for suite_cpu.py's report.

    TLOG=/tmp/tests.tlog PYTHONPATH=docs/lab .venv/bin/python -m pytest -p suite_tlog ...
"""

from __future__ import annotations

import os
import time
from typing import IO

_out: IO[str] | None = None


def _write(what: str, nodeid: str) -> None:
    global _out
    if _out is None:
        _out = open(os.environ["TLOG"], "a")
    _out.write(f"{time.time():.1f} {what} {nodeid}\n")
    _out.flush()


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _write("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    _write("end", nodeid)
