"""A request ends at its deadline or when its client goes, at every stage before its answer:
while its body arrives, while its image waits to be decoded, and after its batch formed while
the batch waits for the device.
It is answered once, gives its seat back, is never computed, and is counted."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from starlette.types import Message

from app.batching import Lane
from app.telemetry.logging import JsonFormatter, RequestIdFilter
from tests.conftest import SettingsFactory
from tests.faults import Faulty
from tests.integration.test_metrics import scrape, total, value
from tests.support import MODEL_NAME, RunningApp, running_app, sample_png

PNG = sample_png(7)


class Connection:
    """One request to the app driven by hand: what its client sends, and what it gets."""

    def __init__(self, running: RunningApp, headers: dict[str, str], state: dict[str, Any] | None = None) -> None:
        """``state``: the request's state as the server (or the edge) left it; the app is then
        called itself, not through the harness's wrapper, which gives each request its own."""
        assert running.asgi is not None
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.sent: list[Message] = []
        self.answered = asyncio.Event()
        raw = [(b"host", b"testserver"), *((k.lower().encode(), v.encode()) for k, v in headers.items())]
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/predict",
            "raw_path": b"/predict",
            "query_string": b"",
            "root_path": "",
            "headers": raw,
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
        }
        if state is not None:
            scope["state"] = state
        app = running.asgi if state is None else running.app
        self.task = asyncio.ensure_future(app(scope, self.inbox.get, self._send))

    async def _send(self, message: Message) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.answered.set()

    def body(self, chunk: bytes, more: bool) -> None:
        self.inbox.put_nowait({"type": "http.request", "body": chunk, "more_body": more})

    def disconnect(self) -> None:
        self.inbox.put_nowait({"type": "http.disconnect"})

    async def answer(self) -> tuple[int, dict[str, Any]]:
        await asyncio.wait_for(self.answered.wait(), 30)  # a bound against a hang, not a timing
        status = next(m["status"] for m in self.sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        return status, json.loads(body)

    async def sent_nothing(self) -> bool:
        """Once its task ended: the app sent nothing (its client went: nobody would read it)."""
        await asyncio.wait_for(self.task, 30)  # a bound against a hang, not a timing
        return self.sent == []


def png_request(running: RunningApp, **headers: str) -> Connection:
    return Connection(running, {"content-type": "image/png", "content-length": str(len(PNG)), **headers})


@asynccontextmanager
async def device_held(running: RunningApp) -> AsyncIterator[None]:
    """Every device thread busy (as with a model loading, or another model's batches)."""
    gate = threading.Event()
    for _ in range(running.service.threads.workers + running.service.threads.urgent):
        running.service._device_thread.submit(gate.wait)
    try:
        yield
    finally:
        gate.set()


async def batch_formed(running: RunningApp, count: int = 1) -> None:
    batcher = running.service.models[MODEL_NAME].batcher
    async with asyncio.timeout(30):
        while batcher.batches < count:  # noqa: ASYNC110 (no event says a batch left)
            await asyncio.sleep(0.005)


async def batches_done(running: RunningApp) -> None:
    batcher = running.service.models[MODEL_NAME].batcher
    async with asyncio.timeout(30):
        while batcher._in_flight:  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def test_a_stalled_body_is_answered_at_its_deadline_and_its_seat_given_back(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(batching={"normal": {"window_ms": 5.0, "max_batch": 2, "max_queue": 2}})
    async with running_app(settings) as running:
        # two uploads that stop after their first bytes: as many as the lane has seats
        stalled = [png_request(running, **{"x-request-timeout": "200"}) for _ in range(2)]
        for connection in stalled:
            connection.body(PNG[:10], more=True)
        for connection in stalled:
            status, body = await connection.answer()  # the rest of the body never comes
            assert (status, body["code"]) == (503, "deadline_exceeded")
            assert "body was arriving" in body["message"]
        ok = await running.predict_png(PNG)
        assert ok.status_code == 200, "the stalled requests gave their seats back"
        counted = await scrape(running)
        assert total(counted, "ai_backend_cancellations_total", reason="deadline") == 2
        for connection in stalled:
            connection.disconnect()
            await asyncio.wait_for(connection.task, 30)


async def test_uploads_that_stall_hold_no_seat_in_the_lane(make_settings: SettingsFactory) -> None:
    """A seat is taken when the body is whole: a client that opens as many uploads as the lane
    has seats and stalls them must not turn everyone else away (503 queue_full) until their
    deadlines pass."""
    settings = make_settings(
        server={"default_timeout_ms": 60_000}, batching={"normal": {"window_ms": 5.0, "max_batch": 2, "max_queue": 2}}
    )
    async with running_app(settings) as running:
        batcher = running.service.models[MODEL_NAME].batcher
        stalled = [png_request(running) for _ in range(3)]
        for connection in stalled:
            connection.body(PNG[:10], more=True)
        async with asyncio.timeout(30):
            while batcher.intake._arriving != 3:  # noqa: ASYNC110 (admitted, their bodies on the way)
                await asyncio.sleep(0.005)
        assert batcher.depth(Lane.NORMAL) == 0, "a body on its way holds no seat"
        answers = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in (1, 2)))
        assert [a.status_code for a in answers] == [200, 200]
        assert not any(c.answered.is_set() for c in stalled)
        for connection in stalled:
            connection.disconnect()
            assert await connection.sent_nothing()
        assert batcher.intake._arriving == 0
        counted = await scrape(running)
        assert value(counted, "ai_backend_cancellations_total", reason="cancelled") == 3
        assert total(counted, "ai_backend_rejections_total", reason="queue_full") == 0


async def test_a_body_that_comes_during_the_drain_is_served(make_settings: SettingsFactory) -> None:
    """Admitted before the drain began, a request whose body was still arriving is served if its
    body comes within the grace, as one queued is: the drain waits for it."""
    settings = make_settings(server={"default_timeout_ms": 60_000})
    async with running_app(settings) as running:
        connection = png_request(running, **{"x-request-id": "late-body"})
        connection.body(PNG[:10], more=True)
        batcher = running.service.models[MODEL_NAME].batcher
        async with asyncio.timeout(30):
            while batcher.intake._arriving != 1:  # noqa: ASYNC110 (admitted, its body on the way)
                await asyncio.sleep(0.005)
        drained = asyncio.ensure_future(running.service.drain(30))
        async with asyncio.timeout(30):
            while not running.service.draining:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
        refused = await running.predict_png(PNG)
        assert (refused.status_code, refused.json()["code"]) == (503, "draining"), "new work is refused"
        connection.body(PNG[10:], more=False)
        status, body = await connection.answer()
        assert status == 200 and body["request_id"] == "late-body"
        await asyncio.wait_for(drained, 30)
        assert not batcher.running


async def test_a_client_gone_while_its_body_arrives_is_a_499_not_a_500(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings()) as running:
        connection = png_request(running)
        connection.body(PNG[:10], more=True)
        connection.disconnect()
        assert await connection.sent_nothing()
        samples = await scrape(running)
        assert value(samples, "ai_backend_requests_total", status="499", code="client_closed_request") == 1
        assert value(samples, "ai_backend_requests_total", status="500", code="internal_error") == 0
        assert value(samples, "ai_backend_cancellations_total", reason="cancelled") == 1
        assert (await running.predict_png(PNG)).status_code == 200


async def test_a_client_gone_while_its_image_waits_to_be_decoded_is_not_computed(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(server={"default_timeout_ms": 60_000})
    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        spy = Faulty(served.model)
        served.runner.model = spy  # type: ignore[assignment]
        pool = running.service._pool
        gate = threading.Event()
        for _ in range(pool.workers):  # every decode thread busy
            pool.submit(gate.wait)
        try:
            connection = png_request(running)
            connection.body(PNG, more=False)
            async with asyncio.timeout(30):
                while not any(pool._queues):  # noqa: ASYNC110 (no event says a decode was queued)
                    await asyncio.sleep(0.005)
            connection.disconnect()
            assert await connection.sent_nothing()
        finally:
            gate.set()
        assert (await running.predict_png(PNG)).status_code == 200, "its seat was given back"
        assert spy.sizes == [1], "only the request that stayed reached the model"
        samples = await scrape(running)
        assert value(samples, "ai_backend_cancellations_total", reason="cancelled") == 1
        assert value(samples, "ai_backend_cancellations_total", reason="deadline") == 0


async def test_a_client_gone_after_its_batch_formed_is_not_computed(make_settings: SettingsFactory) -> None:
    settings = make_settings(server={"default_timeout_ms": 60_000})
    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        spy = Faulty(served.model)  # fails nothing: records the batches that reach the model
        served.runner.model = spy  # type: ignore[assignment]
        async with device_held(running):
            connection = png_request(running)
            connection.body(PNG, more=False)
            await batch_formed(running)  # its batch waits for a device thread
            connection.disconnect()
            assert await connection.sent_nothing()
        await batches_done(running)
        assert spy.sizes == [], "the batch reached the device with nobody left to answer"
        samples = await scrape(running)
        assert value(samples, "ai_backend_cancellations_total", reason="cancelled") == 1


async def test_a_deadline_passed_while_the_batch_waits_for_the_device_is_counted(
    make_settings: SettingsFactory,
) -> None:
    async with running_app(make_settings()) as running:
        served = running.service.models[MODEL_NAME]
        spy = Faulty(served.model)
        served.runner.model = spy  # type: ignore[assignment]
        async with device_held(running):
            late = asyncio.ensure_future(running.predict_png(PNG, headers={"X-Request-Timeout": "300"}))
            await batch_formed(running)
            answer = await late  # answered at its deadline, by the batcher's timer
            assert answer.status_code == 503 and answer.json()["code"] == "deadline_exceeded"
        await batches_done(running)
        assert spy.sizes == []
        samples = await scrape(running)
        assert value(samples, "ai_backend_cancellations_total", reason="deadline") == 1
        assert served.batcher.depth(Lane.NORMAL) == 0


async def test_a_request_cancelled_before_its_answer_is_not_counted_ok(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn cancels the request tasks still running when its graceful-shutdown timeout ends.
    Such a request was never answered: it must not be counted as a success, and its access line
    gives the code it is counted under."""
    settings = make_settings(server={"default_timeout_ms": 60_000}, logging={"access_log": True})
    caplog.handler.addFilter(RequestIdFilter())
    async with running_app(settings) as running:
        async with device_held(running):
            connection = png_request(running, **{"x-request-id": "cut-1"})
            connection.body(sample_png(7), more=False)
            await batch_formed(running)
            with caplog.at_level(logging.INFO, logger="app.access"):
                connection.task.cancel()
                await asyncio.gather(connection.task, return_exceptions=True)
            # its line, not the scrape's below (logged too where an earlier test left app.access at INFO)
            logged = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == "app.access"]
        counted = await scrape(running)
    unanswered = {labels: v for (name, labels), v in counted.items() if name == "ai_backend_requests_total"}
    assert value(counted, "ai_backend_requests_total", status="0", code="ok") == 0, unanswered
    assert value(counted, "ai_backend_requests_total", status="0", code="unanswered") == 1, unanswered
    (line,) = logged
    assert (line["request_id"], line["status"], line.get("code")) == ("cut-1", 0, "unanswered")


async def test_a_request_cut_off_after_the_drain_gets_503_draining_not_a_500(make_settings: SettingsFactory) -> None:
    """A stalled upload outlives the drain; uvicorn's wait after it ends by cancelling the
    request's task. Its client gets the 503 the drain promises."""
    settings = make_settings(server={"default_timeout_ms": 60_000})
    async with running_app(settings) as running:
        connection = png_request(running, **{"x-request-id": "stalled-1"})
        connection.body(PNG[:10], more=True)  # the rest never comes
        batcher = running.service.models[MODEL_NAME].batcher
        async with asyncio.timeout(30):
            while batcher.intake._arriving != 1:  # noqa: ASYNC110 (admitted, its body on the way)
                await asyncio.sleep(0.005)
        await running.service.drain(0.2)  # the grace ends with it still waiting for its body
        assert not connection.answered.is_set()
        connection.task.cancel()  # as uvicorn does once its own wait is over
        status, body = await connection.answer()
        (ended,) = await asyncio.gather(connection.task, return_exceptions=True)
        # answered, the app returns: a CancelledError raised on had uvicorn log a traceback
        # ("Exception in ASGI application") for what is a client's stalled upload
        assert ended is None
        assert (status, body) == (503, {"code": "draining", "message": body["message"], "request_id": "stalled-1"})
        start = next(m for m in connection.sent if m["type"] == "http.response.start")
        assert dict(start["headers"])[b"retry-after"] and dict(start["headers"])[b"connection"] == b"close"
        counted = await scrape(running)
    assert value(counted, "ai_backend_requests_total", status="503", code="draining") == 1
