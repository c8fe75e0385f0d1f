"""Runs one batch of one model on the device thread, and survives device memory pressure.

A batch that runs out of device memory is split in halves and each half retried; the
batcher is told, so it caps batch sizes until the pressure passes. A single image that
still does not fit is a device failure. After ``fallback_after`` consecutive failures, a
configured fallback (the model in fp32 on the CPU) takes over for good, and the service
reports itself degraded; without one, each failure is a 503 ``device_unavailable``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from app.errors import DeviceUnavailable
from app.inference.device import DeviceThread
from app.inference.manifest import Manifest
from app.inference.postprocess import TopK

log = logging.getLogger(__name__)


class Model(Protocol):
    """What the runner needs of a model (``LayeredModel``, or a test double around one)."""

    manifest: Manifest
    device: torch.device

    def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor: ...


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
        self, images: Sequence[torch.Tensor], deadlines: Sequence[float] | None = None, urgent: bool = False
    ) -> list[TopK | None]:
        """Answers in order; ``None`` for an image whose deadline (``time.monotonic()``) passed
        before its batch reached the device: it is not computed. Urgent batches go first."""
        batch = list(images)
        return await self._device.run(lambda: self._run_live(batch, deadlines), urgent=urgent)

    def _run_live(self, images: list[torch.Tensor], deadlines: Sequence[float] | None) -> list[TopK | None]:
        # The deadline's last check, on the device thread just before compute: a batch can
        # wait here behind others (several batches in flight, a slow one ahead).
        now = time.monotonic()
        live = [i for i in range(len(images)) if deadlines is None or deadlines[i] > now]
        answers: list[TopK | None] = [None] * len(images)
        if live:
            computed = self.run_sync(images if len(live) == len(images) else [images[i] for i in live])
            for i, top in zip(live, computed, strict=True):
                answers[i] = top
        return answers

    def run_sync(self, images: list[torch.Tensor]) -> list[TopK]:
        """Blocking: the whole batch on the device (split on out-of-memory), answers on the host."""
        try:
            answers = self._split_on_oom(images)
        except DeviceUnavailable:
            self.failures += 1
            if self._fallback is None or self.failures < self._fallback_after:
                raise
            self._fall_back()
            answers = self._forward(images)
        self.failures = 0
        return answers

    def _split_on_oom(self, images: list[torch.Tensor]) -> list[TopK]:
        try:
            return self._forward(images)
        except torch.cuda.OutOfMemoryError as exc:
            _release(self.model.device)
            if len(images) == 1:
                raise DeviceUnavailable("the device is out of memory even for one image") from exc
            log.warning("out of device memory at batch %d: splitting", len(images))
            self._on_pressure(len(images))
            half = len(images) // 2
            return self._split_on_oom(images[:half]) + self._split_on_oom(images[half:])

    def _forward(self, images: list[torch.Tensor]) -> list[TopK]:
        with torch.inference_mode():
            probabilities = self.model.probabilities(torch.stack(images))
            values, indices = probabilities.topk(self._k, dim=1)
            values, indices = values.cpu(), indices.cpu()
        return [TopK(tuple(v), tuple(i)) for v, i in zip(values.tolist(), indices.tolist(), strict=True)]

    def _fall_back(self) -> None:
        assert self._fallback is not None
        log.error("the device failed %d batches in a row: serving from the CPU fallback", self.failures)
        failed = self.model
        self.model = self._fallback()
        self.degraded = True
        del failed
        _release(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
