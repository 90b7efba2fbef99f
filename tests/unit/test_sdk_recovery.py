"""How the SDK's pipeline recovers without a process restart, against stand-in producers.

kafka-python's idempotent producer may never resolve some sends after an outage longer than its
delivery timeout (design.md, measured against a real broker; the integration test
test_sdk_kafka.py repeats that outage for real). Here a fake KafkaProducer plays each case
exactly: sends that hang, sends acknowledged late, one send stuck while the rest flow. The
"broker" is a local socket that accepts connections, so the SDK's reachability probe succeeds.
Also here: the spool a restarted or killed process leaves behind, and orphaned spools.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from flywheel.ingest.sdk import OutcomeReporter, SessionLogger, _default_name
from flywheel.ingest.spool import Spool
from tests.unit.test_sdk import dead_address

REPO = Path(__file__).resolve().parents[2]


class _Future:
    """The part of kafka-python's FutureRecordMetadata the SDK uses."""

    def __init__(self) -> None:
        self.is_done = False
        self.exception: BaseException | None = None
        self._ok = False
        self._callbacks: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._errbacks: list[tuple[Callable[..., None], tuple[Any, ...]]] = []

    def add_callback(self, fn: Callable[..., None], *args: Any) -> "_Future":
        if self.is_done and self._ok:
            fn(*args, None)
        else:
            self._callbacks.append((fn, args))
        return self

    def add_errback(self, fn: Callable[..., None], *args: Any) -> "_Future":
        if self.is_done and not self._ok:
            fn(*args, self.exception)
        else:
            self._errbacks.append((fn, args))
        return self

    def succeeded(self) -> bool:
        return self.is_done and self._ok

    def failed(self) -> bool:
        return self.is_done and not self._ok

    def resolve(self, ok: bool, exception: BaseException | None = None) -> None:
        if self.is_done:
            return
        self.is_done, self._ok, self.exception = True, ok, exception
        for fn, args in self._callbacks if ok else self._errbacks:
            fn(*args, None if ok else exception)


class _Producer:
    """A KafkaProducer whose sends do what `behaviour(i)` says for the i-th send: "ack", "hang", or "later"
    (acknowledged ACK_DELAY_S later by an I/O thread, as a broker's round trip would be)."""

    ACK_DELAY_S = 0.02

    def __init__(self, behaviour: Callable[[int], str], **config: Any) -> None:
        self.behaviour = behaviour
        self.config = config
        self.sent: list[bytes] = []
        self.futures: list[_Future] = []
        self.closed_with: float | None = None
        self._later: list[tuple[float, _Future]] = []
        self._io: threading.Thread | None = None

    def send(self, topic: str, key: bytes | None = None, value: bytes | None = None) -> _Future:
        future = _Future()
        self.futures.append(future)
        self.sent.append(value or b"")
        what = self.behaviour(len(self.sent) - 1)
        if what == "ack":
            future.resolve(True)
        elif what == "later":
            self._later.append((time.monotonic() + self.ACK_DELAY_S, future))
            if self._io is None:
                self._io = threading.Thread(target=self._acknowledge, daemon=True)
                self._io.start()
        return future

    def _acknowledge(self) -> None:
        while self.closed_with is None:
            now = time.monotonic()
            due = [item for item in self._later[:1000] if item[0] <= now]
            del self._later[:len(due)]
            for _, future in due:
                future.resolve(True)
            time.sleep(0.005)

    def flush(self, timeout: float | None = None) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        # what kafka-python's force_close does: every unresolved send fails
        self.closed_with = timeout
        for future in self.futures:
            future.resolve(False, RuntimeError("Producer is closed forcefully."))


class _Fakes:
    def __init__(self) -> None:
        self.behaviours: list[Callable[[int], str]] = []
        self.producers: list[_Producer] = []

    def make(self, **config: Any) -> _Producer:
        n = len(self.producers)
        behaviour = self.behaviours[n] if n < len(self.behaviours) else (lambda i: "ack")
        producer = _Producer(behaviour, **config)
        self.producers.append(producer)
        return producer


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> _Fakes:
    import kafka

    fakes = _Fakes()
    monkeypatch.setattr(kafka, "KafkaProducer", fakes.make)
    return fakes


@pytest.fixture
def listening() -> Iterator[str]:
    """A bootstrap address that accepts TCP connections (and closes them): the broker 'is back'."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                conn.close()
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(2)
    server.close()


def _logger(bootstrap: str, spool_dir: Path | None, **kw: Any) -> SessionLogger:
    options = {"name": "rec", "linger_s": 0.01, "retry_s": 0.1, "outage_after_s": 0.2, "inflight_wait_s": 0.3, **kw}
    if spool_dir is not None:
        options["spool_dir"] = spool_dir
    return SessionLogger(bootstrap, **options)


def _indices(values: list[bytes]) -> list[int]:
    return [json.loads(v)["arguments"]["i"] for v in values]


def _spooled_names(directory: Path) -> list[str]:
    spool = Spool(directory)
    names = [json.loads(r)["name"] for r in spool.peek(100_000)]
    spool.close()
    return names


def _wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s}s"
        time.sleep(0.01)


def test_a_producer_whose_sends_never_resolve_is_replaced_and_its_records_resent(
        fakes: _Fakes, listening: str, tmp_path: Path) -> None:
    fakes.behaviours = [lambda i: "hang"]  # the first producer: kafka-python after a long outage
    log = _logger(listening, tmp_path / "spool")
    s = log.attach("sess-w")
    for i in range(100):
        s.tool_call("t", {"i": i})
    started = time.monotonic()
    delivered = log.flush(10)
    took = time.monotonic() - started
    m = log.metrics()
    log.close(timeout=2)
    assert delivered, f"flush did not finish after {took:.1f}s: {m}"
    first, second = fakes.producers[0], fakes.producers[1]
    assert len(first.sent) == 100 and first.closed_with == 0.0, "the wedged producer is closed without waiting"
    assert _indices(second.sent) == list(range(100)), "every record once, in order, from the spool"
    assert m["producer_restarts"] == 1 and m["replayed"] == 100 and m["dropped"] == 0, m
    # outage_after_s (0.2) + inflight_wait_s (0.3) + a retry or two: well under the 10 s the SDK promises
    assert took < 3.0, f"delivery resumed {took:.1f}s after the flush began; {m}"


def test_sends_acknowledged_late_keep_the_producer_and_are_not_sent_twice(fakes: _Fakes, listening: str,
                                                                         tmp_path: Path) -> None:
    fakes.behaviours = [lambda i: "hang"]
    log = _logger(listening, tmp_path / "spool", inflight_wait_s=5.0)
    s = log.attach("sess-late")
    for i in range(50):
        s.tool_call("t", {"i": i})
    # noticed after outage_after_s without an ack; the in-flight records are then copied to disk
    _wait_for(lambda: log.metrics()["broker_down"] and log.metrics()["spool_records"] == 50, 5,
              "the outage being noticed and the in-flight records copied to the spool")
    for future in list(fakes.producers[0].futures):  # the broker is back: the producer delivers them after all
        future.resolve(True)
    assert log.flush(10), log.metrics()
    m = log.metrics()
    log.close(timeout=2)
    assert len(fakes.producers) == 1 and len(fakes.producers[0].sent) == 50, "no second producer, no resend"
    assert m["producer_restarts"] == 0 and m["sent"] == 50 and m["replayed"] == 0 and m["spool_records"] == 0, m


def test_one_send_stuck_past_the_delivery_timeout_replaces_the_producer(fakes: _Fakes, listening: str,
                                                                       tmp_path: Path) -> None:
    fakes.behaviours = [lambda i: "hang" if i == 0 else "ack"]  # the rest flows, so no outage is noticed
    log = _logger(listening, tmp_path / "spool", outage_after_s=30.0, inflight_wait_s=0.2,
                  producer_config={"delivery_timeout_ms": 300})
    s = log.attach("sess-stuck")
    for i in range(20):
        s.tool_call("t", {"i": i})
    assert log.flush(10), log.metrics()
    m = log.metrics()
    log.close(timeout=2)
    first, second = fakes.producers[0], fakes.producers[1]
    assert _indices(first.sent) == list(range(20)) and _indices(second.sent) == [0], (
        f"the stuck record is re-sent by the new producer: {_indices(second.sent)}")
    assert m["producer_restarts"] == 1 and m["sent"] == 20 and m["send_errors"] == 0, m


def test_the_outage_ends_while_the_agent_keeps_logging(fakes: _Fakes, listening: str, tmp_path: Path) -> None:
    """Records logged during a replay queue behind the spool; once it is caught up they must go straight to
    Kafka again, or every event goes through the disk for as long as the agent logs."""
    fakes.behaviours = [lambda i: "hang", lambda i: "later"]
    log = _logger(listening, tmp_path / "spool")
    s = log.attach("sess-busy")
    i, started, recovered = 0, time.monotonic(), None
    while time.monotonic() - started < 4.0:
        s.tool_call("t", {"i": i})  # ~1,000 calls/s, all along
        i += 1
        time.sleep(0.001)
        m = log.metrics()
        if recovered is None and m["producer_restarts"] == 1 and not m["broker_down"] and not m["spool_records"]:
            recovered = time.monotonic() - started
    assert log.flush(10), log.metrics()
    m = log.metrics()
    log.close(timeout=2)
    assert recovered is not None and recovered < 2.5, f"still spilling after {time.monotonic() - started:.1f}s: {m}"
    assert _indices(fakes.producers[1].sent) == list(range(i)), "every record once, in the order logged"
    assert m["replayed"] < i / 2, f"{m['replayed']} of {i} records went through the spool: {m}"


def test_orphaned_spools_are_adopted_in_order_and_removed(tmp_path: Path) -> None:
    dead, spool_dir = dead_address(), tmp_path / "spool"
    first = _logger(dead, spool_dir)
    for name in ("a0", "a1"):
        first.attach("s").tool_call(name, {})
    _wait_for(lambda: first.metrics()["spilled"] == 2, 5, "the first logger spilling")
    second = _logger(dead, spool_dir)  # same name while the first holds the spool: it takes a sibling
    for name in ("b0", "b1", "b2"):
        second.attach("s").tool_call(name, {})
    second.close(timeout=2)
    first.close(timeout=2)
    orphan = tmp_path / f"spool-{os.getpid()}"
    assert _spooled_names(orphan) == ["b0", "b1", "b2"], "the second logger's records are in its sibling spool"
    third = _logger(dead, spool_dir)
    third.attach("s").tool_call("c0", {})
    third.close(timeout=2)
    assert _spooled_names(spool_dir) == ["a0", "a1", "b0", "b1", "b2", "c0"]
    assert not orphan.exists(), "an adopted spool is removed once its records are safe in ours"
    assert third.metrics()["adopted"] == 3, third.metrics()


KILLED = """
import sys, time
from flywheel import SessionLogger
log = SessionLogger(sys.argv[1], name="killed", linger_s=0.01, retry_s=0.1)
s = log.attach("sess-killed")
for i in range(50):
    s.tool_call("t", {"i": i})
while log.metrics()["spilled"] < 50:
    time.sleep(0.01)
print("spooled", flush=True)
time.sleep(60)
"""


def test_a_killed_agent_is_replayed_by_the_next_process_of_that_name(fakes: _Fakes, listening: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_SPOOL_DIR", str(tmp_path / "var" / "spool"))  # the default layout, in tmp_path
    proc = subprocess.Popen([sys.executable, "-c", KILLED, dead_address()], cwd=tmp_path, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "spooled", "the agent never spooled"
    finally:
        proc.send_signal(signal.SIGKILL)  # no close, no atexit: only what reached the spool survives
        proc.wait(10)
    spool_dir = tmp_path / "var" / "spool" / "killed@flywheel.events"
    assert spool_dir.is_dir(), f"default spool is per name and topic, without the pid: {list(tmp_path.rglob('*'))}"
    monkeypatch.chdir(tmp_path)
    log = SessionLogger(listening, name="killed", linger_s=0.01, retry_s=0.1)
    assert log.flush(10), log.metrics()
    log.close(timeout=2)
    assert _indices(fakes.producers[0].sent) == list(range(50)), "the predecessor's records, once, in order"
    assert not spool_dir.exists(), "a replayed spool leaves nothing behind"


def test_default_spool_is_stable_and_per_topic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_SPOOL_DIR", str(tmp_path / "var" / "spool"))
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    dead = dead_address()
    log = SessionLogger(dead, name="same", linger_s=0.01)
    reporter = OutcomeReporter(dead, name="same", linger_s=0.01)
    log.attach("s").tool_call("t", {})
    reporter.report("s", kind="accepted", value=1.0)
    log.close(timeout=2)
    reporter.close(timeout=2)
    root = tmp_path / "var" / "spool"
    assert sorted(p.name for p in root.iterdir()) == ["same@flywheel.events", "same@flywheel.outcomes"]
    assert _spooled_names(root / "same@flywheel.events") == ["t"]
    assert str(os.getpid()) not in _default_name() and SessionLogger(None).name == _default_name()


def _spill_then_close(spool_dir: Path, n: int, name: str = "rec") -> None:
    first = _logger(dead_address(), spool_dir, name=name)
    s = first.attach("s")
    for i in range(n):
        s.tool_call("t", {"i": i})
    _wait_for(lambda: first.metrics()["spilled"] == n, 5, f"{n} records spilling")
    first.close(timeout=2)


def test_an_io_error_does_not_end_the_background_thread(fakes: _Fakes, listening: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO or ENOSPC from the spool's fsync must not stop delivery for good: once the disk recovers it goes on."""
    import errno

    _spill_then_close(tmp_path / "spool", 5)
    failing = threading.Event()
    failing.set()
    real_sync = Spool.maybe_sync

    def maybe_sync(self: Spool) -> bool:
        if failing.is_set():
            raise OSError(errno.EIO, "Input/output error")
        return real_sync(self)

    monkeypatch.setattr(Spool, "maybe_sync", maybe_sync)
    log = _logger(listening, tmp_path / "spool")
    _wait_for(lambda: log.metrics()["io_errors"] >= 1, 5, "an I/O error in a cycle")
    s = log.attach("s")
    for i in range(5, 8):
        s.tool_call("t", {"i": i})
    time.sleep(0.3)
    failing.clear()  # the disk recovers
    delivered = log.flush(10)
    m = log.metrics()
    log.close(timeout=2)
    assert delivered, f"nothing delivered after the disk recovered: {m}"
    assert _indices(fakes.producers[0].sent) == list(range(8)), _indices(fakes.producers[0].sent)


def test_a_send_failing_during_close_is_spooled(fakes: _Fakes, listening: str, tmp_path: Path) -> None:
    """An errback between close()'s last respool and its copy of in-flight records must not lose the record."""
    fakes.behaviours = [lambda i: "hang"]
    log = _logger(listening, tmp_path / "spool", outage_after_s=30.0)
    s = log.attach("s")
    for i in range(10):
        s.tool_call("t", {"i": i})
    _wait_for(lambda: len(fakes.producers) == 1 and len(fakes.producers[0].sent) == 10, 5, "10 sends in flight")
    pipe = log._pipe
    assert pipe is not None
    real_copy = pipe._copy_inflight_to_spool

    def copy_after_an_errback() -> None:
        if pipe._stopping and not fakes.producers[0].futures[0].is_done:
            fakes.producers[0].futures[0].resolve(False, RuntimeError("broker went away"))  # lands in _failed
        real_copy()

    pipe._copy_inflight_to_spool = copy_after_an_errback  # type: ignore[method-assign]
    log.close(timeout=0.5)
    spooled = sorted(json.loads(r)["arguments"]["i"] for r in _spool_records(tmp_path / "spool"))
    assert spooled == list(range(10)), f"spooled {spooled} of 10 unacknowledged records"


def _spool_records(directory: Path) -> list[bytes]:
    spool = Spool(directory)
    records = spool.peek(100_000)
    spool.close()
    return records


def test_flush_and_metrics_never_raise_while_the_spool_closes(tmp_path: Path) -> None:
    log = _logger(dead_address(), tmp_path / "spool")
    log.attach("s").tool_call("t", {})
    log.close(timeout=2)
    pipe = log._pipe
    assert pipe is not None
    spool = Spool(tmp_path / "other")
    spool.append([b'{"name":"t"}'])  # spooled and not delivered: flush() must answer False, not raise
    reads = iter([spool])

    class Closing(type(pipe)):  # type: ignore[misc]
        @property
        def _spool(self) -> Spool | None:  # the spool on the first read, None (closed by _finish) after
            return next(reads, None)

        @_spool.setter
        def _spool(self, value: Spool | None) -> None:
            pass

    pipe.__class__ = Closing
    try:
        assert log.flush(0.05) is False
        reads = iter([spool])
        assert log.metrics()["spool_records"] == 1
    finally:
        pipe.__class__ = Closing.__mro__[1]
        spool.close()


FORKING = """
import os, sys, time
from flywheel import SessionLogger
log = SessionLogger(sys.argv[1], name="forks", spool_dir=sys.argv[2], linger_s=0.01, retry_s=0.1)
log.attach("s").tool_call("t", {})
while log.metrics()["spilled"] < 1:
    time.sleep(0.01)
child = os.fork()
if child == 0:
    # os.fork() returns here only after the at-fork hooks ran: the child has let go of its copy of the lock by now.
    # One write each (print may split a line in two, and the parent's line then lands in the middle)
    os.write(1, b"child ready\\n")
    time.sleep(30)
    os._exit(0)
os.write(1, f"child {child}\\n".encode())
time.sleep(60)
"""


def test_a_forked_child_does_not_keep_the_parents_spool_locked(tmp_path: Path) -> None:
    from flywheel.ingest.spool import SpoolLocked

    spool_dir = tmp_path / "spool"
    proc = subprocess.Popen([sys.executable, "-c", FORKING, dead_address(), str(spool_dir)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    child = 0
    try:
        assert proc.stdout is not None
        # Both lines, in either order: the parent's (the child's pid) and the child's (its at-fork hook ran). Without
        # the second, a busy machine could kill the parent before the child was first scheduled (CI stop 44).
        ready = False
        while not (child and ready):
            line = proc.stdout.readline().split()
            assert line, "the forking script ended early"
            if line[0] == "child" and line[1].isdigit():
                child = int(line[1])
            ready = ready or line == ["child", "ready"]
        proc.send_signal(signal.SIGKILL)  # the parent dies; its forked child lives on
        proc.wait(10)
        try:
            Spool(spool_dir).close()
        except SpoolLocked:
            pytest.fail("the SIGKILLed parent's spool is still locked by its forked child")
    finally:
        if proc.poll() is None:
            proc.kill()
        if child:
            os.kill(child, signal.SIGKILL)


def test_a_long_replay_parks_the_hosts_queue_in_the_spool(fakes: _Fakes, listening: str, tmp_path: Path) -> None:
    """While a replay waits for acks, a short queue must not stay only in memory (lost to a SIGKILL) for the
    whole replay: once its oldest record waited ~100 ms it is parked behind the spool."""
    _spill_then_close(tmp_path / "spool", 10)
    released = threading.Event()
    fakes.behaviours = [lambda i: "ack" if released.is_set() else "hang"]
    log = _logger(listening, tmp_path / "spool")
    _wait_for(lambda: len(fakes.producers) == 1 and len(fakes.producers[0].sent) == 10, 5, "the replay's sends")
    s = log.attach("s")
    for i in range(10, 15):
        s.tool_call("t", {"i": i})
    started = time.monotonic()
    _wait_for(lambda: log.metrics()["queue_depth"] == 0 and log.metrics()["spool_records"] == 15, 2,
              "5 queued records parked in the spool during the replay")
    parked_after = time.monotonic() - started
    released.set()
    for future in list(fakes.producers[0].futures):
        future.resolve(True)
    assert log.flush(10), log.metrics()
    log.close(timeout=2)
    sent = [i for p in fakes.producers for i in _indices(p.sent)]
    assert sent == list(range(15)), f"order after parking: {sent}"
    assert parked_after < 1.0, f"parked after {parked_after:.2f}s"


def test_adoption_refuses_another_loggers_or_topics_spool(tmp_path: Path) -> None:
    dead = dead_address()
    for suffix, owner in (("1", {"name": "other", "topic": "flywheel.events"}),
                          ("2", {"name": "rec", "topic": "flywheel.outcomes"}), ("3", None)):
        sibling = Spool(tmp_path / f"spool-{suffix}", owner=owner)
        sibling.append([b'{"name":"theirs"}'])
        sibling.close()
    log = _logger(dead, tmp_path / "spool")
    log.attach("s").tool_call("mine", {})
    log.close(timeout=2)
    assert log.metrics()["adopted"] == 0, log.metrics()
    for suffix in "123":
        assert _spooled_names(tmp_path / f"spool-{suffix}") == ["theirs"], f"spool-{suffix} was touched"
    assert _spooled_names(tmp_path / "spool") == ["mine"]


def test_an_unmarked_sibling_is_adopted_only_under_the_default_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("FLYWHEEL_SPOOL_DIR", str(tmp_path / "var" / "spool"))
    root = tmp_path / "var" / "spool"
    for directory in (root / "rec@flywheel.events-999", root / "rec"):  # an older version's sibling; the old path
        old = Spool(directory)
        old.append([b'{"name":"old"}'])
        old.close()
    with caplog.at_level("INFO", logger="flywheel.ingest.sdk"):
        log = SessionLogger(dead_address(), name="rec", linger_s=0.01, retry_s=0.1)
        log.attach("s").tool_call("new", {})
        log.close(timeout=2)
    assert log.metrics()["adopted"] == 1, log.metrics()
    assert _spooled_names(root / "rec@flywheel.events") == ["old", "new"]
    assert _spooled_names(root / "rec") == ["old"], "the old-path spool is left alone"
    assert any("older SDK version" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
