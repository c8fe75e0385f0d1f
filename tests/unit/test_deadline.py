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
