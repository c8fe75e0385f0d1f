"""Time for the batcher, behind a protocol so tests can drive it by hand."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Protocol

TIMER_RESOLUTION_S = 0.001  # uvloop's timers count whole milliseconds, and run up to one early


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic seconds, timers on that scale, and a wait that ends on an event or a timeout."""

    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer: ...

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None: ...


class MonotonicClock:
    """``time.monotonic()``, with timers as plain loop handles (no polling).

    Not the loop's own clock: uvloop's counts whole milliseconds, read once a turn, and every
    queue wait and batch time measured on it (the answers' timings, the histograms, the
    estimate admission prices waits with) came out in whole milliseconds."""

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, when - time.monotonic()), callback)

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:
        if timeout is not None and timeout <= 0:
            return
        # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancel that lands just as the
        # event is set, and the batcher's close cancels its dispatcher in this wait
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()
