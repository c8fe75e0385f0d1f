"""X-Request-ID: kept when well formed, replaced when not, the same in header and body."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.support import VALID_REQUEST_ID, RunningApp, b64, build_settings, running_app, sample_png

pytestmark = pytest.mark.asyncio(loop_scope="module")

GENERATED = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def running() -> AsyncIterator[RunningApp]:
    async with running_app(build_settings()) as app:
        yield app


@pytest.mark.parametrize(
    "request_id",
    [VALID_REQUEST_ID, "a", "x" * 128, "0123456789abcdef0123456789abcdef", "trace:span.1-2_3"],
    ids=["mixed", "one-char", "128-chars", "hex", "colons-dots"],
)
async def test_well_formed_ids_are_kept(running: RunningApp, request_id: str) -> None:
    ok = await running.predict_png(sample_png(0), headers={"X-Request-ID": request_id})
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-request-id"] == ok.json()["request_id"] == request_id
    # errors and the probes keep it too
    bad = await running.client.post("/predict", content=b"x", headers={"X-Request-ID": request_id})
    assert bad.status_code == 415
    assert bad.headers["x-request-id"] == bad.json()["request_id"] == request_id
    probe = await running.client.get("/livez", headers={"X-Request-ID": request_id})
    assert probe.headers["x-request-id"] == request_id


@pytest.mark.parametrize(
    "request_id",
    [
        "x" * 129,
        "has space",
        "slash/es",
        "semi;colon",
        "quote'",
        "<script>",
        "new%0Aline",
        "",
    ],
    ids=["129-chars", "space", "slash", "semicolon", "quote", "angle", "percent", "empty"],
)
async def test_malformed_ids_are_replaced(running: RunningApp, request_id: str) -> None:
    ok = await running.predict_png(sample_png(0), headers={"X-Request-ID": request_id})
    assert ok.status_code == 200, ok.text
    replaced = ok.headers["x-request-id"]
    assert replaced != request_id
    assert GENERATED.fullmatch(replaced)
    assert ok.json()["request_id"] == replaced
    bad = await running.client.post("/predict", json={}, headers={"X-Request-ID": request_id})
    assert bad.status_code == 422
    assert bad.json()["request_id"] == bad.headers["x-request-id"] != request_id


async def test_non_ascii_id_is_replaced(running: RunningApp) -> None:
    response = await running.client.post(
        "/predict", json={"image_base64": b64(sample_png(1))}, headers={b"X-Request-ID": "caf\u00e9".encode()}
    )
    assert response.status_code == 200, response.text
    assert GENERATED.fullmatch(response.headers["x-request-id"])
    assert response.json()["request_id"] == response.headers["x-request-id"]


async def test_generated_ids_are_unique_under_concurrency(running: RunningApp) -> None:
    responses = await asyncio.gather(*(running.predict_png(sample_png(d % 10)) for d in range(20)))
    ids = [r.headers["x-request-id"] for r in responses]
    assert [r.json()["request_id"] for r in responses] == ids
    assert len(set(ids)) == 20
    assert all(GENERATED.fullmatch(i) for i in ids)


async def test_client_ids_stay_with_their_requests_under_concurrency(running: RunningApp) -> None:
    sent = [f"req-{i}" for i in range(20)]
    responses = await asyncio.gather(
        *(running.predict_png(sample_png(i % 10), headers={"X-Request-ID": rid}) for i, rid in enumerate(sent))
    )
    assert [r.json()["request_id"] for r in responses] == sent
    assert [r.headers["x-request-id"] for r in responses] == sent
