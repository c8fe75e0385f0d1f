"""The drain's warning when it left requests unanswered, with ``server.shutdown_grace_s`` unset
(None: no limit). No grace can run out then; a drain stopped before it ended (cancelled) leaves
the queued requests answered 503 draining all the same, and the close's drain reported them as
"the drain's grace (no limit) ran out"."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
from pathlib import Path

import pytest

from app.batching import Lane
from app.inference.loader import LayeredModel
from app.service import InferenceService
from app.settings import Settings
from tests.support import sample_png

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "models" / "digits" / "1", tmp_path / "digits" / "1")
    return tmp_path


async def test_a_drain_with_no_limit_stopped_early_says_so_not_that_its_grace_ran_out(
    repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(
        model={"repository": repository, "warmup": False, "device_workers": 1},  # type: ignore[arg-type]
        batching={"normal": {"window_ms": 5.0, "max_batch": 1, "max_queue": 8}},  # type: ignore[arg-type]
    )
    service = InferenceService(settings)
    await service.start()
    served = service.models["digits"]
    model = served.runner.model
    assert isinstance(model, LayeredModel)
    probabilities, inside, release = model.probabilities, threading.Event(), threading.Event()

    def held(*args, **kwargs):  # type: ignore[no-untyped-def]
        inside.set()
        release.wait(30)
        return probabilities(*args, **kwargs)

    model.probabilities = held  # type: ignore[method-assign]
    running = asyncio.create_task(service.predict(served, sample_png(1), 3, Lane.NORMAL, 30.0))
    assert await asyncio.to_thread(inside.wait, 30)
    queued = asyncio.create_task(service.predict(served, sample_png(2), 3, Lane.NORMAL, 30.0))
    async with asyncio.timeout(30):
        while served.batcher.queued(Lane.NORMAL) != 1:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
    caplog.set_level("INFO", logger="app.service")
    drain = asyncio.create_task(service.drain(None))
    await asyncio.sleep(0.1)
    drain.cancel()  # stopped before it ended (its task cancelled)
    with contextlib.suppress(asyncio.CancelledError):
        await drain
    release.set()
    await service.close(None)
    await asyncio.gather(running, queued, return_exceptions=True)
    said = [r.getMessage() for r in caplog.records if r.name == "app.service" and "drain" in r.getMessage()]
    assert said == [
        "the drain (no time limit) was stopped before it ended: 1 queued or running request(s) answered 503 draining"
    ]
