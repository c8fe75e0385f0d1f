"""Time for the batcher, behind a protocol so tests can drive it by hand."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic seconds, timers on that scale, and a wait that ends on an event or a timeout."""

    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer: ...

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None: ...


class MonotonicClock:
    """The event loop's own clock: timers are plain ``loop.call_at`` handles, no polling."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_at(when, callback)

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:
        if timeout is not None and timeout <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
