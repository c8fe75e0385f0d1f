"""Fakes for the batcher: a clock moved by hand and a runner that records its batches."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(order=True)
class _Timer:
    when: float
    seq: int
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Time stands still until ``advance``; timers fire in order as it passes them."""

    def __init__(self) -> None:
        self.t = 0.0
        self._timers: list[_Timer] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    def call_at(self, when: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(when, next(self._seq), callback)
        heapq.heappush(self._timers, timer)
        return timer

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:
        if timeout is not None and timeout <= 0:
            return
        woken = asyncio.Event()
        timer = self.call_at(self.t + timeout, woken.set) if timeout is not None else None
        waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(woken.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            if timer is not None:
                timer.cancel()

    async def advance(self, seconds: float) -> None:
        """Move time forward, firing due timers, and let every task react."""
        target = self.t + seconds
        await settle()
        while self._timers and self._timers[0].when <= target:
            timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self.t = max(self.t, timer.when)
            timer.callback()
            await settle()
        self.t = target
        await settle()


async def settle(rounds: int = 30) -> None:
    """Give every ready task a chance to run (the fake clock never sleeps)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class FakeRunner:
    """Doubles each payload; records batches; can be gated, or fail chosen batches."""

    def __init__(self, fail_on: Callable[[Sequence[int]], BaseException | None] | None = None) -> None:
        self.batches: list[list[int]] = []
        self.gate: asyncio.Event | None = None
        self.held: list[asyncio.Event] | None = None  # [] holds each batch until ``release(its index)``
        self.fail_on = fail_on
        self.short = False

    def release(self, *indexes: int) -> None:
        assert self.held is not None, "set held = [] before the batches run"
        for index in indexes or range(len(self.held)):
            self.held[index].set()

    async def __call__(self, payloads: Sequence[int]) -> list[int]:
        self.batches.append(list(payloads))
        if self.held is not None:
            self.held.append(event := asyncio.Event())
            await event.wait()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_on is not None and (error := self.fail_on(payloads)) is not None:
            raise error
        outputs = [p * 2 for p in payloads]
        return outputs[:-1] if self.short else outputs


class TimedRunner:
    """Each batch takes ``batch_s`` of fake time on ``clock``; payloads are (lane, id) pairs, each
    answered with its id; records its batches."""

    def __init__(self, clock: FakeClock, batch_s: float) -> None:
        self.clock, self.batch_s = clock, batch_s
        self.batches: list[list[tuple[object, int]]] = []

    async def __call__(self, payloads: Sequence[tuple[object, int]]) -> list[int]:
        self.batches.append(list(payloads))
        done = asyncio.Event()
        self.clock.call_at(self.clock.now() + self.batch_s, done.set)
        await done.wait()
        return [i for _, i in payloads]
