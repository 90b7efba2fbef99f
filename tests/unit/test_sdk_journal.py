"""The SDK's write-ahead journal (ingest/journal.py): a record is on disk when the log call returns, a SIGKILLed
host's records are logged again by its successor with their event_ids, and segments go once Kafka confirmed them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from flywheel.ingest.journal import SUFFIX, Journal
from flywheel.ingest.sdk import SessionLogger
from flywheel.ingest.spool import Spool

CHILD = textwrap.dedent("""
    import os, signal, sys
    from flywheel.ingest.sdk import SessionLogger
    root = sys.argv[1]
    # nothing listens on port 1: every record is still in the SDK's memory queue when the host dies
    log = SessionLogger("127.0.0.1:1", topic="t", name="proxy", spool_dir=root + "/spool", journal_dir=root + "/journal",
                        outage_after_s=600.0)
    with log.session(task_type="t", session_id="s1") as s:
        for i in range(50):
            s.llm_call(model="m", policy_version=0, prompt_token_ids=[1, 2, i], completion_token_ids=[3, i],
                       completion_logprobs=[-0.5, -0.25])
    print("logged", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _journal_records(directory: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(directory.glob(f"*{SUFFIX}")) for line in path.read_bytes().splitlines()]


def test_a_sigkilled_hosts_calls_are_in_its_journal_and_its_successor_logs_them_again(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL and "logged" in out.stdout, out.stdout + out.stderr[-2000:]
    before = _journal_records(tmp_path / "journal")
    calls = [r for r in before if r["type"] == "llm_call"]
    assert len(calls) == 50 and len({r["event_id"] for r in calls}) == 50, len(calls)
    assert [r["completion_token_ids"] for r in calls] == [[3, i] for i in range(50)]

    successor = SessionLogger("127.0.0.1:1", topic="t", name="proxy", spool_dir=tmp_path / "spool2",
                              journal_dir=tmp_path / "journal", outage_after_s=600.0)
    try:
        assert successor.metrics()["enqueued"] == len(before), successor.metrics()
        again = _journal_records(tmp_path / "journal")
        assert [r["event_id"] for r in again] == [r["event_id"] for r in before], "replayed under other ids"
    finally:
        successor.close(timeout=0.1)
    # closed with the broker away: the records went to the spool (durable, replayed by the next start) ...
    spooled = Spool(tmp_path / "spool2")
    try:
        kept = len(spooled) + len(_journal_records(tmp_path / "journal"))
    finally:
        spooled.close()
    assert kept >= len(before), f"{kept} of {len(before)} undelivered records kept in the spool or the journal"


def test_segments_go_only_once_a_flush_confirmed_everything_before_them(tmp_path: Path) -> None:
    journal = Journal(tmp_path, "event_id", rotate_s=0.1)
    try:
        journal.append({"type": "llm_call", "i": 1})
        assert not journal.checkpoint(lambda _t: False), "an unconfirmed flush must keep the segment"
        assert len(_journal_records(tmp_path)) == 1
        journal.append({"type": "llm_call", "i": 2})
        assert journal.checkpoint(lambda _t: True)
        assert _journal_records(tmp_path) == [], "confirmed records stay in the journal"
        assert journal.metrics()["journal_appended"] == 2
    finally:
        journal.close()
    assert list(tmp_path.glob(f"*{SUFFIX}")) == [], "a clean close leaves no segment"


def test_a_second_process_on_the_same_journal_is_refused_and_the_host_still_logs(tmp_path: Path) -> None:
    first = Journal(tmp_path / "j", "event_id")
    try:
        log = SessionLogger("127.0.0.1:1", topic="t", name="second", spool_dir=tmp_path / "spool",
                            journal_dir=tmp_path / "j", outage_after_s=600.0)
        with log.session(task_type="t") as s:
            s.llm_call(model="m", policy_version=0, prompt_token_ids=[1], completion_token_ids=[2],
                       completion_logprobs=[-0.1])
        assert log.metrics()["enqueued"] == 3 and "journal_appended" not in log.metrics(), log.metrics()
        log.close(timeout=0.1)
    finally:
        first.close()


def test_a_torn_last_line_is_skipped_not_fatal(tmp_path: Path) -> None:
    (tmp_path / f"{1:012d}{SUFFIX}").write_bytes(b'{"event_id": "a", "type": "llm_call"}\n{"event_id": "b", "ty')
    journal = Journal(tmp_path, "event_id")
    try:
        assert [r["event_id"] for r in journal.leftovers()] == ["a"]
    finally:
        journal.close()
