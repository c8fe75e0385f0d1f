"""Batching under the real lifespan: concurrent requests share batches, urgent goes first.

Batches are made to form by count (a lane's max_batch) under windows far longer than the
test, so what forms is decided by the batcher's rules, not by how fast this machine is.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from app.batching import Lane
from tests.conftest import SettingsFactory
from tests.support import MODEL_NAME, RunningApp, b64, running_app, sample_png, top_label, wait_queued

LONG_WINDOW_MS = 20_000.0  # never reached by a passing test
LONG_TIMEOUTS = {"default_timeout_ms": 60_000, "max_timeout_ms": 120_000}


def _assert_batches_consistent(responses: list[httpx.Response], batches_run: int) -> None:
    """Each batch of size s answers exactly s requests that all say s; the sizes add up."""
    sizes = Counter(r.json()["batch_size"] for r in responses)
    for size, count in sizes.items():
        assert count % size == 0, sizes
    assert sum(count // size for size, count in sizes.items()) == batches_run, (sizes, batches_run)
    assert sum(sizes.values()) == len(responses)


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


async def test_concurrent_requests_under_default_windows_are_consistent(make_settings: SettingsFactory) -> None:
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


class Recorder:
    """Sends requests as tasks and notes the order in which their responses come back."""

    def __init__(self, running: RunningApp) -> None:
        self.running = running
        self.finished: list[str] = []

    def send(self, tag: str, digit: int, headers: dict[str, str] | None = None) -> asyncio.Task[httpx.Response]:
        async def call() -> httpx.Response:
            response = await self.running.predict_png(
                sample_png(digit), headers={"X-Request-ID": tag, **(headers or {})}
            )
            self.finished.append(tag)
            return response

        return asyncio.create_task(call(), name=tag)

    async def queue_normals(self, tags: list[str]) -> list[asyncio.Task[httpx.Response]]:
        """One normal request per tag, each queued before the next is sent, so queue order is tag order."""
        tasks = []
        for i, tag in enumerate(tags):
            depth = self.running.service.models[MODEL_NAME].batcher.queued(Lane.NORMAL)
            tasks.append(self.send(tag, i % 10))
            await wait_queued(self.running, Lane.NORMAL, depth + 1)
        return tasks


def _urgency_settings(make_settings: SettingsFactory, *, urgent_fill: bool, urgent_max_batch: int = 16):  # type: ignore[no-untyped-def]
    return make_settings(
        server=LONG_TIMEOUTS,
        batching={
            "urgent_fill": urgent_fill,
            "normal": {"window_ms": LONG_WINDOW_MS, "max_batch": 8, "max_queue": 1024},
            "urgent": {"window_ms": 2.0, "max_batch": urgent_max_batch, "max_queue": 64},
        },
    )


async def _settle(tasks: list[asyncio.Task[httpx.Response]]) -> list[httpx.Response]:
    """The tasks' responses; a safety bound only (a failing batcher would otherwise wait out the window)."""
    async with asyncio.timeout(30):
        responses = await asyncio.gather(*tasks)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    return list(responses)


async def test_urgent_overtakes_queued_normals_and_carries_them_along(make_settings: SettingsFactory) -> None:
    async with running_app(_urgency_settings(make_settings, urgent_fill=True)) as running:
        recorder = Recorder(running)
        normals = await recorder.queue_normals(["n0", "n1", "n2"])
        urgent = recorder.send("urgent", 9, {"X-Urgency": "HIGH"})  # case-insensitive
        responses = await _settle([urgent, *normals])

        assert recorder.finished[0] == "urgent"
        urgent_body, *normal_bodies = (r.json() for r in responses)
        assert urgent_body["lane"] == "urgent" and top_label(urgent_body) == "9"
        # one urgent batch of four, long before the normal window could have closed
        assert urgent_body["batch_size"] == 4
        assert [b["batch_size"] for b in normal_bodies] == [4, 4, 4]
        assert [b["lane"] for b in normal_bodies] == ["normal"] * 3
        assert [top_label(b) for b in normal_bodies] == ["0", "1", "2"]
        assert running.service.models[MODEL_NAME].batcher.depth(Lane.NORMAL) == 0


async def test_urgent_fill_takes_the_oldest_normals_first(make_settings: SettingsFactory) -> None:
    settings = _urgency_settings(make_settings, urgent_fill=True, urgent_max_batch=2)
    async with running_app(settings) as running:
        recorder = Recorder(running)
        normals = await recorder.queue_normals(["n0", "n1", "n2"])
        urgent = recorder.send("urgent", 5, {"X-Urgency": "high"})
        (urgent_response,) = await _settle([urgent])
        oldest = await _settle(normals[:1])

        # one free seat in the urgent batch: it went to n0, the oldest; n1 and n2 still wait
        assert urgent_response.json()["batch_size"] == 2
        assert oldest[0].json()["batch_size"] == 2 and oldest[0].json()["lane"] == "normal"
        assert not normals[1].done() and not normals[2].done()
        assert running.service.models[MODEL_NAME].batcher.depth(Lane.NORMAL) == 2

        # six more fill the normal batch of eight: n1, n2 and the newcomers leave together
        newcomers = [recorder.send(f"m{i}", i) for i in range(6)]
        rest = await _settle([*normals[1:], *newcomers])
        assert [r.json()["batch_size"] for r in rest] == [8] * 8
        assert recorder.finished[:2] == ["urgent", "n0"]


async def test_without_urgent_fill_normals_wait_for_their_own_batch(make_settings: SettingsFactory) -> None:
    async with running_app(_urgency_settings(make_settings, urgent_fill=False)) as running:
        recorder = Recorder(running)
        normals = await recorder.queue_normals(["n0", "n1", "n2"])
        urgent = recorder.send("urgent", 7, {"X-Urgency": "High"})
        (urgent_response,) = await _settle([urgent])

        assert urgent_response.json()["batch_size"] == 1
        assert urgent_response.json()["lane"] == "urgent"
        assert top_label(urgent_response.json()) == "7"
        # the normals did not ride along: still queued, not answered
        assert not any(task.done() for task in normals)
        assert running.service.models[MODEL_NAME].batcher.depth(Lane.NORMAL) == 3

        newcomers = [recorder.send(f"m{i}", i) for i in range(5)]
        rest = await _settle([*normals, *newcomers])
        assert [r.json()["batch_size"] for r in rest] == [8] * 8
        assert [r.json()["lane"] for r in rest] == ["normal"] * 8
        assert [top_label(r.json()) for r in rest] == ["0", "1", "2", "0", "1", "2", "3", "4"]
        assert recorder.finished[0] == "urgent"


async def test_explicit_normal_urgency_uses_the_normal_lane(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings()) as running:
        response = await running.predict_png(sample_png(1), headers={"X-Urgency": " Normal "})
        assert response.status_code == 200, response.text
        assert response.json()["lane"] == "normal"
        urgent = await running.predict_png(sample_png(1), headers={"X-Urgency": "high"})
        assert urgent.json()["lane"] == "urgent"


@pytest.mark.usefixtures("no_hurry")  # it waits out the window, as behind a busy device
async def test_a_request_past_its_deadline_is_answered_503_and_never_computed(make_settings: SettingsFactory) -> None:
    settings = make_settings(
        server=LONG_TIMEOUTS, batching={"normal": {"window_ms": LONG_WINDOW_MS, "max_batch": 8, "max_queue": 64}}
    )
    async with running_app(settings) as running:
        batcher = running.service.models[MODEL_NAME].batcher
        before = batcher.batches
        # alone in a lane whose window never closes: only its own deadline can answer it
        late = await running.predict_png(sample_png(2), headers={"X-Request-Timeout": "50", "X-Request-ID": "late"})
        assert late.status_code == 503, late.text
        assert late.json() == {"code": "deadline_exceeded", "message": late.json()["message"], "request_id": "late"}
        assert int(late.headers["retry-after"]) >= 1
        assert batcher.batches == before
        assert batcher.depth(Lane.NORMAL) == 0
        # the service is unharmed: an urgent request with a generous deadline is answered
        ok = await running.predict_png(sample_png(2), headers={"X-Urgency": "high", "X-Request-Timeout": "60000"})
        assert ok.status_code == 200 and top_label(ok.json()) == "2"
        assert ok.json()["batch_size"] == 1
