"""The images ``ai-backend limit`` measures with: deterministic synthetic photos, or a folder of JPEGs."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

IMAGE_SUFFIXES = (".jpg", ".jpeg")


def synthetic_photo(seed: int, width: int = 640, height: int = 480, quality: int = 90) -> bytes:
    """A deterministic photo-like JPEG: smooth colour gradients, filled shapes, soft edges, sensor noise.

    Flat or random images would mislead: JPEG decode time depends on how much detail
    survives quantisation, and these land near a real photo's size (about 70 KB here).
    """
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.empty((height, width, 3), np.float32)
    for channel in range(3):
        a, b, phase, tilt = rng.uniform(-1, 1, 4)
        base[..., channel] = 128 + 60 * np.sin(a * x / 90 + b * y / 70 + phase * 6) + 40 * tilt * (x / width - 0.5)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        box = (x0, y0, x0 + int(rng.integers(20, 250)), y0 + int(rng.integers(20, 200)))
        colour = (int(rng.integers(0, 256)), int(rng.integers(0, 256)), int(rng.integers(0, 256)))
        if rng.integers(0, 2):
            draw.ellipse(box, fill=colour)
        else:
            draw.rectangle(box, fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(1.5))
    noisy = np.asarray(image, dtype=np.float32) + rng.normal(0, 6, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def write_images(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` synthetic photos as ``folder/photo_NNN.jpg`` (rewritten every time, deterministic)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        path = folder / f"photo_{index:03d}.jpg"
        path.write_bytes(synthetic_photo(seed * 1000 + index))
        paths.append(path)
    return paths


def image_files(folder: Path) -> list[Path]:
    """The JPEGs in ``folder``, by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
