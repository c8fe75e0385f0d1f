"""Liveness, readiness and health under the real lifespan: before, during and after start-up.

"Before ready" is made deterministic by holding model loading at a gate (the self-check
waits on an event this test sets), not by racing the loader.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from app.batching import Lane
from app.inference.loader import LayeredModel
from app.service import State
from tests.conftest import SettingsFactory
from tests.support import MODEL_NAME, b64, running_app, sample_png, top_label, wait_queued


class LoadGate:
    """Holds every model load inside its self-check until ``open`` is called."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.released = threading.Event()

    def open(self) -> None:
        self.released.set()

    async def wait_reached(self) -> None:
        assert await asyncio.to_thread(self.reached.wait, 30), "model loading never reached the gate"


@pytest.fixture
def load_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[LoadGate]:
    gate = LoadGate()
    original = LayeredModel.self_check

    def gated(self: LayeredModel, batch_size: int = 2) -> None:
        gate.reached.set()
        gate.released.wait(30)
        original(self, batch_size)

    monkeypatch.setattr(LayeredModel, "self_check", gated)
    try:
        yield gate
    finally:
        gate.open()  # never leave the device thread parked


async def test_not_ready_while_loading_then_ready(make_settings: SettingsFactory, load_gate: LoadGate) -> None:
    async with running_app(make_settings(model={"warmup": True}), wait=False) as running:
        await load_gate.wait_reached()
        client = running.client
        assert running.service.state is State.STARTING

        live = await client.get("/livez")
        assert live.status_code == 200 and live.json() == {"status": "alive"}

        ready = await client.get("/readyz", headers={"X-Request-ID": "probe-1"})
        assert ready.status_code == 503
        assert ready.json() == {"code": "not_ready", "message": ready.json()["message"], "request_id": "probe-1"}
        assert int(ready.headers["retry-after"]) >= 1

        health = await client.get("/healthz")
        assert health.status_code == 503
        report = health.json()
        assert report["status"] == "failing" and report["state"] == "starting"
        assert report["models"] == [] and report["failure"] is None

        predict = await client.post("/predict", json={"image_base64": b64(sample_png(5))})
        assert predict.status_code == 503
        assert predict.json()["code"] == "model_not_ready"
        assert int(predict.headers["retry-after"]) >= 1
        named = await running.predict_png(sample_png(5), path=f"/v1/models/{MODEL_NAME}/predict")
        assert named.status_code == 503 and named.json()["code"] == "model_not_ready"

        listing = (await client.get("/v1/models")).json()
        assert [(m["name"], m["state"], m["loaded_version"]) for m in listing["models"]] == [
            (MODEL_NAME, "not_loaded", None)
        ]

        assert not running.starting.done()  # still held: nothing above depended on timing
        load_gate.open()
        await running.wait_started()
        assert running.service.ready and running.fatal == []

        assert (await client.get("/readyz")).status_code == 200
        assert (await client.get("/healthz")).status_code == 200
        after = await client.post("/predict", json={"image_base64": b64(sample_png(5))})
        assert after.status_code == 200 and top_label(after.json()) == "5"


async def test_a_drain_while_models_load_keeps_the_service_from_turning_ready(
    make_settings: SettingsFactory, load_gate: LoadGate
) -> None:
    """SIGTERM during start-up: the start may finish before the shutdown cancels it, and must
    not then turn ready and serve on connections still open."""
    async with running_app(make_settings(model={"warmup": True}), wait=False) as running:
        await load_gate.wait_reached()
        await running.service.drain(0.1)
        assert running.service.state is State.DRAINING
        load_gate.open()
        await running.wait_started()
        assert running.service.state is State.DRAINING and not running.service.ready
        assert (await running.client.get("/readyz")).status_code == 503
        refused = await running.predict_png(sample_png(5))
        assert (refused.status_code, refused.json()["code"]) == (503, "draining")
        assert not running.service.models[MODEL_NAME].batcher.running


async def test_health_report_when_ready(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings(model={"warmup": True})) as running:
        ready = await running.client.get("/readyz")
        assert ready.status_code == 200 and ready.json() == {"status": "ready"}
        health = await running.client.get("/healthz")
        assert health.status_code == 200
        report = health.json()
        memory = report.pop("memory")
        assert report == {
            "status": "ok",
            "state": "ready",
            "device": "cpu",
            "dtype": "float32",
            "models": [
                {
                    "name": MODEL_NAME,
                    "version": "1",
                    "default": True,
                    "device": "cpu",
                    "dtype": "float32",
                    "loaded": True,
                    "batcher_running": True,
                    "device_failures": 0,
                    "failed_heads": {},
                    "unreadable_heads": {},
                    "queue_depth": {"urgent": 0, "normal": 0},
                    "batch_ceiling": None,
                }
            ],
            "failure": None,
            "loading": [],
        }
        assert memory["ok"] is True
        assert memory["min_free_bytes"] == 256 << 20
        assert 0 < memory["free_bytes"] <= memory["total_bytes"]


async def test_health_shows_queue_depth(make_settings: SettingsFactory) -> None:
    settings = make_settings(
        server={"default_timeout_ms": 60_000},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": 4, "max_queue": 64}},
    )
    async with running_app(settings) as running:
        waiting = [asyncio.create_task(running.predict_png(sample_png(d))) for d in range(3)]
        await wait_queued(running, Lane.NORMAL, 3)
        report = (await running.client.get("/healthz")).json()
        assert report["models"][0]["queue_depth"] == {"urgent": 0, "normal": 3}
        # a fourth fills the batch; all four leave together
        waiting.append(asyncio.create_task(running.predict_png(sample_png(3))))
        async with asyncio.timeout(30):
            responses = await asyncio.gather(*waiting)
        assert [r.json()["batch_size"] for r in responses] == [4] * 4
        report = (await running.client.get("/healthz")).json()
        assert report["models"][0]["queue_depth"] == {"urgent": 0, "normal": 0}


async def test_health_fails_without_memory_headroom(make_settings: SettingsFactory) -> None:
    """A failing check makes /healthz 503 (and says which), while readiness and serving go on."""
    async with running_app(make_settings(model={"min_free_memory_mb": 1 << 40})) as running:
        health = await running.client.get("/healthz")
        assert health.status_code == 503 and int(health.headers["retry-after"]) >= 1
        report = health.json()
        assert report["status"] == "failing" and report["state"] == "ready"
        assert report["memory"]["ok"] is False
        assert (await running.client.get("/readyz")).status_code == 200
        metrics = (await running.client.get("/metrics")).text
        assert 'ai_backend_requests_total{code="unhealthy",status="503"} 1.0' in metrics.splitlines()


async def test_shutdown_drains_queued_requests(make_settings: SettingsFactory) -> None:
    """Requests still waiting for their window when the lifespan ends are run, not dropped."""
    settings = make_settings(
        server={"default_timeout_ms": 60_000},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": 16, "max_queue": 64}},
    )
    async with running_app(settings) as running:
        waiting = [asyncio.create_task(running.predict_png(sample_png(d))) for d in range(3)]
        await wait_queued(running, Lane.NORMAL, 3)
        service = running.service
    # the lifespan has ended: the batcher flushed its queue before stopping
    assert service.state is State.STOPPED
    responses = [task.result() for task in waiting]
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert [top_label(r.json()) for r in responses] == ["0", "1", "2"]
    assert [r.json()["batch_size"] for r in responses] == [3, 3, 3]


async def test_a_drain_whose_grace_runs_out_says_how_many_it_cut_off(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """ "drained in 0.73s" read as a clean drain where 708 requests had been answered 503: the
    operator's cue to give the drain more time was missing."""
    settings = make_settings(
        server={"default_timeout_ms": 60_000, "shutdown_grace_s": 0.2},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": 2, "max_queue": 64}},
        model={"device_workers": 1},
    )
    release = threading.Event()
    caplog.set_level("INFO", logger="app.service")
    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        model = served.runner.model
        assert isinstance(model, LayeredModel)
        probabilities = model.probabilities

        def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
            release.wait(10)  # held on the device thread past the grace
            return probabilities(*args, **kwargs)

        model.probabilities = slow  # type: ignore[method-assign]
        waiting = [asyncio.create_task(running.predict_png(sample_png(d))) for d in range(3)]
        await wait_queued(running, Lane.NORMAL, 1)  # two running, one queued behind them
        # the lifespan ends with the block: the drain, its grace 0.2 s; the device thread let go after
        asyncio.get_running_loop().call_later(1.0, release.set)
    assert [task.result().json()["code"] for task in waiting] == ["draining"] * 3
    said = [r.getMessage() for r in caplog.records if r.name == "app.service" and "drain" in r.getMessage()]
    assert said == ["the drain's grace (0.2 s) ran out: 3 queued or running request(s) answered 503 draining"]


async def test_the_probes_answer_head_as_get(make_settings: SettingsFactory) -> None:
    # RFC 9110: HEAD wherever GET is; balancers and uptime checks probe with it
    async with running_app(make_settings()) as running:
        for path in ("/livez", "/readyz", "/healthz"):
            got, head = await running.client.get(path), await running.client.head(path)
            assert head.status_code == got.status_code == 200 and head.content == b"", path
            assert head.headers["content-length"] == got.headers["content-length"], path
        metrics = await running.client.head("/metrics")  # scrapers' liveness checks, too
        assert metrics.status_code == 200 and metrics.content == b""
        assert metrics.headers["content-type"].startswith("text/plain")
