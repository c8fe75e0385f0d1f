"""Padded batches: few shapes for the device, each image's answer its own."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from app.inference.loader import LayeredModel, padded_size
from app.inference.preprocess import ImageLimits, decode
from app.inference.repository import Repository
from tests.support import MODEL_NAME, MODELS_DIR, sample_png


@given(largest=st.integers(1, 4096), size=st.integers(1, 5000))
def test_a_padded_size_is_the_next_power_of_two_capped_at_the_largest_batch(largest: int, size: int) -> None:
    padded = padded_size(size, largest)
    if size >= largest:
        assert padded == size, "nothing bigger than the policy allows: never padded"
        return
    assert size <= padded <= largest
    assert padded < 2 * size or padded == 1, "the padding at most doubles a batch"
    assert padded == largest or padded & (padded - 1) == 0, "a power of two, or the largest batch"


@given(largest=st.integers(1, 4096))
def test_every_batch_up_to_the_largest_runs_at_one_of_few_shapes(largest: int) -> None:
    shapes = {padded_size(size, largest) for size in range(1, largest + 1)}
    assert len(shapes) <= largest.bit_length() + 1
    assert max(shapes) == largest


def digits() -> tuple[LayeredModel, list[torch.Tensor]]:
    repository = Repository(MODELS_DIR)
    model = LayeredModel.load(
        repository.folder(MODEL_NAME, "1"), repository.manifest(MODEL_NAME, "1"), torch.device("cpu"), torch.float32
    )
    limits = ImageLimits(max_bytes=1 << 20, max_pixels=1 << 20)
    images = [decode(sample_png(digit), model.manifest.input, limits) for digit in range(10)]
    return model, images


def test_a_padded_batch_holds_the_images_then_zeros_in_the_backbones_layout() -> None:
    model, images = digits()
    for channels_last in (True, False):
        model.channels_last = channels_last
        unpadded = model.batch(images[:5])
        model.largest_batch = lambda: 7
        padded = model.batch(images[:5])
        model.largest_batch = None
        assert padded.shape == (7, *unpadded.shape[1:]), "5 -> 8, capped at the largest batch, 7"
        assert torch.equal(padded[:5], unpadded) and not padded[5:].any()
        assert layout(padded) == layout(unpadded), "laid out as the backbone takes it"


def layout(batch: torch.Tensor) -> str:
    if batch.is_contiguous(memory_format=torch.channels_last):
        return "channels-last"
    return "contiguous" if batch.is_contiguous() else "strided"


def test_padding_leaves_full_and_oversized_batches_alone() -> None:
    model, images = digits()
    model.largest_batch = lambda: 4
    assert model.batch(images[:4]).shape[0] == 4
    assert model.batch(images[:6]).shape[0] == 6, "a policy lowered meanwhile: the batch runs as it is"
    assert model.batch(images[:3]).shape[0] == 4


def test_the_warm_up_runs_every_padded_size_and_only_those() -> None:
    model, _ = digits()
    assert model.warm_up_sizes(24) == [1, 12, 24], "unpadded: the smallest, the largest and one between"
    model.largest_batch = lambda: 24
    assert model.warm_up_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert model.warm_up_sizes(1) == [1]
