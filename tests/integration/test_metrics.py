"""/metrics after real traffic: histograms and counters move, labels stay bounded."""

from __future__ import annotations

import asyncio
import threading

from prometheus_client.parser import text_string_to_metric_families

from app.batching import Lane
from tests.conftest import SettingsFactory
from tests.support import RunningApp, b64, running_app, sample_png, wait_queued


async def scrape(running: RunningApp) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await running.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


async def test_traffic_moves_the_histograms_and_counters(make_settings: SettingsFactory) -> None:
    # batches fill by count under a window that never closes (see test_device_faults)
    normal = {"window_ms": 20_000.0, "max_batch": 4, "max_queue": 8}
    settings = make_settings(batching={"normal": normal, "admission_headroom": 1.0})
    async with running_app(settings) as running:
        before = await scrape(running)
        assert value(before, "ai_backend_model_info", model="digits", version="1", device="cpu", dtype="float32") == 1
        assert value(before, "ai_backend_model_load_seconds", model="digits", version="1") > 0

        ok = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in range(4)))
        assert [r.status_code for r in ok] == [200] * 4
        urgent = await running.predict_png(sample_png(5), headers={"X-Urgency": "high"})
        assert urgent.status_code == 200
        bad = await running.client.post("/predict", json={"image_base64": "@@"})
        assert bad.status_code == 400

        after = await scrape(running)
        assert total(after, "ai_backend_batch_size_count", lane="normal") == 1
        assert value(after, "ai_backend_batch_size_sum", lane="normal") == 4
        assert value(after, "ai_backend_batch_fill_ratio_sum", lane="normal") == 1.0
        assert total(after, "ai_backend_batch_size_count", lane="urgent") == 1
        assert total(after, "ai_backend_queue_wait_seconds_count", lane="normal") == 4
        assert total(after, "ai_backend_queue_wait_seconds_count", lane="urgent") == 1, "under its own lane"
        assert total(after, "ai_backend_inference_seconds_count", model="digits", version="1", batch_size="3-4") == 1
        assert (
            value(after, "ai_backend_requests_total", status="200", code="ok")
            - value(before, "ai_backend_requests_total", status="200", code="ok")
            >= 5
        )
        assert value(after, "ai_backend_requests_total", status="400", code="invalid_base64") == 1
        latency = total(
            after, "ai_backend_request_duration_seconds_count", route="/predict", status="200", lane="normal"
        )
        assert latency == 4
        assert value(after, "ai_backend_in_flight_requests") == 1  # the scrape itself


async def test_queue_depth_rejections_and_cancellations_are_counted(make_settings: SettingsFactory) -> None:
    settings = make_settings(
        server={"default_timeout_ms": 60_000},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": 2, "max_queue": 2}},
        model={"device_workers": 1},  # one batch in flight: the next ones queue behind it
    )
    async with running_app(settings) as running:
        batcher = running.service.models["digits"].batcher
        gate = threading.Event()
        for _ in range(running.service.threads.workers):  # hold the device: queues can only grow
            running.service._device_thread.submit(gate.wait)
        try:
            running_batch = [asyncio.ensure_future(running.predict_png(sample_png(d))) for d in (1, 2)]
            async with asyncio.timeout(30):
                # a full batch of two leaves at once, then waits for the device; no event says so
                while batcher.batches == 0:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
            waiting = asyncio.ensure_future(running.predict_png(sample_png(3)))
            # queued beside ``waiting`` until its deadline: long enough for both to be decoded and the
            # depth read on a loaded machine (at 300 ms it could expire first, and the depth never read 2)
            doomed = asyncio.ensure_future(running.predict_png(sample_png(4), headers={"X-Request-Timeout": "1000"}))
            await wait_queued(running, Lane.NORMAL, 2)
            samples = await scrape(running)
            assert value(samples, "ai_backend_queue_depth", model="digits", version="1", lane="normal") == 2
            refused = await running.client.post("/predict", json={"image_base64": b64(sample_png(5))})
            assert refused.status_code == 503 and refused.json()["code"] == "queue_full"
            assert refused.headers["Retry-After"]
            late = await doomed
            assert late.status_code == 503 and late.json()["code"] == "deadline_exceeded"
            waiting.cancel()
            await wait_queued(running, Lane.NORMAL, 0)
            samples = await scrape(running)
            assert value(samples, "ai_backend_rejections_total", reason="queue_full") == 1
            assert value(samples, "ai_backend_cancellations_total", reason="deadline") == 1
            assert value(samples, "ai_backend_cancellations_total", reason="cancelled") == 1
            assert value(samples, "ai_backend_queue_depth", model="digits", version="1", lane="normal") == 0
        finally:
            gate.set()
        assert [r.status_code for r in await asyncio.gather(*running_batch)] == [200, 200]
        samples = await scrape(running)
        assert total(samples, "ai_backend_batch_size_count", lane="normal") == 1, "nothing else was computed"


async def test_a_device_that_cannot_say_its_memory_leaves_the_rest_of_the_scrape(
    make_settings: SettingsFactory,
) -> None:
    def lost() -> list[tuple[str, int]]:  # what torch.cuda raises once the context is gone
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async with running_app(make_settings()) as running:
        running.app.state.metrics.scrape_time.device_memory = lost
        running.app.state.metrics.scrape_time.device_memory_total = lost
        samples = await scrape(running)  # 200, and parses
    assert value(samples, "ai_backend_model_info", model="digits", version="1", device="cpu", dtype="float32") == 1
    assert not [name for name, _ in samples if name.startswith("ai_backend_device_memory")]


async def test_the_event_loops_lag_is_sampled_while_serving_and_its_task_ends_with_the_app(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(telemetry={"loop_lag_interval_ms": 5.0})
    async with running_app(settings) as running:
        await asyncio.sleep(0.1)
        samples = await scrape(running)
        assert value(samples, "ai_backend_event_loop_lag_seconds_count") >= 3
        assert [t for t in asyncio.all_tasks() if t.get_name() == "loop-lag"]
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "loop-lag"], "closed with the app"


async def test_the_labelled_counters_start_at_zero(make_settings: SettingsFactory) -> None:
    """A series born with its first event hides that event from rate() and increase(), and a panel
    reads "no data" rather than 0: every reason, and each loaded version's failures and faults,
    are there at 0 from the start (a version's go when it is unloaded: tests/integration/
    test_lifecycle_api.py)."""
    async with running_app(make_settings()) as running:
        samples = await scrape(running)
    zero = {
        ("ai_backend_rejections_total", (("reason", reason),))
        for reason in ("queue_full", "would_miss_deadline", "deadline_exceeded")
    }
    zero |= {("ai_backend_cancellations_total", (("reason", reason),)) for reason in ("cancelled", "deadline", "late")}
    zero.add(("ai_backend_batch_failures_total", (("model", "digits"), ("version", "1"))))
    zero |= {
        ("ai_backend_device_faults_total", (("fault", fault), ("model", "digits"), ("version", "1")))
        for fault in ("out_of_memory", "device_error")
    }
    assert {key: samples.get(key) for key in zero} == dict.fromkeys(zero, 0.0)


async def test_a_normal_request_riding_an_urgent_batch_waits_under_its_own_lane(make_settings: SettingsFactory) -> None:
    normal = {"window_ms": 20_000.0, "max_batch": 8, "max_queue": 8}
    settings = make_settings(batching={"normal": normal, "urgent_fill": "always", "admission_headroom": 1.0})
    async with running_app(settings) as running:
        riders = [asyncio.create_task(running.predict_png(sample_png(d))) for d in range(3)]
        while running.service.models["digits"].batcher.queued(Lane.NORMAL) < 3:  # noqa: ASYNC110 (queued)
            await asyncio.sleep(0.01)
        urgent = await running.predict_png(sample_png(5), headers={"X-Urgency": "high"})
        answers = [await rider for rider in riders]
        assert [a.json()["batch_size"] for a in (urgent, *answers)] == [4] * 4, "one urgent batch took them all"
        after = await scrape(running)
        assert total(after, "ai_backend_batch_size_count", lane="urgent") == 1
        assert total(after, "ai_backend_queue_wait_seconds_count", lane="normal") == 3
        assert total(after, "ai_backend_queue_wait_seconds_count", lane="urgent") == 1


async def test_a_batch_that_reached_the_device_with_nothing_is_not_counted_as_one_that_ran(
    make_settings: SettingsFactory,
) -> None:
    """Decoded in the batch (``server.decode=batch``), an image that does not decode is found
    there: a batch of only such images ran no forward pass. Its requests waited in the queue,
    but its size (as formed) and near-zero time were recorded as a batch's run."""
    settings = make_settings(server={"decode": "batch"}, batching={"normal": {"window_ms": 5.0, "max_batch": 4}})
    async with running_app(settings) as running:
        truncated = sample_png(2)[:60]  # a PNG's signature and header, no image data: found only by decoding
        bad = await running.predict_png(truncated)
        assert bad.status_code == 400 and bad.json()["code"] == "undecodable_image", bad.text
        after = await scrape(running)
        assert total(after, "ai_backend_queue_wait_seconds_count", lane="normal") == 1, "it did wait"
        assert total(after, "ai_backend_batch_size_count") == 0
        assert total(after, "ai_backend_batch_fill_ratio_count") == 0
        assert total(after, "ai_backend_inference_seconds_count") == 0
        ok = await running.predict_png(sample_png(3))
        assert ok.status_code == 200, ok.text
        after = await scrape(running)
        assert total(after, "ai_backend_batch_size_count", lane="normal") == 1
        assert total(after, "ai_backend_inference_seconds_count", model="digits", version="1", batch_size="1") == 1
