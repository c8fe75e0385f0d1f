"""Admission upstream of the batcher: requests admitted whose images are not yet queued.

Between its body being whole and the batcher's queue a request's image is decoded. Such
requests hold a ``Seat`` in their lane (the batcher counts it in the queue bound and the
predicted wait; a body still arriving holds none), and ``DecodeBacklog`` says how long a new
image would wait for a decode thread: the images ahead of it at the measured decode time,
shared among the threads, and, for a normal image, the urgent images that will come while it
waits (they go first).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from app.batching import Lane
from app.batching.moving import Decaying

# What the decode estimates remember, in seconds. Admission refuses at the edge of what the
# estimate allows, so under overload it admits a request just when the estimate dips: with the
# mean of the last ten decodes, and no count of the urgent images that overtake, normal images
# waited 1.4-1.9 times their predicted decode wait at twice the load; with both, 0.9-1.1 at the
# median (docs/performance.md, twenty-third pass). Half a second is a few hundred decodes, and
# still follows a host that slows within the second.
MEMORY_S = 0.5
# the urgent images' share of the decode threads past which a normal image's wait is counted
# as if they took this much (beyond it the normal lane would never be decoded)
MAX_URGENT_SHARE = 0.9


class Seats(Protocol):
    def release(self, lane: Lane) -> None: ...


class DecodeBacklog:
    """Requests admitted and not yet queued, per lane, and moving estimates of one decode's time
    and of the urgent images' arrivals."""

    def __init__(self, threads: int, clock: Callable[[], float] = time.monotonic, memory_s: float = MEMORY_S) -> None:
        self._threads = threads
        self._waiting = {Lane.URGENT: 0, Lane.NORMAL: 0}
        self._decode_s = Decaying(memory_s, clock)
        self._urgent = Decaying(memory_s, clock)

    def wait_s(self, lane: Lane) -> float:
        """Seconds a new image of ``lane`` would take to come out of the decode threads: 0 until
        measured, and 0 with none ahead of it (a stale estimate, one slow decode's, must not
        refuse the requests that would measure it again).

        An urgent image waits for the urgent images ahead. A normal one waits for every image
        ahead and for the urgent ones that arrive meanwhile: they take ``share`` of the threads'
        time, so the images ahead clear at ``1 - share`` of the threads' pace."""
        ahead = self._waiting[Lane.URGENT] + (self._waiting[Lane.NORMAL] if lane is Lane.NORMAL else 0)
        decode_s = self._decode_s.mean()
        if decode_s is None or ahead == 0:
            return 0.0
        per_image = decode_s / self._threads
        wait = (ahead + 1) * per_image
        if lane is Lane.NORMAL:
            share = min(MAX_URGENT_SHARE, self._urgent.rate() * per_image)
            wait /= 1.0 - share
        return wait

    def record(self, decode_s: float) -> None:
        """One image's decode, in seconds."""
        self._decode_s.add(decode_s)

    def seat(self, seats: Seats, lane: Lane) -> Seat:
        """A seat the batcher's intake (``seats``) already holds for an admitted request."""
        self._waiting[lane] += 1
        if lane is Lane.URGENT:
            self._urgent.add()
        return Seat(self, seats, lane)

    def _left(self, lane: Lane) -> None:
        self._waiting[lane] -= 1


class Seat:
    """A request's place in its lane from its body being whole until it is queued (its image
    decoded); ``release`` once it is queued or has failed (idempotent)."""

    def __init__(self, backlog: DecodeBacklog, seats: Seats, lane: Lane) -> None:
        self._backlog, self._seats, self._lane = backlog, seats, lane
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._backlog._left(self._lane)
            self._seats.release(self._lane)
