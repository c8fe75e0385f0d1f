"""A stop at once (a second SIGTERM or SIGQUIT, Ctrl-C) ends the drain under way and the close's
own drain, whatever the grace, with a batch held on a device thread.

``halt`` only turned readiness 503: the drain the first signal began went on waiting for the held
batch (for ever with no time limit), the close drained again with the full grace, and the server
put its wait for open connections back to seconds once that drain ended.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from app.errors import Draining
from app.server import DrainingServer
from tests.support import copy_repository, held_batch_and_one_queued

HELD_S = 30.0  # the batch's call: longer than anything here may wait


@pytest.mark.parametrize("grace_s", [None, 3600.0], ids=["no-limit", "an-hour"])
async def test_a_halt_ends_the_drain_and_the_close_with_a_batch_held_on_the_device(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, grace_s: float | None
) -> None:
    held = await held_batch_and_one_queued(copy_repository(tmp_path), HELD_S, urgent_workers=0)
    service, running, queued, release = held.service, held.running, held.queued, held.release
    caplog.set_level("INFO", logger="app.service")
    try:
        drain = asyncio.create_task(service.drain(grace_s))  # the first signal's
        await asyncio.sleep(0.2)
        assert not drain.done(), "the drain waits for the held batch"
        service.halt()  # the second signal
        async with asyncio.timeout(3):
            await drain
        async with asyncio.timeout(5):
            await service.close(grace_s)  # the lifespan's, with the same grace
        outcomes = await asyncio.gather(running, queued, return_exceptions=True)
    finally:
        release.set()
    assert [type(outcome) for outcome in outcomes] == [Draining, Draining], outcomes
    assert service.unfinished, "the thread still inside the call is named (the CLI exits without finalizing)"
    said = [r.getMessage() for r in caplog.records if r.name == "app.service" and r.levelno >= logging.WARNING]
    assert said == [
        "the service stopped at once (a second signal, Ctrl-C): 2 queued or running request(s) answered 503 draining",
        "shutdown: a batch still running on device when the service stopped at once was abandoned, not awaited "
        "(its requests had their 503 already)",
    ]


async def _app(scope: Scope, receive: Receive, send: Send) -> None:  # never served
    raise AssertionError("not called")


@pytest.mark.parametrize(
    "second", [signal.SIGTERM, signal.SIGQUIT, signal.SIGINT], ids=["SIGTERM", "SIGQUIT", "SIGINT"]
)
async def test_a_second_signal_halts_the_service_and_uvicorn_then_waits_for_nothing(second: signal.Signals) -> None:
    halted = asyncio.Event()

    async def drain() -> None:  # as the service's: it ends once halted
        await halted.wait()

    server = DrainingServer(uvicorn.Config(_app, timeout_graceful_shutdown=31), drain, halted.set)
    server._loop = asyncio.get_running_loop()  # as ``serve`` sets it
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.sleep(0.05)
    assert server._draining is not None and not server._draining.done()
    server.handle_exit(second, None)
    async with asyncio.timeout(5):
        await server._draining  # the drain the first signal began, ended by the halt
    assert server.should_exit
    assert server.config.timeout_graceful_shutdown == 0, "the drain's end gave open requests seconds again"
