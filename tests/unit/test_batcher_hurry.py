"""A request whose deadline cannot wait out its lane's window hurries: its lane's batch goes at
once (with whatever is queued, as soon as a device thread may take it), and admission leaves the
window out of its predicted wait. On an idle normal lane (a 25 ms window) a 20 ms deadline was
refused ``would_miss_deadline`` and told to retry, a request no retry would serve though the device
was free.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.batching import BatchPolicy, DualWindowBatcher, Lane, LanePolicy
from app.batching.policy import LaneState, hurries, is_ready, next_wakeup, ready_at
from app.errors import DeadlineExceeded, WouldMissDeadline
from tests.unit.fakes import FakeClock, FakeRunner, settle

MS = 0.001
NORMAL = LanePolicy(25 * MS, 4, 64)
POLICY = BatchPolicy(LanePolicy(2 * MS, 4, 64), NORMAL)


def test_a_request_that_hurries_makes_its_lane_ready_at_once() -> None:
    assert ready_at(LaneState(1, 0.0), NORMAL) == pytest.approx(25 * MS)
    assert ready_at(LaneState(2, 3 * MS, hurried=True), NORMAL) == pytest.approx(3 * MS)
    assert is_ready(LaneState(2, 3 * MS, hurried=True), NORMAL, 3 * MS)
    assert not is_ready(LaneState(2, 3 * MS), NORMAL, 4 * MS)
    assert ready_at(LaneState(0, None, hurried=True), NORMAL) is None
    assert next_wakeup(LaneState(), LaneState(2, 7 * MS, hurried=True), POLICY) == pytest.approx(7 * MS)


def test_only_a_deadline_under_the_window_and_four_batches_hurries() -> None:
    assert hurries(0.020, 0.025, 0.002)
    assert hurries(0.030, 0.025, 0.002), "25 + 4 x 2 ms is more than 30"
    assert not hurries(0.040, 0.025, 0.002)
    assert not hurries(30.0, 0.025, 0.100), "the default deadline never does"
    assert hurries(0.020, 0.025, None) and not hurries(0.030, 0.025, None), "untimed: the window alone"


async def _held_full_batch(batcher: DualWindowBatcher[int, int], runner: FakeRunner) -> list[asyncio.Future[Any]]:
    """A full normal batch (0-3, 10 s deadlines) holding the one device thread until ``runner.gate`` is set."""
    runner.gate = asyncio.Event()
    running = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(4)]
    await settle()
    return running


async def _timed(batch_s: float) -> tuple[DualWindowBatcher[int, int], FakeClock, FakeRunner]:
    """A started batcher whose lanes have timed one batch of ``batch_s`` (fake time)."""
    clock, runner = FakeClock(), FakeRunner()
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(runner, POLICY, clock=clock)
    batcher.start()
    tasks = await _held_full_batch(batcher, runner)
    await clock.advance(batch_s)
    runner.gate.set()
    await asyncio.gather(*tasks)
    runner.gate, runner.batches = None, []
    assert batcher.intake.batch_s(Lane.NORMAL) == pytest.approx(batch_s)
    return batcher, clock, runner


async def test_a_short_deadline_on_an_idle_lane_is_admitted_and_goes_at_once() -> None:
    batcher, clock, runner = await _timed(2 * MS)
    try:
        batcher.intake.admit(Lane.NORMAL, 20 * MS)  # 25 ms of window and 2 of batch: refused before
        hurried = asyncio.ensure_future(batcher.submit(7, Lane.NORMAL, 20 * MS))
        await settle()
        assert runner.batches == [[7]], "it goes at once, not at the window (25 ms)"
        answer = await hurried
        assert answer.output == 14 and answer.queued_s == 0
    finally:
        await batcher.close(grace_s=0)


async def test_it_takes_those_queued_before_it_and_a_relaxed_one_alone_waits_its_window() -> None:
    batcher, clock, runner = await _timed(2 * MS)
    try:
        relaxed = asyncio.ensure_future(batcher.submit(1, Lane.NORMAL, 1.0))
        await clock.advance(3 * MS)
        assert runner.batches == []
        hurried = asyncio.ensure_future(batcher.submit(2, Lane.NORMAL, 15 * MS))
        await settle()
        assert runner.batches == [[1, 2]], "the lane's batch goes, in order, with the one that waited"
        await asyncio.gather(relaxed, hurried)
        alone = asyncio.ensure_future(batcher.submit(3, Lane.NORMAL, 1.0))
        await clock.advance(24 * MS)
        assert runner.batches == [[1, 2]], "a deadline with room waits out the window"
        await clock.advance(1.5 * MS)
        assert runner.batches == [[1, 2], [3]]
        await alone
    finally:
        await batcher.close(grace_s=0)


async def test_a_hurried_request_that_left_no_longer_hurries_its_lane() -> None:
    batcher, clock, runner = await _timed(2 * MS)
    try:
        running = await _held_full_batch(batcher, runner)  # the one device thread held
        hurried = asyncio.ensure_future(batcher.submit(8, Lane.NORMAL, 20 * MS))
        relaxed = asyncio.ensure_future(batcher.submit(9, Lane.NORMAL, 10.0))
        await settle()
        hurried.cancel()  # its client went
        await settle()
        runner.gate.set()
        await asyncio.gather(*running)
        runner.gate = None
        await settle()
        assert runner.batches[-1] == [0, 1, 2, 3], "the relaxed one waits its window again"
        await clock.advance(25 * MS)
        assert runner.batches[-1] == [9]
        await relaxed
    finally:
        await batcher.close(grace_s=0)


async def test_a_deadline_shorter_than_a_batch_is_still_refused_and_says_why() -> None:
    batcher, _, _ = await _timed(2 * MS)
    try:
        with pytest.raises(WouldMissDeadline) as refused:
            batcher.intake.admit(Lane.NORMAL, 1.5 * MS)
        said = str(refused.value)
        assert said.startswith("predicted wait 2.0 ms exceeds the deadline of 1.5 ms"), said
        assert "nothing is ahead of it, but a batch of the normal lane takes about 2.0 ms to run" in said
        with pytest.raises(WouldMissDeadline) as refused:
            batcher.intake.admit(Lane.NORMAL, 20 * MS, upstream_s=30 * MS)  # images ahead, not the batch
        said = str(refused.value)
        assert "nothing is ahead" not in said and "the images ahead of it take about 30 ms to decode" in said
    finally:
        await batcher.close(grace_s=0)


async def test_behind_a_busy_device_a_hurried_request_waits_for_a_thread_and_is_priced_without_the_window() -> None:
    batcher, clock, runner = await _timed(10 * MS)
    try:
        running = await _held_full_batch(batcher, runner)  # a full batch holds the one device thread
        # one batch running: 10 ms, then its own 10 ms; with the window, 45 ms would be over 40
        wait = batcher.intake.predicted_wait(Lane.NORMAL, window=False)
        assert wait == pytest.approx(20 * MS)
        assert batcher.intake.predicted_wait(Lane.NORMAL) == pytest.approx(45 * MS)
        hurried = asyncio.ensure_future(batcher.submit(9, Lane.NORMAL, 40 * MS))
        await clock.advance(5 * MS)  # no thread free: it waits for one
        assert runner.batches == [[0, 1, 2, 3]]
        runner.gate.set()
        await asyncio.gather(*running)
        await settle()
        assert runner.batches[-1] == [9], "it goes as soon as a thread is free"
        assert (await hurried).output == 18
    finally:
        await batcher.close(grace_s=0)


async def test_before_any_batch_is_timed_one_that_cannot_wait_the_window_goes_at_once() -> None:
    clock, runner = FakeClock(), FakeRunner()
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(runner, POLICY, clock=clock)
    batcher.start()
    try:
        relaxed = asyncio.ensure_future(batcher.submit(1, Lane.NORMAL, 1.0))
        await settle()
        assert runner.batches == [], "no estimate, and its deadline has room: it waits its window"
        hurried = asyncio.ensure_future(batcher.submit(2, Lane.NORMAL, 20 * MS))
        await settle()
        assert runner.batches == [[1, 2]]
        await asyncio.gather(relaxed, hurried)
    finally:
        await batcher.close(grace_s=0)


async def test_a_hurried_request_put_back_when_its_batch_did_not_form_still_hurries() -> None:
    """A batch that finds a request past its deadline (its timer not run yet) puts the others back,
    and forms again without it: the one put back still cannot wait out the window."""
    batcher, clock, runner = await _timed(2 * MS)
    try:
        running = await _held_full_batch(batcher, runner)  # the one device thread held
        late = asyncio.ensure_future(batcher.submit(1, Lane.NORMAL, 6 * MS))
        hurried = asyncio.ensure_future(batcher.submit(2, Lane.NORMAL, 20 * MS))
        await settle()
        clock.t += 7 * MS  # the first one's deadline passed; the loop has not run its timer
        runner.gate.set()
        await asyncio.gather(*running)
        runner.gate = None
        await settle()
        assert runner.batches[-1] == [2], "formed again at once, without the late one"
        assert (await hurried).output == 4
        with pytest.raises(DeadlineExceeded):
            await late
    finally:
        await batcher.close(grace_s=0)


async def test_a_request_queued_before_the_lanes_first_batch_was_timed_hurries_once_it_is() -> None:
    """Untimed, only a deadline under the window hurries. One of 30 ms on the 25 ms window did not;
    the first batch then measured 10 ms, by which its deadline could not wait out the window and a
    batch's run: it waited the window all the same, and ran past its deadline."""
    clock, runner = FakeClock(), FakeRunner()
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(runner, POLICY, clock=clock)
    batcher.start()
    try:
        first = await _held_full_batch(batcher, runner)
        await clock.advance(1 * MS)
        waiting = asyncio.ensure_future(batcher.submit(9, Lane.NORMAL, 30 * MS))
        await clock.advance(9 * MS)
        runner.gate.set()  # the first batch ends: 10 ms measured
        await asyncio.gather(*first)
        runner.gate = None
        await settle()
        assert runner.batches[-1] == [9], "it goes as the device frees, not at its window (26 ms)"
        assert (await waiting).output == 18
    finally:
        await batcher.close(grace_s=0)
        await asyncio.gather(waiting, return_exceptions=True)  # answered by the close if the test failed


async def test_a_window_made_longer_than_a_queued_deadline_allows_makes_it_hurry() -> None:
    batcher, clock, runner = await _timed(0.5 * MS)
    try:
        waiting = asyncio.ensure_future(batcher.submit(9, Lane.NORMAL, 100 * MS))  # waits out 25 ms
        await clock.advance(1 * MS)
        assert runner.batches == []
        batcher.set_policy(BatchPolicy(LanePolicy(2 * MS, 4, 64), LanePolicy(500 * MS, 4, 64)))
        await settle()
        assert runner.batches == [[9]], "a 500 ms window it cannot wait out: it goes now"
        assert (await waiting).output == 18
    finally:
        await batcher.close(grace_s=0)
        await asyncio.gather(waiting, return_exceptions=True)  # answered by the close if the test failed
