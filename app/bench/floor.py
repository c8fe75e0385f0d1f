"""``ai-backend floor``: the service behind the least HTTP it could have, for the ratio's ladder.

A reference point, not a server to deploy: httptools parses each request, ``json.loads`` reads
the body's ``image_base64``, the same ``InferenceService`` (same settings, ``AI_SERVICE_*``)
predicts, and a fixed-format JSON answer goes back. No request ids, no metrics, no access
log, no validation beyond what the service does, no error envelope: a failed prediction
closes the connection. Loopback only.

Side by side with ``ai-backend core`` (no HTTP at all) and ``ai-backend serve`` (the real
thing), it tells what HTTP itself costs on this machine and what the serving layers on top
of it cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from typing import cast

import httptools

from app.bench.core import predict_plain
from app.bench.loadgen.drive import event_loop_run
from app.bench.loadgen.target import is_loopback
from app.service import InferenceService
from app.settings import SettingsError, load_settings

log = logging.getLogger(__name__)


class FloorProtocol(asyncio.Protocol):
    """One connection: requests parsed by httptools, answered in order, one at a time."""

    def __init__(self, service: InferenceService, tasks: set[asyncio.Task[None]]) -> None:
        self.service = service
        self.tasks = tasks
        self.max_body = service.settings.server.max_body_bytes
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not asyncio's class

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._close()

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > self.max_body:  # the service's own limit, before any more is kept
            self._close()
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body, self.body_bytes = b"".join(self.body), [], 0
        if self.transport is None or self.transport.is_closing():
            return
        if self.task is not None:  # pipelined behind a prediction: not what this reference serves
            self._close()
            return
        if self.parser.get_method() != b"POST":  # /readyz and the like: ready or not
            ready = self.service.ready  # the body says what the status says, as /readyz does
            self._write(200 if ready else 503, b'{"status": "ready"}' if ready else b'{"status": "not_ready"}')
            return
        self.transport.pause_reading()  # one request at a time per connection
        self.task = asyncio.get_running_loop().create_task(self._predict(body))
        self.tasks.add(self.task)
        self.task.add_done_callback(self.tasks.discard)

    async def _predict(self, body: bytes) -> None:
        try:
            outcome = await predict_plain(self.service, json.loads(body)["image_base64"], "")
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("floor: a prediction failed; closing its connection")
            self._close()
            return
        top = outcome.predictions[0]
        answer = {
            "label": top.label,
            "probability": top.probability,
            "lane": "normal",
            "batch_size": outcome.batch_size,
        }
        self._write(200, json.dumps(answer).encode())
        self.task = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _write(self, status: int, body: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        head = f"HTTP/1.1 {status} {'OK' if status == 200 else 'Service Unavailable'}\r\n"
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        self.transport.write(head.encode("latin-1") + body)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def serve(host: str, port: int) -> None:
    """Start the service, listen on ``host:port`` until SIGINT or SIGTERM, then close both."""
    service = InferenceService(load_settings())
    tasks: set[asyncio.Task[None]] = set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
        server = await loop.create_server(lambda: FloorProtocol(service, tasks), host, port, backlog=2048)
        bound = server.sockets[0].getsockname()[1]  # port 0 is any free one: this says which
        print(f"ai-backend floor: listening on http://{host}:{bound}", file=sys.stderr, flush=True)
        try:
            await stop.wait()
        finally:
            server.close()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await server.wait_closed()
    finally:  # whatever failed, the service's threads go: they would keep the process alive
        await service.close(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ai-backend floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="a loopback address")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    if not is_loopback(f"http://{args.host}:{args.port}"):
        parser.error("--host must be a loopback address")
    if not 0 <= args.port <= 65535:
        parser.error("--port must be 0-65535")
    try:
        event_loop_run(serve(args.host, args.port))
    except SettingsError as exc:
        print(f"ai-backend floor: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, ValueError) as exc:  # the port in use, a missing repository
        print(f"ai-backend floor: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
