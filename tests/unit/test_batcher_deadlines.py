"""A request past its deadline never reaches the runner, though its timer has not run yet.

On a busy event loop timers run late: a step that takes a few milliseconds (a slow callback, a
burst of submits) lets a request's deadline pass, and the dispatcher, woken in that step, runs
before the timer that would have answered it. It used to take the request into its batch by the
state of its future alone, and the runner got a request already past its deadline.

And a request is not answered as past its deadline before it passed: uvloop's timers run early."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest

from app.batching import BatchPolicy, Completed, DualWindowBatcher, Lane, LanePolicy
from app.batching.observer import NullObserver
from app.errors import DeadlineExceeded, Draining
from tests.unit.fakes import FakeClock, FakeRunner, settle

# what a deadline does to a request still queued: each waits out its window, as behind a busy device
pytestmark = pytest.mark.usefixtures("no_hurry")

MS = 0.001
POLICY = BatchPolicy(LanePolicy(2 * MS, 2, 8), LanePolicy(25 * MS, 2, 8))
Submit = Callable[[int, Lane, float], "asyncio.Future[Completed[int]]"]
Harness = tuple[FakeClock, FakeRunner, DualWindowBatcher[int, int], Submit]


@contextlib.asynccontextmanager
async def on_a_fake_clock(policy: BatchPolicy = POLICY, observer: NullObserver | None = None) -> AsyncIterator[Harness]:
    """A started batcher on a clock the test moves (its timers run only when the test says), its
    runner recording each batch, and ``submit``, which sends a request as a task; closed at the end.

    Every task ``submit`` made is awaited at the end, its error taken: a test that fails before
    it awaits one (a request past its deadline, say) must not leave a task whose error was never
    retrieved. The garbage collector would finalize it at some later allocation, and asyncio would
    log its traceback there; on Python 3.11.7 that traceback's formatting parses source (``ast``),
    and when the allocation is inside another ``ast.parse`` (pytest rewriting a module it imports
    for its summary, hypothesis) the nested parse makes the outer one fail ("AST constructor
    recursion depth mismatch"): an INTERNALERROR that hid the test's own failure."""
    clock, runner = FakeClock(), FakeRunner()
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(runner, policy, clock=clock, observer=observer)
    submitted: list[asyncio.Future[Completed[int]]] = []

    def submit(payload: int, lane: Lane, timeout_s: float) -> asyncio.Future[Completed[int]]:
        submitted.append(asyncio.ensure_future(batcher.submit(payload, lane, timeout_s)))
        return submitted[-1]

    batcher.start()
    try:
        yield clock, runner, batcher, submit
    finally:
        await batcher.close(grace_s=0)
        await asyncio.gather(*submitted, return_exceptions=True)  # each answered by the close


async def test_a_request_whose_timer_is_late_is_answered_at_formation_not_batched() -> None:
    async with on_a_fake_clock() as (clock, runner, batcher, submit):
        late = submit(1, Lane.NORMAL, 3 * MS)
        await settle()
        clock.t += 5 * MS  # its deadline passed; the loop has not run its timer yet
        on_time = [submit(i, Lane.NORMAL, 1.0) for i in (2, 3)]
        await settle()  # two live requests: a full batch
        assert runner.batches == [[2, 3]]
        assert late.done()
        with pytest.raises(DeadlineExceeded):
            await late
        assert [r.output for r in await asyncio.gather(*on_time)] == [4, 6]


async def test_a_late_request_does_not_make_its_lane_ready_for_the_others() -> None:
    """The plan counted the late request (the oldest, its window closed): the one behind it must
    still wait its own window, not leave at once in a batch of one."""
    async with on_a_fake_clock() as (clock, runner, batcher, submit):
        late = submit(1, Lane.URGENT, 1 * MS)
        await settle()
        clock.t += 3 * MS  # its deadline and its window passed; its timer has not run yet
        behind = submit(2, Lane.URGENT, 1.0)
        await settle()
        with pytest.raises(DeadlineExceeded):
            await late
        assert runner.batches == [], "the request behind it waits its own window"
        await clock.advance(2 * MS)
        assert runner.batches == [[2]]
        assert (await behind).queued_s == pytest.approx(2 * MS)


async def test_on_the_real_loop_a_request_past_its_deadline_never_reaches_the_runner() -> None:
    reached: list[tuple[str, float]] = []

    async def runner(payloads: Sequence[str]) -> list[str]:
        reached.extend((payload, time.monotonic()) for payload in payloads)
        return list(payloads)

    async def busy() -> None:
        time.sleep(3 * MS)  # noqa: ASYNC251 - the point: a step that holds the loop

    batcher: DualWindowBatcher[str, str] = DualWindowBatcher(runner, POLICY)  # the real clock
    batcher.start()
    try:
        deadline = time.monotonic() + 3 * MS
        late = asyncio.ensure_future(batcher.submit("late", Lane.NORMAL, 3 * MS))
        await asyncio.sleep(0)
        time.sleep(2 * MS)  # noqa: ASYNC251
        filler = asyncio.ensure_future(batcher.submit("filler", Lane.NORMAL, 1.0))  # fills the batch
        held = asyncio.ensure_future(busy())  # runs after the filler's submit, before the dispatcher
        results = await asyncio.gather(late, filler, held, return_exceptions=True)
        assert isinstance(results[0], DeadlineExceeded)
        assert all(payload != "late" or at < deadline for payload, at in reached), "computed past its deadline"
    finally:
        await batcher.close(grace_s=0)


async def test_a_close_answers_a_queued_request_past_its_deadline_as_such_not_draining() -> None:
    """Its deadline passed while the close waited (its timer not run yet): ``deadline_exceeded`` is
    what it would have got served, and what its client should read; ``draining`` is for the rest."""
    async with on_a_fake_clock(BatchPolicy(LanePolicy(2 * MS, 1, 8), LanePolicy(25 * MS, 1, 8))) as harness:
        clock, runner, batcher, submit = harness
        runner.gate = asyncio.Event()  # the running batch never ends
        running = submit(1, Lane.NORMAL, 1.0)
        late = submit(2, Lane.NORMAL, 3 * MS)
        live = submit(3, Lane.NORMAL, 1.0)
        await settle()
        assert runner.batches == [[1]]
        clock.t += 5 * MS  # past the second one's deadline; its timer has not run
        await batcher.close(grace_s=0)
    with pytest.raises(DeadlineExceeded):
        await late
    for task in (running, live):
        with pytest.raises(Draining):
            await task


class EarlyClock(FakeClock):
    """Runs each timer early, as uvloop's do (they count whole milliseconds, from a loop clock
    read in whole milliseconds): by half its delay, a millisecond at most."""

    def call_at(self, when: float, callback: Callable[[], None]) -> Any:
        return super().call_at(when - min(1 * MS, (when - self.t) / 2), callback)


async def test_a_timer_that_runs_early_does_not_answer_the_request_before_its_deadline() -> None:
    """Answered ``deadline_exceeded`` before its deadline, a request in a batch waiting for the
    device would still be computed there (the device checks the deadline itself): for nobody."""
    clock, runner = EarlyClock(), FakeRunner()
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(runner, POLICY, clock=clock)
    batcher.start()
    try:
        request = asyncio.ensure_future(batcher.submit(1, Lane.NORMAL, 10 * MS))
        await clock.advance(9.5 * MS)  # its timer ran; its deadline is half a millisecond away
        assert not request.done(), "answered as past its deadline before it passed"
        await clock.advance(2 * MS)
        with pytest.raises(DeadlineExceeded):
            await request
        assert runner.batches == []
    finally:
        await batcher.close(grace_s=0)


def test_on_uvloop_no_request_is_answered_before_its_deadline() -> None:
    """uvloop, the loop ``ai-backend serve`` runs on, ran a third of the deadline timers up to a
    millisecond early."""
    uvloop = pytest.importorskip("uvloop")

    async def play() -> list[float]:
        windows = BatchPolicy(LanePolicy(1.0, 64, 64), LanePolicy(1.0, 64, 64))  # that no deadline here meets
        batcher: DualWindowBatcher[int, int] = DualWindowBatcher(FakeRunner(), windows)  # the real clock
        batcher.start()
        early: list[float] = []

        async def one(i: int) -> None:
            timeout = (3 + i % 7 + i / 31) * MS  # fractions of a millisecond, as real deadlines have
            deadline = time.monotonic() + timeout
            with pytest.raises(DeadlineExceeded):
                await batcher.submit(i, Lane.URGENT if i % 2 else Lane.NORMAL, timeout)
            early.append(deadline - time.monotonic())

        try:
            await asyncio.gather(*(one(i) for i in range(30)))
        finally:
            await batcher.close(grace_s=0)
        return early

    early = uvloop.run(play())
    assert max(early) <= 0, f"{sum(e > 0 for e in early)} of 30 answered up to {max(early) / MS:.2f} ms early"


class Drops(NullObserver):
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def on_dropped(self, lane: Lane, reason: str) -> None:
        self.reasons.append(reason)


async def test_a_result_that_comes_after_the_deadline_is_not_the_answer_though_the_timer_is_late() -> None:
    """At twice the load a batch's result and its late requests' timers come due in the same turn
    of a lagging loop: the result's callback ran first and answered them 200 after their deadline
    (20 of 13,142 answers in one benchmark). They get what the timer would have given them, and
    are counted once, as computed for nobody (``late``)."""
    drops = Drops()
    async with on_a_fake_clock(observer=drops) as (clock, runner, batcher, submit):
        runner.held = []
        late, on_time = submit(1, Lane.NORMAL, 10 * MS), submit(2, Lane.NORMAL, 1.0)
        await settle()  # a full batch of two, running
        assert runner.batches == [[1, 2]]
        clock.t += 15 * MS  # the first one's deadline passed during the batch; its timer has not run
        runner.release()
        await settle()
        with pytest.raises(DeadlineExceeded, match="while its batch ran"):
            await late
        assert (await on_time).output == 4
        assert drops.reasons == ["late"]


async def test_a_timer_that_runs_while_the_batch_runs_answers_at_the_deadline() -> None:
    drops = Drops()
    async with on_a_fake_clock(observer=drops) as (clock, runner, batcher, submit):
        runner.held = []
        late, on_time = submit(1, Lane.NORMAL, 10 * MS), submit(2, Lane.NORMAL, 1.0)
        await settle()
        await clock.advance(15 * MS)  # its timer runs: it is answered now, its batch still running
        assert late.done() and not on_time.done()
        with pytest.raises(DeadlineExceeded, match="while its batch ran"):
            await late
        assert drops.reasons == [], "counted once its batch is done: the device may yet leave it out"
        runner.release()
        assert (await on_time).output == 4
        assert drops.reasons == ["late"], "computed for nobody"
