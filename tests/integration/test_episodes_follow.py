"""`flywheel episodes --follow`: picks up lake files as they land, heartbeats, and exits 0 on SIGTERM."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from bench.fixtures import sessions as synthetic
from flywheel.ingest import lake

REPO = Path(__file__).resolve().parents[2]


def wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_follow_picks_up_new_files_and_stops_on_sigterm(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    var = tmp_path / "var"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flywheel.cli", "episodes", "--follow", "--poll-interval-s", "0.2", "--lake-root", str(root),
         "--state-dir", str(tmp_path / "state"), "--var-dir", str(var)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        feed = synthetic.LakeFeeder(str(root))
        start = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)
        rows = lambda: sum(f.rows_range for f in lake.list_files(str(root), "episodes"))  # noqa: E731
        expected = 0
        for batch in range(2):  # two arrivals while the builder runs
            events, outcomes = synthetic.generate(5, start + dt.timedelta(minutes=batch), seed=batch, task_type="code_edit",
                                                  outcome_kind="tests_passed")
            feed.write("events", events)
            feed.write("outcomes", outcomes)
            expected += sum(e["type"] == "llm_call" for e in events)
            assert wait_for(lambda: rows() == expected, 30), f"{rows()} episode rows, expected {expected}"
        # the heartbeat is written after the pass that published the rows returns: give it that moment
        status_path = var / "run" / "status" / "episodes.json"
        wait_for(lambda: status_path.exists() and json.loads(status_path.read_text()).get("rows_total") == expected, 10)
        status = json.loads(status_path.read_text())
        assert status["rows_total"] == expected and status["sessions_emitted"] == 10, status
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    assert "stopped after" in output, output[-2000:]
