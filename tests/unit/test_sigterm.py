"""SIGTERM's handler in ``DrainingServer``: the drain it starts, and the log lines it writes.

A signal handler runs between two bytecodes of the main thread, in whatever context was
current there: often a request's, whose id and trace the log filter would stamp on the
SIGTERM's lines and whose context the drain task would inherit.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import pytest
import uvicorn
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from starlette.types import Receive, Scope, Send

from app.server import DRAINED_CLOSE_S, DrainingServer
from app.telemetry.logging import RequestIdFilter, request_id_var


async def _app(scope: Scope, receive: Receive, send: Send) -> None:  # never served
    raise AssertionError("not called")


async def test_sigterm_in_a_requests_context_drains_and_logs_outside_it(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[str | None, bool]] = []

    async def drain() -> None:
        seen.append((request_id_var.get(), trace.get_current_span().get_span_context().is_valid))

    server = DrainingServer(uvicorn.Config(_app), drain)
    server._loop = asyncio.get_running_loop()  # as ``serve`` sets it
    caplog.handler.addFilter(RequestIdFilter())
    tracer = TracerProvider().get_tracer(__name__)
    token = request_id_var.set("the-request-being-served")
    try:
        with tracer.start_as_current_span("its span"), caplog.at_level(logging.INFO, logger="app.server"):
            server.handle_exit(signal.SIGTERM, None)
    finally:
        request_id_var.reset(token)
    async with asyncio.timeout(5):
        while not server.should_exit:  # noqa: ASYNC110 (the drain task sets it; nothing to wait on)
            await asyncio.sleep(0.001)
    assert seen == [(None, False)], "the drain ran in no request's context"
    (record,) = [r for r in caplog.records if r.name == "app.server"]
    assert record.getMessage() == "SIGTERM: draining before shutdown"
    assert record.request_id is None and not hasattr(record, "trace_id")


async def test_a_second_sigterm_stops_at_once_even_before_the_drain_has_started() -> None:
    started = asyncio.Event()

    async def drain() -> None:
        started.set()
        await asyncio.sleep(3600)  # a drain that would outlast the test

    server = DrainingServer(uvicorn.Config(_app), drain)
    server._loop = asyncio.get_running_loop()
    server.handle_exit(signal.SIGTERM, None)
    assert not server.should_exit and not started.is_set()
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit, "the second SIGTERM did not wait for the first one's drain to start"
    assert server.config.timeout_graceful_shutdown == 0, "nor does uvicorn wait for open requests"
    await started.wait()
    assert server._draining is not None
    server._draining.cancel()
    with pytest.raises(asyncio.CancelledError):
        await server._draining


async def test_after_the_drain_uvicorn_waits_for_connections_seconds_not_a_second_grace() -> None:
    async def drain() -> None:  # the drain took the grace period
        return

    server = DrainingServer(uvicorn.Config(_app, timeout_graceful_shutdown=31), drain)
    server._loop = asyncio.get_running_loop()
    server.handle_exit(signal.SIGTERM, None)
    async with asyncio.timeout(5):
        while not server.should_exit:  # noqa: ASYNC110 (the drain task sets it)
            await asyncio.sleep(0.001)
    assert server.config.timeout_graceful_shutdown == DRAINED_CLOSE_S < 31


def test_ctrl_c_does_not_wait_for_open_requests() -> None:
    server = DrainingServer(uvicorn.Config(_app, timeout_graceful_shutdown=31), drain=lambda: asyncio.sleep(0))
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and server.config.timeout_graceful_shutdown == 0
    assert server.interrupted, "serve exits 130 whether or not asyncio's runner raises KeyboardInterrupt"
