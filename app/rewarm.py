"""Warming the batch sizes a policy change brings, in the background, while serving.

A change through the admin API or the config file applies from the next batch; a new largest
batch brings batch sizes (on CUDA, padded sizes: a lowered max batch that is no power of two
is one) the device has never run, and the first batch at each would pay the device's set-up
for its shape: about a second of host CPU per shape on CUDA, holding every batch behind it.
The warm-up that start-up runs is run again for the sizes missing, one a device call so that
batches run between them. One task at a time: a later change replaces it (the sizes warmed so
far stay warmed); ``close`` cancels it.

Each call looks the version up again, under the policy in force then: a version unloaded
meanwhile is not warmed, nor a size a later policy no longer allows. No served version is held
(held by this task, an unloaded one outlived its unload's collection, then was frozen with the
rest, never freed), only the model of the call in progress, by that call; ``settled`` waits for
it, so that an unload's release of device memory comes after the model is gone.

A size the device has no memory for ends the version's warm-up: what the failed call took is
released (off the event loop), and the version's batch ceiling drops below that size, as a
batch out of memory drops it: live batches would otherwise run the size unwarmed under the
same pressure, and a size first set up under memory pressure has crashed the process on CUDA
when it ran again. The ceiling climbs back as it does after any out-of-memory batch, but not past
a size that is not warmed: before it rises, ``ready`` starts a warm-up of what the version lacks,
and the ceiling rises at a later batch once the sizes it lets in are warmed (out of memory again,
it stays).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from app.inference.device import Fault, device_fault, fault_line, release_memory
from app.inference.loader import LayeredModel
from app.versions import ServedModel, VersionLoader

log = logging.getLogger(__name__)


class Rewarmer:
    def __init__(self, loader: VersionLoader, served: Callable[[], Sequence[ServedModel]]) -> None:
        self._loader = loader
        self._served = served  # the versions served now
        self.task: asyncio.Task[None] | None = None  # the warm-up in progress, if any
        self._step: asyncio.Task[int | None] | None = None  # its device call in progress, if any

    def start(self) -> None:
        """Warm what the versions served lack under the policy now in force (on the event loop);
        nothing starts where none lacks a size."""
        versions = [(s.name, s.version) for s in self._served() if self._loader.unwarmed_size(s.model) is not None]
        if not versions:
            return
        if self.task is not None:
            self.task.cancel()
        self.task = asyncio.get_running_loop().create_task(self._warm(versions), name="rewarm")

    async def _warm(self, versions: list[tuple[str, str]]) -> None:
        for name, version in versions:
            warmed: list[int] = []
            while True:
                await self.settled()  # a replaced task's call first: one at a time
                step = self._step = asyncio.get_running_loop().create_task(self._one(name, version), name="rewarm-step")
                # shielded: cancelled, this task ends, its call runs on (``settled`` waits for it)
                size = await asyncio.shield(step)
                if size is None:
                    break
                warmed.append(size)
            if warmed:
                log.info("warmed %s/%s at batch sizes %s for the new policy", name, version, warmed)

    def _version(self, name: str, version: str) -> ServedModel | None:
        return next((s for s in self._served() if (s.name, s.version) == (name, version)), None)

    def _model(self, name: str, version: str) -> LayeredModel | None:
        served = self._version(name, version)
        model = None if served is None else served.runner.model
        return model if isinstance(model, LayeredModel) else None  # None: unloaded since

    async def _one(self, name: str, version: str) -> int | None:
        """One size ``name/version`` lacks, warmed: the size; None when none is left, the version
        is gone, or the device failed it (logged: its warm-up ends; out of memory, the memory the
        call took is released and the version's batch ceiling lowered below the size). Its frame
        alone holds the model."""
        model = self._model(name, version)
        size = None if model is None else self._loader.unwarmed_size(model)
        if model is None or size is None:
            return None
        try:
            await self._loader.warm_size(model, size)
        except Exception as exc:  # the device failed a warm-up batch: serving goes on, the size unwarmed
            if (fault := device_fault(exc)) is None:
                log.exception("warming %s/%s for the new policy failed", name, version)
            else:
                log.warning("warming %s/%s at batch %d for the new policy: %s", name, version, size, fault_line(exc))
            if fault is not Fault.MEMORY:
                return None
        else:
            return size
        # past the handler: the failed call's frames, and the tensors they held, are gone
        await asyncio.to_thread(release_memory, model.device)
        served = self._version(name, version)
        if served is not None and served.runner.model is model:  # not since replaced by its CPU fallback
            served.batcher.lower_ceiling(size)
        return None

    def ready(self, name: str, version: str, size: int) -> bool:
        """Whether ``name/version``'s batches up to ``size`` may run: every size up to it that a
        warm-up runs is warmed. If not, a warm-up of what the versions lack starts (unless one
        runs): its ceiling stays until it is done (on the event loop: it starts that task)."""
        model = self._model(name, version)
        if model is None or self._loader.unwarmed_size(model, upto=size) is None:
            return True
        if self.task is None or self.task.done():
            log.info("warming %s/%s up to batch %d before its batch ceiling rises", name, version, size)
            self.start()
        return False

    async def settled(self) -> None:
        """Until the device call a warm-up runs, if any, ended (a cancelled warm-up's too)."""
        if self._step is not None:
            await asyncio.wait([self._step])

    async def close(self) -> None:
        for task in (self.task, self._step):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
