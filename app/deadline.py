"""A request's deadline over the stages before its queue: the body arriving, the image
waiting for a decode thread. (The batcher keeps the deadline from the queue on.)

A stalled upload or a decode backlog must not keep a request past its deadline (nor, for a
decode, its seat in the lane held): at the deadline the stage is cancelled and the request answered 503
``deadline_exceeded``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import TracebackType

from app.batching.clock import TIMER_RESOLUTION_S
from app.errors import DeadlineExceeded


class within:  # noqa: N801 - used as a statement: ``async with within(deadline, "..."):``
    """Cancel the block at ``deadline`` (``time.monotonic()``), raising ``DeadlineExceeded``
    that says the request's deadline passed ``where``. ``expired()`` is called when the block
    ends by the deadline: cut off, or raising ``DeadlineExceeded`` itself.

    Never before it: the cut is made by a timer that reads ``time.monotonic()`` when it runs and,
    run early (uvloop's timers count whole milliseconds, and run up to one early), is armed again
    for what is left; only then is the block's own timeout brought to now."""

    __slots__ = ("_deadline", "_expired", "_timeout", "_timer", "_where")

    def __init__(self, deadline: float, where: str, expired: Callable[[], None] = lambda: None) -> None:
        self._deadline, self._where, self._expired = deadline, where, expired
        self._timeout: asyncio.Timeout | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> None:
        self._timeout = asyncio.timeout_at(None)
        await self._timeout.__aenter__()
        self._check(asyncio.get_running_loop())

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._timeout is not None
        left = self._deadline - time.monotonic()
        if left > 0:  # a millisecond at least: uvloop runs a shorter delay at once, and would spin
            self._timer = loop.call_later(max(left, TIMER_RESOLUTION_S), self._check, loop)
        else:
            self._timer = None
            self._timeout.reschedule(loop.time())  # the loop's clock may be another's than time.monotonic()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._timeout is not None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None  # its callback holds this object
        try:
            await self._timeout.__aexit__(kind, exc, tb)
        except TimeoutError:
            self._expired()
            raise DeadlineExceeded(f"the request's deadline passed {self._where}") from None
        if isinstance(exc, DeadlineExceeded):
            self._expired()
