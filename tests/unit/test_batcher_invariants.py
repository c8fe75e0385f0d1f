"""The batcher as a state machine: random interleavings of submits, clock steps (and lags: time
that passes before the loop runs the timers due), cancels, batches held, released or failed,
policy changes, memory pressure and seats, checked after every step against the batcher's
contract (DESIGN.md, "Batching semantics"). Each run ends with a close, with or without grace.

The runner holds the batches the run says to hold (``FakeRunner`` computes them). What is checked:

- every request gets exactly one answer, and a batch that ended left none of its futures open,
  nor the close any request;
- nothing reaches the runner past its deadline, cancelled, or twice;
- a batch is no larger than the policy (under the ceiling) set last, goes only when its lane is
  full, its oldest request waited the lane's window or one of its requests could not wait it out,
  never before a ready urgent batch, and
  keeps each lane's order; and no request waits past its window while a thread it may use is free;
- the depth counts exactly the live requests queued and the seats held (a cancel frees its slot),
  and admission refuses a full queue and only a full one;
- each request left uncomputed is counted dropped once; the ceiling stays at least 1, and the
  moving batch estimate finite and not negative.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st

from app.batching import BatchPolicy, Completed, DualWindowBatcher, Lane, LanePolicy, UrgentFill
from app.batching.policy import hurries
from app.errors import BatchFailed, DeadlineExceeded, Draining, QueueFull, ServiceError, WouldMissDeadline
from tests.unit.fakes import FakeClock, FakeRunner, settle
from tests.unit.strategies import batch_policies

EPS = 1e-9


class Fatal(BaseException):
    """Not an ``Exception``: what a runner may still raise (a ``GeneratorExit``, an abort)."""


RESULTS = ("ok", "ok", "service", "bug", "short", "cancelled", "fatal")
# what the runner does with each batch in turn: held until a step releases it, or not; then its result
outcomes = st.lists(st.tuples(st.booleans(), st.sampled_from(RESULTS)), min_size=1, max_size=6)

policies = batch_policies(st.sampled_from([0.001, 0.002, 0.005, 0.025]), max_batch=5, max_extra_queue=4, max_backlog=2)
submits = st.tuples(st.just("submit"), st.sampled_from(list(Lane)), st.sampled_from([0.001, 0.004, 0.03, 5.0]))
advances = st.tuples(st.just("advance"), st.sampled_from([0.0005, 0.001, 0.002, 0.01, 0.025]))
releases = st.tuples(st.just("release"), st.integers(min_value=0, max_value=50))
# time passes and the timers due have not run yet: a busy event loop runs them late
lags = st.tuples(st.just("lag"), st.sampled_from([0.0005, 0.002, 0.03]))
steps = st.lists(
    st.one_of(  # weighted: most steps bring requests, move time, or end a batch
        submits,
        submits,
        submits,
        advances,
        advances,
        releases,
        releases,
        lags,
        st.tuples(st.just("cancel"), st.integers(min_value=0, max_value=50)),
        st.tuples(st.just("policy"), policies),
        st.tuples(st.just("pressure"), st.integers(min_value=1, max_value=6)),
        st.tuples(st.just("reserve"), st.sampled_from(list(Lane))),
        st.tuples(st.just("unreserve"), st.sampled_from(list(Lane))),
    ),
    max_size=50,
)


@dataclass
class Request:
    lane: Lane
    enqueued_at: float
    deadline: float
    task: asyncio.Task[Completed[int]]
    cancelled: bool = False
    batch: int | None = None  # the index of the batch that took it
    hurries: bool = False  # its deadline too short for its lane's window, when it came


@dataclass
class Run:
    """One run's batcher, its fakes, and what the checks need to remember."""

    clock: FakeClock
    runner: FakeRunner
    outcomes: list[tuple[bool, str]]
    observer: Recorder
    requests: dict[int, Request] = field(default_factory=dict)
    batches: list[list[int]] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)
    reserved: dict[Lane, int] = field(default_factory=lambda: {Lane.URGENT: 0, Lane.NORMAL: 0})
    policy: BatchPolicy = field(init=False)  # the last one set: the batcher must follow it
    holds: list[asyncio.Event] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # what the batches broke as they reached the runner
    normal_threads: int = 1
    urgent_threads: int = 0
    closing: bool = False
    batcher: DualWindowBatcher[int, int] = field(init=False)

    async def __call__(self, payloads: Sequence[int]) -> list[int]:
        """The batcher's runner: checks the batch as it arrives, then ``FakeRunner`` holds it."""
        index = len(self.batches)
        try:  # raised in here, it would only fail the batch: the batcher takes it for a runner's bug
            self._check_formed(index, list(payloads))
        except AssertionError as exc:
            self.broken.append(str(exc))
        self.batches.append(list(payloads))
        self.ended.append(False)
        hold, outcome = self.outcomes[index % len(self.outcomes)]
        self.holds.append(asyncio.Event())
        if not hold:
            self.holds[index].set()
        try:
            await self.holds[index].wait()
            outputs = await self.runner(payloads)
            if outcome == "service":
                raise ServiceError("device gone", code="device_unavailable")
            if outcome == "bug":
                raise RuntimeError("a bug in the runner")
            if outcome == "cancelled":
                raise asyncio.CancelledError
            if outcome == "fatal":
                raise Fatal
            return outputs[:-1] if outcome == "short" else outputs
        finally:
            self.ended[index] = True

    def _check_formed(self, index: int, payloads: list[int]) -> None:
        now = self.clock.now()
        assert len(set(payloads)) == len(payloads)
        for payload in payloads:
            request = self.requests[payload]
            assert request.batch is None, f"request {payload} computed twice"
            request.batch = index
            assert not request.task.done(), f"request {payload} reached the runner already answered"
            assert not request.cancelled, f"request {payload} reached the runner after its caller went"
            assert now < request.deadline - EPS, f"request {payload} reached the runner past its deadline"
        lanes = [self.requests[p].lane for p in payloads]
        lane = lanes[0]
        assert lanes == sorted(lanes, key=lambda lane: lane is Lane.NORMAL), "urgent requests first"
        policy = self.policy
        assert len(payloads) <= self._max_batch(lane), f"a {lane} batch of {len(payloads)} over its max"
        own = [p for p in payloads if self.requests[p].lane is lane]
        full = len(own) >= self._max_batch(lane)
        waited = now - self.requests[own[0]].enqueued_at
        # or a request of the lane could not wait out the window when it came, or cannot now (it hurries:
        # the batch goes at once; a lane's first batch timed, or one twice as long, looks again)
        hurried = any(
            r.lane is lane and self._may_hurry(r, now) and (p in payloads or self._queued(r, now))
            for p, r in self.requests.items()
        )
        assert full or self.closing or hurried or waited >= policy.lane(lane).window_s - EPS, (
            f"a {lane} batch of {len(own)} went after {waited * 1000:.3f} ms, before its window"
        )
        riders = [p for p in payloads if self.requests[p].lane is not lane]
        if riders and policy.urgent_fill is UrgentFill.NEVER:  # only a normal lane due rides, so it is not starved
            # due: its window closed for its oldest, or one of its requests hurries (its batch goes at once)
            due = now - self.requests[riders[0]].enqueued_at >= policy.normal.window_s - EPS or any(
                r.lane is Lane.NORMAL and self._may_hurry(r, now) and (p in riders or self._queued(r, now))
                for p, r in self.requests.items()
            )
            assert due or self.closing, "normal requests rode an urgent batch under urgent_fill=never"
        if lane is Lane.NORMAL and not self.urgent_threads:  # then urgent batches take the same seats
            urgent = [r for r in self.requests.values() if r.lane is Lane.URGENT and self._queued(r, now)]
            ready = len(urgent) >= self._max_batch(Lane.URGENT) or any(
                now - r.enqueued_at >= policy.urgent.window_s - EPS or self._may_hurry(r, now) for r in urgent
            )
            assert not (ready or (urgent and self.closing)), "a normal batch went before a ready urgent one"

    def _may_hurry(self, request: Request, now: float) -> bool:
        """It hurried when it came, or would by the time it has left now (the batcher looks its queue
        over again when a lane's batch estimate is new or doubled)."""
        window_s, batch_s = self.policy.lane(request.lane).window_s, self.batcher.intake.batch_s(request.lane)
        return request.hurries or hurries(request.deadline - now, window_s, batch_s)

    def _max_batch(self, lane: Lane) -> int:
        ceiling = self.batcher.ceiling
        size = self.policy.lane(lane).max_batch
        return size if ceiling is None else min(size, ceiling)

    @staticmethod
    def _queued(request: Request, now: float) -> bool:
        """Still waiting in its queue: not taken, not cancelled, not past its deadline."""
        return request.batch is None and not request.task.done() and now < request.deadline - EPS

    def check_nothing_overdue(self) -> None:
        """No request waits past its lane's window while a device thread it may use is free, nor at
        all if it hurries: the device is never idle while a batch is ready."""
        running = [i for i, ended in enumerate(self.ended) if not ended]
        urgent_running = sum(self.requests[self.batches[i][0]].lane is Lane.URGENT for i in running)
        now = self.clock.now()
        for payload, request in self.requests.items():
            if not self._queued(request, now):
                continue
            if request.lane is Lane.URGENT and self.urgent_threads:
                free = urgent_running < self.urgent_threads
            else:
                free = len(running) < self.normal_threads
            waited = now - request.enqueued_at
            window = self.policy.lane(request.lane).window_s
            assert not free or waited < window + EPS, f"{payload} waited {waited * 1000:.3f} ms, a thread free"
            assert not (free and request.hurries), f"{payload} cannot wait out its window, and waits, a thread free"

    def check(self) -> None:
        """What must hold whenever the loop is quiet."""
        assert not self.broken, self.broken
        for lane in Lane:
            queued = sum(1 for r in self.requests.values() if r.lane is lane and r.batch is None and not r.task.done())
            assert self.batcher.depth(lane) == queued + self.reserved[lane], f"{lane} depth"
        for index, batch in enumerate(self.batches):
            if self.ended[index]:
                assert all(self.requests[p].task.done() for p in batch), f"batch {index} ended with open futures"
        for lane in Lane:
            order = [p for batch in self.batches for p in batch if self.requests[p].lane is lane]
            assert order == sorted(order), f"{lane} requests leave in arrival order"
        assert self.batcher.ceiling is None or self.batcher.ceiling >= 1
        for lane in Lane:
            estimate = self.batcher.intake.batch_s(lane)
            assert estimate is None or (math.isfinite(estimate) and estimate >= 0)


class Recorder:
    """Counts the requests dropped, per lane; ``failing``: its ``on_batch`` raises (a metrics bug)."""

    def __init__(self, failing: bool) -> None:
        self.failing = failing
        self.dropped = {Lane.URGENT: 0, Lane.NORMAL: 0}

    def on_batch(
        self, lane: Lane, size: int, capacity: int, waits_s: Sequence[tuple[Lane, float]], run_s: float, ok: bool
    ) -> None:
        if self.failing:
            raise RuntimeError("a bug in the metrics")

    def on_rejected(self, lane: Lane, reason: str) -> None:
        return None

    def on_dropped(self, lane: Lane, reason: str) -> None:
        self.dropped[lane] += 1


def _release_all(run: Run) -> None:
    for hold in run.holds:
        hold.set()


async def _step(run: Run, step: tuple[object, ...], next_id: int) -> None:
    kind = step[0]
    if kind == "submit":
        lane, timeout = step[1], step[2]
        assert isinstance(lane, Lane) and isinstance(timeout, float)
        depth, bound = run.batcher.depth(lane), run.policy.lane(lane).max_queue
        now = run.clock.now()
        task = asyncio.ensure_future(run.batcher.submit(next_id, lane, timeout))
        hurried = hurries(timeout, run.policy.lane(lane).window_s, run.batcher.intake.batch_s(lane))
        run.requests[next_id] = Request(lane, now, now + timeout, task, hurries=hurried)
        await settle()
        refused = task.done() and isinstance(task.exception(), QueueFull)
        assert refused == (depth >= bound), f"depth {depth} of {bound}: refused={refused}"
    elif kind == "advance":
        assert isinstance(step[1], float)
        await run.clock.advance(step[1])
    elif kind == "lag":
        assert isinstance(step[1], float)
        run.clock.t += step[1]
    elif kind == "cancel":
        live = [r for r in run.requests.values() if not r.task.done()]
        if live:
            chosen = live[int(step[1]) % len(live)]  # type: ignore[call-overload]
            chosen.cancelled = chosen.batch is None  # a batch that took it already is not called back
            chosen.task.cancel()
            await settle()
    elif kind == "release":
        held = [hold for hold in run.holds if not hold.is_set()]
        if held:
            held[int(step[1]) % len(held)].set()  # type: ignore[call-overload]
            await settle()
    elif kind == "policy":
        assert isinstance(step[1], BatchPolicy)
        now = run.clock.now()
        for request in run.requests.values():  # a longer window: those it leaves no room hurry now
            window_s, batch_s = step[1].lane(request.lane).window_s, run.batcher.intake.batch_s(request.lane)
            if run._queued(request, now) and hurries(request.deadline - now, window_s, batch_s):
                request.hurries = True
        run.batcher.set_policy(step[1])
        run.policy = step[1]
        await settle()
    elif kind == "pressure":
        run.batcher.lower_ceiling(int(step[1]))  # type: ignore[call-overload]
        await settle()
    elif kind == "reserve":
        lane = step[1]
        assert isinstance(lane, Lane)
        try:
            run.batcher.intake.admit(lane, 5.0, reserve=True, predict=False)
        except QueueFull:
            return
        run.reserved[lane] += 1
    elif kind == "unreserve":
        lane = step[1]
        assert isinstance(lane, Lane)
        if run.reserved[lane]:
            run.batcher.intake.release(lane)
            run.reserved[lane] -= 1
            await settle()


async def _close(run: Run, grace: bool) -> None:
    for lane in Lane:
        for _ in range(run.reserved[lane]):
            run.batcher.intake.release(lane)
        run.reserved[lane] = 0
    run.closing = True
    if not grace:
        await run.batcher.close(grace_s=0)
        _release_all(run)
        await settle()
        return
    closing = asyncio.ensure_future(run.batcher.close(grace_s=None))
    for _ in range(50):  # batches formed by the close may be held too: let each go
        _release_all(run)
        await settle()
        if closing.done():
            break
    assert closing.done(), "the close did not finish once every batch was let go"
    await closing


async def _play(
    policy: BatchPolicy,
    script: list[tuple[object, ...]],
    outcomes: list[tuple[bool, str]],
    in_flight: tuple[int, int],
    grace: bool,
    failing_observer: bool,
) -> None:
    run = Run(FakeClock(), FakeRunner(), outcomes, Recorder(failing_observer))
    run.batcher = DualWindowBatcher(
        run, policy, clock=run.clock, observer=run.observer, max_in_flight=in_flight[0], urgent_in_flight=in_flight[1]
    )
    run.normal_threads, run.urgent_threads, run.policy = in_flight[0], in_flight[1], policy
    run.batcher.start()
    for next_id, step in enumerate(script):
        await _step(run, step, next_id)
        run.check()
        if step[0] == "advance":  # every timer due has run
            run.check_nothing_overdue()
    await _close(run, grace)
    run.check()
    for payload, request in run.requests.items():
        assert request.task.done(), f"request {payload} left unanswered by the close"
    await run.clock.advance(10.0)  # past every deadline: an open future would be answered by its timer now
    for payload, request in run.requests.items():
        assert request.task.done(), f"request {payload} never answered"
    for payload, request in run.requests.items():
        _check_answer(run, payload, request)
    assert not run.batcher.running
    for lane in Lane:
        enqueued = [r for r in run.requests.values() if r.lane is lane and _enqueued(r)]
        never_batched = sum(r.batch is None for r in enqueued)
        uncomputed = sum(
            r.batch is not None and (r.task.cancelled() or r.task.exception() is not None) for r in enqueued
        )
        assert never_batched <= run.observer.dropped[lane] <= never_batched + uncomputed, f"{lane} drops"


def _answered(request: Request) -> bool:
    return not request.task.cancelled() and request.task.exception() is None


def _enqueued(request: Request) -> bool:
    """Not refused at admission."""
    return request.task.cancelled() or not isinstance(request.task.exception(), (QueueFull, WouldMissDeadline))


def _check_answer(run: Run, payload: int, request: Request) -> None:
    if request.task.cancelled():
        return
    error = request.task.exception()
    if error is None:
        done = request.task.result()
        assert request.batch is not None, f"request {payload} answered without being computed"
        assert done.output == payload * 2
        assert done.batch_size == len(run.batches[request.batch])
        return
    assert isinstance(error, (DeadlineExceeded, QueueFull, WouldMissDeadline, Draining, BatchFailed, ServiceError)), (
        f"request {payload} answered {error!r}"
    )


@settings(max_examples=300, deadline=None)
@given(
    policies,
    steps,
    outcomes,
    st.sampled_from([(1, 0), (2, 0), (1, 1)]),
    st.booleans(),
    st.booleans(),
)
# pinned: both lanes ready while the device is busy: the urgent batch goes first (random runs find it rarely)
@example(
    BatchPolicy(LanePolicy(0.002, 2, 4), LanePolicy(0.025, 2, 4), UrgentFill.NEVER),
    [("submit", Lane.NORMAL, 5.0), ("advance", 0.025), ("submit", Lane.URGENT, 5.0), ("submit", Lane.NORMAL, 5.0)]
    + [("advance", 0.025), ("release", 0), ("release", 0)],
    [(True, "ok")],
    (1, 0),
    True,
    False,
)
# pinned: under urgent_fill=never an urgent batch leaves a normal request that is not due behind
@example(
    BatchPolicy(LanePolicy(0.002, 2, 4), LanePolicy(0.025, 2, 4), UrgentFill.NEVER),
    [("submit", Lane.NORMAL, 5.0), ("submit", Lane.URGENT, 5.0), ("advance", 0.002)],
    [(False, "ok")],
    (1, 0),
    True,
    False,
)
# pinned: a deadline that cannot wait out the window, behind one that can, with a thread free: both go at once
@example(
    BatchPolicy(LanePolicy(0.002, 4, 8), LanePolicy(0.025, 4, 8)),
    [("submit", Lane.NORMAL, 5.0), ("submit", Lane.NORMAL, 0.004), ("advance", 0.0005), ("advance", 0.03)],
    [(False, "ok")],
    (1, 0),
    True,
    False,
)
# pinned: under urgent_fill=never a normal request that hurries rides an urgent batch on the last thread
@example(
    BatchPolicy(LanePolicy(0.002, 4, 8), LanePolicy(0.025, 4, 8), UrgentFill.NEVER),
    [("submit", Lane.NORMAL, 5.0), ("advance", 0.025), ("submit", Lane.NORMAL, 0.004)]
    + [("submit", Lane.URGENT, 5.0), ("release", 0), ("advance", 0.002), ("release", 1)],
    [(True, "ok")],
    (1, 0),
    True,
    False,
)
def test_every_interleaving_keeps_the_batcher_contract(
    policy: BatchPolicy,
    script: list[tuple[object, ...]],
    outcomes: list[tuple[bool, str]],
    in_flight: tuple[int, int],
    grace: bool,
    failing_observer: bool,
) -> None:
    asyncio.run(_play(policy, script, outcomes, in_flight, grace, failing_observer))
