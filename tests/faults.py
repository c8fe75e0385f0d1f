"""Injected device faults: the real model, but out of memory where a test says so."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from app.inference.loader import LayeredModel


class Faulty:
    """Wraps a model; raises ``torch.cuda.OutOfMemoryError`` (what the CUDA allocator raises)
    for batches of ``fail_at`` or more, or for every batch while ``always`` is set."""

    def __init__(self, inner: LayeredModel, fail_at: int = 10**9, always: bool = False) -> None:
        self.inner, self.fail_at, self.always = inner, fail_at, always
        self.manifest, self.device, self.dtype = inner.manifest, inner.device, inner.dtype
        self.sizes: list[int] = []

    @property
    def failed_heads(self) -> dict[str, str]:
        return self.inner.failed_heads

    @property
    def unreadable_heads(self) -> dict[str, str]:
        return self.inner.unreadable_heads

    def batch(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.inner.batch(images)

    def batch_rows(self, images: int) -> int:
        return self.inner.batch_rows(images)

    def head(self, name: str | None = None) -> torch.jit.ScriptModule:
        return self.inner.head(name)

    def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
        self.sizes.append(len(images))
        if self.always or len(images) >= self.fail_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return self.inner.probabilities(images, head)


@torch.library.custom_op("tests_faults::out_of_memory_at", mutates_args=())
def _out_of_memory_at(x: torch.Tensor, fail_at: int) -> torch.Tensor:
    """An operator inside a graph that runs out of memory, as CUDA's allocator would."""
    if x.shape[0] >= fail_at:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected in the graph)")
    return x.clone()


class _Gate(torch.nn.Module):
    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tests_faults.out_of_memory_at(x, self.fail_at)  # type: ignore[no-any-return]


def out_of_memory_in_graph(model: LayeredModel, fail_at: int) -> LayeredModel:
    """The model with a TorchScript graph in front of its backbone that runs out of memory for
    batches of ``fail_at`` or more: TorchScript re-raises that as a plain ``RuntimeError``."""
    gate, backbone = torch.jit.script(_Gate(fail_at)), model.backbone
    return dataclasses.replace(model, backbone=lambda x: backbone(gate(x)), batched_backbone=None)


class DeviceLost(Faulty):
    """A device whose context is gone (an illegal address, a launch failure): every batch fails
    with the error CUDA gives, whatever its size."""

    def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
        self.sizes.append(len(images))
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")


class Unfit(Faulty):
    """Out of memory for any batch that holds an image ``unfit`` picks, down to that image
    alone: one request too big for the device among others that fit."""

    def __init__(self, inner: LayeredModel, unfit: Callable[[torch.Tensor], bool]) -> None:
        super().__init__(inner)
        self.unfit = unfit

    def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
        self.sizes.append(len(images))
        if any(self.unfit(image) for image in images):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected: an image that does not fit)")
        return self.inner.probabilities(images, head)


class LostAfter(Faulty):
    """A device that computes ``batches`` batches, then loses its context for good."""

    def __init__(self, inner: LayeredModel, batches: int, fail_at: int = 10**9) -> None:
        super().__init__(inner, fail_at=fail_at)
        self.left = batches

    def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
        if len(images) < self.fail_at and self.left <= 0:
            self.sizes.append(len(images))
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        answer = super().probabilities(images, head)
        self.left -= 1
        return answer
