"""The loader thread through the admin API: one load at a time, a promotion beside a load, and
what a load's or a head's failure answers and releases."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import torch

from app.inference.loader import LayeredModel
from tests.integration.test_lifecycle_api import AUTH, add_version, settings_for
from tests.lifecycle_support import StuckLoads
from tests.support import RunningApp, running_app, sample_png


@contextlib.asynccontextmanager
async def load_held(running: RunningApp, monkeypatch: pytest.MonkeyPatch, version: str) -> AsyncIterator[StuckLoads]:
    """An admin load of ``version`` under way, held on the loader thread while the block runs;
    then let go, loads are real again, and it must have succeeded."""
    loads = StuckLoads(monkeypatch)
    load = asyncio.ensure_future(running.client.post(f"/admin/models/digits/versions/{version}/load", headers=AUTH))
    try:
        assert await asyncio.to_thread(loads.started.wait, 30)
        yield loads
        assert not load.done(), "held until now"
    finally:
        loads.gate.set()
        loads.restore()
        answered = await load
    assert answered.status_code == 200, answered.text


def head_held(monkeypatch: pytest.MonkeyPatch, version: str) -> tuple[threading.Event, threading.Event]:
    """``version``'s heads, loaded from now on, wait on the loader thread until the second event
    is set (30 s at most); the first is set as one begins to."""
    started, gate = threading.Event(), threading.Event()
    real_head = LayeredModel.head

    def head(model: LayeredModel, name: str | None = None) -> torch.jit.ScriptModule:
        if model.folder.name == version:
            started.set()
            gate.wait(30)
        return real_head(model, name)

    monkeypatch.setattr(LayeredModel, "head", head)
    return started, gate


async def test_a_promotion_whose_head_is_loaded_does_not_wait_for_a_load_under_way(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The promotion loaded the candidate's head on the loader thread, loaded or not, and so
    waited behind a running load (up to model.load_timeout_s) holding the lifecycle's lock: the
    rollback and the unload sent meanwhile waited too."""
    async with running_app(settings_for(repository)) as running:
        add_version(repository, "3")
        pinned = await running.predict_png(sample_png(5), headers={"X-Model-Version": "2"})
        assert pinned.status_code == 200  # its head loaded by its first request
        async with load_held(running, monkeypatch, "3"), asyncio.timeout(10):  # not behind the load
            promoted = await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)
            rolled_back = await running.client.post("/admin/models/digits/rollback", headers=AUTH)
        assert promoted.status_code == 200 and promoted.json()["loaded_version"] == "2", promoted.text
        assert rolled_back.status_code == 200 and rolled_back.json()["loaded_version"] == "1", rolled_back.text


async def test_a_promotion_that_needs_the_loader_while_a_load_holds_it_is_a_503_and_blocks_nothing(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the warm-up off the candidate's head loads at its promotion, on the loader thread: it
    waited behind the load under way, holding the lifecycle's lock, and an unload waited with it."""
    async with running_app(settings_for(repository)) as running:
        add_version(repository, "3")
        async with load_held(running, monkeypatch, "3"):
            async with asyncio.timeout(10):  # not behind the load
                refused = await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)
                unloaded = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
            assert refused.status_code == 503 and refused.json()["code"] == "model_loading", refused.text
            assert int(refused.headers["Retry-After"]) >= 1 and "digits/3" in refused.json()["message"]
            assert unloaded.status_code == 200, unloaded.text
            assert (await running.predict_png(sample_png(5))).json()["version"] == "1"
        # the loader free again, the head loads at the promotion (outside the lock) and it goes through
        promoted = await running.client.post("/admin/models/digits/versions/3/promote", headers=AUTH)
        assert promoted.status_code == 200 and promoted.json()["loaded_version"] == "3", promoted.text
        assert "classifier" in running.service.groups["digits"].routing.loaded["3"].model.loaded_heads


async def test_a_second_load_while_one_runs_is_a_503_not_a_timeout_blamed_on_it(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its load_timeout_s ran while it queued for the loader thread behind the first: it was
    answered 409 model_load_failed, naming a version that was never tried."""
    async with running_app(settings_for(repository)) as running:
        add_version(repository, "3")
        add_version(repository, "4")
        async with load_held(running, monkeypatch, "3") as loads:
            async with asyncio.timeout(5):  # at once, not at the end of a timeout
                second = await running.client.post("/admin/models/digits/versions/4/load", headers=AUTH)
            assert second.status_code == 503 and second.json()["code"] == "model_loading", second.text
            assert int(second.headers["Retry-After"]) >= 1 and "digits/3" in second.json()["message"]
        again = await running.client.post("/admin/models/digits/versions/4/load", headers=AUTH)
        assert again.status_code == 200 and again.json()["loaded_versions"] == ["1", "2", "3", "4"], again.text
        assert loads.calls == 1, "the second load never reached the loader thread"


async def test_a_warm_up_the_graph_fails_is_a_409_with_its_memory_released(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TorchScript error at a batch size the self-check (2) does not run is the version's
    fault, as a failed self-check is: it escaped as a 500, and what the load held was kept."""
    async with running_app(settings_for(repository, warmup=True)) as running:
        add_version(repository, "3")
        real_warm_up = LayeredModel.warm_up
        warmed: list[weakref.ref[LayeredModel]] = []

        def warm_up(model: LayeredModel, max_batch: int, rounds: int = 3, sizes: Sequence[int] | None = None) -> None:
            if model.folder.name == "3":
                warmed.append(weakref.ref(model))
                raise RuntimeError(
                    "The following operation failed in the TorchScript interpreter.\n"
                    "RuntimeError: shape '[7, 576]' is invalid for input of size 1152"
                )
            real_warm_up(model, max_batch, rounds, sizes)

        released: list[bool] = []
        monkeypatch.setattr(LayeredModel, "warm_up", warm_up)
        monkeypatch.setattr("app.service.release_memory", lambda device: released.append(warmed[0]() is None))
        refused = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert refused.status_code == 409 and refused.json()["code"] == "model_load_failed", refused.text
        assert "warm-up failed" in refused.json()["message"] and "is invalid for input" in refused.json()["message"]
        assert released == [True], "released, once the refused model was gone"
        assert (await running.predict_png(sample_png(5))).status_code == 200
        monkeypatch.setattr(LayeredModel, "warm_up", real_warm_up)
        loaded = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert loaded.status_code == 200, "no load is left holding the loader"


async def test_a_promotion_whose_head_the_device_cannot_hold_is_a_503(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the warm-up off the candidate's head loads at its promotion: out of memory there
    escaped as a 500."""
    async with running_app(settings_for(repository)) as running:
        real_head = LayeredModel.head

        def head(model: LayeredModel, name: str | None = None) -> torch.jit.ScriptModule:
            if model.folder.name == "2":
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
            return real_head(model, name)

        released: list[str] = []
        monkeypatch.setattr(LayeredModel, "head", head)
        monkeypatch.setattr("app.service.release_memory", lambda device: released.append(str(device)))
        refused = await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)
        assert refused.status_code == 503 and refused.json()["code"] == "device_unavailable", refused.text
        assert refused.headers["Retry-After"] == "5" and "digits/2" in refused.json()["message"]
        assert released == ["cpu"]
        assert (await running.predict_png(sample_png(5))).json()["version"] == "1"
        monkeypatch.setattr(LayeredModel, "head", real_head)
        promoted = await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)
        assert promoted.status_code == 200, promoted.text


async def test_a_warm_up_past_the_loads_time_releases_what_it_loaded(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused for its warm-up's time (409), the load left what it had loaded unreleased: the
    other refusals release it once the model is gone."""
    async with running_app(settings_for(repository, warmup=True)) as running:
        add_version(repository, "3")
        running.service.settings.model.load_timeout_s = 1.0
        loader = running.service.loader
        original = loader.warm_size
        warming: list[weakref.ref[LayeredModel]] = []

        async def crawling(model: LayeredModel, size: int) -> None:
            if model.folder.name == "3":
                warming.append(weakref.ref(model))
                await asyncio.sleep(30)  # the device thread at it, for all the event loop knows
            await original(model, size)

        released: list[bool] = []
        monkeypatch.setattr(loader, "warm_size", crawling)
        monkeypatch.setattr("app.service.release_memory", lambda device: released.append(warming[0]() is None))
        async with asyncio.timeout(20):
            late = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert late.status_code == 409 and late.json()["code"] == "model_load_failed", late.text
        assert "load_timeout_s=1s with its warm-up" in late.json()["message"]
        assert released == [True], "released, once the model it had loaded was gone"


async def test_a_promotion_that_goes_away_while_its_head_loads_keeps_the_loader_claimed_until_it_ends(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread cannot be stopped: a promotion cancelled (its client gone) while its candidate's
    head loads leaves the head loading, and a load sent meanwhile is refused, as it is beside any
    load, rather than queued behind it with its timeout running."""
    async with running_app(settings_for(repository)) as running:
        add_version(repository, "3")
        started, gate = head_held(monkeypatch, "2")
        promotion = asyncio.ensure_future(running.app.state.lifecycle.promote("digits", "2"))
        try:
            assert await asyncio.to_thread(started.wait, 30)
            promotion.cancel()
            with pytest.raises(asyncio.CancelledError):
                await promotion
            async with asyncio.timeout(5):
                refused = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
            assert refused.status_code == 503 and refused.json()["code"] == "model_loading", refused.text
            assert "the head of digits/2" in refused.json()["message"]
        finally:
            gate.set()
        async with asyncio.timeout(30):  # the head loaded: the loader is free again
            loaded = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
            while loaded.status_code == 503:  # noqa: ASYNC110 (its end is a callback on the loop)
                await asyncio.sleep(0.02)
                loaded = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert loaded.status_code == 200, loaded.text
        assert "classifier" in running.service.groups["digits"].routing.loaded["2"].model.loaded_heads


async def test_a_head_load_past_the_loads_time_is_a_503_and_a_late_load_until_it_ends(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promotion waited for its candidate's head with no bound, holding the one-load claim: a
    hung read (a stalled network mount) left the promotion unanswered and every load refused, with
    nothing in /healthz saying why. Past model.load_timeout_s the promotion is a 503, and the head
    is a late load, listed, until it ends; then the promotion goes through."""
    async with running_app(settings_for(repository)) as running:
        running.service.settings.model.load_timeout_s = 1.0
        _, gate = head_held(monkeypatch, "2")
        try:
            async with asyncio.timeout(10):
                late = await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)
            assert late.status_code == 503 and late.json()["code"] == "model_loading", late.text
            assert "load_timeout_s=1s" in late.json()["message"] and "Retry-After" in late.headers
            health = (await running.client.get("/healthz")).json()
            assert health["loading"] == ["the head of digits/2"], health
        finally:
            gate.set()
        async with asyncio.timeout(30):  # the head loaded: no longer late, and the model keeps it
            while running.service.late_loads:  # noqa: ASYNC110 (its end is a callback on the loop)
                await asyncio.sleep(0.02)
        promoted = await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)
        assert promoted.status_code == 200, promoted.text
