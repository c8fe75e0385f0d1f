"""Prometheus metrics, on a registry of the app's own (tests build theirs).

Histograms, so figures aggregate across replicas. Labels are small, closed sets: route
templates, status codes, error codes, lanes, model names. Queue depths and device memory
are read when Prometheus scrapes, so the request path pays nothing for them.

One process serves one device; several uvicorn workers are not supported (the CLI runs
one), so the default single-process registry is exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from app.batching import Lane
from app.settings import MAX_BATCH

log = logging.getLogger(__name__)
T = TypeVar("T")

PREFIX = "ai_backend"
# up to the longest deadline a request may ask for (server.max_timeout_ms, 120 s by default); from
# 5 ms to 1 s, where windows, batches and deadlines fall, each bound at most 1.5 times the one
# before, so a quantile read off them (histogram_quantile) is within that of the truth: with
# 25 ms then 50 ms, every normal request's queue wait (just over the 25 ms window) read 37-50 ms
LATENCY_BUCKETS = (
    *(0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075),
    *(0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)
# the event loop's lag: a millisecond (uvloop's timer resolution) to the seconds of a stalled loop
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = tuple(2**i for i in range(MAX_BATCH.bit_length()))  # 1, 2, 4, ... the largest max_batch
FILL_BUCKETS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
REJECTION_REASONS = ("queue_full", "would_miss_deadline", "deadline_exceeded")
CANCELLATION_REASONS = ("cancelled", "deadline", "late")
DEVICE_FAULTS = ("out_of_memory", "device_error")


def batch_bucket(size: int) -> str:
    """A bounded label for a batch size: 1, 2, 3-4, 5-8, ... up to the largest max_batch (4096)."""
    if size <= 2:
        return str(size)
    upper = 4
    while upper < size and upper < MAX_BATCH:
        upper *= 2
    return f"{upper // 2 + 1}-{upper}" if size <= upper else f"{upper + 1}+"


class _ScrapeTimeGauges(Collector):
    """Gauges computed when scraped: queue depths and bounds, batch ceilings, and device memory on CUDA."""

    def __init__(self) -> None:
        self.queue_depths: Callable[[], Iterable[tuple[str, str, str, int]]] = lambda: ()
        self.queue_capacities: Callable[[], Iterable[tuple[str, str, str, int]]] = lambda: ()
        self.batch_ceilings: Callable[[], Iterable[tuple[str, str, int]]] = lambda: ()
        self.device_memory: Callable[[], Iterable[tuple[str, int]]] = lambda: ()
        self.device_memory_total: Callable[[], Iterable[int]] = lambda: ()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        depth = GaugeMetricFamily(
            f"{PREFIX}_queue_depth",
            "Requests holding a seat in a lane (what max_queue bounds): queued, or their image being decoded "
            "(a seat is taken once the body is whole)",
            labels=["model", "version", "lane"],
        )
        for model, version, lane, value in self.queue_depths():
            depth.add_metric([model, version, lane], value)
        yield depth
        # the bound changes at run time (admin API, config reload): alerts divide by this
        capacity = GaugeMetricFamily(
            f"{PREFIX}_queue_capacity", "Requests a lane may hold (its max_queue)", labels=["model", "version", "lane"]
        )
        for model, version, lane, value in self.queue_capacities():
            capacity.add_metric([model, version, lane], value)
        yield capacity
        ceiling = GaugeMetricFamily(
            f"{PREFIX}_batch_ceiling",
            "The cap on a version's batch sizes since its device ran out of memory; 0: none (the policy's own)",
            labels=["model", "version"],
        )
        for model, version, value in self.batch_ceilings():
            ceiling.add_metric([model, version], value)
        yield ceiling
        memory = GaugeMetricFamily(f"{PREFIX}_device_memory_bytes", "CUDA memory held by the process", labels=["kind"])
        for kind, value in _read_device(self.device_memory):
            memory.add_metric([kind], value)
        yield memory
        total = GaugeMetricFamily(f"{PREFIX}_device_memory_total_bytes", "The CUDA device's total memory")
        for value in _read_device(self.device_memory_total):
            total.add_metric([], value)
        yield total


def _read_device(read: Callable[[], Iterable[T]]) -> list[T]:
    """A device reading for a scrape; none when the device cannot say (its context lost): the
    rest of the scrape, which says what went wrong, must still come back."""
    try:
        return list(read())
    except RuntimeError as exc:
        log.warning("could not read device memory for /metrics: %s", str(exc).splitlines()[0] if str(exc) else exc)
        return []


class Metrics:
    """Every metric the service exports, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.request_latency = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "HTTP request latency",
            ["route", "status", "lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP requests by the status answered (499: the client went first; 0: cut off with none sent)",
            ["status", "code"],
            registry=r,
        )
        self.in_flight = Gauge(f"{PREFIX}_in_flight_requests", "HTTP requests being served", registry=r)
        self.queue_wait = Histogram(
            f"{PREFIX}_queue_wait_seconds",
            "Time from submit to dispatch",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            f"{PREFIX}_batch_size", "Requests per batch", ["lane"], buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_fill = Histogram(
            f"{PREFIX}_batch_fill_ratio",
            "Batch size over the lane's max batch",
            ["lane"],
            buckets=FILL_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            f"{PREFIX}_inference_seconds",
            "Time to run one batch on its device thread (its images' decode included where the batch decodes them)",
            ["model", "version", "batch_size"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_failures = Counter(
            f"{PREFIX}_batch_failures", "Batches that failed", ["model", "version"], registry=r
        )
        self.device_faults = Counter(
            f"{PREFIX}_device_faults",
            "Forward passes the device failed: out_of_memory (the batch is split and retried) or device_error",
            ["model", "version", "fault"],
            registry=r,
        )
        self.rejections = Counter(f"{PREFIX}_rejections", "Requests refused at admission", ["reason"], registry=r)
        self.cancellations = Counter(
            f"{PREFIX}_cancellations",
            "Requests admitted and answered no result: dropped uncomputed (cancelled, deadline), "
            "or computed past their deadline (late)",
            ["reason"],
            registry=r,
        )
        # every reason from the start, at 0: rate() and increase() see the first refusal after a
        # start, which a series born with it hides, and a panel reads 0 rather than no data
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)
        for reason in CANCELLATION_REASONS:
            self.cancellations.labels(reason)
        self.dropped_spans = Counter(
            f"{PREFIX}_dropped_spans",
            "Spans lost: dropped by the full export queue, or in an export that failed",
            registry=r,
        )
        self.loop_lag = Histogram(
            f"{PREFIX}_event_loop_lag_seconds",
            "How much later than due the event loop ran a timer (sampled every telemetry.loop_lag_interval_ms)",
            buckets=LOOP_LAG_BUCKETS,
            registry=r,
        )
        self.model_load = Gauge(
            f"{PREFIX}_model_load_seconds", "Time to load, check and warm a model", ["model", "version"], registry=r
        )
        self.model_info = Gauge(
            f"{PREFIX}_model_info", "Models served (value 1)", ["model", "version", "device", "dtype"], registry=r
        )
        self.scrape_time = _ScrapeTimeGauges()
        r.register(self.scrape_time)

    def observer(self, model: str, version: str) -> BatchMetrics:
        return BatchMetrics(self, model, version)

    def version_series(
        self, model: str, version: str, buckets: Iterable[str] = ()
    ) -> list[tuple[Counter | Histogram, tuple[str, ...]]]:
        """A version's series: its counters' (made at 0 when it loads) and its batches' run time at
        each of the ``buckets`` of batch size it ran (``BatchMetrics.series``), removed when it is
        unloaded: each version that ever served left a histogram per bucket behind."""
        return [
            (self.batch_failures, (model, version)),
            *((self.device_faults, (model, version, fault)) for fault in DEVICE_FAULTS),
            *((self.inference, (model, version, bucket)) for bucket in buckets),
        ]


class BatchMetrics:
    """The batcher's observer for one model."""

    def __init__(self, metrics: Metrics, model: str, version: str) -> None:
        self._metrics = metrics
        self._model = model
        self._version = version
        self._buckets: set[str] = set()  # the batch-size buckets its batches ran at: removed with it

    def series(self) -> list[tuple[Counter | Histogram, tuple[str, ...]]]:
        """The version's series (``Metrics.version_series``), its run times at each batch-size
        bucket it ran included: made at 0 when it loads, removed when it is unloaded."""
        return self._metrics.version_series(self._model, self._version, self._buckets)

    def adopt(self, other: BatchMetrics) -> None:
        """Take on the run-time buckets of ``other``, a copy of the same version that drained
        while this one was loaded: their series are this copy's to remove when it goes."""
        self._buckets |= other._buckets

    def on_batch(
        self, lane: Lane, size: int, capacity: int, waits_s: Sequence[tuple[Lane, float]], run_s: float, ok: bool
    ) -> None:
        m = self._metrics
        for own, seconds in waits_s:  # under the request's own lane, whichever batch it rode
            m.queue_wait.labels(own.value).observe(seconds)
        if not size:  # nothing reached the device: no batch ran there, and its near-zero time is no run time
            return
        m.batch_size.labels(lane.value).observe(size)
        m.batch_fill.labels(lane.value).observe(min(1.0, size / capacity))
        bucket = batch_bucket(size)
        self._buckets.add(bucket)
        m.inference.labels(self._model, self._version, bucket).observe(run_s)
        if not ok:
            m.batch_failures.labels(self._model, self._version).inc()

    def on_rejected(self, lane: Lane, reason: str) -> None:
        self._metrics.rejections.labels(reason).inc()

    def on_dropped(self, lane: Lane, reason: str) -> None:
        self._metrics.cancellations.labels(reason).inc()
