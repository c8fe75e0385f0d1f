"""Admission's estimates cannot shut a lane: one slow batch refused tight deadlines for good,
and the urgent lane, on the normal lane's estimate, never ran a batch to get its own (found in
review). Nor does a steady estimate refuse a wait well inside the deadline."""

from __future__ import annotations

import asyncio

import pytest

from app.batching import BatchPolicy, DualWindowBatcher, Lane, LanePolicy
from app.errors import WouldMissDeadline
from tests.unit.fakes import FakeClock, FakeRunner, settle

MS = 0.001


def build() -> tuple[DualWindowBatcher[int, int], FakeClock, FakeRunner]:
    clock, runner = FakeClock(), FakeRunner()
    policy = BatchPolicy(
        LanePolicy(2 * MS, 4, 64),
        LanePolicy(25 * MS, 4, 64),
        admission_headroom=0.5,
    )
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(runner, policy, clock=clock)
    batcher.start()
    return batcher, clock, runner


async def one_batch(batcher, clock, runner, lane: Lane, seconds: float) -> None:
    runner.gate = asyncio.Event()
    tasks = [asyncio.ensure_future(batcher.submit(i, lane, 60.0)) for i in range(4)]
    await settle()
    await clock.advance(seconds)
    runner.gate.set()
    await asyncio.gather(*tasks)
    runner.gate = None


async def test_one_slow_batch_on_an_idle_lane_refuses_tight_deadlines_forever() -> None:
    batcher, clock, runner = build()
    await one_batch(batcher, clock, runner, Lane.NORMAL, 0.05)  # ordinary: 50 ms a batch
    await one_batch(batcher, clock, runner, Lane.NORMAL, 3.0)  # one stall (GC, CPU fallback load, ...)
    # clients with a 1 s deadline: budget 0.5 s, the estimate is now 0.8*0.05+0.2*3 = 0.64 s
    refused = 0
    for _ in range(100):  # 100 s of idle time, one request a second, nothing queued or running
        await clock.advance(1.0)
        assert batcher.depth(Lane.NORMAL) == 0 and not batcher._in_flight
        try:
            task = asyncio.ensure_future(batcher.submit(1, Lane.NORMAL, 1.0))
            await clock.advance(30 * MS)
            await task
        except WouldMissDeadline:
            refused += 1
    await batcher.close(0)
    assert refused < 100, "an idle lane refused every request for 100 s: the stale estimate never updates"


async def test_urgent_lane_borrowing_the_normal_estimate_never_gets_its_own() -> None:
    batcher, clock, runner = build()
    await one_batch(batcher, clock, runner, Lane.NORMAL, 0.3)  # full normal batches: 300 ms
    assert batcher.intake.batch_s(Lane.URGENT) == pytest.approx(0.3)  # borrowed from the normal lane
    refused = 0
    for _ in range(50):  # urgent clients with a 400 ms deadline, service idle
        await clock.advance(1.0)
        try:
            task = asyncio.ensure_future(batcher.submit(1, Lane.URGENT, 0.4))
            await clock.advance(5 * MS)  # an urgent batch of one would take ~0 s here
            await task
        except WouldMissDeadline:
            refused += 1
    await batcher.close(0)
    assert refused < 50, "every urgent request refused on the normal lane's estimate; no urgent batch ever runs"


async def test_a_steady_estimate_admits_a_wait_well_inside_the_deadline() -> None:
    policy = BatchPolicy(LanePolicy(2 * MS, 16, 256), LanePolicy(25 * MS, 16, 256), admission_headroom=0.5)
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(FakeRunner(), policy, clock=FakeClock())
    batcher.start()
    for _ in range(50):  # full batches of about 10 ms, jittered
        batcher.intake.observe_batch(Lane.NORMAL, 9 * MS)
        batcher.intake.observe_batch(Lane.NORMAL, 11 * MS)
    for _ in range(32):  # two full batches admitted ahead (decoding)
        batcher.intake.admit(Lane.NORMAL, 60.0, reserve=True)
    # really: 25 ms window + 3 batches of <= 11 ms = 58 ms, inside 0.5 * 150 ms = 75 ms
    try:
        batcher.intake.admit(Lane.NORMAL, 0.150)
    except WouldMissDeadline as refused:
        pytest.fail(f"refused: {refused} (the true wait is about 58 ms)")
    finally:
        for _ in range(32):
            batcher.intake.release(Lane.NORMAL)
        await batcher.close(0)
