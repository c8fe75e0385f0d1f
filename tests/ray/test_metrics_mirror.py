"""The copy of a replica's Prometheus registry into Ray's metrics, against a recording factory."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field

import pytest

from app.batching import Lane
from app.ray.metrics import MetricsMirror
from app.telemetry.metrics import Metrics


@dataclass
class Recorded:
    name: str
    tag_keys: tuple[str, ...]
    calls: list[tuple[float, dict[str, str]]] = field(default_factory=list)

    def inc(self, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.tag_keys)
        self.calls.append((value, tags))

    def set(self, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.tag_keys)
        self.calls.append((value, tags))

    def last(self, **tags: str) -> float:
        return [v for v, t in self.calls if t == tags][-1]


@dataclass
class Factory:
    counters: dict[str, Recorded] = field(default_factory=dict)
    gauges: dict[str, Recorded] = field(default_factory=dict)

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Recorded:
        assert name not in self.counters, "one Ray metric per name"
        self.counters[name] = Recorded(name, tag_keys)
        return self.counters[name]

    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Recorded:
        assert name not in self.gauges, "one Ray metric per name"
        self.gauges[name] = Recorded(name, tag_keys)
        return self.gauges[name]


def test_counters_are_copied_by_their_increase() -> None:
    metrics, factory = Metrics(), Factory()
    mirror = MetricsMirror(metrics.registry, factory)
    metrics.requests.labels("200", "ok").inc(3)
    mirror.sync()
    requests = factory.counters["ai_backend_requests"]  # Ray exports it as ray_ai_backend_requests_total
    assert requests.calls == [(3.0, {"status": "200", "code": "ok"})]
    mirror.sync()
    assert len(requests.calls) == 1, "nothing new, nothing added"
    metrics.requests.labels("200", "ok").inc(2)
    metrics.requests.labels("503", "queue_full").inc()
    mirror.sync()
    assert requests.calls[1:] == [
        (2.0, {"status": "200", "code": "ok"}),
        (1.0, {"status": "503", "code": "queue_full"}),
    ]


def test_histograms_are_copied_as_cumulative_buckets_count_and_sum() -> None:
    metrics, factory = Metrics(), Factory()
    mirror = MetricsMirror(metrics.registry, factory)
    latency = metrics.request_latency.labels("/predict", "200", "urgent")
    latency.observe(0.004)
    latency.observe(0.02)
    metrics.batch_size.labels(Lane.NORMAL.value).observe(16)
    mirror.sync()
    buckets = factory.gauges["ai_backend_request_duration_seconds_bucket"]
    tags = {"route": "/predict", "status": "200", "lane": "urgent"}
    assert buckets.last(**tags, le="0.003") == 0
    assert buckets.last(**tags, le="0.005") == 1
    assert buckets.last(**tags, le="0.025") == 2
    assert buckets.last(**tags, le="+Inf") == 2
    assert factory.gauges["ai_backend_request_duration_seconds_count"].last(**tags) == 2
    assert abs(factory.gauges["ai_backend_request_duration_seconds_sum"].last(**tags) - 0.024) < 1e-9
    assert factory.gauges["ai_backend_batch_size_bucket"].last(lane="normal", le="16.0") == 1
    latency.observe(0.004)
    mirror.sync()
    assert buckets.last(**tags, le="0.005") == 2, "cumulative, as on /metrics"


def test_gauges_read_at_scrape_time_are_copied_too() -> None:
    metrics, factory = Metrics(), Factory()
    metrics.scrape_time.queue_depths = lambda: [("digits", "1", "normal", 7), ("digits", "1", "urgent", 0)]
    metrics.in_flight.inc()
    MetricsMirror(metrics.registry, factory).sync()
    depth = factory.gauges["ai_backend_queue_depth"]
    assert depth.last(model="digits", version="1", lane="normal") == 7
    assert depth.last(model="digits", version="1", lane="urgent") == 0
    assert factory.gauges["ai_backend_in_flight_requests"].last() == 1


def test_labels_that_serve_reserves_are_renamed() -> None:
    from prometheus_client import CollectorRegistry, Counter

    registry, factory = CollectorRegistry(), Factory()
    Counter("things", "x", ["replica", "deployment"], registry=registry).labels("a", "b").inc()
    MetricsMirror(registry, factory).sync()
    assert factory.counters["things"].calls == [(1.0, {"replica_": "a", "deployment_": "b"})]


def test_a_failing_copy_never_raises_into_the_replica() -> None:
    class Broken(Factory):
        def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Recorded:
            raise RuntimeError("no metrics agent")

    metrics = Metrics()
    metrics.requests.labels("200", "ok").inc()
    MetricsMirror(metrics.registry, Broken())._safe_sync()


@dataclass
class _HeldFirst(Recorded):
    """A counter whose first ``inc`` waits for ``release``; it notes any ``inc`` made meanwhile."""

    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    busy: bool = False
    overlapped: bool = False

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.overlapped |= self.busy
        first, self.busy = not self.calls, True
        try:
            super().inc(value, tags)
            if first:
                self.entered.set()
                self.release.wait(10)
        finally:
            self.busy = False


@dataclass
class _Held(Factory):
    counter_made: threading.Event = field(default_factory=threading.Event)

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Recorded:
        self.counters[name] = _HeldFirst(name, tag_keys)
        self.counter_made.set()
        return self.counters[name]


async def test_the_last_copy_waits_for_the_one_under_way() -> None:
    """The cancel that stops the copying interrupted the await of a copy's thread, not the thread,
    and the last copy ran beside it: both read a counter's last value before either wrote it, and
    Ray's counter got the same increase twice. Here the first copy is held in Ray's ``inc``: the
    last one must not start before it ends."""
    from prometheus_client import CollectorRegistry, Counter

    registry, factory = CollectorRegistry(), _Held()
    things = Counter("things", "x", registry=registry)
    things.inc()
    copying = asyncio.create_task(MetricsMirror(registry, factory).run(0.01))
    assert await asyncio.to_thread(factory.counter_made.wait, 10), "the first copy made no Ray counter"
    counter = factory.counters["things"]
    assert isinstance(counter, _HeldFirst)
    assert await asyncio.to_thread(counter.entered.wait, 10), "the first copy never reached Ray's counter"
    things.inc(2)
    copying.cancel()
    await asyncio.sleep(0)  # the copying task runs its cancellation: the last copy starts
    counter.release.set()
    with contextlib.suppress(asyncio.CancelledError):
        await copying
    assert not counter.overlapped, "the last copy ran beside the one under way"
    assert [value for value, _ in counter.calls] == [1.0, 2.0]


async def test_a_last_copy_that_cannot_run_at_teardown_leaves_the_stop_a_cancel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last copy runs in a thread; at a teardown that runs no more threads its failure
    replaced the task's cancellation, and the replica's lifespan, which expects that
    cancellation only, failed its stop with it."""
    metrics = Metrics()
    copying = asyncio.create_task(MetricsMirror(metrics.registry, Factory()).run(3600))
    await asyncio.sleep(0)  # the copying waits out its interval

    tried: list[object] = []

    async def no_threads(*args: object, **kwargs: object) -> None:
        tried.append(args)
        raise RuntimeError("cannot schedule new futures after shutdown")

    monkeypatch.setattr(asyncio, "to_thread", no_threads)
    copying.cancel()
    with pytest.raises(asyncio.CancelledError):
        await copying
    assert tried, "the last copy was tried"
