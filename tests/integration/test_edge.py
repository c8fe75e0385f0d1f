"""Refusals answered by the HTTP protocol: the real uvicorn server on a loopback port, the real app.

The edge (``app.api.edge``) writes a refusal itself the moment a prediction's headers are
parsed. Each test counts the requests that reach the ASGI app, so it fails if the edge never
engages, and compares the edge's answers with the app's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.types import Receive, Scope, Send

from app.api.edge import edge_protocol
from app.api.shedding import shed
from app.bench.rawhttp import ResponseHead, build_request, read_response
from app.connection import ClosingProtocol
from app.main import create_app
from app.service import InferenceService
from app.settings import Settings
from app.telemetry.logging import RequestIdFilter
from app.telemetry.metrics import PREFIX
from tests.conftest import SettingsFactory
from tests.support import cyclic_garbage, metric_samples, sample_png

# windows longer than the short deadlines these tests send: the predicted wait refuses them on an idle lane
WINDOWS = {"batching": {"urgent": {"window_ms": 100.0}, "normal": {"window_ms": 200.0}}}


@dataclass
class Served:
    """The app behind a real uvicorn server, and the requests that reached the app."""

    app: FastAPI
    port: int
    reached: list[str] = field(default_factory=list)
    server: uvicorn.Server | None = None

    @property
    def service(self) -> InferenceService:
        service: InferenceService = self.app.state.service
        return service

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def exchange(self, *requests: bytes) -> list[tuple[ResponseHead, bytes]]:
        """Send ``requests`` on one new connection, all at once (pipelined), and read their answers."""
        reader, writer = await self.connect()
        try:
            writer.write(b"".join(requests))
            return [await read_response(reader) for _ in requests]
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def served(
    settings: Settings, span_exporter: SpanExporter | None = None, root_path: str = ""
) -> AsyncIterator[Served]:
    """``create_app(settings)`` served by uvicorn with the edge protocol, as ``ai-backend serve`` does
    (``span_exporter`` in place of the configured one; ``root_path``: uvicorn's ``--root-path``)."""
    app = create_app(settings, span_exporter=span_exporter)
    # bound here and handed to uvicorn: a port picked free and bound later could be taken in between
    listener = socket.create_server(("127.0.0.1", 0))
    result = Served(app, listener.getsockname()[1])

    async def counting(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            result.reached.append(f"{scope['method']} {scope['path']}")
        await app(scope, receive, send)

    config = uvicorn.Config(
        counting,
        log_config=None,
        access_log=False,
        http=edge_protocol(app),
        ws="none",  # as ``ai-backend serve``
        timeout_graceful_shutdown=10,  # as ``ai-backend serve`` (grace + 1): an open connection cannot hang a test
        timeout_keep_alive=60,  # longer than any test waits: only the server's own rules close an idle connection
        root_path=root_path,
    )
    server = result.server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        async with asyncio.timeout(60):
            while not server.started:  # noqa: ASYNC110 (uvicorn has no event for it)
                await asyncio.sleep(0.01)
            await asyncio.shield(app.state.starting)
        yield result
    finally:
        server.should_exit = True
        with listener:  # uvicorn's shutdown closes it too, but only once it started
            await serving


def predict(
    path: str = "/predict", body: bytes | None = None, content_type: str = "image/png", **headers: str
) -> bytes:
    """A prediction request as bytes; header names in ``headers`` use ``_`` for ``-``."""
    sent = {"Content-Type": content_type, **{name.replace("_", "-"): value for name, value in headers.items()}}
    return build_request("POST", "127.0.0.1", path, sent, sample_png(3) if body is None else body)


def comparable(head: ResponseHead) -> dict[str, str]:
    """The headers that must match between two answers (the date moves)."""
    return {name: value for name, value in head.headers.items() if name != "date"}


SETTINGS: dict[str, Any] = {"logging": {"access_log": True}}


@pytest.mark.usefixtures("no_hurry")
async def test_a_refusal_is_answered_by_the_protocol_exactly_as_the_app_answers_it(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.handler.addFilter(RequestIdFilter())
    # windows longer than the deadline (90 ms), and no request hurrying (a lane's window closing
    # early for it, ``no_hurry``): the predicted wait refuses every such request on an idle lane,
    # and a deadline no busy machine passes on the way to the app's check: with 1 ms, the app's
    # path, slower than the edge's, could find it already past (deadline_exceeded)
    async with served(make_settings(**SETTINGS, **WINDOWS)) as running:
        ((warm, _),) = await running.exchange(predict())
        assert warm.status == 200 and running.reached == ["POST /predict"], "a prediction reaches the app"
        late = {"X_Request_Timeout": "90", "X_Request_ID": "edge-late-1"}
        requests = [
            predict(**late),
            predict("/v1/models/digits/predict", **late),
            predict(body=b"{not json", content_type="application/json", X_Urgency="high", **late),
        ]
        with caplog.at_level(logging.INFO, logger="app.access"):
            at_edge = await running.exchange(*requests)
            assert running.reached == ["POST /predict"], "refused without reaching the app"
            running.app.state.tracing = True  # the edge stands aside: the app answers the same requests
            by_app = await running.exchange(*requests)
        assert running.reached[1:] == ["POST /predict", "POST /v1/models/digits/predict", "POST /predict"]
        metrics = (await running.exchange(build_request("GET", "127.0.0.1", "/metrics", {})))[0][1].decode()
    for (edge_head, edge_body), (app_head, app_body) in zip(at_edge, by_app, strict=True):
        assert edge_head.status == app_head.status == 503
        assert edge_body == app_body, "the same envelope, byte for byte"
        assert comparable(edge_head) == comparable(app_head)
        assert edge_head.keep_alive
    assert b'"code":"would_miss_deadline"' in at_edge[0][1] and b'"request_id":"edge-late-1"' in at_edge[0][1]
    assert at_edge[0][0].headers["retry-after"] == "1"
    # the same metrics: each refusal counted once per answer, by route, status and lane
    requests_total = metric_samples(metrics, f"{PREFIX}_requests_total")
    assert requests_total[(("code", "would_miss_deadline"), ("status", "503"))] == 6
    latency = metric_samples(metrics, f"{PREFIX}_request_duration_seconds_count")
    assert latency[(("lane", "normal"), ("route", "/predict"), ("status", "503"))] == 2
    assert latency[(("lane", "normal"), ("route", "/v1/models/{name}/predict"), ("status", "503"))] == 2
    assert latency[(("lane", "urgent"), ("route", "/predict"), ("status", "503"))] == 2
    # and the same access lines
    lines = [r for r in caplog.records if r.name == "app.access" and getattr(r, "status", None) == 503]
    assert len(lines) == 6
    fields = [
        (r.request_id, r.method, r.path, r.code, isinstance(r.duration_ms, float))  # type: ignore[attr-defined]
        for r in lines
    ]
    assert fields[:3] == fields[3:]
    assert fields[0] == ("edge-late-1", "POST", "/predict", "would_miss_deadline", True)


@pytest.mark.usefixtures("no_hurry")
async def test_under_a_root_path_the_protocol_refuses_as_at_the_root(make_settings: SettingsFactory) -> None:
    # uvicorn puts its --root-path in front of each request's path, and names it in root_path
    async with served(make_settings(**WINDOWS), root_path="/tight") as running:
        ((warm, _),) = await running.exchange(predict())
        assert warm.status == 200 and running.reached == ["POST /tight/predict"], "a prediction reaches the app"
        late = await running.exchange(
            predict(X_Request_Timeout="90"), predict("/v1/models/digits/predict", X_Request_Timeout="90")
        )
        assert [json.loads(body)["code"] for _, body in late] == ["would_miss_deadline"] * 2
        assert running.reached == ["POST /tight/predict"], "refused without reaching the app"


async def test_a_refused_body_is_dropped_and_the_connection_serves_on(make_settings: SettingsFactory) -> None:
    # a body within the limit (one past it is a 413 before any admission), larger than a socket read
    async with served(make_settings(server={"max_image_bytes": 1 << 20})) as running:
        await running.exchange(predict())
        reader, writer = await running.connect()
        try:
            body = b"x" * 300_000
            head = predict(body=body, X_Request_Timeout="1")[: -len(body)]
            writer.write(head + body[:1000])
            refused, _ = await read_response(reader)  # answered before the body is sent
            assert refused.status == 503 and refused.keep_alive
            for start in range(1000, len(body), 65_536):
                writer.write(body[start : start + 65_536])
                await writer.drain()
            # the next request on the same connection, and a refused one pipelined with an answer
            writer.write(predict() + predict(X_Request_Timeout="1") + predict())
            statuses = [(await read_response(reader))[0].status for _ in range(3)]
            assert statuses == [200, 503, 200]
        finally:
            writer.close()
        assert running.reached == ["POST /predict"] * 3


async def test_a_long_pipeline_of_refusals_is_answered_and_counted_whole(make_settings: SettingsFactory) -> None:
    """Each refusal starts the request pipelined behind it: one after another they must not
    recurse as deep as the pipeline (past Python's recursion limit, requests went unanswered
    and none of the refusals was counted)."""
    async with served(make_settings()) as running:
        await running.exchange(predict())  # a batch timed: a 1 ms deadline is refused at the edge
        refused = 1200  # a stack frame or three each: far past the default limit of 1000
        async with asyncio.timeout(60):  # a bound against the hang of unanswered requests, not a timing
            answers = await running.exchange(predict(), *(predict(X_Request_Timeout="1") for _ in range(refused)))
        assert [head.status for head, _ in answers] == [200] + [503] * refused
        metrics = (await running.exchange(build_request("GET", "127.0.0.1", "/metrics", {})))[0][1].decode()
    requests_total = metric_samples(metrics, f"{PREFIX}_requests_total")
    # 1 ms from each one's first byte: those far down the pipeline are past it when their turn comes
    missed = requests_total[(("code", "would_miss_deadline"), ("status", "503"))]
    assert missed + requests_total.get((("code", "deadline_exceeded"), ("status", "503")), 0) == refused


async def test_a_client_that_waits_for_100_continue_gets_the_refusal_instead(make_settings: SettingsFactory) -> None:
    async with served(make_settings()) as running:
        await running.exchange(predict())
        reader, writer = await running.connect()
        try:
            body = sample_png(3)
            writer.write(predict(X_Request_Timeout="1", Expect="100-continue")[: -len(body)])
            refused, _ = await read_response(reader)
            assert refused.status == 503, "no 100 Continue: the final answer comes first"
            # the client may send its body or not (RFC 9110, 10.1.1): the answer ends the connection,
            # and a body that comes anyway is read and dropped, not answered, until the client closes
            assert refused.headers["connection"] == "close"
            writer.write(body + predict())
            assert await asyncio.wait_for(reader.read(), 10) == b""
        finally:
            writer.close()


async def test_a_closing_client_and_a_draining_service_get_the_refusal_then_the_close(
    make_settings: SettingsFactory,
) -> None:
    async with served(make_settings()) as running:
        await running.exchange(predict())
        # a request pipelined behind a closing answer is not served (RFC 9112, 9.6), refused or not
        for first, status in (
            (predict(X_Request_Timeout="1", Connection="close"), 503),
            (predict(Connection="close"), 200),
        ):
            reader, writer = await running.connect()
            try:
                writer.write(first + predict())
                head, _ = await read_response(reader)
                assert head.status == status and head.headers["connection"] == "close"
                assert await reader.read() == b""
            finally:
                writer.close()
        assert running.reached == ["POST /predict"] * 2
        await running.service.drain(1.0)
        reader, writer = await running.connect()
        try:
            # the refusal sees the request sent behind it in the same write: that one is answered
            # too, and its answer ends the connection
            writer.write(predict() + build_request("GET", "127.0.0.1", "/healthz", {}))
            head, body = await read_response(reader)
            assert head.status == 503 and b'"code":"draining"' in body
            assert int(head.headers["retry-after"]) >= 1 and "connection" not in head.headers
            health, _ = await read_response(reader)
            assert health.status == 503 and health.headers["connection"] == "close"
            assert await reader.read() == b"", "the server closed the connection after the last answer"
        finally:
            writer.close()
        assert running.reached == ["POST /predict"] * 2 + ["GET /healthz"], "the refusal was the edge's"


async def test_with_an_api_key_the_edge_refuses_nothing(make_settings: SettingsFactory) -> None:
    async with served(make_settings(server={"api_key": "k" * 24})) as running:
        ((head, body),) = await running.exchange(predict(X_Request_Timeout="1"))
        assert head.status == 401, "credentials are checked before any refusal"
        assert running.reached == ["POST /predict"]


async def test_what_the_edge_admits_is_not_asked_again_by_the_app(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.api.routes import predict as routes

    asked: list[str | None] = []

    def counting_shed(state: Any, scope: Scope, model: str | None) -> Any:
        asked.append(model)
        return shed(state, scope, model)

    monkeypatch.setattr(routes, "shed", counting_shed)
    async with served(make_settings()) as running:
        assert [head.status for head, _ in await running.exchange(predict(), predict())] == [200, 200]
        assert asked == [], "admitted at the edge: the direct path does not ask again"
        running.app.state.tracing = True  # the edge stands aside: the direct path asks
        assert [head.status for head, _ in await running.exchange(predict())] == [200]
        assert asked == [None]


def test_a_uvicorn_without_the_hook_gets_the_protocol_without_the_edge(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    app = create_app(make_settings())
    assert issubclass(edge_protocol(app), ClosingProtocol) and edge_protocol(app) is not ClosingProtocol
    monkeypatch.delattr(HttpToolsProtocol, "_start_asgi_task")
    with caplog.at_level(logging.WARNING, logger="app.api.edge"):
        assert edge_protocol(app) is ClosingProtocol
    assert "refused by the middleware" in caplog.text


async def test_a_failing_edge_leaves_the_request_to_the_app(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import app.api.edge

    def broken(*args: object) -> None:
        raise RuntimeError("edge bug")

    async with served(make_settings()) as running:
        await running.exchange(predict())
        monkeypatch.setattr(app.api.edge, "shed", broken)
        with caplog.at_level(logging.ERROR, logger="app.api.edge"):
            answers = await running.exchange(predict(), predict(X_Request_Timeout="1"))
        assert [head.status for head, _ in answers] == [200, 503], "each request answered, by the app"
        # its 1 ms ran out behind the prediction pipelined before it, or is too short for a batch
        assert json.loads(answers[1][1])["code"] in ("deadline_exceeded", "would_miss_deadline")
        assert running.reached == ["POST /predict"] * 3
    assert caplog.text.count("the edge failed on POST /predict") == 2


async def test_a_deadline_runs_from_the_requests_first_byte(make_settings: SettingsFactory) -> None:
    """The client's X-Request-Timeout started when it sent the request: a head that took longer
    to arrive than the whole deadline is past it, though the app has only just seen it (under load
    a request's task also starts well after its bytes came)."""
    async with served(make_settings()) as running:
        await running.exchange(predict())  # a batch timed
        request = predict(X_Request_Timeout="300", X_Request_ID="slow-head")
        reader, writer = await running.connect()
        try:
            writer.write(request[:24])  # the request line has begun
            await asyncio.sleep(0.5)  # its head is still on the way when its deadline passes
            writer.write(request[24:])
            head, body = await read_response(reader)
        finally:
            writer.close()
        metrics = (await running.exchange(build_request("GET", "127.0.0.1", "/metrics", {})))[0][1].decode()
    assert head.status == 503 and json.loads(body)["code"] == "deadline_exceeded", body
    assert head.headers["x-request-id"] == "slow-head"
    refused = [
        seconds
        for labels, seconds in metric_samples(metrics, f"{PREFIX}_request_duration_seconds_sum").items()
        if ("status", "503") in labels
    ]
    assert refused and refused[0] >= 0.5, refused  # timed from the first byte too


@pytest.mark.usefixtures("no_hurry")  # the window refuses: see the test above
@pytest.mark.parametrize("by", ["edge", "app"])
async def test_refusals_leave_nothing_for_the_cycle_collector(make_settings: SettingsFactory, by: str) -> None:
    """At twice the load refusals outnumber answers; each must be freed when it is answered. A
    refusal kept with its traceback tied the frames that made it into a reference cycle, left
    for the cyclic collector, whose passes then held the GIL for tens of milliseconds at a time."""
    async with served(make_settings(**WINDOWS)) as running:
        await running.exchange(predict())
        running.app.state.tracing = by == "app"  # with spans exported, the app's direct path refuses
        refusals = [predict(X_Request_Timeout="150") for _ in range(20)]
        await running.exchange(*refusals)  # whatever a first refusal warms up
        with cyclic_garbage() as left:
            answers = await running.exchange(*refusals)
    assert {json.loads(body)["code"] for _, body in answers} == {"would_miss_deadline"}
    assert not left.keys() & {"WouldMissDeadline", "frame", "traceback", "Request"}, left
    # a closed connection's protocol and its last request hold each other: one for the connection, not one each
    assert left["RequestResponseCycle"] <= 1, left


async def test_a_flood_of_refusals_logs_its_cap_and_sums_up_the_rest(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """At most ``logging.refusal_lines_per_s`` access lines a second for 503s; every other one is in
    a summary line (the last one written as the service closes), and in the metrics as always."""
    caplog.handler.addFilter(RequestIdFilter())
    settings = make_settings(logging={"access_log": True, "refusal_lines_per_s": 5})
    refused = 60
    with caplog.at_level(logging.INFO, logger="app.access"):
        async with served(settings) as running:
            await running.exchange(predict())  # a batch timed: a 1 ms deadline is refused at the edge
            answers = await running.exchange(*(predict(X_Request_Timeout="1") for _ in range(refused)), predict())
            metrics = (await running.exchange(build_request("GET", "127.0.0.1", "/metrics", {})))[0][1].decode()
    assert [head.status for head, _ in answers] == [503] * refused + [200]
    lines = [r for r in caplog.records if r.name == "app.access"]
    summaries = [r for r in caplog.records if r.name == "app.access.unlogged"]
    logged = sum(1 for r in lines if getattr(r, "status", None) == 503)
    unlogged = sum(r.unlogged_503 for r in summaries)
    assert 5 <= logged < refused and logged + unlogged == refused
    assert summaries and all(r.request_id is None for r in summaries), "a summary is no request's line"
    assert sum(1 for r in lines if getattr(r, "status", None) == 200) == 3  # both predictions and the scrape
    requests_total = metric_samples(metrics, f"{PREFIX}_requests_total")
    assert sum(n for labels, n in requests_total.items() if ("status", "503") in labels) == refused


async def test_a_body_declared_over_the_limit_is_a_413_though_admission_would_refuse_it(
    make_settings: SettingsFactory,
) -> None:
    """The client's mistake first: a retry after a 503 would meet the 413 anyway. The declared
    length is judged before admission, at the edge and at the route alike."""
    async with served(make_settings(server={"max_image_bytes": 1 << 20})) as running:
        await running.exchange(predict())  # a batch timed: a 1 ms deadline is refused at admission
        (late, _), (big, body) = await running.exchange(
            predict(X_Request_Timeout="1"),
            predict(body=b"x" * (2 << 20), X_Request_Timeout="1"),
        )
        assert late.status == 503
        assert big.status == 413 and json.loads(body)["code"] == "image_too_large"


async def test_a_request_pipelined_behind_a_refusal_that_ends_the_connection_is_not_served(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A refusal to a client waiting for 100 Continue ends the connection; a request pipelined
    behind it in the same read was parsed on, admitted and computed for nobody, its answer
    written after the end of the stream (an ERROR from uvloop, a 200 in the access log)."""
    async with served(make_settings()) as running:
        await running.exchange(predict())  # a batch timed: a 1 ms deadline is refused at admission
        reader, writer = await running.connect()
        try:
            writer.write(predict(X_Request_Timeout="1", Expect="100-continue") + predict(X_Request_ID="behind"))
            refused, _ = await read_response(reader)
            assert refused.status == 503 and refused.headers["connection"] == "close"
            assert await asyncio.wait_for(reader.read(), 10) == b"", "nothing after the refusal"
        finally:
            writer.close()
        await asyncio.sleep(0.2)
        assert running.reached == ["POST /predict"], "the one behind never reached the app"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "nothing written after the end"


async def test_a_request_waiting_for_100_continue_behind_another_is_served_on_the_same_connection(
    make_settings: SettingsFactory,
) -> None:
    """The 100-continue close is for the request answered before its body came, not for the one
    answered while another waits for its 100 Continue behind it (that one was lost, as a 499)."""
    body = sample_png(3)
    waiting = predict(X_Request_ID="waiting", Expect="100-continue")[: -len(body)]
    async with served(make_settings()) as running:
        reader, writer = await running.connect()
        try:
            writer.write(predict(X_Request_ID="first") + waiting)
            first, _ = await read_response(reader)
            assert first.status == 200 and first.headers.get("connection") != "close"
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert interim.startswith(b"HTTP/1.1 100 Continue")
            writer.write(body)
            second, _ = await read_response(reader)
            assert second.status == 200 and second.headers["x-request-id"] == "waiting"
        finally:
            writer.close()
