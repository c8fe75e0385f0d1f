"""Decoding and its limits: formats, sizes, bombs, corrupt bytes."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from app.errors import BadRequest, PayloadTooLarge
from app.inference.manifest import InputSpec, ResizeSpec
from app.inference.preprocess import ImageLimits, decode

DIGITS = InputSpec(channels=1, height=8, width=8, resize=ResizeSpec(filter="box"), mean=(0.3,), std=(0.4,))
IMAGENET = InputSpec(
    channels=3,
    height=224,
    width=224,
    resize=ResizeSpec(mode="shorter_side_then_center_crop", resize_to=256),
    mean=(0.485, 0.456, 0.406),
    std=(0.229, 0.224, 0.225),
)
LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=4_000_000)


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width x height``: what a decompression bomb looks like up front."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_each_accepted_format_becomes_the_input_grid(fmt: str) -> None:
    image = Image.new("RGB", (40, 30), (200, 200, 200))
    tensor = decode(encode(image, fmt), DIGITS, LIMITS)
    assert tensor.shape == (1, 8, 8) and tensor.dtype == torch.uint8
    assert 190 <= int(tensor.float().mean()) <= 210


@pytest.mark.parametrize("filter_", ["bilinear", "bicubic", "nearest", "box"])
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_the_pixels_come_laid_out_as_decoded_three_bytes_a_pixel(fmt: str, filter_: str) -> None:
    """A ``C x H x W`` tensor over ``H x W x C`` memory with nothing between the pixels, writable,
    and the same pixels as a contiguous copy, whichever decoder and resize made it: the device
    thread's batch is then a plain copy of each image (a padding byte a pixel left in memory made
    it a strided copy, 40 times the cost)."""
    spec = IMAGENET.model_copy(update={"resize": IMAGENET.resize.model_copy(update={"filter": filter_})})
    image = Image.effect_noise((320, 240), 60).convert("RGB")
    tensor = decode(encode(image, fmt), spec, LIMITS)
    assert tensor.shape == (3, 224, 224)
    assert tensor.stride() == (1, 224 * 3, 3)
    assert torch.equal(tensor, tensor.contiguous())
    tensor[0, 0, 0] = 7  # torch shares only writable memory


def test_a_wide_image_is_resized_then_centre_cropped_for_imagenet_models() -> None:
    image = Image.new("RGB", (640, 320), (0, 0, 0))
    image.paste((255, 0, 0), (0, 0, 160, 320))  # the left quarter is red and falls outside the crop
    tensor = decode(encode(image, "PNG"), IMAGENET, LIMITS)
    assert tensor.shape == (3, 224, 224)
    assert int(tensor[0].max()) == 0, "the crop keeps the centre only"


def test_transparent_pixels_become_a_dark_ground() -> None:
    image = Image.new("RGBA", (16, 16), (255, 255, 255, 0))
    assert int(decode(encode(image, "PNG"), DIGITS, LIMITS).max()) == 0


@pytest.mark.parametrize(
    "data",
    [encode(Image.new("RGB", (8, 8)), "GIF"), encode(Image.new("RGB", (8, 8)), "BMP"), b"hello, not an image"],
    ids=["gif", "bmp", "text"],
)
def test_other_formats_are_refused(data: bytes) -> None:
    with pytest.raises(BadRequest) as caught:
        decode(data, DIGITS, LIMITS)
    assert caught.value.code == "unsupported_image"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_a_truncated_image_is_undecodable(fmt: str) -> None:
    data = encode(Image.effect_noise((64, 64), 40).convert("RGB"), fmt)
    with pytest.raises(BadRequest) as caught:
        decode(data[: len(data) // 2], DIGITS, LIMITS)
    assert caught.value.code in {"undecodable_image", "unsupported_image"}


def test_too_many_bytes_is_413_before_decoding() -> None:
    data = encode(Image.new("L", (8, 8)), "PNG")
    with pytest.raises(PayloadTooLarge) as caught:
        decode(data, DIGITS, ImageLimits(max_bytes=len(data) - 1, max_pixels=100))
    assert caught.value.code == "image_too_large"


@pytest.mark.parametrize("size", [(2001, 2000), (20_000, 20_000), (60_000, 60_000)])
def test_a_decompression_bomb_is_413_from_its_header(size: tuple[int, int]) -> None:
    with pytest.raises(PayloadTooLarge) as caught:
        decode(png_header_only(*size), DIGITS, LIMITS)
    assert caught.value.code == "image_too_many_pixels"


@settings(max_examples=40, deadline=None)
@given(
    st.integers(min_value=1, max_value=300),
    st.integers(min_value=1, max_value=300),
    st.sampled_from(["L", "RGB", "RGBA", "P", "LA", "I;16"]),
    st.sampled_from(["PNG", "WEBP", "JPEG"]),
)
def test_any_size_and_mode_becomes_the_spec_shape(width: int, height: int, mode: str, fmt: str) -> None:
    if fmt == "JPEG" and mode not in ("L", "RGB"):
        mode = "RGB"
    if fmt == "WEBP" and mode in ("I;16", "P"):
        mode = "RGBA"
    data = encode(Image.new(mode, (width, height)), fmt)
    assert decode(data, DIGITS, LIMITS).shape == (1, 8, 8)
    assert decode(data, IMAGENET, LIMITS).shape == (3, 224, 224)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_bilinear_and_bicubic_resizes_are_torchs_not_pillows(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow's resize costs three times torch's (docs/performance.md, twentieth pass): the common
    filters never reach it, whichever decoder read the image."""
    data = encode(Image.effect_noise((320, 240), 60).convert("RGB"), fmt)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("Pillow's resize was called")

    monkeypatch.setattr(Image.Image, "resize", refuse)
    for filter_ in ("bilinear", "bicubic"):
        spec = IMAGENET.model_copy(update={"resize": IMAGENET.resize.model_copy(update={"filter": filter_})})
        assert decode(data, spec, LIMITS).shape == (3, 224, 224)
    with pytest.raises(AssertionError, match="Pillow's resize"):
        decode(data, IMAGENET.model_copy(update={"resize": ResizeSpec(filter="box")}), LIMITS)
