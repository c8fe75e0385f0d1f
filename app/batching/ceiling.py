"""The batch ceiling under device memory pressure.

A batch that ran out of device memory caps every lane's batches at half its size at most: the
size the device ran it at (a padded batch's rows, not its requests: a batch of 10 padded to 16
caps them at 8, a size batches run at unpadded), as does a new batch size whose warm-up ran out
(``app/rewarm.py``). Only batches full at the cap show that the cap fits (small ones prove
nothing, and a larger one was formed before the cap: the batch that failed, once its halves
ran), and after ``recovery_batches`` of them the cap doubles, until it reaches the policy's own
sizes. A policy lowered under the cap for a while does not lift it: its batches prove nothing of
the sizes that failed.

Before it rises, ``ready`` is asked whether the sizes the new cap lets in are set up (warmed): a
size first set up by a live batch under the pressure that lowered the cap (the size whose warm-up
ran out of memory, typically) has crashed the process on CUDA. Not ready, the cap stays while they
are warmed (``Rewarmer.ready`` starts that), and the next batch full at the cap asks again.
A failure where the cap tried to rise (the pressure is still there) doubles the batches it waits for.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from app.batching.policy import BatchPolicy, LanePolicy

log = logging.getLogger(__name__)

MAX_BACKOFF_DOUBLINGS = 6  # a rise failing again and again is tried every 64 x recovery_batches at most


class Ceiling:
    """The cap on batch sizes set by memory pressure (``value``; ``None``: the policy's own)."""

    def __init__(self, name: str, recovery_batches: int = 32, ready: Callable[[int], bool] | None = None) -> None:
        self._name = name
        self.value: int | None = None
        self.recovery_batches = recovery_batches
        self._calm = 0
        # whether batches up to a size may run now (its warm-up done); False: not yet
        self._ready = ready or (lambda _size: True)
        self._strikes = 0  # failures where the cap tried to rise (the pressure stayed): each doubles the wait
        self._tried = False  # the cap tried to rise (or rose) since it was last lowered

    def lower(self, failed_size: int) -> None:
        """A batch of ``failed_size`` rows ran out of device memory: cap batches at half of it. A
        failure where the cap tried to rise (the pressure has not gone) doubles the batches it waits
        for before it tries again, up to ``MAX_BACKOFF_DOUBLINGS`` times: each try is another
        out-of-memory error, and on CUDA another set-up under pressure. Back at the policy's own
        sizes, it starts afresh."""
        if self._tried:  # it failed where the cap tried to rise to (not the halves of one split)
            self._strikes = min(self._strikes + 1, MAX_BACKOFF_DOUBLINGS)
        self._tried = False
        self.value = max(1, min(failed_size // 2, self.value or failed_size))
        self._calm = 0
        log.warning(
            "%s: batch ceiling lowered to %d after a failure at %d; it rises after %d batches at it",
            self._name,
            self.value,
            failed_size,
            self._needed,
        )

    @property
    def _needed(self) -> int:
        """The batches full at the cap before it may rise."""
        return self.recovery_batches << self._strikes

    def reset(self) -> None:
        """Another model serves now (the CPU fallback): the old device's pressure says nothing of it."""
        if self.value is not None:
            log.info("%s: batch ceiling lifted: another model serves", self._name)
        self.value, self._calm, self._strikes, self._tried = None, 0, 0, False

    def calm(self, size: int, policy: BatchPolicy) -> None:
        """A batch of ``size`` ran without failing."""
        # a policy lowered under the ceiling leaves it as it is: the pressure is the device's, and
        # batches smaller than the cap say nothing of it, so a policy set back meets the cap again
        if self.value is None or size != self.value:
            return
        self._calm += 1
        if self._calm < self._needed:
            return
        raised = None if self.value * 2 >= policy.largest_batch else self.value * 2
        self._tried = True
        if not self._ready(raised or policy.largest_batch):
            return  # the sizes it would let in are being warmed: a later batch at the cap asks again
        self.value, self._calm = raised, 0
        if raised is None:  # at the policy's own sizes again: a later failure starts afresh
            self._strikes, self._tried = 0, False
        log.info("%s: batch ceiling raised to %s", self._name, self.value or "the policy's max")

    def cap(self, policy: BatchPolicy) -> BatchPolicy:
        """``policy`` with both lanes' batches (and queues, to stay valid) under the ceiling."""
        if self.value is None:
            return policy
        ceiling = self.value
        return dataclasses.replace(
            policy,
            urgent=_capped(policy.urgent, ceiling),
            normal=_capped(policy.normal, ceiling),
        )


def _capped(lane: LanePolicy, ceiling: int) -> LanePolicy:
    size = min(lane.max_batch, ceiling)
    return LanePolicy(lane.window_s, size, max(lane.max_queue, size))
