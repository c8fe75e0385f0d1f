"""``create_app(settings)`` and the lifespan. Importing this module does no I/O.

The lifespan starts the service and loads models in the background, so the probes
answer (``/readyz`` 503) while loading and warm-up run. A load that fails calls
``on_fatal`` (the CLI stops the server and exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from app.api.errors import install_error_handlers
from app.api.middleware import RequestContextMiddleware
from app.api.openapi import install_openapi
from app.api.routes import health, models, predict
from app.api.routes import metrics as metrics_route
from app.service import InferenceService
from app.settings import Settings, load_settings
from app.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

FatalHandler = Callable[[str], None]


def _log_fatal(message: str) -> None:
    log.critical("start-up failed: %s", message)


def create_app(settings: Settings | None = None, on_fatal: FatalHandler | None = None) -> FastAPI:
    """Build the ASGI app for ``settings`` (read from the environment and config/ when omitted)."""
    settings = settings or load_settings()
    fatal = on_fatal or _log_fatal
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = InferenceService(settings, metrics)
        app.state.service = service

        async def start() -> None:
            try:
                await service.start()
            except Exception as exc:
                fatal(str(exc))

        starting = asyncio.create_task(start(), name="model-start")
        app.state.starting = starting
        try:
            yield
        finally:
            if not starting.done():
                starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            await service.close(settings.server.shutdown_grace_s)

    app = FastAPI(
        title="ai-backend",
        version="0.1.0",
        summary="Image classification over REST with dual-window batching.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    install_error_handlers(app)
    install_openapi(app)
    app.add_middleware(RequestContextMiddleware, metrics=metrics, access_log=settings.logging.access_log)
    for router in (predict.router, models.router, health.router, metrics_route.router):
        app.include_router(router)
    return app
