"""The HTTP server: uvicorn, taught to drain on SIGTERM before it stops listening.

Plain uvicorn stops accepting connections the moment SIGTERM arrives, then re-raises the
signal so the process dies by it. A deploy wants the opposite order: readiness turns 503
and new predictions get 503 ``draining`` while queued and running requests finish (within
the grace period), and only then does the listener close and the process exit 0.
A second SIGTERM, or SIGINT, stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

log = logging.getLogger(__name__)

Drain = Callable[[], Awaitable[None]]


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose SIGTERM drains the service first and ends with exit code 0."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._loop is None:
            super().handle_exit(sig, frame)
            return
        # not recorded in _captured_signals: uvicorn would re-raise it and the exit code would be 143
        if self._draining is not None or self.should_exit:
            log.warning("second SIGTERM: stopping without waiting for the drain")
            self.should_exit = True
            return
        log.info("SIGTERM: draining before shutdown")
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._draining = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:
            log.exception("drain failed; shutting down anyway")
        finally:
            self.should_exit = True
