"""How late the event loop runs what is due: the operator's view of a stalled loop.

Every request's work on the loop (its bytes, its answer, the batcher's timers) waits while the loop
runs something else or waits for a core. ``LoopLag`` sleeps ``interval_s`` again and again on the
loop and observes how much later than due each sleep ended into ``event_loop_lag_seconds``; a lag
of ``warn_s`` or more is logged as a warning, one a minute at most (a throttled container would
lag at every sample), counting the late samples since the last. Beside the stage histograms it tells a stalled loop
(its lag long with them) from threads starved while the loop kept time (the stages long, its
lag short). Four timers a second at the default interval: nothing the request path notices.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from prometheus_client import Histogram

log = logging.getLogger(__name__)

WARN_EVERY_S = 60.0  # one warning a minute at most


class LoopLag:
    """Samples the running loop's lag every ``interval_s`` into ``histogram``, until cancelled."""

    def __init__(
        self, histogram: Histogram, interval_s: float, warn_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._histogram, self._interval_s, self._warn_s, self._clock = histogram, interval_s, warn_s, clock
        self._warned_at = -math.inf
        self._late, self._worst = 0, 0.0  # late samples since the last warning, and the longest

    async def run(self) -> None:
        while True:
            due = self._clock() + self._interval_s
            await asyncio.sleep(self._interval_s)
            lag = max(0.0, self._clock() - due)  # uvloop's timers count whole milliseconds: some end early
            self._histogram.observe(lag)
            if lag >= self._warn_s:
                self._late_sample(lag)

    def _late_sample(self, lag: float) -> None:
        self._late, self._worst = self._late + 1, max(self._worst, lag)
        if (now := self._clock()) - self._warned_at < WARN_EVERY_S:
            return
        log.warning(
            "the event loop ran up to %.0f ms late (%d samples %.0f ms or more late since the last such warning): "
            "every request's work on it waited that long",
            self._worst * 1000,
            self._late,
            self._warn_s * 1000,
            extra={"lag_ms": round(self._worst * 1000, 1), "late_samples": self._late},
        )
        self._warned_at, self._late, self._worst = now, 0, 0.0


def watch_loop(histogram: Histogram, interval_ms: float, warn_ms: float) -> list[asyncio.Task[None]]:
    """``LoopLag``'s task on the running loop, for its owner to cancel and await at close; none
    when ``interval_ms`` is 0 (``telemetry.loop_lag_interval_ms``)."""
    if interval_ms <= 0:
        return []
    lag = LoopLag(histogram, interval_ms / 1000, warn_ms / 1000)
    return [asyncio.get_running_loop().create_task(lag.run(), name="loop-lag")]
