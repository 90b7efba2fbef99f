"""Prometheus metrics of one process: its own registry, the naming rule, and the scrape endpoint.

Every daemon builds one `Metrics(process)` in `run()`; the proxy serves `exposition()` on its own
GET /metrics, the other daemons call `serve(cfg.metrics_port)` (0: off). Names follow

    flywheel_<process>_<what>_<unit>          e.g. flywheel_lake_writer_consumed_records_total

where unit is a base unit (seconds, bytes) or the thing counted (records, sessions, steps); counters
also end in `_total` (prometheus_client adds it). Each process has its own CollectorRegistry, never
the library's global one, so tests and the demo's several daemons in one Python do not collide.

Two kinds of values:
- what a process already counts for its heartbeat (its Stats, counter dicts, queue sizes) is read at
  scrape time through `read(fn)`: the exposition and `flywheel status` show the same numbers and no
  increment site is written twice;
- what exists only as events (a request's latency, a row's policy lag, a gate decision) is a histogram,
  gauge or counter made with `histogram()` / `gauge()` / `counter()` and updated where it happens.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

# generate_latest writes the classic text format; prometheus_client >= 0.22 labels its own output 1.0.0,
# which scrapers older than Prometheus 3 do not negotiate, so the proxy states the version it writes.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_PART = re.compile(r"[a-z][a-z0-9_]*")


def metric_name(process: str, what: str, unit: str) -> str:
    """`flywheel_<process>_<what>_<unit>`; each part lower snake case (a typo fails at start-up, not in a dashboard)."""
    for part, value in (("process", process), ("what", what), ("unit", unit)):
        assert _PART.fullmatch(value), f"metric name {part} {value!r} is not lower snake case"
    assert not unit.endswith("total"), f"unit {unit!r}: counters get _total from prometheus_client"
    return f"flywheel_{process}_{what}_{unit}"


@dataclass(frozen=True)
class Reading:
    """One value a process already keeps, read at scrape time.

    value: a number, or label value -> number for one sample per label value (`label` names the label).
    A gauge may be NaN (unknown now, e.g. a lag the broker did not answer for).
    """

    kind: str  # "counter" (monotonic in a process's life) | "gauge"
    what: str
    unit: str
    help: str
    value: float | Mapping[str, float]
    label: str = ""


class _Readings:
    """A collector over a function returning Readings (prometheus_client's custom-collector protocol)."""

    def __init__(self, process: str, fn: Callable[[], Iterable[Reading]]) -> None:
        self.process = process
        self.fn = fn

    def collect(self) -> Iterator[Metric]:
        for r in self.fn():
            assert r.kind in ("counter", "gauge"), f"reading {r.what}: kind {r.kind!r}"
            family = CounterMetricFamily if r.kind == "counter" else GaugeMetricFamily
            name = metric_name(self.process, r.what, r.unit)
            if isinstance(r.value, Mapping):
                assert r.label, f"reading {name}: a mapping value needs a label name"
                metric = family(name, r.help, labels=[r.label])
                for key, v in sorted(r.value.items()):
                    metric.add_metric([str(key)], float(v))
            else:
                metric = family(name, r.help, value=float(r.value))
            yield metric


class Metrics:
    """One process's registry: definitions by the naming rule, scrape-time readings, exposition, endpoint."""

    def __init__(self, process: str) -> None:
        assert _PART.fullmatch(process), f"process {process!r} is not lower snake case"
        self.process = process
        self.registry = CollectorRegistry()
        self._server: Any = None

    def name(self, what: str, unit: str) -> str:
        return metric_name(self.process, what, unit)

    def histogram(self, what: str, unit: str, help: str, buckets: Sequence[float],
                  labels: Sequence[str] = ()) -> Histogram:
        return Histogram(self.name(what, unit), help, list(labels), buckets=list(buckets), registry=self.registry)

    def gauge(self, what: str, unit: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self.name(what, unit), help, list(labels), registry=self.registry)

    def counter(self, what: str, unit: str, help: str, labels: Sequence[str] = ()) -> Counter:
        """For events no heartbeat counts already (otherwise `read` them); exposed as <name>_total."""
        return Counter(self.name(what, unit), help, list(labels), registry=self.registry)

    def read(self, fn: Callable[[], Iterable[Reading]]) -> None:
        """Export what `fn` returns at every scrape (it runs on the scrape thread: read, never mutate)."""
        self.registry.register(_Readings(self.process, fn))

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (served with CONTENT_TYPE)."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "0.0.0.0") -> bool:
        """Start the scrape endpoint http://host:port/metrics in a daemon thread when port > 0; True if started.

        A port in use raises OSError: a daemon asked for metrics fails at start-up, not silently unscraped.
        """
        if port <= 0:
            log.info("metrics: Prometheus endpoint off (metrics_port 0)")
            return False
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics: Prometheus endpoint on http://%s:%d/metrics", host, port)
        return True

    def close(self) -> None:
        """Stop the endpoint (run() in a thread of a longer-lived process, e.g. tests and the demo, frees its port)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def nan_if_negative(value: float) -> float:
    """Heartbeats write -1 for "unknown"; a gauge says NaN, so a dashboard shows a gap instead of a dip."""
    return math.nan if value < 0 else float(value)
