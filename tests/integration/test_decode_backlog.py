"""A backlog at the decode pool counts at admission, and an image past its deadline is not decoded
(``server.decode=pool``: decoded in the batch, an image never waits for a decode thread)."""

from __future__ import annotations

import asyncio
import math
import threading

from app.batching import Lane
from tests.conftest import SettingsFactory
from tests.integration.test_metrics import scrape, total
from tests.support import running_app, sample_png


async def test_requests_waiting_to_be_decoded_fill_the_queue_and_late_ones_are_never_decoded(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(
        server={"default_timeout_ms": 60_000, "decode": "pool"},
        batching={"normal": {"window_ms": 5.0, "max_batch": 2, "max_queue": 2}},
    )
    async with running_app(settings) as running:
        service = running.service
        gate = threading.Event()
        for _ in range(service.threads.decode):  # every decode thread busy: images wait for one
            service._pool.submit(gate.wait)
        try:
            waiting = [asyncio.ensure_future(running.predict_png(sample_png(d))) for d in (1, 2)]
            batcher = service.models["digits"].batcher
            async with asyncio.timeout(30):
                while batcher.depth(Lane.NORMAL) < 2:  # noqa: ASYNC110 (no event says "admitted")
                    await asyncio.sleep(0.005)
            refused = await running.predict_png(sample_png(3))
            assert refused.status_code == 503 and refused.json()["code"] == "queue_full"
            assert refused.headers["Retry-After"]
            # nothing reached the batcher's queue itself (both are decoding), but what refused
            # the third is what the depth says: the queue-near-bound alert and the autoscaler
            # read it
            metrics = (await running.client.get("/metrics")).text
            assert 'ai_backend_queue_depth{lane="normal",model="digits",version="1"} 2.0' in metrics
            assert (await running.client.get("/healthz")).json()["models"][0]["queue_depth"]["normal"] == 2
        finally:
            gate.set()
        assert [r.status_code for r in await asyncio.gather(*waiting)] == [200, 200]

        # a deadline admission accepts on this host: a slow one measures slow batches, and a
        # 50 ms deadline was refused up front (would_miss_deadline) instead of expiring later
        predicted_ms = 1000 * (batcher.intake.predicted_wait(Lane.NORMAL) or 0.0)
        timeout_ms = max(50, math.ceil(4 * predicted_ms))
        gate = threading.Event()
        for _ in range(service.threads.decode):
            service._pool.submit(gate.wait)
        try:
            late = asyncio.ensure_future(
                running.predict_png(sample_png(4), headers={"X-Request-Timeout": str(timeout_ms)})
            )
            # its deadline passes while its image waits to be decoded: answered then, while the
            # decode threads are still busy, not once one is free (a bound against a hang, 30 s)
            answer = await asyncio.wait_for(late, 30)
        finally:
            gate.set()
        assert answer.status_code == 503 and answer.json()["code"] == "deadline_exceeded"
        assert "waited to be decoded" in answer.json()["message"]
        counted = await scrape(running)
        assert total(counted, "ai_backend_cancellations_total", reason="deadline") == 1
        ok = await running.predict_png(sample_png(5))
        assert ok.status_code == 200, "the seats were all given back"
