"""Model lifecycle through the admin API, under load: load, canary, promote, roll back, unload."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import shutil
import weakref
from pathlib import Path

import pytest

from app.settings import Settings
from tests.support import build_settings, running_app, sample_png, truncate_file

TOKEN = "lifecycle-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]


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


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "models" / "digits" / "1", tmp_path / "digits" / "1")
    add_version(tmp_path, "2")
    return tmp_path


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


async def test_the_canary_split_stays_within_statistical_bounds(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        answer = await running.client.put("/admin/models/digits/canary", headers=AUTH, json={"weights": {"2": 0.25}})
        assert answer.status_code == 200 and answer.json()["canary"] == {"2": 0.25}
        n = 600
        responses = await asyncio.gather(*(running.predict_png(sample_png(i % 10)) for i in range(n)))
        share = sum(r.json()["version"] == "2" for r in responses) / n
        bound = 5 * math.sqrt(0.25 * 0.75 / n)  # five standard deviations: a flake once in millions of runs
        assert abs(share - 0.25) < bound, share
        off = await running.client.put("/admin/models/digits/canary", headers=AUTH, json={"weights": {}})
        assert off.status_code == 200
        assert {(await running.predict_png(sample_png(1))).json()["version"] for _ in range(20)} == {"1"}
        for bad in ({"1": 0.5}, {"7": 0.1}, {"2": 1.5}):
            refused = await running.client.put("/admin/models/digits/canary", headers=AUTH, json={"weights": bad})
            assert refused.status_code in (409, 422), (bad, refused.text)


async def test_a_version_added_while_serving_can_be_loaded_and_a_corrupt_one_is_refused(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        add_version(repository, "3")
        loaded = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert loaded.status_code == 200 and loaded.json()["loaded_versions"] == ["1", "2", "3"]
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


async def test_unloading_drains_and_the_default_cannot_go(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        refused = await running.client.post("/admin/models/digits/versions/1/unload", headers=AUTH)
        assert refused.status_code == 409 and "promote another first" in refused.json()["message"]
        unloaded = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
        assert unloaded.status_code == 200 and unloaded.json()["loaded_versions"] == ["1"]
        gone = await running.predict_png(sample_png(2), headers={"X-Model-Version": "2"})
        assert gone.status_code == 503 and gone.json()["code"] == "version_not_loaded"
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
