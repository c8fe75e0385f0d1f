"""A call on worker threads that its caller waits for a bounded time.

A thread cannot be stopped. When a model load passes ``model.load_timeout_s`` its caller is
answered, but a load already running goes on holding its thread and, as it completes, a
second copy of the model's memory; a second load started then would run beside it (with two
threads) or queue behind it, and time out in turn. ``BoundedCall`` tells the two cases
apart: a call that had not started when its caller gave up never starts, and one that had is
``late`` until it ends, when its result is dropped on the thread and ``on_late_end`` is called
on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from app.inference.workers import WorkerThreads

T = TypeVar("T")
log = logging.getLogger(__name__)


class _State(enum.Enum):
    WAITING = "waiting"  # queued for a thread
    RUNNING = "running"
    LATE = "late"  # running, and its caller gave up
    CALLED_OFF = "called off"  # its caller gave up before it started: it never will
    ENDED = "ended"


class BoundedCall(Generic[T]):
    """``fn`` run once on ``threads``, awaited at most ``timeout_s`` (``run``). ``release`` runs on
    the thread after a late call's result is dropped (the device's cached memory, say), then
    ``on_late_end`` on the event loop."""

    def __init__(
        self,
        fn: Callable[[], T],
        release: Callable[[], None] = lambda: None,
        on_late_end: Callable[[], None] = lambda: None,
    ) -> None:
        self._fn, self._release, self._on_late_end = fn, release, on_late_end
        self._lock = threading.Lock()  # held for a state change only, on either side
        self._state = _State.WAITING
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def late(self) -> bool:
        """Its caller gave up (timed out or was cancelled) and it still runs (``on_late_end``
        comes after the caller's exception has been handled: both are on the event loop)."""
        return self._state is _State.LATE

    async def run(self, threads: WorkerThreads, timeout_s: float) -> T:
        """The call's result; ``TimeoutError`` past ``timeout_s``. Past it, or cancelled, the call
        never starts or, if running, is ``late`` until it ends."""
        self._loop = asyncio.get_running_loop()
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancel (start-up's) that lands
            # just as the call ends
            async with asyncio.timeout(timeout_s):
                result: T = await threads.run(self._call)
        except (TimeoutError, asyncio.CancelledError):
            with self._lock:
                if self._state is _State.WAITING:
                    self._state = _State.CALLED_OFF
                elif self._state is _State.RUNNING:
                    self._state = _State.LATE
            raise
        return result

    def _call(self) -> T:  # on a worker thread
        with self._lock:
            if self._state is _State.CALLED_OFF:  # picked up just as its caller gave up
                raise TimeoutError("called off before it started")
            self._state = _State.RUNNING
        try:
            result = self._fn()
        except BaseException:
            if self._end():
                self._after_late()
            raise
        if self._end():
            del result  # nobody awaits it: what it holds goes now, before the release
            self._after_late()
            raise TimeoutError("its caller gave up while it ran")
        return result

    def _end(self) -> bool:
        """The call ended; whether it was late."""
        with self._lock:
            late, self._state = self._state is _State.LATE, _State.ENDED
        return late

    def _after_late(self) -> None:
        try:
            self._release()
        except Exception:  # nobody awaits this call: said here, and the end is told all the same
            log.exception("releasing what a late call held failed")
        assert self._loop is not None  # set before the call was queued
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self._loop.call_soon_threadsafe(self._on_late_end)
