"""Runs one batch of one model on the device thread."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.inference.device import DeviceThread
from app.inference.loader import LayeredModel
from app.inference.postprocess import TopK


class ModelRunner:
    """The batcher's runner for one model: stack, forward, top-k, all off the event loop."""

    def __init__(self, model: LayeredModel, device: DeviceThread, top_k: int) -> None:
        self.model = model
        self._device = device
        self._k = min(top_k, len(model.manifest.labels))

    async def __call__(self, images: Sequence[torch.Tensor]) -> list[TopK]:
        batch = list(images)
        return await self._device.run(lambda: self.run_sync(batch))

    def run_sync(self, images: list[torch.Tensor]) -> list[TopK]:
        """Blocking: the whole batch on the device, answers back on the host."""
        with torch.inference_mode():
            probabilities = self.model.probabilities(torch.stack(images))
            values, indices = probabilities.topk(self._k, dim=1)
            values, indices = values.cpu(), indices.cpu()
        return [TopK(tuple(v), tuple(i)) for v, i in zip(values.tolist(), indices.tolist(), strict=True)]
