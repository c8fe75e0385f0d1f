"""Device faults through the whole service: OOM splits keep answering, the fallback degrades."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.inference import loader
from app.inference.device import Memory, plan_threads
from app.inference.loader import LayeredModel, PreparedLayer
from app.inference.manifest import Layer, Manifest
from app.service import State
from tests.conftest import SettingsFactory
from tests.faults import DeviceLost, Faulty, Unfit
from tests.support import MODEL_NAME, metric_samples, running_app, sample_png, top_label


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


async def test_the_ceiling_shows_in_healthz_and_metrics_until_it_climbs_back(make_settings: SettingsFactory) -> None:
    lanes = {"urgent": {"max_batch": 4}, "normal": {"window_ms": 20_000.0, "max_batch": 4, "max_queue": 64}}
    settings = make_settings(batching={**lanes, "admission_headroom": 1.0})
    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        model = served.runner.model
        assert isinstance(model, LayeredModel)

        async def shown() -> tuple[object, float]:
            health = (await running.client.get("/healthz")).json()["models"][0]["batch_ceiling"]
            page = (await running.client.get("/metrics")).text
            ((labels, value),) = metric_samples(page, "ai_backend_batch_ceiling").items()
            assert labels == (("model", MODEL_NAME), ("version", served.version))
            return health, value

        assert await shown() == (None, 0.0)
        served.runner.model = Faulty(model, fail_at=3)  # type: ignore[assignment]
        await asyncio.gather(*(running.predict_png(sample_png(d)) for d in range(4)))
        assert await shown() == (2, 2.0)
        served.runner.model = model  # the pressure is gone: one full batch at the cap doubles it
        served.batcher.recovery_batches = 1
        await asyncio.gather(*(running.predict_png(sample_png(d)) for d in range(2)))
        assert await shown() == (None, 0.0), "at the policy's own size again, nothing caps it"


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
        assert isinstance(served.runner.model, LayeredModel) and served.model is served.runner.model
        assert (await running.client.get("/readyz")).status_code == 200


async def test_without_a_fallback_the_device_failure_stays_503(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings()) as running:
        served = running.service.models[MODEL_NAME]
        healthy = served.model
        served.runner.model = Faulty(healthy, always=True)  # type: ignore[assignment]
        for _ in range(3):
            response = await running.predict_png(sample_png(1))
            assert response.status_code == 503 and response.json()["code"] == "device_unavailable"
        health = await running.client.get("/healthz")
        assert health.status_code == 503
        assert health.json()["status"] == "failing" and health.json()["models"][0]["device_failures"] == 3
        served.runner.model = healthy  # the device recovers
        assert (await running.predict_png(sample_png(1))).status_code == 200
        assert (await running.client.get("/healthz")).json()["status"] == "ok"


async def test_a_lost_device_falls_back_and_lets_the_failed_model_go(make_settings: SettingsFactory) -> None:
    settings = make_settings(model={"cpu_fallback": True, "fallback_after_failures": 2})
    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        failed = weakref.ref(served.model)
        served.runner.model = DeviceLost(served.model)  # type: ignore[assignment]
        first = await running.predict_png(sample_png(3))
        assert first.status_code == 503 and first.json()["code"] == "device_unavailable"
        second = await running.predict_png(sample_png(3))
        assert second.status_code == 200 and top_label(second.json()) == "3"
        assert (await running.client.get("/healthz")).json()["status"] == "degraded"
        # nothing keeps the failed model (on a GPU: its weights, in device memory) alive
        assert failed() is None
        metrics = (await running.client.get("/metrics")).text
        assert [line for line in metrics.splitlines() if line.startswith("ai_backend_model_info{")] == [
            'ai_backend_model_info{device="cpu",dtype="float32",model="digits",version="1"} 1.0'
        ], "one series for the version, where it serves from now"


async def test_healthz_reads_the_host_memory_once_every_model_fell_back(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[str] = []

    def memory(device: torch.device) -> Memory:
        read.append(device.type)
        if device.type == "cuda":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")  # the context is lost
        return Memory(8 << 30, 16 << 30)

    settings = make_settings(model={"cpu_fallback": True, "fallback_after_failures": 1})
    async with running_app(settings) as running:
        monkeypatch.setattr("app.service.memory", memory)
        service = running.service
        monkeypatch.setattr(service, "device", torch.device("cuda"))  # as served from a GPU
        health = await running.client.get("/healthz")
        assert health.status_code == 503, "a device that cannot say its memory has none free"
        assert health.json()["status"] == "failing" and health.json()["memory"]["ok"] is False
        served = service.models[MODEL_NAME]
        served.runner.model = DeviceLost(served.model)  # type: ignore[assignment]
        assert (await running.predict_png(sample_png(5))).status_code == 200  # the fallback answers it
        health = await running.client.get("/healthz")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert read == ["cuda", "cpu"]


async def test_shutdown_frees_the_models_before_it_releases_the_device_cache(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    alive_at_release: list[bool] = []
    async with running_app(make_settings()) as running:
        model = weakref.ref(running.service.models[MODEL_NAME].model)
        monkeypatch.setattr("app.service.release_memory", lambda device: alive_at_release.append(model() is not None))
        monkeypatch.setattr(running.service, "device", torch.device("cuda"))
    assert alive_at_release == [False], "the cache was emptied while the models still held their blocks"


async def test_after_the_fallback_model_info_says_the_cpu_only(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(model={"cpu_fallback": True, "fallback_after_failures": 1})
    async with running_app(settings) as running:
        service, info = running.service, running.app.state.metrics.model_info
        for loaded_by in (service, service.loader):  # as served from a GPU in fp16
            monkeypatch.setattr(loaded_by, "device", torch.device("cuda"))
            monkeypatch.setattr(loaded_by, "dtype", torch.float16)
        info.remove(MODEL_NAME, "1", "cpu", "float32")
        info.labels(MODEL_NAME, "1", "cuda", "float16").set(1)
        monkeypatch.setattr("app.service.memory", lambda device: Memory(8 << 30, 16 << 30))
        served = service.models[MODEL_NAME]
        served.runner.model = DeviceLost(served.model)  # type: ignore[assignment]
        assert (await running.predict_png(sample_png(2))).status_code == 200
        metrics = (await running.client.get("/metrics")).text
        assert [line for line in metrics.splitlines() if line.startswith("ai_backend_model_info{")] == [
            'ai_backend_model_info{device="cpu",dtype="float32",model="digits",version="1"} 1.0'
        ]


async def test_a_request_too_big_for_the_device_fails_alone(make_settings: SettingsFactory) -> None:
    normal = {"window_ms": 20_000.0, "max_batch": 4, "max_queue": 64}
    settings = make_settings(batching={"normal": normal, "admission_headroom": 1.0}, telemetry={"exporter": "console"})
    exporter = InMemorySpanExporter()
    async with running_app(settings, span_exporter=exporter) as running:
        served = running.service.models[MODEL_NAME]
        inner = served.model
        seven = served.labels.index("7")
        unfit = Unfit(inner, lambda image: int(inner.probabilities(image[None]).argmax()) == seven)
        served.runner.model = unfit  # type: ignore[assignment]
        responses = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in (1, 7, 3, 4)))
        assert [r.status_code for r in responses] == [200, 503, 200, 200]
        assert [top_label(r.json()) for r in responses if r.status_code == 200] == ["1", "3", "4"]
        refused = responses[1]
        assert refused.json()["code"] == "device_unavailable" and refused.headers["Retry-After"]
        assert {r.json()["batch_size"] for r in responses if r.status_code == 200} == {4}
        assert sorted(unfit.sizes) == [1, 1, 2, 2, 4]  # which half holds the 7 is the decode order's
        running.app.state.tracer_provider.force_flush()
    spans = exporter.get_finished_spans()
    failed = [s for s in spans if s.name == "inference" and s.status.status_code.name == "ERROR"]
    assert [s.attributes["request.id"] for s in failed] == [refused.json()["request_id"]]
    assert "device_unavailable" in (failed[0].status.description or "")
    (batch,) = [s for s in spans if s.name == "batch" and s.attributes["batch.size"] == 4]
    assert batch.status.status_code.name == "ERROR" and batch.status.description == "1 of 4 images failed"


async def test_after_the_fallback_healthz_gives_the_models_device_and_precision_as_served(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(model={"cpu_fallback": True, "fallback_after_failures": 1})
    async with running_app(settings) as running:
        service = running.service
        monkeypatch.setattr(service, "device", torch.device("cuda"))  # as served from a GPU in fp16
        monkeypatch.setattr(service, "dtype", torch.float16)
        monkeypatch.setattr("app.service.memory", lambda device: Memory(8 << 30, 16 << 30))
        served = service.models[MODEL_NAME]
        served.runner.model = DeviceLost(served.model)  # type: ignore[assignment]
        assert (await running.predict_png(sample_png(2))).status_code == 200
        report = (await running.client.get("/healthz")).json()
        assert (report["status"], report["device"], report["dtype"]) == ("degraded", "cuda", "float16")
        assert (report["models"][0]["device"], report["models"][0]["dtype"]) == ("cpu", "float32")


async def test_each_out_of_memory_is_counted_shown_on_its_batch_span_and_logged_with_the_version(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    normal = {"window_ms": 20_000.0, "max_batch": 4, "max_queue": 64}
    settings = make_settings(batching={"normal": normal, "admission_headroom": 1.0}, telemetry={"exporter": "console"})
    exporter = InMemorySpanExporter()
    async with running_app(settings, span_exporter=exporter) as running:
        served = running.service.models[MODEL_NAME]
        served.runner.model = Faulty(served.model, fail_at=3)  # type: ignore[assignment]
        with caplog.at_level(logging.WARNING):
            answers = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in range(4)))
        assert [a.status_code for a in answers] == [200] * 4
        metrics = (await running.client.get("/metrics")).text
        running.app.state.tracer_provider.force_flush()
    counted = f'ai_backend_device_faults_total{{fault="out_of_memory",model="{MODEL_NAME}",version="1"}} 1.0'
    assert counted in metrics.splitlines()
    (batch,) = [s for s in exporter.get_finished_spans() if s.name == "batch"]
    assert [(e.name, e.attributes["batch.size"]) for e in batch.events] == [("out of memory", 4)]
    (line,) = [r for r in caplog.records if r.getMessage().startswith("out of memory at batch 4")]
    assert (line.model, line.version) == (MODEL_NAME, "1")  # type: ignore[attr-defined]
    (lowered,) = [r for r in caplog.records if "ceiling lowered" in r.getMessage()]
    assert lowered.getMessage().startswith(f"{MODEL_NAME}/1: ")


async def test_padded_batches_split_on_oom_and_every_image_keeps_its_own_answer(make_settings: SettingsFactory) -> None:
    # model.pad_batches=on pads on the CPU too (auto pads on CUDA only): batches run at 1, 2, 4 or 6
    lanes = {"urgent": {"max_batch": 2}, "normal": {"window_ms": 20_000.0, "max_batch": 6, "max_queue": 64}}
    settings = make_settings(model={"pad_batches": "on"}, batching={**lanes, "admission_headroom": 1.0})
    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        model = served.runner.model
        assert isinstance(model, LayeredModel) and model.largest_batch is not None
        faulty = Faulty(model, fail_at=5)
        served.runner.model = faulty  # type: ignore[assignment]
        digits = [9, 1, 7, 3, 0, 4]
        responses = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in digits))
        assert [top_label(r.json()) for r in responses] == [str(d) for d in digits]
        assert faulty.sizes == [6, 4, 4], "6 fails; each half of 3 runs padded to 4"
        assert served.batcher.ceiling == 3
        more = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in (8, 2, 5)))
        assert [top_label(r.json()) for r in more] == ["8", "2", "5"]
        assert [r.json()["batch_size"] for r in more] == [3, 3, 3], "the batch as the requests made it"
        assert faulty.sizes[3:] == [4], "run padded to 4, under the failing size"


async def test_batches_are_not_padded_on_the_cpu_by_default(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings()) as running:
        model = running.service.models[MODEL_NAME].runner.model
        assert isinstance(model, LayeredModel) and model.largest_batch is None


async def test_warmup_off_on_cuda_is_warned_of_and_on_the_cpu_it_is_not(make_settings: SettingsFactory) -> None:
    """Served with the warm-up off, a CUDA device sets each batch size up while serving (and a size
    first set up under memory pressure crashed the process on an H200): said at each load, on CUDA
    only; the CPU's cost is a slower first batch, nothing to warn of."""
    async with running_app(make_settings(model={"warmup": False})) as running:
        loader = running.service.loader
        warning = loader.unwarmed_shapes_warning(torch.device("cuda", 0))
        assert warning is not None and "model.warmup is off on cuda:0" in warning
        assert "AI_SERVICE_MODEL__WARMUP=true" in warning
        assert loader.unwarmed_shapes_warning(torch.device("cpu")) is None
    async with running_app(make_settings(model={"warmup": True})) as running:
        assert running.service.loader.unwarmed_shapes_warning(torch.device("cuda", 0)) is None


@pytest.mark.parametrize("fault", ["device", "bug"])
async def test_an_image_that_did_not_decode_keeps_its_400_when_its_batch_fails(
    make_settings: SettingsFactory, fault: str
) -> None:
    """Decoded in the batch (``server.decode=batch``), a broken image is the client's mistake
    whatever happens to the rest of its batch: a device that fails it (503) or a bug (500)."""
    settings = make_settings(
        server={"decode": "batch", "default_timeout_ms": 60_000},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": 3}},
    )
    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        healthy = served.runner.model

        class Bug(Faulty):
            def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
                raise KeyError("a bug in the forward pass")

        served.runner.model = Faulty(healthy, always=True) if fault == "device" else Bug(healthy)  # type: ignore[assignment]
        answers = await asyncio.gather(
            running.predict_png(sample_png(1)),
            running.predict_png(sample_png(2)[:60]),  # a PNG's signature and header, no image data
            running.predict_png(sample_png(3)),
        )
        expected = (503, "device_unavailable") if fault == "device" else (500, "internal_error")
        assert [(a.status_code, a.json()["code"]) for a in answers] == [
            expected,
            (400, "undecodable_image"),
            expected,
        ]


TOKEN = "s3cret-admin-token-0123456789"


async def test_a_new_size_the_warm_up_has_no_memory_for_is_released_and_batches_stay_under_it(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A policy raising the max batch to 32 warms 32 in the background; out of memory there, live
    batches would run 32 unwarmed under the same pressure (a size first set up under memory pressure
    crashed the process on an H200): the memory is released and the ceiling caps batches below it."""
    settings = make_settings(
        admin={"enabled": True, "token": TOKEN, "config_watch_s": 0},
        server={"default_timeout_ms": 60_000},
        model={"warmup": True, "pad_batches": "on"},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": 8, "max_queue": 64}},
    )
    released: list[torch.device] = []
    out_of_memory = "CUDA out of memory. Tried to allocate 4.00 GiB (injected)"
    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        model = served.runner.model
        assert isinstance(model, LayeredModel) and model.warmed == {1, 2, 4, 8, 16}
        warm_up = model.warm_up

        def short_of_memory(max_batch: int, rounds: int = 3, sizes: Sequence[int] | None = None) -> None:
            if sizes is not None and max(sizes) >= 32:
                raise torch.cuda.OutOfMemoryError(out_of_memory)
            warm_up(max_batch, rounds, sizes)

        model.warm_up = short_of_memory  # type: ignore[method-assign]
        monkeypatch.setattr("app.rewarm.release_memory", released.append, raising=False)
        with caplog.at_level(logging.WARNING):
            raised = {"normal": {"max_batch": 32, "max_queue": 64}}
            changed = await running.client.put(
                "/admin/policy", headers={"Authorization": f"Bearer {TOKEN}"}, json=raised
            )
            assert changed.status_code == 200, changed.text
            assert running.service.rewarm.task is not None
            await asyncio.wait_for(running.service.rewarm.task, 30)
        assert 32 not in model.warmed
        assert released == [model.device], "what the failed warm-up took, released"
        assert served.batcher.ceiling == 16 and served.batcher.effective_policy().normal.max_batch == 16
        warned = [r.getMessage() for r in caplog.records if r.name == "app.rewarm"]
        assert warned == [f"warming {MODEL_NAME}/1 at batch 32 for the new policy: {out_of_memory}"], "once"
        assert (await running.predict_png(sample_png(4))).status_code == 200


async def test_the_ceiling_climbs_back_only_past_sizes_warmed_first(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a warm-up ran out of memory at 32, the ceiling (16) climbing back would let live
    batches set 32 up under the pressure that failed it: it warms 32 first and rises after."""
    settings = make_settings(
        admin={"enabled": True, "token": TOKEN, "config_watch_s": 0},
        server={"default_timeout_ms": 60_000},
        model={"warmup": True, "pad_batches": "on"},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": 8, "max_queue": 64}},
    )
    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        model = served.runner.model
        assert isinstance(model, LayeredModel)
        warm_up, probabilities = model.warm_up, model.probabilities
        short = {"of_memory": True}
        ran: list[int] = []

        def short_of_memory(max_batch: int, rounds: int = 3, sizes: Sequence[int] | None = None) -> None:
            if short["of_memory"] and sizes is not None and max(sizes) >= 32:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
            warm_up(max_batch, rounds, sizes)

        def counted(batch: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # live batches (not warm-ups)
            ran.append(batch.shape[0])
            return probabilities(batch, *args, **kwargs)

        model.warm_up = short_of_memory  # type: ignore[method-assign]
        monkeypatch.setattr("app.rewarm.release_memory", lambda device: None, raising=False)
        raised = {"normal": {"max_batch": 32, "max_queue": 64}}
        changed = await running.client.put("/admin/policy", headers={"Authorization": f"Bearer {TOKEN}"}, json=raised)
        assert changed.status_code == 200, changed.text
        assert running.service.rewarm.task is not None
        await asyncio.wait_for(running.service.rewarm.task, 30)
        assert served.batcher.ceiling == 16
        served.batcher.recovery_batches = 1
        model.probabilities = counted  # type: ignore[method-assign]

        async def full_batch() -> None:
            answers = await asyncio.gather(*(running.predict_png(sample_png(d % 10)) for d in range(16)))
            assert [a.status_code for a in answers] == [200] * 16
            task = running.service.rewarm.task
            assert task is not None
            await asyncio.wait_for(task, 30)

        await full_batch()  # the cap would rise: 32 is warmed first, and runs out of memory again
        assert served.batcher.ceiling == 16 and 32 not in model.warmed
        previous, running.service.state = running.service.rewarm.task, State.DRAINING
        assert not running.service._sizes_ready(MODEL_NAME, served.version, 32), "a drain starts no warm-up"
        assert running.service.rewarm.task is previous
        running.service.state = State.READY
        short["of_memory"] = False
        # the pressure is gone; it failed a rise once, so the cap waits twice as many batches to try
        await full_batch()
        assert 32 not in model.warmed and served.batcher.ceiling == 16
        await full_batch()  # now 32 warms, the cap still 16 meanwhile
        assert 32 in model.warmed and served.batcher.ceiling == 16
        await full_batch()  # the next batch at the cap lifts it
        assert served.batcher.ceiling is None
        assert ran == [16] * 4, "no live batch over the cap before 32 was warmed"


async def test_a_lazy_head_the_device_has_no_memory_for_fails_its_batch_once_without_a_split(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    normal = {"window_ms": 20_000.0, "max_batch": 8, "max_queue": 64}
    settings = make_settings(model={"warmup": False}, batching={"normal": normal, "admission_headroom": 1.0})
    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        assert served.model.loaded_heads == (), "the head loads on its first batch"
        load_layer, loads = loader.load_layer, []

        def short_of_memory(folder: Path, manifest: Manifest, layer: Layer, *args: Any) -> PreparedLayer:
            if layer.name == manifest.backbone.name:
                return load_layer(folder, manifest, layer, *args)
            loads.append(layer.name)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB (injected: the head)")

        monkeypatch.setattr(loader, "load_layer", short_of_memory)
        answers = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in range(8)))
        assert [(a.status_code, a.json()["code"]) for a in answers] == [(503, "device_unavailable")] * 8
        assert len(loads) == 1, "one batch, one load: not once more for every half of a split"
        assert served.batcher.ceiling is None, "no batch size is to blame"
        assert served.runner.failures == 1


async def test_the_cpu_fallback_computes_on_the_cpus_torch_threads_not_the_gpus_one(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU's plan gives its one device thread one torch thread (the host's share of a batch is
    small). The fallback swapped the CPU model in on that thread and kept the one: on a 16-core
    host the degraded service computed on one core. Here the GPU's plan on 3 cores, as a GPU host's."""
    monkeypatch.setattr("app.service.plan_threads", lambda device, *args: plan_threads(torch.device("cuda", 0), *args))
    monkeypatch.setattr("app.service.cpu_cores", lambda: 3)
    settings = make_settings(model={"cpu_fallback": True, "fallback_after_failures": 1})
    before = torch.get_num_threads()
    try:
        async with running_app(settings) as running:
            service = running.service
            assert (service.threads.workers, service.threads.intra_op, service.threads.urgent) == (1, 1, 0)
            device_thread = service._device_thread
            assert await device_thread.run(torch.get_num_threads) == 1, "as on a GPU"
            served = service.models[MODEL_NAME]
            served.runner.model = DeviceLost(served.model)  # type: ignore[assignment]
            with caplog.at_level(logging.WARNING):
                answer = await running.predict_png(sample_png(6))
            assert answer.status_code == 200 and top_label(answer.json()) == "6", "the fallback answers it"
            assert await device_thread.run(torch.get_num_threads) == 3, "the CPU's plan for 3 cores, one device thread"
            again = await running.predict_png(sample_png(2))
            assert again.status_code == 200 and top_label(again.json()) == "2"
            assert await device_thread.run(torch.get_num_threads) == 3
    finally:
        torch.set_num_threads(before)  # torch's count for threads yet to start is process-wide
    said = [r.getMessage() for r in caplog.records if "torch threads" in r.getMessage()]
    assert said == [
        "the CPU fallback runs each batch on 3 torch threads (the CPU's plan for this machine; on the device: 1)"
    ]
