"""What the batcher tells the outside world, without knowing who listens (metrics, traces)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from app.batching.policy import Lane


class BatchObserver(Protocol):
    """Called on the event loop; implementations must be cheap and must not raise."""

    def on_batch(
        self, lane: Lane, size: int, capacity: int, waits_s: Sequence[tuple[Lane, float]], run_s: float, ok: bool
    ) -> None:
        """A batch formed by ``lane`` ran; ``waits_s`` has each request's own lane (a normal
        request may ride an urgent batch) and its wait in the queue. ``size`` is what the device
        ran: 0 for a batch none of whose requests reached it (each gone, past its deadline, or its
        image undecodable), which took no device time."""

    def on_rejected(self, lane: Lane, reason: str) -> None: ...

    def on_dropped(self, lane: Lane, reason: str) -> None: ...


class NullObserver:
    """Listens to nothing."""

    def on_batch(
        self, lane: Lane, size: int, capacity: int, waits_s: Sequence[tuple[Lane, float]], run_s: float, ok: bool
    ) -> None:
        return None

    def on_rejected(self, lane: Lane, reason: str) -> None:
        return None

    def on_dropped(self, lane: Lane, reason: str) -> None:
        return None
