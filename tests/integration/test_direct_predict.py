"""The edge serves predictions past FastAPI's router, and answers exactly as the router would.

Each request below goes once to an app whose edge serves the prediction routes itself (the
default) and once to one where ``direct`` claims nothing, so FastAPI routes everything; the
two answers must match in status, body (ids and timings aside) and headers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.types import Receive, Scope, Send

from app.api.routes import predict
from tests.conftest import SettingsFactory
from tests.support import MODEL_NAME, RunningApp, b64, running_app, sample_png

PNG = sample_png(7)
Call = Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]

CALLS: dict[str, Call] = {
    "json": lambda c: c.post("/predict", json={"image_base64": b64(PNG), "top_k": 3}),
    "raw, named": lambda c: c.post(
        f"/v1/models/{MODEL_NAME}/predict", content=PNG, headers={"Content-Type": "image/png"}
    ),
    "urgent": lambda c: c.post("/predict", content=PNG, headers={"Content-Type": "image/png", "X-Urgency": "high"}),
    "bad query": lambda c: c.post("/predict", content=PNG, headers={"Content-Type": "image/png"}, params={"top_k": 0}),
    "top_k over the labels": lambda c: c.post("/predict", json={"image_base64": b64(PNG), "top_k": 11}),
    "bad JSON": lambda c: c.post("/predict", content=b"{nope", headers={"Content-Type": "application/json"}),
    "schema": lambda c: c.post("/predict", json={"image": "x"}),
    "bad base64": lambda c: c.post("/predict", json={"image_base64": "%%%"}),
    "media type": lambda c: c.post("/predict", content=b"x", headers={"Content-Type": "text/plain"}),
    "too large": lambda c: c.post("/predict", content=b"x" * 300_000, headers={"Content-Type": "image/png"}),
    "unknown model": lambda c: c.post("/v1/models/nope/predict", content=PNG, headers={"Content-Type": "image/png"}),
    "unknown version": lambda c: c.post(
        "/predict", content=PNG, headers={"Content-Type": "image/png", "X-Model-Version": "9"}
    ),
    "bad header": lambda c: c.post("/predict", content=PNG, headers={"Content-Type": "image/png", "X-Urgency": "x"}),
    "timeout header": lambda c: c.post(
        "/predict", content=PNG, headers={"Content-Type": "image/png", "X-Request-Timeout": "-5"}
    ),
    "wrong method": lambda c: c.get("/predict"),
    "trailing slash": lambda c: c.post("/predict/", content=PNG, headers={"Content-Type": "image/png"}),
}
VARYING = {"request_id", "timings"}  # differ between any two requests
HEADERS = ("content-type", "retry-after", "allow", "x-request-id")


def _answer(response: httpx.Response) -> tuple[int, Any, dict[str, str | None]]:
    try:
        body = {k: v for k, v in response.json().items() if k not in VARYING}
    except ValueError:
        body = response.text
    headers = {name: response.headers.get(name) for name in HEADERS}
    headers["x-request-id"] = "present" if headers["x-request-id"] else None
    return response.status_code, body, headers


class _RouterCalls:
    """Counts the requests that reach FastAPI's router."""

    def __init__(self, running: RunningApp) -> None:
        self.count = 0
        router = running.app.router
        inner = router.middleware_stack

        async def counting(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                self.count += 1
            await inner(scope, receive, send)

        router.middleware_stack = counting


async def _answers(running: RunningApp) -> dict[str, tuple[int, Any, dict[str, str | None]]]:
    return {name: _answer(await call(running.client)) for name, call in CALLS.items()}


async def test_the_edge_answers_every_prediction_as_the_router_would(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings()
    async with running_app(settings) as running:
        routed = _RouterCalls(running)
        direct = await _answers(running)
    assert routed.count == 2, "only the wrong method and the unmatched path went through the router"
    assert direct["json"][0] == 200 and direct["raw, named"][0] == 200 and direct["urgent"][1]["lane"] == "urgent"

    monkeypatch.setattr(predict, "direct", lambda scope: None)
    async with running_app(settings) as running:
        routed = _RouterCalls(running)
        through_router = await _answers(running)
    assert routed.count == len(CALLS)
    for name in CALLS:
        assert direct[name] == through_router[name], name
    statuses = {name: answer[0] for name, answer in direct.items()}
    assert sorted(set(statuses.values())) == [200, 400, 404, 405, 413, 415, 422], statuses


@pytest.mark.parametrize("routed", [False, True], ids=["direct", "routed"])
async def test_a_bug_is_a_generic_500_with_the_detail_in_the_log_and_serving_goes_on(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, routed: bool
) -> None:
    from app.service import InferenceService

    if routed:
        monkeypatch.setattr(predict, "direct", lambda scope: None)
    real = InferenceService.predict
    calls = 0

    async def buggy(self: InferenceService, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError("secret-internal-detail")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(InferenceService, "predict", buggy)
    exporter = InMemorySpanExporter()
    async with running_app(make_settings(telemetry={"exporter": "console"}), span_exporter=exporter) as running:
        with caplog.at_level(logging.ERROR):
            broken = await running.predict_png(PNG, headers={"X-Request-ID": "bug-1"})
        after = await running.predict_png(PNG)
        metrics = (await running.client.get("/metrics")).text
        running.app.state.tracer_provider.force_flush()
    (server,) = [
        s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER and s.attributes["request.id"] == "bug-1"
    ]
    assert server.status.status_code is StatusCode.ERROR
    assert [e.attributes["exception.type"] for e in server.events if e.name == "exception"] == ["KeyError"], (
        "whoever reads the trace sees what failed"
    )
    assert broken.status_code == 500
    assert broken.json() == {"code": "internal_error", "message": "internal server error", "request_id": "bug-1"}
    assert "secret-internal-detail" not in broken.text and "Retry-After" not in broken.headers
    logged = [r for r in caplog.records if r.exc_info and "secret-internal-detail" in str(r.exc_info[1])]
    assert logged, "the traceback is in the log"
    assert after.status_code == 200, "the service goes on serving"
    assert 'route="/predict",status="500"' in metrics
