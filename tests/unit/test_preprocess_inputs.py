"""Inputs that decoded wrong or cost too much (found in review): a strip whose content square
would outgrow the pixel limit, 16-bit grey, EXIF orientation, a small digit in a large JPEG,
and torchvision's own resize-then-crop arithmetic."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from app.errors import BadRequest
from app.inference.manifest import InputSpec, Manifest
from app.inference.preprocess import ImageLimits, decode
from tests.support import DIGITS_DIR, png_from_array, sample_png
from tests.unit.test_preprocess import IMAGENET, LIMITS

DIGITS = Manifest.read(DIGITS_DIR / "1").input  # fit_content, box, 8x8: the bundled model's spec


def _thin_strip(height: int) -> bytes:
    """A 1-pixel-wide PNG whose top and bottom pixels are white: its content spans its height."""
    pixels = np.zeros((height, 1), dtype=np.uint8)
    pixels[0] = pixels[-1] = 255
    return png_from_array(pixels)


def test_fit_content_never_builds_an_image_larger_than_the_pixel_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """fit_content pastes the content into a square of its LONGER side: a 1 x N strip
    (N pixels, well under max_pixels, a ~100-byte PNG) becomes an N x N image. 1 x 100000
    made a 10 GB allocation and 39 s of CPU; 1 x 16,000,000 (a 31 KB PNG, under the default
    16M pixel limit) got the process OOM-killed. The pixel limit is bypassed after the check."""
    biggest: list[int] = [0]
    real_new = Image.new

    def spy_new(mode: str, size: tuple[int, int], *args: object, **kwargs: object) -> Image.Image:
        biggest[0] = max(biggest[0], size[0] * size[1])
        if size[0] * size[1] > LIMITS.max_pixels:  # refuse before allocating, so the test stays cheap
            raise AssertionError(f"preprocess allocates a {size[0]}x{size[1]} image")
        return real_new(mode, size, *args, **kwargs)

    monkeypatch.setattr(Image, "new", spy_new)
    data = _thin_strip(5_000)  # 5,000 pixels, under 100 bytes
    assert len(data) < 200
    tensor = decode(data, DIGITS, LIMITS)  # decoded, its content shrunk before the square is built
    assert tuple(tensor.shape) == (1, DIGITS.height, DIGITS.width)
    assert biggest[0] <= LIMITS.max_pixels


def test_a_16_bit_grayscale_png_keeps_its_gray_levels() -> None:
    """Pillow opens a 16-bit grayscale PNG as mode I;16 and convert('L') clips at 255:
    a mid-gray (30000 of 65535, 46%) image decodes as pure white, for both 1- and 3-channel specs."""
    mid = Image.fromarray(np.full((32, 32), 30000, dtype=np.uint16))
    assert mid.mode == "I;16"
    buffer = io.BytesIO()
    mid.save(buffer, format="PNG")
    expected = 30000 / 257  # about 117
    for spec in (IMAGENET, InputSpec(channels=1, height=8, width=8, mean=(0.5,), std=(0.5,))):
        got = float(decode(buffer.getvalue(), spec, LIMITS).float().mean())
        assert abs(got - expected) < 2, f"{spec.channels} channel(s): mean {got}, expected about {expected:.0f}"


def _exif_rotated_jpeg(upright: Image.Image) -> bytes:
    """The JPEG a phone writes: pixels stored rotated, EXIF orientation 6 ('rotate 90 CW to view')."""
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # counter-clockwise; a viewer turns it back
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    stored.convert("RGB").save(buffer, format="JPEG", quality=95, exif=exif.tobytes())
    return buffer.getvalue()


def test_exif_orientation_is_applied() -> None:
    """Browsers and viewers show a JPEG turned by its EXIF orientation; the service decodes the
    stored pixels, so a phone photo reaches the model sideways."""
    upright = Image.open(io.BytesIO(sample_png(7))).convert("L").resize((96, 64))  # not square
    upright_jpeg = io.BytesIO()
    upright.convert("RGB").save(upright_jpeg, format="JPEG", quality=95)
    spec = InputSpec(channels=1, height=16, width=24, mean=(0.5,), std=(0.5,))  # stretch, 24 wide x 16 tall
    expected = decode(upright_jpeg.getvalue(), spec, LIMITS).float()
    got = decode(_exif_rotated_jpeg(upright), spec, LIMITS).float()
    assert float((got - expected).abs().mean()) < 20, "the EXIF orientation was ignored"


def test_a_small_digit_in_a_large_jpeg_decodes_like_the_same_png() -> None:
    """For fit_content, draft mode sizes the JPEG decode for the 8x8 OUTPUT (asks libjpeg for
    ~8x8, so it decodes at 1/8 scale) although the resize only applies to the content box
    found afterwards. A 48-pixel digit in a 640x640 photo is decoded as 6 pixels: the JPEG and
    the PNG of the same picture differ by ~32/255 on average, and the bundled model's accuracy
    on such JPEGs falls from 98/100 (PNG, or JPEG fully decoded) to 73/100."""
    from app.inference.loader import LayeredModel
    from app.training.digits import load_split

    split = load_split(0)
    folder = DIGITS_DIR / "1"
    model = LayeredModel.load(folder, Manifest.read(folder), torch.device("cpu"), torch.float32)
    agree = 0
    diffs = []
    count = 40
    for index in range(count):
        digit = Image.fromarray(split.heldout_images[index]).resize((48, 48), Image.Resampling.BILINEAR)
        canvas = Image.new("L", (640, 640))
        canvas.paste(digit, (200, 160))
        png, jpeg = io.BytesIO(), io.BytesIO()
        canvas.save(png, format="PNG")
        canvas.save(jpeg, format="JPEG", quality=95)
        from_png = decode(png.getvalue(), DIGITS, LIMITS)
        from_jpeg = decode(jpeg.getvalue(), DIGITS, LIMITS)
        diffs.append(float((from_png.float() - from_jpeg.float()).abs().mean()))
        with torch.inference_mode():
            a, b = model.probabilities(torch.stack([from_png, from_jpeg])).argmax(dim=1).tolist()
        agree += a == b
    assert np.mean(diffs) < 8, f"JPEG vs PNG of the same picture: mean abs difference {np.mean(diffs):.1f}/255"
    assert agree >= count - 2, f"the model answers differently for JPEG and PNG on {count - agree} of {count}"


def test_shorter_side_then_center_crop_matches_torchvision_preprocessing() -> None:
    """export.py takes resize/crop/filter from torchvision's weights metadata, so the served
    input should be what torchvision's transforms give. torchvision sizes the long side with
    int() (300 * 256 / 257 = 298.8 -> 298), the service with round() (-> 299): for a 257x300
    photo every row is shifted/scaled by about half a pixel (mean |diff| ~5/255, max ~40)."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as tvf

    from app.inference.export import input_spec_for

    spec = input_spec_for("mobilenet_v3_small")
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (38, 33, 3), dtype=np.uint8)).resize(
        (257, 300), Image.Resampling.BICUBIC
    )
    buffer = io.BytesIO()
    photo.save(buffer, format="PNG")
    ours = decode(buffer.getvalue(), spec, ImageLimits(1 << 22, 4_000_000)).float()
    resized = tvf.resize(photo, spec.resize.resize_to, interpolation=InterpolationMode.BILINEAR, antialias=True)
    theirs = tvf.pil_to_tensor(tvf.center_crop(resized, spec.height)).float()
    assert float((ours - theirs).abs().mean()) < 1.0, float((ours - theirs).abs().mean())


def _jpeg_with_orientation(kind: int, count: int, value: bytes) -> bytes:
    """A JPEG whose EXIF holds one entry, Orientation, of TIFF type ``kind`` (hand-built:
    Pillow's writer forces the tag's standard type)."""
    entry = struct.pack("<HHI", 0x0112, kind, count) + value.ljust(4, b"\0")
    tiff = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1) + entry + struct.pack("<I", 0)
    out = io.BytesIO()
    Image.new("RGB", (320, 240), (200, 30, 30)).save(out, "JPEG", exif=b"Exif\x00\x00" + tiff)
    return out.getvalue()


@pytest.mark.parametrize(
    ("kind", "count", "value"),
    [(2, 2, b"6\0"), (7, 1, b"\x06")],
    ids=["ascii", "undefined"],
)
def test_an_orientation_tag_of_another_type_is_a_400_or_ignored(kind: int, count: int, value: bytes) -> None:
    data = _jpeg_with_orientation(kind, count, value)
    assert Image.open(io.BytesIO(data)).getexif().get(0x0112) in ("6", b"\x06")
    tensor = decode(data, IMAGENET, LIMITS)  # as stored: the tag says nothing a viewer could read
    assert tuple(tensor.shape) == (3, 224, 224)


def test_a_32_bit_grey_image_is_scaled_and_clipped_not_wrapped() -> None:
    from app.inference.preprocess import _to_mode

    signed = Image.fromarray(np.array([[-5, 0, 30000, 70000]], dtype=np.int32))
    assert signed.mode == "I"
    assert np.asarray(_to_mode(signed, 1)).tolist() == [[0, 0, 117, 255]], "a negative value is black, not white"


@pytest.mark.parametrize(
    ("fmt", "size"),
    [("PNG", (4_000_000, 1)), ("PNG", (1, 100_000)), ("WEBP", (16_383, 1)), ("JPEG", (4_000, 2)), ("JPEG", (8, 8_000))],
)
def test_a_thin_strip_is_not_resized_whole_before_the_crop(
    fmt: str, size: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """shorter_side_then_center_crop takes the shorter side to resize_to: torch's resize of the
    whole image made a 16383 x 1 WebP (526 bytes) a 4,194,048 x 256 tensor, 3.2 GB and 8 s of a
    served request, and a 16,000,000 x 1 PNG a 500 (3 TB, refused by the allocator). The crop's
    pixels alone are computed instead, as Pillow's box resize does."""
    real_empty = torch.empty

    def spy_empty(*shape: object, **kwargs: object) -> torch.Tensor:
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        cells = int(np.prod([int(d) for d in dims]))  # type: ignore[call-overload]
        if cells > 3 * LIMITS.max_pixels:  # refuse before allocating, so the test stays cheap
            raise AssertionError(f"preprocess allocates a tensor of {cells} bytes")
        return real_empty(*shape, **kwargs)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(torch, "empty", spy_empty)
    buffer = io.BytesIO()
    Image.new("RGB", size, (90, 120, 150)).save(buffer, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    tensor = decode(buffer.getvalue(), IMAGENET, LIMITS)
    assert tuple(tensor.shape) == (3, IMAGENET.height, IMAGENET.width)
    assert [round(float(band.float().mean())) for band in tensor] == pytest.approx([90, 120, 150], abs=3)


def _repeated_last_scan(times: int) -> bytes:
    """A progressive grey JPEG with its last scan written ``times`` more times: each repeat is a
    few dozen bytes and another pass of the decoder over every block of the image."""
    buffer = io.BytesIO()
    Image.new("L", (256, 256)).save(buffer, format="JPEG", progressive=True)
    data = buffer.getvalue()
    last, end = data.rindex(b"\xff\xda"), len(data) - 2  # the last scan, up to the EOI
    return data[:end] + data[last:end] * times + data[end:]


@pytest.mark.parametrize("spec", [DIGITS, IMAGENET], ids=["fit_content", "crop"])
def test_a_jpeg_of_a_thousand_scans_is_refused_before_decoding(spec: InputSpec) -> None:
    """A 4000 x 4000 grey JPEG with its last scan repeated 1,000 times (94 KB) took a decode
    thread for 31 s, every prediction queued behind it; a megabyte holds 33,000 such scans."""
    with pytest.raises(BadRequest) as caught:
        decode(_repeated_last_scan(1_000), spec, LIMITS)
    assert caught.value.code == "undecodable_image"
    assert "scans" in caught.value.message


@pytest.mark.parametrize("mode", ["L", "RGB", "CMYK"])
def test_progressive_jpegs_as_encoders_write_them_decode(mode: str) -> None:
    """libjpeg's progressive scripts: 6 scans for grey, 10 for colour, 18 for CMYK."""
    buffer = io.BytesIO()
    Image.new(mode, (64, 48)).save(buffer, format="JPEG", progressive=True)
    assert tuple(decode(buffer.getvalue(), IMAGENET, LIMITS).shape) == (3, 224, 224)


@pytest.mark.parametrize(("mode", "white"), [("L", 255), ("RGB", (255, 255, 255)), ("1", 1), ("P", 1)])
def test_a_pngs_transparent_colour_becomes_a_dark_ground(mode: str, white: object) -> None:
    """A PNG may mark one colour transparent (its tRNS chunk) instead of carrying alpha: a grey or
    colour one's transparent white came out white, where the same image with alpha came out black."""
    image = Image.new(mode, (16, 16), white if mode != "P" else 1)
    if mode == "P":
        image.putpalette([0, 0, 0, 255, 255, 255])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", transparency=white if mode != "RGB" else (255, 255, 255))
    assert "transparency" in Image.open(io.BytesIO(buffer.getvalue())).info
    for spec in (DIGITS, IMAGENET):
        assert int(decode(buffer.getvalue(), spec, LIMITS).max()) == 0


def _photo_jpeg(width: int, height: int, orientation: int = 1) -> bytes:
    """A smooth photo-like JPEG (quality 95, 4:4:4), with an EXIF orientation if not 1."""
    rng = np.random.default_rng(width * 7 + height)
    photo = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(
        (width, height), Image.Resampling.BICUBIC
    )
    out = io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    photo.save(out, "JPEG", quality=95, subsampling=0, exif=exif.tobytes())
    return out.getvalue()


def _decoded_whole(data: bytes, spec: InputSpec, limits: ImageLimits) -> torch.Tensor:
    """``data`` decoded at full size by Pillow, upright, and served as a PNG: no reduced decoding."""
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)).convert("RGB"))
    lossless = io.BytesIO()
    upright.save(lossless, "PNG")
    return decode(lossless.getvalue(), spec, limits)


@pytest.mark.parametrize("orientation", [1, 6], ids=["fast-path", "pillow-path"])
@pytest.mark.parametrize("size", [(641, 481), (1281, 961), (1027, 771), (640, 480)])
def test_a_jpeg_decoded_at_a_reduced_scale_is_the_picture_decoded_whole(
    size: tuple[int, int], orientation: int
) -> None:
    """A 641 x 481 photo decoded at 1/2 is 321 x 241 pixels, the last of each row covering half
    a pixel of the photo; resized as if it covered the whole of it, the input came out stretched
    (mean 2.5-4.1 levels off the full decode, 17-24 at most, for these sizes). The partial pixel
    is cut off: as close to the full decode as a size the scale divides (mean 0.4-1.6, at most 9)."""
    from app.inference.export import input_spec_for
    from app.inference.jpeg import draft_scale
    from app.inference.preprocess import draft_size

    spec = input_spec_for("mobilenet_v3_small")
    data = _photo_jpeg(*size, orientation)
    limits = ImageLimits(1 << 24, 4_000_000)
    assert draft_scale(*size, draft_size(*size, spec)) > 1, "decoded reduced"
    served = decode(data, spec, limits).float()
    off = (served - _decoded_whole(data, spec, limits).float()).abs()
    assert float(off.mean()) < 2.0 and float(off.max()) <= 12, (float(off.mean()), float(off.max()))


def test_a_16_bit_grey_pngs_transparent_grey_becomes_the_dark_ground() -> None:
    """Scaling 16-bit grey to 8 bits built a new image without the PNG's transparent grey (tRNS):
    the bundled digits on a 16-bit ground marked transparent read '8' in 9 of 10."""
    wide = np.full((16, 16), 60000, dtype=np.uint16)
    wide[4:12, 4:12] = 30000  # a mid grey square on a transparent white ground
    buffer = io.BytesIO()
    Image.fromarray(wide).save(buffer, format="PNG", transparency=60000)
    assert Image.open(io.BytesIO(buffer.getvalue())).info.get("transparency") == 60000
    narrow = io.BytesIO()  # the same picture in 8 bits, its transparent grey marked the same way
    Image.fromarray((wide >> 8).astype(np.uint8)).save(narrow, format="PNG", transparency=60000 >> 8)
    pixels = decode(buffer.getvalue(), IMAGENET, LIMITS)
    assert int(pixels[:, :3, :3].max()) == 0, "the transparent ground is black"
    assert int(pixels[:, IMAGENET.height // 2, IMAGENET.width // 2].min()) > 0, "the square stays grey"
    for spec in (DIGITS, IMAGENET):
        assert torch.equal(decode(buffer.getvalue(), spec, LIMITS), decode(narrow.getvalue(), spec, LIMITS))


@pytest.mark.parametrize("orientation", [1, 6], ids=["fast-path", "pillow-path"])
def test_with_reduced_decoding_off_a_jpeg_is_decoded_whole(orientation: int) -> None:
    """``server.jpeg_reduced_decode=false``: the input is the whole decode's, as torchvision's
    reference preprocessing gives it (reduced, real photos came out 25-40 dB off it)."""
    from app.inference.export import input_spec_for

    spec = input_spec_for("mobilenet_v3_small")
    data = _photo_jpeg(1281, 961, orientation)
    whole = _decoded_whole(data, spec, ImageLimits(1 << 24, 4_000_000)).float()
    exact = decode(data, spec, ImageLimits(1 << 24, 4_000_000, reduce_jpeg=False)).float()
    reduced = decode(data, spec, ImageLimits(1 << 24, 4_000_000)).float()
    assert float((exact - whole).abs().max()) <= 1.0
    assert float((reduced - whole).abs().mean()) > 0.1, "the default reduces it"


def test_a_webp_whose_exif_is_a_bare_tiff_signature_decodes() -> None:
    """Found in review: Pillow's EXIF parser raised struct.error (a 500) for a TIFF header of 4
    bytes; metadata never decides whether an image is served, and such a file is served as stored."""
    out = io.BytesIO()
    Image.new("RGB", (300, 300), (200, 30, 30)).save(out, "WEBP", exif=b"II*\x00")
    assert tuple(decode(out.getvalue(), IMAGENET, LIMITS).shape) == (3, 224, 224)


def test_a_jfif_dpi_jpeg_whose_exif_is_cut_short_decodes() -> None:
    """Pillow reads no EXIF while opening a JPEG whose JFIF segment gives its dpi: ours was the
    first read, and it raised struct.error for an EXIF cut short."""
    out = io.BytesIO()
    Image.new("RGB", (300, 300), (200, 30, 30)).save(out, "JPEG", dpi=(300, 300), exif=b"Exif\x00\x00II*\x00")
    assert tuple(decode(out.getvalue(), IMAGENET, LIMITS).shape) == (3, 224, 224)


def test_a_rotated_jpeg_with_a_signed_resolution_decodes_upright() -> None:
    """Orientation 6 beside an XResolution stored as SRATIONAL -72/1: ImageOps.exif_transpose
    rewrote the EXIF with Pillow's type for the tag (RATIONAL), and packing -1 raised struct.error.
    The pixels are turned as the orientation says, and the EXIF is left as it came."""
    rng = np.random.default_rng(3)
    stored = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize((320, 240))
    entries = struct.pack("<HHI", 0x0112, 3, 1) + struct.pack("<H", 6).ljust(4, b"\0")
    entries += struct.pack("<HHII", 0x011A, 10, 1, 8 + 2 + 2 * 12 + 4)  # SRATIONAL, its value after the IFD
    tiff = b"II*\x00" + struct.pack("<IH", 8, 2) + entries + struct.pack("<I", 0) + struct.pack("<ii", -72, 1)
    out = io.BytesIO()
    stored.save(out, "JPEG", quality=95, exif=b"Exif\x00\x00" + tiff)
    data = out.getvalue()
    upright = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").transpose(Image.Transpose.ROTATE_270).save(upright, "PNG")
    assert torch.equal(decode(data, IMAGENET, LIMITS), decode(upright.getvalue(), IMAGENET, LIMITS))


def _cut_out_png() -> bytes:
    """An e-commerce cut-out: an opaque red square on a transparent ground whose stored colour is white,
    with a semi-transparent edge."""
    image = Image.new("RGBA", (300, 300), (255, 255, 255, 0))
    image.paste((200, 30, 30, 255), (90, 90, 210, 210))
    image.paste((200, 30, 30, 128), (80, 80, 90, 220))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def test_an_exported_imagenet_model_sees_transparency_as_torchvisions_loader_gives_it() -> None:
    """Found in review: transparent pixels were composited onto black for every model. torchvision's
    reference (ImageFolder's pil_loader, ``img.convert("RGB")``, then the weights' transforms) keeps
    their stored colour: a cut-out on white came out on black, its edges darkened. An exported
    model's manifest says ``drop``, as torchvision does; the bundled digits model keeps black."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as tvf

    from app.inference.export import input_spec_for

    spec = input_spec_for("mobilenet_v3_small")
    assert spec.background == "drop" and DIGITS.background == "black"
    data = _cut_out_png()
    ours = decode(data, spec, LIMITS).float()
    loaded = Image.open(io.BytesIO(data)).convert("RGB")  # torchvision.datasets.folder.pil_loader
    resized = tvf.resize(loaded, spec.resize.resize_to, interpolation=InterpolationMode.BILINEAR, antialias=True)
    theirs = tvf.pil_to_tensor(tvf.center_crop(resized, spec.height)).float()
    assert float((ours - theirs).abs().mean()) < 1.0, float((ours - theirs).abs().mean())
    assert int(decode(data, IMAGENET, LIMITS)[:, :4, :4].max()) == 0, "a spec that names none: black"


@pytest.mark.parametrize("background", ["black", "white", "drop"])
@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "L"])
def test_each_background_a_manifest_names_is_what_transparent_pixels_become(background: str, mode: str) -> None:
    """A fully transparent image whose stored colour is mid grey (a palette's or a tRNS grey's too)."""
    stored = {"RGBA": (128, 128, 128, 0), "LA": (128, 0), "P": 0, "L": 128}[mode]
    image = Image.new(mode, (16, 16), stored)  # type: ignore[arg-type]
    options: dict[str, object] = {}
    if mode == "P":
        image.putpalette([128, 128, 128])
        options["transparency"] = 0
    elif mode == "L":
        options["transparency"] = 128
    out = io.BytesIO()
    image.save(out, "PNG", **options)
    spec = IMAGENET.model_copy(update={"background": background})
    expected = {"black": 0, "white": 255, "drop": 128}[background]
    assert {int(value) for value in decode(out.getvalue(), spec, LIMITS).unique()} == {expected}
