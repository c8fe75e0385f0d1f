"""Admission's estimates stay honest: a stale one cannot shut a lane, and a batch is priced
by its size (found in review: one slow batch refused tight deadlines for good, and after
light traffic a burst's full batches were priced as batches of one)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest

from app.batching import BatchPolicy, DualWindowBatcher, Lane, LanePolicy
from app.batching.cost import BatchCost
from app.errors import DeadlineExceeded, WouldMissDeadline
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
    assert batcher.batch_s(Lane.URGENT) == pytest.approx(0.3)  # borrowed from the normal lane
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


class PerImageRunner:
    """A CPU: each image costs ``per_image`` of fake time (the design notes ~3.7 ms an image)."""

    def __init__(self, clock: FakeClock, per_image: float) -> None:
        self.clock, self.per_image = clock, per_image

    async def __call__(self, payloads: Sequence[int]) -> list[int]:
        done = asyncio.Event()
        self.clock.call_at(self.clock.now() + self.per_image * len(payloads), done.set)
        await done.wait()
        return list(payloads)


async def test_a_burst_after_light_traffic_is_not_admitted_past_its_deadline() -> None:
    clock = FakeClock()
    policy = BatchPolicy(LanePolicy(2 * MS, 16, 256), LanePolicy(25 * MS, 16, 1024), admission_headroom=0.5)
    batcher = DualWindowBatcher(PerImageRunner(clock, 10 * MS), policy, clock=clock)
    batcher.start()
    for i in range(10):  # light traffic: one request every 100 ms, batches of one (10 ms each)
        task = asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0))
        await clock.advance(100 * MS)
        await task
    burst = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(64)]
    await clock.advance(0)
    predicted = batcher.predicted_wait(Lane.NORMAL)
    late = asyncio.ensure_future(batcher.submit(99, Lane.NORMAL, 0.6))  # budget 0.3 s at headroom 0.5
    await clock.advance(0)
    await clock.advance(2.0)
    await asyncio.gather(*burst)
    outcome = (await asyncio.gather(late, return_exceptions=True))[0]
    await batcher.close(0)
    # admitted on a predicted wait of ~75 ms; four full batches of 16 (160 ms each) were ahead
    assert not isinstance(outcome, DeadlineExceeded), (
        f"admitted on a predicted wait of {predicted * 1000:.0f} ms, then expired: {outcome!r}"
    )


def test_a_batch_costs_by_its_size_once_sizes_vary() -> None:
    cost = BatchCost()
    for size in (1, 2, 4, 8, 16, 1, 4, 16, 2, 8) * 3:  # 1 ms fixed + 10 ms an image
        cost.observe(size, 0.001 + 0.010 * size)
    assert cost.seconds(16) == pytest.approx(0.161) and cost.seconds(1) == pytest.approx(0.011)


def test_with_one_size_seen_the_estimate_is_read_conservatively() -> None:
    cost = BatchCost()
    cost.observe(4, 0.1)
    assert cost.seconds(1) == pytest.approx(0.1), "smaller: as dear as those seen (a GPU's are)"
    assert cost.seconds(16) == pytest.approx(0.4), "larger: in proportion (a CPU's are)"


def test_a_full_batch_is_priced_near_what_full_batches_cost() -> None:
    # a GPU at saturation: batches of 16 and 15 cost the same 10 ms, give or take 1 ms
    cost = BatchCost()
    for _ in range(50):
        cost.observe(15, 9 * MS)
        cost.observe(16, 11 * MS)
    assert cost.seconds(16) <= 1.5 * 11 * MS, f"a batch of 16 priced {cost.seconds(16) / MS:.1f} ms; it cost 11"


def test_jittered_times_at_steady_sizes_do_not_inflate_the_price() -> None:
    rng = random.Random(2)
    cost = BatchCost()
    longest, worst = 0.0, 0.0
    for i in range(3000):  # mostly full batches, a few of 15; each 10 ms +-20% whatever its size
        size = 15 if rng.random() < 0.05 else 16
        run_s = 10 * MS * (1 + 0.2 * rng.uniform(-1, 1))
        cost.observe(size, run_s)
        longest = max(longest, run_s)
        if i > 20:
            worst = max(worst, cost.seconds(16))
    assert worst <= 1.5 * longest, f"a batch of 16 priced up to {worst / MS:.1f} ms; none took over {longest / MS:.1f}"


async def test_admission_does_not_refuse_on_a_jittered_slope() -> None:
    policy = BatchPolicy(LanePolicy(2 * MS, 16, 256), LanePolicy(25 * MS, 16, 256), admission_headroom=0.6)
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(FakeRunner(), policy, clock=FakeClock())
    batcher.start()
    for _ in range(50):  # full batches of ~10 ms, as above
        batcher.observe_batch(Lane.NORMAL, 9 * MS, 15)
        batcher.observe_batch(Lane.NORMAL, 11 * MS, 16)
    for _ in range(32):  # two full batches admitted ahead (decoding)
        batcher.admit(Lane.NORMAL, 60.0, reserve=True)
    # really: 25 ms window + 3 batches of <= 11 ms = 58 ms, inside 0.6 * 150 ms = 90 ms
    try:
        batcher.admit(Lane.NORMAL, 0.150)
    except WouldMissDeadline as refused:
        pytest.fail(f"refused: {refused} (the true wait is about 58 ms)")
    finally:
        for _ in range(32):
            batcher.release(Lane.NORMAL)
        await batcher.close(0)
