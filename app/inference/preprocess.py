"""Image bytes to a uint8 ``C x H x W`` tensor (laid out ``H x W x C``), as the manifest's input spec says.

Runs in the preprocessing pool, or on the device thread whose batch the image rides
(``server.decode``), never on the event loop: there only ``encoded_payload``'s checks run.
The pixel count is checked from the header before anything is decoded, so a decompression
bomb costs nothing.
Normalisation is not done here: it happens once per batch, on the device.
"""

from __future__ import annotations

import functools
import io
import math
import struct
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from app.errors import BadRequest, PayloadTooLarge
from app.inference.encoded import base64_bytes, check_png_chunks, kind_of, undecodable
from app.inference.jpeg import (
    Header,
    HeaderTooLong,
    TooManyScans,
    check_scans,
    decode_reduced,
    draft_scale,
    pillow_image,
    read_header,
    reduced_size,
)
from app.inference.manifest import InputSpec

ACCEPTED_FORMATS = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}
_FILTERS = {
    "box": Image.Resampling.BOX,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
}
# The filters torch resizes uint8 images with (its antialiased kernels: ``F.interpolate(...,
# antialias=True)`` without the choice of output layout), Pillow's weights in fixed point of its
# own: a level apart in a few pixels in a hundred. About three times faster than Pillow's here
# (docs/performance.md, twentieth pass). The others, and fit_content's own crop, keep Pillow's.
_TORCH_FILTERS = {
    "bilinear": torch.ops.aten._upsample_bilinear2d_aa.out,
    "bicubic": torch.ops.aten._upsample_bicubic2d_aa.out,
}
# JPEG draft mode may decode at a scale that leaves this share of the pixels the resize
# needs, so the resize then enlarges by at most 1/0.9. A 640x480 photo for a 256-then-224
# crop decodes at 320x240 instead of 640x480: about half the CPU of the whole decode, and
# the 224x224 result differs from the full decode by 40-46 dB PSNR on smooth pictures, but
# 25-38 dB on detailed photos at some sizes (README; ``server.jpeg_reduced_decode=false``
# decodes whole). 1.0 never enlarges. A side the scale does not divide loses its partial last
# pixel (``jpeg.reduced_size``).
DRAFT_TOLERANCE = 0.9
ORIENTATION = 0x0112  # the EXIF tag
# what each EXIF orientation but 1 asks a viewer to do to the stored pixels (ImageOps.exif_transpose's
# table): applied plainly, without exif_transpose's rewriting of the EXIF, which raised struct.error
# (a 500) for tags stored with another type than Pillow's table says (a signed XResolution, say)
_TRANSPOSES = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
UNSUPPORTED = "not a JPEG, PNG or WebP image"


@dataclass(frozen=True)
class ImageLimits:
    """Bytes and pixels one image may have, and whether a large JPEG may be decoded at a reduced
    scale (``reduce_jpeg``: ``server.jpeg_reduced_decode``)."""

    max_bytes: int
    max_pixels: int
    reduce_jpeg: bool = True


def _check_size(data: bytes, limits: ImageLimits) -> None:
    if len(data) > limits.max_bytes:
        raise PayloadTooLarge(f"image is {len(data)} bytes; the limit is {limits.max_bytes}", code="image_too_large")


def _open(data: bytes, limits: ImageLimits) -> Image.Image:
    _check_size(data, limits)
    check_png_chunks(data)
    try:
        image = Image.open(io.BytesIO(data), formats=list(ACCEPTED_FORMATS))
    except UnidentifiedImageError as exc:
        if kind_of(data) is None:
            raise BadRequest(UNSUPPORTED, code="unsupported_image") from exc
        raise undecodable(exc, data, "header") from exc  # Pillow knew the signature, not what follows it
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise PayloadTooLarge("image has too many pixels", code="image_too_many_pixels") from exc
    except (OSError, SyntaxError, ValueError, struct.error) as exc:  # a known format, but its header is broken
        raise undecodable(exc, data, "header") from exc
    width, height = image.size
    if width * height > limits.max_pixels:
        raise PayloadTooLarge(
            f"image is {width}x{height} = {width * height} pixels; the limit is {limits.max_pixels}",
            code="image_too_many_pixels",
        )
    return image


_GROUNDS = {"black": 0, "white": 255}  # the grey of each background a manifest may name


def _to_mode(image: Image.Image, channels: int, background: str = "black") -> Image.Image:
    """``image`` as ``L`` or ``RGB``, its transparent pixels made as ``background`` says
    (``InputSpec.background``: composited onto black or white, or the alpha dropped)."""
    mode = "L" if channels == 1 else "RGB"
    ground = _GROUNDS.get(background)  # None: the alpha is dropped, the stored colours kept
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        # 16-bit grey (a PNG's): Pillow's conversions clip at 255, so scale it to 8 bits first
        # (clipped before the cast: mode I is signed, and a negative value would wrap to white)
        wide = np.clip(np.asarray(image), 0, 65535).astype(np.uint16)
        gray = (wide >> 8).astype(np.uint8)
        if isinstance(key := image.info.get("transparency"), int) and ground is not None:
            gray[wide == key] = ground  # its transparent grey (tRNS), which the rebuilt image would not know of
        image = Image.fromarray(gray, mode="L")
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        # A palette's transparency, or a grey or colour PNG's transparent colour (its tRNS chunk),
        # is only in ``info``: convert applies it (such pixels came out as their colour, white say)
        image = image.convert("RGBA")
        if ground is not None:
            image = Image.alpha_composite(Image.new("RGBA", image.size, (ground, ground, ground, 255)), image)
    return image.convert(mode) if image.mode != mode else image


def _fit_content(image: Image.Image, threshold: float, max_pixels: int, resample: Image.Resampling) -> Image.Image:
    """The content's bounding box, centred in a square of its longer side (dark padding).

    The square is never more pixels than an accepted image may have: a 1 x 16,000,000 strip
    passes the pixel limit, but its square would not (the content is shrunk first)."""
    gray = image if image.mode == "L" else image.convert("L")
    peak = gray.getextrema()[1]
    assert isinstance(peak, int)
    box = gray.point(lambda v: 255 if v > threshold * peak else 0).getbbox() if peak > 0 else None
    if box is None:
        return image
    content = image.crop(box)
    side, most = max(content.size), math.isqrt(max_pixels)
    if side > most:
        scale = most / side
        content = content.resize(
            (max(1, round(content.width * scale)), max(1, round(content.height * scale))), resample
        )
        side = max(content.size)
    square = Image.new(image.mode, (side, side))
    square.paste(content, ((side - content.width) // 2, (side - content.height) // 2))
    return square


def _resized_size(width: int, height: int, spec: InputSpec) -> tuple[int, int]:
    """The size the whole image is resized to before the centre crop (at least the crop):
    the shorter side to ``resize_to``, the longer truncated, as torchvision's ``Resize``."""
    short = spec.resize.resize_to or min(spec.width, spec.height)
    if width <= height:
        return max(spec.width, short), max(spec.height, int(short * height / width))
    return max(spec.width, int(short * width / height)), max(spec.height, short)


def _needed_size(width: int, height: int, spec: InputSpec) -> tuple[int, int]:
    """The fewest pixels the decoded image needs for the resize to shrink it, not enlarge it."""
    if spec.resize.mode == "shorter_side_then_center_crop":
        return _resized_size(width, height, spec)
    return spec.width, spec.height


def _crop_origin(resized_width: int, resized_height: int, spec: InputSpec) -> tuple[int, int]:
    """Where the centre crop starts in the resized image, as torchvision's ``CenterCrop``."""
    return round((resized_width - spec.width) / 2), round((resized_height - spec.height) / 2)


def _by_torch(spec: InputSpec) -> bool:
    """Whether ``_resized_tensor`` resizes for ``spec`` (else Pillow's ``_resize``)."""
    return spec.resize.mode != "fit_content" and spec.resize.filter in _TORCH_FILTERS


def _torch_resize_fits(width: int, height: int, spec: InputSpec, max_pixels: int) -> bool:
    """Whether the whole image ``_resized_tensor`` builds before its crop has at most ``max_pixels``,
    as an accepted image has. The shorter side goes to ``resize_to``, so a thin strip grows along
    its longer one: a 16383 x 1 WebP of 526 bytes became a 4,194,048 x 256 tensor (3.2 GB), a 65500 x 8
    JPEG of 17 KB one of 1.6 GB, and a 16,000,000 x 1 PNG a 500 (3 TB refused). Pillow's ``_resize``
    resizes only the box that becomes the crop, whatever the whole would be."""
    if spec.resize.mode == "stretch":
        return True
    resized_width, resized_height = _resized_size(width, height, spec)
    return resized_width * resized_height <= max_pixels


def _resized_tensor(pixels: np.ndarray, spec: InputSpec) -> torch.Tensor:
    """``H x W x C`` uint8 pixels (``C`` the spec's channels) resized and cropped as the spec says,
    by torch's uint8 kernels: a writable ``C x H x W`` tensor laid out ``H x W x C``, as ``_tensor``
    gives.

    The whole image is resized and its centre then cropped, as torchvision does (torch cannot
    resize a box of the source alone, and is the faster all the same). The kernel is asked to
    write channels-last: left to choose, it returns N x C x H x W, converted at a cost of its own
    (0.35 against 0.14 ms for a 320x240 RGBX photo to 341x256), and the crop would then be a
    transposing copy."""
    height, width, bands = pixels.shape
    if spec.resize.mode == "stretch":
        (resized_width, resized_height), (left, top) = (spec.width, spec.height), (0, 0)
    else:
        resized_width, resized_height = _resized_size(width, height, spec)
        left, top = _crop_origin(resized_width, resized_height, spec)
    image = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)  # 1 x C x H x W over H x W x C: channels-last
    resized = torch.empty((1, resized_height, resized_width, bands), dtype=torch.uint8).permute(0, 3, 1, 2)
    _TORCH_FILTERS[spec.resize.filter](image, [resized_height, resized_width], False, None, None, out=resized)
    crop = resized[0, :, top : top + spec.height, left : left + spec.width].permute(1, 2, 0).contiguous()
    return crop.permute(2, 0, 1)


def _resize(image: Image.Image, spec: InputSpec, max_pixels: int) -> Image.Image:
    resample = _FILTERS[spec.resize.filter]
    if spec.resize.mode == "fit_content":
        image = _fit_content(image, spec.resize.content_threshold, max_pixels, resample)
    if spec.resize.mode in ("stretch", "fit_content"):
        return image.resize((spec.width, spec.height), resample)
    # Resizing the whole image and then cropping its centre computes pixels only to throw
    # them away; resizing just the source box that becomes the crop gives the same pixels
    # (the filter still reads the neighbours outside the box) for about half the work.
    width, height = image.size
    resized_width, resized_height = _resized_size(width, height, spec)
    left, top = _crop_origin(resized_width, resized_height, spec)
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
    if len(data) <= limits.max_bytes:  # (beyond it, _open refuses it before any work)
        try:
            header = read_header(data)  # None: no JPEG
            if header is not None:
                check_scans(data, header, limits.max_pixels)
        except (HeaderTooLong, TooManyScans) as exc:
            raise BadRequest(str(exc), code="undecodable_image") from exc
        pixels = _decode_reduced(data, header, spec, limits, draft_tolerance) if header is not None else None
        if pixels is not None:
            height, width = pixels.shape[:2]
            if _by_torch(spec) and _torch_resize_fits(width, height, spec, limits.max_pixels):
                return _resized_tensor(pixels, spec)
            return _tensor(_resize(pillow_image(pixels), spec, limits.max_pixels))
    image = _open(data, limits)
    turned = _orientation(image)
    try:
        # fit_content crops a box of unknown size first: a draft scaled to the output would
        # leave a small digit in a large photo a few pixels wide
        if image.format == "JPEG" and spec.resize.mode != "fit_content":
            width, height = image.size if turned < 5 else image.size[::-1]  # 5-8: a quarter turn
            wanted = draft_size(width, height, spec, draft_tolerance) if limits.reduce_jpeg else (width, height)
            # asked for the whole pixels at that scale, Pillow picks it (at 1 the draft still sets
            # the decoder's colour mode); a partial last pixel is cut off as on the fast path
            whole = reduced_size(*image.size, draft_scale(*image.size, wanted if turned < 5 else wanted[::-1]))
            image.draft("L" if spec.channels == 1 else "RGB", whole)
            if image.size != whole:
                image = image.crop((0, 0, *whole))
        image.load()
        if turned != 1:
            image = image.transpose(_TRANSPOSES[turned])
        image = _to_mode(image, spec.channels, spec.background)
        if _by_torch(spec) and _torch_resize_fits(*image.size, spec, limits.max_pixels):
            return _resized_tensor(_pixels(image), spec)
        image = _resize(image, spec, limits.max_pixels)
    except (OSError, SyntaxError, ValueError, struct.error, Image.DecompressionBombError) as exc:
        raise undecodable(exc, data, "data") from exc
    return _tensor(image)


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation of an opened image, 1 to 8 (1: as stored). A photo stored on its side
    says so in its EXIF (as phones write them), and is served upright. Metadata never decides
    whether an image is served: an EXIF Pillow cannot parse (a TIFF header cut short raised
    struct.error, a 500) counts as no orientation, as browsers show such a file as stored."""
    if image.format == "PNG":
        return 1
    try:
        tag = image.getexif().get(ORIENTATION, 1)
    except Exception:  # whatever Pillow's EXIF parser raises on a client's bytes
        return 1
    return tag if isinstance(tag, int) and 1 <= tag <= 8 else 1  # another type or value: as stored


def _decode_reduced(
    data: bytes, header: Header, spec: InputSpec, limits: ImageLimits, draft_tolerance: float
) -> np.ndarray | None:
    """The common case, a JPEG photo (``header``: its walk), in one call without the GIL
    (``app.inference.jpeg``), or None: Pillow decodes it, with the same pixels. fit_content crops a
    box of unknown size first, so it never drafts (see ``decode``)."""
    if spec.resize.mode == "fit_content":
        return None
    # Image.open refuses more than twice Pillow's own bomb limit, whatever max_pixels allows
    most = min(limits.max_pixels, 2 * Image.MAX_IMAGE_PIXELS) if Image.MAX_IMAGE_PIXELS else limits.max_pixels
    wanted = functools.partial(draft_size, spec=spec, tolerance=draft_tolerance) if limits.reduce_jpeg else _whole
    return decode_reduced(data, spec.channels, wanted, most, padded=not _by_torch(spec), header=header)


def _whole(width: int, height: int) -> tuple[int, int]:
    """Every pixel: a JPEG decoded at full scale (``server.jpeg_reduced_decode=false``)."""
    return width, height


def _pixels(image: Image.Image) -> np.ndarray:
    """A Pillow image's pixels as a writable ``H x W x C`` copy (torch shares only writable memory),
    three bytes a colour pixel: the fast path's RGBX loses its padding byte here, in Pillow's
    conversion (0.09 ms an image). Left in memory, it made the device thread's batch a strided copy,
    0.21 ms an image (docs/performance.md, twentieth pass)."""
    array = np.array(image.convert("RGB") if image.mode == "RGBX" else image, dtype=np.uint8)
    return array if array.ndim == 3 else array[:, :, None]


def _tensor(image: Image.Image) -> torch.Tensor:
    """The pixels as a ``C x H x W`` tensor laid out ``H x W x C``, as Pillow holds them, not
    transposed. The device thread lays the batch out as its backbone takes it
    (``LayeredModel.batch``): for a channels-last one, that is this layout already, one plain copy an
    image; transposed here, each image cost the decode thread 0.12 ms."""
    return torch.from_numpy(_pixels(image)).permute(2, 0, 1)


class Encoded:
    """An image still encoded, checked as far as is cheap (base64, size), decoded later by the
    device thread whose batch it rides (``server.decode=batch``): the event loop's part is a
    few microseconds, and the thread that runs the batch decodes its images just before the
    forward pass, so no decode thread competes with the device threads for the cores.
    ``decode_s`` is set by the decode, on that thread, before the batch's answers go back."""

    __slots__ = ("data", "decode_s", "limits", "spec")

    def __init__(self, data: bytes, spec: InputSpec, limits: ImageLimits) -> None:
        self.data, self.spec, self.limits = data, spec, limits
        self.decode_s = 0.0

    def decode(self) -> torch.Tensor:
        """``decode``: the tensor, or ``BadRequest`` or ``PayloadTooLarge``."""
        started = time.perf_counter()
        try:
            return decode(self.data, self.spec, self.limits)
        finally:
            self.decode_s = time.perf_counter() - started


def encoded_payload(payload: bytes | str, spec: InputSpec, limits: ImageLimits) -> Encoded:
    """An image as bytes, or as a JSON body's base64 text, checked for what costs microseconds
    (strict base64, by SIMD: about 4 µs for 90 KB; the byte limit; the format's signature, as
    Pillow tells its formats apart) and kept encoded: what is no image at all is refused now,
    not once its batch runs. One that is broken further in is refused by its batch."""
    data = payload if isinstance(payload, bytes) else base64_bytes(payload)
    _check_size(data, limits)
    if kind_of(data) is None:  # no JPEG, PNG or WebP start: the prefixes Pillow's plugins accept
        raise BadRequest(UNSUPPORTED, code="unsupported_image")
    return Encoded(data, spec, limits)


def decode_payload(payload: bytes | str, spec: InputSpec, limits: ImageLimits) -> torch.Tensor:
    """An image as bytes, or as a JSON body's base64 text, to a tensor (in the decode pool).

    Base64 decoding holds the GIL for about 0.2 ms per 90 KB image; on the event loop that
    is time no other request is served, so it happens here, beside the image decoding.
    """
    return decode(payload if isinstance(payload, bytes) else base64_bytes(payload), spec, limits)
