"""The service as a Ray Serve application: ``serve run app.ray_app:build``.

``build(args)`` returns an application of one deployment, ``Classifier``, whose replicas
each serve the same FastAPI app as ``ai-backend serve``: each replica builds it with
``create_app(settings)`` where it runs (``__serve_build_asgi_app__``), so its model,
batcher, device thread and telemetry are its own and nothing is pickled but settings
overrides. Serve runs the app's lifespan once per replica; the objects it makes live on
``app.state``, where routes find them (lifespan *state*, the dict a lifespan may yield,
does not reach requests under Serve, so nothing here relies on it).

Under Serve, the lifespan's start-up also waits until the models are loaded, checked and
warmed: Serve sends a replica no traffic before its start-up returns, which is what
``/readyz`` does behind a plain balancer. ``check_health`` fails where ``/readyz`` does (one
function, ``not_ready``): a batcher's task died, or a default model's head failed to load;
Serve replaces the replica after 3 failed checks in a row. Every few seconds the replica
copies its Prometheus registry into Ray's metrics (``app.ray.metrics``).

Importing this module imports Ray Serve but neither torch nor the app, and starts nothing;
``docs/ray.md`` has the commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.ray.options import (
    check_device,
    deployment_options,
    device_override,
    gpus_per_replica,
    read_settings,
    secrets_for_replicas,
    split_args,
)
from app.settings import config_path, env_name, file_stamp

log = logging.getLogger(__name__)

DEPLOYMENT = "Classifier"
START_TIMEOUT_FLOOR_S = 120.0  # importing torch and loading on a busy node is slow


class OneRequestIdHeader:
    """Drops the app's ``X-Request-ID`` response header where Serve's proxy adds the same one.

    The proxy passes every request on with an ``X-Request-ID`` (the client's, or one it
    made) and appends that header to the response itself; the app, which keeps a valid
    incoming id, sets it too, and clients would read ``abc, abc``. Where the app replaced
    an invalid id, both stay: the body's ``request_id`` is the app's.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        incoming = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        if scope["type"] != "http" or incoming is None:
            await self.app(scope, receive, send)
            return

        async def send_once(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v) for k, v in message.get("headers", ()) if (k.lower(), v) != (b"x-request-id", incoming)
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_once)


def replica_app(overrides: Mapping[str, Any], config_file: Path | None, expects_api_key: bool = False) -> FastAPI:
    """A replica's app: the builder's overrides over the environment and its config file, at
    start and at every reload (admin API, SIGHUP, an edit of that file). ``expects_api_key``:
    the builder's settings had an API key inline, which a replica must find in its own
    environment: with none, it refuses to start rather than serve the API open."""
    from app.main import create_app  # torch comes in here, in the replica, not at import

    stamp = file_stamp(config_file or config_path())  # before the read: an edit meanwhile is a change
    settings = read_settings(overrides, config_file)
    if not settings.model.cores and (given := _assigned_cpus()):
        # Ray packs replicas onto a node by the CPUs each asked for (num_cpus), and each would plan
        # its threads for every core of the node: four replicas of 1 CPU on 4 cores ran 4 plans of 4
        overrides = {**overrides, "model": {**overrides.get("model", {}), "cores": given}}
        settings = read_settings(overrides, config_file)
    if expects_api_key and settings.server.api_key is None and settings.server.api_key_file is None:
        variable = env_name(("server", "api_key"))
        raise RuntimeError(
            f"the deployment was built with an API key ({variable} where it was built) that this replica "
            f"cannot see: its environment is the Ray node's. Set {variable} where `ray start` runs, or pass "
            "server.api_key_file=PATH to the builder; the API is not served without its key"
        )
    reread = functools.partial(read_settings, overrides, config_file)
    return create_app(settings, reread=reread, config_file=config_file, config_stamp=stamp)


def _assigned_cpus() -> int:
    """The cores this replica plans its threads for: the CPUs Ray reserved for it (``num_cpus``),
    rounded up; 1 where it reserved none (``num_cpus=0``, as GPU replicas are often deployed);
    0 outside a Ray worker (``model.cores`` 0: the process's own)."""
    import ray

    if not ray.is_initialized():  # not in a Ray worker (a test builds the replica's app alone): asked,
        return 0  # Ray would start a local cluster for the question
    try:
        cpus = float(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0))
    except Exception:  # a driver, not a worker, or an older Ray
        return 0
    if not cpus:
        # every core of the node would be planned for by each replica packed onto it; Ray itself
        # sets OMP_NUM_THREADS=1 for a worker that reserved no CPU
        log.warning(
            "this replica reserved no CPU (num_cpus=0): it plans its threads for 1 core; "
            "set num_cpus, or model.cores, to plan for more"
        )
        return 1
    return math.ceil(cpus)


@serve.deployment(
    name=DEPLOYMENT,
    # placeholders: build() sizes them from the settings (app.ray.options.deployment_options)
    max_ongoing_requests=64,
    max_queued_requests=128,
    graceful_shutdown_timeout_s=40.0,
)
@serve.ingress()
class Classifier:
    """One replica: the service's FastAPI app, its lifespan, its health and its metrics copy."""

    def __init__(
        self,
        overrides: Mapping[str, Any],
        config_file: str | None = None,
        metrics_interval_s: float = 5.0,
        expects_api_key: bool = False,
    ) -> None:
        self._overrides = dict(overrides)
        self._config_file = Path(config_file) if config_file else None
        self._metrics_interval_s = metrics_interval_s
        self._expects_api_key = expects_api_key
        self._app: FastAPI | None = None
        self._lifespan_starts = 0

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The app this replica serves, built here (Serve calls this once, after ``__init__``).
        The replica's log lines take the settings' level and format, with request and trace
        ids, as ``ai-backend serve``'s do (Ray leaves the root logger to the process)."""
        from app.environment import warn_unknown_variables
        from app.telemetry.logging import configure_logging

        app = replica_app(self._overrides, self._config_file, self._expects_api_key)
        logging_settings = app.state.settings.logging
        configure_logging(logging_settings.level, logging_settings.json_format)
        warn_unknown_variables()
        served_lifespan = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[Any]:
            self._lifespan_starts += 1
            async with served_lifespan(app) as state:
                await self._until_ready(app)
                copying = asyncio.create_task(self._copy_metrics(app), name="ray-metrics")
                try:
                    yield state
                finally:
                    copying.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await copying

        app.router.lifespan_context = lifespan
        app.add_middleware(OneRequestIdHeader)
        self._app = app
        return app

    async def _until_ready(self, app: FastAPI) -> None:
        """Wait for the models to load, check and warm up; raise (start-up fails) if they did not."""
        service = app.state.service
        limit = max(START_TIMEOUT_FLOOR_S, 4 * service.settings.model.load_timeout_s)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(app.state.starting), timeout=limit)
        if not service.ready:
            reason = service.failure or f"not ready after {limit:.0f} s"
            raise RuntimeError(f"the service did not start: {reason}")

    async def _copy_metrics(self, app: FastAPI) -> None:
        from app.ray.metrics import MetricsMirror, RayMetricFactory

        await MetricsMirror(app.state.metrics.registry, RayMetricFactory()).run(self._metrics_interval_s)

    async def check_health(self) -> None:
        """Serve's health check: ``/readyz``'s condition, the same function. Serve replaces the
        replica after 3 failed checks in a row (``REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD``)."""
        from app.api.routes.health import not_ready

        service = getattr(self._app.state, "service", None) if self._app is not None else None
        if service is None:
            raise RuntimeError("the app has not started")
        if (reason := not_ready(service)) is not None:
            raise RuntimeError(reason)

    async def replica_info(self) -> dict[str, Any]:
        """Which process this replica is and how often its lifespan started (for ops and tests)."""
        context = serve.get_replica_context()
        service = getattr(self._app.state, "service", None) if self._app is not None else None
        return {
            "replica": context.replica_id.unique_id,
            "pid": os.getpid(),
            "lifespan_starts": self._lifespan_starts,
            "ready": bool(service is not None and service.ready),
        }


def build(args: dict[str, Any]) -> Application:
    """The Serve application for ``args`` (see ``app.ray.options``); ``{}`` serves the defaults.

    The settings are read here too, where the application is built (the Serve controller's
    node for a config deploy, the caller for ``serve run``), to size the deployment; each
    replica reads them again where it runs.
    """
    own, overrides = split_args(args)
    settings = read_settings(overrides, own.config_file)
    num_gpus = gpus_per_replica(own, settings)
    check_device(settings, num_gpus)
    if (device := device_override(settings, num_gpus)) is not None:
        log.info("model.device=%s for the replicas: they reserve no GPU (num_gpus=%g)", device, num_gpus)
        overrides.setdefault("model", {})["device"] = device
    options = deployment_options(own, settings, num_gpus)
    config_file = str(own.config_file) if own.config_file else None
    log.info("Classifier options: %s", options)
    # the secrets the builder's settings name reach the replicas as files, or are required of them
    overrides, expects_api_key = secrets_for_replicas(settings, overrides)
    deployment: Any = Classifier  # a serve.Deployment once decorated; mypy keeps seeing the class
    return deployment.options(**options).bind(overrides, config_file, own.metrics_interval_s, expects_api_key)
