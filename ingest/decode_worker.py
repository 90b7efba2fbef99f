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

import ctypes
import logging
import os
import pickle
import queue
import signal
import threading
from typing import TYPE_CHECKING, Any

from flywheel.ingest.decode import DecodedBatch, decode_batch

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


class WorkerDied(RuntimeError):
    """The decode worker is gone (killed, crashed, or its pipe broke): the runs in flight are lost."""


class DecodeWorker:
    """The parent's handle: `send` runs, `receive` their results in the same order."""

    def __init__(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # never fork: the parent runs kafka-python's threads
        self._conn, child = ctx.Pipe(duplex=True)
        self.process: BaseProcess = ctx.Process(target=_serve, args=(child, os.getpid()), name="lake-writer-decode",
                                                daemon=True)
        self.process.start()
        child.close()  # the parent keeps only its end: the child's death then reads as EOF here
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
            self._conn.send_bytes(pickle.dumps((table, topic, partition, offsets, values), protocol=5))
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
            self.process.join(1.0)
            raise WorkerDied(f"decode worker pid {self.process.pid} exited (code {self.process.exitcode}): "
                             f"{type(got).__name__}")
        head, body = got
        self.in_flight -= 1
        good, dates, rejected = pickle.loads(head)
        if isinstance(good, BaseException):
            raise good  # MemoryError in the child: as if decoding had run here
        table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
        return DecodedBatch(table, good, dates, rejected)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the child (it exits at EOF) and reap it."""
        self._conn.close()  # also ends the reader thread (its recv fails)
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout_s)
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


def _serve(conn: "Connection", parent_pid: int) -> None:
    """The child's loop: a run in, its DecodedBatch out (a header of good, dates, rejected; then Arrow IPC)."""
    import pyarrow as pa

    _die_with(parent_pid)
    while True:
        try:
            table, topic, partition, offsets, values = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent closed its end or died
        try:
            out = decode_batch(table, topic, partition, offsets, values)
        except MemoryError as exc:
            conn.send_bytes(pickle.dumps((exc, None, None)))
            conn.send_bytes(b"")
            continue
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, out.table.schema) as stream:
            stream.write_table(out.table)
        conn.send_bytes(pickle.dumps((out.good, out.dates, out.rejected), protocol=5))
        conn.send_bytes(sink.getvalue())
