"""Each replica's Prometheus registry, copied into Ray's metrics so that no replica is missed.

Behind Serve, ``GET /metrics`` goes through a proxy to whichever replica the router picks:
a scrape sees one replica at a time. So each replica copies its own registry into Ray's
metrics API every few seconds, and Ray's metrics agent on each node exports every
replica's figures on the node's metrics port (``ray start --metrics-export-port``), tagged
with ``deployment``, ``replica`` and ``application`` (Serve adds them).

The names stay those of ``/metrics`` with Ray's ``ray_`` prefix, and the values are exact:

- counters go to Ray counters, by the increase since the last copy
  (``ai_backend_requests_total`` becomes ``ray_ai_backend_requests_total``);
- gauges go to Ray gauges;
- a histogram's ``_bucket`` (with ``le``), ``_count`` and ``_sum`` series go to Ray gauges
  holding the cumulative values, so ``histogram_quantile(0.99, sum by (le)
  (rate(ray_ai_backend_request_duration_seconds_bucket[1m])))`` works as it does on
  ``/metrics``. (Replaying observations into a Ray histogram would make the sum a guess.)

This module imports no Ray at import: ``RayMetricFactory`` imports it when first used, and
tests pass a factory of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

Key = tuple[str, tuple[tuple[str, str], ...]]
# Serve adds these to every metric made in a replica; a label of ours by the same name is renamed.
RESERVED_TAGS = frozenset({"deployment", "replica", "application"})


class CounterSink(Protocol):
    def inc(self, value: float, tags: dict[str, str]) -> None: ...


class GaugeSink(Protocol):
    def set(self, value: float, tags: dict[str, str]) -> None: ...


class MetricFactory(Protocol):
    """Makes the metrics the copy writes to (Ray's in a replica; fakes in tests)."""

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> CounterSink: ...

    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> GaugeSink: ...


class RayMetricFactory:
    """``ray.serve.metrics``: inside a replica, each metric also carries its Serve tags."""

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> CounterSink:
        from ray.serve import metrics

        counter: CounterSink = metrics.Counter(name, description, tag_keys=tag_keys)
        return counter

    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> GaugeSink:
        from ray.serve import metrics

        gauge: GaugeSink = metrics.Gauge(name, description, tag_keys=tag_keys)
        return gauge


def _tags(labels: Mapping[str, str]) -> dict[str, str]:
    return {(f"{k}_" if k in RESERVED_TAGS else k): v for k, v in labels.items()}


class MetricsMirror:
    """Copies ``registry`` into ``factory``'s metrics; ``sync`` once, or ``run`` every interval."""

    def __init__(self, registry: CollectorRegistry, factory: MetricFactory) -> None:
        self._registry = registry
        self._factory = factory
        self._counters: dict[str, CounterSink] = {}
        self._gauges: dict[str, GaugeSink] = {}
        self._last: dict[Key, float] = {}
        self._set: dict[Key, tuple[GaugeSink, dict[str, str]]] = {}  # the gauge series written last sync
        self._syncing = threading.Lock()

    def _counter(self, name: str, description: str, tags: dict[str, str]) -> CounterSink:
        if name not in self._counters:
            self._counters[name] = self._factory.counter(name, description, tuple(sorted(tags)))
        return self._counters[name]

    def _gauge(self, name: str, description: str, tags: dict[str, str]) -> GaugeSink:
        if name not in self._gauges:
            self._gauges[name] = self._factory.gauge(name, description, tuple(sorted(tags)))
        return self._gauges[name]

    def sync(self) -> int:
        """Copy every sample once; returns how many series were written."""
        written = 0
        seen: dict[Key, tuple[GaugeSink, dict[str, str]]] = {}
        for family in self._registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue  # creation timestamps: Ray keeps its own
                tags = _tags(sample.labels)
                value = float(sample.value)
                if family.type == "counter":
                    key: Key = (sample.name, tuple(sorted(tags.items())))
                    increase = value - self._last.get(key, 0.0)
                    self._last[key] = value
                    if increase <= 0:
                        continue
                    # Ray exports a counter named N as N_total, as prometheus_client does
                    self._counter(family.name, family.documentation, tags).inc(increase, tags)
                else:
                    gauge = self._gauge(sample.name, family.documentation, tags)
                    gauge.set(value, tags)
                    seen[(sample.name, tuple(sorted(tags.items())))] = (gauge, tags)
                written += 1
        # a series the registry no longer has (an unloaded version, the device's model_info
        # after a fallback): Ray's gauges cannot be removed, so they read 0, not their last value
        for key in self._set.keys() - seen.keys():
            gauge, tags = self._set[key]
            gauge.set(0.0, tags)
        self._set = seen
        return written

    async def run(self, interval_s: float) -> None:
        """``sync`` every ``interval_s`` until cancelled, then once more; all off the event loop."""
        try:
            while True:
                await asyncio.sleep(interval_s)
                await asyncio.to_thread(self._safe_sync)
        finally:
            # a cancel stops the await, not the thread's copy under way: the last copy waits for
            # it on the lock, in a thread of its own, so that the event loop does not wait too.
            # At a teardown that no longer runs threads, the copy is skipped: the replica's stop goes on
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._safe_sync)

    def _safe_sync(self) -> None:
        """``sync``, one at a time: two at once both read a counter's last value before either
        wrote it, and Ray's counter got the same increase twice."""
        with self._syncing:
            try:
                self.sync()
            except Exception:  # a metrics failure must never take a replica down
                log.exception("copying metrics to Ray failed")
