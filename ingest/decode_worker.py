"""The lake writer's decode worker: a child process that runs `decode.decode_batch` on the runs of records the
writer polls, so decoding, validation and the Arrow conversion do not hold the consuming process's GIL.

kafka-python fetches on an I/O thread of the consuming process, which waits for the GIL while that process
decodes (docs/lake.md, "Ingest throughput"); in a child process the two run side by side, on two cores.

The child owns nothing: it turns (table, topic, partition, offsets, values) into a DecodedBatch, in the order the
runs were sent, and keeps no state between them. So its death loses only the runs in flight, which the writer
reads again from the lake's next offsets, as after a restart (`lake_writer._Decoder`). It dies with its parent:
the kernel kills it when the parent dies (PR_SET_PDEATHSIG), and it exits when the parent's end of the pipe
closes. It ignores SIGINT and SIGTERM, which are the parent's to handle (the parent then drains and stops it).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

from flywheel.ingest.decode import DecodedBatch, decode_batch, warm_up

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


class WorkerDied(RuntimeError):
    """The decode worker is gone (killed, crashed, or its pipe broke): the runs in flight are lost."""


class DecodeWorker:
    """The parent's handle: `send` runs, `receive` their results in the same order."""

    def __init__(self) -> None:
        from multiprocessing.connection import Connection

        # a fresh interpreter on this module (never fork: the parent runs kafka-python's threads; and not
        # multiprocessing's spawn, which re-imports the parent's __main__), talking over two pipes
        child_in, to_child = os.pipe()
        from_child, child_out = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flywheel.ingest.decode_worker", str(child_in), str(child_out), str(os.getpid())],
            pass_fds=(child_in, child_out), stdin=subprocess.DEVNULL)
        os.close(child_in)  # the parent keeps only its ends: the child's death then reads as EOF here
        os.close(child_out)
        self._to_child = Connection(to_child, readable=False)
        self._conn = Connection(from_child, writable=False)
        self.in_flight = 0
        # results are read by a thread as soon as they come: a send may block on a full pipe while the child
        # blocks on sending a result, which nobody would read otherwise
        self._results: queue.SimpleQueue[tuple[bytes, bytes] | BaseException] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="lake-writer-decode-results", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                head = self._conn.recv_bytes()
                body = self._conn.recv_bytes()
            except (EOFError, OSError) as exc:
                self._results.put(exc)
                return
            self._results.put((head, body))

    def send(self, table: str, topic: str, partition: int, offsets: list[int], values: list[Any]) -> None:
        try:
            self._to_child.send_bytes(pickle.dumps((table, topic, partition, offsets, values), protocol=5))
        except (OSError, ValueError) as exc:
            raise WorkerDied(f"decode worker pid {self.process.pid}: send failed ({exc})") from None
        self.in_flight += 1

    def ready(self) -> bool:
        """Whether the oldest run's result can be received without waiting."""
        return self.in_flight > 0 and not self._results.empty()

    def receive(self) -> DecodedBatch:
        """The oldest run's result (waits for it)."""
        import pyarrow as pa

        assert self.in_flight > 0, "receive() with no run in flight"
        got = self._results.get()
        if isinstance(got, BaseException):
            self._results.put(got)  # every later receive() says so too
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(1.0)
            raise WorkerDied(f"decode worker pid {self.process.pid} exited (code {self.process.returncode}): "
                             f"{type(got).__name__}")
        head, body = got
        self.in_flight -= 1
        good, dates, rejected = pickle.loads(head)
        if isinstance(good, BaseException):
            raise good  # MemoryError in the child: as if decoding had run here
        table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
        return DecodedBatch(table, good, dates, rejected)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the child (it exits at the EOF of its input) and reap it."""
        self._to_child.close()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout_s)
        self._conn.close()  # the reader thread's recv then fails, and it ends
        self._reader.join(timeout_s)


def _die_with(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux), and make sure the parent is still the one
    that started it (it may have died before the request was made)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the EOF of the pipe still ends the loop
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def _serve(source: "Connection", sink: "Connection", parent_pid: int) -> None:
    """The child's loop: a run in, its DecodedBatch out (a header of good, dates, rejected; then Arrow IPC)."""
    import pyarrow as pa

    _die_with(parent_pid)
    warm_up()
    while True:
        try:
            table, topic, partition, offsets, values = pickle.loads(source.recv_bytes())
        except (EOFError, OSError):
            return  # the parent closed its end or died
        try:
            out = decode_batch(table, topic, partition, offsets, values)
        except MemoryError as exc:
            sink.send_bytes(pickle.dumps((exc, None, None)))
            sink.send_bytes(b"")
            continue
        stream = pa.BufferOutputStream()
        with pa.ipc.new_stream(stream, out.table.schema) as writer:
            writer.write_table(out.table)
        sink.send_bytes(pickle.dumps((out.good, out.dates, out.rejected), protocol=5))
        sink.send_bytes(stream.getvalue())


def main(argv: list[str] | None = None) -> int:
    """`python -m flywheel.ingest.decode_worker <read fd> <write fd> <parent pid>`: started by DecodeWorker only."""
    from multiprocessing.connection import Connection

    source_fd, sink_fd, parent_pid = (int(a) for a in (argv or sys.argv[1:]))
    try:
        _serve(Connection(source_fd, writable=False), Connection(sink_fd, readable=False), parent_pid)
    except BrokenPipeError:  # the parent is gone
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
