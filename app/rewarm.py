"""Warming the batch sizes a policy change newly allows, in the background, while serving.

A change through the admin API or the config file applies from the next batch; a bigger max
batch brings batch sizes (on CUDA, padded sizes) the device has never run, and the first batch
at each would pay the device's set-up for its shape: about a second of host CPU per shape on
CUDA, holding every batch behind it. The warm-up that start-up runs is run again for the sizes
missing, one a device call so that batches run between them. One task at a time: a later change
replaces it (the sizes warmed so far stay warmed); ``close`` cancels it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from app.inference.device import device_fault, fault_line
from app.inference.loader import LayeredModel
from app.versions import ServedModel, VersionLoader

log = logging.getLogger(__name__)


class Rewarmer:
    def __init__(self, loader: VersionLoader) -> None:
        self._loader = loader
        self.task: asyncio.Task[None] | None = None  # the warm-up in progress, if any

    def start(self, served: Sequence[ServedModel]) -> None:
        """Warm what ``served`` lacks under the policy now in force (on the event loop)."""
        if self.task is not None:
            self.task.cancel()
        self.task = asyncio.get_running_loop().create_task(self._warm(list(served)), name="rewarm")

    async def _warm(self, served: list[ServedModel]) -> None:
        for version in served:
            model = version.runner.model
            if not isinstance(model, LayeredModel):
                continue
            try:
                sizes = await self._loader.warm_new_sizes(model)
            except Exception as exc:  # the device failed a warm-up batch: serving goes on, the size unwarmed
                if device_fault(exc) is None:
                    log.exception("warming %s/%s for the new policy failed", version.name, version.version)
                else:
                    log.warning("warming %s/%s for the new policy: %s", version.name, version.version, fault_line(exc))
                continue
            if sizes:
                log.info("warmed %s/%s at batch sizes %s for the new policy", version.name, version.version, sizes)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
