"""``create_app(settings)`` and the lifespan. Importing this module does no I/O.

The lifespan starts the service and loads models in the background, so the probes
answer (``/readyz`` 503) while loading and warm-up run. A load that fails calls
``on_fatal`` (the CLI stops the server and exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.instrumentation.utils import suppress_http_instrumentation
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.types import Receive, Scope, Send

from app.api.access_log import AccessLog
from app.api.auth import admin_gate
from app.api.errors import install_error_handlers
from app.api.middleware import RequestContextMiddleware
from app.api.mount import route_path
from app.api.openapi import install_openapi
from app.api.routes import admin, admin_models, health, models, predict
from app.api.routes import metrics as metrics_route
from app.inference.device import DeviceMissing, resolve_device
from app.lifecycle.manager import LifecycleManager
from app.policy import PolicyManager
from app.service import InferenceService
from app.settings import (
    FileStamp,
    Settings,
    SettingsError,
    file_stamp,
    load_settings,
    read_each_secret,
    read_secrets,
    read_settings,
)
from app.telemetry.loop_lag import watch_loop
from app.telemetry.metrics import Metrics
from app.telemetry.tracing import build_tracer_provider, query_redacted

log = logging.getLogger(__name__)

FatalHandler = Callable[[str], None]
# probes and scrapes make no spans: these paths exactly, relative to where the app is mounted
# (``TracedApp``), so that neither a model named "metrics-net" nor a Host header holding
# "/metrics" takes a prediction out of its trace
UNTRACED_PATHS = frozenset({"/livez", "/readyz", "/healthz", "/metrics"})


class TracedApp(FastAPI):
    """The service's FastAPI app when its requests are traced (with no exporter it is a plain
    ``FastAPI``: nothing is added to a request's path). The probes and scrapes (``UNTRACED_PATHS``)
    make no spans: their path is matched here as the routes match it, relative to the app's mount
    (``app.api.mount``), and the instrumentation, the outermost middleware, is told to stand aside.
    Its own exclusion matches the URL, whose path holds the prefix a server mounts the app under,
    which is not known when the app is built."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope) in UNTRACED_PATHS:
            with suppress_http_instrumentation():
                await super().__call__(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _log_fatal(message: str) -> None:
    log.critical("start-up failed: %s", message)


async def _reread_secrets(app: FastAPI, settings: Settings, one_at_a_time: asyncio.Lock, why: str = "SIGHUP") -> None:
    """The admin token and the API key read again from their files (a rotated Kubernetes Secret,
    say), on SIGHUP or when a file changed (``_watch_secrets``), so a rotation needs no restart. A
    file that cannot be used keeps its old secret, and the other is rotated all the same. Re-reads
    run one at a time: two around a rotation must not let the older read land last and bring a
    revoked secret back."""
    async with one_at_a_time:
        read = await asyncio.to_thread(read_each_secret, settings)
        kept = (app.state.admin_token, app.state.api_key)
        fresh = []
        for secret, old in zip(read, kept, strict=True):
            if isinstance(secret, SettingsError):
                log.error("%s: that secret stays as it was: %s", why, secret)
                fresh.append(old)
            else:
                fresh.append(secret)
        if tuple(fresh) != kept:
            app.state.admin_token, app.state.api_key = fresh
            log.info("%s: the admin token or the API key changed in its file and is in use from now on", why)


def _secret_files(settings: Settings) -> list[Path]:
    return [path for path in (settings.admin.token_file, settings.server.api_key_file) if path is not None]


def _stamps(paths: list[Path]) -> list[FileStamp]:
    return [file_stamp(path) for path in paths]


async def _watch_secrets(app: FastAPI, settings: Settings, one_at_a_time: asyncio.Lock) -> None:
    """The secrets' files polled every ``admin.config_watch_s`` (0: only SIGHUP reads them): a
    rotated Kubernetes Secret is swapped into its volume with no signal sent, and a Ray replica
    cannot take one (its event loop is not on the main thread, and SIGHUP's default ends it)."""
    paths, interval = _secret_files(settings), settings.admin.config_watch_s
    if not paths or not interval:
        return
    stamps = await asyncio.to_thread(_stamps, paths)
    while True:
        await asyncio.sleep(interval)
        now = await asyncio.to_thread(_stamps, paths)
        if now != stamps:
            stamps = now
            await _reread_secrets(app, settings, one_at_a_time, why="a secret's file changed")


def _reloader(
    app: FastAPI, settings: Settings, policy: PolicyManager, tasks: set[asyncio.Task[None]]
) -> tuple[Callable[[], None], asyncio.Task[None]]:
    """What SIGHUP does: the config file re-read (by the policy's watch) and the secrets' files
    (a task of ``tasks``, which the lifespan awaits on close); and the task that watches those
    files (``_watch_secrets``), their re-reads one at a time with SIGHUP's."""
    one_at_a_time = asyncio.Lock()
    watch = asyncio.get_running_loop().create_task(_watch_secrets(app, settings, one_at_a_time), name="secrets-watch")

    def on_sighup() -> None:
        policy.wake()
        reread = _reread_secrets(app, settings, one_at_a_time)
        task = asyncio.get_running_loop().create_task(reread, name="secrets-reread")
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return on_sighup, watch


class StartupFailed(RuntimeError):
    """The app must not start: what it would serve is not what was configured. Raised once
    ``fatal`` has named it (``serve`` leaves uvicorn's traceback of it out)."""


async def _secrets(settings: Settings, fatal: FatalHandler) -> tuple[bytes | None, bytes | None]:
    """The admin token and the API key. ``serve`` checked their files before starting: here
    only a file changed since fails (and every embedding that did not check: a Ray replica).
    It fails the start-up itself, not only through ``fatal``: with no key read, the API would
    be served open, and the admin API would fail on every call."""
    try:
        return await asyncio.to_thread(read_secrets, settings)
    except SettingsError as exc:
        fatal(str(exc))
        raise StartupFailed(str(exc)) from None


@contextlib.contextmanager
def _on_sighup(handler: Callable[[], object]) -> Iterator[None]:
    """Reload on SIGHUP while serving, where signals can be handled (the main thread, POSIX)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, handler)
    except (RuntimeError, ValueError, NotImplementedError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # not back to its default, which ends the process


async def _new_service(
    settings: Settings, metrics: Metrics, tracer: trace.Tracer, fatal: FatalHandler
) -> InferenceService:
    """The service, on the device ``model.device`` resolves to: off the event loop, as ``auto``
    makes a CUDA context to see that the GPU works (seconds). A device this machine does not
    have fails start-up, named (not blamed on the port): ``serve`` checked it before starting,
    so this is every embedding that did not (a Ray replica)."""
    try:
        device = await asyncio.to_thread(resolve_device, settings.model.device)
    except DeviceMissing as exc:
        fatal(str(exc))
        raise StartupFailed(str(exc)) from None
    try:
        return InferenceService(settings, metrics, tracer, device)
    except Exception as exc:  # a bug: named, not blamed on the port, and its traceback shown
        fatal(str(exc))
        raise


def _install_routes(app: FastAPI, settings: Settings, metrics: Metrics, access_log: AccessLog | None) -> None:
    """The error handlers, the OpenAPI document, the outermost middleware and the routes."""
    install_error_handlers(app)
    install_openapi(app, settings.server)
    admin_routes = (*admin.router.routes, *admin_models.router.routes)
    app.add_middleware(
        RequestContextMiddleware,
        metrics=metrics,
        access_log=access_log,
        direct=lambda scope: predict.direct(scope) or admin_gate(scope, admin_routes),  # the token before any body
    )
    for router in (predict.router, models.router, health.router, metrics_route.router):
        app.include_router(router)
    if settings.admin.enabled:
        app.include_router(admin.router)
        app.include_router(admin_models.router)


def _trace_requests(app: FastAPI, tracer_provider: TracerProvider) -> None:
    """A server span for each request, but for the probes and scrapes (``TracedApp``, which
    ``app`` is)."""
    FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=tracer_provider,
        excluded_urls="",  # none by URL (nor by the environment): TracedApp leaves the probes out
        exclude_spans=["receive", "send"],
        server_request_hook=query_redacted,
    )


async def _loads_unless_halted(loads: Sequence[Awaitable[object]], service: InferenceService) -> None:
    """Wait for the admin loads under way, unless the service is halted meanwhile (a second signal,
    Ctrl-C: it stops at once, and a load bounded only by ``model.load_timeout_s`` would hold the
    exit that long). A load left running is abandoned with the loader thread at the close."""
    if not loads:
        return
    halted = asyncio.ensure_future(service.halted.wait())
    waits: list[asyncio.Future[Any]] = [asyncio.gather(*loads, return_exceptions=True), halted]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        halted.cancel()


def create_app(
    settings: Settings | None = None,
    on_fatal: FatalHandler | None = None,
    span_exporter: SpanExporter | None = None,
    config_stamp: FileStamp = None,
    reread: Callable[[], Settings] = read_settings,
    config_file: Path | None = None,
) -> FastAPI:
    """Build the ASGI app for ``settings`` (read from the environment and config/ when omitted).

    ``span_exporter`` replaces the configured one (tests pass an in-memory exporter).
    For the reloads (``app.policy``): ``config_stamp`` is the config file's when ``settings``
    were read, ``reread`` reads them again the same way (with what the command line or a Ray
    builder set over the environment and the file), from ``config_file`` (default: the
    environment's, or ``config/default.toml``).
    """
    settings = settings or load_settings()
    fatal = on_fatal or _log_fatal
    metrics = Metrics()
    tracer_provider, processor = build_tracer_provider(settings.telemetry, span_exporter, metrics.dropped_spans.inc)
    exporting = processor is not None
    access_log = AccessLog(settings.logging.refusal_lines_per_s) if settings.logging.access_log else None
    # with nowhere to send spans, none are made: a span nobody can read still costs the request path
    tracer = tracer_provider.get_tracer("app.service") if exporting else trace.NoOpTracer()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # first: a secret that cannot be read fails start-up before anything is made that needs closing
        app.state.admin_token, app.state.api_key = await _secrets(settings, fatal)
        service = await _new_service(settings, metrics, tracer, fatal)
        app.state.service = service

        async def start() -> None:
            try:
                await service.start()
            except Exception as exc:
                fatal(str(exc))

        app.state.lifecycle = LifecycleManager(service)
        app.state.policy = policy = PolicyManager(settings, service.set_policy, config_stamp, reread, config_file)
        app.state.starting = starting = asyncio.create_task(start(), name="model-start")
        watching = asyncio.create_task(policy.watch(settings.admin.config_watch_s), name="config-watch")
        lag = watch_loop(metrics.loop_lag, settings.telemetry.loop_lag_interval_ms, settings.telemetry.loop_lag_warn_ms)
        summaries = [asyncio.create_task(access_log.report_every(), name="access-log")] if access_log else []
        rereads: set[asyncio.Task[None]] = set()
        on_sighup, secrets = _reloader(app, settings, policy, rereads)
        with _on_sighup(on_sighup):
            background = [starting, watching, secrets, *lag, *summaries]
            try:
                yield
            finally:
                for task in [*background, *rereads]:
                    task.cancel()
                # nothing of theirs stops the close; an admin load (its caller perhaps gone) is not
                # cancelled but ends by itself, within its timeout, and is retired if it ends now
                await asyncio.gather(*background, *rereads, return_exceptions=True)
                await _loads_unless_halted(app.state.lifecycle.loads_under_way(), service)
                try:
                    await service.close(settings.server.shutdown_grace_s)
                    await asyncio.to_thread(tracer_provider.shutdown)  # flush what the exporter can take
                finally:
                    if access_log is not None:
                        access_log.report_unlogged(force=True)  # the 503s past the cap not summed up yet

    app = (TracedApp if exporting else FastAPI)(
        title="ai-backend",
        version="0.1.0",
        summary="Image classification over REST with dual-window batching.",
        lifespan=lifespan,
        # the service's settings say what is traced (app.telemetry). FastAPI's own telemetry
        # turns on wherever global OpenTelemetry providers are set (opentelemetry-instrument,
        # FASTAPI_OTEL_AUTO_CONFIGURE): it would trace with the exporter off, on the hot path
        telemetry={"tracing": False, "metrics": False, "logs": False, "auto_configure": False},
        # a path with a slash too many is a 404 in the envelope, not a 307 whose Location is built
        # from the request's Host header and which sends a client's body a second time
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.access_log = access_log
    app.state.tracer_provider = tracer_provider
    app.state.tracing = exporting  # the edge refuses nothing then: each refusal gets its span
    _install_routes(app, settings, metrics, access_log)
    if exporting:
        _trace_requests(app, tracer_provider)
    return app
