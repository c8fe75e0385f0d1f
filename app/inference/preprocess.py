"""Image bytes to a uint8 ``C x H x W`` tensor, as the manifest's input spec says.

Runs in the preprocessing pool, never on the event loop. The pixel count is checked
from the header before anything is decoded, so a decompression bomb costs nothing.
Normalisation is not done here: it happens once per batch, on the device.
"""

from __future__ import annotations

import binascii
import io
import math
from dataclasses import dataclass

import numpy as np
import pybase64
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
# JPEG draft mode may decode at a scale that leaves this share of the pixels the resize
# needs, so the resize then enlarges by at most 1/0.9. A 640x480 photo for a 256-then-224
# crop decodes at 320x240 instead of 640x480: about half the CPU of the whole decode, and
# the 224x224 result differs from the full decode by about 46 dB PSNR (mean 0.9 of 255),
# less than the JPEG quantisation at quality 90 changed the photo. 1.0 never enlarges.
DRAFT_TOLERANCE = 0.9


@dataclass(frozen=True)
class ImageLimits:
    """Bytes and pixels one image may have."""

    max_bytes: int
    max_pixels: int


def base64_bytes(text: str) -> bytes:
    """Strict standard base64 (padded, no other characters) to bytes; 400 ``invalid_base64`` otherwise.

    pybase64 decodes with SIMD instructions where the CPU has them: a 90 KB image in about
    4 µs, against 170 µs for ``binascii.a2b_base64(strict_mode=True)``, time in which the
    decode thread holds the GIL and the event loop waits for it. It is also the stricter of
    the two: it refuses padding after a whole group (``QUJD=``), which binascii takes.
    """
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:  # ValueError: characters outside ASCII
        raise BadRequest("image_base64 is not valid base64", code="invalid_base64") from exc


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


def _resized_size(width: int, height: int, spec: InputSpec) -> tuple[int, int]:
    """The size the whole image is resized to before the centre crop (at least the crop)."""
    scale = (spec.resize.resize_to or min(spec.width, spec.height)) / min(width, height)
    return max(spec.width, round(width * scale)), max(spec.height, round(height * scale))


def _needed_size(width: int, height: int, spec: InputSpec) -> tuple[int, int]:
    """The fewest pixels the decoded image needs for the resize to shrink it, not enlarge it."""
    if spec.resize.mode == "shorter_side_then_center_crop":
        return _resized_size(width, height, spec)
    return spec.width, spec.height


def _resize(image: Image.Image, spec: InputSpec) -> Image.Image:
    resample = _FILTERS[spec.resize.filter]
    if spec.resize.mode == "fit_content":
        image = _fit_content(image, spec.resize.content_threshold)
    if spec.resize.mode in ("stretch", "fit_content"):
        return image.resize((spec.width, spec.height), resample)
    # Resizing the whole image and then cropping its centre computes pixels only to throw
    # them away; resizing just the source box that becomes the crop gives the same pixels
    # (the filter still reads the neighbours outside the box) for about half the work.
    width, height = image.size
    resized_width, resized_height = _resized_size(width, height, spec)
    left = (resized_width - spec.width) // 2
    top = (resized_height - spec.height) // 2
    x_scale, y_scale = resized_width / width, resized_height / height
    box = (left / x_scale, top / y_scale, (left + spec.width) / x_scale, (top + spec.height) / y_scale)
    return image.resize((spec.width, spec.height), resample, box=box)


def blank_png(width: int, height: int) -> bytes:
    """A black PNG, for warming the decoding pool."""
    buffer = io.BytesIO()
    Image.new("L", (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


def draft_size(width: int, height: int, spec: InputSpec, tolerance: float = DRAFT_TOLERANCE) -> tuple[int, int]:
    """The size to ask JPEG draft mode for: the needed size, less the tolerated shortfall.

    libjpeg can decode at 1/2, 1/4 or 1/8 scale for a fraction of the work, and Pillow
    picks the smallest scale that is still at least the size asked for.
    """
    needed_width, needed_height = _needed_size(width, height, spec)
    return max(1, math.ceil(needed_width * tolerance)), max(1, math.ceil(needed_height * tolerance))


def decode(data: bytes, spec: InputSpec, limits: ImageLimits, draft_tolerance: float = DRAFT_TOLERANCE) -> torch.Tensor:
    """Decode, validate and resize one image; raises ``BadRequest`` or ``PayloadTooLarge``.

    A JPEG is decoded at a reduced scale when that still leaves at least
    ``draft_tolerance`` of the pixels the resize needs (1.0: never enlarge afterwards).
    """
    image = _open(data, limits)
    try:
        if image.format == "JPEG":
            image.draft("L" if spec.channels == 1 else "RGB", draft_size(*image.size, spec, draft_tolerance))
        image.load()
        image = _resize(_to_mode(image, spec.channels), spec)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise BadRequest("the image could not be decoded", code="undecodable_image") from exc
    array = np.asarray(image, dtype=np.uint8)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(array.transpose(2, 0, 1).copy())


def decode_payload(payload: bytes | str, spec: InputSpec, limits: ImageLimits) -> torch.Tensor:
    """An image as bytes, or as a JSON body's base64 text, to a tensor (in the decode pool).

    Base64 decoding holds the GIL for about 0.2 ms per 90 KB image; on the event loop that
    is time no other request is served, so it happens here, beside the image decoding.
    """
    return decode(payload if isinstance(payload, bytes) else base64_bytes(payload), spec, limits)
