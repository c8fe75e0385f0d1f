"""A batch still running on a device thread once the drain's grace ran out is abandoned: the close
does not wait for it (every request of it has its 503 already, and the threads are daemons).

The close joined the device threads for up to 10 s after the grace: with Kubernetes' default
terminationGracePeriodSeconds (30) and the default grace (30 s), the kubelet's SIGKILL came first,
before the spans were flushed.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.inference.loader import LayeredModel
from tests.conftest import SettingsFactory
from tests.support import MODEL_NAME, running_app, sample_png

GRACE_S = 0.2
HELD_S = 30.0  # the batch's call: longer than any close may wait


async def test_a_batch_running_past_the_grace_is_abandoned_not_joined(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(
        server={"default_timeout_ms": 60_000, "shutdown_grace_s": GRACE_S},
        model={"device_workers": 1},
        telemetry={"exporter": "console"},
    )
    exporter = InMemorySpanExporter()
    release = threading.Event()
    caplog.set_level("INFO", logger="app.service")
    try:
        async with running_app(settings, span_exporter=exporter) as running:
            served = running.service.models[MODEL_NAME]
            model = served.runner.model
            assert isinstance(model, LayeredModel)
            probabilities = model.probabilities
            inside = threading.Event()

            def held(*args, **kwargs):  # type: ignore[no-untyped-def]
                inside.set()
                release.wait(HELD_S)  # on the device thread, past the grace and past the close
                return probabilities(*args, **kwargs)

            model.probabilities = held  # type: ignore[method-assign]
            answer = asyncio.create_task(running.predict_png(sample_png(3), headers={"X-Request-ID": "held"}))
            assert await asyncio.to_thread(inside.wait, 30), "the batch never reached the device"
            closing = time.monotonic()
        closed_in = time.monotonic() - closing  # the lifespan's close: the drain, the joins, the flush
        service = running.service
    finally:
        release.set()
    assert answer.result().status_code == 503 and answer.result().json()["code"] == "draining"
    assert closed_in < GRACE_S + 3, f"the close waited {closed_in:.1f}s for a batch nobody awaits"
    assert service.unfinished, "the thread still inside the call is named (the CLI exits without finalizing)"
    said = [r.getMessage() for r in caplog.records if r.name == "app.service"]
    assert any("abandoned" in line for line in said), said
    # telemetry still flushed by the close: the held request's server span
    assert [s for s in exporter.get_finished_spans() if s.attributes and s.attributes.get("request.id") == "held"]
