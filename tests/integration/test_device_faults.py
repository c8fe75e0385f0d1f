"""Device faults through the whole service: OOM splits keep answering, the fallback degrades."""

from __future__ import annotations

import asyncio

from app.inference.loader import LayeredModel
from tests.conftest import SettingsFactory
from tests.faults import Faulty
from tests.support import MODEL_NAME, running_app, sample_png, top_label


async def test_oom_batches_are_split_and_the_ceiling_drops(make_settings: SettingsFactory) -> None:
    # batches fill by count under a window that never closes; the predicted wait counts the
    # whole window, so admission may use all of the time left
    normal = {"window_ms": 20_000.0, "max_batch": 8, "max_queue": 64}
    settings = make_settings(batching={"normal": normal, "admission_headroom": 1.0})
    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        assert isinstance(served.runner.model, LayeredModel)
        faulty = Faulty(served.runner.model, fail_at=3)
        served.runner.model = faulty  # type: ignore[assignment]
        digits = list(range(8))
        responses = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in digits))
        assert [r.status_code for r in responses] == [200] * 8
        assert [top_label(r.json()) for r in responses] == [str(d) for d in digits]
        assert faulty.sizes == [8, 4, 2, 2, 4, 2, 2]
        assert served.batcher.ceiling == 2, "the pressure callback reached the batcher"
        more = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in range(4)))
        assert [r.json()["batch_size"] for r in more] == [2, 2, 2, 2], "batches stay under the ceiling"
        assert (await running.client.get("/healthz")).json()["status"] == "ok"


async def test_a_failing_device_is_503_then_the_cpu_fallback_serves_degraded(make_settings: SettingsFactory) -> None:
    settings = make_settings(model={"cpu_fallback": True, "fallback_after_failures": 2})
    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        served.runner.model = Faulty(served.model, always=True)  # type: ignore[assignment]
        first = await running.predict_png(sample_png(3))
        assert first.status_code == 503
        assert first.json()["code"] == "device_unavailable" and first.headers["Retry-After"]
        assert (await running.client.get("/healthz")).json()["status"] == "ok"
        second = await running.predict_png(sample_png(3))
        assert second.status_code == 200 and top_label(second.json()) == "3"
        health = await running.client.get("/healthz")
        assert health.status_code == 200
        report = health.json()
        assert report["status"] == "degraded"
        assert report["models"][0]["device"] == "cpu"
        assert isinstance(served.runner.model, LayeredModel) and served.runner.model is not served.model
        assert (await running.client.get("/readyz")).status_code == 200


async def test_without_a_fallback_the_device_failure_stays_503(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings()) as running:
        served = running.service.models[MODEL_NAME]
        served.runner.model = Faulty(served.model, always=True)  # type: ignore[assignment]
        for _ in range(3):
            response = await running.predict_png(sample_png(1))
            assert response.status_code == 503 and response.json()["code"] == "device_unavailable"
        health = await running.client.get("/healthz")
        assert health.status_code == 503
        assert health.json()["status"] == "failing" and health.json()["models"][0]["device_failures"] == 3
        served.runner.model = served.model  # the device recovers
        assert (await running.predict_png(sample_png(1))).status_code == 200
        assert (await running.client.get("/healthz")).json()["status"] == "ok"
