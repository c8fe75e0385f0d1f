"""Out of device memory through the whole batch path: the real runner on the bundled model, wired
to the batcher as the service wires them, with the allocator failing at random batch sizes.

Every request is answered once; while one image fits, every image is computed (the halves are
retried); the ceiling the failures set stays at least 1 and under the policy's max batch, and
climbs back to the policy's own sizes once batches full at it keep running.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace

from app.batching import BatchPolicy, Completed, DualWindowBatcher, Lane, LanePolicy
from app.batching.ceiling import MAX_BACKOFF_DOUBLINGS
from app.errors import DeviceUnavailable
from app.inference.device import DeviceThread
from app.inference.jobs import Answer, Job, TracedRunner
from app.inference.loader import LayeredModel
from app.inference.manifest import Manifest
from app.inference.postprocess import TopK
from app.inference.runner import ModelRunner
from tests.faults import Faulty

DIGITS = Path(__file__).resolve().parents[2] / "models" / "digits" / "1"
MS = 0.001


@pytest.fixture(scope="module")
def model() -> LayeredModel:
    loaded = LayeredModel.load(DIGITS, Manifest.read(DIGITS), torch.device("cpu"), torch.float32)
    loaded.load_all_heads()
    return loaded


def _wired(
    model: Faulty, device: DeviceThread, max_batch: int, lowered: list[tuple[int, int | None]]
) -> DualWindowBatcher[Job, Answer]:
    """The batcher and runner as ``InferenceService._load`` wires them (pressure from the device
    thread); ``lowered`` gets each failed size and the ceiling it left."""
    loop = asyncio.get_running_loop()
    batchers: list[DualWindowBatcher[Job, Answer]] = []

    def lower(size: int) -> None:
        batchers[0].lower_ceiling(size)
        lowered.append((size, batchers[0].ceiling))

    def on_pressure(size: int) -> None:
        loop.call_soon_threadsafe(lower, size)

    runner = ModelRunner(model, device, 3, on_pressure=on_pressure)
    lanes = BatchPolicy(LanePolicy(1 * MS, max_batch, 256), LanePolicy(1 * MS, max_batch, 256))
    batcher: DualWindowBatcher[Job, Answer] = DualWindowBatcher(
        TracedRunner(runner, trace.NoOpTracer(), "digits", "1", "float32"),
        lanes,
        computed=lambda answers: sum(answer.top is not None for answer in answers),
        model_epoch=lambda: runner.generation,
    )
    batchers.append(batcher)
    return batcher


async def _send(batcher: DualWindowBatcher[Job, Answer], images: torch.Tensor) -> list[object]:
    jobs = [Job(image, Lane.NORMAL, f"r{i}", None) for i, image in enumerate(images)]
    submits = [batcher.submit(job, Lane.NORMAL, 30.0) for job in jobs]
    return list(await asyncio.gather(*submits, return_exceptions=True))


async def _play(inner: LayeredModel, fail_at: int, max_batch: int, requests: int, recovery: int) -> None:
    device = DeviceThread("test-oom-device")
    faulty = Faulty(inner, fail_at=fail_at)
    try:
        lowered: list[tuple[int, int | None]] = []
        batcher = _wired(faulty, device, max_batch, lowered)
        batcher.recovery_batches = recovery
        batcher.start()
        try:
            answers = await _send(batcher, inner.dummy_batch(requests))
            assert len(answers) == requests
            for answer in answers:
                if fail_at == 1:  # not even one image fits: a device failure for each, 503
                    assert isinstance(answer, DeviceUnavailable), answer
                else:
                    assert isinstance(answer, Completed) and isinstance(answer.output.top, TopK), answer
            assert [size for size, _ in lowered] == [size for size in faulty.sizes if 1 < size >= fail_at], (
                "each batch split reports its size once"
            )
            for size, ceiling in lowered:
                assert ceiling is not None and 1 <= ceiling <= size // 2, f"{ceiling} after a failure at {size}"
            assert batcher.ceiling is None or 1 <= batcher.ceiling < max_batch
            faulty.fail_at = 10**9  # the pressure passes
            # each doubling of the cap waits for recovery batches at it, twice as many for each time
            # the pressure failed a rise before (at most MAX_BACKOFF_DOUBLINGS times)
            for _ in range(recovery * (1 << MAX_BACKOFF_DOUBLINGS) * max_batch.bit_length() + 1):
                if batcher.ceiling is None:
                    break
                size = batcher.ceiling
                before = len(faulty.sizes)
                await _send(batcher, inner.dummy_batch(size))  # a batch full at the ceiling
                assert faulty.sizes[before:] == [size]
            assert batcher.ceiling is None, "the ceiling climbed back to the policy's own sizes"
        finally:
            await batcher.close(grace_s=5.0)
    finally:
        device.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.integers(min_value=1, max_value=9),
    st.integers(min_value=2, max_value=8),
    st.integers(min_value=1, max_value=20),
    st.integers(min_value=1, max_value=3),
)
def test_out_of_memory_splits_answer_everyone_and_the_ceiling_recovers(
    model: LayeredModel, fail_at: int, max_batch: int, requests: int, recovery: int
) -> None:
    asyncio.run(_play(model, fail_at, max_batch, requests, recovery))
