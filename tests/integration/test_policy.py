"""Runtime policy: the authenticated admin API and the config file, applied from the next batch."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from app.settings import SettingsError, load_settings
from tests.conftest import SettingsFactory
from tests.support import MODEL_NAME, running_app, sample_png

TOKEN = "s3cret-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def admin_settings(make_settings: SettingsFactory, **extra: object):  # type: ignore[no-untyped-def]
    return make_settings(
        admin={"enabled": True, "token": TOKEN, "config_watch_s": 0},
        server={"default_timeout_ms": 60_000},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": 8, "max_queue": 64}},
        **extra,
    )


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "unauthorized"),
        ({"Authorization": TOKEN}, 401, "unauthorized"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, 401, "unauthorized"),
        ({"Authorization": "Bearer wrong-token-wrong-token"}, 403, "forbidden"),
        ({"Authorization": f"Bearer {TOKEN}x"}, 403, "forbidden"),
    ],
)
async def test_the_admin_api_needs_the_token(
    make_settings: SettingsFactory, headers: dict[str, str], status: int, code: str
) -> None:
    async with running_app(admin_settings(make_settings)) as running:
        for method, path in (("GET", "/admin/policy"), ("PUT", "/admin/policy"), ("POST", "/admin/policy/reload")):
            response = await running.client.request(method, path, headers=headers, json={})
            assert response.status_code == status, (method, path, response.text)
            assert response.json()["code"] == code
        assert (await running.client.get("/admin/policy", headers=AUTH)).status_code == 200


async def test_a_policy_change_applies_from_the_next_batch(make_settings: SettingsFactory) -> None:
    async with running_app(admin_settings(make_settings)) as running:
        changed = await running.client.put("/admin/policy", headers=AUTH, json={"normal": {"max_batch": 2}})
        assert changed.status_code == 200, changed.text
        assert changed.json()["normal"] == {"window_ms": 20_000.0, "max_batch": 2, "max_queue": 64}
        assert running.service.models[MODEL_NAME].batcher.policy.normal.max_batch == 2
        responses = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in range(4)))
        assert [r.json()["batch_size"] for r in responses] == [2, 2, 2, 2], "full at the new max, not the old 8"
        assert (await running.client.get("/admin/policy", headers=AUTH)).json() == changed.json()


@pytest.mark.parametrize(
    "patch",
    [
        {"normal": {"window_ms": 0}},
        {"normal": {"max_batch": 0}},
        {"normal": {"max_batch": 100, "max_queue": 10}},
        {"urgent": {"window_ms": 50_000}},
        {"normal": {"window_ms": 90_000}},  # not shorter than the 60 s default deadline
        {"lanes": 3},
        {"urgent_fill": "sometimes"},
    ],
)
async def test_an_invalid_change_is_refused_and_the_old_policy_stays(
    make_settings: SettingsFactory, patch: dict[str, object]
) -> None:
    async with running_app(admin_settings(make_settings)) as running:
        before = (await running.client.get("/admin/policy", headers=AUTH)).json()
        refused = await running.client.put("/admin/policy", headers=AUTH, json=patch)
        assert refused.status_code == 422, refused.text
        assert refused.json()["code"] == "validation_error" and "old one stays" in refused.json()["message"]
        assert (await running.client.get("/admin/policy", headers=AUTH)).json() == before
        assert running.service.models[MODEL_NAME].batcher.policy.normal.max_batch == 8


async def test_without_admin_enabled_there_is_no_admin_api(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings()) as running:
        assert (await running.client.get("/admin/policy", headers=AUTH)).status_code == 404


def test_admin_enabled_without_a_token_stops_start_up() -> None:
    with pytest.raises(SettingsError, match="admin.enabled needs admin.token"):
        load_settings(admin={"enabled": True})


async def test_the_token_can_come_from_a_file(make_settings: SettingsFactory, tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    settings = make_settings(admin={"enabled": True, "token_file": secret, "config_watch_s": 0})
    async with running_app(settings) as running:
        assert (await running.client.get("/admin/policy", headers=AUTH)).status_code == 200


CONFIG = """
[batching.normal]
window_ms = {window}
max_batch = {batch}
max_queue = 64
"""


async def test_editing_the_config_file_changes_the_policy_without_restart(
    make_settings: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "service.toml"
    config.write_text(CONFIG.format(window=20000.0, batch=8))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    settings = make_settings(
        admin={"enabled": True, "token": TOKEN, "config_watch_s": 0.05}, server={"default_timeout_ms": 60_000}
    )
    async with running_app(settings) as running:
        batcher = running.service.models[MODEL_NAME].batcher
        config.write_text(CONFIG.format(window=20000.0, batch=3))
        os.utime(config, (1, 1))  # a different mtime, whatever the file system's resolution
        async with asyncio.timeout(10):
            while batcher.policy.normal.max_batch != 3:  # noqa: ASYNC110 - the watcher has no event to wait on
                await asyncio.sleep(0.02)
        responses = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in range(3)))
        assert [r.json()["batch_size"] for r in responses] == [3, 3, 3]

        config.write_text(CONFIG.format(window=0, batch=3))  # invalid: the old policy stays
        os.utime(config, (2, 2))
        reload = await running.client.post("/admin/policy/reload", headers=AUTH)
        assert reload.status_code == 422 and "window_ms" in reload.json()["message"]
        assert batcher.policy.normal.max_batch == 3
        assert (await running.client.get("/admin/policy", headers=AUTH)).json()["normal"]["max_batch"] == 3


async def test_sighup_rereads_the_config_file(
    make_settings: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "service.toml"
    config.write_text(CONFIG.format(window=20000.0, batch=8))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    settings = make_settings(admin={"config_watch_s": 0}, server={"default_timeout_ms": 60_000})
    async with running_app(settings) as running:
        batcher = running.service.models[MODEL_NAME].batcher
        config.write_text(CONFIG.format(window=20000.0, batch=5))
        os.kill(os.getpid(), signal.SIGHUP)
        async with asyncio.timeout(10):
            while batcher.policy.normal.max_batch != 5:  # noqa: ASYNC110 - the reload has no event to wait on
                await asyncio.sleep(0.02)
