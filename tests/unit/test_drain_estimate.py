"""The normal lane's predicted wait, when it is behind, follows the pace its queue is drawn at.

On 2 cores at twice the load, urgent batches ran in one of the three seats normal batches
share, and the event loop took its turn between a batch's end and the next one's start: the
normal queue drained at about two thirds of what its batches' run times and seats promised,
and requests admitted at half their deadline's worth of predicted wait expired in bursts
(docs/performance.md, thirty-seventh pass). Here a fake device runs every batch in 100 ms and
the urgent thread is never idle, so the normal lane has two seats of three, not the four the
seat count gives it while urgent batches may take riders.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.batching import BatchPolicy, DualWindowBatcher, Lane, LanePolicy, UrgentFill
from app.batching.intake import DRAIN_MEMORY_S
from app.errors import DeadlineExceeded, QueueFull, WouldMissDeadline
from tests.unit.fakes import FakeClock, FakeRunner, TimedRunner

MS = 0.001
BATCH_S = 0.1


async def test_admitted_requests_meet_their_deadline_when_urgent_batches_hold_a_seat() -> None:
    clock = FakeClock()
    runner = TimedRunner(clock, BATCH_S)
    policy = BatchPolicy(
        LanePolicy(2 * MS, 4, 256), LanePolicy(25 * MS, 8, 4096), UrgentFill.BACKLOG, admission_headroom=0.8
    )
    # a CPU's threads: three seats for batches of either lane, one thread for urgent batches only
    batcher = DualWindowBatcher(runner, policy, clock=clock, max_in_flight=3, urgent_in_flight=1)
    batcher.start()
    normal: list[asyncio.Future[object]] = []
    urgent: list[asyncio.Future[object]] = []
    refused = 0
    for step in range(2400):  # 12 s: 400 normal requests a second, 20 urgent
        for i in range(2):
            try:
                batcher.intake.admit(Lane.NORMAL, 1.0)  # the route's admission: predicted wait against the deadline
            except (WouldMissDeadline, QueueFull):
                refused += 1
                continue
            normal.append(asyncio.ensure_future(batcher.submit((Lane.NORMAL, 2 * step + i), Lane.NORMAL, 1.0, True)))
        if step % 10 == 0:
            urgent.append(asyncio.ensure_future(batcher.submit((Lane.URGENT, step), Lane.URGENT, 10.0)))
        await clock.advance(5 * MS)
    await clock.advance(3.0)
    results = await asyncio.gather(*normal, return_exceptions=True)
    await asyncio.gather(*urgent, return_exceptions=True)
    await batcher.close(0)
    expired = sum(isinstance(r, DeadlineExceeded) for r in results)
    answered = sum(not isinstance(r, BaseException) for r in results)
    # the urgent thread always busy, so normal batches of 8 get two seats: 160 a second, 1920 in 12 s
    assert refused > 0, "at 2.5 times what the normal lane can take, admission refused nothing"
    assert expired == 0, f"{expired} of {len(results)} admitted normal requests expired in the queue"
    assert answered >= 0.85 * 160 * 12, f"answered {answered}: admission refused what the device could serve"


def started(clock: FakeClock) -> DualWindowBatcher[int, int]:
    """A batcher taking requests (its intake refuses none while it is not), normal batches of 8."""
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(
        FakeRunner(), BatchPolicy(LanePolicy(2 * MS, 4, 64), LanePolicy(25 * MS, 8, 64)), clock=clock
    )
    batcher.start()
    return batcher


async def test_the_drain_rate_is_measured_only_while_the_lane_is_behind() -> None:
    clock = FakeClock()
    batcher = started(clock)
    intake = batcher.intake
    for _ in range(3):  # a few requests at a time, never a full batch behind: the clients' pace, not the service's
        clock.t += 0.5
        intake.took_normal(3)
    assert intake.drain_rate() is None
    for _ in range(8):  # a full batch admitted ahead (decoding) after each take
        intake.admit(Lane.NORMAL, 60.0, reserve=True)
    clock.t += 0.05
    intake.took_normal(8)  # the first take that leaves a backlog times nothing yet
    assert intake.drain_rate() is None
    clock.t += 0.1
    intake.took_normal(8)
    assert intake.drain_rate() == pytest.approx(80.0)
    for _ in range(8):
        intake.release(Lane.NORMAL)
    clock.t += 0.1
    intake.took_normal(8)  # timed: the take before left a full batch behind
    assert intake.drain_rate() == pytest.approx(80.0)
    clock.t += 1.0
    intake.took_normal(1)  # not timed: the lane was no longer behind after the take before
    assert intake.drain_rate() == pytest.approx(80.0)
    clock.t += DRAIN_MEMORY_S
    assert intake.drain_rate() is None, "no take timed for DRAIN_MEMORY_S: the pace is no longer known"
    await batcher.close(0)


async def test_a_pace_measured_in_a_stall_does_not_keep_the_queue_short_for_good() -> None:
    """One take timed across a 3 s stall reads 8 requests in 3 s. Priced at that pace, any request with
    a full batch ahead misses a 1 s deadline, so admission keeps the queue under a full batch and no
    take is timed again: the stale pace must lapse, or the lane stays short for good."""
    clock = FakeClock()
    batcher = started(clock)
    intake = batcher.intake
    for _ in range(50):  # full batches of 8 in about 100 ms each
        intake.observe_batch(Lane.NORMAL, 0.1)
    for _ in range(16):  # two full batches admitted ahead (decoding)
        intake.admit(Lane.NORMAL, 60.0, reserve=True)
    intake.took_normal(8)
    clock.t += 3.0  # a stall
    intake.took_normal(8)
    assert intake.drain_rate() == pytest.approx(8 / 3.0)
    with pytest.raises(WouldMissDeadline):  # priced at the stall's pace: 2 batches of 8 at 2.7 a second
        intake.admit(Lane.NORMAL, 1.0)
    clock.t += DRAIN_MEMORY_S + 0.1  # nothing timed since: the queue never had a full batch left behind
    intake.admit(Lane.NORMAL, 1.0)  # the seats' count again: 25 ms + a few rounds of 100 ms
    for _ in range(16):
        intake.release(Lane.NORMAL)
    await batcher.close(0)


async def _rate_after(takes: list[tuple[float, int]]) -> tuple[float | None, float | None]:
    clock = FakeClock()
    batcher = started(clock)
    intake = batcher.intake
    for _ in range(8):
        intake.admit(Lane.NORMAL, 60.0, reserve=True)
    intake.took_normal(1)
    for gap, taken in takes:
        clock.t += gap
        intake.took_normal(taken)
    rate = intake.drain_rate()
    clock.t += DRAIN_MEMORY_S / 2  # a pause inside the memory changes nothing
    later = intake.drain_rate()
    for _ in range(8):
        intake.release(Lane.NORMAL)
    await batcher.close(0)
    return rate, later


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.001, 1.0), st.integers(1, 32)), min_size=1, max_size=40))
def test_the_drain_rate_lies_within_the_paces_it_saw(takes: list[tuple[float, int]]) -> None:
    rate, later = asyncio.run(_rate_after(takes))
    paces = [taken / gap for gap, taken in takes]
    assert rate is not None and min(paces) * (1 - 1e-9) <= rate <= max(paces) * (1 + 1e-9)
    assert later == pytest.approx(rate), "a short pause forgets nothing: the next samples weigh the most"
