"""Spans over real OTLP: the server exports to a receiver that this test runs on loopback.

The receiver is an OTLP/HTTP endpoint (``POST /v1/traces``, a protobuf
``ExportTraceServiceRequest``) on ``http.server``; the server is ``python -m app.cli
serve`` with ``AI_SERVICE_TELEMETRY__EXPORTER=otlp_http``. Two servers start together:

- ``periodic`` exports every 100 ms: the spans of each request arrive while it serves,
  carrying the request ids, the stage spans and the batch span linked to the requests.
- ``at_exit`` would wait 10 minutes before an export, so anything the receiver gets before the
  process ends can only come from the flush on SIGTERM.

Every wait is bounded; every process is stopped in ``finally``.
"""

from __future__ import annotations

import asyncio
import gzip
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from tests.e2e.server import HOST, ServerProcess, spawn
from tests.support import sample_png, server_environment

pytestmark = pytest.mark.e2e

SPANS_TIMEOUT_S = 30.0  # the periodic server exports every 100 ms: this only bounds a failure
EXIT_TIMEOUT_S = 60.0
STAGES = ("preprocess", "queue", "inference", "postprocess")
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER
PNG_HEADERS = {"Content-Type": "image/png"}


# --- the receiver ------------------------------------------------------------------------


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    links: tuple[str, ...]  # span ids
    service: str
    arrived: float  # time.monotonic() when its export request came in


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    items: list[KeyValue] = list(pairs)
    return {pair.key: _value(pair.value) for pair in items}


@dataclass
class Receiver:
    """An OTLP/HTTP traces endpoint that keeps every span it is sent."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    exports: int = 0
    changed: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver.add(ExportTraceServiceRequest.FromString(body))
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: object) -> None:
                return None  # quiet: pytest shows the assertions

        self._http = ThreadingHTTPServer((HOST, 0), Handler)
        self._thread = threading.Thread(target=self._http.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self._http.server_address[1]}"

    def add(self, request: ExportTraceServiceRequest) -> None:
        now = time.monotonic()
        received = []
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.kind,
                            _attributes(span.attributes),
                            tuple(link.span_id.hex() for link in span.links),
                            service,
                            now,
                        )
                    )
        with self.changed:
            self.spans.extend(received)
            self.exports += 1
            self.changed.notify_all()

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = SPANS_TIMEOUT_S
    ) -> list[ReceivedSpan]:
        """The spans once ``done(spans)`` holds; fails with what did arrive if it never does."""
        with self.changed:
            if not self.changed.wait_for(lambda: done(self.spans), timeout):
                names = sorted({(s.name, str(s.attributes.get("request.id"))) for s in self.spans})
                pytest.fail(f"spans never arrived; got {len(self.spans)}: {names}")
            return list(self.spans)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=10)


# --- the servers -------------------------------------------------------------------------


@dataclass
class Server(ServerProcess):
    receiver: Receiver


def _spawn(logs: Path, schedule_delay_ms: int) -> Server:
    receiver = Receiver()
    env = server_environment(
        {
            "AI_SERVICE_TELEMETRY__EXPORTER": "otlp_http",
            "AI_SERVICE_TELEMETRY__ENDPOINT": receiver.endpoint,
            "AI_SERVICE_TELEMETRY__SCHEDULE_DELAY_MS": str(schedule_delay_ms),
            "AI_SERVICE_SERVER__SHUTDOWN_GRACE_S": "10",
        },
        drop=("OTEL_",),
    )
    return Server(spawn(logs, env), logs, receiver)


def _stop(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=10)
    server.receiver.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """Both servers, started together so that their torch imports overlap."""
    started: dict[str, Server] = {}
    try:
        for name, delay_ms in (("periodic", 100), ("at_exit", 600_000)):
            started[name] = _spawn(tmp_path_factory.mktemp(name), delay_ms)
        yield started
    finally:
        for server in started.values():
            _stop(server)


def _trace(spans: list[ReceivedSpan], request_id: str) -> tuple[ReceivedSpan, dict[str, ReceivedSpan]]:
    """The request's HTTP server span and its stage spans by name."""
    servers = [s for s in spans if s.kind == SERVER_KIND and s.attributes.get("request.id") == request_id]
    assert len(servers) == 1, (request_id, servers)
    root = servers[0]
    stages = {s.name: s for s in spans if s.parent_span_id == root.span_id and s.name in STAGES}
    return root, stages


def _complete(request_ids: list[str]) -> Callable[[list[ReceivedSpan]], bool]:
    """True once every request has its server span, its four stages, and is named by a batch span."""

    def done(spans: list[ReceivedSpan]) -> bool:
        batched = {rid for s in spans if s.name == "batch" for rid in s.attributes.get("request.ids", [])}
        for rid in request_ids:
            roots = [s for s in spans if s.kind == SERVER_KIND and s.attributes.get("request.id") == rid]
            if len(roots) != 1 or rid not in batched:
                return False
            if {s.name for s in spans if s.parent_span_id == roots[0].span_id} < set(STAGES):
                return False
        return True

    return done


# --- the tests ---------------------------------------------------------------------------


def test_each_request_arrives_as_a_trace_with_its_id_stages_and_batch(servers: dict[str, Server]) -> None:
    server = servers["periodic"]
    server.wait_ready()
    request_ids = [f"otlp-{n}" for n in range(6)]

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/predict",
                        content=sample_png(n),
                        headers={**PNG_HEADERS, "X-Request-ID": rid, "X-Urgency": "high" if n % 3 == 0 else "normal"},
                    )
                    for n, rid in enumerate(request_ids)
                )
            )

    responses = asyncio.run(send_all())
    assert [r.status_code for r in responses] == [200] * len(request_ids), [r.text for r in responses]
    spans = server.receiver.wait_for(_complete(request_ids))
    assert server.process.poll() is None, "the spans came while serving, not at exit"

    batches = [s for s in spans if s.name == "batch"]
    for response, rid in zip(responses, request_ids, strict=True):
        root, stages = _trace(spans, rid)
        assert root.service == "ai-backend"
        assert response.headers["x-trace-id"] == root.trace_id, "X-Trace-Id finds the trace in Jaeger"
        for name in STAGES:
            assert stages[name].trace_id == root.trace_id, name
            assert stages[name].attributes["request.id"] == rid, name
        mine = [b for b in batches if rid in b.attributes["request.ids"]]
        assert len(mine) == 1, (rid, mine)
        assert root.span_id in mine[0].links, "the batch span links to the request's server span"
        assert mine[0].attributes["batch.size"] == len(mine[0].attributes["request.ids"])
    assert "span export failed" not in server.stderr()


def test_an_incoming_traceparent_is_continued_over_otlp(servers: dict[str, Server]) -> None:
    server = servers["periodic"]
    server.wait_ready()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {**PNG_HEADERS, "X-Request-ID": "otlp-parent", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    response = httpx.post(f"{server.url}/predict", content=sample_png(4), headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    spans = server.receiver.wait_for(_complete(["otlp-parent"]))
    root, _ = _trace(spans, "otlp-parent")
    assert root.trace_id == trace_id and root.parent_span_id == "00f067aa0ba902b7"


def test_sigterm_flushes_the_spans_of_the_last_request(servers: dict[str, Server]) -> None:
    server = servers["at_exit"]
    server.wait_ready()
    response = httpx.post(
        f"{server.url}/predict", content=sample_png(9), headers={**PNG_HEADERS, "X-Request-ID": "last"}, timeout=30
    )
    assert response.status_code == 200, response.text
    with server.receiver.changed:
        assert server.receiver.exports == 0, "a 10-minute schedule exported early: this test would prove nothing"
    terminated = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(timeout=EXIT_TIMEOUT_S)
    assert code in (0, -signal.SIGTERM), server.stderr()[-4000:]
    spans = server.receiver.wait_for(_complete(["last"]), timeout=1.0)  # already there: the process is gone
    root, stages = _trace(spans, "last")
    assert root.arrived >= terminated and all(s.arrived >= terminated for s in stages.values())
    assert response.headers["x-trace-id"] == root.trace_id
