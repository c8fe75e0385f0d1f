"""The dual-window batcher: requests wait in two lanes and leave in batches.

One future per request, resolved exactly once: a ``Completed`` result, or an error. A
batch goes when its lane is full or its oldest request has waited the lane's window;
urgent batches go first and may take free seats from the head of the normal queue.
The dispatcher sleeps until the next event or window deadline; it never polls.
Requests whose future is already done (client gone, deadline passed), or whose deadline has
passed before its timer ran, are skipped when a batch forms and never reach the runner.
What may enter a lane, and what it is predicted to wait, its ``Intake`` decides; its
``Execution`` runs each batch and answers its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from app.batching.ceiling import Ceiling
from app.batching.clock import TIMER_RESOLUTION_S, Clock, MonotonicClock
from app.batching.execution import BATCH_RAN_PAST, Execution, Runner
from app.batching.intake import Intake
from app.batching.observer import BatchObserver, NullObserver
from app.batching.policy import (
    BatchPlan,
    BatchPolicy,
    Lane,
    LaneState,
    hurries,
    next_wakeup,
    plan_batch,
    ready_at,
)
from app.batching.queue import Completed, LaneQueue, Pending
from app.errors import DeadlineExceeded, Draining

P = TypeVar("P")
R = TypeVar("R")


class DualWindowBatcher(Generic[P, R]):
    """Groups submitted payloads into batches for ``runner``, urgent lane first."""

    def __init__(
        self,
        runner: Runner[P, R],
        policy: BatchPolicy,
        *,
        clock: Clock | None = None,
        observer: BatchObserver | None = None,
        name: str = "batcher",
        max_in_flight: int = 1,
        urgent_in_flight: int = 0,
        computed: Callable[[Sequence[R]], int] = len,
        model_epoch: Callable[[], int] = lambda: 0,
        ceiling_ready: Callable[[int], bool] | None = None,
    ) -> None:
        """``computed(outputs)``: how many of a batch's requests the device computed (those gone
        before it reached the device are left out). A batch that computed none took no time and
        measures nothing; the memory ceiling climbs back on what the device ran, not on what
        the batcher sent. ``model_epoch()`` changes when the runner's model is replaced (a CPU
        fallback): the run times measured of the old one say nothing of the new one, and the
        batch the replacement loaded in took the load's seconds. ``ceiling_ready(size)``: whether
        the memory ceiling may rise to ``size`` now (see ``Ceiling``)."""
        if max_in_flight < 1 or urgent_in_flight < 0:
            raise ValueError("max_in_flight must be at least 1, urgent_in_flight at least 0")
        self._max_in_flight = max_in_flight
        self._urgent_in_flight = urgent_in_flight  # more batches in flight, for urgent batches only
        self._observer: BatchObserver = observer or NullObserver()
        self._policy = policy
        self._clock: Clock = clock or MonotonicClock()
        self._name = name
        self._queues: dict[Lane, LaneQueue[P, R]] = {Lane.URGENT: LaneQueue(), Lane.NORMAL: LaneQueue()}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._accepting = False
        self._flush = False
        self._in_flight: set[asyncio.Task[None]] = set()  # batches handed to the runner
        self._running = {Lane.URGENT: 0, Lane.NORMAL: 0}  # of those, by the lane that formed them
        # each lane's batch estimate when its queue was last looked over for requests that hurry
        self._hurry_basis: dict[Lane, float | None] = {Lane.URGENT: None, Lane.NORMAL: None}
        # with threads of their own for urgent batches (on a CPU), urgent requests that waited for
        # a busy one go without normal riders: an urgent request then waits for at most one long
        # (filled) batch, not for that one and then its own; except under the backlog rule while
        # it holds (see ``plan_batch``). (Without them, as on a GPU where a batch's time hardly
        # depends on its size, the seats fill as the rule says.)
        self._urgent_waited = False
        self._ceiling = Ceiling(name, ready=ceiling_ready)  # lowered under device memory pressure
        self._intake = Intake(self, self._observer, self._clock, self._wakeup)
        self._execution = Execution(
            runner,
            clock=self._clock,
            observer=self._observer,
            intake=self._intake,
            ceiling=self._ceiling,
            policy=lambda: self._policy,
            name=name,
            computed=computed,
            model_epoch=model_epoch,
        )

    @property
    def observer(self) -> BatchObserver:
        return self._observer

    @property
    def batches(self) -> int:
        """The batches handed to the runner so far (counted as each starts to run)."""
        return self._execution.batches

    @property
    def intake(self) -> Intake:
        """Admission to the lanes: refusals, predicted waits, and the seats held for requests on their way."""
        return self._intake

    @property
    def policy(self) -> BatchPolicy:
        return self._policy

    def set_policy(self, policy: BatchPolicy) -> None:
        """Takes effect from the next batch."""
        self._policy = policy
        self._rehurry()  # a longer window: a deadline that waited it out may not any more
        self._wakeup.set()

    @property
    def ceiling(self) -> int | None:
        """The batch size cap set by memory pressure, if any."""
        return self._ceiling.value

    @property
    def recovery_batches(self) -> int:
        return self._ceiling.recovery_batches

    @recovery_batches.setter
    def recovery_batches(self, batches: int) -> None:
        self._ceiling.recovery_batches = batches

    def lower_ceiling(self, failed_size: int) -> None:
        """A batch of ``failed_size`` ran out of device memory: cap batches below it."""
        self._ceiling.lower(failed_size)
        self._wakeup.set()  # a lane may be full at the new cap: it goes now, not at its window

    def effective_policy(self) -> BatchPolicy:
        """The policy with its batch sizes capped by the ceiling: what batches form under."""
        return self._ceiling.cap(self._policy)

    def _may_start(self, lane: Lane) -> bool:
        """A batch formed by ``lane`` may go now. Normal batches go while fewer than
        ``max_in_flight`` batches of either lane run: on a CPU that is the cores' worth, and an
        urgent batch running takes a core too (letting a normal batch go beside it anyway made
        three forward passes on two cores, and cost a sixth more CPU per request). Urgent
        batches go while their own threads (``urgent_in_flight``) have room, or, without any,
        as normal ones do."""
        if lane is Lane.URGENT and self._urgent_in_flight:
            return self._running[Lane.URGENT] < self._urgent_in_flight
        return len(self._in_flight) < self._max_in_flight

    @property
    def max_in_flight(self) -> int:
        """Batches of either lane that may run at once."""
        return self._max_in_flight

    @property
    def urgent_in_flight(self) -> int:
        """More batches that may run at once, urgent ones only (threads of their own)."""
        return self._urgent_in_flight

    @property
    def accepting(self) -> bool:
        """Taking new requests: started, and not closing."""
        return self._accepting

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def batches_running(self, lane: Lane | None = None) -> int:
        """The batches handed to the runner and not yet done: those ``lane`` formed, or all."""
        return len(self._in_flight) if lane is None else self._running[lane]

    def depth(self, lane: Lane) -> int:
        """What ``max_queue`` bounds: the requests queued, and the seats held for those still
        being read or decoded."""
        return self._intake.ahead(lane)

    def queued(self, lane: Lane) -> int:
        """The requests in the queue itself, waiting for a batch."""
        return self._queues[lane].waiting

    def start(self) -> None:
        """Start dispatching. The dispatcher and its batches run in a context of their own: started
        while a request is served (a version loaded through the admin API), they would otherwise
        carry that request's id and trace for as long as they run."""
        if self._task is not None:
            raise RuntimeError("batcher already started")
        self._accepting = True
        self._task = asyncio.get_running_loop().create_task(
            self._dispatch(), name=f"{self._name}-dispatch", context=contextvars.Context()
        )

    async def submit(self, payload: P, lane: Lane, timeout_s: float, admitted: bool = False) -> Completed[R]:
        """Queue ``payload`` and wait for its answer.

        Raises ``QueueFull`` at once when the lane is at its bound, ``DeadlineExceeded``
        when ``timeout_s`` passes before the batch runs, ``Draining`` once closing began, and
        ``WouldMissDeadline`` when its predicted wait is longer than ``timeout_s``, unless it was
        ``admitted`` already (its seat was held upstream, its image decoded: that work is done,
        and it is given its chance; past its deadline it still leaves uncomputed).
        Cancelling the caller cancels the request: it leaves the queue uncomputed.
        """
        self._intake.admit(lane, timeout_s, predict=not admitted, seated=admitted)
        future = self._enqueue(payload, lane, timeout_s)
        try:
            return await future
        finally:
            if not future.done():  # our caller was cancelled: drop the request
                future.cancel()
            # raised, the future's exception has this frame in its traceback: holding the future
            # here would tie the two into a cycle, left to the cyclic collector
            del future

    def _enqueue(self, payload: P, lane: Lane, timeout_s: float) -> asyncio.Future[Completed[R]]:
        """Queue ``payload`` with its deadline's timer; the future its batch settles."""
        queue = self._queues[lane]
        now = self._clock.now()
        future: asyncio.Future[Completed[R]] = asyncio.get_running_loop().create_future()
        item: Pending[P, R] = Pending(payload, lane, now, future, now + timeout_s)
        item.timer = self._clock.call_at(item.deadline, lambda: self._expire(item))
        future.add_done_callback(lambda _: self._settled(item))
        queue.items.append(item)
        if hurries(timeout_s, self.effective_policy().lane(lane).window_s, self._intake.batch_s(lane)):
            queue.hurry(item)  # its lane's batch goes at once
        queue.waiting += 1
        self._wakeup.set()
        return future

    def _expire(self, item: Pending[P, R]) -> None:
        if item.future.done():
            return
        if (early := item.deadline - self._clock.now()) > 0:
            # its timer ran early: uvloop's timers count whole milliseconds, and a third of them ran up
            # to one early. Answered then, a request in a batch waiting for the device was still computed
            # there (the device checks the deadline itself), for nobody. Armed again for what is left, a
            # millisecond at least: uvloop runs a shorter delay at once, and the loop would spin
            item.timer = self._clock.call_at(
                self._clock.now() + max(early, TIMER_RESOLUTION_S), lambda: self._expire(item)
            )
            return
        why = BATCH_RAN_PAST if item.batched else "the request's deadline passed before it was computed"
        item.future.set_exception(DeadlineExceeded(why))

    def _settled(self, item: Pending[P, R]) -> None:
        if item.timer is not None:
            item.timer.cancel()
            item.timer = None  # its callback holds the item: let go of it whatever the clock's timers keep
        if not item.batched:  # it left before being batched: cancelled by its caller, or expired
            reason = "cancelled" if item.future.cancelled() else "deadline"
            self._observer.on_dropped(item.lane, reason)
        self._queues[item.lane].drop(item)

    async def _dispatch(self) -> None:
        urgent, normal = self._queues[Lane.URGENT], self._queues[Lane.NORMAL]
        try:
            while True:
                self._wakeup.clear()
                self._track_urgent_wait(urgent.waiting)
                if not (self._may_start(Lane.URGENT) or self._may_start(Lane.NORMAL)):
                    await self._wakeup.wait()  # a batch finishing sets it
                    continue
                u_state, n_state = urgent.state(), normal.state()
                policy = self.effective_policy()
                plan = self._plan(u_state, n_state, policy)
                if plan is not None and self._may_start(plan.lane):
                    if (batch := self._form(plan)) is not None:
                        self._start_batch(plan, batch)
                    continue
                if not (self._accepting or u_state.waiting or n_state.waiting or self._intake.seats_held()):
                    break  # nothing queued, and nothing admitted still on its way (a body, a decode)
                urgent_free = self._may_start(Lane.URGENT)
                if plan is None:  # with the urgent threads busy, only the normal lane's window can wake it
                    wake = next_wakeup(u_state if urgent_free else LaneState(), n_state, policy)
                elif u_state.oldest_at is not None and urgent_free:
                    wake = ready_at(u_state, policy.urgent)  # a normal batch waits; urgent ones need not
                else:
                    wake = None  # a batch finishing, or a request coming, wakes it
                await self._clock.wait(self._wakeup, None if wake is None else wake - self._clock.now())
            while self._in_flight:  # closing: the last batches finish before the batcher is done
                await asyncio.wait(set(self._in_flight))
        finally:  # cancelled (closing ran out of grace): so are the batches still running
            for task in list(self._in_flight):
                task.cancel()
            if self._in_flight:
                await asyncio.wait(set(self._in_flight))

    def _form(self, plan: BatchPlan) -> list[Pending[P, R]] | None:
        """The plan's requests; ``None`` when some turned out past their deadline though their timer
        has not run yet (a busy loop runs timers late, and the dispatcher may run first). Those are
        answered now, uncomputed, and the rest go back: the plan counted the late ones (their lane
        full, its window closed for its oldest), and is made again without them."""
        urgent, normal = self._queues[Lane.URGENT], self._queues[Lane.NORMAL]
        now = self._clock.now()
        from_urgent, late_urgent = urgent.take(plan.from_urgent, now)
        from_normal, late_normal = normal.take(plan.from_normal, now)
        if not late_urgent and not late_normal:
            if from_normal:
                self._intake.took_normal(len(from_normal))
            return from_urgent + from_normal
        urgent.restore(from_urgent)
        normal.restore(from_normal)
        for item in late_urgent + late_normal:
            self._expire(item)
        return None

    def _track_urgent_wait(self, waiting: int) -> None:
        if not waiting:  # those that waited are gone (taken, expired, cancelled)
            self._urgent_waited = False
        elif self._urgent_in_flight and not self._may_start(Lane.URGENT):
            self._urgent_waited = True  # these urgent requests wait for a busy urgent thread

    def _plan(self, u_state: LaneState, n_state: LaneState, policy: BatchPolicy) -> BatchPlan | None:
        """The batch the rules pick now; a normal one when the urgent threads are busy."""
        now, backlog, upstream = self._clock.now(), self._max_in_flight, self._intake.reserved(Lane.NORMAL)
        riders = not self._urgent_waited
        # an urgent batch on the last worker the normal lane shares with it takes its turn
        shared_last = not self._urgent_in_flight and len(self._in_flight) + 1 >= self._max_in_flight
        refusing = self._intake.refusing()  # the normal lane turns requests away: one batch's backlog fills
        plan = plan_batch(u_state, n_state, policy, now, self._flush, backlog, riders, upstream, shared_last, refusing)
        if plan is not None and plan.lane is Lane.URGENT and not self._may_start(Lane.URGENT):
            # the urgent threads are busy: a ready normal batch need not wait for them
            plan = plan_batch(LaneState(), n_state, policy, now, self._flush, backlog_batches=backlog)
        return plan

    def _start_batch(self, plan: BatchPlan, batch: list[Pending[P, R]]) -> None:
        if not batch:
            return
        if plan.lane is Lane.URGENT:
            self._urgent_waited = False
        # the fill it is reported against is that of the policy it formed under, not of one set while it runs
        capacity = self.effective_policy().lane(plan.lane).max_batch
        task = asyncio.get_running_loop().create_task(
            self._execution.run(plan, batch, capacity), name=f"{self._name}-batch"
        )
        self._in_flight.add(task)
        self._running[plan.lane] += 1
        task.add_done_callback(functools.partial(self._batch_done, plan.lane))

    def _batch_done(self, lane: Lane, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        self._running[lane] -= 1
        self._rehurry(estimates_only=True)
        self._wakeup.set()

    def _rehurry(self, estimates_only: bool = False) -> None:
        """Mark the queued requests that hurry now, though they did not when they came: their lane's
        window is longer now (a policy change), or its batch estimate is new (the lane's first batch
        timed) or twice what it was at the last look. An estimate rising less than that leaves a
        request that did not hurry at least two batch runs to spare after its window (``hurries``
        asks four): that many looks, each over the queue, are not worth the batches' time."""
        now = self._clock.now()
        for lane, queue in self._queues.items():
            batch_s, basis = self._intake.batch_s(lane), self._hurry_basis[lane]
            if estimates_only and (batch_s is None or (basis is not None and batch_s <= 2 * basis)):
                continue
            self._hurry_basis[lane] = batch_s
            if queue.hurried == queue.waiting:  # none waiting, or each hurries already
                continue
            window_s = self.effective_policy().lane(lane).window_s
            for item in queue.items:
                if item.queued and not item.hurried and hurries(item.deadline - now, window_s, batch_s):
                    queue.hurry(item)

    @property
    def cut_off(self) -> int:
        """The requests a close has answered uncomputed so far (queued or running when its grace ran out)."""
        return self._execution.cut

    async def close(self, grace_s: float | None = None) -> None:
        """Stop taking requests, run what is queued for up to ``grace_s`` (``None``: no limit), fail the rest."""
        self._accepting = False
        self._flush = True  # windows no longer matter: everything queued goes now
        self._wakeup.set()
        if self._task is None:
            return
        try:
            _, pending = await asyncio.wait({self._task}, timeout=grace_s)
            if pending:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        finally:
            now = self._clock.now()
            for queue in self._queues.values():
                taken, late = queue.take(queue.waiting, now)
                for item in late:  # past its deadline first: that is its answer, as it would have been served
                    self._expire(item)
                self._execution.cut_off(taken, Draining("the service shut down before this request ran"))
