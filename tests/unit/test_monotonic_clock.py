"""The batcher's real clock: its waits end on the event, at the timeout, or on a cancel, and a
cancel is never lost (Python 3.11's ``asyncio.wait_for`` drops one that lands just as the
awaited thing finishes, and the batcher's close cancels its dispatcher in such a wait)."""

from __future__ import annotations

import asyncio

import pytest

from app.batching.clock import MonotonicClock


async def test_a_wait_ends_when_its_event_is_set() -> None:
    event = asyncio.Event()
    waiter = asyncio.create_task(MonotonicClock().wait(event, 30.0))
    await asyncio.sleep(0)
    event.set()
    async with asyncio.timeout(10):
        await waiter


async def test_a_wait_ends_at_its_timeout_without_raising() -> None:
    async with asyncio.timeout(10):
        await MonotonicClock().wait(asyncio.Event(), 0.001)
        await MonotonicClock().wait(asyncio.Event(), 0)


@pytest.mark.parametrize("turns", [0, 1, 2, 3])
async def test_a_cancel_that_lands_as_the_event_is_set_is_not_lost(turns: int) -> None:
    event = asyncio.Event()
    waiter = asyncio.create_task(MonotonicClock().wait(event, 30.0))
    await asyncio.sleep(0)  # waiting
    event.set()
    for _ in range(turns):
        await asyncio.sleep(0)
    if waiter.cancel():  # not finished yet: the cancel must end it
        with pytest.raises(asyncio.CancelledError):
            await waiter
    else:
        assert waiter.done() and waiter.exception() is None
