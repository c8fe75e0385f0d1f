"""Overload is refused at the edge: before routing, before the body is read or parsed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from app.batching import Lane
from tests.conftest import SettingsFactory
from tests.support import RunningApp, running_app, sample_png


@asynccontextmanager
async def full_queue(running: RunningApp) -> AsyncIterator[None]:
    """Every decode thread held and two requests admitted behind them: the normal lane is full."""
    service = running.service
    gate = threading.Event()
    for _ in range(service.threads.decode):
        service._pool.submit(gate.wait)
    waiting = [asyncio.ensure_future(running.predict_png(sample_png(d))) for d in (1, 2)]
    batcher = service.models["digits"].batcher
    try:
        async with asyncio.timeout(30):
            while batcher.depth(Lane.NORMAL) < 2:  # noqa: ASYNC110 (no event says "admitted")
                await asyncio.sleep(0.005)
        yield
    finally:
        gate.set()
        assert [r.status_code for r in await asyncio.gather(*waiting)] == [200, 200]


def shed_of(running: RunningApp, path: str, *headers: tuple[bytes, bytes]) -> object:
    from app.api.routes.predict import predict_call
    from app.api.shedding import shed

    scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers), "app": running.app, "state": {}}
    call = predict_call(scope)
    assert call is not None
    return shed(running.app.state, scope, call.name)


SETTINGS = {  # the lane is filled by holding the decode threads: images decoded in a pool of their own
    "server": {"default_timeout_ms": 60_000, "decode": "pool"},
    "batching": {"normal": {"window_ms": 5.0, "max_batch": 2, "max_queue": 2}},
}


async def test_a_full_lane_refuses_before_the_body_is_even_parsed(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings(**SETTINGS)) as running, full_queue(running):
        garbage = await running.client.post(
            "/predict", content=b"{not json", headers={"Content-Type": "application/json", "X-Request-ID": "shed-1"}
        )
        assert garbage.status_code == 503, "refused before the body was read: its JSON was never looked at"
        assert garbage.json() == {
            "code": "queue_full",
            "message": "the normal queue is full",
            "request_id": "shed-1",
        }
        assert garbage.headers["Retry-After"] == "1" and garbage.headers["x-request-id"] == "shed-1"
        named = await running.client.post(
            "/v1/models/digits/predict", content=b"not a png", headers={"Content-Type": "image/png"}
        )
        assert named.status_code == 503 and named.json()["code"] == "queue_full"
        # an empty body, declared so, no retry mends: its 400 comes first
        empty = await running.client.post("/v1/models/digits/predict", headers={"Content-Type": "image/png"})
        assert empty.status_code == 400 and empty.json()["code"] == "empty_body"
        assert shed_of(running, "/predict", (b"x-urgency", b"high")) is None, "the urgent lane has room of its own"
        # what the edge does not refuse still gets the route's answer
        unknown = await running.client.post(
            "/v1/models/nope/predict", content=b"x", headers={"Content-Type": "image/png"}
        )
        assert unknown.status_code == 404
        bad_header = await running.predict_png(sample_png(8), headers={"X-Urgency": "soon"})
        assert bad_header.status_code == 400 and bad_header.json()["code"] == "invalid_header"
        metrics = (await running.client.get("/metrics")).text
    assert 'route="/predict",status="503"' in metrics
    assert 'route="/v1/models/{name}/predict",status="503"' in metrics


async def test_with_an_api_key_credentials_are_checked_before_any_refusal(make_settings: SettingsFactory) -> None:
    key = "k" * 24
    settings = make_settings(batching=SETTINGS["batching"], server={**SETTINGS["server"], "api_key": key})
    async with running_app(settings) as running:
        auth = {"Authorization": f"Bearer {key}"}
        service = running.service
        gate = threading.Event()
        for _ in range(service.threads.decode):
            service._pool.submit(gate.wait)
        waiting = [asyncio.ensure_future(running.predict_png(sample_png(d), headers=auth)) for d in (1, 2)]
        try:
            async with asyncio.timeout(30):
                while service.models["digits"].batcher.depth(Lane.NORMAL) < 2:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
            anonymous = await running.predict_png(sample_png(3))
            assert anonymous.status_code == 401
            known = await running.predict_png(sample_png(3), headers=auth)
            assert known.status_code == 503 and known.json()["code"] == "queue_full"
        finally:
            gate.set()
        assert [r.status_code for r in await asyncio.gather(*waiting)] == [200, 200]
