"""Top-k class probabilities to labelled predictions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TopK:
    """The best classes of one image, best first: probabilities and class indices."""

    probabilities: tuple[float, ...]
    indices: tuple[int, ...]


@dataclass(frozen=True)
class Prediction:
    label: str
    class_index: int
    probability: float


def label(top: TopK, labels: Sequence[str], k: int) -> list[Prediction]:
    """The first ``k`` of ``top`` with their labels."""
    return [
        Prediction(labels[index], index, probability)
        for probability, index in zip(top.probabilities[:k], top.indices[:k], strict=True)
    ]
