"""Batching under the real lifespan: concurrent requests share batches, urgent goes first.

Batches are made to form by count (a lane's max_batch) under windows far longer than the
test, so what forms is decided by the batcher's rules, not by how fast this machine is.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from app.batching import Lane
from tests.conftest import SettingsFactory
from tests.support import MODEL_NAME, RunningApp, b64, running_app, sample_png, top_label

LONG_WINDOW_MS = 20_000.0  # never reached by a passing test
LONG_TIMEOUTS = {"default_timeout_ms": 60_000, "max_timeout_ms": 120_000}


def _assert_batches_consistent(responses: list[httpx.Response], batches_run: int) -> None:
    """Each batch of size s answers exactly s requests that all say s; the sizes add up."""
    sizes = Counter(r.json()["batch_size"] for r in responses)
    for size, count in sizes.items():
        assert count % size == 0, sizes
    assert sum(count // size for size, count in sizes.items()) == batches_run, (sizes, batches_run)
    assert sum(sizes.values()) == len(responses)


async def _wait_queued(running: RunningApp, lane: Lane, depth: int) -> None:
    """Until ``depth`` requests wait in ``lane`` (they pass preprocessing at their own pace)."""
    batcher = running.service.models[MODEL_NAME].batcher
    async with asyncio.timeout(30):
        while batcher.depth(lane) != depth:
            await asyncio.sleep(0.002)


async def test_concurrent_requests_share_full_batches(make_settings: SettingsFactory) -> None:
    settings = make_settings(
        server=LONG_TIMEOUTS, batching={"normal": {"window_ms": LONG_WINDOW_MS, "max_batch": 8, "max_queue": 64}}
    )
    async with running_app(settings) as running:
        batcher = running.service.models[MODEL_NAME].batcher
        before = batcher.batches
        digits = [i % 10 for i in range(32)]
        responses = await asyncio.gather(
            *(running.client.post("/predict", json={"image_base64": b64(sample_png(d))}) for d in digits)
        )
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
        # 32 requests, batches of 8 that leave only when full: exactly four, all full
        assert [r.json()["batch_size"] for r in responses] == [8] * 32
        assert batcher.batches - before == 4
        _assert_batches_consistent(list(responses), 4)
        # every answer went back to the request it belongs to
        assert [top_label(r.json()) for r in responses] == [str(d) for d in digits]
        assert len({r.json()["request_id"] for r in responses}) == 32


async def test_concurrent_requests_under_default_windows_are_consistent(
    make_settings: SettingsFactory,
) -> None:
    """The shipped windows (25 ms, max 16): whatever batches form, sizes and answers agree."""
    settings = make_settings(batching={"normal": {"window_ms": 25.0, "max_batch": 16}})
    async with running_app(settings) as running:
        batcher = running.service.models[MODEL_NAME].batcher
        before = batcher.batches
        digits = [i % 10 for i in range(32)]
        responses = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in digits))
        assert all(r.status_code == 200 for r in responses)
        assert all(1 <= r.json()["batch_size"] <= 16 for r in responses)
        _assert_batches_consistent(list(responses), batcher.batches - before)
        assert [top_label(r.json()) for r in responses] == [str(d) for d in digits]


async def _queue_normals(running: RunningApp, count: int, start: int = 0) -> list[asyncio.Task[httpx.Response]]:
    """``count`` normal requests, each queued before the next is sent (so their order is known)."""
    tasks = []
    for i in range(start, start + count):
        png = sample_png(i % 10)
        tasks.append(asyncio.create_task(running.predict_png(png, headers={"X-Request-ID": f"normal-{i}"})))
        await _wait_queued(running, Lane.NORMAL, i + 1 - _queued_offset(tasks, start))
    return tasks


def _queued_offset(tasks: list[asyncio.Task[httpx.Response]], start: int) -> int:
    return 0


def _urgency_settings(make_settings: SettingsFactory, *, urgent_fill: bool, urgent_max_batch: int = 16):  # type: ignore[no-untyped-def]
    return make_settings(
        server=LONG_TIMEOUTS,
        batching={
            "urgent_fill": urgent_fill,
            "normal": {"window_ms": LONG_WINDOW_MS, "max_batch": 8, "max_queue": 1024},
            "urgent": {"window_ms": 2.0, "max_batch": urgent_max_batch, "max_queue": 64},
        },
    )
