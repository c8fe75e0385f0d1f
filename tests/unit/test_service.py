"""The service's start-up rules: the load timeout, missing models, the default model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from app.errors import Unavailable
from app.inference import loader
from app.inference.loader import LayeredModel, ModelLoadError
from app.service import InferenceService, State
from app.settings import Settings
from tests.lifecycle_support import StuckLoads

ROOT = Path(__file__).resolve().parents[2]


def settings_for(repository: Path, **model: object) -> Settings:
    return Settings(model={"repository": repository, "warmup": False, **model})  # type: ignore[arg-type]


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "models" / "digits" / "1", tmp_path / "digits" / "1")
    return tmp_path


async def test_a_load_past_its_timeout_stops_start_up_naming_the_setting(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads = StuckLoads(monkeypatch)  # a load that ends only when the test lets it
    service = InferenceService(settings_for(repository, load_timeout_s=0.1))
    try:
        with pytest.raises(ModelLoadError, match=r"load_timeout_s=0.1s \(AI_SERVICE_MODEL__LOAD_TIMEOUT_S\)"):
            async with asyncio.timeout(10):  # bounds a start that waits for the load after all
                await service.start()
        assert await asyncio.to_thread(loads.started.wait, 30), "the held load was never called"
        assert service.state is State.FAILED and not service.ready
    finally:
        loads.gate.set()
        await service.close(0)


async def test_a_model_named_in_settings_but_absent_stops_start_up(repository: Path) -> None:
    service = InferenceService(settings_for(repository, names=["digits", "resnet9000"]))
    with pytest.raises(ModelLoadError, match="resnet9000"):
        await service.start()
    await service.close(0)


async def test_an_empty_repository_stops_start_up(tmp_path: Path) -> None:
    service = InferenceService(settings_for(tmp_path))
    with pytest.raises(ModelLoadError, match="has no model"):
        await service.start()
    await service.close(0)


async def test_the_latest_version_is_served_and_the_default_resolves(repository: Path) -> None:
    shutil.copytree(repository / "digits" / "1", repository / "digits" / "10")
    manifest = repository / "digits" / "10" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"version": "1"', '"version": "10"'))
    service = InferenceService(settings_for(repository))
    await service.start()
    try:
        assert service.ready
        assert service.served(None).version == "10", "versions sort as integers: 10 after 1"
        assert service.served("digits").name == "digits"
    finally:
        await service.close(1.0)
    assert service.state is State.STOPPED


async def test_a_load_past_its_timeout_holds_off_other_loads_until_it_ends(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread cannot be stopped: the load that timed out goes on, and a second load meanwhile would
    run beside it (or queue behind it and time out too). It is refused, 503 with Retry-After, until
    the first ends; then its model is dropped and loads work again."""
    shutil.copytree(repository / "digits" / "1", repository / "digits" / "2")
    manifest = repository / "digits" / "2" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"version": "1"', '"version": "2"'))
    service = InferenceService(settings_for(repository, names=["digits"], load_timeout_s=1.0))
    await service.start()
    loads = StuckLoads(monkeypatch)
    try:
        with pytest.raises(ModelLoadError, match="load_timeout_s=1s"):
            await service.load_version("digits", "2")
        assert await asyncio.to_thread(loads.started.wait, 30), "it had started (the manifest read before it)"
        with pytest.raises(Unavailable) as refused:
            await service.load_version("digits", "1")
        assert refused.value.code == "model_loading" and refused.value.retry_after_s == 1
        assert "digits/2" in refused.value.message
        assert loads.calls == 1, "the second load never started"
        loads.gate.set()
        async with asyncio.timeout(30):
            while service.late_loads:  # noqa: ASYNC110 (the end is a log line and this list)
                await asyncio.sleep(0.01)
        assert loads.made and loads.made[0]() is None, "the late load's model (reference cycles and all) is gone"
        loads.restore()
        served = await service.load_version("digits", "2")
        assert served.version == "2"
    finally:
        loads.gate.set()
        await service.close(1.0)


async def test_start_up_warms_every_device_thread_and_a_version_loaded_while_serving_warms_a_size_a_call(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each device thread keeps its own allocator arena, grown to the largest batch it has run:
    warmed on one thread only, the others grew by hundreds of MiB under the first heavy load.
    While serving, a load runs on the loader thread and its warm-up one batch size a call, so the
    batches queued meanwhile run between them."""
    warmed: list[tuple[str, str, int, tuple[int, ...] | None]] = []
    loaded_on: list[str] = []
    real_warm_up, real_load = LayeredModel.warm_up, LayeredModel.load

    def recording_warm_up(
        model: LayeredModel, max_batch: int, rounds: int = 3, sizes: Sequence[int] | None = None
    ) -> None:
        name = threading.current_thread().name
        warmed.append((model.manifest.version, name, max_batch, None if sizes is None else tuple(sizes)))
        real_warm_up(model, max_batch, rounds=1, sizes=sizes)

    def recording_load(*args: Any, **kwargs: Any) -> LayeredModel:
        loaded_on.append(threading.current_thread().name)
        return real_load(*args, **kwargs)

    layers_on: list[tuple[str, str]] = []
    real_layer = loader.load_layer

    def recording_layer(folder: Path, manifest: Any, layer: Any, *args: Any) -> Any:
        layers_on.append((layer.name, threading.current_thread().name))
        return real_layer(folder, manifest, layer, *args)

    monkeypatch.setattr(loader, "load_layer", recording_layer)

    monkeypatch.setattr(LayeredModel, "warm_up", recording_warm_up)
    monkeypatch.setattr(LayeredModel, "load", recording_load)
    shutil.copytree(repository / "digits" / "1", repository / "digits" / "2")
    manifest = repository / "digits" / "2" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"version": "1"', '"version": "2"'))
    settings = Settings(
        model={"repository": repository, "warmup": True, "device_workers": 2, "urgent_workers": 1},  # type: ignore[arg-type]
        batching={"normal": {"max_batch": 8}, "urgent": {"max_batch": 4}},  # type: ignore[arg-type]
    )
    service = InferenceService(settings)
    await service.start()
    try:
        threads = ["device-0", "device-1", "device-urgent-0"]
        # a size a call on each thread, ascending: a stopped start-up waits for one size, not all
        assert sorted(warmed) == sorted(("2", thread, 8, (size,)) for thread in threads for size in (1, 4, 8))
        warmed.clear()
        await service.load_version("digits", "1")
        assert [(version, sizes) for version, _, _, sizes in warmed] == [("1", (1,)), ("1", (4,)), ("1", (8,))]
        assert {thread for _, thread, _, _ in warmed} <= {"device-0", "device-1"}
        assert loaded_on == ["loader", "loader"], "no load holds a device thread"
        nice = service.threads.normal_nice
        priorities = await asyncio.gather(
            asyncio.to_thread(service.loader._loader.submit(lambda: os.getpriority(os.PRIO_PROCESS, 0)).result, 10),
            asyncio.to_thread(service._device_thread.submit(lambda: os.getpriority(os.PRIO_PROCESS, 0)).result, 10),
        )
        assert nice > 0 and priorities[0] == priorities[1], (
            "a load runs as low as the normal batches it shares cores with"
        )
        assert {thread for _, thread in layers_on} == {"loader"}, layers_on
        assert sorted(layers_on) == [("backbone", "loader"), ("backbone", "loader")] + [("classifier", "loader")] * 2
    finally:
        await service.close(1.0)


async def test_a_start_up_stopped_during_its_warm_up_waits_for_the_size_under_way_not_the_rest(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM during the start-up warm-up let it run to its end (seconds a shape on a GPU),
    for nothing: the sizes after the one under way are not run."""
    from app.inference.loader import LayeredModel

    calls: list[tuple[int, ...] | None] = []
    started, release = threading.Event(), threading.Event()

    def held_warm_up(model: LayeredModel, max_batch: int, rounds: int = 3, sizes: Sequence[int] | None = None) -> None:
        calls.append(None if sizes is None else tuple(sizes))
        started.set()
        release.wait(10)

    monkeypatch.setattr(LayeredModel, "warm_up", held_warm_up)
    settings = Settings(
        model={"repository": repository, "warmup": True, "device_workers": 1, "urgent_workers": 0},  # type: ignore[arg-type]
        batching={"normal": {"max_batch": 8}, "urgent": {"max_batch": 4}},  # type: ignore[arg-type]
    )
    service = InferenceService(settings)
    start = asyncio.ensure_future(service.start())
    try:
        assert await asyncio.to_thread(started.wait, 30)
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await start
    finally:
        release.set()
        await service.close(1.0)
    assert calls == [(1,)], calls


async def test_a_close_after_a_drain_says_drained_once(repository: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM drains, then the lifespan's close drains again and finds nothing: the log says it once."""
    service = InferenceService(settings_for(repository))
    await service.start()
    with caplog.at_level("INFO", logger="app.service"):
        await service.drain(1.0)
        await service.close(1.0)
    assert [r.getMessage().split(" in ")[0] for r in caplog.records if "drained" in r.getMessage()] == ["drained"]


@pytest.mark.parametrize("resumed_late", [False, True])
async def test_an_answer_whose_task_resumes_past_the_deadline_is_deadline_exceeded_not_200_late(
    repository: Path, monkeypatch: pytest.MonkeyPatch, resumed_late: bool
) -> None:
    """At twice the load on a slow host, 9 answers of one minute left the server 1-15 ms after
    their deadline: their batch finished in time, and the loop, behind, resumed their tasks later."""
    from app.batching import Lane
    from app.errors import DeadlineExceeded
    from app.inference import preprocess

    service = InferenceService(settings_for(repository))
    await service.start()
    try:
        served = service.served("digits", None)
        submit = served.batcher.submit

        async def behind(*args: Any, **kwargs: Any) -> Any:
            done = await submit(*args, **kwargs)
            if resumed_late:
                await asyncio.sleep(0.6)  # the batch ran in time; the task resumes after the deadline
            return done

        monkeypatch.setattr(served.batcher, "submit", behind)
        image = preprocess.blank_png(8, 8)
        late = service.metrics.cancellations.labels("late")
        if resumed_late:
            with pytest.raises(DeadlineExceeded, match="before its answer could be sent"):
                await service.predict(served, image, 3, Lane.NORMAL, 0.5)
        else:
            outcome = await service.predict(served, image, 3, Lane.NORMAL, 0.5)
            assert len(outcome.predictions) == 3
        assert late._value.get() == (1 if resumed_late else 0), "computed for nobody: counted"
    finally:
        await service.close(0)


async def test_the_thread_plan_is_made_for_model_cores_where_set(repository: Path) -> None:
    service = InferenceService(settings_for(repository, cores=1))
    try:
        assert (service.threads.workers, service.threads.intra_op) == (1, 1), service.threads
    finally:
        await service.close(0)


async def test_normal_batches_wait_for_urgent_ones_as_far_as_the_threads_outnumber_the_cores(repository: Path) -> None:
    # 2 cores: three normal device threads decoding their batches and the urgent one, two beyond the
    # cores; 8 cores: two normal threads of four torch threads and the urgent one, none beyond them
    for cores, plan, beyond, pause_s in ((2, (3, 1), 2, 0.03), (8, (2, 1), 0, 0.0)):
        service = InferenceService(settings_for(repository, cores=cores))
        try:
            assert (service.threads.workers, service.threads.urgent) == plan, service.threads
            assert service._device_thread._pausable == beyond
            assert service._device_thread._pause_s == pause_s, "none may wait: nothing counted either"
        finally:
            await service.close(0)


async def test_on_a_gpu_no_normal_batch_waits_for_an_urgent_one(repository: Path) -> None:
    # a Ray GPU replica plans for one core (num_cpus=0); its batches wait for the device, not a core
    service = InferenceService(settings_for(repository, cores=1, urgent_workers=1), device=torch.device("cuda"))
    try:
        assert (service.threads.workers, service.threads.urgent) == (1, 1), service.threads
        assert service._device_thread._pausable == 0 and service._device_thread._pause_s == 0.0
    finally:
        await service.close(0)
