"""The dual-window batcher: requests wait in two lanes and leave in batches.

One future per request, resolved exactly once: a ``Completed`` result, or an error. A
batch goes when its lane is full or its oldest request has waited the lane's window;
urgent batches go first and may take free seats from the head of the normal queue.
The dispatcher sleeps until the next event or window deadline; it never polls.
Requests whose future is already done (client gone, deadline passed), or whose deadline has
passed before its timer ran, are skipped when a batch forms and never reach the runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Generic, TypeVar

from app.batching.ceiling import Ceiling
from app.batching.clock import Clock, MonotonicClock
from app.batching.observer import BatchObserver, NullObserver
from app.batching.policy import BatchPlan, BatchPolicy, Lane, LaneState, fills, next_wakeup, plan_batch
from app.batching.queue import Completed, LaneQueue, Pending
from app.errors import BatchFailed, DeadlineExceeded, Draining, QueueFull, ServiceError, WouldMissDeadline

log = logging.getLogger(__name__)

# how long a refusal in the normal lane marks it as overloaded, for the urgent fill rule
REFUSING_S = 1.0

P = TypeVar("P")
R = TypeVar("R")

Runner = Callable[[Sequence[P]], Awaitable[Sequence[R]]]
"""Runs one batch: one output per input, in order. Raising fails exactly that batch."""


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
    ) -> None:
        """``computed(outputs)``: how many of a batch's requests the device computed (those gone
        before it reached the device are left out). A batch that computed none took no time and
        measures nothing; the memory ceiling climbs back on what the device ran, not on what
        the batcher sent. ``model_epoch()`` changes when the runner's model is replaced (a CPU
        fallback): the run times measured of the old one say nothing of the new one, and the
        batch the replacement loaded in took the load's seconds."""
        if max_in_flight < 1 or urgent_in_flight < 0:
            raise ValueError("max_in_flight must be at least 1, urgent_in_flight at least 0")
        self._runner = runner
        self._computed = computed
        self._model_epoch = model_epoch
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
        # with threads of their own for urgent batches (on a CPU), urgent requests that waited for
        # a busy one go without normal riders: an urgent request then waits for at most one long
        # (filled) batch, not for that one and then its own; except under the backlog rule while
        # it holds (see ``plan_batch``). (Without them, as on a GPU where a batch's time hardly
        # depends on its size, the seats fill as the rule says.)
        self._urgent_waited = False
        self._reserved = {Lane.URGENT: 0, Lane.NORMAL: 0}  # admitted, still on their way (decoding)
        self._arriving = 0  # admitted, their bodies still arriving: no seat, but a close waits for them
        self._ceiling = Ceiling(name)  # lowered under device memory pressure
        # moving estimates of one batch's run time, by the lane that formed it: with a thread
        # for urgent batches only (and the others niced), urgent batches run apart and faster,
        # and one estimate for both made normal waits look short and admitted too many
        self._batch_s: dict[Lane, float | None] = {Lane.URGENT: None, Lane.NORMAL: None}
        self._refused_at: float | None = None  # the normal lane's last refusal with requests ahead
        self.batches = 0

    @property
    def observer(self) -> BatchObserver:
        return self._observer

    @property
    def policy(self) -> BatchPolicy:
        return self._policy

    def set_policy(self, policy: BatchPolicy) -> None:
        """Takes effect from the next batch."""
        self._policy = policy
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

    def _effective_policy(self) -> BatchPolicy:
        return self._ceiling.cap(self._policy)

    def _idle(self, lane: Lane) -> bool:
        """Nothing admitted ahead of a request in ``lane`` and nothing running where it would:
        it waits for nothing but its own window and batch. Admission takes it whatever the
        estimates say: refused, it would leave them as they are, stale after one slow batch
        or one slow decode, and refusing everyone behind it for good."""
        if self._ahead_of(lane):
            return False
        if lane is Lane.URGENT and self._urgent_in_flight:
            return self._running[Lane.URGENT] == 0
        return not self._in_flight

    def batch_s(self, lane: Lane) -> float | None:
        """The moving estimate of a batch's run time in ``lane`` (the other lane's until it has one).

        A mean over the batches run, whatever their sizes. Pricing each batch by its size (a
        line fitted to sizes and times) was measured side by side at twice the load: at any
        headroom that kept admitted requests from expiring it answered 4-10% less, because a
        shorter queue made smaller, dearer batches (docs/performance.md, thirteenth pass).
        """
        other = Lane.NORMAL if lane is Lane.URGENT else Lane.URGENT
        return self._batch_s[lane] if self._batch_s[lane] is not None else self._batch_s[other]

    def observe_batch(self, lane: Lane, run_s: float) -> None:
        """Fold a batch's run time into its lane's moving estimate."""
        before = self._batch_s[lane]
        self._batch_s[lane] = run_s if before is None else 0.8 * before + 0.2 * run_s

    def predicted_wait(self, lane: Lane) -> float | None:
        """Seconds until a request submitted now to ``lane`` would be answered, if known.

        The requests ahead (urgent ones are ahead of everything), in batches, plus the batches
        running now, shared among the batches that run at once, times the measured batch
        latency, plus the lane's window.
        """
        if (batch_s := self.batch_s(lane)) is None:
            return None
        policy = self._effective_policy()
        # the batches ahead, each lane's requests in its own batch size (whole batches: those
        # of one lane may complete another's last)
        urgent, normal = policy.urgent.max_batch, policy.normal.max_batch
        if lane is Lane.URGENT:
            batches = self._ahead(Lane.URGENT) // urgent
        else:
            batches = (self._ahead(Lane.URGENT) * normal + self._ahead(Lane.NORMAL) * urgent) // (urgent * normal)
        if lane is Lane.URGENT and self._urgent_in_flight:  # urgent batches have threads of their own
            running, workers = self._running[Lane.URGENT], self._urgent_in_flight
        else:
            running, workers = len(self._in_flight), self._max_in_flight
            urgent_traffic = self._ahead(Lane.URGENT) > 0 or self._running[Lane.URGENT] > 0
            if urgent_traffic and fills(policy, self._ahead(Lane.NORMAL), self._max_in_flight, self._refusing()):
                workers += self._urgent_in_flight  # urgent batches fill from the normal queue: they drain it too
        rounds = (batches + running) // workers + 1
        return policy.lane(lane).window_s + rounds * batch_s

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

    def _seats_held(self) -> bool:
        return self._reserved[Lane.URGENT] > 0 or self._reserved[Lane.NORMAL] > 0 or self._arriving > 0

    def _ahead(self, lane: Lane) -> int:
        return self._queues[lane].waiting + self._reserved[lane]

    def _ahead_of(self, lane: Lane) -> int:
        """The requests a new one in ``lane`` would wait behind: urgent ones are ahead of all."""
        return self._ahead(Lane.URGENT) + (self._ahead(Lane.NORMAL) if lane is Lane.NORMAL else 0)

    def admit(
        self,
        lane: Lane,
        timeout_s: float,
        reserve: bool = False,
        upstream_s: float = 0.0,
        predict: bool = True,
        seated: bool = False,
        admitted: bool = False,
    ) -> None:
        """Refuse at once what cannot be served: closing, a full queue, a deadline out of reach.

        ``reserve`` holds a seat in the lane for a request admitted before its payload is
        ready (its image is being decoded): until ``release``, it counts in the queue's bound
        and in the wait predicted for those behind it, so a backlog upstream of the queue
        cannot slip past admission. ``upstream_s`` is how long the request is expected to take
        to reach the queue (its image waiting to be decoded behind others'): the predicted wait
        is the longer of the two stages, since they run side by side. ``seated``: it holds a seat
        already, taken before closing began: it is still taken while the batcher runs.
        ``admitted``: it was admitted before closing began, and held no seat meanwhile (its body
        was arriving): it is still taken while the batcher runs, if the lane has room for it now;
        refused by the close, it is not counted here: its caller may route it to another version.
        """
        earlier = seated or admitted
        if not self._accepting and not (earlier and self.running):
            if seated:  # its image decoded, and the close's grace ran out while it was on the way
                self._observer.on_dropped(lane, "cancelled")
            raise Draining("the service is shutting down")
        if timeout_s <= 0:
            if earlier:  # admitted earlier, and its deadline passed on the way (its body, its decode)
                self._observer.on_dropped(lane, "deadline")
            else:
                self._observer.on_rejected(lane, "deadline_exceeded")
            raise DeadlineExceeded("the request's deadline passed before it was queued")
        # a seated request was counted against the bound when it took its seat: a bound lowered
        # since (a policy change) refuses new requests, not one whose image is decoded already
        if not seated and self._ahead(lane) >= self._policy.lane(lane).max_queue:
            self._refuse(lane, "queue_full")
            raise QueueFull(f"the {lane.value} queue is full")
        # None until a batch has been timed: no estimate, no refusal. With nothing ahead of it
        # in the batcher, its wait is its window and the decodes ahead of it, if any: no batch
        # estimate refuses it (it is the probe that keeps those current)
        batch_s = self.batch_s(lane) if predict else None
        wait = None
        if batch_s is not None:
            window = self._effective_policy().lane(lane).window_s
            wait = window if self._idle(lane) else (self.predicted_wait(lane) or window)
            if upstream_s > 0:  # the images ahead of it in the decode threads, then its own batch
                wait = max(wait, upstream_s + window + batch_s)
        if wait is not None and wait > self._policy.admission_headroom * timeout_s:
            self._refuse(lane, "would_miss_deadline")
            raise WouldMissDeadline(self._miss_message(lane, wait, timeout_s), retry_after_s=max(1, math.ceil(wait)))
        if reserve:
            self._reserved[lane] += 1

    def _refuse(self, lane: Lane, reason: str) -> None:
        """Count a request turned away; with requests ahead of it in the normal lane, that lane is
        behind as far as admission lets it be (one refused for its own short deadline alone says
        nothing of load)."""
        self._observer.on_rejected(lane, reason)
        if lane is Lane.NORMAL and self._ahead(Lane.NORMAL):
            self._refused_at = self._clock.now()

    def _refusing(self) -> bool:
        """The normal lane refused a request with others ahead of it within ``REFUSING_S``."""
        return self._refused_at is not None and self._clock.now() - self._refused_at < REFUSING_S

    def _miss_message(self, lane: Lane, wait: float, timeout_s: float) -> str:
        headroom = self._policy.admission_headroom
        said = f"predicted wait {wait * 1000:.0f} ms"
        if headroom < 1:
            said += f" is over {headroom:g} of the {timeout_s * 1000:.0f} ms deadline (batching.admission_headroom)"
        else:
            said += f" exceeds the deadline of {timeout_s * 1000:.0f} ms"
        if self._idle(lane):  # nothing ahead: the lane's window alone is too long for this deadline
            window_ms = self._effective_policy().lane(lane).window_s * 1000
            said += f"; the {lane.value} lane's window alone is {window_ms:g} ms"
        return said

    def release(self, lane: Lane) -> None:
        """A seat ``admit(reserve=True)`` held is free again (the request is submitted, or failed)."""
        self._reserved[lane] -= 1
        if not self._accepting:
            self._wakeup.set()  # closing: the dispatcher ends once no seat is held either

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Held while an admitted request's body arrives: it takes no seat (a stalled upload must
        not fill the lane or lengthen the predicted wait), but a close waits for it, its grace
        allowing, as for a request queued: admitted, it is served if its body comes in time."""
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1
            if not self._accepting:
                self._wakeup.set()  # closing: the dispatcher ends once nothing is on its way either

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def depth(self, lane: Lane) -> int:
        """What ``max_queue`` bounds: the requests queued, and the seats held for those still
        being read or decoded."""
        return self._ahead(lane)

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
        self.admit(lane, timeout_s, predict=not admitted, seated=admitted)
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
        queue.waiting += 1
        self._wakeup.set()
        return future

    def _expire(self, item: Pending[P, R]) -> None:
        if not item.future.done():
            item.future.set_exception(DeadlineExceeded("the request's deadline passed before it was computed"))

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
                policy = self._effective_policy()
                plan = self._plan(u_state, n_state, policy)
                if plan is not None and self._may_start(plan.lane):
                    if (batch := self._form(plan)) is not None:
                        self._start_batch(plan, batch)
                    continue
                if not self._accepting and u_state.waiting == 0 and n_state.waiting == 0 and not self._seats_held():
                    break  # nothing queued, and nothing admitted still on its way (a body, a decode)
                urgent_free = self._may_start(Lane.URGENT)
                if plan is None:  # with the urgent threads busy, only the normal lane's window can wake it
                    wake = next_wakeup(u_state if urgent_free else LaneState(), n_state, policy)
                elif u_state.oldest_at is not None and urgent_free:
                    wake = u_state.oldest_at + policy.urgent.window_s  # a normal batch waits; urgent ones need not
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
        now, backlog, upstream = self._clock.now(), self._max_in_flight, self._reserved[Lane.NORMAL]
        riders = not self._urgent_waited
        # an urgent batch on the last worker the normal lane shares with it takes its turn
        shared_last = not self._urgent_in_flight and len(self._in_flight) + 1 >= self._max_in_flight
        refusing = self._refusing()  # the normal lane turns requests away: one batch's backlog fills
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
        capacity = self._effective_policy().lane(plan.lane).max_batch
        task = asyncio.get_running_loop().create_task(self._execute(plan, batch, capacity), name=f"{self._name}-batch")
        self._in_flight.add(task)
        self._running[plan.lane] += 1
        task.add_done_callback(functools.partial(self._batch_done, plan.lane))

    def _batch_done(self, lane: Lane, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        self._running[lane] -= 1
        self._wakeup.set()

    async def _execute(self, plan: BatchPlan, batch: list[Pending[P, R]], capacity: int) -> None:
        started = self._clock.now()
        epoch = self._model_epoch()
        self.batches += 1
        try:
            outputs = await self._runner([item.payload for item in batch])
            if len(outputs) != len(batch):
                raise BatchFailed(f"runner returned {len(outputs)} outputs for {len(batch)} inputs")
        except asyncio.CancelledError:  # closing ran out of grace mid-batch
            self._cut_off(batch, Draining("the service shut down while this request ran"))
            return
        except ServiceError as exc:
            error: BaseException = exc
        except Exception as exc:  # a bug in the runner: fail exactly this batch, keep serving
            error = self._bug(batch, exc)
        except BaseException as exc:  # an abort through the runner: its requests are answered, then it goes on up
            self._fail(batch, self._bug(batch, exc))
            raise
        else:
            run_s = self._clock.now() - started
            for item, output in zip(batch, outputs, strict=True):
                if not item.future.done():
                    item.future.set_result(
                        Completed(output, item.lane, plan.lane, len(batch), started - item.enqueued_at, run_s)
                    )
            try:  # answered first: a failure in what is counted after must not cost them their answers
                self._after_success(plan, batch, outputs, started, run_s, capacity, epoch)
            except Exception:
                log.exception("counting a batch of %d that ran failed in %s", len(batch), self._name)
            return
        self._fail(batch, error)
        try:  # answered first, as a batch that ran is
            self._report(plan, batch, started, self._clock.now() - started, capacity, ok=False)
        except Exception:
            log.exception("counting a batch of %d that failed failed in %s", len(batch), self._name)

    def _bug(self, batch: Sequence[Pending[P, R]], exc: BaseException) -> BatchFailed:
        """The error a batch's requests get for what the runner raised that is no service error: a
        generic one (their 500 shows no internals), the detail logged once for the batch."""
        log.error("batch of %d failed in %s", len(batch), self._name, exc_info=exc)
        error = BatchFailed("inference failed")
        error.__cause__, error.logged = exc, True
        return error

    def _after_success(
        self,
        plan: BatchPlan,
        batch: Sequence[Pending[P, R]],
        outputs: Sequence[R],
        started: float,
        run_s: float,
        capacity: int,
        epoch: object,
    ) -> None:
        """A batch ran: its time in the estimates, its report, and the ceiling's recovery."""
        computed = self._computed(outputs)
        if self._model_epoch() != epoch:  # another model now: estimates start again, from its batches
            self._batch_s = {Lane.URGENT: None, Lane.NORMAL: None}
            self._ceiling.reset()  # and the old device's memory pressure no longer caps them
        elif computed:
            self.observe_batch(plan.lane, run_s)
        self._report(plan, batch, started, run_s, capacity, ok=True)
        self._ceiling.calm(computed, self._policy)

    def _report(
        self, plan: BatchPlan, batch: Sequence[Pending[P, R]], started: float, run_s: float, capacity: int, ok: bool
    ) -> None:
        waits = [(item.lane, started - item.enqueued_at) for item in batch]
        self._observer.on_batch(plan.lane, len(batch), capacity, waits, run_s, ok)

    @staticmethod
    def _fail(batch: Sequence[Pending[P, R]], error: BaseException) -> None:
        for item in batch:
            if not item.future.done():
                item.future.set_exception(error)

    def _cut_off(self, items: Sequence[Pending[P, R]], error: BaseException) -> None:
        """Fail the requests the close leaves uncomputed, and count each once: taken from the queue
        or cut off on the device, nothing else will (``_settled`` skips what was taken, and the
        device counts only what it ran). One already gone (its client, its deadline) counts so."""
        for item in items:
            if not item.future.done():
                item.future.set_exception(error)
                self._observer.on_dropped(item.lane, "cancelled")
            elif item.future.cancelled():
                self._observer.on_dropped(item.lane, "cancelled")
            elif isinstance(item.future.exception(), DeadlineExceeded):
                self._observer.on_dropped(item.lane, "deadline")

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
                self._cut_off(taken, Draining("the service shut down before this request ran"))
