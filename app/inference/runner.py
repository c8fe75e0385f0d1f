"""Runs one batch of one model on the device thread, and survives device faults.

A batch that runs out of device memory is split in halves and each half retried; the
batcher is told, so it caps batch sizes until the pressure passes. A single image that
still does not fit, or a device that fails outright (a CUDA error: the context is lost for
good), is a device failure. After ``fallback_after`` consecutive failures, a configured
fallback (the model in fp32 on the CPU) takes over for good, and the service reports itself
degraded; without one, or if it cannot load, each failure is a 503 ``device_unavailable``.

Before every attempt, the first and each retry, the images whose request has gone (deadline
passed, client disconnected) are left out. A failed attempt's tensors are let go before the
retry: the handler's traceback would keep them, and the device memory with them.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from app.errors import DeviceUnavailable
from app.inference.device import DeviceThread, release_memory
from app.inference.manifest import Manifest
from app.inference.postprocess import TopK

log = logging.getLogger(__name__)


class Model(Protocol):
    """What the runner needs of a model (``LayeredModel``, or a test double around one)."""

    manifest: Manifest
    device: torch.device

    def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor: ...


class Fault(enum.Enum):
    MEMORY = "out of memory"
    DEVICE = "device error"


def device_fault(exc: BaseException) -> Fault | None:
    """What a forward pass's error says of the device; None: not the device's (a bug, bad input).

    TorchScript re-raises an error from inside a graph as a plain ``RuntimeError`` carrying
    the original message, so CUDA's out-of-memory error from the scripted backbone is known
    by its text; a CUDA error (illegal address, launch failure, ECC) leaves the context unusable.
    """
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return Fault.MEMORY
    if not isinstance(exc, RuntimeError):
        return None
    if isinstance(exc, getattr(torch, "AcceleratorError", ())):
        return Fault.DEVICE
    text = str(exc)
    if "out of memory" in text:
        return Fault.MEMORY
    if "CUDA error" in text:
        return Fault.DEVICE
    return None


class ModelRunner:
    """The batcher's runner for one model: stack, forward, top-k, all off the event loop."""

    def __init__(
        self,
        model: Model,
        device: DeviceThread,
        top_k: int,
        *,
        on_pressure: Callable[[int], None] = lambda size: None,
        fallback: Callable[[], Model] | None = None,
        fallback_after: int = 3,
    ) -> None:
        self.model = model
        self._device = device
        self._k = min(top_k, len(model.manifest.labels))
        self._on_pressure = on_pressure
        self._fallback = fallback
        self._fallback_after = fallback_after
        self.failures = 0  # consecutive device failures
        self.degraded = False

    async def __call__(
        self,
        images: Sequence[torch.Tensor],
        deadlines: Sequence[float] | None = None,
        urgent: bool = False,
        gone: Callable[[int], bool] | None = None,
    ) -> list[TopK | None]:
        """Answers in order; ``None`` for an image whose request went before its batch reached
        the device, or before a retry: past its deadline (``time.monotonic()``), or ``gone(i)``
        (its client disconnected). It is not computed. Urgent batches go first."""
        batch = list(images)
        return await self._device.run(lambda: self.run_sync(batch, deadlines, gone), urgent=urgent)

    def run_sync(
        self,
        images: list[torch.Tensor],
        deadlines: Sequence[float] | None = None,
        gone: Callable[[int], bool] | None = None,
    ) -> list[TopK | None]:
        """Blocking: the live images on the device (split on out-of-memory), answers on the host."""
        answers: list[TopK | None] = [None] * len(images)
        live = _Live(images, deadlines, gone)
        try:
            self._compute(live, range(len(images)), answers)
        except DeviceUnavailable:
            self.failures += 1
            if self._fallback is None or self.failures < self._fallback_after:
                raise
        else:
            self.failures = 0
            return answers
        self._fall_back()  # outside the handler: the failed model is no longer referenced from it
        self._compute(live, range(len(images)), answers)
        self.failures = 0
        return answers

    def _compute(self, live: _Live, indices: Sequence[int], answers: list[TopK | None]) -> None:
        wanted = live.now(indices)
        if not wanted:
            return
        try:
            computed = self._forward([live.images[i] for i in wanted])
        except Exception as exc:
            fault = device_fault(exc)
            if fault is None:
                raise
            log.warning("%s at batch %d: %s", fault.value, len(wanted), _summary(exc))
        else:
            for i, top in zip(wanted, computed, strict=True):
                answers[i] = top
            return
        # past the handler: the failed attempt's frames, and the tensors they held, are gone
        release_memory(self.model.device)
        if fault is Fault.DEVICE:
            raise DeviceUnavailable("the device failed")
        if len(wanted) == 1:
            raise DeviceUnavailable("the device is out of memory even for one image")
        self._on_pressure(len(wanted))
        half = len(wanted) // 2
        self._compute(live, wanted[:half], answers)
        self._compute(live, wanted[half:], answers)

    def _forward(self, images: list[torch.Tensor]) -> list[TopK]:
        with torch.inference_mode():
            probabilities = self.model.probabilities(torch.stack(images))
            values, indices = probabilities.topk(self._k, dim=1)
            values, indices = values.cpu(), indices.cpu()
        return [TopK(tuple(v), tuple(i)) for v, i in zip(values.tolist(), indices.tolist(), strict=True)]

    def _fall_back(self) -> None:
        assert self._fallback is not None
        log.error("the device failed %d batches in a row: serving from the CPU fallback", self.failures)
        try:
            fallback = self._fallback()
        except Exception:
            # it would fail the same way again, seconds on the device thread for every batch
            log.exception("the CPU fallback did not load: the model stays unavailable")
            self._fallback = None
            raise DeviceUnavailable("the device failed, and the CPU fallback could not load") from None
        failed, self.model = self.model, fallback
        device = failed.device
        self.degraded = True
        del failed  # nothing else holds it (the service reads the runner's model)
        release_memory(device)


class _Live:
    """The images of one batch, and which of them are still wanted."""

    def __init__(
        self, images: list[torch.Tensor], deadlines: Sequence[float] | None, gone: Callable[[int], bool] | None
    ) -> None:
        self.images, self._deadlines, self._gone = images, deadlines, gone

    def now(self, indices: Sequence[int]) -> list[int]:
        now = time.monotonic()
        deadlines, gone = self._deadlines, self._gone
        return [i for i in indices if (deadlines is None or deadlines[i] > now) and (gone is None or not gone(i))]


def _summary(exc: BaseException) -> str:
    """The line of a device error that says what happened (TorchScript's start with its own)."""
    lines = str(exc).splitlines() or [type(exc).__name__]
    return next((line.strip() for line in lines if "out of memory" in line or "CUDA error" in line), lines[0])
