"""The dual-window batcher under a hand-moved clock and a recording runner."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from app.batching import BatchPolicy, Completed, DualWindowBatcher, Lane, LanePolicy, UrgentFill
from app.batching.intake import REFUSING_S
from app.batching.observer import NullObserver
from app.errors import BatchFailed, DeadlineExceeded, Draining, QueueFull, ServiceError
from tests.support import cyclic_garbage
from tests.unit.fakes import FakeClock, FakeRunner, settle

MS = 0.001


def policy(
    normal_window: float = 25 * MS,
    normal_max: int = 16,
    urgent_window: float = 2 * MS,
    urgent_max: int = 16,
    fill: UrgentFill = UrgentFill.ALWAYS,
    max_queue: int = 64,
) -> BatchPolicy:
    return BatchPolicy(
        urgent=LanePolicy(urgent_window, urgent_max, max_queue),
        normal=LanePolicy(normal_window, normal_max, max_queue),
        urgent_fill=fill,
    )


class Harness:
    def __init__(self, batcher: DualWindowBatcher[int, int], clock: FakeClock, runner: FakeRunner) -> None:
        self.batcher, self.clock, self.runner = batcher, clock, runner

    def submit(self, payload: int, lane: Lane = Lane.NORMAL, timeout: float = 10.0) -> asyncio.Task[Completed[int]]:
        return asyncio.ensure_future(self.batcher.submit(payload, lane, timeout))


@pytest.fixture
async def make() -> AsyncIterator[object]:
    made: list[DualWindowBatcher[int, int]] = []

    def build(p: BatchPolicy | None = None, runner: FakeRunner | None = None) -> Harness:
        clock, runner = FakeClock(), runner or FakeRunner()
        batcher: DualWindowBatcher[int, int] = DualWindowBatcher(runner, p or policy(), clock=clock)
        batcher.start()
        made.append(batcher)
        return Harness(batcher, clock, runner)

    yield build
    for batcher in made:
        await batcher.close(grace_s=0)


async def test_a_batch_goes_when_the_window_of_its_oldest_request_closes(make) -> None:
    h = make()
    tasks = [h.submit(i) for i in range(3)]
    await h.clock.advance(10 * MS)
    tasks.append(h.submit(3))
    await h.clock.advance(14 * MS)
    assert h.runner.batches == []
    await h.clock.advance(1 * MS)
    assert h.runner.batches == [[0, 1, 2, 3]]
    results = await asyncio.gather(*tasks)
    assert [r.output for r in results] == [0, 2, 4, 6]
    assert {r.batch_size for r in results} == {4}
    assert results[0].queued_s == pytest.approx(25 * MS)
    assert results[3].queued_s == pytest.approx(15 * MS)


async def test_a_full_batch_goes_at_once_and_the_rest_waits_for_its_window(make) -> None:
    h = make(policy(normal_max=4))
    tasks = [h.submit(i) for i in range(6)]
    await settle()
    assert h.runner.batches == [[0, 1, 2, 3]]
    await h.clock.advance(25 * MS)
    assert h.runner.batches == [[0, 1, 2, 3], [4, 5]]
    await asyncio.gather(*tasks)


async def test_urgent_requests_leave_after_two_ms(make) -> None:
    h = make()
    task = h.submit(7, Lane.URGENT)
    await h.clock.advance(1.9 * MS)
    assert h.runner.batches == []
    await h.clock.advance(0.1 * MS)
    assert h.runner.batches == [[7]]
    done = await task
    assert (done.lane, done.batch_lane, done.batch_size) == (Lane.URGENT, Lane.URGENT, 1)


async def test_urgent_goes_before_normal_and_takes_free_seats_oldest_first(make) -> None:
    h = make(policy(urgent_max=4))
    h.runner.gate = asyncio.Event()
    first = h.submit(100)
    await h.clock.advance(25 * MS)  # [100] is running, held by the gate
    normals = [h.submit(i) for i in range(1, 6)]
    await h.clock.advance(5 * MS)
    urgent = h.submit(50, Lane.URGENT)
    await h.clock.advance(25 * MS)  # both lanes are ready now
    h.runner.gate.set()
    await settle()
    assert h.runner.batches[1] == [50, 1, 2, 3], "urgent first, then the oldest normal requests"
    await h.clock.advance(25 * MS)
    assert h.runner.batches[2] == [4, 5]
    done = await urgent
    assert done.batch_lane is Lane.URGENT and done.batch_size == 4
    rider = await normals[0]
    assert (rider.lane, rider.batch_lane) == (Lane.NORMAL, Lane.URGENT)
    await asyncio.gather(first, *normals)


async def test_without_fill_urgent_batches_carry_only_urgent_requests(make) -> None:
    h = make(policy(fill=UrgentFill.NEVER))
    normal = [h.submit(i) for i in range(3)]
    urgent = h.submit(9, Lane.URGENT)
    await h.clock.advance(2 * MS)
    assert h.runner.batches == [[9]]
    await h.clock.advance(23 * MS)
    assert h.runner.batches == [[9], [0, 1, 2]]
    await asyncio.gather(urgent, *normal)


async def test_backlog_fill_takes_normal_seats_only_while_a_full_normal_batch_waits(make) -> None:
    h = make(policy(fill=UrgentFill.BACKLOG, normal_max=4, urgent_max=8))
    few = [h.submit(i) for i in range(3)]  # under a full normal batch: the urgent batch goes alone
    alone = h.submit(90, Lane.URGENT)
    await h.clock.advance(2 * MS)
    assert h.runner.batches == [[90]]
    await h.clock.advance(23 * MS)
    assert h.runner.batches[1] == [0, 1, 2]
    h.runner.gate = asyncio.Event()  # the device falls behind: normal requests pile up past a batch
    busy = h.submit(50, Lane.URGENT)
    await h.clock.advance(2 * MS)
    backlog = [h.submit(i) for i in range(3, 9)]
    filled = h.submit(91, Lane.URGENT)
    await h.clock.advance(2 * MS)
    h.runner.gate.set()
    await settle()
    assert h.runner.batches[2:4] == [[50], [91, 3, 4, 5, 6, 7, 8]]
    await asyncio.gather(alone, busy, filled, *few, *backlog)


@pytest.mark.parametrize("refused", ["no", "just now", "a while ago"])
async def test_while_the_normal_lane_refuses_one_batch_of_backlog_fills_whatever_the_policy_asks(
    make, refused: str
) -> None:
    """Under ``backlog`` with ``urgent_fill_backlog=3`` a backlog of one and a half batches does not
    fill; but a normal lane refusing requests (overload) is as far behind as admission lets it be
    (a short deadline caps its backlog below three batches), and one batch's backlog fills again
    for as long as the refusals go on."""
    lanes = BatchPolicy(
        urgent=LanePolicy(2 * MS, 8, 64),
        normal=LanePolicy(5.0, 4, 6),  # a long window: the normal batch is not due while this runs
        urgent_fill=UrgentFill.BACKLOG,
        urgent_fill_backlog=3,
    )
    h = make(lanes)
    h.runner.gate = asyncio.Event()
    busy = h.submit(50, Lane.URGENT)  # holds the device
    await h.clock.advance(2 * MS)
    # deadlines that wait out the window whatever the held batch's run: none of them hurries
    queued = [h.submit(i, timeout=60.0) for i in range(3)]
    for _ in range(3):  # and three more admitted, their images still decoding: six ahead in all
        h.batcher.intake.admit(Lane.NORMAL, 10.0, reserve=True)
    await settle()
    if refused != "no":
        with pytest.raises(QueueFull):
            await h.batcher.submit(99, Lane.NORMAL, 10.0)
        if refused == "a while ago":
            await h.clock.advance(REFUSING_S)
    urgent = h.submit(91, Lane.URGENT)
    await h.clock.advance(2 * MS)
    h.runner.gate.set()
    await settle()
    assert h.runner.batches[0] == [50]
    if refused == "just now":
        assert h.runner.batches[1] == [91, 0, 1, 2]
    else:
        assert h.runner.batches[1] == [91], "one and a half batches of backlog, and no refusal lately: no riders"
    for _ in range(3):
        h.batcher.intake.release(Lane.NORMAL)
    await h.clock.advance(5.0)
    await asyncio.gather(busy, urgent, *queued)


async def test_work_accumulates_while_the_device_is_busy_and_goes_when_it_frees(make) -> None:
    h = make(policy(normal_max=8))
    h.runner.gate = asyncio.Event()
    tasks = [h.submit(0)]
    await h.clock.advance(25 * MS)
    tasks += [h.submit(i) for i in range(1, 4)]
    await h.clock.advance(100 * MS)  # windows long closed, device still busy
    assert len(h.runner.batches) == 1
    h.runner.gate.set()
    await settle()
    assert h.runner.batches == [[0], [1, 2, 3]], "the ready batch goes the moment the device frees"
    await asyncio.gather(*tasks)


async def test_a_failing_batch_fails_exactly_its_own_requests(make) -> None:
    runner = FakeRunner(fail_on=lambda batch: RuntimeError("boom") if 13 in batch else None)
    h = make(policy(normal_max=2), runner)
    bad = [h.submit(13), h.submit(1)]
    good = [h.submit(2), h.submit(3)]
    await settle()
    for task in bad:
        with pytest.raises(BatchFailed):
            await task
    assert [r.output for r in await asyncio.gather(*good)] == [4, 6]
    later = h.submit(5)
    await h.clock.advance(25 * MS)
    assert (await later).output == 10, "the batcher keeps serving after a failed batch"


async def test_a_service_error_from_the_runner_reaches_each_request_unchanged(make) -> None:
    error = ServiceError("device gone", code="device_unavailable")
    h = make(policy(normal_max=2), FakeRunner(fail_on=lambda _: error))
    tasks = [h.submit(1), h.submit(2)]
    await settle()
    for task in tasks:
        with pytest.raises(ServiceError) as caught:
            await task
        assert caught.value is error


async def test_a_runner_that_returns_too_few_outputs_fails_the_batch(make) -> None:
    h = make(policy(normal_max=3))
    h.runner.short = True
    tasks = [h.submit(i) for i in range(3)]
    await settle()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, BatchFailed) for r in results)


async def test_a_cancelled_request_leaves_the_queue_and_is_never_computed(make) -> None:
    h = make()
    keep, gone = h.submit(1), h.submit(2)
    await settle()
    assert h.batcher.depth(Lane.NORMAL) == 2
    gone.cancel()
    await settle()
    assert h.batcher.depth(Lane.NORMAL) == 1
    await h.clock.advance(25 * MS)
    assert h.runner.batches == [[1]]
    assert (await keep).output == 2


@pytest.mark.usefixtures("no_hurry")
async def test_a_request_past_its_deadline_is_answered_at_once_and_never_computed(make) -> None:
    h = make()
    late = h.submit(1, timeout=10 * MS)
    on_time = h.submit(2)
    await h.clock.advance(10 * MS)
    assert late.done()
    with pytest.raises(DeadlineExceeded):
        await late
    await h.clock.advance(15 * MS)
    assert h.runner.batches == [[2]]
    await on_time


@pytest.mark.usefixtures("no_hurry")
async def test_requests_that_fail_or_expire_leave_nothing_for_the_cycle_collector(make) -> None:
    """At twice the load many requests expire or fail; each must be freed once answered. A
    waiting frame that held its future (whose exception's traceback held the frame), or an item
    whose spent timer held it, was a cycle each, left to the collector."""
    h = make(runner=FakeRunner(fail_on=lambda payloads: BatchFailed("device") if payloads[0] < 0 else None))
    with cyclic_garbage() as left:
        late = [h.submit(i, timeout=5 * MS) for i in range(3)]
        await h.clock.advance(10 * MS)
        failing = [h.submit(-1 - i) for i in range(3)]
        await h.clock.advance(30 * MS)
        await settle()
        for task in late + failing:
            with pytest.raises((DeadlineExceeded, BatchFailed)):
                await task
        del late, failing, task
    assert not left, left


async def test_a_full_queue_refuses_at_once(make) -> None:
    h = make(policy(normal_max=2, urgent_max=2, max_queue=2))
    h.runner.gate = asyncio.Event()
    tasks = [h.submit(i) for i in range(2)]
    await settle()  # running, held by the gate
    tasks += [h.submit(i) for i in range(2, 4)]
    await settle()
    with pytest.raises(QueueFull):
        await h.batcher.submit(9, Lane.NORMAL, 10.0)
    assert h.batcher.depth(Lane.NORMAL) == 2, "the refused request took no place in the queue"
    h.runner.gate.set()
    await h.clock.advance(25 * MS)
    await asyncio.gather(*tasks)


async def test_a_policy_change_applies_from_the_next_batch(make) -> None:
    h = make()
    tasks = [h.submit(i) for i in range(3)]
    h.batcher.set_policy(policy(normal_max=2))
    await settle()
    assert h.runner.batches == [[0, 1]]
    await h.clock.advance(25 * MS)
    assert h.runner.batches == [[0, 1], [2]]
    await asyncio.gather(*tasks)


async def test_close_runs_what_is_queued_without_waiting_for_windows(make) -> None:
    h = make()
    tasks = [h.submit(i) for i in range(3)]
    await settle()
    await h.batcher.close(grace_s=None)
    assert h.runner.batches == [[0, 1, 2]]
    assert [r.output for r in await asyncio.gather(*tasks)] == [0, 2, 4]
    with pytest.raises(Draining):
        await h.batcher.submit(1, Lane.NORMAL, 1.0)


async def test_close_past_its_grace_fails_what_is_left_exactly_once(make) -> None:
    h = make(policy(normal_max=1))
    h.runner.gate = asyncio.Event()
    running = h.submit(1)
    waiting = h.submit(2)
    await settle()
    await h.batcher.close(grace_s=0)
    for task in (running, waiting):
        with pytest.raises(Draining):
            await task
    assert not h.batcher.running


async def test_close_with_no_grace_stops_a_dispatcher_waiting_for_a_window_on_the_real_clock() -> None:
    """The close's cancel lands just as its own wakeup ends the dispatcher's wait for a window: it
    must not be lost (it was, through ``asyncio.wait_for`` on 3.11: the dispatcher went on, and
    the close waited with no bound for the batch it then ran)."""
    runner = FakeRunner()
    runner.gate = asyncio.Event()  # a batch that started would never end
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(runner, policy())  # the real clock
    batcher.start()
    queued = asyncio.ensure_future(batcher.submit(1, Lane.NORMAL, 10.0))
    await asyncio.sleep(0.001)  # queued, its window (25 ms) not yet over
    try:
        async with asyncio.timeout(10):
            await batcher.close(grace_s=0)
        with pytest.raises(Draining):
            await queued
        assert not batcher.running
    finally:
        runner.gate.set()


async def test_a_batch_that_ran_is_answered_though_counting_it_fails(caplog: pytest.LogCaptureFixture) -> None:
    """The observer (metrics) raising after a batch ran must not cost its requests their answers:
    they were computed (before, they waited for their deadline and expired)."""

    class Broken(NullObserver):
        def on_batch(self, *args: object) -> None:
            raise RuntimeError("a metrics bug")

    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(
        FakeRunner(), policy(normal_max=2), clock=FakeClock(), observer=Broken()
    )
    batcher.start()
    try:
        tasks = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in (1, 2)]
        async with asyncio.timeout(5):
            assert [r.output for r in await asyncio.gather(*tasks)] == [2, 4]
        assert "counting a batch of 2 that ran failed" in caplog.text
    finally:
        await batcher.close(grace_s=0)


async def test_the_batch_size_is_what_the_device_ran_not_the_requests_it_left_out() -> None:
    """A request whose client went (or whose deadline passed) after its batch formed is left out
    by the device: the answers and the batch histogram said the batch as formed."""
    sizes: list[int] = []

    class Sizes(NullObserver):
        def on_batch(self, lane: Lane, size: int, *args: object) -> None:
            sizes.append(size)

    class LeavesOutTheFirst(FakeRunner):
        async def __call__(self, payloads: Sequence[int]) -> list[int]:
            return [-1, *(await super().__call__(payloads))[1:]]  # -1: not computed

    clock, runner = FakeClock(), LeavesOutTheFirst()
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(
        runner, policy(), clock=clock, observer=Sizes(), computed=lambda outputs: sum(o >= 0 for o in outputs)
    )
    batcher.start()
    try:
        tasks = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 10.0)) for i in range(4)]
        await clock.advance(25 * MS)
        results = await asyncio.gather(*tasks)
    finally:
        await batcher.close(grace_s=0)
    assert runner.batches == [[0, 1, 2, 3]]
    assert [r.batch_size for r in results[1:]] == [3, 3, 3]
    assert sizes == [3]
