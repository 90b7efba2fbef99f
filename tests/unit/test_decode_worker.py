"""The lake writer's decode worker: results in order, equal to decoding in the process; a crash loses nothing;
it dies with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flywheel.ingest import lake
from flywheel.ingest.decode import decode_batch
from flywheel.ingest.decode_worker import DecodeWorker
from flywheel.ingest.lake_writer import _Decoder, _loop, _Rebalance
from tests.unit.test_lake_writer_logic import TOPIC, FakeConsumer, assert_exact, event, make_writer, messages, tp, wire

ROOT = Path(__file__).resolve().parents[2]


def test_runs_come_back_in_order_and_as_decoded_here() -> None:
    worker = DecodeWorker()
    try:
        runs = [[wire(event(i)) for i in range(k, k + 40)] + [b"not json"] for k in range(0, 200, 40)]
        for k, values in enumerate(runs):  # all sent before any is read: a full pipe must not deadlock
            worker.send("events", TOPIC, k, list(range(len(values))), values)
        for k, values in enumerate(runs):
            got, want = worker.receive(), decode_batch("events", TOPIC, k, list(range(len(values))), values)
            assert (got.good, got.dates, got.rejected) == (want.good, want.dates, want.rejected), k
            assert got.table.drop(["_ingest_ts"]).equals(want.table.drop(["_ingest_ts"])), k
    finally:
        worker.close()
    assert worker.process.poll() is not None, "close() leaves no child behind"


def test_a_killed_worker_is_replaced_and_its_partitions_resume_from_the_lake(tmp_path: Path) -> None:
    polls = [{tp(0): messages(range(0, 4))}, {tp(0): messages(range(4, 8))}, {tp(0): messages(range(8, 12))}]
    consumer = FakeConsumer(polls, ends={(TOPIC, 0): 12})
    w = make_writer(tmp_path, roll_max_records=4, status_interval_s=3600.0)
    rebalance = _Rebalance(w, consumer)
    rebalance.on_partitions_assigned({tp(0)})
    decoder = _Decoder(w, rebalance, DecodeWorker, depth=8)
    first = decoder.worker
    count = iter(range(10))

    def stopped() -> bool:
        step = next(count)
        if step == 2:  # two runs sent and not yet taken: the child dies with them
            os.kill(first.process.pid, signal.SIGKILL)
            first.process.wait(5)
        if step == 4:  # the restart sought partition 0 back to the lake's next offset: deliver from there
            start = consumer.seeks[(TOPIC, 0)] or 0
            consumer.batches = [{tp(0): messages(range(start, 12))}]
        return step >= 6

    try:
        decoder.depth = 8
        decoder.worker.ready = lambda: False  # type: ignore[method-assign]  # hold the results: they die in flight
        _loop(w.cfg, consumer, w, rebalance, "lake-writer-test", stopped, decoder)
    finally:
        decoder.close()
    assert decoder.restarts == 1 and decoder.worker is not first, decoder.restarts
    assert_exact(tmp_path, range(0, 12))
    assert [f.last for f in lake.list_files(str(tmp_path), "events")][-1] == 11


def test_the_worker_dies_with_its_parent(tmp_path: Path) -> None:
    script = ("import sys, time; sys.path.insert(0, %r)\n"
              "from flywheel.ingest.decode_worker import DecodeWorker\n"
              "if __name__ == '__main__':\n"
              "    w = DecodeWorker(); print(w.process.pid, flush=True); time.sleep(60)\n") % str(ROOT)
    (tmp_path / "parent.py").write_text(script)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py")], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())  # type: ignore[union-attr]
    time.sleep(2.0)  # let the child get past its start-up (it asks the kernel for its parent's death signal)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), f"decode worker {child} outlived its SIGKILLed parent"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_worker_dying_at_the_first_send_of_a_poll_loses_no_partition_of_that_poll(tmp_path: Path) -> None:
    """The child dies while partitions 0 and 1 hold open files, and the next poll covers both: the restart seeks
    both back to the lake, and the rest of that poll must not seek partition 1 forward to its polled offset."""
    from flywheel.ingest.lake_writer import _take

    consumer = FakeConsumer([], ends={(TOPIC, 0): 8, (TOPIC, 1): 8})
    w = make_writer(tmp_path, roll_max_records=100, status_interval_s=3600.0)
    rebalance = _Rebalance(w, consumer)
    rebalance.on_partitions_assigned({tp(0), tp(1)})
    decoder = _Decoder(w, rebalance, DecodeWorker, depth=8)
    try:
        for part in (0, 1):
            w.unchecked.discard((TOPIC, part))  # the log check passed
        _take(consumer, w, {tp(0): messages(range(0, 4)), tp(1): messages(range(0, 4))}, decoder)
        decoder.collect(wait=True)
        assert not lake.list_files(str(tmp_path), "events"), "nothing published yet: both files are open"
        os.kill(decoder.worker.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
        decoder.worker.process.wait(5)  # type: ignore[union-attr]
        consumer.seeks.clear()
        _take(consumer, w, {tp(0): messages(range(4, 8)), tp(1): messages(range(4, 8))}, decoder)
    finally:
        decoder.close()
    assert decoder.restarts == 1
    # both partitions were sought back to the lake's start (nothing landed), none forward to offset 4
    assert consumer.seeks == {(TOPIC, 0): None, (TOPIC, 1): None}, consumer.seeks
