"""Runtime policy: the authenticated admin API and the config file, applied from the next batch."""

from __future__ import annotations

import asyncio
import errno
import functools
import itertools
import json
import logging
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from app.errors import SchemaError
from app.policy import PolicyManager
from app.settings import SettingsError, file_stamp, load_settings, read_settings
from tests.conftest import SettingsFactory
from tests.support import MODEL_NAME, PulledBody, running_app, sample_png

TOKEN = "s3cret-admin-token-0123456789"
BIGGER = {"normal": {"max_batch": 64, "max_queue": 64}}  # a bigger max batch than the tests' policy
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def until_entered(entered: asyncio.Event, caller: asyncio.Future[bool]) -> None:
    """Until a patched function says it was entered (``entered``, set through the loop), bounded;
    failing at once if ``caller`` ends first: then the patch no longer applies, and the test,
    which slows that function to open its race, would prove nothing."""
    waiting = asyncio.ensure_future(entered.wait())
    try:
        await asyncio.wait({waiting, caller}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    assert entered.is_set(), "the patched function was never called: the patch no longer applies"


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
        metrics = (await running.client.get("/metrics")).text
    # refused before the router, labelled as the router would have
    assert f'route="/admin/policy",status="{status}"' in metrics
    assert f'route="/admin/policy/reload",status="{status}"' in metrics
    assert 'route="unmatched"' not in metrics


async def test_a_policy_change_applies_from_the_next_batch(make_settings: SettingsFactory) -> None:
    async with running_app(admin_settings(make_settings)) as running:
        patch = {"normal": {"max_batch": 2}, "urgent_fill_backlog": 3}
        changed = await running.client.put("/admin/policy", headers=AUTH, json=patch)
        assert changed.status_code == 200, changed.text
        assert changed.json()["normal"] == {"window_ms": 20_000.0, "max_batch": 2, "max_queue": 64}
        policy = running.service.models[MODEL_NAME].batcher.policy
        assert policy.normal.max_batch == 2 and policy.urgent_fill_backlog == 3
        responses = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in range(4)))
        assert [r.json()["batch_size"] for r in responses] == [2, 2, 2, 2], "full at the new max, not the old 8"
        assert (await running.client.get("/admin/policy", headers=AUTH)).json() == changed.json()


# the warm-up at start runs up to the urgent lane's 16: the smallest, the largest and one between, or
# every padded size; then 64: its own sizes, those not run yet
@pytest.mark.parametrize(
    ("pad", "before", "after"), [("off", {1, 8, 16}, {32, 64}), ("on", {1, 2, 4, 8, 16}, {32, 64})]
)
async def test_a_bigger_max_batch_is_warmed_while_serving(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture, pad: str, before: set[int], after: set[int]
) -> None:
    """A policy raising the max batch brings sizes the device never ran (on CUDA each costs its
    set-up, about a second, on the first batch at it): they are warmed in the background."""
    settings = admin_settings(make_settings, model={"warmup": True, "pad_batches": pad})
    caplog.set_level(logging.INFO, logger="app.rewarm")  # the task may end before the request's answer
    async with running_app(settings) as running:
        model = running.service.models[MODEL_NAME].runner.model
        assert model.warmed == before
        changed = await running.client.put("/admin/policy", headers=AUTH, json=BIGGER)
        assert changed.status_code == 200, changed.text
        warming = running.service.rewarm.task
        assert warming is not None
        answered = await running.predict_png(sample_png(5), headers={"X-Urgency": "high"})
        assert answered.status_code == 200, "served while it warms"
        await asyncio.wait_for(warming, 30)
        assert model.warmed == before | after
        assert f"warmed {MODEL_NAME}/1 at batch sizes {sorted(after)} for the new policy" in caplog.text, "only those"
        caplog.clear()
        lowered = await running.client.put("/admin/policy", headers=AUTH, json={"normal": {"max_batch": 4}})
        assert lowered.status_code == 200
        assert running.service.rewarm.task is not None
        await asyncio.wait_for(running.service.rewarm.task, 30)
        assert model.warmed == before | after and "warmed" not in caplog.text, "nothing new to warm"


LOWER = {"urgent": {"max_batch": 12}, "normal": {"max_batch": 12}}  # under the tests' 16, no power of two


async def test_a_lowered_max_batch_that_brings_a_new_padded_size_warms_it(make_settings: SettingsFactory) -> None:
    """Padded, batches of 9 to 12 run at 12 once the largest batch is 12: a shape never run."""
    settings = admin_settings(make_settings, model={"warmup": True, "pad_batches": "on"})
    async with running_app(settings) as running:
        model = running.service.models[MODEL_NAME].runner.model
        assert model.warmed == {1, 2, 4, 8, 16}
        changed = await running.client.put("/admin/policy", headers=AUTH, json=LOWER)
        assert changed.status_code == 200, changed.text
        warming = running.service.rewarm.task
        assert warming is not None, "a lowered max batch warms what it brings too"
        await asyncio.wait_for(warming, 30)
        assert model.warmed == {1, 2, 4, 8, 12, 16}


async def test_a_warm_up_runs_no_size_a_later_policy_no_longer_allows(make_settings: SettingsFactory) -> None:
    """Raised to 64, then lowered to 12 while 32 warms: 64 never runs (its memory is what the
    operator may have lowered the policy to spare), 12 does."""
    settings = admin_settings(make_settings, model={"warmup": True, "pad_batches": "on"})
    entered, release = threading.Event(), threading.Event()
    async with running_app(settings) as running:
        model = running.service.models[MODEL_NAME].runner.model
        warm_up, ran = model.warm_up, []

        def held(max_batch: int, rounds: int = 3, sizes: Sequence[int] = ()) -> None:
            entered.set()
            release.wait(10)
            ran.extend(sizes)
            warm_up(max_batch, rounds, sizes)

        model.warm_up = held
        assert (await running.client.put("/admin/policy", headers=AUTH, json=BIGGER)).status_code == 200
        first = running.service.rewarm.task
        assert first is not None
        assert await asyncio.to_thread(entered.wait, 10), "the warm-up of 32 began"
        assert (await running.client.put("/admin/policy", headers=AUTH, json=LOWER)).status_code == 200
        release.set()
        second = running.service.rewarm.task
        assert second is not None and second is not first
        await asyncio.wait_for(second, 30)
        assert first.cancelled()
        assert ran == [32, 12], "the size begun ends; then only what the policy in force brings"


async def test_a_warm_up_still_running_at_shutdown_is_cancelled(make_settings: SettingsFactory) -> None:
    settings = admin_settings(make_settings, model={"warmup": True})
    release = threading.Event()  # the device thread's warm-up call ends once the close cancelled the task
    async with running_app(settings) as running:
        model, rewarm = running.service.models[MODEL_NAME].runner.model, running.service.rewarm
        warm_up, close = model.warm_up, rewarm.close

        def held(*args: object, **kwargs: object) -> None:
            release.wait(10)
            warm_up(*args, **kwargs)

        async def close_then_release() -> None:
            await close()
            release.set()

        model.warm_up, rewarm.close = held, close_then_release
        changed = await running.client.put("/admin/policy", headers=AUTH, json=BIGGER)
        assert changed.status_code == 200, changed.text
        warming = rewarm.task
        assert warming is not None
    assert warming.cancelled(), "the lifespan's close ended it"
    assert release.is_set()


async def test_each_fill_mode_can_be_set_and_what_get_says_can_be_put_back(make_settings: SettingsFactory) -> None:
    async with running_app(admin_settings(make_settings)) as running:
        batcher = running.service.models[MODEL_NAME].batcher
        for given, mode in (("never", "never"), ("Always", "always"), ("backlog", "backlog"), (False, "never")):
            changed = await running.client.put("/admin/policy", headers=AUTH, json={"urgent_fill": given})
            assert changed.status_code == 200, changed.text
            assert changed.json()["urgent_fill"] == mode and batcher.policy.urgent_fill.value == mode
        document = (await running.client.get("/admin/policy", headers=AUTH)).json()
        again = await running.client.put("/admin/policy", headers=AUTH, json=document)
        assert again.status_code == 200 and again.json() == document, again.text
        refused = await running.client.put("/admin/policy", headers=AUTH, json={"urgent_fill": "sometimes"})
        assert "always, backlog or never" in refused.json()["message"], refused.text


@pytest.mark.parametrize(
    "patch",
    [
        {"normal": {"window_ms": 0}},
        {"urgent": {"window_ms": 5e-324}},  # valid as "above 0", but 0.0 s to the batcher
        {"normal": {"max_batch": 0}},
        {"normal": {"max_batch": 100, "max_queue": 10}},
        {"urgent": {"window_ms": 50_000}},
        {"normal": {"window_ms": 90_000}},  # not shorter than the 60 s default deadline
        {"lanes": 3},
        {"urgent_fill": "sometimes"},
        {"normal": {"max_batch": True}},  # JSON's true: not a batch of 1
        {"normal": {"window_ms": "10"}},  # a string: not 10 ms
        {"admission_headroom": True},
        {"urgent_fill_backlog": 0},
        {"urgent_fill_backlog": 1.5},
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


@pytest.mark.parametrize("given", [None, 3, ["always"]])
async def test_a_fill_mode_of_another_type_is_refused_naming_the_modes(
    make_settings: SettingsFactory, given: object
) -> None:
    async with running_app(admin_settings(make_settings)) as running:
        refused = await running.client.put("/admin/policy", headers=AUTH, json={"urgent_fill": given})
        assert refused.status_code == 422, refused.text
        # not "Input should be an instance of UrgentFill": a class name tells an operator nothing
        assert "must be always, backlog or never" in refused.json()["message"], refused.text


async def test_without_admin_enabled_there_is_no_admin_api(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings()) as running:
        assert (await running.client.get("/admin/policy", headers=AUTH)).status_code == 404


async def test_the_admin_token_guards_the_admin_api_only(make_settings: SettingsFactory) -> None:
    async with running_app(admin_settings(make_settings)) as running:
        assert (await running.client.get("/administrator")).status_code == 404, "not under /admin/"
        assert (await running.client.get("/admin")).status_code == 401


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


def watched_config(make_settings: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A config file (normal lane: 12 s window, batches of 8) the service reads and watches,
    with the admin API on; and the test's settings."""
    config = tmp_path / "service.toml"
    config.write_text(CONFIG.format(window=12000.0, batch=8))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    settings = make_settings(
        admin={"enabled": True, "token": TOKEN, "config_watch_s": 0.1}, server={"default_timeout_ms": 60_000}
    )
    return config, settings


async def test_editing_the_config_file_changes_the_policy_without_restart(
    make_settings: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, settings = watched_config(make_settings, tmp_path, monkeypatch)
    async with running_app(settings) as running:
        batcher = running.service.models[MODEL_NAME].batcher
        config.write_text(CONFIG.format(window=12000.0, batch=3))
        os.utime(config, (1, 1))  # a different mtime, whatever the file system's resolution
        await policy_becomes(running, 3)
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
    config.write_text(CONFIG.format(window=12000.0, batch=8))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    settings = make_settings(admin={"config_watch_s": 0}, server={"default_timeout_ms": 60_000})
    async with running_app(settings) as running:
        batcher = running.service.models[MODEL_NAME].batcher
        config.write_text(CONFIG.format(window=12000.0, batch=5))
        os.kill(os.getpid(), signal.SIGHUP)
        async with asyncio.timeout(10):
            while batcher.policy.normal.max_batch != 5:  # noqa: ASYNC110 - the reload has no event to wait on
                await asyncio.sleep(0.02)


TRUNCATED = "[batching.normal]\nwindow_ms = 12000.0\nmax_batch = "  # an editor's write half done


async def policy_becomes(running, max_batch: int) -> None:  # type: ignore[no-untyped-def]
    batcher = running.service.models[MODEL_NAME].batcher
    async with asyncio.timeout(10):
        while batcher.policy.normal.max_batch != max_batch:  # noqa: ASYNC110 - the watcher has no event
            await asyncio.sleep(0.02)


async def watcher_read(running, config: Path) -> None:  # type: ignore[no-untyped-def]
    """Until the watcher has read the file as it is now (and applied or refused it)."""
    async with asyncio.timeout(10):
        while running.app.state.policy._stamp != file_stamp(config):  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_a_file_that_is_not_toml_is_refused_and_the_watcher_goes_on(
    make_settings: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, settings = watched_config(make_settings, tmp_path, monkeypatch)
    async with running_app(settings) as running:
        config.write_text(TRUNCATED)
        os.utime(config, (1, 1))
        await watcher_read(running, config)  # and refused it
        watcher = next(t for t in asyncio.all_tasks() if t.get_name() == "config-watch")
        assert not watcher.done()
        reload = await running.client.post("/admin/policy/reload", headers=AUTH)
        assert reload.status_code == 422 and "cannot be read" in reload.json()["message"]
        # the admin API is the way left to change the policy now: it does not read the file
        changed = await running.client.put("/admin/policy", headers=AUTH, json={"normal": {"max_batch": 6}})
        assert changed.status_code == 200, changed.text
        assert running.service.models[MODEL_NAME].batcher.policy.normal.max_batch == 6
        config.write_text(CONFIG.format(window=12000.0, batch=3))  # the editor finishes
        os.utime(config, (2, 2))
        await policy_becomes(running, 3)
    # and the shutdown ran to its end (an exception out of a dead watcher stopped it before)
    assert running.service.state.value == "stopped"


async def test_a_write_in_place_is_read_once_it_is_whole(
    make_settings: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An editor that truncates the file and writes it again: a poll between the two sees an
    empty file, or half of one that is valid TOML (the other fields at their defaults)."""
    config, settings = watched_config(make_settings, tmp_path, monkeypatch)
    # polls far apart next to the test's own checks, each made within a poll of the one it follows
    settings = settings.model_copy(update={"admin": settings.admin.model_copy(update={"config_watch_s": 0.5})})
    async with running_app(settings) as running:
        policy = running.app.state.policy
        assert (await running.client.put("/admin/policy", headers=AUTH, json={"normal": {"max_batch": 2}})).is_success
        batcher = running.service.models[MODEL_NAME].batcher
        for partial, when in (("", 1), ("[batching.normal]\nwindow_ms = 12000.0\n", 2)):
            config.write_text(partial)
            os.utime(config, (when, when))
            async with asyncio.timeout(10):
                while policy._settling != file_stamp(config):  # noqa: ASYNC110 - seen by a poll
                    await asyncio.sleep(0.01)
            assert batcher.policy.normal.max_batch == 2, f"applied a file being written: {partial!r}"
        config.write_text(CONFIG.format(window=12000.0, batch=3) + "\n[logging]\nlevel = 'INFO'\n")
        os.utime(config, (3, 3))
        await policy_becomes(running, 3)
        config.write_text("")  # and an empty file that stays empty: refused, as a missing one is
        os.utime(config, (4, 4))
        await watcher_read(running, config)
        assert batcher.policy.normal.max_batch == 3
        reload = await running.client.post("/admin/policy/reload", headers=AUTH)
        assert reload.status_code == 422 and "is empty" in reload.json()["message"]


async def test_a_reload_checks_the_batching_against_the_live_settings(
    make_settings: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "service.toml"
    config.write_text("[server]\ndefault_timeout_ms = 1000\n" + CONFIG.format(window=5.0, batch=8))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    settings = make_settings(
        admin={"enabled": True, "token": TOKEN, "config_watch_s": 0}, server={"default_timeout_ms": 1000}
    )
    async with running_app(settings) as running:
        # a longer default deadline (for the next start) and a window that only it would allow
        config.write_text("[server]\ndefault_timeout_ms = 5000\n" + CONFIG.format(window=3000.0, batch=8))
        reload = await running.client.post("/admin/policy/reload", headers=AUTH)
        assert reload.status_code == 422 and "default_timeout_ms" in reload.json()["message"]
        assert running.service.models[MODEL_NAME].batcher.policy.normal.window_s < 1.0


async def test_an_admin_change_stays_until_the_files_batching_changes_or_a_reload_is_asked(
    make_settings: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, settings = watched_config(make_settings, tmp_path, monkeypatch)
    async with running_app(settings) as running:
        config.write_text(CONFIG.format(window=12000.0, batch=8) + "\n[logging]\nlevel = 'DEBUG'\n")
        os.utime(config, (1, 1))
        await watcher_read(running, config)  # the first read of the file: its batching is applied
        assert running.service.models[MODEL_NAME].batcher.policy.normal.window_s == 12.0
        assert (await running.client.put("/admin/policy", headers=AUTH, json={"normal": {"max_batch": 2}})).is_success
        config.write_text(CONFIG.format(window=12000.0, batch=8) + "\n[logging]\nlevel = 'INFO'\n")
        os.utime(config, (2, 2))
        await watcher_read(running, config)
        assert running.service.models[MODEL_NAME].batcher.policy.normal.max_batch == 2, "an edit elsewhere kept it"
        config.write_text(CONFIG.format(window=12000.0, batch=4))
        os.utime(config, (3, 3))
        await policy_becomes(running, 4)  # an edit of the batching itself wins
        assert (await running.client.put("/admin/policy", headers=AUTH, json={"normal": {"max_batch": 2}})).is_success
        reload = await running.client.post("/admin/policy/reload", headers=AUTH)  # asked for: the file wins
        assert reload.json()["normal"]["max_batch"] == 4


async def test_an_edit_while_the_service_starts_is_picked_up(
    make_settings: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "service.toml"
    config.write_text(CONFIG.format(window=12000.0, batch=8))
    os.utime(config, (1, 1))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    stamp = file_stamp(config)  # what `ai-backend serve` takes as it reads its settings
    settings = make_settings(
        admin={"enabled": True, "token": TOKEN, "config_watch_s": 0.1}, server={"default_timeout_ms": 60_000}
    )
    config.write_text(CONFIG.format(window=12000.0, batch=3))  # edited while torch imports, models load
    os.utime(config, (2, 2))
    async with running_app(settings, config_stamp=stamp) as running:
        await policy_becomes(running, 3)


async def test_reloads_run_one_at_a_time_on_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "service.toml"
    config.write_text(CONFIG.format(window=12000.0, batch=8))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    applied: list[tuple[int, int]] = []
    manager = PolicyManager(load_settings(), lambda b: applied.append((b.normal.max_batch, threading.get_ident())))
    real, loop, reads = load_settings, asyncio.get_running_loop(), itertools.count()
    first_read = asyncio.Event()

    def slow_first(**overrides: object):  # type: ignore[no-untyped-def]
        settings = real(**overrides)  # the file as it is now
        if next(reads) == 0:
            loop.call_soon_threadsafe(first_read.set)
            # a poll that read the old file just before the next edit: time for a reload that
            # did not wait for this one to read the new file and land first
            threading.Event().wait(0.3)
        return settings

    monkeypatch.setattr("app.settings.loading.load_settings", slow_first)
    config.write_text(CONFIG.format(window=12000.0, batch=4))
    older = asyncio.ensure_future(manager.reload(forced=False))
    await until_entered(first_read, older)
    config.write_text(CONFIG.format(window=12000.0, batch=5))
    newer = asyncio.ensure_future(manager.reload())  # SIGHUP after the second edit
    await asyncio.gather(older, newer)
    assert manager.current.normal.max_batch == 5, "the older read landed last"
    assert [size for size, _ in applied] == [4, 5]
    assert {thread for _, thread in applied} == {threading.get_ident()}, "applied on the event loop's thread"


async def test_the_command_lines_host_and_port_are_not_a_change_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "service.toml"
    config.write_text(CONFIG.format(window=12000.0, batch=8))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    overrides: dict[str, object] = {"port": 8123}
    live = load_settings(server=load_settings().server.model_dump() | overrides)  # as `serve --port 8123`
    manager = PolicyManager(live, lambda b: None, read=functools.partial(read_settings, overrides))
    with caplog.at_level(logging.WARNING, logger="app.policy"):
        await manager.reload()
    assert not [r for r in caplog.records if "need a restart" in r.getMessage()]
    config.write_text("[server]\nmax_top_k = 7\n" + CONFIG.format(window=12000.0, batch=8))
    with caplog.at_level(logging.WARNING, logger="app.policy"):
        await manager.reload()
    assert [r.getMessage() for r in caplog.records if "need a restart" in r.getMessage()] == [
        "config changes to server.max_top_k need a restart (only batching applies live)"
    ]


def second_version_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, asyncio.Event, asyncio.Event]:
    """A repository of two versions, and start-up held once version 1 loaded: the repository,
    the event set then, and the one that lets version 2 load."""
    from app.versions import VersionLoader
    from tests.lifecycle_support import copy_version
    from tests.support import copy_repository

    root = copy_repository(tmp_path)
    copy_version(root, "2")
    gate, first_loaded = asyncio.Event(), asyncio.Event()
    real_load = VersionLoader.load

    async def slow_load(self: VersionLoader, name: str, version: str, **options: bool):  # type: ignore[no-untyped-def]
        served = await real_load(self, name, version, **options)
        if version == "1":  # the next version takes its time
            first_loaded.set()
            await gate.wait()
        return served

    monkeypatch.setattr(VersionLoader, "load", slow_load)
    return root, first_loaded, gate


async def test_a_policy_change_while_versions_load_reaches_every_version(
    make_settings: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, first_loaded, gate = second_version_held(tmp_path, monkeypatch)
    settings = admin_settings(make_settings, model={"repository": root, "load_versions": "all"})
    async with running_app(settings, wait=False) as running:
        await asyncio.wait_for(first_loaded.wait(), 30)
        changed = await running.client.put("/admin/policy", headers=AUTH, json={"normal": {"max_batch": 2}})
        assert changed.status_code == 200
        gate.set()
        await running.wait_started()
        assert {s.version: s.batcher.policy.normal.max_batch for s in running.service.all_served()} == {"1": 2, "2": 2}


async def test_a_bigger_max_batch_set_while_the_service_starts_is_warmed_once_it_is_ready(
    make_settings: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raised while version 2 loads: version 1, warmed already under the old policy, lacks the
    new sizes. The change itself warms nothing while the service starts; start-up's end does."""
    root, first_loaded, gate = second_version_held(tmp_path, monkeypatch)
    settings = admin_settings(make_settings, model={"repository": root, "load_versions": "all", "warmup": True})
    async with running_app(settings, wait=False) as running:
        await asyncio.wait_for(first_loaded.wait(), 30)
        changed = await running.client.put("/admin/policy", headers=AUTH, json=BIGGER)
        assert changed.status_code == 200, changed.text
        gate.set()
        await running.wait_started()
        warming = running.service.rewarm.task
        assert warming is not None, "nothing warms the sizes version 1 lacks"
        await asyncio.wait_for(warming, 30)
        warmed = {s.version: s.model.warmed for s in running.service.all_served()}
        assert {32, 64} <= warmed["1"] and {32, 64} <= warmed["2"], warmed


async def test_the_admin_token_is_checked_before_any_body_is_read(make_settings: SettingsFactory) -> None:
    async with running_app(admin_settings(make_settings)) as running:
        malformed = await running.client.put(
            "/admin/policy", content=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert malformed.status_code == 401, "refused for its token, not parsed first"
        body = PulledBody()
        unread = await running.client.put("/admin/policy", content=body, headers={"Content-Type": "application/json"})
        assert unread.status_code == 401 and body.pulled < 64
        big = await running.client.put(
            "/admin/policy", headers={**AUTH, "Content-Type": "application/json"}, content=b" " * (1 << 20)
        )
        assert big.status_code == 413 and big.json()["code"] == "body_too_large"
        body = PulledBody()
        chunked = await running.client.put(
            "/admin/policy", content=body, headers={**AUTH, "Content-Type": "application/json"}
        )
        assert chunked.status_code == 411 and chunked.json()["code"] == "length_required" and body.pulled < 64
        assert (await running.client.put("/admin/policy", headers=AUTH, json={"normal": {"max_batch": 4}})).is_success


def test_a_config_file_that_is_not_toml_stops_serve_with_exit_code_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main

    config = tmp_path / "service.toml"
    config.write_text(TRUNCATED)
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    assert main(["serve"]) == 2
    assert "cannot be read" in capsys.readouterr().err


async def test_malformed_json_to_the_admin_api_is_a_400_as_to_predict(make_settings: SettingsFactory) -> None:
    headers = {**AUTH, "Content-Type": "application/json"}
    async with running_app(admin_settings(make_settings)) as running:
        answers = [
            await running.client.request(method, path, content=b"{not json", headers=headers)
            for method, path in (
                ("POST", "/predict"),
                ("PUT", "/admin/policy"),
                ("PUT", f"/admin/models/{MODEL_NAME}/canary"),
            )
        ]
    assert [(a.status_code, a.json()["code"]) for a in answers] == [(400, "invalid_json")] * 3


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
async def test_an_admin_body_that_is_not_json_is_a_415_as_to_predict(
    make_settings: SettingsFactory, content_type: str | None
) -> None:
    # ``curl -d`` without ``-H 'Content-Type: application/json'`` sends a form: FastAPI took the
    # body for a string and the answer was a 422 saying the JSON object was not a dictionary
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    body = b'{"normal": {"max_batch": 4}}'
    async with running_app(admin_settings(make_settings)) as running:
        answers = [
            await running.client.put(path, content=body, headers=headers)
            for path in ("/admin/policy", f"/admin/models/{MODEL_NAME}/canary")
        ]
        assert [(a.status_code, a.json()["code"]) for a in answers] == [(415, "unsupported_media_type")] * 2
        assert all(a.json()["request_id"] == a.headers["x-request-id"] for a in answers)
        assert "application/json" in answers[0].json()["message"]
        assert (await running.client.get("/admin/policy", headers=AUTH)).json()["normal"]["max_batch"] == 8
        # a route that takes no body is not refused for one; JSON under any of its names is taken
        assert (await running.client.post("/admin/policy/reload", content=b"x", headers=headers)).status_code == 200
        for json_type in ("application/json; charset=utf-8", "Application/JSON", "application/merge-patch+json"):
            taken = await running.client.put("/admin/policy", content=body, headers={**AUTH, "Content-Type": json_type})
            assert taken.status_code == 200, (json_type, taken.text)


async def test_json_nested_past_the_parsers_depth_is_a_400_invalid_json(make_settings: SettingsFactory) -> None:
    # json.loads gives up on deep nesting with a RecursionError, which FastAPI answers with its
    # own 400 "There was an error parsing the body": the envelope names it as any bad JSON
    deep = b"[" * 5_000 + b"]" * 5_000
    headers = {**AUTH, "Content-Type": "application/json"}
    async with running_app(admin_settings(make_settings)) as running:
        answer = await running.client.put("/admin/policy", content=deep, headers=headers)
        assert (answer.status_code, answer.json()["code"]) == (400, "invalid_json")
        assert answer.json()["request_id"] == answer.headers["x-request-id"]
        assert (await running.client.get("/admin/policy", headers=AUTH)).status_code == 200


async def test_an_admin_change_with_thousands_of_errors_lists_ten(make_settings: SettingsFactory) -> None:
    """Every error was listed: 5,000 unknown keys (59 KB) made a 194 KB answer, 6,000 bad canary
    weights (65 KB) a 557 KB one, as a prediction body's errors are no longer."""
    async with running_app(admin_settings(make_settings)) as running:
        policy = await running.client.put("/admin/policy", headers=AUTH, json={f"u{i}": 1 for i in range(5_000)})
        canary = await running.client.put(
            f"/admin/models/{MODEL_NAME}/canary", headers=AUTH, json={"weights": {str(i): "x" for i in range(6_000)}}
        )
        assert (await running.client.get("/admin/policy", headers=AUTH)).status_code == 200
    assert policy.status_code == 422 and len(policy.content) < 2_000, len(policy.content)
    assert policy.json()["message"].endswith("(5000 errors, the first 10 listed)")
    assert canary.status_code == 422 and len(canary.json()["details"]) == 10, len(canary.content)
    assert canary.json()["message"].endswith("(6000 errors, the first 10 listed)")


REVIEWED = """
[batching.normal]
window_ms = {window}
max_batch = {batch}
max_queue = 64
"""


@pytest.fixture
def reviewed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The config file, window 10 s and max batch 8, that the races below edit."""
    config = tmp_path / "service.toml"
    config.write_text(REVIEWED.format(window=10000.0, batch=8))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    return config


async def _reload_racing_an_admin_change(
    config: Path, monkeypatch: pytest.MonkeyPatch, edit: str, patch: dict[str, Any], applied: list[int] | None = None
) -> PolicyManager:
    """The watcher saw ``edit`` of the config file and is reading it (a slow disk, a busy machine:
    until this releases it, bounded); ``patch`` is PUT meanwhile. ``applied`` gets each max batch
    the manager applies, in order."""
    seen = [] if applied is None else applied
    manager = PolicyManager(load_settings(), lambda b: seen.append(b.normal.max_batch))
    real, loop = load_settings, asyncio.get_running_loop()
    reading, release = asyncio.Event(), threading.Event()

    def slow(**overrides: object):  # type: ignore[no-untyped-def]
        settings = real(**overrides)  # the file as edited
        loop.call_soon_threadsafe(reading.set)
        release.wait(10)
        return settings

    monkeypatch.setattr("app.settings.loading.load_settings", slow)
    config.write_text(edit)  # noqa: ASYNC240 - a few bytes, in a test
    polled = asyncio.ensure_future(manager.reload(forced=False))
    try:
        await until_entered(reading, polled)
        manager.update(patch)
    finally:
        release.set()
    await polled
    monkeypatch.setattr("app.settings.loading.load_settings", real)
    return manager


async def test_an_admin_change_made_while_a_reload_reads_the_file_is_not_lost(
    reviewed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher saw an edit (batch 4) and is reading the file; an admin then sets batch 2
    (200, GET says 2). The reload lands after and puts 4 back: the admin change, newer than
    the edit, is lost with no later edit of the file (README: it stays until the file's
    batching is edited)."""
    applied: list[int] = []
    edit = REVIEWED.format(window=10000.0, batch=4)
    manager = await _reload_racing_an_admin_change(reviewed, monkeypatch, edit, {"normal": {"max_batch": 2}}, applied)
    assert manager.current.normal.max_batch == 2, f"admin change lost: applied in order {applied}"


async def test_an_edit_read_while_an_admin_change_lands_applies_under_it(
    reviewed: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The edit (the window) and the PUT (the max batch) change different keys: both stand, as if
    the edit came first and the newer admin change after it. The edit was dropped, silently, and
    the stamp recorded: no later poll read the file again."""
    caplog.set_level(logging.INFO, logger="app.policy")
    edit = REVIEWED.format(window=5000.0, batch=8)
    manager = await _reload_racing_an_admin_change(reviewed, monkeypatch, edit, {"normal": {"max_batch": 2}})
    assert (manager.current.normal.window_ms, manager.current.normal.max_batch) == (5000.0, 2)
    assert any("under the admin change made meanwhile" in r.getMessage() for r in caplog.records)
    assert not await manager.reload(forced=False), "read once: the next poll has nothing new"


async def test_an_edit_that_an_admin_change_made_meanwhile_makes_invalid_leaves_the_admin_change(
    reviewed: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    edit = REVIEWED.format(window=10000.0, batch=8).replace("max_queue = 64", "max_queue = 8")
    manager = await _reload_racing_an_admin_change(reviewed, monkeypatch, edit, {"normal": {"max_batch": 16}})
    assert (manager.current.normal.max_batch, manager.current.normal.max_queue) == (16, 64)
    assert any("the admin change stays" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


async def test_a_file_gone_for_one_poll_is_waited_for_as_any_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An editor that saves by rename: a poll may find the file gone, the next one the new file
    being written. Gone is a change like any other: read only if the next poll finds it gone too.
    Before, a missing file's stamp (None) passed for 'nothing seen yet', and it was read at once:
    refused as missing (an ERROR for a normal save), or the new file read half written."""
    config = tmp_path / "service.toml"
    config.write_text(CONFIG.format(window=5.0, batch=8))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    applied: list[int] = []
    manager = PolicyManager(load_settings(), lambda b: applied.append(b.normal.max_batch))
    real_stamp = file_stamp
    # what the editor has done by each stamp taken: gone, half written (valid TOML all the same), whole
    edits = [config.unlink, lambda: config.write_text(CONFIG.format(window=5.0, batch=4))]
    edits.append(lambda: config.write_text(CONFIG.format(window=5.0, batch=3)))
    stamps: list[Path] = []

    def stamp_after_the_next_edit(path: Path):  # type: ignore[no-untyped-def]
        stamps.append(path)
        if edits:
            edits.pop(0)()
        return real_stamp(path)

    monkeypatch.setattr("app.policy.file_stamp", stamp_after_the_next_edit)
    caplog.set_level(logging.WARNING, logger="app.policy")
    watching = asyncio.ensure_future(manager.watch(0.01))
    try:
        async with asyncio.timeout(10):
            while not applied or len(stamps) < 8:  # noqa: ASYNC110 - the watcher has no event
                await asyncio.sleep(0.01)
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    assert applied == [3], "applied what a poll caught while the editor wrote"
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_deleted_config_file_does_not_reset_the_policy_to_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default config path (no AI_SERVICE_CONFIG_FILE), an editor that renames the file
    away before writing the new one, or an rm + cp, leaves a moment without the file: a poll
    then applies the built-in defaults (batch 16, 25 ms), not the file's policy. With
    AI_SERVICE_CONFIG_FILE set the same moment is refused ("no such file") and the old policy stays."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AI_SERVICE_CONFIG_FILE", raising=False)
    (tmp_path / "config").mkdir()
    config = tmp_path / "config" / "default.toml"
    config.write_text(REVIEWED.format(window=10000.0, batch=8))
    settings = load_settings(server={"default_timeout_ms": 60_000})
    manager = PolicyManager(settings, lambda b: None)
    assert manager.config_file == Path("config/default.toml")
    assert manager.current.normal.max_batch == 8
    config.unlink()  # the editor's rename, before its write
    await manager.reload(forced=False)  # what the watcher's next poll does
    assert manager.current.normal.max_batch == 8, "the file's policy was replaced by the defaults"


@pytest.mark.parametrize("edit", ["truncated", "deleted"])
async def test_the_file_is_read_once_so_an_edit_during_a_reload_cannot_apply_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: str
) -> None:
    """The file was checked (present, not empty) in one read and parsed from later ones: the
    editor's next write, truncating it or renaming it away, could land between them, and the
    settings read from no file at all are the built-in defaults (batch 16, 25 ms), applied as the
    live policy. The settings take the bytes that were checked and stamped."""
    monkeypatch.chdir(tmp_path)  # the default path: a file gone there is no error, only no settings
    monkeypatch.delenv("AI_SERVICE_CONFIG_FILE", raising=False)
    (tmp_path / "config").mkdir()
    config = tmp_path / "config" / "default.toml"
    config.write_text(REVIEWED.format(window=10000.0, batch=8))
    settings = load_settings(server={"default_timeout_ms": 60_000})

    def read_as_the_editor_writes() -> Any:
        config.write_text("") if edit == "truncated" else config.unlink()
        return load_settings()

    manager = PolicyManager(settings, lambda b: None, read=read_as_the_editor_writes)
    config.write_text(REVIEWED.format(window=10000.0, batch=3))
    os.utime(config, (1, 1))
    assert await manager.reload(forced=False)
    assert manager.current.normal.max_batch == 3, "the built-in defaults were applied"
    assert manager.current.normal.window_ms == 10000.0


async def test_an_edit_within_the_mtime_granularity_is_not_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two in-place writes of the same size within one mtime tick (a coarse clock tick on
    ext4/tmpfs, 1 s on HFS+/some network and bind mounts, 2 s on FAT): the watcher read the
    first, and the stamp (inode, size, mtime) never changes again, so the second is never
    applied. Simulated by giving both writes the same mtime."""
    config = tmp_path / "service.toml"
    config.write_text(REVIEWED.format(window=10000.0, batch=8))
    os.utime(config, ns=(5_000_000_000, 5_000_000_000))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    manager = PolicyManager(load_settings(server={"default_timeout_ms": 60_000}), lambda b: None)
    watcher = asyncio.create_task(manager.watch(0.02))
    try:
        with config.open("r+") as f:  # in place: same inode, same size
            f.write(REVIEWED.format(window=10000.0, batch=4))
        os.utime(config, ns=(5_000_000_000, 5_000_000_000))  # the same tick
        async with asyncio.timeout(2):
            while manager.current.normal.max_batch != 4:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
    except TimeoutError:
        pytest.fail("the edit was never applied: the file's stamp did not change")
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


async def test_an_accepted_window_leaves_requests_with_the_default_deadline_servable(
    make_settings: SettingsFactory,
) -> None:
    """The check is "normal.window_ms < server.default_timeout_ms", but admission refuses a
    request whose predicted wait (at least the window) is over admission_headroom (0.5) of
    its deadline: a window of 600 ms with a 1 s default deadline is accepted (200), and from
    then on every request with the default deadline is a 503 would_miss_deadline whose
    Retry-After cannot help. The change should be refused (422) and the old policy stay."""
    token = "s3cret-admin-token-0123456789"
    auth = {"Authorization": f"Bearer {token}"}
    settings = make_settings(
        admin={"enabled": True, "token": token, "config_watch_s": 0}, server={"default_timeout_ms": 1000}
    )
    async with running_app(settings) as running:
        assert (await running.predict_png(sample_png(1))).status_code == 200  # a batch is timed
        changed = await running.client.put("/admin/policy", headers=auth, json={"normal": {"window_ms": 600}})
        refused = [(await running.predict_png(sample_png(d))) for d in range(3)]
        codes = [(r.status_code, r.json().get("code")) for r in refused]
        assert changed.status_code == 422 and "admission_headroom" in changed.json()["message"], changed.text
        assert all(status == 200 for status, _ in codes), codes


async def test_a_non_ascii_admin_token_that_settings_accept_can_be_presented(make_settings: SettingsFactory) -> None:
    """Settings take any 16+ character token (from the environment or a UTF-8 file) and compare
    its UTF-8 bytes; the header's bytes are decoded as latin-1 and encoded again as UTF-8, so a
    token with a non-ASCII character never matches: 403 with the right token. (Either refuse
    such a token at start-up, or compare the raw header bytes.)"""
    token = "Zürich-admin-token-0123456789"
    settings = make_settings(admin={"enabled": True, "token": token, "config_watch_s": 0})
    async with running_app(settings) as running:
        answer = await running.client.get("/admin/policy", headers={"Authorization": b"Bearer " + token.encode()})
        assert answer.status_code == 200, answer.text


async def test_an_admin_body_that_stops_coming_is_answered_408(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token checks out and the body never finishes: answered 408 ``request_timeout`` once
    the body's bound passes (it waited for ever), and the policy is unchanged."""
    from app.api import middleware
    from app.bench.rawhttp import read_response
    from tests.integration.test_edge import served

    monkeypatch.setattr(middleware, "BODY_TIMEOUT_S", 0.3)
    async with served(admin_settings(make_settings)) as running:
        reader, writer = await running.connect()
        try:
            head = f"PUT /admin/policy HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            head += "Content-Type: application/json\r\nContent-Length: 100\r\nX-Request-ID: stalled\r\n\r\n"
            writer.write(head.encode() + b'{"nor')
            answer, body = await asyncio.wait_for(read_response(reader), 10)
        finally:
            writer.close()
        assert answer.status == 408 and answer.headers["connection"] == "close", body
        assert json.loads(body) == {
            "code": "request_timeout",
            "message": "the request's body did not arrive within 0.3 s",
            "request_id": "stalled",
        }
        assert running.service.models[MODEL_NAME].batcher.policy.normal.max_batch == 8


async def test_a_405_names_every_method_the_path_takes(make_settings: SettingsFactory) -> None:
    async with running_app(admin_settings(make_settings)) as running:
        refused = await running.client.delete("/admin/policy", headers=AUTH)
        assert refused.status_code == 405 and refused.json()["code"] == "method_not_allowed"
        assert refused.headers["allow"] == "GET, HEAD, PUT", "Starlette's named the first route's method only"
        wrong = await running.client.get("/predict")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"


def deny_reading(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """``path`` cannot be read, as a file of mode 000 is not to a service without
    CAP_DAC_OVERRIDE (the tests may run as root, which reads through file modes)."""
    real = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        if self == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)


async def test_a_config_file_that_cannot_be_read_is_said_so_not_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Start-up says Permission denied; a reload said the file was missing."""
    config = tmp_path / "service.toml"
    config.write_text(REVIEWED.format(window=10000.0, batch=8))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    manager = PolicyManager(load_settings(server={"default_timeout_ms": 60_000}), lambda b: None)
    assert file_stamp(config) is not None
    deny_reading(monkeypatch, config)
    assert file_stamp(config) == "Permission denied"
    with caplog.at_level(logging.ERROR, logger="app.policy"), pytest.raises(SchemaError) as refused:
        await manager.reload(strict=True)  # POST /admin/policy/reload: its 422
    assert str(refused.value).endswith(f"config file {config} cannot be read: Permission denied")
    assert [r.getMessage() for r in caplog.records] == [
        f"config reload refused, the old policy stays: config file {config} cannot be read: Permission denied"
    ]
    assert manager.current.normal.max_batch == 8


async def test_a_restart_is_asked_for_on_every_reload_while_the_file_differs_from_what_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The warning compared with the file's last read: an edit back to the running value warned
    again, and a restart still pending went unsaid at the next reload."""
    config = tmp_path / "service.toml"
    file = "[server]\ndefault_timeout_ms = 60000\nmax_top_k = {top_k}\n[logging]\nlevel = '{level}'\n" + CONFIG
    config.write_text(file.format(top_k=20, level="INFO", window=12000.0, batch=8))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    manager = PolicyManager(read_settings(), lambda b: None)

    async def said(top_k: int, level: str = "INFO", batch: int = 8) -> list[str]:
        caplog.clear()
        config.write_text(file.format(top_k=top_k, level=level, window=12000.0, batch=batch))
        with caplog.at_level(logging.WARNING, logger="app.policy"):
            await manager.reload(forced=False)
        return [r.getMessage() for r in caplog.records if "restart" in r.getMessage()]

    pending = "config changes to server.max_top_k need a restart (only batching applies live)"
    assert await said(top_k=10) == [pending]
    assert await said(top_k=20) == [], "back to what runs: nothing to restart for"
    assert await said(top_k=10) == [pending]
    assert await said(top_k=10, batch=4) == [pending], "still pending at the next reload"
    assert manager.current.normal.max_batch == 4
    assert await said(top_k=10, level="DEBUG", batch=4) == [
        "config changes to server.max_top_k, logging.level need a restart (only batching applies live)"
    ]


LANES = """
[server]
default_timeout_ms = 60000
[batching.normal]
window_ms = {window}
max_batch = {batch}
max_queue = 64
[batching.urgent]
window_ms = 2.0
max_batch = {urgent}
"""


async def test_an_edit_of_a_restart_only_setting_that_a_variable_overrides_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Only batching edits were compared: an edit of server.max_top_k that a variable overrides
    was dropped without a word (the settings did not change, so no restart was asked for either),
    and it would not apply after a restart."""
    config = tmp_path / "service.toml"
    config.write_text("[server]\nmax_top_k = 20\n")
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    monkeypatch.setenv("ai_service_server__max_top_k", "8")  # read in any case
    manager = PolicyManager(read_settings(), lambda b: None)
    config.write_text("[server]\nmax_top_k = 10\n")
    with caplog.at_level(logging.WARNING, logger="app.policy"):
        await manager.reload(forced=False)
    assert [r.getMessage() for r in caplog.records] == [
        "config file edits that the environment overrides do not apply (it wins over the file): "
        "server.max_top_k (ai_service_server__max_top_k)"
    ]


async def test_an_edit_of_the_file_that_a_variable_overrides_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The environment wins over the file (as documented): an edit of a batching value that a
    variable sets changed nothing, and nothing said so."""
    config = tmp_path / "service.toml"
    config.write_text(LANES.format(window=12000.0, batch=8, urgent=16))
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    monkeypatch.setenv("AI_SERVICE_BATCHING__NORMAL__WINDOW_MS", "10000")
    monkeypatch.setenv("AI_SERVICE_BATCHING__URGENT", '{"max_batch": 4}')  # a lane as JSON: the keys it holds
    manager = PolicyManager(read_settings(), lambda b: None)

    async def said(window: float, batch: int = 8, urgent: int = 16) -> list[str]:
        caplog.clear()
        config.write_text(LANES.format(window=window, batch=batch, urgent=urgent))
        with caplog.at_level(logging.WARNING, logger="app.policy"):
            await manager.reload(forced=False)
        return [r.getMessage() for r in caplog.records]

    overridden = "config file edits that the environment overrides do not apply (it wins over the file): "
    assert await said(window=11000.0) == [
        overridden + "batching.normal.window_ms (AI_SERVICE_BATCHING__NORMAL__WINDOW_MS)"
    ]
    assert manager.current.normal.window_ms == 10000.0
    assert await said(window=9000.0, batch=4) == [
        overridden + "batching.normal.window_ms (AI_SERVICE_BATCHING__NORMAL__WINDOW_MS)"
    ], "the edit that applies is not named"
    assert manager.current.normal.max_batch == 4
    assert await said(window=9000.0, batch=2) == [], "no edit of an overridden value"
    assert await said(window=9000.0, batch=2, urgent=8) == [
        overridden + "batching.urgent.max_batch (AI_SERVICE_BATCHING__URGENT)"
    ]
    assert manager.current.urgent.max_batch == 4
    # the lanes' tables removed, then added back: each key is an edit, named only where overridden
    both = overridden + (
        "batching.normal.window_ms (AI_SERVICE_BATCHING__NORMAL__WINDOW_MS); "
        "batching.urgent.max_batch (AI_SERVICE_BATCHING__URGENT)"
    )
    caplog.clear()
    config.write_text(LANES.format(window=9000.0, batch=2, urgent=8).split("[batching.normal]")[0])
    with caplog.at_level(logging.WARNING, logger="app.policy"):
        await manager.reload(forced=False)
    assert [r.getMessage() for r in caplog.records] == [both]
    assert await said(window=8000.0, batch=2, urgent=8) == [both], "not the whole tables: their overridden keys"
