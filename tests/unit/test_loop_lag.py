"""The event loop's lag: sampled on the real loop, a stall seen in the histogram and the log."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from app.telemetry.loop_lag import LoopLag, watch_loop
from app.telemetry.metrics import LOOP_LAG_BUCKETS, Metrics


def histogram() -> tuple[Histogram, CollectorRegistry]:
    registry = CollectorRegistry()
    return Histogram("lag_seconds", "lag", buckets=LOOP_LAG_BUCKETS, registry=registry), registry


async def test_a_blocked_loop_shows_as_one_long_lag_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    lag, registry = histogram()
    task = asyncio.create_task(LoopLag(lag, interval_s=0.01, warn_s=0.1).run())
    await asyncio.sleep(0.05)  # a few samples of a loop with nothing to do
    quiet = registry.get_sample_value("lag_seconds_sum") or 0.0
    with caplog.at_level(logging.WARNING, logger="app.telemetry.loop_lag"):
        time.sleep(0.25)  # noqa: ASYNC251 - the stall under test: the loop runs nothing for 250 ms
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # noqa: ASYNC251 - a second one within the minute: counted, not logged again yet
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    count = registry.get_sample_value("lag_seconds_count") or 0.0
    total = registry.get_sample_value("lag_seconds_sum") or 0.0
    assert count >= 4 and quiet < 0.1, "samples on a quiet loop read next to nothing"
    assert total - quiet >= 0.5, "both stalls are in the histogram"
    assert (registry.get_sample_value("lag_seconds_bucket", {"le": "0.1"}) or 0) <= count - 2, "in long buckets"
    warnings = [r for r in caplog.records if r.name == "app.telemetry.loop_lag"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, "one warning a minute at most"
    first = warnings[0]
    assert 200 <= first.lag_ms < 290 and first.late_samples == 1  # type: ignore[attr-defined]
    assert "ran up to" in first.getMessage()


def test_late_samples_within_the_minute_are_counted_into_the_next_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    lag = LoopLag(histogram()[0], interval_s=0.25, warn_s=0.25, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="app.telemetry.loop_lag"):
        for at, late in ((1.0, 0.3), (20.0, 0.9), (40.0, 0.4), (61.5, 0.5), (70.0, 0.3)):
            now[0] = at
            lag._late_sample(late)
    warnings = [(r.lag_ms, r.late_samples) for r in caplog.records]  # type: ignore[attr-defined]
    assert warnings == [(300.0, 1), (900.0, 3)], "the first at once, then one a minute with the worst since"


async def test_no_task_when_sampling_is_off_and_one_named_task_when_on() -> None:
    metrics = Metrics()
    assert watch_loop(metrics.loop_lag, 0, 250) == []
    tasks = watch_loop(metrics.loop_lag, 5, 250)
    assert [t.get_name() for t in tasks] == ["loop-lag"]
    await asyncio.sleep(0.05)
    tasks[0].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert (metrics.registry.get_sample_value("ai_backend_event_loop_lag_seconds_count") or 0) >= 2
