"""The app served under a prefix, as uvicorn's ``--root-path`` or a Ray Serve ``route_prefix`` mounts it.

Such a server keeps the prefix in ``scope["path"]`` and names it in ``scope["root_path"]``
(``httpx.ASGITransport(root_path=...)`` does the same here). FastAPI's router takes it off
before matching; what matches requests before the router (the predictions' direct path, the
admin gate) must as well, or under a prefix it is skipped. The probes' spans: test_tracing.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx

from app.telemetry.metrics import PREFIX as METRICS
from tests.conftest import SettingsFactory
from tests.integration.test_direct_predict import _RouterCalls
from tests.integration.test_policy import AUTH, admin_settings
from tests.integration.test_shedding import SETTINGS as FULL_LANE
from tests.integration.test_shedding import full_queue
from tests.support import MODEL_NAME, PulledBody, RunningApp, metric_samples, running_app, sample_png

MOUNT = "/tight"


@contextlib.asynccontextmanager
async def mounted(running: RunningApp) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``running``'s app served under ``MOUNT`` (its requests' paths begin with it)."""
    transport = httpx.ASGITransport(app=running.asgi or running.app, root_path=MOUNT)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=30) as client:
        yield client


async def test_predictions_under_a_prefix_are_served_and_refused_past_the_router(
    make_settings: SettingsFactory,
) -> None:
    png = {"Content-Type": "image/png"}
    async with running_app(make_settings(**FULL_LANE)) as running, mounted(running) as client:
        routed = _RouterCalls(running)
        default = await client.post(f"{MOUNT}/predict", content=sample_png(7), headers=png)
        named = await client.post(f"{MOUNT}/v1/models/{MODEL_NAME}/predict", content=sample_png(7), headers=png)
        assert default.status_code == named.status_code == 200
        async with full_queue(running):
            garbage = await client.post(
                f"{MOUNT}/predict", content=b"{not json", headers={"Content-Type": "application/json"}
            )
            assert garbage.status_code == 503 and garbage.json()["code"] == "queue_full"
        assert routed.count == 0, "the predictions were served by the direct path, not FastAPI's router"
        metrics = (await client.get(f"{MOUNT}/metrics")).text
        assert routed.count == 1
    latency = metric_samples(metrics, f"{METRICS}_request_duration_seconds_count")
    # labelled with the route templates, as at the root: the prefix is no part of them
    assert latency[(("lane", "normal"), ("route", "/predict"), ("status", "200"))] >= 1
    assert latency[(("lane", "normal"), ("route", "/v1/models/{name}/predict"), ("status", "200"))] == 1
    assert latency[(("lane", "normal"), ("route", "/predict"), ("status", "503"))] == 1


async def test_the_admin_gate_holds_under_a_prefix(make_settings: SettingsFactory) -> None:
    json_type = {"Content-Type": "application/json"}
    async with running_app(admin_settings(make_settings)) as running, mounted(running) as client:
        policy = f"{MOUNT}/admin/policy"
        malformed = await client.put(policy, content=b"{not json", headers=json_type)
        assert malformed.status_code == 401, "refused for its token, not parsed first"
        big = await client.put(policy, headers={**AUTH, **json_type}, content=b" " * (1 << 20))
        assert big.status_code == 413 and big.json()["code"] == "body_too_large"
        body = PulledBody()
        chunked = await client.put(policy, content=body, headers={**AUTH, **json_type})
        assert chunked.status_code == 411 and chunked.json()["code"] == "length_required" and body.pulled < 64
        assert (await client.put(policy, headers=AUTH, json={"normal": {"max_batch": 4}})).is_success
        metrics = (await client.get(f"{MOUNT}/metrics")).text
    requests = metric_samples(metrics, f"{METRICS}_request_duration_seconds_count")
    assert requests[(("lane", "none"), ("route", "/admin/policy"), ("status", "413"))] == 1
