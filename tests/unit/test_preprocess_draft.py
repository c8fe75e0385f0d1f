"""JPEG draft mode and the crop-box resize: faster decoding that keeps the pixels."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torchvision import transforms

from app.bench.limit import synthetic_photo
from app.inference.manifest import InputSpec, ResizeSpec
from app.inference.preprocess import ImageLimits, decode, draft_size

IMAGENET = InputSpec(
    channels=3,
    height=224,
    width=224,
    resize=ResizeSpec(mode="shorter_side_then_center_crop", resize_to=256),
    mean=(0.485, 0.456, 0.406),
    std=(0.229, 0.224, 0.225),
)
LIMITS = ImageLimits(max_bytes=1 << 22, max_pixels=16_000_000)


def reference(image: Image.Image, spec: InputSpec) -> np.ndarray:
    """torchvision's own eval transform: the shorter side resized, then the centre cropped."""
    transform = transforms.Compose(
        [
            transforms.Resize(spec.resize.resize_to or 0, interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.CenterCrop((spec.height, spec.width)),
        ]
    )
    return np.asarray(transform(image.convert("RGB"))).transpose(2, 0, 1).astype(np.int16)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b) ** 2).mean())
    return 99.0 if mse == 0 else 10 * np.log10(255**2 / mse)


def jpeg(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


@pytest.mark.parametrize(
    ("size", "tolerance", "decoded"),
    [
        ((640, 480), 0.9, (320, 240)),  # 240 is 0.94 of the 256 the resize needs
        ((640, 480), 1.0, (640, 480)),  # never enlarge: no draft at all
        ((1280, 960), 1.0, (640, 480)),
        ((1280, 960), 0.9, (320, 240)),
        ((4000, 3000), 0.9, (500, 375)),
    ],
)
def test_draft_decodes_at_the_smallest_scale_within_the_tolerance(
    size: tuple[int, int], tolerance: float, decoded: tuple[int, int]
) -> None:
    image = Image.open(io.BytesIO(jpeg(Image.new("RGB", size, (90, 120, 150)))))
    image.draft("RGB", draft_size(*size, IMAGENET, tolerance))
    assert image.size == decoded


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=60, max_value=900), st.integers(min_value=60, max_value=900), st.integers(0, 2**16))
def test_the_resize_gives_the_pixels_of_torchvisions_resize_then_crop(width: int, height: int, seed: int) -> None:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    out = io.BytesIO()
    image.save(out, format="PNG")  # PNG: no draft mode, so only the resize differs
    tensor = decode(out.getvalue(), IMAGENET, LIMITS).numpy().astype(np.int16)
    assert tensor.shape == (3, 224, 224)
    # torch's resize rounds in fixed point of its own: on noise, a level apart in a few pixels in a
    # hundred (two, rarely); Pillow's crop box, before it, one level in about one in a thousand
    difference = np.abs(tensor - reference(image, IMAGENET))
    assert int(difference.max()) <= 2 and float(difference.mean()) <= 0.3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_drafted_photo_is_within_40_db_of_the_full_decode(seed: int) -> None:
    data = synthetic_photo(seed)
    drafted = decode(data, IMAGENET, LIMITS).numpy()
    exact = decode(data, IMAGENET, LIMITS, draft_tolerance=1.0).numpy()
    assert drafted.shape == exact.shape == (3, 224, 224)
    assert psnr(drafted, reference(Image.open(io.BytesIO(data)), IMAGENET)) > 40
    assert psnr(exact, reference(Image.open(io.BytesIO(data)), IMAGENET)) > 60
