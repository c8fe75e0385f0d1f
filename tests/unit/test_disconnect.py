"""A client's disconnect cancels its request's work, which runs in the request's own task."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from fastapi import Request

from app.api.disconnect import ClientClosed, unless_disconnected


class Client:
    """The ASGI ``receive`` of a request whose body was read: it returns when the client goes."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.receives = 0

    async def receive(self) -> dict[str, Any]:
        self.receives += 1
        await self.gone.wait()
        return {"type": "http.disconnect"}


def request(client: Client) -> Request:
    return cast(Request, client)  # unless_disconnected only calls receive()


async def test_the_work_runs_in_the_callers_task_and_the_watch_ends_with_it() -> None:
    """No task of its own for the work: one more to create and schedule for every prediction."""
    client = Client()
    tasks_before = len(asyncio.all_tasks())
    caller = asyncio.current_task()

    async def work() -> str:
        await asyncio.sleep(0.01)
        assert asyncio.current_task() is caller
        assert len(asyncio.all_tasks()) == tasks_before + 1  # the watcher
        return "answer"

    assert await unless_disconnected(request(client), work()) == "answer"
    await asyncio.sleep(0)  # the watcher's cancellation is delivered
    assert len(asyncio.all_tasks()) == tasks_before and client.receives == 1


async def test_a_client_gone_cancels_the_work_and_is_told_as_client_closed() -> None:
    client = Client()
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async def handler() -> None:
        with pytest.raises(ClientClosed):
            await unless_disconnected(request(client), work())
        # the cancellation is answered: the task is not left cancelling, so what the handler
        # awaits next (an answer nobody reads, a log) is not cut off, nor an enclosing timeout confused
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0)

    running = asyncio.ensure_future(handler())
    await asyncio.sleep(0.01)
    client.gone.set()
    await asyncio.wait_for(running, 5)
    assert cancelled.is_set()


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    """The server cutting the request off (its shutdown) is not the client leaving."""
    client = Client()
    running = asyncio.ensure_future(unless_disconnected(request(client), asyncio.sleep(60)))
    await asyncio.sleep(0.01)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running


async def test_a_deadline_around_the_work_still_expires_as_a_timeout() -> None:
    """An ``asyncio.timeout`` inside the work (the decode's deadline, say) is its own cancellation."""
    client = Client()

    async def work() -> None:
        async with asyncio.timeout(0.01):
            await asyncio.sleep(60)

    with pytest.raises(TimeoutError):
        await unless_disconnected(request(client), work())
