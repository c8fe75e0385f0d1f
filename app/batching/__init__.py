"""The dual-window batcher: pure asyncio, free of torch and FastAPI."""

from app.batching.batcher import DualWindowBatcher
from app.batching.clock import Clock, MonotonicClock
from app.batching.execution import Runner
from app.batching.observer import BatchObserver, NullObserver
from app.batching.policy import BatchPolicy, Lane, LanePolicy, UrgentFill
from app.batching.queue import Completed

__all__ = [
    "BatchObserver",
    "BatchPolicy",
    "Clock",
    "Completed",
    "DualWindowBatcher",
    "Lane",
    "LanePolicy",
    "MonotonicClock",
    "NullObserver",
    "Runner",
    "UrgentFill",
]
