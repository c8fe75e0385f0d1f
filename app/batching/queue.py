"""What waits in a lane: each request's future and timer, and the lane's queue of them."""

from __future__ import annotations

import asyncio
import heapq
import itertools
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


@dataclass(eq=False)
class LaneQueue(Generic[P, R]):
    """A lane's requests in arrival order; those answered meanwhile leave lazily."""

    items: deque[Pending[P, R]] = field(default_factory=deque)
    waiting: int = 0  # live requests; done ones are removed lazily from the deque
    # the requests whose deadline may not wait out the window, earliest deadline first (those
    # gone leave lazily); empty under the default deadlines, which costs nothing to keep
    hurried: list[tuple[float, int, Pending[P, R]]] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def hurry(self, item: Pending[P, R]) -> None:
        """Watch ``item``'s deadline: its lane's window closes early when it must start."""
        heapq.heappush(self.hurried, (item.deadline, next(self._order), item))

    def drop(self, item: Pending[P, R]) -> None:
        if item.queued:
            item.queued = False
            self.waiting -= 1

    def prune_head(self) -> None:
        while self.items and (not self.items[0].queued or self.items[0].future.done()):
            self.drop(self.items.popleft())

    def state(self, lead_s: float = 0.0) -> LaneState:
        """The queue as the rules see it; a hurried request must start ``lead_s`` (its batch's
        run) before its deadline."""
        self.prune_head()
        hurried = self.hurried
        while hurried and (not hurried[0][2].queued or hurried[0][2].future.done()):
            heapq.heappop(hurried)
        start_by = hurried[0][0] - lead_s if hurried else None
        return LaneState(self.waiting, self.items[0].enqueued_at if self.items else None, start_by)

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
