"""What waits in a lane: each request's future and timer, and the lane's queue of them."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from app.batching.clock import Timer
from app.batching.policy import Lane, LaneState

P = TypeVar("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Completed(Generic[R]):
    """A request's answer and how it got there."""

    output: R
    lane: Lane
    batch_lane: Lane
    batch_size: int
    queued_s: float
    run_s: float


@dataclass(eq=False)
class Pending(Generic[P, R]):
    """One submitted request, from its queueing to its answer."""

    payload: P
    lane: Lane
    enqueued_at: float
    future: asyncio.Future[Completed[R]]
    deadline: float = math.inf  # on the batcher's clock
    timer: Timer | None = None
    queued: bool = True
    batched: bool = False  # taken into a batch (from then on, the runner reports it left out)
    hurried: bool = False  # its deadline cannot wait out its lane's window (``LaneQueue.hurry``)


@dataclass(eq=False)
class LaneQueue(Generic[P, R]):
    """A lane's requests in arrival order; those answered meanwhile leave lazily."""

    items: deque[Pending[P, R]] = field(default_factory=deque)
    waiting: int = 0  # live requests; done ones are removed lazily from the deque
    hurried: int = 0  # of those, the ones whose deadline cannot wait out the window

    def hurry(self, item: Pending[P, R]) -> None:
        """``item``'s deadline cannot wait out the window: its lane's batch goes at once."""
        item.hurried = True
        self.hurried += 1

    def drop(self, item: Pending[P, R]) -> None:
        if item.queued:
            item.queued = False
            self.waiting -= 1
            self.hurried -= item.hurried

    def prune_head(self) -> None:
        while self.items and (not self.items[0].queued or self.items[0].future.done()):
            self.drop(self.items.popleft())

    def state(self) -> LaneState:
        self.prune_head()
        return LaneState(self.waiting, self.items[0].enqueued_at if self.items else None, self.hurried > 0)

    def take(self, count: int, now: float = -math.inf) -> tuple[list[Pending[P, R]], list[Pending[P, R]]]:
        """Up to ``count`` live requests from the head, for a batch; and those passed over because
        their deadline is not after ``now`` (their timer is due, and has not run yet: on a busy
        loop it runs late), for the caller to answer. Both leave the queue (see ``restore``)."""
        taken: list[Pending[P, R]] = []
        late: list[Pending[P, R]] = []
        while self.items and len(taken) < count:
            item = self.items.popleft()
            if item.queued and not item.future.done():
                if item.deadline <= now:
                    late.append(item)
                else:
                    item.batched = True
                    taken.append(item)
            self.drop(item)
        return taken, late

    def restore(self, taken: list[Pending[P, R]]) -> None:
        """Put requests ``take`` gave out back at the head, in their order: their batch did not form."""
        for item in reversed(taken):
            item.batched, item.queued = False, True
            self.items.appendleft(item)
        self.waiting += len(taken)
        self.hurried += sum(item.hurried for item in taken)
