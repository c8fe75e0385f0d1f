"""``within``: a request's deadline over a stage before its queue, and the count of those it ends."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.deadline import within
from app.errors import DeadlineExceeded


async def test_a_block_cut_off_at_the_deadline_is_deadline_exceeded_and_counted() -> None:
    expired: list[str] = []
    with pytest.raises(DeadlineExceeded, match="while it waited"):
        async with within(time.monotonic() + 0.01, "while it waited", lambda: expired.append("cut")):
            await asyncio.Event().wait()  # never set: only the deadline ends it
    assert expired == ["cut"]


async def test_a_block_that_finds_its_deadline_passed_itself_is_counted_too() -> None:
    # the decode pool's check: a thread picks the image up after its deadline and refuses it
    expired: list[str] = []
    with pytest.raises(DeadlineExceeded):
        async with within(time.monotonic() + 60, "while it waited", lambda: expired.append("late")):
            raise DeadlineExceeded("the request's deadline passed while its image waited to be decoded")
    assert expired == ["late"]


async def test_a_block_that_ends_otherwise_is_not_counted() -> None:
    expired: list[str] = []
    async with within(time.monotonic() + 60, "while it waited", lambda: expired.append("no")):
        await asyncio.sleep(0)
    with pytest.raises(ValueError):
        async with within(time.monotonic() + 60, "while it waited", lambda: expired.append("no")):
            raise ValueError("not a deadline")
    assert expired == []


async def test_a_deadline_already_past_cuts_the_block_at_its_first_wait() -> None:
    with pytest.raises(DeadlineExceeded):
        async with within(time.monotonic() - 1, "while it waited"):
            await asyncio.sleep(0.5)


def test_on_uvloop_no_block_is_cut_before_its_deadline() -> None:
    """uvloop, the loop ``ai-backend serve`` runs on, counts its timers in whole milliseconds and
    ran a third of them up to 1.3 ms early: a body or a decode wait was answered
    ``deadline_exceeded`` before the request's deadline."""
    uvloop = pytest.importorskip("uvloop")

    async def play() -> list[float]:
        early: list[float] = []

        async def one(i: int) -> None:
            deadline = time.monotonic() + (2 + i % 7 + i / 31) / 1000  # fractions of a millisecond
            with pytest.raises(DeadlineExceeded):
                async with within(deadline, "while it waited"):
                    await asyncio.Event().wait()
            early.append(deadline - time.monotonic())

        for start in range(0, 60, 15):  # some alone, some together, as requests come
            await asyncio.gather(*(one(i) for i in range(start, start + 1 + start // 4)))
        return early

    early = uvloop.run(play())
    assert max(early) <= 0, f"{sum(e > 0 for e in early)} of {len(early)} cut up to {max(early) * 1000:.2f} ms early"
