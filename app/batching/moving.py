"""Moving estimates that forget by time, not by count: a mean and a rate over the last while, and
the pace of what was counted over the intervals timed."""

from __future__ import annotations

import math
from collections.abc import Callable


class Decaying:
    """Sums that forget at ``exp(-age / memory_s)``: a mean over the last ``memory_s`` or so,
    weighing every sample alike within it, and a rate of events."""

    def __init__(self, memory_s: float, clock: Callable[[], float]) -> None:
        self._memory_s, self._clock = memory_s, clock
        self._at: float | None = None
        self._total = self._count = 0.0

    def add(self, value: float = 1.0) -> None:
        now = self._clock()
        if self._at is not None:
            kept = math.exp(-(now - self._at) / self._memory_s)
            self._total *= kept
            self._count *= kept
        self._at = now
        self._total += value
        self._count += 1.0

    @property
    def at(self) -> float | None:
        """When the last sample came, None before the first."""
        return self._at

    def mean(self) -> float | None:
        """The samples' mean, None before the first (a pause forgets nothing: a mean of old
        samples only)."""
        return self._total / self._count if self._count else None

    def rate(self) -> float:
        """Events a second over about the last ``memory_s``, fading after they stop."""
        if self._at is None:
            return 0.0
        return self._count * math.exp(-(self._clock() - self._at) / self._memory_s) / self._memory_s


class Pace:
    """What was counted over the intervals timed, a second, over about the last ``memory_s`` of
    samples; unknown once nothing has been timed for ``memory_s`` (a pace from before a pause is
    no longer the pace)."""

    def __init__(self, memory_s: float, clock: Callable[[], float]) -> None:
        self._memory_s, self._clock = memory_s, clock
        self._counted = Decaying(memory_s, clock)
        self._seconds = Decaying(memory_s, clock)

    def add(self, counted: float, seconds: float) -> None:
        self._counted.add(counted)
        self._seconds.add(seconds)

    def rate(self) -> float | None:
        at, counted, seconds = self._seconds.at, self._counted.mean(), self._seconds.mean()
        if at is None or self._clock() - at > self._memory_s or counted is None or not seconds:
            return None
        return counted / seconds
