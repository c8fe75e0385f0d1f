"""An unload whose grace runs out: what it cuts off is told the version went, not that the
service shut down (it serves on); a shutdown still answers ``draining``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from app.batching import Lane
from tests.integration.test_lifecycle_api import AUTH, settings_for
from tests.support import RunningApp, running_app, sample_png

PINNED = {"Content-Type": "image/png", "X-Model-Version": "2", "X-Request-Timeout": "20000"}


async def _running_and_queued_on_version_2(running: RunningApp) -> tuple[list[asyncio.Future[httpx.Response]], Any]:
    """Version 2's batches held on its device until cancelled: as many running as may run, and
    one more queued behind them; the requests, and version 2's batcher."""
    batcher = running.service.groups["digits"].routing.loaded["2"].batcher
    never = asyncio.Event()

    async def held(payloads: Sequence[Any]) -> Sequence[Any]:
        await never.wait()
        raise AssertionError("never released")

    batcher._execution._runner = held
    requests: list[asyncio.Future[httpx.Response]] = []
    async with asyncio.timeout(10):
        for running_after in (*range(1, batcher.max_in_flight + 1), batcher.max_in_flight):
            requests.append(asyncio.ensure_future(running.predict_png(sample_png(len(requests)), headers=PINNED)))
            while batcher.batches_running() < running_after:  # noqa: ASYNC110 - its window, then its batch
                await asyncio.sleep(0.005)
        while batcher.queued(Lane.NORMAL) == 0:  # noqa: ASYNC110 - the last one waits for a free slot
            await asyncio.sleep(0.005)
    return requests, batcher


async def test_what_an_unload_cuts_off_is_told_the_version_was_unloaded(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        running.service.settings.server.shutdown_grace_s = 0.1
        requests, batcher = await _running_and_queued_on_version_2(running)
        unload = await running.client.post("/admin/models/digits/versions/2/unload", headers=AUTH)
        assert unload.status_code == 200 and not batcher.running, "the grace ran out"
        answers = await asyncio.gather(*requests)
        assert len(answers) >= 2
        for answer in answers:  # the running ones, and the one queued behind them
            assert answer.status_code == 503, answer.text
            assert answer.json()["code"] == "version_not_loaded", answer.text
            assert "version 2 of digits was unloaded" in answer.json()["message"]
            assert answer.headers["Retry-After"]
        assert (await running.client.get("/readyz")).status_code == 200, "it serves on"
        assert (await running.predict_png(sample_png(1))).status_code == 200


async def test_what_a_shutdown_cuts_off_is_told_the_service_shut_down(repository: Path) -> None:
    async with running_app(settings_for(repository)) as running:
        requests, _ = await _running_and_queued_on_version_2(running)
        await running.service.drain(0.1)
        answers = await asyncio.gather(*requests)
        assert {(a.status_code, a.json()["code"]) for a in answers} == {(503, "draining")}
