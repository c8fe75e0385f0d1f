"""Shutdown's loose ends: SIGQUIT, which drains as SIGTERM does (``DrainingServer``)."""

from __future__ import annotations

import asyncio
import logging
import signal

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from app.server import DrainingServer


async def _app(scope: Scope, receive: Receive, send: Send) -> None:  # never served
    raise AssertionError("not called")


async def test_sigquit_drains_as_sigterm_does_and_is_not_raised_again_at_exit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """nginx's graceful quit. uvicorn leaves SIGQUIT to its default action (a core dump, every
    accepted request lost); recorded as a signal uvicorn caught, it would raise it again once
    shut down, with the same end."""
    drained = asyncio.Event()

    async def drain() -> None:
        drained.set()

    server = DrainingServer(uvicorn.Config(_app, timeout_graceful_shutdown=31), drain)
    server._loop = asyncio.get_running_loop()  # as ``serve`` sets it
    with caplog.at_level(logging.INFO, logger="app.server"):
        server.handle_exit(signal.SIGQUIT, None)
        assert not server.should_exit, "it waits for the drain"
        async with asyncio.timeout(5):
            await drained.wait()
            while not server.should_exit:  # noqa: ASYNC110 (the drain task sets it)
                await asyncio.sleep(0.001)
    assert server._captured_signals == []
    assert [r.getMessage() for r in caplog.records if r.name == "app.server"] == ["SIGQUIT: draining before shutdown"]


async def test_a_second_sigquit_or_sigterm_stops_at_once(caplog: pytest.LogCaptureFixture) -> None:
    for first, second in [(signal.SIGQUIT, signal.SIGQUIT), (signal.SIGTERM, signal.SIGQUIT)]:
        never = asyncio.Event()
        server = DrainingServer(uvicorn.Config(_app, timeout_graceful_shutdown=31), never.wait)
        server._loop = asyncio.get_running_loop()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="app.server"):
            server.handle_exit(first, None)
            server.handle_exit(second, None)
        assert server.should_exit and server.config.timeout_graceful_shutdown == 0
        assert server._captured_signals == []
        said = [r.getMessage() for r in caplog.records if r.name == "app.server"]
        assert said[-1] == f"second {second.name}: stopping without waiting for the drain"
        await asyncio.sleep(0)  # the drain task begins, then is let go
        assert server._draining is not None
        server._draining.cancel()
        with pytest.raises(asyncio.CancelledError):
            await server._draining


def test_serving_takes_sigquit_and_gives_it_back() -> None:
    server = DrainingServer(uvicorn.Config(_app), drain=lambda: asyncio.sleep(0))
    before = signal.getsignal(signal.SIGQUIT)
    with server.capture_signals():
        assert signal.getsignal(signal.SIGQUIT) == server.handle_exit
        assert signal.getsignal(signal.SIGTERM) == server.handle_exit
    assert signal.getsignal(signal.SIGQUIT) == before
