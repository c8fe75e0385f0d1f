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
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.errors import ServiceError

T = TypeVar("T")


class ClientClosed(ServiceError):
    """The client disconnected before its answer was ready (logged as 499; nobody reads it)."""

    status = 499
    code = "client_closed_request"


class NothingSent(Response):
    """The answer to a request whose client went: nothing is sent, as nobody would read it. Its
    499 is nginx's convention for the access log and the metrics, never a status on the wire."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return None


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first.

    ``work`` runs in the caller's own task (a task of its own was one more to create, schedule
    and finish for every prediction, on the event loop): the watcher cancels the caller's task,
    and the cancellation it asked for comes out as ``ClientClosed``."""
    caller = asyncio.current_task()
    assert caller is not None, "awaited outside a task"
    gone = False

    async def watch() -> None:
        nonlocal gone
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone = True
                caller.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone:
            caller.uncancel()  # this cancellation is answered here: nothing outside asked for it
            raise ClientClosed("the client disconnected") from None
        raise
    finally:
        watcher.cancel()
