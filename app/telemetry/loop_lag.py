"""How late the event loop runs what is due: the operator's view of a stalled loop.

Every request's work on the loop (its bytes, its answer, the batcher's timers) waits while the loop
runs something else or waits for a core. ``LoopLag`` sleeps ``interval_s`` again and again on the
loop and observes how much later than due each sleep ended into ``event_loop_lag_seconds``; a lag
of ``warn_s`` or more is logged as a warning. Beside the stage histograms it tells a stalled loop
(its lag long with them) from threads starved while the loop kept time (the stages long, its
lag short). Four timers a second at the default interval: nothing the request path notices.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import Histogram

log = logging.getLogger(__name__)


class LoopLag:
    """Samples the running loop's lag every ``interval_s`` into ``histogram``, until cancelled."""

    def __init__(
        self, histogram: Histogram, interval_s: float, warn_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._histogram, self._interval_s, self._warn_s, self._clock = histogram, interval_s, warn_s, clock

    async def run(self) -> None:
        while True:
            due = self._clock() + self._interval_s
            await asyncio.sleep(self._interval_s)
            lag = max(0.0, self._clock() - due)  # uvloop's timers count whole milliseconds: some end early
            self._histogram.observe(lag)
            if lag >= self._warn_s:
                log.warning(
                    "the event loop ran %.0f ms late: every request's work on it waited that long",
                    lag * 1000,
                    extra={"lag_ms": round(lag * 1000, 1)},
                )


def watch_loop(histogram: Histogram, interval_ms: float, warn_ms: float) -> list[asyncio.Task[None]]:
    """``LoopLag``'s task on the running loop, for its owner to cancel and await at close; none
    when ``interval_ms`` is 0 (``telemetry.loop_lag_interval_ms``)."""
    if interval_ms <= 0:
        return []
    lag = LoopLag(histogram, interval_ms / 1000, warn_ms / 1000)
    return [asyncio.get_running_loop().create_task(lag.run(), name="loop-lag")]
