"""The moving estimate of a batch's run time, which admission prices waits with: measured on the
batches the device ran, never NaN, negative or outside what was measured, and back near the
usual time a few batches after an outlier (a stall, a collection), so admission stops refusing."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from app.batching import BatchPolicy, DualWindowBatcher, Lane, LanePolicy
from app.errors import WouldMissDeadline
from tests.unit.fakes import FakeClock, settle

MS = 0.001
POLICY = BatchPolicy(LanePolicy(2 * MS, 4, 64), LanePolicy(25 * MS, 4, 64))


class TimedRunner:
    """Each batch takes the next of ``times`` on the fake clock."""

    def __init__(self, clock: FakeClock, times: Sequence[float]) -> None:
        self.clock, self.times, self.ran = clock, list(times), 0

    async def __call__(self, payloads: Sequence[int]) -> list[int]:
        seconds = self.times[self.ran % len(self.times)]
        self.ran += 1
        done = asyncio.Event()
        self.clock.call_at(self.clock.now() + seconds, done.set)
        await done.wait()
        return list(payloads)


async def _run_batches(times: Sequence[float], lane: Lane) -> list[float | None]:
    """One batch per time, each alone on the device; the estimate after each."""
    clock = FakeClock()
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(TimedRunner(clock, times), POLICY, clock=clock)
    batcher.start()
    estimates: list[float | None] = []
    try:
        for i, _ in enumerate(times):
            task = asyncio.ensure_future(batcher.submit(i, lane, 1e6))
            await settle()
            await clock.advance(POLICY.lane(lane).window_s)  # the batch forms
            while not task.done():
                await clock.advance(max(times))
            await task
            estimates.append(batcher.intake.batch_s(lane))
    finally:
        await batcher.close(grace_s=0)
    return estimates


run_times = st.floats(min_value=1e-5, max_value=60.0, allow_nan=False)


@settings(max_examples=40, deadline=None)
@given(st.lists(run_times, min_size=1, max_size=12), st.sampled_from(list(Lane)))
def test_the_estimate_stays_finite_positive_and_within_what_was_measured(times: list[float], lane: Lane) -> None:
    estimates = asyncio.run(_run_batches(times, lane))
    for ran, estimate in enumerate(estimates, start=1):
        assert estimate is not None and math.isfinite(estimate)
        seen = times[:ran]
        assert min(seen) * (1 - 1e-9) <= estimate <= max(seen) * (1 + 1e-9), (estimate, seen)


@settings(max_examples=40, deadline=None)
@given(
    st.floats(min_value=1 * MS, max_value=50 * MS),
    st.floats(min_value=1.0, max_value=60.0),
    st.integers(min_value=1, max_value=30),
)
def test_after_an_outlier_the_estimate_comes_back_batch_by_batch(usual: float, outlier: float, after: int) -> None:
    estimates = asyncio.run(_run_batches([usual] * 3 + [outlier] + [usual] * after, Lane.NORMAL))
    left = estimates[-1]
    assert left is not None
    assert left - usual <= 0.8**after * (outlier - usual) * (1 + 1e-9), "each batch takes a fifth of the excess off"


async def test_admission_refuses_after_an_outlier_and_admits_again_once_the_estimate_recovers() -> None:
    clock = FakeClock()
    times = [5 * MS] * 2 + [10.0] + [5 * MS] * 40
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(TimedRunner(clock, times), POLICY, clock=clock)
    batcher.start()
    try:
        for i in range(3):  # two usual batches, then one that stalls for 10 s
            task = asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 1e6))
            await clock.advance(25 * MS)
            while not task.done():
                await clock.advance(1.0)
        refused = 0
        for i in range(3, 40):  # a request queued ahead, then one with a 1 s deadline behind it
            ahead = asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 1e6))
            await settle()
            try:
                behind = asyncio.ensure_future(batcher.submit(1000 + i, Lane.NORMAL, 1.0))
                await settle()
                if behind.done() and isinstance(behind.exception(), WouldMissDeadline):
                    refused += 1
                    continue
                break
            finally:
                while not ahead.done():
                    await clock.advance(25 * MS)
        else:
            raise AssertionError("still refusing after 37 batches at the usual time")
        assert 1 <= refused <= 12, refused
    finally:
        await batcher.close(grace_s=None)
