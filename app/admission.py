"""Admission upstream of the batcher: requests admitted whose images are not yet queued.

Between admission and the batcher's queue a request's body is read and its image decoded.
Such requests hold a ``Seat`` in their lane (the batcher counts it in the queue bound and the
predicted wait), and ``DecodeBacklog`` says how long a new image would wait for a decode
thread: the images ahead of it (urgent ones go first) at the measured decode time, shared
among the threads.
"""

from __future__ import annotations

from typing import Protocol

from app.batching import Lane


class Seats(Protocol):
    def release(self, lane: Lane) -> None: ...


class DecodeBacklog:
    """Requests admitted and not yet queued, per lane, and a moving estimate of one decode."""

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._waiting = {Lane.URGENT: 0, Lane.NORMAL: 0}
        self._decode_s: float | None = None

    def wait_s(self, lane: Lane) -> float:
        """Seconds a new image of ``lane`` would take to come out of the decode threads: 0 until
        measured, and 0 with none ahead of it (a stale estimate, one slow decode's, must not
        refuse the requests that would measure it again)."""
        ahead = self._waiting[Lane.URGENT] + (self._waiting[Lane.NORMAL] if lane is Lane.NORMAL else 0)
        if self._decode_s is None or ahead == 0:
            return 0.0
        return (ahead + 1) * self._decode_s / self._threads

    def record(self, decode_s: float) -> None:
        self._decode_s = decode_s if self._decode_s is None else 0.9 * self._decode_s + 0.1 * decode_s

    def seat(self, seats: Seats, lane: Lane) -> Seat:
        """A seat the batcher (``seats``) already holds for an admitted request."""
        self._waiting[lane] += 1
        return Seat(self, seats, lane)

    def _left(self, lane: Lane) -> None:
        self._waiting[lane] -= 1


class Seat:
    """A request's place in its lane from admission until it is queued (its body being read,
    its image decoded); ``release`` once it is queued or has failed (idempotent)."""

    def __init__(self, backlog: DecodeBacklog, seats: Seats, lane: Lane) -> None:
        self._backlog, self._seats, self._lane = backlog, seats, lane
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._backlog._left(self._lane)
            self._seats.release(self._lane)
