"""Image bytes to a uint8 ``C x H x W`` tensor, as the manifest's input spec says.

Runs in the preprocessing pool, never on the event loop. The pixel count is checked
from the header before anything is decoded, so a decompression bomb costs nothing.
Normalisation is not done here: it happens once per batch, on the device.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from app.errors import BadRequest, PayloadTooLarge
from app.inference.manifest import InputSpec

ACCEPTED_FORMATS = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}
_FILTERS = {
    "box": Image.Resampling.BOX,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
}


@dataclass(frozen=True)
class ImageLimits:
    """Bytes and pixels one image may have."""

    max_bytes: int
    max_pixels: int


def _open(data: bytes, limits: ImageLimits) -> Image.Image:
    if len(data) > limits.max_bytes:
        raise PayloadTooLarge(f"image is {len(data)} bytes; the limit is {limits.max_bytes}", code="image_too_large")
    try:
        image = Image.open(io.BytesIO(data), formats=list(ACCEPTED_FORMATS))
    except UnidentifiedImageError as exc:
        raise BadRequest("not a JPEG, PNG or WebP image", code="unsupported_image") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise PayloadTooLarge("image has too many pixels", code="image_too_many_pixels") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # a known format, but its header is broken
        raise BadRequest("the image could not be decoded", code="undecodable_image") from exc
    width, height = image.size
    if width * height > limits.max_pixels:
        raise PayloadTooLarge(
            f"image is {width}x{height} = {width * height} pixels; the limit is {limits.max_pixels}",
            code="image_too_many_pixels",
        )
    return image


def _to_mode(image: Image.Image, channels: int) -> Image.Image:
    mode = "L" if channels == 1 else "RGB"
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        # transparent pixels become black: the bundled model reads light digits on a dark ground
        rgba = image.convert("RGBA")
        ground = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
        image = Image.alpha_composite(ground, rgba)
    return image.convert(mode) if image.mode != mode else image


def _fit_content(image: Image.Image, threshold: float) -> Image.Image:
    """The content's bounding box, centred in a square of its longer side (dark padding)."""
    gray = image if image.mode == "L" else image.convert("L")
    peak = gray.getextrema()[1]
    assert isinstance(peak, int)
    box = gray.point(lambda v: 255 if v > threshold * peak else 0).getbbox() if peak > 0 else None
    if box is None:
        return image
    content = image.crop(box)
    side = max(content.size)
    square = Image.new(image.mode, (side, side))
    square.paste(content, ((side - content.width) // 2, (side - content.height) // 2))
    return square


def _resize(image: Image.Image, spec: InputSpec) -> Image.Image:
    resample = _FILTERS[spec.resize.filter]
    if spec.resize.mode == "fit_content":
        image = _fit_content(image, spec.resize.content_threshold)
    if spec.resize.mode in ("stretch", "fit_content"):
        return image.resize((spec.width, spec.height), resample)
    shorter = spec.resize.resize_to or min(spec.width, spec.height)
    width, height = image.size
    scale = shorter / min(width, height)
    resized = image.resize((max(spec.width, round(width * scale)), max(spec.height, round(height * scale))), resample)
    left = (resized.width - spec.width) // 2
    top = (resized.height - spec.height) // 2
    return resized.crop((left, top, left + spec.width, top + spec.height))


def blank_png(width: int, height: int) -> bytes:
    """A black PNG, for warming the decoding pool."""
    buffer = io.BytesIO()
    Image.new("L", (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


def decode(data: bytes, spec: InputSpec, limits: ImageLimits) -> torch.Tensor:
    """Decode, validate and resize one image; raises ``BadRequest`` or ``PayloadTooLarge``."""
    image = _open(data, limits)
    try:
        if image.format == "JPEG":
            # let libjpeg decode at a reduced scale that is still at least the target size
            target = spec.resize.resize_to or max(spec.width, spec.height)
            image.draft("L" if spec.channels == 1 else "RGB", (target, target))
        image.load()
        image = _resize(_to_mode(image, spec.channels), spec)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise BadRequest("the image could not be decoded", code="undecodable_image") from exc
    array = np.asarray(image, dtype=np.uint8)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(array.transpose(2, 0, 1).copy())
