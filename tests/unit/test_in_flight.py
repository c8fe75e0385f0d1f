"""Several batches in flight (``model.device_workers`` on a CPU): the batcher's side."""

from __future__ import annotations

import asyncio

import pytest

from app.batching import BatchPolicy, Completed, DualWindowBatcher, Lane, LanePolicy, UrgentFill
from app.errors import Draining, WouldMissDeadline
from tests.unit.fakes import FakeClock, FakeRunner, settle

MS = 0.001


def policy(urgent_max: int = 2, normal_max: int = 2, fill: UrgentFill = UrgentFill.ALWAYS) -> BatchPolicy:
    return BatchPolicy(
        urgent=LanePolicy(2 * MS, urgent_max, 64), normal=LanePolicy(25 * MS, normal_max, 64), urgent_fill=fill
    )


def batcher(
    runner: FakeRunner, clock: FakeClock, in_flight: int, urgent_in_flight: int = 0, rules: BatchPolicy | None = None
) -> DualWindowBatcher[int, int]:
    made: DualWindowBatcher[int, int] = DualWindowBatcher(
        runner, rules or policy(), clock=clock, max_in_flight=in_flight, urgent_in_flight=urgent_in_flight
    )
    made.start()
    return made


async def test_two_batches_run_at_once_and_a_third_waits_for_a_free_worker() -> None:
    clock, runner = FakeClock(), FakeRunner()
    runner.gate = asyncio.Event()
    b = batcher(runner, clock, in_flight=2)
    tasks = [asyncio.ensure_future(b.submit(i, Lane.NORMAL, 10.0)) for i in range(6)]
    await clock.advance(100 * MS)
    assert runner.batches == [[0, 1], [2, 3]], "two full batches at once; the third waits though ready"
    runner.gate.set()
    await settle()
    assert runner.batches == [[0, 1], [2, 3], [4, 5]]
    assert [done.output for done in await asyncio.gather(*tasks)] == [0, 2, 4, 6, 8, 10]
    await b.close(grace_s=None)


async def test_one_in_flight_keeps_batches_strictly_one_after_another() -> None:
    clock, runner = FakeClock(), FakeRunner()
    runner.gate = asyncio.Event()
    b = batcher(runner, clock, in_flight=1)
    tasks = [asyncio.ensure_future(b.submit(i, Lane.NORMAL, 10.0)) for i in range(4)]
    await clock.advance(100 * MS)
    assert runner.batches == [[0, 1]]
    runner.gate.set()
    await asyncio.gather(*tasks)
    await b.close(grace_s=None)


async def test_predicted_wait_shares_the_queue_among_the_workers() -> None:
    clock, runner = FakeClock(), FakeRunner()
    runner.gate = asyncio.Event()
    one, two = batcher(runner, clock, in_flight=1), batcher(runner, clock, in_flight=2)
    for b in (one, two):
        b.intake.observe_batch(Lane.NORMAL, 0.1)
        for i in range(8):  # full batches of 2 leave at once and hang at the gate
            asyncio.ensure_future(b.submit(i, Lane.NORMAL, 10.0))
    await settle()
    # one worker: 1 batch runs, 3 wait: 3 + 1 rounds ahead, then its own = 5
    # two workers: 2 run, 2 wait: (2 + 2) / 2 rounds ahead, then its own = 3
    assert one.intake.predicted_wait(Lane.NORMAL) == pytest.approx(25 * MS + 5 * 0.1)
    assert two.intake.predicted_wait(Lane.NORMAL) == pytest.approx(25 * MS + 3 * 0.1)
    runner.gate.set()
    for b in (one, two):
        await b.close(grace_s=None)


async def test_closing_waits_for_every_batch_in_flight() -> None:
    clock, runner = FakeClock(), FakeRunner()
    runner.gate = asyncio.Event()
    b = batcher(runner, clock, in_flight=2)
    tasks = [asyncio.ensure_future(b.submit(i, Lane.NORMAL, 10.0)) for i in range(4)]
    await settle()
    closing = asyncio.ensure_future(b.close(grace_s=None))
    await settle()
    assert not closing.done(), "two batches still run"
    runner.gate.set()
    await closing
    assert [done.output for done in await asyncio.gather(*tasks)] == [0, 2, 4, 6]


async def test_closing_past_its_grace_fails_every_running_batch_with_draining() -> None:
    clock, runner = FakeClock(), FakeRunner()
    runner.gate = asyncio.Event()  # never set: the batches outlive the grace
    b = batcher(runner, clock, in_flight=2)
    tasks = [asyncio.ensure_future(b.submit(i, Lane.NORMAL, 10.0)) for i in range(6)]
    await settle()
    assert len(runner.batches) == 2
    await b.close(grace_s=0)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, Draining) for r in results), results
    assert not b.running


def test_max_in_flight_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        DualWindowBatcher(FakeRunner(), policy(), clock=FakeClock(), max_in_flight=0)


async def test_an_urgent_batch_takes_its_own_seat_when_every_worker_is_busy() -> None:
    clock, runner = FakeClock(), FakeRunner()
    runner.gate = asyncio.Event()
    made = batcher(runner, clock, in_flight=1, urgent_in_flight=1)
    normal = [asyncio.ensure_future(made.submit(i, Lane.NORMAL, 10.0)) for i in range(4)]
    await clock.advance(100 * MS)
    assert runner.batches == [[0, 1]], "one normal batch in flight; the next waits for its worker"
    urgent = asyncio.ensure_future(made.submit(9, Lane.URGENT, 10.0))
    await clock.advance(1 * MS)
    assert runner.batches == [[0, 1]], "the urgent window is still open"
    await clock.advance(1 * MS)
    assert runner.batches[1][0] == 9, "the urgent batch went on its own seat, at its window's end"
    runner.gate.set()
    await asyncio.gather(urgent, *normal)
    await made.close(grace_s=None)


async def test_backlog_fill_waits_for_a_full_normal_batch_per_batch_in_flight() -> None:
    clock, runner = FakeClock(), FakeRunner()
    runner.gate = asyncio.Event()
    b = batcher(runner, clock, in_flight=2, urgent_in_flight=2, rules=policy(4, 2, UrgentFill.BACKLOG))
    tasks = [asyncio.ensure_future(b.submit(i, Lane.NORMAL, 10.0)) for i in range(7)]  # 2 batches run, 3 wait
    await settle()
    tasks.append(asyncio.ensure_future(b.submit(90, Lane.URGENT, 10.0)))
    await clock.advance(2 * MS)
    assert runner.batches[2] == [90], "3 waiting are under a full batch for each of the 2 in flight"
    tasks.append(asyncio.ensure_future(b.submit(7, Lane.NORMAL, 10.0)))  # now 4: two full batches
    tasks.append(asyncio.ensure_future(b.submit(91, Lane.URGENT, 10.0)))
    await clock.advance(2 * MS)
    assert runner.batches[3] == [91, 4, 5, 6], "the device is behind: the urgent batch fills its seats"
    runner.gate.set()
    await clock.advance(25 * MS)
    await asyncio.gather(*tasks)
    await b.close(grace_s=None)


async def test_backlog_fill_counts_normal_requests_admitted_and_still_decoding() -> None:
    """Under overload the backlog builds up upstream (images waiting for a decode thread), not
    in the queue: admitted requests count, so urgent batches take the seats the queue has."""
    clock, runner = FakeClock(), FakeRunner()
    runner.gate = asyncio.Event()
    b = batcher(runner, clock, in_flight=2, urgent_in_flight=2, rules=policy(4, 2, UrgentFill.BACKLOG))
    tasks = [asyncio.ensure_future(b.submit(i, Lane.NORMAL, 10.0)) for i in range(5)]  # 2 batches run, 1 waits
    await settle()
    b.intake.admit(Lane.NORMAL, 10.0, reserve=True)
    b.intake.admit(Lane.NORMAL, 10.0, reserve=True)  # 1 queued + 2 decoding: under a full batch for each of 2
    tasks.append(asyncio.ensure_future(b.submit(90, Lane.URGENT, 10.0)))
    await clock.advance(2 * MS)
    assert runner.batches[2] == [90], "3 admitted ahead are under two full batches"
    b.intake.admit(Lane.NORMAL, 10.0, reserve=True)  # 4 admitted ahead: two full batches
    tasks.append(asyncio.ensure_future(b.submit(91, Lane.URGENT, 10.0)))
    await clock.advance(2 * MS)
    assert runner.batches[3] == [91, 4], "the service is behind: the urgent batch takes what the queue has"
    for _ in range(3):
        b.intake.release(Lane.NORMAL)
    runner.gate.set()
    await clock.advance(25 * MS)
    await asyncio.gather(*tasks)
    await b.close(grace_s=None)


async def test_while_urgent_batches_fill_from_the_normal_queue_they_count_as_draining_it() -> None:
    clock, runner = FakeClock(), FakeRunner()
    runner.gate = asyncio.Event()
    made = []
    for fill in (UrgentFill.BACKLOG, UrgentFill.NEVER):
        b = batcher(runner, clock, in_flight=2, urgent_in_flight=1, rules=policy(1, 2, fill))
        b.intake.observe_batch(Lane.NORMAL, 0.1)
        for i in range(8):  # 2 batches run (gated), 4 requests wait: a full batch for each of the 2
            asyncio.ensure_future(b.submit(i, Lane.NORMAL, 10.0))
        made.append(b)
    await settle()
    backlog, never = made
    # no urgent traffic: the urgent thread drains nothing, whatever the fill mode
    assert backlog.intake.predicted_wait(Lane.NORMAL) == pytest.approx(25 * MS + ((2 + 2) // 2 + 1) * 0.1)
    for b in made:
        asyncio.ensure_future(b.submit(90, Lane.URGENT, 10.0))  # runs (gated) on the urgent thread
    await clock.advance(2 * MS)
    # (4 waiting // 2 + 2 running) batches, shared by 2 normal threads + the urgent one (filling), then its own
    assert backlog.intake.predicted_wait(Lane.NORMAL) == pytest.approx(25 * MS + ((2 + 2) // 3 + 1) * 0.1)
    assert never.intake.predicted_wait(Lane.NORMAL) == pytest.approx(25 * MS + ((2 + 2) // 2 + 1) * 0.1)
    runner.gate.set()
    for b in made:
        await b.close(grace_s=None)


async def urgent_behind_a_filled_batch(
    fill: UrgentFill,
) -> tuple[FakeClock, FakeRunner, DualWindowBatcher[int, int], list[asyncio.Future[Completed[int]]]]:
    """Two normal batches run and 8 wait (two full batches for the two threads); urgent 90 fills
    its seats on the free urgent thread; urgent 91 comes and waits until that batch ends."""
    clock, runner = FakeClock(), FakeRunner()
    runner.held = []  # each batch runs until released
    b = batcher(runner, clock, in_flight=2, urgent_in_flight=1, rules=policy(4, 2, fill))
    tasks = [asyncio.ensure_future(b.submit(i, Lane.NORMAL, 10.0)) for i in range(12)]
    await settle()
    tasks.append(asyncio.ensure_future(b.submit(90, Lane.URGENT, 10.0)))
    await clock.advance(2 * MS)
    assert runner.batches[2] == [90, 4, 5, 6], "the urgent thread was free: the batch fills its seats"
    tasks.append(asyncio.ensure_future(b.submit(91, Lane.URGENT, 10.0)))
    await clock.advance(10 * MS)
    assert len(runner.batches) == 3, "91 waits for the urgent thread, busy with the filled batch"
    runner.release(2)  # the filled urgent batch ends; the normal ones still run
    await settle()
    return clock, runner, b, tasks


async def test_urgent_requests_that_waited_for_a_busy_thread_go_without_riders() -> None:
    clock, runner, b, tasks = await urgent_behind_a_filled_batch(UrgentFill.ALWAYS)
    assert runner.batches[3] == [91], "it waited for one long batch: its own carries no riders"
    runner.release(3)
    await settle()
    tasks.append(asyncio.ensure_future(b.submit(92, Lane.URGENT, 10.0)))
    await clock.advance(2 * MS)
    assert runner.batches[4] == [92, 7, 8, 9], "the next one, with the thread free again, fills"
    runner.release()  # every batch held so far ends, and the rest run through
    runner.held = None
    await clock.advance(25 * MS)
    assert [done.output for done in await asyncio.gather(*tasks)] == [2 * i for i in range(12)] + [180, 182, 184]
    await b.close(grace_s=None)


async def test_while_the_service_is_behind_urgent_requests_that_waited_take_riders_too() -> None:
    clock, runner, b, tasks = await urgent_behind_a_filled_batch(UrgentFill.BACKLOG)
    assert runner.batches[3] == [91, 7, 8, 9], "it waited for a filled batch, but the service is behind: it fills"
    runner.release()
    runner.held = None
    await clock.advance(25 * MS)
    assert [done.output for done in await asyncio.gather(*tasks)] == [2 * i for i in range(12)] + [180, 182]
    await b.close(grace_s=None)


async def test_urgent_batches_have_their_own_threads_and_count_against_the_cores() -> None:
    clock, runner = FakeClock(), FakeRunner()
    runner.gate = asyncio.Event()
    b = batcher(runner, clock, in_flight=2, urgent_in_flight=1, rules=policy(2, 2, UrgentFill.NEVER))
    tasks = [asyncio.ensure_future(b.submit(90 + i, Lane.URGENT, 10.0)) for i in range(4)]
    await clock.advance(2 * MS)
    assert runner.batches == [[90, 91]], "one urgent thread: one urgent batch at a time, the next one waits"
    tasks += [asyncio.ensure_future(b.submit(i, Lane.NORMAL, 10.0)) for i in range(4)]
    await settle()
    assert runner.batches[1:] == [[0, 1]], "the urgent batch running takes one of the two cores' worth"
    b.intake.observe_batch(Lane.URGENT, 0.05)
    # urgent: (2 waiting // 2 + 1 running) batches on its 1 thread, then its own; normal batches do not count
    assert b.intake.predicted_wait(Lane.URGENT) == pytest.approx(2 * MS + ((2 // 2 + 1) // 1 + 1) * 0.05)
    runner.gate.set()
    await clock.advance(2 * MS)
    assert [92, 93] in runner.batches and [2, 3] in runner.batches
    await asyncio.gather(*tasks)
    await b.close(grace_s=None)


async def test_with_the_urgent_thread_busy_a_normal_window_still_closes_on_time() -> None:
    clock, runner = FakeClock(), FakeRunner()
    runner.gate = asyncio.Event()
    b = batcher(runner, clock, in_flight=2, urgent_in_flight=1, rules=policy(1, 8, UrgentFill.NEVER))
    tasks = [asyncio.ensure_future(b.submit(90 + i, Lane.URGENT, 10.0)) for i in range(2)]
    await clock.advance(2 * MS)
    assert runner.batches == [[90]], "the urgent thread is busy; 91 waits for it"
    tasks.append(asyncio.ensure_future(b.submit(0, Lane.NORMAL, 10.0)))
    await clock.advance(25 * MS)
    assert runner.batches == [[90], [0]], "the normal window closed while an urgent request waited for its thread"
    runner.gate.set()
    await asyncio.gather(*tasks)
    await b.close(grace_s=None)


async def test_while_the_normal_lane_refuses_the_urgent_thread_counts_as_draining_it_at_one_batch_each() -> None:
    """With ``urgent_fill_backlog=3`` one batch of backlog per thread does not fill, so the urgent
    thread drains none of the normal queue; once the normal lane refuses a request with others
    ahead, it fills at one batch each, and the wait admission predicts says so."""
    clock, runner = FakeClock(), FakeRunner()
    runner.gate = asyncio.Event()
    rules = BatchPolicy(
        urgent=LanePolicy(2 * MS, 1, 64),
        normal=LanePolicy(25 * MS, 2, 64),
        urgent_fill=UrgentFill.BACKLOG,
        urgent_fill_backlog=3,
    )
    b = batcher(runner, clock, in_flight=2, urgent_in_flight=1, rules=rules)
    b.intake.observe_batch(Lane.NORMAL, 0.1)
    tasks = [asyncio.ensure_future(b.submit(i, Lane.NORMAL, 10.0)) for i in range(8)]
    tasks.append(asyncio.ensure_future(b.submit(90, Lane.URGENT, 10.0)))  # runs (gated) on the urgent thread
    await clock.advance(2 * MS)
    assert b.intake.predicted_wait(Lane.NORMAL) == pytest.approx(25 * MS + ((2 + 2) // 2 + 1) * 0.1)
    with pytest.raises(WouldMissDeadline):
        b.intake.admit(Lane.NORMAL, 0.05)  # four ahead and two batches running: far past 50 ms
    assert b.intake.predicted_wait(Lane.NORMAL) == pytest.approx(25 * MS + ((2 + 2) // 3 + 1) * 0.1)
    runner.gate.set()
    await clock.advance(25 * MS)
    await asyncio.gather(*tasks)
    await b.close(grace_s=None)
