"""Every lane gets its turn, and the dispatcher acts on what changes (found in review):
steady urgent traffic starved the normal lane on a shared device, a stale "waited" flag kept
riders off later urgent batches, and a lowered ceiling left a now-full batch for its window."""

from __future__ import annotations

import asyncio

from app.batching import BatchPolicy, DualWindowBatcher, Lane, LanePolicy, UrgentFill
from app.errors import DeadlineExceeded
from tests.unit.fakes import FakeClock, FakeRunner, TimedRunner, settle

MS = 0.001


async def test_normal_requests_are_served_under_constant_urgent_traffic() -> None:
    clock = FakeClock()
    runner = TimedRunner(clock, 3 * MS)  # a GPU: one batch at a time, ~3 ms each
    policy = BatchPolicy(  # the shipped defaults
        LanePolicy(2 * MS, 16, 256), LanePolicy(25 * MS, 16, 1024), UrgentFill.BACKLOG, admission_headroom=0.5
    )
    batcher = DualWindowBatcher(runner, policy, clock=clock, max_in_flight=1, urgent_in_flight=0)
    batcher.start()
    urgent = []
    for i in range(20):  # warm the estimate
        urgent.append(asyncio.ensure_future(batcher.submit((Lane.URGENT, i), Lane.URGENT, 10.0)))
        await clock.advance(1 * MS)
    # three normal requests with a 1 s deadline: admitted (predicted wait a few ms)
    normal = [asyncio.ensure_future(batcher.submit((Lane.NORMAL, 1000 + i), Lane.NORMAL, 1.0)) for i in range(3)]
    for i in range(20, 1200):  # urgent traffic: one request a millisecond, ~1/3 of the device
        urgent.append(asyncio.ensure_future(batcher.submit((Lane.URGENT, i), Lane.URGENT, 10.0)))
        await clock.advance(1 * MS)
    await clock.advance(2.0)
    assert all(t.done() for t in normal + urgent)
    results = await asyncio.gather(*normal, return_exceptions=True)
    await batcher.close(0)
    ran = sum(1 for b in runner.batches for lane, _ in b if lane is Lane.NORMAL)
    assert ran == 3, "each normal request computed once"
    assert not any(isinstance(r, DeadlineExceeded) for r in results), (
        f"admitted normal requests starved and expired: {results}"
    )


async def test_a_fresh_urgent_request_takes_riders_after_an_earlier_waiter_expired() -> None:
    clock, runner = FakeClock(), FakeRunner()
    policy = BatchPolicy(LanePolicy(2 * MS, 8, 64), LanePolicy(25 * MS, 8, 64), UrgentFill.ALWAYS)
    batcher = DualWindowBatcher(runner, policy, clock=clock, max_in_flight=2, urgent_in_flight=1)  # a CPU
    batcher.start()
    runner.gate = asyncio.Event()
    busy = asyncio.ensure_future(batcher.submit(1, Lane.URGENT, 10.0))
    await clock.advance(2 * MS)  # [1] runs on the urgent thread, held
    waiter = asyncio.ensure_future(batcher.submit(2, Lane.URGENT, 5 * MS))  # waits for the busy thread...
    await clock.advance(5 * MS)  # ...and expires there
    assert waiter.done() and waiter.exception() is not None
    runner.gate.set()
    await busy
    await clock.advance(1.0)  # long idle
    runner.gate = None
    normals = [asyncio.ensure_future(batcher.submit(10 + i, Lane.NORMAL, 10.0)) for i in range(3)]
    await clock.advance(5 * MS)
    fresh = asyncio.ensure_future(batcher.submit(3, Lane.URGENT, 10.0))  # the urgent thread is free
    await clock.advance(2 * MS)
    await clock.advance(30 * MS)
    await asyncio.gather(fresh, *normals, return_exceptions=True)
    await batcher.close(0)
    assert runner.batches[1] == [3, 10, 11, 12], f"no riders for a request that never waited: {runner.batches}"


async def test_a_lowered_ceiling_sends_a_now_full_batch_to_a_free_worker_at_once() -> None:
    clock, runner = FakeClock(), FakeRunner()
    policy = BatchPolicy(LanePolicy(2 * MS, 8, 64), LanePolicy(25 * MS, 8, 64))
    batcher = DualWindowBatcher(runner, policy, clock=clock, max_in_flight=2)
    batcher.start()
    runner.held = []
    first = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(8)]
    await settle()  # a full batch of 8 runs on worker 1; worker 2 is free
    rest = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(8, 13)]
    await clock.advance(1 * MS)
    # the running batch of 8 runs out of memory: the runner calls this (via call_soon_threadsafe)
    asyncio.get_running_loop().call_soon_threadsafe(batcher.lower_ceiling, 8)
    await clock.advance(1 * MS)
    sizes = [len(b) for b in runner.batches]
    runner.release()
    await clock.advance(50 * MS)
    runner.release()
    await asyncio.gather(*first, *rest)
    await batcher.close(0)
    assert sizes == [8, 4], f"5 waiting, ceiling 4, a worker free: a full batch should have gone (got {sizes})"
