"""A replica keeps its builder's settings: over every reload, and from the builder's own file
(no cluster: the replica's app is built as ``Classifier`` builds it). And the Ray copy of the
metrics lets go of the series ``/metrics`` removed."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

pytest.importorskip("ray.serve")

from app.ray.metrics import MetricsMirror  # noqa: E402
from app.ray.options import split_args  # noqa: E402
from app.ray_app import replica_app  # noqa: E402
from app.telemetry.metrics import Metrics  # noqa: E402
from tests.ray.test_metrics_mirror import Factory  # noqa: E402
from tests.support import REPO_ROOT, TEST_DEFAULTS, merge, state_per_request  # noqa: E402

TOKEN = "a-test-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextlib.asynccontextmanager
async def replica(overrides: dict[str, Any], config_file: Path | None = None) -> AsyncIterator[FastAPI]:
    """The app a replica serves, with the tests' small settings and the admin API among the overrides."""
    test = merge(TEST_DEFAULTS, {"admin": {"enabled": True, "token": TOKEN, "config_watch_s": 0}})
    app = replica_app(merge(test, overrides), config_file)
    async with LifespanManager(state_per_request(app), startup_timeout=30) as manager:
        await app.state.starting
        app.state.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=manager.app), base_url="http://t")
        yield app
        await app.state.client.aclose()


async def test_a_reload_keeps_the_builders_overrides() -> None:
    _, overrides = split_args({"batching.normal.window_ms": "10"})
    async with replica(overrides) as app:
        policy = app.state.policy
        assert policy.current.normal.window_ms == 10.0
        reloaded = await app.state.client.post("/admin/policy/reload", headers=AUTH)
        assert reloaded.status_code == 200, reloaded.text
        await policy.reload(forced=False)  # what an edit of the watched file brings
        assert policy.current.normal.window_ms == 10.0, "the builder's override wins over the file, always"


async def test_a_replica_reloads_its_builders_config_file(tmp_path: Path) -> None:
    own_file = tmp_path / "serve.toml"
    default = (REPO_ROOT / "config" / "default.toml").read_text()
    own_file.write_text(default.replace("window_ms = 2.0", "window_ms = 3.0"))
    own, overrides = split_args({"config_file": str(own_file)})
    async with replica(overrides, own.config_file) as app:
        policy = app.state.policy
        assert policy.config_file == own_file and policy.current.urgent.window_ms == 3.0
        own_file.write_text(default.replace("window_ms = 2.0", "window_ms = 4.0"))
        assert await policy.reload()
        assert policy.current.urgent.window_ms == 4.0


def test_a_series_gone_from_the_registry_reads_0_in_rays_copy() -> None:
    metrics, factory = Metrics(), Factory()
    mirror = MetricsMirror(metrics.registry, factory)
    metrics.model_info.labels("digits", "1", "cuda:0", "float16").set(1)
    metrics.scrape_time.queue_depths = lambda: [("digits", "1", "normal", 7)]
    mirror.sync()
    metrics.model_info.remove("digits", "1", "cuda:0", "float16")  # the CPU fallback took over
    metrics.model_info.labels("digits", "1", "cpu", "float32").set(1)
    metrics.scrape_time.queue_depths = lambda: []  # version 1 unloaded
    mirror.sync()
    info = factory.gauges["ai_backend_model_info"]
    assert info.last(model="digits", version="1", device="cuda:0", dtype="float16") == 0
    assert info.last(model="digits", version="1", device="cpu", dtype="float32") == 1
    assert factory.gauges["ai_backend_queue_depth"].last(model="digits", version="1", lane="normal") == 0


def test_a_replica_logs_in_its_settings_level_and_format(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray leaves the root logger to the process: without this, a replica's lines had neither the
    # JSON format nor the request ids, and logging.level was ignored
    import app.telemetry.logging as telemetry_logging
    from app.ray_app import Classifier

    configured: list[tuple[str, bool]] = []
    monkeypatch.setattr(telemetry_logging, "configure_logging", lambda *args: configured.append(args))
    _, overrides = split_args({"logging.level": "WARNING", "logging.json_format": "false"})
    # the replica's own build step, on a stand-in for the replica (Serve's ingress wraps __init__)
    stand_in = SimpleNamespace(_overrides=merge(TEST_DEFAULTS, overrides), _config_file=None, _expects_api_key=False)
    built = Classifier.func_or_class.__serve_build_asgi_app__(stand_in)
    assert isinstance(built, FastAPI)
    assert configured == [("WARNING", False)]


async def test_a_replica_picks_up_an_edit_made_while_it_starts(tmp_path: Path) -> None:
    """``ai-backend serve`` stamps the file as it reads its settings (an edit while torch
    imports and Serve starts the replica is picked up); a Ray replica reads them in
    ``replica_app`` but the stamp is taken only when the lifespan starts, so an edit in
    between is never applied (until the next edit)."""
    import asyncio
    import os

    own_file = tmp_path / "serve.toml"
    default = (REPO_ROOT / "config" / "default.toml").read_text()
    own_file.write_text(default)
    os.utime(own_file, (1, 1))
    own, overrides = split_args({"config_file": str(own_file)})
    test = merge(TEST_DEFAULTS, {"admin": {"config_watch_s": 0.1}})
    test["batching"] = {}  # the file's batching
    app = replica_app(merge(test, overrides), own.config_file)
    assert app.state.settings.batching.urgent.window_ms == 2.0
    own_file.write_text(default.replace("window_ms = 2.0", "window_ms = 3.0"))  # while Serve starts it
    os.utime(own_file, (2, 2))
    async with LifespanManager(state_per_request(app), startup_timeout=30):
        await app.state.starting
        try:
            async with asyncio.timeout(10):  # a poll every 0.1 s: a bound on a miss, not a wait
                while app.state.policy.current.urgent.window_ms != 3.0:  # noqa: ASYNC110 - no event says "applied"
                    await asyncio.sleep(0.01)
        except TimeoutError:
            pytest.fail("the edit made while it started was missed")


def test_a_replica_built_to_need_an_api_key_it_cannot_see_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never served open where the deployer set a key: the builder saw it, this replica's
    environment (the Ray node's) does not have it."""
    test = merge(TEST_DEFAULTS, {"admin": {"enabled": True, "token": TOKEN, "config_watch_s": 0}})
    monkeypatch.delenv("AI_SERVICE_SERVER__API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="AI_SERVICE_SERVER__API_KEY"):
        replica_app(test, None, expects_api_key=True)
    monkeypatch.setenv("AI_SERVICE_SERVER__API_KEY", "the-replicas-own-key-0123456789")
    assert replica_app(test, None, expects_api_key=True).state.settings.server.api_key is not None


def test_a_replica_plans_its_threads_for_the_cpus_ray_gave_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas reserving 1 CPU each planned their threads for every core of the node: packed
    onto it by their reservations, they oversubscribed it (49 threads a GPU replica on 96 cores)."""
    import app.ray_app as ray_app

    test = merge(TEST_DEFAULTS, {"admin": {"enabled": True, "token": TOKEN, "config_watch_s": 0}})
    monkeypatch.setattr(ray_app, "_assigned_cpus", lambda: 1)
    assert replica_app(test, None).state.settings.model.cores == 1
    chosen = merge(test, {"model": {"cores": 3}})  # the deployer's own choice stands
    assert replica_app(chosen, None).state.settings.model.cores == 3
    monkeypatch.setattr(ray_app, "_assigned_cpus", lambda: 0)  # outside Ray: the process's own
    assert replica_app(test, None).state.settings.model.cores == 0


@pytest.mark.parametrize(("reserved", "cores"), [({}, 1), ({"CPU": 0.5}, 1), ({"CPU": 2.0}, 2)])
def test_a_replica_that_reserved_no_cpu_plans_for_one_core(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, reserved: dict[str, float], cores: int
) -> None:
    """``num_cpus=0`` (common for GPU replicas): Ray reports no CPU for the actor, and the replica
    planned its threads for every core of the node, as each replica packed onto it did. It now
    plans for 1, as Ray sets OMP_NUM_THREADS=1 for it, and says so."""
    import ray

    import app.ray_app as ray_app

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_assigned_resources=lambda: reserved))
    test = merge(TEST_DEFAULTS, {"admin": {"enabled": True, "token": TOKEN, "config_watch_s": 0}})
    with caplog.at_level("WARNING", logger=ray_app.__name__):
        assert replica_app(test, None).state.settings.model.cores == cores
    said = [r.getMessage() for r in caplog.records if r.name == ray_app.__name__]
    assert said == (
        [
            "this replica reserved no CPU (num_cpus=0): it plans its threads for 1 core; "
            "set num_cpus, or model.cores, to plan for more"
        ]
        if not reserved
        else []
    )
