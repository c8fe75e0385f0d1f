"""Admission and pressure in the batcher: predicted-wait refusals, deadlines, the batch ceiling."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from app.batching import BatchPolicy, DualWindowBatcher, Lane, LanePolicy
from app.errors import DeadlineExceeded, Draining, WouldMissDeadline
from tests.unit.fakes import FakeClock, FakeRunner, settle

MS = 0.001


class Recorder:
    def __init__(self) -> None:
        self.rejected: list[tuple[Lane, str]] = []
        self.batches: list[tuple[Lane, int, int]] = []
        self.dropped: list[tuple[Lane, str]] = []
        self.waits: list[tuple[Lane, float]] = []

    def on_batch(
        self, lane: Lane, size: int, capacity: int, waits_s: Sequence[tuple[Lane, float]], run_s: float, ok: bool
    ) -> None:
        self.batches.append((lane, size, capacity))
        self.waits += waits_s

    def on_rejected(self, lane: Lane, reason: str) -> None:
        self.rejected.append((lane, reason))

    def on_dropped(self, lane: Lane, reason: str) -> None:
        self.dropped.append((lane, reason))


def make(
    max_batch: int = 4, max_queue: int = 64
) -> tuple[DualWindowBatcher[int, int], FakeClock, FakeRunner, Recorder]:
    clock, runner, recorder = FakeClock(), FakeRunner(), Recorder()
    policy = BatchPolicy(LanePolicy(2 * MS, max_batch, max_queue), LanePolicy(25 * MS, max_batch, max_queue))
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(runner, policy, clock=clock, observer=recorder)
    batcher.start()
    return batcher, clock, runner, recorder


async def run_one_timed_batch(batcher: DualWindowBatcher[int, int], clock: FakeClock, runner: FakeRunner) -> None:
    """One full batch that takes 100 ms of (fake) device time: the batcher learns its latency."""
    runner.gate = asyncio.Event()
    tasks = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(4)]
    await settle()
    await clock.advance(100 * MS)
    runner.gate.set()
    await asyncio.gather(*tasks)
    runner.gate = None


async def test_no_estimate_admits_everything() -> None:
    batcher, _, _, recorder = make()
    assert batcher.intake.predicted_wait(Lane.NORMAL) is None
    batcher.intake.admit(Lane.NORMAL, 0.001)
    assert recorder.rejected == []
    await batcher.close(0)


async def test_a_request_that_would_miss_its_deadline_is_refused_at_once() -> None:
    batcher, clock, runner, recorder = make()
    await run_one_timed_batch(batcher, clock, runner)
    assert batcher.intake.batch_s(Lane.NORMAL) == batcher.intake.batch_s(Lane.URGENT) == pytest.approx(0.1)
    runner.gate = asyncio.Event()
    queued = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(12)]
    await settle()  # one batch of 4 runs (gated), 8 wait: two more batches, then ours
    wait = batcher.intake.predicted_wait(Lane.NORMAL)
    assert wait == pytest.approx(0.025 + (8 // 4 + 1 + 1) * 0.1)
    with pytest.raises(WouldMissDeadline) as refused:
        await batcher.submit(99, Lane.NORMAL, 0.3)
    assert refused.value.retry_after_s == 1
    assert recorder.rejected == [(Lane.NORMAL, "would_miss_deadline")]
    accepted = asyncio.ensure_future(batcher.submit(100, Lane.NORMAL, 1.0))
    urgent_wait = batcher.intake.predicted_wait(Lane.URGENT)
    assert urgent_wait is not None and urgent_wait < wait, "urgent requests only wait for urgent ones"
    runner.gate.set()
    await clock.advance(1.0)
    await asyncio.gather(accepted, *queued)
    await batcher.close(0)


async def test_a_deadline_already_spent_is_refused_before_queueing() -> None:
    batcher, _, runner, recorder = make()
    with pytest.raises(DeadlineExceeded):
        await batcher.submit(1, Lane.URGENT, 0.0)
    assert recorder.rejected == [(Lane.URGENT, "deadline_exceeded")]
    assert batcher.depth(Lane.URGENT) == 0 and runner.batches == []
    await batcher.close(0)


async def test_memory_pressure_caps_batches_until_enough_calm_batches() -> None:
    batcher, clock, runner, recorder = make(max_batch=8)
    batcher.recovery_batches = 2
    batcher.lower_ceiling(8)
    assert batcher.ceiling == 4
    tasks = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(8)]
    await settle()
    assert [len(b) for b in runner.batches] == [4, 4], "full at the ceiling, not at the policy's 8"
    assert [capacity for _, _, capacity in recorder.batches] == [4, 4]
    await asyncio.gather(*tasks)
    assert batcher.ceiling is None, "two calm batches: 4 doubles to 8, the policy's max"
    tasks = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(8)]
    await settle()
    assert len(runner.batches[-1]) == 8
    await asyncio.gather(*tasks)
    batcher.lower_ceiling(3)
    assert batcher.ceiling == 1
    batcher.lower_ceiling(1)
    assert batcher.ceiling == 1, "never below one"
    await batcher.close(0)


async def test_only_batches_full_at_the_ceiling_raise_it_again() -> None:
    batcher, clock, runner, recorder = make(max_batch=8)
    batcher.recovery_batches = 2
    runner.gate = asyncio.Event()
    failing = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(8)]
    await settle()
    batcher.lower_ceiling(8)  # this batch of 8 ran out of memory; its halves then succeed
    runner.gate.set()
    await asyncio.gather(*failing)
    runner.gate = None
    for _ in range(3):  # light traffic: batches of one, which prove nothing about the cap of 4
        single = asyncio.ensure_future(batcher.submit(0, Lane.NORMAL, 10.0))
        await clock.advance(25 * MS)
        await single
    assert batcher.ceiling == 4, "neither the failed batch nor small ones count as calm"
    full = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(8)]
    await settle()
    await asyncio.gather(*full)
    assert batcher.ceiling is None, "two batches full at the cap: it doubles back to the policy's 8"
    await batcher.close(0)


async def test_reserved_seats_count_against_the_queue_bound_until_released() -> None:
    from app.errors import QueueFull

    batcher, _, _, recorder = make(max_batch=2, max_queue=3)
    for _ in range(3):
        batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)  # three images decoding
    assert batcher.depth(Lane.NORMAL) == 3, "the seats are what the bound counts, and what the depth says"
    with pytest.raises(QueueFull):
        batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)
    batcher.intake.admit(Lane.URGENT, 10.0)  # the other lane has its own bound
    batcher.intake.release(Lane.NORMAL)
    batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)
    assert recorder.rejected == [(Lane.NORMAL, "queue_full")]
    await batcher.close(grace_s=0)


async def test_a_bound_lowered_while_seats_are_held_refuses_new_requests_not_the_seated() -> None:
    from app.errors import QueueFull

    batcher, clock, _, recorder = make(max_batch=2, max_queue=4)
    for _ in range(3):
        batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)  # three images decoding
    lower = LanePolicy(25 * MS, 1, 1)
    batcher.set_policy(BatchPolicy(batcher.policy.urgent, lower))
    with pytest.raises(QueueFull):
        batcher.intake.admit(Lane.NORMAL, 10.0)  # a new request meets the new bound
    queued = []
    for _ in range(3):  # their images decoded: each gives its seat back and is queued
        batcher.intake.release(Lane.NORMAL)
        queued.append(asyncio.ensure_future(batcher.submit(0, Lane.NORMAL, 10.0, admitted=True)))
    await settle()
    await clock.advance(25 * MS)
    assert [r.batch_size for r in await asyncio.gather(*queued)] == [1, 1, 1], "all three computed"
    assert recorder.rejected == [(Lane.NORMAL, "queue_full")]
    await batcher.close(grace_s=0)


async def test_a_request_admitted_before_its_body_meets_the_lanes_rules_again_when_it_takes_its_seat() -> None:
    """Its body read holding no seat, a request admitted earlier is refused by a lane that filled
    meanwhile; past its deadline it counts as dropped, not refused; a close lets it on while the
    batcher runs, where a new request is refused; once the batcher stops, it is refused uncounted
    (the route counts it, or routes it to another version)."""
    from app.errors import QueueFull

    batcher, _, _, recorder = make(max_batch=2, max_queue=2)
    for _ in range(2):
        batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)
    with pytest.raises(QueueFull):
        batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True, admitted=True)
    assert recorder.rejected == [(Lane.NORMAL, "queue_full")]
    with pytest.raises(DeadlineExceeded):
        batcher.intake.admit(Lane.NORMAL, 0.0, reserve=True, admitted=True)
    assert recorder.dropped == [(Lane.NORMAL, "deadline")] and len(recorder.rejected) == 1
    batcher.intake.release(Lane.NORMAL)
    closing = asyncio.ensure_future(batcher.close(grace_s=10.0))
    await settle()
    assert batcher.running, "a seat is held: the close waits for it"
    with pytest.raises(Draining):
        batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)
    batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True, admitted=True)
    for _ in range(2):
        batcher.intake.release(Lane.NORMAL)
    await closing
    with pytest.raises(Draining):  # the batcher has stopped: nothing is taken any more
        batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True, admitted=True)
    assert len(recorder.dropped) == 1, "not counted here: its caller may route it to another version"
    with pytest.raises(Draining):  # its image decoded: it ends here, and is counted
        batcher.intake.admit(Lane.NORMAL, 10.0, seated=True)
    assert recorder.dropped[-1] == (Lane.NORMAL, "cancelled")


async def test_a_close_waits_for_a_body_on_its_way_without_counting_it_as_queued() -> None:
    batcher, _, _, _ = make(max_batch=2, max_queue=2)
    with batcher.intake.arriving():
        assert batcher.depth(Lane.NORMAL) == 0
        batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)
        batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)  # the bound counts seats, not bodies
        for _ in range(2):
            batcher.intake.release(Lane.NORMAL)
        closing = asyncio.ensure_future(batcher.close(grace_s=10.0))
        await settle()
        assert batcher.running and not closing.done()
    await settle()
    assert closing.done() and not batcher.running


async def test_reserved_seats_count_in_the_predicted_wait() -> None:
    batcher, clock, runner, recorder = make(max_batch=4)
    await run_one_timed_batch(batcher, clock, runner)  # 100 ms a batch
    for _ in range(8):  # two batches' worth decoding ahead
        batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)
    assert batcher.intake.predicted_wait(Lane.NORMAL) == pytest.approx(25 * MS + 3 * 100 * MS)
    assert batcher.intake.predicted_wait(Lane.URGENT) == pytest.approx(2 * MS + 100 * MS), "urgent goes before them"
    with pytest.raises(WouldMissDeadline):
        batcher.intake.admit(Lane.NORMAL, 0.2)
    for _ in range(8):
        batcher.intake.release(Lane.NORMAL)
    batcher.intake.admit(Lane.NORMAL, 0.2)
    await batcher.close(grace_s=0)


async def test_a_wait_upstream_of_the_queue_counts_when_it_is_the_longer_stage() -> None:
    batcher, clock, runner, recorder = make(max_batch=4)
    await run_one_timed_batch(batcher, clock, runner)  # 100 ms a batch, queue empty
    # a deadline under the window and four batches hurries: its window closes early, the wait is
    # the decodes ahead and its batch
    batcher.intake.admit(Lane.NORMAL, 0.2, upstream_s=0.1)  # 100 + 100 ms fits in 200
    with pytest.raises(WouldMissDeadline) as refused:
        batcher.intake.admit(Lane.NORMAL, 0.2, upstream_s=0.11)  # 110 + 100 ms does not
    assert "210 ms" in str(refused.value)
    batcher.intake.admit(Lane.NORMAL, 1.0, upstream_s=0.05)  # one that does not hurry: 50 + 25 + 100 ms
    with pytest.raises(WouldMissDeadline) as refused:
        batcher.intake.admit(Lane.NORMAL, 1.0, upstream_s=0.9)  # 900 + 25 + 100 ms does not fit in 1 s
    assert "1025 ms" in str(refused.value)
    assert recorder.rejected[-1] == (Lane.NORMAL, "would_miss_deadline")
    await batcher.close(grace_s=0)


@pytest.mark.usefixtures("no_hurry")
async def test_headroom_keeps_part_of_the_time_left_in_reserve() -> None:
    clock, runner, recorder = FakeClock(), FakeRunner(), Recorder()
    lanes = LanePolicy(2 * MS, 4, 64), LanePolicy(25 * MS, 4, 64)
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(
        runner, BatchPolicy(*lanes, admission_headroom=0.5), clock=clock, observer=recorder
    )
    batcher.start()
    await run_one_timed_batch(batcher, clock, runner)
    batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)  # one ahead (decoding): predicted wait now 25 + 100 ms
    batcher.intake.admit(Lane.NORMAL, 0.25)  # 125 ms is half of 250
    with pytest.raises(WouldMissDeadline):
        batcher.intake.admit(Lane.NORMAL, 0.2)  # 125 ms is more than half of 200
    await batcher.close(grace_s=0)
    with pytest.raises(ValueError, match="admission_headroom"):
        BatchPolicy(*lanes, admission_headroom=0.0)


async def test_each_lane_predicts_with_its_own_batches_run_time() -> None:
    batcher, _, _, _ = make()
    batcher.intake.observe_batch(Lane.URGENT, 0.01)  # urgent batches run apart, on their own thread
    batcher.intake.observe_batch(Lane.NORMAL, 0.2)
    batcher.intake.observe_batch(Lane.NORMAL, 0.1)
    assert batcher.intake.batch_s(Lane.URGENT) == pytest.approx(0.01)
    assert batcher.intake.batch_s(Lane.NORMAL) == pytest.approx(0.8 * 0.2 + 0.2 * 0.1)
    assert batcher.intake.predicted_wait(Lane.NORMAL) == pytest.approx(0.025 + 0.18)
    assert batcher.intake.predicted_wait(Lane.URGENT) == pytest.approx(0.002 + 0.01)
    await batcher.close(0)


async def test_a_request_cancelled_as_a_batch_ends_is_counted_once() -> None:
    # the batch's end wakes the dispatcher, and the cancelled request's future is done before its
    # own done callback (which counts it) has run: the dispatcher drops it from the queue first
    batcher, _, runner, recorder = make(max_batch=1)
    runner.gate = asyncio.Event()
    first = asyncio.ensure_future(batcher.submit(1, Lane.NORMAL, 10.0))
    await settle()
    second = asyncio.ensure_future(batcher.submit(2, Lane.NORMAL, 10.0))
    await settle()
    assert runner.batches == [[1]] and batcher.depth(Lane.NORMAL) == 1
    (running,) = batcher._in_flight
    running.add_done_callback(lambda _: second.cancel())  # its client goes in the turn the batch ends
    runner.gate.set()
    await first
    await settle()
    assert second.cancelled() and runner.batches == [[1]] and batcher.depth(Lane.NORMAL) == 0
    assert recorder.dropped == [(Lane.NORMAL, "cancelled")]
    await batcher.close(0)


async def test_each_request_s_queue_wait_is_reported_under_its_own_lane() -> None:
    batcher, clock, _, recorder = make()
    normal = asyncio.ensure_future(batcher.submit(1, Lane.NORMAL, 10.0))
    await settle()
    await clock.advance(10 * MS)  # in its 25 ms window
    urgent = asyncio.ensure_future(batcher.submit(2, Lane.URGENT, 10.0))
    await settle()
    await clock.advance(2 * MS)  # the urgent window closes: the normal request rides along
    assert (await normal).batch_lane is Lane.URGENT
    await urgent
    assert recorder.batches == [(Lane.URGENT, 2, 4)]
    assert sorted(recorder.waits) == [(Lane.NORMAL, pytest.approx(12 * MS)), (Lane.URGENT, pytest.approx(2 * MS))]
    await batcher.close(0)


async def test_urgent_requests_ahead_count_in_urgent_sized_batches() -> None:
    clock, runner, recorder = FakeClock(), FakeRunner(), Recorder()
    policy = BatchPolicy(LanePolicy(2 * MS, 2, 64), LanePolicy(25 * MS, 8, 64))
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(runner, policy, clock=clock, observer=recorder)
    batcher.start()
    batcher.intake.observe_batch(Lane.NORMAL, 0.1)
    for _ in range(4):  # two urgent batches of two, ahead of any normal request
        batcher.intake.admit(Lane.URGENT, 10.0, reserve=True)
    assert batcher.intake.predicted_wait(Lane.URGENT) == pytest.approx(2 * MS + 3 * 0.1)
    assert batcher.intake.predicted_wait(Lane.NORMAL) == pytest.approx(25 * MS + 3 * 0.1), "not half a normal batch"
    for _ in range(4):
        batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)  # half a normal batch more: still three rounds
    assert batcher.intake.predicted_wait(Lane.NORMAL) == pytest.approx(25 * MS + 3 * 0.1)
    for _ in range(4):
        batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)  # a whole one
    assert batcher.intake.predicted_wait(Lane.NORMAL) == pytest.approx(25 * MS + 4 * 0.1)
    await batcher.close(grace_s=0)


async def test_the_ceiling_climbs_back_on_what_the_device_computed() -> None:
    # batches at the cap whose requests had gone before the device (overload: deadlines passing
    # there) prove nothing about memory: the cap must not rise on them
    clock, runner = FakeClock(), FakeRunner()
    policy = BatchPolicy(LanePolicy(2 * MS, 8, 64), LanePolicy(25 * MS, 8, 64))
    computed: list[int] = [0]
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(
        runner, policy, clock=clock, computed=lambda outputs: computed[0]
    )
    batcher.start()
    batcher.recovery_batches = 2
    batcher.lower_ceiling(8)
    assert batcher.ceiling == 4
    for ran in (0, 0, 0, 1, 4, 4):
        computed[0] = ran
        await asyncio.gather(*(batcher.submit(i, Lane.NORMAL, 10.0) for i in range(4)))
        if ran < 4:
            assert batcher.ceiling == 4, f"raised on a batch of 4 that computed {ran}"
    assert batcher.ceiling is None, "two batches computed whole at the cap: it doubles back to 8"
    await batcher.close(0)


def with_model_epoch(max_batch: int) -> tuple[DualWindowBatcher[int, int], FakeClock, FakeRunner, list[int]]:
    """A started batcher whose runner's model is replaced when a test bumps ``epoch[0]``."""
    clock, runner, epoch = FakeClock(), FakeRunner(), [0]
    policy = BatchPolicy(LanePolicy(2 * MS, max_batch, 64), LanePolicy(25 * MS, max_batch, 64))
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(runner, policy, clock=clock, model_epoch=lambda: epoch[0])
    batcher.start()
    return batcher, clock, runner, epoch


async def test_a_model_replaced_mid_batch_starts_the_estimates_again() -> None:
    # the CPU fallback loads inside the batch whose failure brought it (seconds): that batch's
    # time, and the old model's estimate, would refuse requests the new model can serve
    batcher, clock, runner, epoch = with_model_epoch(max_batch=4)
    await run_one_timed_batch(batcher, clock, runner)
    assert batcher.intake.batch_s(Lane.NORMAL) == pytest.approx(0.1)
    runner.gate = asyncio.Event()
    replaced = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 60.0)) for i in range(4)]
    await settle()
    await clock.advance(3.0)  # the fallback's load, inside this batch
    epoch[0] += 1
    runner.gate.set()
    await asyncio.gather(*replaced)
    runner.gate = None
    assert batcher.intake.batch_s(Lane.NORMAL) is None and batcher.intake.batch_s(Lane.URGENT) is None
    batcher.intake.admit(Lane.NORMAL, 1.0)  # no estimate: not refused on the old model's, nor the load's
    await run_one_timed_batch(batcher, clock, runner)
    assert batcher.intake.batch_s(Lane.NORMAL) == pytest.approx(0.1), "learnt again from the new model's batches"
    await batcher.close(0)


async def test_a_batch_that_ran_nothing_does_not_teach_the_estimate() -> None:
    # every request of a batch went (gone, or past its deadline) before it reached the device: it
    # took no time, and would have pulled the estimate down a fifth
    clock, runner = FakeClock(), FakeRunner()
    policy = BatchPolicy(LanePolicy(2 * MS, 4, 64), LanePolicy(25 * MS, 4, 64))
    ran: list[bool] = [True]
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(
        runner, policy, clock=clock, computed=lambda outputs: len(outputs) if ran[0] else 0
    )
    batcher.start()
    await run_one_timed_batch(batcher, clock, runner)
    ran[0] = False
    tasks = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(4)]
    await settle()
    await asyncio.gather(*tasks)
    assert batcher.intake.batch_s(Lane.NORMAL) == pytest.approx(0.1), "a batch that measured nothing"
    await batcher.close(0)


async def test_requests_a_close_cuts_off_uncomputed_are_counted_as_cancelled() -> None:
    batcher, _clock, runner, recorder = make(max_batch=1)
    runner.gate = asyncio.Event()  # the first batch never ends: the close runs out of grace
    tasks = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(3)]
    await settle()
    await batcher.close(grace_s=0)
    for task in tasks:
        with pytest.raises(Draining):
            await task
    # one cut off mid-batch, two still queued: each counted once
    assert recorder.dropped == [(Lane.NORMAL, "cancelled")] * 3


async def test_an_admitted_request_past_its_deadline_at_the_queue_is_a_drop_not_a_refusal() -> None:
    # admitted, then its deadline passed while its image decoded: cancellations_total{deadline},
    # not rejections_total, which counts what admission refused
    batcher, _clock, _runner, recorder = make()
    batcher.intake.admit(Lane.NORMAL, 1.0, reserve=True)  # the route's seat
    batcher.intake.release(Lane.NORMAL)  # given back once decoded, as the service does
    with pytest.raises(DeadlineExceeded):
        await batcher.submit(1, Lane.NORMAL, -0.001, admitted=True)
    assert recorder.dropped == [(Lane.NORMAL, "deadline")] and recorder.rejected == []
    await batcher.close(0)


async def test_a_batch_is_reported_against_the_max_batch_it_formed_under() -> None:
    batcher, clock, runner, recorder = make(max_batch=16)
    runner.gate = asyncio.Event()
    tasks = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(4)]
    await settle()
    await clock.advance(25 * MS)  # the window closes: 4 of 16 go
    batcher.set_policy(BatchPolicy(LanePolicy(2 * MS, 4, 64), LanePolicy(25 * MS, 4, 64)))  # while it runs
    runner.gate.set()
    await asyncio.gather(*tasks)
    assert [(lane, size, capacity) for lane, size, capacity in recorder.batches] == [(Lane.NORMAL, 4, 16)]
    await batcher.close(0)


async def test_a_request_gone_from_a_batch_the_close_cuts_off_is_counted_once() -> None:
    batcher, clock, runner, recorder = make()
    runner.gate = asyncio.Event()
    gone = asyncio.ensure_future(batcher.submit(1, Lane.NORMAL, 10.0))
    stays = asyncio.ensure_future(batcher.submit(2, Lane.NORMAL, 10.0))
    await settle()
    await clock.advance(25 * MS)
    assert runner.batches == [[1, 2]]
    gone.cancel()  # its client went after its batch formed
    await settle()
    await batcher.close(grace_s=0)  # the batch never ends: cut off
    with pytest.raises(Draining):
        await stays
    assert recorder.dropped == [(Lane.NORMAL, "cancelled")] * 2


async def test_the_cpu_fallback_is_not_held_under_the_old_devices_ceiling() -> None:
    batcher, clock, runner, epoch = with_model_epoch(max_batch=8)
    batcher.lower_ceiling(4)  # the GPU ran out of memory at 4
    assert batcher.ceiling == 2
    runner.gate = asyncio.Event()
    tasks = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(2)]
    await settle()
    await clock.advance(25 * MS)
    epoch[0] += 1  # the CPU fallback took over inside this batch
    runner.gate.set()
    await asyncio.gather(*tasks)
    assert batcher.ceiling is None
    await batcher.close(0)


async def test_a_ceiling_outlives_a_policy_under_it_and_caps_the_policy_set_back() -> None:
    """Lowering max_batch is what the runbook says to do when batches fail; batches under the cap
    prove nothing of the size that failed, so the policy set back meets the cap, not the failure."""
    batcher, clock, runner, _ = make(max_batch=16)
    batcher.lower_ceiling(16)  # capped at 8
    batcher.set_policy(BatchPolicy(LanePolicy(2 * MS, 4, 64), LanePolicy(25 * MS, 4, 64)))  # both under it now
    await run_one_timed_batch(batcher, clock, runner)
    assert batcher.ceiling == 8
    assert batcher.effective_policy().normal.max_batch == 4
    batcher.set_policy(BatchPolicy(LanePolicy(2 * MS, 16, 64), LanePolicy(25 * MS, 16, 64)))
    assert batcher.effective_policy().normal.max_batch == batcher.effective_policy().urgent.max_batch == 8
    await batcher.close(0)
