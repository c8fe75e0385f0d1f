"""Injected device faults: the real model, but out of memory where a test says so."""

from __future__ import annotations

import torch

from app.inference.loader import LayeredModel


class Faulty:
    """Wraps a model; raises ``torch.cuda.OutOfMemoryError`` (what the CUDA allocator raises)
    for batches of ``fail_at`` or more, or for every batch while ``always`` is set."""

    def __init__(self, inner: LayeredModel, fail_at: int = 10**9, always: bool = False) -> None:
        self.inner, self.fail_at, self.always = inner, fail_at, always
        self.manifest, self.device = inner.manifest, inner.device
        self.sizes: list[int] = []

    def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
        self.sizes.append(len(images))
        if self.always or len(images) >= self.fail_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return self.inner.probabilities(images, head)
