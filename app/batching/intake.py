"""The batcher's intake: whether a request may enter a lane, and what it is predicted to wait.

Admission at the batcher itself: closing, the lanes' bounds, a deadline out of reach by the
predicted wait. It holds the seats of requests admitted and still on their way to the queue
(a body arriving, an image decoding: ``app.admission`` keeps the decode backlog those wait in),
and the moving estimates of a batch's run time that the predicted wait is made of. What is
queued and running it reads from the batcher behind it (``Dispatcher``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterator
from typing import Protocol

from app.batching.clock import Clock
from app.batching.moving import Pace
from app.batching.observer import BatchObserver
from app.batching.policy import BatchPolicy, Lane, fills, hurries
from app.errors import DeadlineExceeded, Draining, QueueFull, WouldMissDeadline

# how long a refusal in the normal lane marks it as overloaded, for the urgent fill rule
REFUSING_S = 1.0
# what the normal lane's drain rate remembers, in seconds: a few dozen batches at twice the load
DRAIN_MEMORY_S = 2.0


class Dispatcher(Protocol):
    """What the intake reads of the batcher behind it."""

    @property
    def accepting(self) -> bool: ...

    @property
    def running(self) -> bool: ...

    @property
    def policy(self) -> BatchPolicy: ...

    def effective_policy(self) -> BatchPolicy: ...

    def queued(self, lane: Lane) -> int: ...

    def batches_running(self, lane: Lane | None = None) -> int: ...

    @property
    def max_in_flight(self) -> int: ...

    @property
    def urgent_in_flight(self) -> int: ...


class Intake:
    """Admits requests to the lanes of ``dispatcher`` or refuses them at once, and holds the seats
    of those admitted and not yet queued."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        observer: BatchObserver,
        clock: Clock,
        wakeup: asyncio.Event,
    ) -> None:
        """``wakeup`` is the dispatcher's: set when, closing, the last seat held is given back."""
        self._dispatcher = dispatcher
        self._observer = observer
        self._clock = clock
        self._wakeup = wakeup
        self._reserved = {Lane.URGENT: 0, Lane.NORMAL: 0}  # admitted, still on their way (decoding)
        self._arriving = 0  # admitted, their bodies still arriving: no seat, but a close waits for them
        # moving estimates of one batch's run time, by the lane that formed it: with a thread
        # for urgent batches only (and the others niced), urgent batches run apart and faster,
        # and one estimate for both made normal waits look short and admitted too many
        self._batch_s: dict[Lane, float | None] = {Lane.URGENT: None, Lane.NORMAL: None}
        self._refused_at: float | None = None  # the normal lane's last refusal with requests ahead
        # the normal lane's drain while it is behind (a full batch left after each take): the
        # requests each take drew from it over the seconds since the take before
        self._drain = Pace(DRAIN_MEMORY_S, clock.now)
        self._behind_at: float | None = None  # the last take that left a full batch behind

    def _idle(self, lane: Lane) -> bool:
        """Nothing admitted ahead of a request in ``lane`` and nothing running where it would:
        it waits for nothing but its own window and batch. Admission takes it whatever the
        estimates say: refused, it would leave them as they are, stale after one slow batch
        or one slow decode, and refusing everyone behind it for good."""
        if self._ahead_of(lane):
            return False
        if lane is Lane.URGENT and self._dispatcher.urgent_in_flight:
            return self._dispatcher.batches_running(Lane.URGENT) == 0
        return not self._dispatcher.batches_running()

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

    def forget_batches(self) -> None:
        """Another model runs the batches now: the estimates start again, from its batches."""
        self._batch_s = {Lane.URGENT: None, Lane.NORMAL: None}
        self._drain = Pace(DRAIN_MEMORY_S, self._clock.now)
        self._behind_at = None

    def took_normal(self, taken: int) -> None:
        """``taken`` normal requests left the queue for a batch (of either lane). Timed from the
        take before, while that one left a full batch behind: the lane was behind all along, and
        the pace it drained at was the service's, not the clients'."""
        now = self._clock.now()
        if self._behind_at is not None:
            self._drain.add(taken, now - self._behind_at)
        behind = self.ahead(Lane.NORMAL) >= self._dispatcher.effective_policy().normal.max_batch
        self._behind_at = now if behind else None

    def drain_rate(self) -> float | None:
        """Normal requests a second the batches drew from the normal queue while it was behind,
        over about the last ``DRAIN_MEMORY_S``; None until measured, and once no take has been
        timed for ``DRAIN_MEMORY_S``. A pace measured in a stall (a collection, a reload) would
        otherwise price every request with a full batch ahead out of its deadline for good:
        admission would keep the queue under a full batch, and no take would be timed again."""
        return self._drain.rate()

    def predicted_wait(self, lane: Lane, window: bool = True) -> float | None:
        """Seconds until a request submitted now to ``lane`` would be answered, if known.

        The requests ahead (urgent ones are ahead of everything), in batches, plus the batches
        running now, shared among the batches that run at once, times the measured batch
        latency, plus the lane's window (unless ``window`` is false: a request that hurries, whose
        lane's window closes early for it). A normal request with a full batch ahead of it waits
        at least for the batches ahead to be drawn at the pace the lane was drawn at while behind,
        then its own batch's run.
        """
        if (batch_s := self.batch_s(lane)) is None:
            return None
        policy = self._dispatcher.effective_policy()
        # the batches ahead, each lane's requests in its own batch size (whole batches: those
        # of one lane may complete another's last)
        urgent, normal = policy.urgent.max_batch, policy.normal.max_batch
        if lane is Lane.URGENT:
            batches = self.ahead(Lane.URGENT) // urgent
        else:
            batches = (self.ahead(Lane.URGENT) * normal + self.ahead(Lane.NORMAL) * urgent) // (urgent * normal)
        dispatcher = self._dispatcher
        if lane is Lane.URGENT and dispatcher.urgent_in_flight:  # urgent batches have threads of their own
            running, workers = dispatcher.batches_running(Lane.URGENT), dispatcher.urgent_in_flight
        else:
            running, workers = dispatcher.batches_running(), dispatcher.max_in_flight
            urgent_traffic = self.ahead(Lane.URGENT) > 0 or dispatcher.batches_running(Lane.URGENT) > 0
            if urgent_traffic and fills(policy, self.ahead(Lane.NORMAL), dispatcher.max_in_flight, self.refusing()):
                workers += dispatcher.urgent_in_flight  # urgent batches fill from the normal queue: they drain it too
        rounds = (batches + running) // workers + 1
        wait = (policy.lane(lane).window_s if window else 0.0) + rounds * batch_s
        behind = lane is Lane.NORMAL and self.ahead(Lane.NORMAL) >= normal
        if behind and (rate := self.drain_rate()) is not None:
            # behind, the queue drains at the pace measured: the batches' run times and the
            # seats' count above leave out what else takes the device threads' turns (urgent
            # batches run in a normal batch's seat, the event loop's turn between two batches)
            wait = max(wait, math.ceil((self.ahead(Lane.NORMAL) + 1) / normal) * normal / rate + batch_s)
        return wait

    def seats_held(self) -> bool:
        return self._reserved[Lane.URGENT] > 0 or self._reserved[Lane.NORMAL] > 0 or self._arriving > 0

    def reserved(self, lane: Lane) -> int:
        """The seats held in ``lane`` for requests admitted and still on their way (decoding)."""
        return self._reserved[lane]

    def ahead(self, lane: Lane) -> int:
        """The requests in ``lane`` a new one would wait behind, and what ``max_queue`` bounds."""
        return self._dispatcher.queued(lane) + self._reserved[lane]

    def _ahead_of(self, lane: Lane) -> int:
        """The requests a new one in ``lane`` would wait behind: urgent ones are ahead of all."""
        return self.ahead(Lane.URGENT) + (self.ahead(Lane.NORMAL) if lane is Lane.NORMAL else 0)

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
        if not self._dispatcher.accepting and not (earlier and self._dispatcher.running):
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
        if not seated and self.ahead(lane) >= self._dispatcher.policy.lane(lane).max_queue:
            self._refuse(lane, "queue_full")
            raise QueueFull(f"the {lane.value} queue is full")
        # None until a batch has been timed: no estimate, no refusal. With nothing ahead of it
        # in the batcher, its wait is its window and the decodes ahead of it, if any: no batch
        # estimate refuses it (it is the probe that keeps those current)
        batch_s = self.batch_s(lane) if predict else None
        wait, allowed = None, self._dispatcher.policy.admission_headroom * timeout_s
        if batch_s is not None:
            window = self._dispatcher.effective_policy().lane(lane).window_s
            # a deadline too short to wait out the window closes it early: the wait is the batches'
            window = 0.0 if hurries(timeout_s, window, batch_s) else window
            if self._idle(lane) and upstream_s <= 0:
                # nothing ahead: its window and its own batch, no estimate of others' that the
                # headroom must allow for (with it, a deadline under twice the window was refused
                # on an idle server, and told to retry a request no retry would serve)
                wait, allowed = window + batch_s, timeout_s
            else:
                wait = self.predicted_wait(lane, window=window > 0) or window
            if upstream_s > 0:  # the images ahead of it in the decode threads, then its own batch
                wait = max(wait, upstream_s + window + batch_s)
        if wait is not None and wait > allowed:
            self._refuse(lane, "would_miss_deadline")
            message = self._miss_message(lane, wait, timeout_s, upstream_s)
            raise WouldMissDeadline(message, retry_after_s=max(1, math.ceil(wait)))
        if reserve:
            self._reserved[lane] += 1

    def _refuse(self, lane: Lane, reason: str) -> None:
        """Count a request turned away; with requests ahead of it in the normal lane, that lane is
        behind as far as admission lets it be (one refused for its own short deadline alone says
        nothing of load)."""
        self._observer.on_rejected(lane, reason)
        if lane is Lane.NORMAL and self.ahead(Lane.NORMAL):
            self._refused_at = self._clock.now()

    def refusing(self) -> bool:
        """The normal lane refused a request with others ahead of it within ``REFUSING_S``."""
        return self._refused_at is not None and self._clock.now() - self._refused_at < REFUSING_S

    def _miss_message(self, lane: Lane, wait: float, timeout_s: float, upstream_s: float) -> str:
        headroom = self._dispatcher.policy.admission_headroom
        said, deadline = f"predicted wait {_ms(wait)}", _ms(timeout_s)
        if self._idle(lane) and upstream_s <= 0:  # nothing ahead, and it hurries: its own batch is too long
            return (
                f"{said} exceeds the deadline of {deadline}: nothing is ahead of it, but "
                f"a batch of the {lane.value} lane takes about {_ms(wait)} to run"
            )
        if headroom < 1:  # (the idle lane's own batch, above, is allowed the whole deadline)
            why = f"{said} is over {headroom:g} of the {deadline} deadline (batching.admission_headroom)"
        else:
            why = f"{said} exceeds the deadline of {deadline}"
        if upstream_s > 0:
            why += f": the images ahead of it take about {_ms(upstream_s)} to decode, then its batch runs"
        return why

    def release(self, lane: Lane) -> None:
        """A seat ``admit(reserve=True)`` held is free again (the request is submitted, or failed)."""
        self._reserved[lane] -= 1
        if not self._dispatcher.accepting:
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
            if not self._dispatcher.accepting:
                self._wakeup.set()  # closing: the dispatcher ends once nothing is on its way either


def _ms(seconds: float) -> str:
    """A duration for a message: whole milliseconds, a tenth under ten (2 ms against 2 ms said nothing)."""
    millis = seconds * 1000
    return f"{millis:.0f} ms" if millis >= 10 else f"{millis:.1f} ms"
