"""Model lifecycle through the admin API, under load: load, canary, promote, roll back, unload."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import random
import shutil
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from app.batching import Lane
from app.errors import ServiceError
from app.inference.loader import LayeredModel
from app.inference.manifest import InputSpec, Provenance
from app.inference.packaging import sha256_file, write_version
from app.settings import Settings
from tests.faults import DeviceLost
from tests.integration.test_metrics import scrape, total
from tests.integration.test_request_ends import Connection
from tests.lifecycle_support import StuckLoads
from tests.support import RunningApp, build_settings, running_app, sample_png, truncate_file

TOKEN = "lifecycle-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]


def misfit_head(version: Path, tmp: Path) -> None:
    """Give ``version`` a head that cannot run on its backbone's features (seven inputs where
    the backbone gives more), with checksums that match: only running it tells."""
    other = write_version(
        tmp,
        name="digits",
        version="1",
        backbone=nn.Sequential(nn.Flatten(), nn.Linear(4, 7)).eval(),
        heads={"classifier": nn.Linear(7, 10).eval()},
        input_spec=InputSpec(channels=1, height=2, width=2, mean=(0.5,), std=(0.5,)),
        labels=tuple(str(d) for d in range(10)),
        provenance=Provenance(source="tests"),
    )
    manifest = json.loads((version / "manifest.json").read_text())
    for file in ("classifier.graph.pt", "classifier.safetensors"):
        shutil.copy(other / file, version / file)
        manifest["files"][file] = sha256_file(version / file)
    (version / "manifest.json").write_text(json.dumps(manifest, indent=2))


def add_version(root: Path, version: str, accuracy: float | None = None) -> Path:
    """A copy of digits/1 as ``version`` (same weights), with its recorded accuracy set."""
    target = root / "digits" / version
    shutil.copytree(ROOT / "models" / "digits" / "1", target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["version"] = version
    if accuracy is not None:
        manifest["evaluation"]["accuracy"]["fp32"] = accuracy
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return target


def settings_for(repository: Path, **model: object) -> Settings:
    return build_settings(
        model={"repository": repository, "load_versions": "all", "default_versions": {"digits": "1"}, **model},
        admin={"enabled": True, "token": TOKEN, "config_watch_s": 0},
    )


async def test_pinning_routes_to_a_version_or_says_why_not(repository: Path) -> None:
    add_version(repository, "3")
    async with running_app(settings_for(repository, versions={"digits": ["1", "2"]})) as running:
        for pin, status, code in (
            ("2", 200, None),
            ("1", 200, None),
            ("3", 503, "version_not_loaded"),
            ("99", 404, "version_not_found"),
            ("../1", 404, "version_not_found"),
        ):
            response = await running.predict_png(sample_png(4), headers={"X-Model-Version": pin})
            assert response.status_code == status, (pin, response.text)
            if status == 200:
                assert response.json()["version"] == pin
            else:
                assert response.json()["code"] == code
        unpinned = await running.predict_png(sample_png(4))
        assert unpinned.json()["version"] == "1"


async def test_promotion_and_rollback_under_load_fail_no_request(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        log: list[tuple[str, int, str | None]] = []  # (phase, status, version)
        phase = "v1"
        stop = asyncio.Event()

        async def client(digit: int) -> None:
            while not stop.is_set():
                sent_in = phase
                response = await running.predict_png(sample_png(digit))
                log.append((sent_in, response.status_code, response.json().get("version")))

        async def answered_in(name: str, count: int = 16) -> None:
            async with asyncio.timeout(60):
                while sum(1 for p, _, _ in log if p == name) < count:  # noqa: ASYNC110 - counts, not time
                    await asyncio.sleep(0.01)

        clients = [asyncio.ensure_future(client(d)) for d in range(8)]
        await answered_in("v1")
        promoted = await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)
        assert promoted.status_code == 200, promoted.text
        assert promoted.json()["loaded_version"] == "2" and promoted.json()["previous_version"] == "1"
        phase = "v2"
        await answered_in("v2")
        rolled = await running.client.post("/admin/models/digits/rollback", headers=AUTH)
        assert rolled.status_code == 200 and rolled.json()["loaded_version"] == "1"
        phase = "back"
        await answered_in("back")
        stop.set()
        await asyncio.gather(*clients)
    assert all(status == 200 for _, status, _ in log), "no request failed during the swaps"
    by_phase = {p: {v for q, _, v in log if q == p} for p in ("v1", "v2", "back")}
    assert by_phase["v2"] == {"2"}, "requests sent after the promotion returned all went to v2"
    assert by_phase["back"] == {"1"}, "rollback restores v1 for everything sent after it"
    assert by_phase["v1"] <= {"1", "2"}  # those in flight at the swap may be on either
    assert sum(1 for p, _, _ in log if p == "v2") > 0 and sum(1 for p, _, _ in log if p == "back") > 0


async def test_a_retried_rollback_is_a_409_and_the_canary_rules_hold(
    repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second rollback (a retried request) put the demoted version back as the default without
    the promotion's gates; now it is a 409 in the error envelope. A promotion ends the promoted
    version's canary share and keeps the others'; an unload drops its share, said in its log."""
    add_version(repository, "3")
    caplog.set_level(logging.INFO, logger="app.lifecycle.manager")
    async with running_app(settings_for(repository)) as running:

        async def state() -> tuple[str, str | None, dict[str, float]]:
            described = (await running.client.get("/v1/models/digits")).json()
            return described["loaded_version"], described["previous_version"], described["canary"]

        split = await running.client.put(
            "/admin/models/digits/canary", headers=AUTH, json={"weights": {"2": 0.1, "3": 0.2}}
        )
        assert split.status_code == 200, split.text
        promoted = await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)
        assert promoted.status_code == 200, promoted.text
        assert await state() == ("2", "1", {"3": 0.2})
        assert "promoted digits/2 (was 1); canary still {'3': 0.2}" in caplog.messages
        rolled = await running.client.post("/admin/models/digits/rollback", headers=AUTH)
        assert rolled.status_code == 200 and rolled.json()["loaded_version"] == "1", rolled.text
        assert await state() == ("1", None, {"3": 0.2})
        again = await running.client.post("/admin/models/digits/rollback", headers=AUTH)
        assert again.status_code == 409, again.text
        assert again.json()["code"] == "conflict"
        assert "no previous default to roll back to: version 1 is the default" in again.json()["message"]
        assert "promote" in again.json()["message"], "it says what to do instead"
        assert await state() == ("1", None, {"3": 0.2}), "the refused rollback changed nothing"
        pinned = await running.predict_png(sample_png(2), headers={"X-Model-Version": "2"})
        assert pinned.status_code == 200 and pinned.json()["version"] == "2", "the demoted version stays loaded"
        unloaded = await running.client.post("/admin/models/digits/versions/3/unload", headers=AUTH)
        assert unloaded.status_code == 200 and unloaded.json()["canary"] == {}, unloaded.text
        assert "unloaded digits/3 (its canary share 0.2 went to version 1)" in caplog.messages
        assert (await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)).status_code == 200
        gone = await running.client.post("/admin/models/digits/versions/1/unload", headers=AUTH)
        assert gone.status_code == 200 and gone.json()["previous_version"] is None, gone.text
        assert (await running.client.post("/admin/models/digits/rollback", headers=AUTH)).status_code == 409


async def test_the_canary_split_stays_within_statistical_bounds(
    repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_app(settings_for(repository)) as running:
        with caplog.at_level(logging.INFO, logger="app.lifecycle.manager"):
            answer = await running.client.put(
                "/admin/models/digits/canary", headers=AUTH, json={"weights": {"2": 0.25}}
            )
        assert answer.status_code == 200 and answer.json()["canary"] == {"2": 0.25}
        assert "canary of digits set to {'2': 0.25} (the rest to version 1)" in caplog.messages, "the log says when"
        n = 600
        responses = await asyncio.gather(*(running.predict_png(sample_png(i % 10)) for i in range(n)))
        share = sum(r.json()["version"] == "2" for r in responses) / n
        bound = 5 * math.sqrt(0.25 * 0.75 / n)  # five standard deviations: a flake once in millions of runs
        assert abs(share - 0.25) < bound, share
        off = await running.client.put("/admin/models/digits/canary", headers=AUTH, json={"weights": {}})
        assert off.status_code == 200
        assert {(await running.predict_png(sample_png(1))).json()["version"] for _ in range(20)} == {"1"}
        for bad, status in (
            ({"weights": {"1": 0.5}}, 409),  # the default
            ({"weights": {"7": 0.1}}, 404),
            ({"weights": {"2": 1.5}}, 422),
            ({"weights": {"2": True}}, 422),  # not a share of 1
            ({"weights": {"2": "0.5"}}, 422),
            ({"weights": {"2": 0.5}, "wieghts": {}}, 422),
            ({"weights": {"2": 0.5, "3": 0.6}}, 422),  # more than all of it
        ):
            refused = await running.client.put("/admin/models/digits/canary", headers=AUTH, json=bad)
            assert refused.status_code == status, (bad, refused.text)
        assert running.service.groups["digits"].routing.canary == {}, "each refused, the split stays off"
        promoted = await running.client.post("/admin/models/digits/versions/7/promote", headers=AUTH)
        assert promoted.status_code == 404 and promoted.json()["code"] == "version_not_found", "not in the repository"


async def test_a_request_draws_the_canary_split_once(repository: Path) -> None:
    """The overload check before the body and the route serve the version of one draw: two
    draws would check one version's queue and serve another's (a busy canary refusing requests
    the default version would have served)."""
    async with running_app(settings_for(repository)) as running:
        answer = await running.client.put("/admin/models/digits/canary", headers=AUTH, json={"weights": {"2": 0.5}})
        assert answer.status_code == 200
        group = running.service.groups["digits"]
        draws: list[float] = []

        class Recorded(random.Random):
            def random(self) -> float:
                draws.append(value := super().random())
                return value

        group._rng = Recorded(0)
        responses = [await running.predict_png(sample_png(i % 10)) for i in range(20)]
        assert len(draws) == len(responses), "one draw a request"
        assert [r.json()["version"] for r in responses] == [group.routing.pick(v) for v in draws]


async def test_a_version_added_while_serving_can_be_loaded_and_a_corrupt_one_is_refused(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        add_version(repository, "3")
        loaded = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert loaded.status_code == 200 and loaded.json()["loaded_versions"] == ["1", "2", "3"]
        assert (await running.client.get("/healthz")).json()["loading"] == []
        pinned = await running.predict_png(sample_png(5), headers={"X-Model-Version": "3"})
        assert pinned.status_code == 200 and pinned.json()["version"] == "3"

        truncate_file(add_version(repository, "4") / "backbone.safetensors")
        refused = await running.client.post("/admin/models/digits/versions/4/load", headers=AUTH)
        assert refused.status_code == 409 and refused.json()["code"] == "model_load_failed"
        assert "backbone.safetensors" in refused.json()["message"]
        still = await running.predict_png(sample_png(5))
        assert still.status_code == 200 and still.json()["version"] == "1"

        for name, version in (("digits", "..%2F1"), ("..", "1"), ("digits", "77")):
            missing = await running.client.post(f"/admin/models/{name}/versions/{version}/load", headers=AUTH)
            assert missing.status_code == 404, (name, version, missing.text)


async def test_a_request_whose_routed_version_is_unloaded_before_its_seat_is_routed_again(
    repository: Path,
) -> None:
    """The edge's overload check routes a request, and its route takes the seat a loop turn
    later: a version unloaded in between is no reason to answer 'shutting down'."""
    async with running_app(settings_for(repository)) as running:
        stale = running.service.groups["digits"].routing.loaded["2"]
        unloaded = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
        assert unloaded.status_code == 200
        png = sample_png(6)
        # as the edge leaves it: checked, and routed to version 2 before the unload
        request = Connection(
            running,
            {"content-type": "image/png", "content-length": str(len(png))},
            state={"shed_checked": True, "served": stale},
        )
        request.body(png, more=False)
        status, reply = await request.answer()
        assert (status, reply.get("version")) == (200, "1"), reply
        counted = await scrape(running)
        assert total(counted, "ai_backend_cancellations_total") == 0, "routed again and answered: not dropped"


async def test_unloading_releases_device_memory_off_the_event_loop(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # empty_cache waits for the device, which may be running another version's batch
    threads: list[str] = []
    monkeypatch.setattr("app.service.release_memory", lambda device: threads.append(threading.current_thread().name))
    async with running_app(settings_for(repository)) as running:
        unloaded = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
        assert unloaded.status_code == 200
    assert threads and threading.main_thread().name not in threads, threads


async def test_unloading_drains_and_the_default_cannot_go(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        refused = await running.client.post("/admin/models/digits/versions/1/unload", headers=AUTH)
        assert refused.status_code == 409 and "promote another first" in refused.json()["message"]
        unloaded = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
        assert unloaded.status_code == 200 and unloaded.json()["loaded_versions"] == ["1"]
        gone = await running.predict_png(sample_png(2), headers={"X-Model-Version": "2"})
        assert gone.status_code == 503 and gone.json()["code"] == "version_not_loaded"
        again = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
        assert again.status_code == 409 and again.json()["code"] == "conflict", "known, not loaded: as a promotion"
        unknown = await running.client.post("/admin/models/digits/versions/99/unload", headers=AUTH)
        assert unknown.status_code == 404 and unknown.json()["code"] == "version_not_found"
        back = await running.client.post("/admin/models/digits/versions/2/load", headers=AUTH)
        assert back.status_code == 200


async def test_an_unloaded_version_is_freed_although_the_collector_was_frozen(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        assert gc.get_freeze_count() > 0, "frozen once warm"
        group = running.app.state.service.groups["digits"]
        model = weakref.ref(group.routing.loaded["2"].model)
        del group
        unloaded = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
        assert unloaded.status_code == 200
        assert model() is None, "the version's model (reference cycles and all) was collected"


@pytest.mark.parametrize("warming", ["1", "2"])
async def test_a_version_unloaded_while_a_new_policy_warms_is_collected(
    repository: Path, monkeypatch: pytest.MonkeyPatch, warming: str
) -> None:
    """A bigger max batch warms every version in the background; one unloaded meanwhile, while
    version 1 warms or while it does itself, is warmed no more and collected by its unload: held
    by the warm-up then, it would be frozen with the rest, never freed."""
    release, entered = threading.Event(), threading.Event()
    warm_up = LayeredModel.warm_up

    def held(model: LayeredModel, *args: Any, **kwargs: Any) -> None:  # holds no model itself
        if model.folder.name == warming:
            entered.set()
            release.wait(10)
        warm_up(model, *args, **kwargs)

    async with running_app(settings_for(repository, warmup=True)) as running:
        monkeypatch.setattr(LayeredModel, "warm_up", held)
        model = weakref.ref(running.app.state.service.groups["digits"].routing.loaded["2"].model)
        bigger = await running.client.put("/admin/policy", headers=AUTH, json={"normal": {"max_batch": 64}})
        assert bigger.status_code == 200, bigger.text
        rewarm = running.app.state.service.rewarm.task
        assert await asyncio.to_thread(entered.wait, 10), f"version {warming} warms"
        unloading = asyncio.ensure_future(running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH))
        await asyncio.sleep(0.2)
        release.set()
        assert (await unloading).status_code == 200
        await asyncio.wait_for(rewarm, 30)
        assert model() is None, "the unloaded version was collected"


async def test_promotion_is_refused_when_accuracy_drops_unless_forced(repository: Path) -> None:
    add_version(repository, "3", accuracy=0.80)
    async with running_app(settings_for(repository)) as running:
        refused = await running.client.post("/admin/models/digits/versions/3/promote", headers=AUTH)
        assert refused.status_code == 409, refused.text
        body = refused.json()
        assert body["code"] == "promotion_refused" and "80" in body["message"]
        assert (await running.predict_png(sample_png(3))).json()["version"] == "1"
        forced = await running.client.post("/admin/models/digits/versions/3/promote?force=true", headers=AUTH)
        assert forced.status_code == 200 and forced.json()["loaded_version"] == "3"
        assert forced.json()["waived"], "the overridden reasons are reported"


async def test_lifecycle_endpoints_need_the_token(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        for path in ("/admin/models/digits/versions/2/promote", "/admin/models/digits/rollback"):
            assert (await running.client.post(path)).status_code == 401
            assert (await running.client.post(path, headers={"Authorization": "Bearer nope"})).status_code == 403


async def test_a_degraded_version_is_refused_by_its_measured_accuracy_and_rollback_restores_answers(
    repository: Path,
) -> None:
    """A real degraded head, evaluated by `ai-backend eval`: the gate refuses it; forced in, its
    answers differ; one rollback call brings back exactly the answers v1 gave."""
    from app.lifecycle.evaluate import main as evaluate
    from tests.lifecycle_support import copy_version, degrade_head

    degrade_head(copy_version(repository, "3"), noise=0.5, seed=0)
    assert evaluate(["--repository", str(repository), "--model", "digits", "--version", "3"]) == 0
    assert evaluate(["--repository", str(repository), "--model", "digits", "--version", "1"]) == 0
    async with running_app(settings_for(repository)) as running:

        async def answers() -> list[list[float]]:
            replies = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in range(10)))
            return [[p["probability"] for p in r.json()["predictions"]] for r in replies]

        before = await answers()
        refused = await running.client.post("/admin/models/digits/versions/3/promote", headers=AUTH)
        assert refused.status_code == 409 and refused.json()["code"] == "promotion_refused"
        assert "accuracy" in refused.json()["message"]
        forced = await running.client.post("/admin/models/digits/versions/3/promote?force=true", headers=AUTH)
        assert forced.status_code == 200
        degraded = await answers()
        assert max(abs(a - b) for x, y in zip(degraded, before, strict=True) for a, b in zip(x, y, strict=True)) > 1e-3
        rolled = await running.client.post("/admin/models/digits/rollback", headers=AUTH)
        assert rolled.status_code == 200 and rolled.json()["loaded_version"] == "1"
        restored = await answers()  # equal up to batch-size rounding
        assert [x for row in restored for x in row] == pytest.approx([x for row in before for x in row], abs=1e-5)


async def _uploading_to_version_2(running: RunningApp) -> tuple[asyncio.Future[httpx.Response], asyncio.Event, Any]:
    """A prediction pinned to version 2, its body half sent (the rest once the event is set),
    returned once it was admitted to version 2's batcher, its body on the way; and that batcher."""
    body_may_finish = asyncio.Event()
    png = sample_png(4)

    async def slow_body():  # type: ignore[no-untyped-def]  # still uploading when the unload comes
        yield png[:10]
        await body_may_finish.wait()
        yield png[10:]

    headers = {"Content-Type": "image/png", "X-Model-Version": "2", "X-Request-Timeout": "20000"}
    request = asyncio.ensure_future(running.client.post("/predict", content=slow_body(), headers=headers))
    batcher = running.service.groups["digits"].routing.loaded["2"].batcher
    async with asyncio.timeout(10):
        while batcher.intake._arriving == 0:  # noqa: ASYNC110 (routed to v2, admitted, its body on the way)
            await asyncio.sleep(0.005)
    return request, body_may_finish, batcher


async def test_a_request_routed_to_a_version_is_answered_though_the_version_is_unloaded_meanwhile(
    repository: Path,
) -> None:
    async with running_app(settings_for(repository)) as running:
        request, body_may_finish, batcher = await _uploading_to_version_2(running)
        unload = asyncio.ensure_future(running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH))
        async with asyncio.timeout(10):
            while "2" in running.service.groups["digits"].routing.loaded:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
        body_may_finish.set()
        response = await request
        assert response.status_code == 200 and response.json()["version"] == "2", response.text
        assert (await unload).status_code == 200, "the unload waited for it, then ended"
        assert not batcher.running


async def test_a_request_still_uploading_when_its_versions_grace_runs_out_is_told_the_version_went(
    repository: Path,
) -> None:
    """The unload's grace ends before the body does: the answer says the version was unloaded
    (503 ``version_not_loaded``), not that the service is shutting down (it is not), and the
    request is counted as dropped."""
    async with running_app(settings_for(repository)) as running:
        running.service.settings.server.shutdown_grace_s = 0.1
        request, body_may_finish, batcher = await _uploading_to_version_2(running)
        unload = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
        assert unload.status_code == 200 and not batcher.running, "the grace ran out"
        body_may_finish.set()
        response = await request
        assert response.status_code == 503, response.text
        assert response.json()["code"] == "version_not_loaded", response.text
        assert "version 2 of digits was unloaded" in response.json()["message"]
        assert response.headers["Retry-After"]
        assert (await running.client.get("/readyz")).status_code == 200
        metrics = (await running.client.get("/metrics")).text
        assert 'ai_backend_cancellations_total{reason="cancelled"} 1.0' in metrics.splitlines()


async def test_a_version_whose_load_ends_after_the_drain_began_is_not_served(
    repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with running_app(settings_for(repository)) as running:
        add_version(repository, "3")
        service = running.service
        loaded, release = asyncio.Event(), asyncio.Event()
        original = service.load_version

        async def slow_load(name: str, version: str):  # type: ignore[no-untyped-def]  # SIGTERM comes meanwhile
            served = await original(name, version)
            loaded.set()
            await release.wait()
            return served

        service.load_version = slow_load  # type: ignore[method-assign]
        load = asyncio.ensure_future(running.app.state.lifecycle.load("digits", "3"))
        await asyncio.wait_for(loaded.wait(), 30)
        await service.drain(5.0)
        release.set()
        with pytest.raises(ServiceError) as refused:
            await load
        assert (refused.value.status, refused.value.code) == (503, "draining")  # as every other call in a drain
        said = [r.getMessage() for r in caplog.records if r.name == "app.lifecycle.manager"]
        assert said == ["the load of digits/3 ended after the shutdown began: not served, released"], said
        assert [s.version for s in service.all_served() if s.batcher.running] == []
        assert 'version="3"' not in (await running.client.get("/metrics")).text
        later = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
        assert later.status_code == 503 and later.json()["code"] == "draining", later.text


async def test_a_rollback_and_an_unload_do_not_wait_for_a_load_under_way(repository: Path) -> None:
    """The load (its read, checks and warm-up: minutes for a big model) held the lifecycle's lock:
    the way out of a bad canary waited behind an unrelated load, however long it took."""
    async with running_app(settings_for(repository)) as running:
        add_version(repository, "3")
        service = running.service
        loaded, release = asyncio.Event(), asyncio.Event()
        original = service.load_version

        async def slow_load(name: str, version: str):  # type: ignore[no-untyped-def]
            served = await original(name, version)
            loaded.set()
            await release.wait()  # still warming up, say
            return served

        assert (await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)).status_code == 200
        service.load_version = slow_load  # type: ignore[method-assign]
        load = asyncio.ensure_future(running.client.post("/admin/models/digits/versions/3/load", headers=AUTH))
        again = asyncio.ensure_future(running.client.post("/admin/models/digits/versions/3/load", headers=AUTH))
        try:
            await asyncio.wait_for(loaded.wait(), 30)
            async with asyncio.timeout(10):  # not behind the load
                rollback = await running.client.post("/admin/models/digits/rollback", headers=AUTH)
                assert rollback.status_code == 200 and rollback.json()["loaded_version"] == "1", rollback.text
                unloaded = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
                assert unloaded.status_code == 200, unloaded.text
            assert not load.done() and not again.done()
        finally:
            release.set()
        first, second = await load, await again  # one load, its outcome given to both
        assert first.status_code == second.status_code == 200
        assert first.json()["loaded_versions"] == second.json()["loaded_versions"] == ["1", "3"]
        assert running.app.state.lifecycle.loads_under_way() == []


async def test_a_warm_up_past_the_loads_time_is_a_409_and_serving_goes_on(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the read and the checks were timed: a graph that crawls at the sizes its self-check
    does not run loaded in 10-15 s under a 1 s timeout."""
    async with running_app(settings_for(repository, warmup=True)) as running:
        add_version(repository, "3")
        running.service.settings.model.load_timeout_s = 1.0
        loader = running.service.loader
        original = loader.warm_size

        async def crawling(model, size: int) -> None:  # type: ignore[no-untyped-def]
            if model.folder.name == "3":
                await asyncio.sleep(30)  # the device thread at it, for all the event loop knows
            await original(model, size)

        monkeypatch.setattr(loader, "warm_size", crawling)
        async with asyncio.timeout(20):
            late = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert late.status_code == 409 and late.json()["code"] == "model_load_failed", late.text
        assert "load_timeout_s=1s with its warm-up" in late.json()["message"]
        assert (await running.predict_png(sample_png(5))).status_code == 200
        models = (await running.client.get("/v1/models")).json()
        assert "3" not in next(m for m in models["models"] if m["name"] == "digits")["loaded_versions"]


async def test_unloading_during_shutdown_lets_that_versions_requests_finish(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        service = running.service
        served = service.groups["digits"].routing.loaded["2"]
        runner = served.batcher._execution._runner

        async def slow_runner(payloads):  # type: ignore[no-untyped-def]  # v2's queue takes a while
            await asyncio.sleep(0.5)
            return await runner(payloads)

        served.batcher._execution._runner = slow_runner  # type: ignore[assignment]
        headers = {"X-Model-Version": "2", "X-Request-Timeout": "20000"}
        # enough that 8 still queue once every device thread holds a full batch
        count = service.threads.workers * service.settings.batching.normal.max_batch + 8
        requests = [
            asyncio.ensure_future(running.predict_png(sample_png(i % 10), headers=headers)) for i in range(count)
        ]
        async with asyncio.timeout(10):
            while served.batcher.batches < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
        unload = asyncio.ensure_future(running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH))
        async with asyncio.timeout(10):
            while "2" in service.groups["digits"].routing.loaded:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
        await service.close(5.0)  # SIGTERM while v2 drains: the device thread stops only after it
        responses = await asyncio.gather(*requests)
        assert (await unload).status_code == 200
        assert {r.status_code for r in responses} == {200}, [r.json() for r in responses if r.status_code != 200][:2]


async def _unloading_held(running: RunningApp, version: str) -> tuple[asyncio.Event, asyncio.Future[Any]]:
    """``version`` unloaded through the admin API, its drain held until the event is set: once
    it has left the routing, the event and the unload's call."""
    served = running.service.groups["digits"].routing.loaded[version]
    release, close = asyncio.Event(), served.batcher.close

    async def slow_close(grace_s: float | None = None) -> None:  # its queue takes a while to drain
        await release.wait()
        await close(grace_s)

    served.batcher.close = slow_close  # type: ignore[method-assign]
    path = f"/admin/models/digits/versions/{version}/unload"
    unload = asyncio.ensure_future(running.client.post(path, headers=AUTH))
    async with asyncio.timeout(10):
        while version in running.service.groups["digits"].routing.loaded:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
    return release, unload


def _loads_held(service: Any) -> tuple[asyncio.Event, asyncio.Event]:
    """Each version load's model ready and then held, not yet routed, until the second event is
    set; the first is set as one is ready."""
    loaded, release, original = asyncio.Event(), asyncio.Event(), service.load_version

    async def held_load(name: str, version: str):  # type: ignore[no-untyped-def]
        served = await original(name, version)
        loaded.set()
        await release.wait()
        return served

    service.load_version = held_load
    return loaded, release


async def test_reloading_a_version_while_its_last_copy_drains_keeps_its_model_info(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        release, unload = await _unloading_held(running, "2")
        assert (await running.client.post("/admin/models/digits/versions/2/load", headers=AUTH)).status_code == 200
        release.set()
        assert (await unload).status_code == 200
        info = [line for line in (await running.client.get("/metrics")).text.splitlines() if "model_info{" in line]
        assert any('version="2"' in line for line in info), info


async def test_a_version_reloaded_while_its_copy_drains_leaves_no_series_once_unloaded(repository: Path) -> None:
    """The drained copy left its run-time series alone (the labels were the new copy's), and the
    new copy, unloaded in turn, removed only the buckets it had run itself: the rest stayed."""
    async with running_app(settings_for(repository)) as running:
        pinned = await running.predict_png(sample_png(3), headers={"X-Model-Version": "2"})
        assert pinned.status_code == 200  # a batch of 1 on the first copy: its bucket's series
        release, unload = await _unloading_held(running, "2")
        assert (await running.client.post("/admin/models/digits/versions/2/load", headers=AUTH)).status_code == 200
        release.set()
        assert (await unload).status_code == 200
        again = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
        assert again.status_code == 200, again.text
        page = (await running.client.get("/metrics")).text
    left = [line for line in page.splitlines() if 'version="2"' in line and not line.startswith("#")]
    assert left == [], left


async def test_a_version_that_joins_the_routing_takes_the_policy_and_series_of_that_moment(
    repository: Path,
) -> None:
    """A policy change made while a load waited for the lifecycle's lock never reached the new
    version's batcher (it kept the old windows and bounds until the next change); and a copy of
    the same version that finished draining meanwhile removed the new copy's model_info."""
    async with running_app(settings_for(repository)) as running:
        service = running.service
        drained, unload = await _unloading_held(running, "2")
        loaded, release = _loads_held(service)
        load = asyncio.ensure_future(running.client.post("/admin/models/digits/versions/2/load", headers=AUTH))
        await asyncio.wait_for(loaded.wait(), 30)
        changed = await running.client.put("/admin/policy", headers=AUTH, json={"normal": {"max_queue": 77}})
        assert changed.status_code == 200, changed.text
        drained.set()  # the old copy's drain ends now: it finds no copy of version 2 in the routing
        assert (await unload).status_code == 200
        release.set()
        assert (await load).status_code == 200
        new = service.groups["digits"].routing.loaded["2"]
        assert new.batcher.policy.normal.max_queue == 77 == service.policy.normal.max_queue
        info = [line for line in (await running.client.get("/metrics")).text.splitlines() if "model_info{" in line]
        assert any('version="2"' in line for line in info), info


async def test_a_version_loaded_across_a_larger_max_batch_warms_the_sizes_it_brought(repository: Path) -> None:
    """Warmed under the policy of its load's start, a version that joined after a larger max batch
    came in would set the new sizes up in live batches (on CUDA, a second each, batches held)."""
    async with running_app(settings_for(repository, warmup=True)) as running:
        service = running.service
        add_version(repository, "3")
        loaded, release = _loads_held(service)
        load = asyncio.ensure_future(running.client.post("/admin/models/digits/versions/3/load", headers=AUTH))
        await asyncio.wait_for(loaded.wait(), 30)
        largest = service.policy.largest_batch
        raised = {"normal": {"max_batch": 2 * largest, "max_queue": 4 * largest}}
        assert (await running.client.put("/admin/policy", headers=AUTH, json=raised)).status_code == 200
        release.set()
        assert (await load).status_code == 200
        assert service.rewarm.task is not None
        await asyncio.wait_for(service.rewarm.task, 30)
        model = service.groups["digits"].routing.loaded["3"].model
        assert 2 * largest in model.warmed, model.warmed


async def test_promotion_gates_on_the_loaded_manifest_when_the_file_is_gone(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        (repository / "digits" / "1" / "manifest.json").unlink()  # the default's folder changed under it
        promoted = await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)
        assert promoted.status_code == 200, promoted.text


async def test_a_version_whose_head_cannot_run_on_its_backbone_is_refused_at_load(
    repository: Path, tmp_path: Path
) -> None:
    async with running_app(settings_for(repository, warmup=True)) as running:
        misfit_head(add_version(repository, "3"), tmp_path / "other")
        refused = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert refused.status_code == 409 and refused.json()["code"] == "model_load_failed", refused.text
        assert "self-check failed, head classifier cannot run" in refused.json()["message"]
        assert (await running.predict_png(sample_png(5))).status_code == 200


@pytest.mark.parametrize("during", ["self-check", "warm-up"])
async def test_a_load_the_device_cannot_fit_is_a_503_its_memory_released_and_serving_goes_on(
    repository: Path, monkeypatch: pytest.MonkeyPatch, during: str
) -> None:
    """On a GPU a version loaded beside others may not fit: out of memory in its self-check or its
    warm-up is the device's, not a bug (it was a 500)."""
    settings = settings_for(repository, load_versions="latest", default_versions={}, warmup=True)
    async with running_app(settings) as running:
        add_version(repository, "3")
        real_features, real_warm_up = LayeredModel.features, LayeredModel.warm_up

        loaded: list[weakref.ref[LayeredModel]] = []

        def features(model: LayeredModel, images: torch.Tensor) -> torch.Tensor:
            if model.folder.name == "3":
                loaded.append(weakref.ref(model))
            if model.folder.name == "3" and during == "self-check":
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
            return real_features(model, images)

        def warm_up(model: LayeredModel, max_batch: int, rounds: int = 3, sizes: Sequence[int] | None = None) -> None:
            if model.folder.name == "3" and during == "warm-up":
                raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
            real_warm_up(model, max_batch, rounds, sizes)

        released: list[tuple[str, bool]] = []

        def release(device: torch.device) -> None:  # what the load held is gone by then, or nothing is released
            released.append((str(device), any(ref() is not None for ref in loaded)))

        monkeypatch.setattr(LayeredModel, "features", features)
        monkeypatch.setattr(LayeredModel, "warm_up", warm_up)
        monkeypatch.setattr("app.service.release_memory", release)
        refused = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert refused.status_code == 503 and refused.json()["code"] == "device_unavailable", refused.text
        assert refused.headers["Retry-After"] == "5" and "digits/3" in refused.json()["message"]
        assert released == [("cpu", False)] and loaded
        still = await running.predict_png(sample_png(5))
        assert still.status_code == 200 and still.json()["version"] == "2"
        monkeypatch.setattr(LayeredModel, "features", real_features)
        monkeypatch.setattr(LayeredModel, "warm_up", real_warm_up)
        loaded = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert loaded.status_code == 200 and loaded.json()["loaded_versions"] == ["2", "3"], loaded.text


async def test_a_load_refused_for_its_files_releases_on_a_gpu_what_it_had_moved_there(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version whose head does not fit its backbone is refused (409) after its backbone was
    built on the device: on a GPU the cached blocks are released, once nothing holds them."""
    settings = settings_for(repository, load_versions="latest", default_versions={}, warmup=True)
    async with running_app(settings) as running:
        broken = add_version(repository, "3")
        misfit_head(broken, repository.parent / "other")
        loaded: list[weakref.ref[LayeredModel]] = []
        real_head = LayeredModel.head

        def head(model: LayeredModel, name: str | None = None) -> torch.jit.ScriptModule:
            loaded.append(weakref.ref(model))
            return real_head(model, name)

        released: list[bool] = []
        monkeypatch.setattr(LayeredModel, "head", head)
        monkeypatch.setattr("app.service.release_memory", lambda device: released.append(loaded[0]() is None))
        refused = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert refused.status_code == 409 and refused.json()["code"] == "model_load_failed", refused.text
        assert "classifier" in refused.json()["message"]
        assert released == [True], "released, and only once the refused model was gone"


async def test_a_version_that_is_not_the_default_and_fails_shows_in_healthz_without_failing_the_probes(
    repository: Path, tmp_path: Path
) -> None:
    """A canary whose head cannot run: pinned requests get 503, the default serves on; /healthz lists
    every loaded version and says degraded (200), /readyz stays 200 (the default traffic is served)."""
    misfit_head(repository / "digits" / "2", tmp_path / "other")
    async with running_app(settings_for(repository, warmup=False)) as running:
        pinned = await running.predict_png(sample_png(5), headers={"X-Model-Version": "2"})
        assert pinned.status_code == 503 and pinned.json()["code"] == "model_unavailable", pinned.text
        assert (await running.predict_png(sample_png(5))).status_code == 200
        health = await running.client.get("/healthz")
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        models = {(m["version"], m["default"]): m for m in health.json()["models"]}
        assert set(models) == {("1", True), ("2", False)}
        assert "cannot run" in models["2", False]["failed_heads"]["classifier"]
        assert models["1", True]["failed_heads"] == {}
        assert (await running.client.get("/readyz")).status_code == 200


async def test_a_promotion_is_judged_on_the_precision_the_version_serves_in_after_its_fallback(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Configured fp16 on a GPU, version 2 fell back to the CPU: it serves fp32, and its figures
    for fp32 are the ones that decide (the gate took the configured precision)."""
    settings = settings_for(repository, cpu_fallback=True, fallback_after_failures=1)
    async with running_app(settings) as running:
        service = running.service
        monkeypatch.setattr(service, "dtype", torch.float16)
        candidate = service.groups["digits"].routing.loaded["2"]
        candidate.runner.model = DeviceLost(candidate.model)  # type: ignore[assignment]
        pinned = await running.predict_png(sample_png(5), headers={"X-Model-Version": "2"})
        assert pinned.status_code == 200 and candidate.runner.degraded
        judged: list[str] = []

        def check_promotion(candidate: object, current: object, precision: str, *margins: float) -> list[str]:
            judged.append(precision)
            return []

        monkeypatch.setattr("app.lifecycle.manager.check_promotion", check_promotion)
        promoted = await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)
        assert promoted.status_code == 200, promoted.text
        assert judged == ["fp32"]


async def test_a_lazily_loaded_head_that_fails_turns_the_probes_and_is_not_loaded_again(
    repository: Path, tmp_path: Path
) -> None:
    misfit_head(repository / "digits" / "1", tmp_path / "other")  # the default: start-up cannot tell with warmup off
    async with running_app(settings_for(repository, warmup=False)) as running:
        assert (await running.client.get("/readyz")).status_code == 200
        for _ in range(3):
            failed = await running.predict_png(sample_png(5))
            assert failed.status_code == 503 and failed.json()["code"] == "model_unavailable", failed.text
        assert running.service.models["digits"].model.head_loads == 0
        ready = await running.client.get("/readyz")
        assert ready.status_code == 503 and "head failed to load" in ready.json()["message"]
        health = await running.client.get("/healthz")
        assert health.status_code == 503 and health.json()["status"] == "failing"
        assert "cannot run" in health.json()["models"][0]["failed_heads"]["classifier"]


async def test_a_lazily_loaded_head_whose_file_cannot_be_read_fails_healthz_until_it_loads(repository: Path) -> None:
    """Its requests get 503 and it is tried again on the next one; /healthz says why meanwhile
    (it said ok while every prediction failed)."""
    head = repository / "digits" / "1" / "classifier.safetensors"
    placed = (str(repository), str(repository.resolve()))  # noqa: ASYNC240 - a stat or two, in a test
    async with running_app(settings_for(repository, warmup=False)) as running:
        saved = head.read_bytes()
        head.unlink()
        failed = await running.predict_png(sample_png(5))
        assert failed.status_code == 503, failed.text
        health = await running.client.get("/healthz")
        assert health.status_code == 503 and health.json()["status"] == "failing"
        default = next(m for m in health.json()["models"] if m["default"])
        why = default["unreadable_heads"]["classifier"]
        assert "digits/1/classifier.safetensors" in why, why
        assert not any(path in why for path in placed), "named within the repository"
        head.write_bytes(saved)
        assert (await running.predict_png(sample_png(5))).status_code == 200
        health = await running.client.get("/healthz")
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text


async def test_a_version_changed_on_disk_since_its_load_is_not_promoted(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        # re-exported in place after its load: the manifest on disk describes other files now
        # (with better figures, say), while the weights loaded stay what they were
        folder = repository / "digits" / "2"
        manifest = json.loads((folder / "manifest.json").read_text())
        weights = folder / "classifier.safetensors"
        weights.write_bytes(weights.read_bytes()[:-4] + b"\x00\x00\x00\x00")
        manifest["files"]["classifier.safetensors"] = sha256_file(weights)
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
        for query in ("", "?force=true"):
            refused = await running.client.post(f"/admin/models/digits/versions/2/promote{query}", headers=AUTH)
            assert refused.status_code == 409 and refused.json()["code"] == "version_changed", refused.text
        assert (await running.predict_png(sample_png(3))).json()["version"] == "1"


async def test_a_version_whose_labels_changed_on_disk_or_whose_head_no_longer_loads_is_not_promoted(
    repository: Path,
) -> None:
    """Only the files were compared: labels edited by hand (as the README tells after export
    --num-classes) promoted a version that still served the old ones; and with the warm-up off, a
    head file replaced under an unchanged manifest passed, then failed its checksum on the first
    request after the promotion, every unpinned request a 503 and /readyz with them."""
    async with running_app(settings_for(repository, warmup=False)) as running:
        folder = repository / "digits" / "2"
        saved = (folder / "manifest.json").read_text()
        manifest = json.loads(saved)
        manifest["labels"][7] = "seven"
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
        relabelled = await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)
        (folder / "manifest.json").write_text(saved)
        weights = folder / "classifier.safetensors"
        weights.write_bytes(weights.read_bytes()[:-4] + b"\x00\x00\x00\x00")  # its manifest unchanged
        replaced = await running.client.post("/admin/models/digits/versions/2/promote", headers=AUTH)
        served = await running.predict_png(sample_png(3))
        ready = await running.client.get("/readyz")
    for refused in (relabelled, replaced):
        assert refused.status_code == 409 and refused.json()["code"] == "version_changed", refused.text
    assert "head does not load" in replaced.json()["message"]
    assert served.status_code == 200 and served.json()["version"] == "1"
    assert ready.status_code == 200


async def test_a_version_removed_from_disk_then_unloaded_is_a_404_to_pin(repository: Path) -> None:
    """The known versions were read again only by a load: pinned, it was a 503 with Retry-After,
    telling clients to retry a version that cannot come back, until some other admin call."""
    async with running_app(settings_for(repository)) as running:
        await asyncio.to_thread(shutil.rmtree, repository / "digits" / "2")
        unloaded = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
        pinned = await running.predict_png(sample_png(3), headers={"X-Model-Version": "2"})
        listed = (await running.client.get("/v1/models/digits")).json()
    assert unloaded.status_code == 200, unloaded.text
    assert pinned.status_code == 404 and pinned.json()["code"] == "version_not_found", pinned.text
    assert "retry-after" not in pinned.headers
    assert "2" not in listed["versions"], listed


async def test_an_unreadable_repository_is_a_503_to_the_admin_and_serving_goes_on(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        assert (await running.predict_png(sample_png(6))).status_code == 200  # its head loaded
        moved = repository.with_name(repository.name + "-away")
        await asyncio.to_thread(repository.rename, moved)  # the volume unmounted under the running service
        try:
            refused = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
            assert refused.status_code in (200, 409)  # unloading needs no listing
            answer = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
            assert answer.status_code == 503 and answer.json()["code"] == "repository_unavailable", answer.text
            assert "retry-after" in answer.headers
            assert (await running.predict_png(sample_png(6))).status_code == 200
        finally:
            await asyncio.to_thread(moved.rename, repository)


async def test_an_unloaded_versions_queue_is_scraped_while_it_drains(repository: Path) -> None:
    """Its requests still wait in its queue: a scrape that left it out read an empty queue while
    they did (an autoscaler on the queue depth would have scaled down under them)."""
    async with running_app(settings_for(repository)) as running:
        service = running.service
        served = service.groups["digits"].routing.loaded["2"]
        runner, release = served.batcher._execution._runner, asyncio.Event()

        async def held_runner(payloads):  # type: ignore[no-untyped-def]  # v2's device holds its queue
            await release.wait()
            return await runner(payloads)

        served.batcher._execution._runner = held_runner  # type: ignore[assignment]
        headers = {"X-Model-Version": "2", "X-Request-Timeout": "20000"}
        # enough that 8 still queue once every device thread holds a full batch
        count = service.threads.workers * service.settings.batching.normal.max_batch + 8
        requests = [
            asyncio.ensure_future(running.predict_png(sample_png(i % 10), headers=headers)) for i in range(count)
        ]
        async with asyncio.timeout(10):
            while served.batcher.depth(Lane.NORMAL) < 8:  # noqa: ASYNC110 (batches out, the rest queued)
                await asyncio.sleep(0.005)
        unload = asyncio.ensure_future(running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH))
        async with asyncio.timeout(10):
            while "2" in service.groups["digits"].routing.loaded:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
        scraped = (await running.client.get("/metrics")).text
        depth = [
            line
            for line in scraped.splitlines()
            if line.startswith("ai_backend_queue_depth{") and 'version="2"' in line
        ]
        bound = [
            line
            for line in scraped.splitlines()
            if line.startswith("ai_backend_queue_capacity{") and 'version="2"' in line
        ]
        release.set()
        responses = await asyncio.gather(*requests)
        assert (await unload).status_code == 200
        assert {r.status_code for r in responses} == {200}
        normal = [line for line in depth if 'lane="normal"' in line]
        assert len(normal) == 1 and float(normal[0].rsplit(" ", 1)[1]) >= 8, depth
        assert len(bound) == 2, bound
        after = (await running.client.get("/metrics")).text
        assert not any(
            line.startswith("ai_backend_queue_depth{") and 'version="2"' in line for line in after.splitlines()
        )
        for counter in ("ai_backend_batch_failures_total{", "ai_backend_device_faults_total{"):
            assert any(line.startswith(counter) and 'version="1"' in line for line in after.splitlines())
        # version 2 ran batches: its run times had a series per batch-size bucket, left behind forever
        for series in ("ai_backend_batch_failures_total{", "ai_backend_device_faults_total{", "ai_backend_inference"):
            assert not any(line.startswith(series) and 'version="2"' in line for line in after.splitlines()), series
        timed = [labels for metric, labels in served.metrics.series() if metric is running.app.state.metrics.inference]
        assert timed, "it ran batches: its run times had series, at the buckets it ran"


async def test_a_load_past_its_timeout_is_a_409_and_other_loads_wait_for_it_with_a_503(
    repository: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_app(settings_for(repository)) as running:
        add_version(repository, "3")
        running.service.settings.model.load_timeout_s = 1.0
        loads = StuckLoads(monkeypatch)
        try:
            late = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
            assert late.status_code == 409 and late.json()["code"] == "model_load_failed"
            assert "load_timeout_s=1s" in late.json()["message"]
            assert await asyncio.to_thread(loads.started.wait, 30), "it had started: it runs on"
            again = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
            assert again.status_code == 503 and again.json()["code"] == "model_loading"
            assert again.headers["Retry-After"] == "1"
            served = await running.predict_png(sample_png(5))
            assert served.status_code == 200, "serving goes on meanwhile"
            health = await running.client.get("/healthz")
            assert health.status_code == 200 and health.json()["loading"] == ["digits/3"]
        finally:
            loads.gate.set()
        loads.restore()
        async with asyncio.timeout(30):  # the late load ends: its model dropped, loads work again
            loaded = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
            while loaded.status_code == 503:  # noqa: ASYNC110 (the end is a log line)
                await asyncio.sleep(0.02)
                loaded = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert loaded.status_code == 200 and loaded.json()["loaded_versions"] == ["1", "2", "3"]
        assert (await running.client.get("/healthz")).json()["loading"] == []
    ended = [r.getMessage() for r in caplog.records if "what it loaded was dropped" in r.getMessage()]
    assert len(ended) == 1 and ended[0].startswith("the load of digits/3, given up after model.load_timeout_s=1s,")


async def test_a_start_up_load_a_close_cancelled_says_so_when_it_ends(
    repository: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A thread cannot be stopped: a load running when the close cancelled start-up goes on, and its
    end is logged with why it was given up (not as a timeout it never had)."""
    loads = StuckLoads(monkeypatch)
    opening = threading.Timer(1.0, loads.gate.set)  # the load ends while the close waits for its thread
    try:
        async with running_app(settings_for(repository), wait=False) as running:
            assert await asyncio.to_thread(loads.started.wait, 30)
            assert running.service.state.value == "starting"
            opening.start()
    finally:
        loads.gate.set()
        opening.cancel()
    ended = [r.getMessage() for r in caplog.records if "what it loaded was dropped" in r.getMessage()]
    assert len(ended) == 1, ended
    assert ended[0].startswith("the load of digits/"), ended
    assert ", cancelled as start-up stopped, ended " in ended[0], ended


async def test_a_close_waits_for_an_admin_load_whose_caller_went_away(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load goes on without its caller (it is shielded); the close awaits it before closing the
    service, so what it loads is closed with the rest, not left running as the loop ends."""
    closing: list[list[asyncio.Future[Any]]] = []
    async with running_app(settings_for(repository)) as running:
        add_version(repository, "3")
        loads = StuckLoads(monkeypatch)
        call = asyncio.ensure_future(running.client.post("/admin/models/digits/versions/3/load", headers=AUTH))
        assert await asyncio.to_thread(loads.started.wait, 30)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        lifecycle, service = running.app.state.lifecycle, running.service
        assert len(lifecycle.loads_under_way()) == 1, "the caller went, the load did not"
        close = service.close

        async def close_after_the_loads(grace_s: float) -> None:
            closing.append(lifecycle.loads_under_way())
            await close(grace_s)

        monkeypatch.setattr(service, "close", close_after_the_loads)
        threading.Timer(1.0, loads.gate.set).start()  # the load ends while the close waits for it
    assert closing == [[]]
    assert loads.calls == 1 and len(loads.made) == 1, "it ran to its end, once"


async def test_an_admin_call_before_the_service_is_ready_is_told_to_retry_as_a_prediction_is(
    repository: Path,
) -> None:
    """Both are 503 ``model_not_ready``: the admin API said Retry-After 1 where predictions say 5."""
    from app.service import State

    async with running_app(settings_for(repository)) as running:
        running.service.state = State.STARTING  # as before its first load ended
        try:
            admin = await running.client.post("/admin/models/digits/versions/1/promote", headers=AUTH)
            predicted = await running.predict_png(sample_png(5))
        finally:
            running.service.state = State.READY
    for answer in (admin, predicted):
        assert answer.status_code == 503 and answer.json()["code"] == "model_not_ready", answer.text
    assert admin.headers["Retry-After"] == predicted.headers["Retry-After"] == "5"
