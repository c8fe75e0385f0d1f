"""Helpers shared by the integration and end-to-end tests: images, apps, repositories.

Nothing here touches the network: apps run in-process through ``httpx.ASGITransport``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import io
import os
import shutil
import socket
import struct
import threading
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp, Receive, Scope, Send

from app.batching import Lane
from app.main import create_app
from app.service import InferenceService
from app.settings import Settings, load_settings

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
DIGITS_DIR = MODELS_DIR / "digits"
SAMPLES_DIR = DIGITS_DIR / "samples"
MODEL_NAME = "digits"
LABELS = tuple(str(d) for d in range(10))

# A request id the middleware must keep: the full allowed alphabet, well under 128 chars.
VALID_REQUEST_ID = "test-Req_1.2:abc"


# --- images -----------------------------------------------------------------------------


@contextlib.contextmanager
def cyclic_garbage() -> Iterator[Counter[str]]:
    """What the block leaves for the cyclic collector, by type name (filled when it ends): objects
    only a reference cycle keeps alive, which reference counting never frees. Under load such
    garbage is what sets off the collector's passes, each holding the GIL."""
    found: Counter[str] = Counter()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable is kept in gc.garbage
    try:
        yield found
        gc.collect()
        found.update(type(thing).__name__ for thing in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def sample_png(digit: int) -> bytes:
    """The bundled sample PNG of ``digit``."""
    return (SAMPLES_DIR / f"digit_{digit}.png").read_bytes()


def reencode(data: bytes, fmt: str, size: int | None = None, **params: object) -> bytes:
    """``data`` decoded and written again as ``fmt`` (JPEG, WEBP, PNG, GIF, BMP), optionally resized."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        converted = image.convert("L")
    if size is not None:
        converted = converted.resize((size, size), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    converted.save(out, format=fmt, **params)
    return out.getvalue()


def png_from_array(pixels: np.ndarray) -> bytes:
    """A grayscale PNG of a ``H x W`` uint8 array, pixel for pixel."""
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8), mode="L").save(out, format="PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_header_only(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares ``width`` x ``height`` grayscale pixels (a decompression bomb).

    The image data is a few rows of zeros: anything that trusts the header and decodes
    would have to allocate ``width * height`` bytes. Only a header check stops it cheaply.
    """
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = zlib.compress(b"\x00" * (width + 1) * 4)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", rows) + _png_chunk(b"IEND", b"")


def noise_png(size: int, seed: int = 0) -> bytes:
    """A PNG of random gray noise: incompressible, so its byte size is about ``size * size``."""
    rng = np.random.default_rng(seed)
    return png_from_array(rng.integers(0, 256, (size, size), dtype=np.uint8))


def top_label(body: dict[str, object]) -> str:
    predictions = body["predictions"]
    assert isinstance(predictions, list) and predictions, body
    first = predictions[0]
    assert isinstance(first, dict)
    return str(first["label"])


# --- model repositories -----------------------------------------------------------------


class PulledBody:
    """A request body of ``chunks`` chunks of 1 MiB, sent chunked as the client reads it:
    ``pulled`` counts the chunks read, so a test sees how much of it the server took."""

    def __init__(self, chunks: int = 64) -> None:
        self.chunks, self.pulled = chunks, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.chunks):
            self.pulled += 1
            yield b" " * (1 << 20)


def copy_repository(into: Path) -> Path:
    """A copy of the bundled repository (the digits model, version 1) under ``into``; returns its root."""
    root = into / "models"
    shutil.copytree(DIGITS_DIR / "1", root / MODEL_NAME / "1")
    return root


def truncate_file(path: Path, keep: float = 0.5) -> None:
    """Cut ``path`` to ``keep`` of its length, as a half-finished copy would leave it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def metric_samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of ``name`` in a /metrics page, by its labels (sorted name, value pairs)."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


# --- apps under their real lifespan -----------------------------------------------------


@dataclass
class RunningApp:
    """An app whose lifespan is running, and a client talking to it in-process."""

    app: FastAPI
    client: httpx.AsyncClient
    fatal: list[str] = field(default_factory=list)
    asgi: ASGIApp | None = None  # the app as the server calls it (lifespan state in each scope)

    @property
    def service(self) -> InferenceService:
        service: InferenceService = self.app.state.service
        return service

    @property
    def starting(self) -> asyncio.Task[None]:
        task: asyncio.Task[None] = self.app.state.starting
        return task

    async def wait_started(self, timeout: float = 60.0) -> None:
        """Wait for the background start task (success or failure) to finish."""
        await asyncio.wait_for(asyncio.shield(self.starting), timeout)

    async def predict_png(
        self,
        data: bytes,
        *,
        path: str = "/predict",
        headers: dict[str, str] | None = None,
        params: dict[str, Any] | list[tuple[str, str]] | None = None,
    ) -> httpx.Response:
        """POST ``data`` as a raw ``image/png`` body (unless ``headers`` say another type)."""
        sent = {"Content-Type": "image/png", **(headers or {})}
        return await self.client.post(path, content=data, headers=sent, params=params)


def state_per_request(app: ASGIApp) -> ASGIApp:
    """Give each request its own shallow copy of the lifespan state, as uvicorn does.

    ``asgi_lifespan.LifespanManager`` puts one shared dict into every request's
    ``scope["state"]``; the ASGI spec (and uvicorn) copy it per request. The service keeps
    per-request values there (the request id), so without this concurrent in-process
    requests would overwrite each other's ids: a harness artefact, not a service bug.
    """

    async def app_with_own_state(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and "state" in scope:
            scope = {**scope, "state": dict(scope["state"])}
        await app(scope, receive, send)

    return app_with_own_state


@contextlib.asynccontextmanager
async def running_app(
    settings: Settings, *, wait: bool = True, on_fatal: Callable[[str], None] | None = None, **create: Any
) -> AsyncIterator[RunningApp]:
    """``create_app(settings)`` under ``LifespanManager``, with an ``httpx`` client on it.

    ``wait``: return only once the start task finished (the service is ready, or failed).
    Fatal start-up messages are collected in ``RunningApp.fatal`` unless ``on_fatal`` is given;
    ``create`` goes to ``create_app``.
    """
    fatal: list[str] = []
    app = create_app(settings, on_fatal=on_fatal or fatal.append, **create)
    async with LifespanManager(state_per_request(app), startup_timeout=30, shutdown_timeout=30) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=30) as client:
            running = RunningApp(app, client, fatal, manager.app)
            if wait:
                await running.wait_started()
            yield running


# --- settings ---------------------------------------------------------------------------

# Small and quick: one decode worker, CPU fp32 (the service would pick fp16 on a GPU box,
# which these tests do not mean to exercise), a 64 KiB image limit, a 5 ms normal window
# (tests that send one request at a time would otherwise wait 25 ms each), no access log,
# and no warm-up (it costs about a second per app on a busy 2-core machine; the readiness
# tests and the end-to-end server keep it on).
TEST_DEFAULTS: dict[str, Any] = {
    "server": {"preprocess_workers": 1, "max_image_bytes": 64 * 1024, "shutdown_grace_s": 5.0},
    "batching": {"normal": {"window_ms": 5.0}},
    "model": {"device": "cpu", "dtype": "float32", "warmup": False},
    "logging": {"access_log": False},
}


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` deep-merged onto ``base`` (nested dicts merge, everything else replaces)."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# Set once per session by tests/conftest.py: a private copy of the bundled repository, so
# that in-process tests never read models/ while something rebuilds it in place.
test_repository: Path | None = None


def build_settings(**overrides: Any) -> Settings:
    """Test settings: ``TEST_DEFAULTS`` deep-merged with ``overrides``, over config/default.toml."""
    defaults = TEST_DEFAULTS
    if test_repository is not None:
        defaults = merge(defaults, {"model": {"repository": test_repository}})
    return load_settings(**merge(defaults, overrides))


async def wait_queued(running: RunningApp, lane: Lane, depth: int, timeout: float = 30.0) -> None:
    """Until exactly ``depth`` requests wait in ``lane`` of the default model's batcher.

    The batcher exposes no event for "a request was queued", so this polls its depth; the
    condition holds within one decode (milliseconds), and the timeout only bounds a failure.
    """
    batcher = running.service.models[MODEL_NAME].batcher
    async with asyncio.timeout(timeout):
        while batcher.queued(lane) != depth:  # noqa: ASYNC110 - nothing to wait on but the depth
            await asyncio.sleep(0.002)


def free_port(host: str = "127.0.0.1") -> int:
    """A loopback port free right now, for a server a test starts."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` loopback ports free right now and distinct (each held until all are chosen: two
    calls to ``free_port`` in a row may both get the port the first let go of)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def server_environment(overrides: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment for a server subprocess: no ``AI_SERVICE_*`` setting (nor any
    other prefix in ``drop``), unbuffered output, tracebacks of every thread on a crash (an abort
    at exit leaves them in the log), then ``overrides``. A ``PYTHONPATH`` among them goes before
    this process's own, which stays (packages installed with ``pip --target``, as on a GPU host)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AI_SERVICE_", *drop))}
    env.update(PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.update(overrides or {})
    inherited = os.environ.get("PYTHONPATH")
    if inherited and overrides and "PYTHONPATH" in overrides:
        env["PYTHONPATH"] = os.pathsep.join([overrides["PYTHONPATH"], inherited])
    return env


@dataclass
class HeldBatch:
    """A started service whose one device thread holds its batch until ``release`` is set, with
    one more request queued behind it: ``running`` and ``queued`` are their predictions."""

    service: InferenceService
    running: asyncio.Task[Any]
    queued: asyncio.Task[Any]
    release: threading.Event


async def held_batch_and_one_queued(repository: Path, held_s: float, **model: Any) -> HeldBatch:
    """``repository``'s digits model served with one device thread and batches of one, the first
    batch held on its device thread (``held_s`` at most: a device call that hangs), one request queued."""
    from app.inference.loader import LayeredModel

    settings = Settings(
        model={"repository": repository, "warmup": False, "device_workers": 1, **model},  # type: ignore[arg-type]
        batching={"normal": {"window_ms": 5.0, "max_batch": 1, "max_queue": 8}},  # type: ignore[arg-type]
    )
    service = InferenceService(settings)
    await service.start()
    served = service.models[MODEL_NAME]
    held_model = served.runner.model
    assert isinstance(held_model, LayeredModel)
    probabilities, inside, release = held_model.probabilities, threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        inside.set()
        release.wait(held_s)
        return probabilities(*args, **kwargs)

    held_model.probabilities = held  # type: ignore[method-assign]
    running = asyncio.create_task(service.predict(served, sample_png(1), 3, Lane.NORMAL, 60.0))
    assert await asyncio.to_thread(inside.wait, 30), "the batch never reached the device"
    queued = asyncio.create_task(service.predict(served, sample_png(2), 3, Lane.NORMAL, 60.0))
    async with asyncio.timeout(30):
        while served.batcher.queued(Lane.NORMAL) != 1:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
    return HeldBatch(service, running, queued, release)
