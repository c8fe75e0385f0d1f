"""The CPU time one call costs, timed over rounds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass(frozen=True)
class Cost:
    """CPU seconds per call: the median and the best of several rounds."""

    median_s: float
    min_s: float
    calls: int

    @property
    def median_ms(self) -> float:
        return self.median_s * 1000


def cpu_cost(
    fn: Callable[[int], object], items: int, seconds: float, rounds: int = 5, clock: Clock = time.thread_time
) -> Cost:
    """CPU time per call of ``fn(i)`` for ``i`` cycling over ``range(items)``.

    One warm-up pass over every item, then ``rounds`` rounds of at least ``seconds / rounds``
    CPU seconds each (and at least one pass over the items). The median round is the
    figure: CPU time hardly depends on other processes, but caches and clocks do a little.
    """
    for index in range(items):
        fn(index)
    per_round = seconds / max(1, rounds)
    results, calls = [], 0
    for _ in range(max(1, rounds)):
        done = 0
        started = clock()
        while done < items or clock() - started < per_round:
            fn(done % items)
            done += 1
        results.append((clock() - started) / done)
        calls += done
    return Cost(statistics.median(results), min(results), calls)
