"""How long a model's forward pass takes at each batch size: the passes timed, per size, in order."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from app.bench.sweep.memory import MemoryProbe
from app.inference.device import Fault, device_fault

Forward = Callable[[torch.Tensor], object]


@dataclass(frozen=True)
class SizeResult:
    """What one batch size measured; an ``oom`` result carries no timings."""

    batch_size: int
    status: Literal["ok", "oom"] = "ok"
    iterations: int = 0
    median_ms: float = 0.0
    p90_ms: float = 0.0
    min_ms: float = 0.0
    throughput: float = 0.0  # items/s: batch size / median latency
    memory: dict[str, int] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class Limits:
    """How long to spend on each size."""

    warmup: int = 3
    iterations: int = 50
    seconds_per_size: float = 3.0


def batch_sizes(max_batch: int) -> list[int]:
    """Powers of two from 1 up to ``max_batch`` (rounded down to one)."""
    if max_batch < 1:
        raise ValueError("max batch must be at least 1")
    return [2**k for k in range(max_batch.bit_length()) if 2**k <= max_batch]


# Not ``loadgen.summary.percentile`` (nearest rank, 0 for none) on purpose: a size has a few dozen
# passes, where a nearest rank jumps from one pass to the next, and a size with no passes has no
# figure to give rather than a zero that would read as infinitely fast.
def percentile(values: Sequence[float], q: float) -> float:
    """Linearly interpolated percentile (numpy's default): a sweep has few samples per size."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def time_passes(
    forward: Forward, batch: torch.Tensor, sync: Callable[[], None], limits: Limits, clock: Callable[[], float]
) -> list[float]:
    """Seconds per timed pass. Warm-up and timing each stop at the per-size budget (after one pass)."""
    started = clock()
    for _ in range(limits.warmup):
        forward(batch)
        if clock() - started >= limits.seconds_per_size:
            break
    sync()
    timings: list[float] = []
    started = clock()
    while len(timings) < limits.iterations:
        begin = clock()
        forward(batch)
        sync()
        end = clock()
        timings.append(end - begin)
        if end - started >= limits.seconds_per_size:
            break
    return timings


def sweep(
    forward: Forward,
    make_batch: Callable[[int], torch.Tensor],
    sizes: Sequence[int],
    probe: MemoryProbe,
    limits: Limits,
    sync: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
    on_result: Callable[[SizeResult], None] = lambda _: None,
) -> list[SizeResult]:
    """Time every size in order; an out-of-memory (CUDA's, or the host allocator's, the dummy
    batch's own included) is recorded and ends the sweep."""
    results: list[SizeResult] = []
    for size in sizes:
        batch: torch.Tensor | None = None
        try:
            batch = make_batch(size)  # in here: a host batch too large for the machine is this size's OOM
            probe.start()
            timings = time_passes(forward, batch, sync, limits, clock)
        except Exception as exc:  # CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError
            if device_fault(exc) is not Fault.MEMORY:
                raise
            result = SizeResult(size, "oom", error=str(exc).splitlines()[0] if str(exc) else "out of memory")
        else:
            memory = probe.stop()
            ms = [t * 1000 for t in timings]
            median = percentile(ms, 50)
            throughput = size / max(median / 1000, 1e-9)  # a finite number, so the JSON stays valid
            result = SizeResult(size, "ok", len(ms), median, percentile(ms, 90), min(ms), throughput, memory)
        results.append(result)
        on_result(result)
        if result.status == "oom":
            del batch
            torch.cuda.empty_cache()  # a no-op unless CUDA was initialised
            break
    return results
