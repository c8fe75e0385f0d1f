"""The server span of a request whose client went: no HTTP status, since none was sent.

The 499 is nginx's convention for the access log and the requests metric; on the span it read
as an answer the client got. OpenTelemetry's HTTP conventions record ``http.response.status_code``
(``http.status_code`` before them) only where a status was sent, and ``error.type`` for a request
that ended before one was.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from app.batching import Lane
from app.bench.rawhttp import build_request
from app.telemetry.logging import RequestIdFilter
from app.telemetry.metrics import PREFIX
from tests.conftest import SettingsFactory
from tests.integration.test_edge import predict, served
from tests.support import metric_samples, wait_queued

STATUS_ATTRIBUTES = ("http.status_code", "http.response.status_code")


async def _server_span(exporter: InMemorySpanExporter, request_id: str) -> ReadableSpan:
    """The request's server span, once it has ended (bounded)."""
    async with asyncio.timeout(30):
        while True:
            spans = [
                s
                for s in exporter.get_finished_spans()
                if s.kind is SpanKind.SERVER
                and s.attributes is not None
                and s.attributes.get("request.id") == request_id
            ]
            if spans:
                (span,) = spans
                return span
            await asyncio.sleep(0.01)


def _events(span: ReadableSpan) -> Sequence[str]:
    return [event.name for event in span.events]


async def test_a_client_gone_while_queued_leaves_no_status_on_its_server_span(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    exporter = InMemorySpanExporter()
    settings = make_settings(
        telemetry={"exporter": "console"},
        logging={"access_log": True},
        server={"default_timeout_ms": 60_000},
        batching={"normal": {"window_ms": 20_000.0}},  # it waits in its lane until its client goes
    )
    caplog.set_level("INFO", logger="app.access")
    caplog.handler.addFilter(RequestIdFilter())
    async with served(settings, span_exporter=exporter) as running:
        _, writer = await running.connect()
        try:
            writer.write(predict(X_Request_ID="gone-queued"))
            await writer.drain()
            await wait_queued(running, Lane.NORMAL, 1)  # type: ignore[arg-type]
        finally:
            writer.close()
        server = await _server_span(exporter, "gone-queued")
        ((_, metrics),) = await running.exchange(build_request("GET", "127.0.0.1", "/metrics", {}))
    for name in STATUS_ATTRIBUTES:
        assert name not in server.attributes, f"{name}: no status was sent"  # type: ignore[operator]
    assert server.attributes["error.type"] == "client_closed_request"  # type: ignore[index]
    assert server.attributes["error.code"] == "client_closed_request"  # type: ignore[index]
    assert server.status.status_code is StatusCode.UNSET, "a client leaving is no failure of the service"
    (queue,) = [
        s
        for s in exporter.get_finished_spans()
        if s.name == "queue" and s.attributes.get("request.id") == "gone-queued"
    ]
    assert _events(queue) == ["client went"]
    # the access log and the metrics keep nginx's 499
    logged = [r for r in caplog.records if r.name == "app.access" and r.request_id == "gone-queued"]  # type: ignore[attr-defined]
    assert [r.status for r in logged] == [499]  # type: ignore[attr-defined]
    counted = metric_samples(metrics.decode(), f"{PREFIX}_requests_total")
    assert counted[(("code", "client_closed_request"), ("status", "499"))] == 1


async def test_a_client_gone_while_its_body_arrived_leaves_no_status_on_its_server_span(
    make_settings: SettingsFactory,
) -> None:
    exporter = InMemorySpanExporter()
    async with served(make_settings(telemetry={"exporter": "console"}), span_exporter=exporter) as running:
        _, writer = await running.connect()
        try:
            writer.write(predict(X_Request_ID="gone-mid-body")[:-100])  # all but the body's last bytes
            await writer.drain()
            await asyncio.sleep(0.2)  # its head read and its app task waiting for the body
        finally:
            writer.close()
        server = await _server_span(exporter, "gone-mid-body")
    for name in STATUS_ATTRIBUTES:
        assert name not in server.attributes, f"{name}: no status was sent"  # type: ignore[operator]
    assert server.attributes["error.type"] == "client_closed_request"  # type: ignore[index]
    # and what it waited for (a gone mid-upload's span said nothing of it)
    assert [(e.name, dict(e.attributes or {})) for e in server.events] == [
        ("client went", {"while": "its body was arriving"})
    ]
    assert server.status.status_code is StatusCode.UNSET
