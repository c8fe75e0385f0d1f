"""Cancel a request's work when its client goes away.

Once the body has been read, the next ASGI ``receive`` only returns when the client
disconnects. Watching it beside the work lets a gone client's request leave the batcher
queue instead of being computed for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from app.errors import ServiceError

T = TypeVar("T")


class ClientClosed(ServiceError):
    """The client disconnected before its answer was ready (logged as 499; nobody reads it)."""

    status = 499
    code = "client_closed_request"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientClosed("the client disconnected") from None
        raise
    finally:
        watcher.cancel()
