"""Where batching stops paying, and the max batch to serve with."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from app.bench.sweep.timing import SizeResult


@dataclass(frozen=True)
class Recommendation:
    """The knee and the max batch to serve with, and why in words."""

    knee: int | None
    knee_reached: bool  # False: throughput still rose at the largest size that ran
    max_batch: int | None
    reason: str
    # the smallest size within NEAR_BEST of the best throughput measured: a curve that climbs a few
    # percent a doubling past the knee may still gain much in all (the knee compares doublings)
    near_best_batch: int | None = None


NEAR_BEST = 0.95


def _measured(results: Sequence[SizeResult]) -> list[SizeResult]:
    """The sizes that ran, up to the first out-of-memory."""
    return list(itertools.takewhile(lambda r: r.status == "ok", results))


def find_knee(results: Sequence[SizeResult], knee_gain: float) -> tuple[int | None, bool]:
    """The knee and whether the curve flattened there (False: it was still rising).

    Each next measured size is a doubling; the knee is the smallest size from which no
    larger size gains ``knee_gain`` or more over the best of the sizes below it, so a
    plateau followed by a real jump is not mistaken for the end, and a rebound from a dip
    that stays under the best so far is not a gain. Sizes after an out-of-memory never ran
    and do not count.
    """
    ok = _measured(results)
    if not ok:
        return None, False
    knee = len(ok) - 1
    while knee > 0 and ok[knee].throughput < max(r.throughput for r in ok[:knee]) * (1 + knee_gain):
        knee -= 1
    return ok[knee].batch_size, knee < len(ok) - 1


def recommend(
    results: Sequence[SizeResult], knee_gain: float, latency_budget_ms: float | None = None
) -> Recommendation:
    """The knee, capped by the latency budget; explains the choice."""
    knee, reached = find_knee(results, knee_gain)
    oom = next((r.batch_size for r in results if r.status == "oom"), None)
    if knee is None:
        reason = f"out of memory at batch {oom}" if oom is not None else "nothing was measured"
        return Recommendation(None, False, None, reason)
    measured = _measured(results)
    best = max(r.throughput for r in measured)
    near = min(r.batch_size for r in measured if r.throughput >= best * NEAR_BEST)
    if len(measured) == 1:
        reason = f"only batch {knee} was measured"
    elif reached:
        reason = f"beyond batch {knee}, doubling the batch gains less than {knee_gain:.0%} throughput"
    else:
        reason = f"throughput still gained {knee_gain:.0%} or more up to batch {knee}, the largest that ran"
    if oom is not None:
        reason += f" (batch {oom} ran out of memory)"
    if latency_budget_ms is None:
        return Recommendation(knee, reached, knee, reason, near)
    by_size = {r.batch_size: r for r in measured}
    within = [size for size, r in by_size.items() if size <= knee and r.median_ms <= latency_budget_ms]
    if not within:
        reason += f"; but no size up to it has a median latency within {latency_budget_ms:g} ms"
        return Recommendation(knee, reached, None, reason, near)
    chosen = max(within)
    if chosen < knee:
        reason += (
            f"; capped to {chosen} by the {latency_budget_ms:g} ms latency budget "
            f"(batch {knee} takes {by_size[knee].median_ms:.1f} ms)"
        )
    return Recommendation(knee, reached, chosen, reason, near)
