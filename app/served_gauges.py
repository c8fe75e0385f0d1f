"""What ``/metrics`` reads from the served versions at each scrape: queue depths and bounds, batch
ceilings, and the CUDA device's memory (``Metrics.scrape_time``'s sources)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

import torch

from app.batching.policy import Lane
from app.telemetry.metrics import Metrics
from app.versions import ServedModel


class ServedGauges:
    """The scrape-time figures of every loaded version, and of the unloaded ones whose requests
    still drain (``retiring``)."""

    def __init__(
        self,
        loaded: Callable[[], Iterable[ServedModel]],
        retiring: Collection[ServedModel],
        device: torch.device,
    ) -> None:
        self.loaded = loaded
        self.retiring = retiring  # the service's own set: read at each scrape
        self.device = device

    def install(self, metrics: Metrics) -> None:
        metrics.scrape_time.queue_depths = self.queue_depths
        metrics.scrape_time.queue_capacities = self.queue_capacities
        metrics.scrape_time.batch_ceilings = self.batch_ceilings
        if self.device.type == "cuda":
            metrics.scrape_time.device_memory = self.cuda_memory
            metrics.scrape_time.device_memory_total = self.cuda_memory_total

    def queue_depths(self) -> list[tuple[str, str, str, int]]:
        """Each version's queues, an unloaded one's too while they drain (its requests still wait
        there); a version loaded again meanwhile has both copies' requests in one series."""
        depths: dict[tuple[str, str, str], int] = {}
        for served in (*self.loaded(), *self.retiring):
            for lane in Lane:
                key = (served.name, served.version, lane.value)
                depths[key] = depths.get(key, 0) + served.batcher.depth(lane)
        return [(*key, depth) for key, depth in depths.items()]

    def queue_capacities(self) -> list[tuple[str, str, str, int]]:
        """Each version's queue bounds, an unloaded one's while it drains (a loaded copy's first)."""
        capacities: dict[tuple[str, str, str], int] = {}
        for served in (*self.loaded(), *self.retiring):
            for lane in Lane:
                capacities.setdefault(
                    (served.name, served.version, lane.value), served.batcher.policy.lane(lane).max_queue
                )
        return [(*key, capacity) for key, capacity in capacities.items()]

    def batch_ceilings(self) -> list[tuple[str, str, int]]:
        """Each loaded version's batch ceiling (0: none)."""
        return [(served.name, served.version, served.batcher.ceiling or 0) for served in self.loaded()]

    def cuda_memory_total(self) -> list[int]:
        return [torch.cuda.get_device_properties(self.device).total_memory]

    def cuda_memory(self) -> list[tuple[str, int]]:
        return [
            ("allocated", torch.cuda.memory_allocated(self.device)),
            ("reserved", torch.cuda.memory_reserved(self.device)),
        ]
