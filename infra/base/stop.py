"""The stop signal, one mechanism for every daemon: SIGTERM and SIGINT set an Event.

A daemon's loop checks `stop.is_set()` (or waits on it) between units of work, finishes the one in
hand (publishes open files, checkpoints), and returns 0. Handlers can only be installed from the
main thread; a daemon started from another thread (a test, the benchmarks) gets the Event only,
and its caller sets it.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)


def stop_on_signals(what: str, stop: threading.Event | None = None,
                    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> threading.Event:
    """Return an Event that the given signals set; `what` says what the process does on stopping."""
    stop = stop if stop is not None else threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return stop

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("stop: signal %s; %s", signal.Signals(signum).name, what)
        stop.set()

    for sig in signals:
        signal.signal(sig, on_signal)
    return stop
