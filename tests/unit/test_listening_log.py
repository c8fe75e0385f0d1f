"""``DrainingServer``'s start-up line saying where it listens: started on port 0, only its log
can tell a client (or an end-to-end test) which port that is."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from app.server import DrainingServer
from app.telemetry.logging import JsonFormatter


async def _app(scope: Scope, receive: Receive, send: Send) -> None:  # never served
    raise AssertionError("not called")


async def _drain() -> None:
    return


async def test_a_server_started_on_port_0_logs_the_port_it_bound(caplog: pytest.LogCaptureFixture) -> None:
    config = uvicorn.Config(_app, host="127.0.0.1", port=0, lifespan="off", log_config=None)
    server = DrainingServer(config, _drain)
    with caplog.at_level(logging.INFO, logger="app.server"):
        serving = asyncio.create_task(server.serve())
        try:
            async with asyncio.timeout(10):
                while not server.started:  # noqa: ASYNC110 (uvicorn has no event for it)
                    await asyncio.sleep(0.01)
            (bound,) = [listener.getsockname()[1] for listening in server.servers for listener in listening.sockets]
            (record,) = [r for r in caplog.records if r.name == "app.server"]
            line = json.loads(JsonFormatter().format(record))
            assert (line["host"], line["port"]) == ("127.0.0.1", bound) and bound != 0, line
            assert line["message"] == f"listening on http://127.0.0.1:{bound}"
            with socket.create_connection(("127.0.0.1", line["port"]), timeout=5):
                pass  # the port logged is the one listening
        finally:
            server.should_exit = True
            await serving
