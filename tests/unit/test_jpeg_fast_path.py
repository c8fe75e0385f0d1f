"""The JPEG fast path (simplejpeg, one call without the GIL) gives Pillow's pixels, or stands aside."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from app.bench.limit.photos import synthetic_photo
from app.errors import BadRequest, PayloadTooLarge
from app.inference import jpeg, preprocess
from app.inference.jpeg import decode_reduced, draft_scale, pillow_image, reduced_size
from app.inference.manifest import InputSpec, ResizeSpec
from app.inference.preprocess import ImageLimits, decode, draft_size
from tests.unit.test_preprocess import IMAGENET
from tests.unit.test_preprocess_inputs import DIGITS  # fit_content: the bundled model's spec

SPECS = [
    IMAGENET,
    InputSpec(channels=1, height=16, width=24, mean=(0.5,), std=(0.5,)),  # stretch, grey
    InputSpec(channels=3, height=48, width=64, resize=ResizeSpec(filter="bicubic"), mean=(0.5,) * 3, std=(0.5,) * 3),
    InputSpec(
        channels=1,
        height=32,
        width=32,
        resize=ResizeSpec(mode="shorter_side_then_center_crop", resize_to=36),
        mean=(0.5,),
        std=(0.5,),
    ),
]
LIMITS = ImageLimits(max_bytes=1 << 22, max_pixels=16_000_000)


def photo(width: int, height: int, seed: int) -> Image.Image:
    return Image.open(io.BytesIO(synthetic_photo(seed, width, height))).convert("RGB")


def encode(image: Image.Image, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format="JPEG", **options)
    return out.getvalue()


def pillow_only(data: bytes, spec: InputSpec, tolerance: float, monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    with monkeypatch.context() as patch:
        patch.setattr(preprocess, "decode_reduced", lambda *args, **kwargs: None)
        return decode(data, spec, LIMITS, draft_tolerance=tolerance).numpy()


def exif_jpeg(orientation: bytes, order: str = "<", xmp: bool = False) -> bytes:
    """A 320x240 photo whose EXIF holds one entry, Orientation (``order``: < little, > big endian)."""
    mark = b"II" if order == "<" else b"MM"
    entry = struct.pack(f"{order}HHI", 0x0112, 3, 1) + orientation.ljust(4, b"\0")
    tiff = mark + struct.pack(f"{order}HI", 42, 8) + struct.pack(f"{order}H", 1) + entry + struct.pack(f"{order}I", 0)
    options: dict[str, object] = {"exif": b"Exif\x00\x00" + tiff, "quality": 90}
    if xmp:
        options["xmp"] = b'<x:xmpmeta xmlns:x="adobe:ns:meta/"></x:xmpmeta>'
    return encode(photo(320, 240, 3), **options)


@settings(max_examples=60, deadline=None)
@given(
    width=st.integers(16, 900),
    height=st.integers(16, 900),
    grey=st.booleans(),
    subsampling=st.sampled_from([0, 1, 2]),
    progressive=st.booleans(),
    spec=st.sampled_from(SPECS),
    tolerance=st.sampled_from([0.9, 1.0, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_the_fast_path_gives_exactly_the_pixels_of_pillows_path(
    width: int,
    height: int,
    grey: bool,
    subsampling: int,
    progressive: bool,
    spec: InputSpec,
    tolerance: float,
    seed: int,
) -> None:
    image = photo(width, height, seed)
    data = encode(image.convert("L") if grey else image, quality=85, subsampling=subsampling, progressive=progressive)
    wanted = draft_size(width, height, spec, tolerance)
    assert decode_reduced(data, spec.channels, lambda w, h: wanted, LIMITS.max_pixels) is not None  # it was taken
    fast = decode(data, spec, LIMITS, draft_tolerance=tolerance).numpy()
    with pytest.MonkeyPatch.context() as patch:
        assert np.array_equal(fast, pillow_only(data, spec, tolerance, patch))


@settings(max_examples=200, deadline=None)
@given(
    width=st.integers(1, 5000), height=st.integers(1, 5000), wanted_w=st.integers(1, 600), wanted_h=st.integers(1, 600)
)
def test_the_scale_leaves_what_was_wanted_in_whole_pixels_and_is_what_pillow_then_picks(
    width: int, height: int, wanted_w: int, wanted_h: int
) -> None:
    """The Pillow path asks its draft for the whole pixels at ``draft_scale``: Pillow picks that
    scale, so both paths decode the same pixels, and both cut a partial last pixel off."""
    scale = draft_scale(width, height, (wanted_w, wanted_h))
    whole = reduced_size(width, height, scale)
    assert scale == 1 or (whole[0] >= wanted_w and whole[1] >= wanted_h)
    assert scale == 8 or width // (2 * scale) < wanted_w or height // (2 * scale) < wanted_h, "the largest such"
    opened = Image.open(io.BytesIO(encode(Image.new("RGB", (width, height)))))
    opened.draft("RGB", whole)
    assert opened.size == (-(-width // scale), -(-height // scale)), "every pixel, the partial last one too"


@pytest.mark.parametrize("order", ["<", ">"])
def test_an_exif_orientation_of_1_keeps_the_fast_path_and_any_other_leaves_it_to_pillow(order: str) -> None:
    upright = exif_jpeg(struct.pack(f"{order}H", 1), order)
    turned = exif_jpeg(struct.pack(f"{order}H", 6), order)
    assert decode_reduced(upright, 3, lambda w, h: (w // 2, h // 2), LIMITS.max_pixels) is not None
    assert decode_reduced(turned, 3, lambda w, h: (w // 2, h // 2), LIMITS.max_pixels) is None
    assert tuple(decode(turned, IMAGENET, LIMITS).shape) == (3, 224, 224)  # Pillow turned it


def test_an_xmp_packet_leaves_the_orientation_to_pillow() -> None:
    """Pillow also reads an orientation from XMP: a JPEG that has one is not this path's."""
    data = exif_jpeg(struct.pack("<H", 1), xmp=True)
    assert b"http://ns.adobe.com/xap/1.0/\x00" in data
    assert decode_reduced(data, 3, lambda w, h: (w, h), LIMITS.max_pixels) is None


@pytest.mark.parametrize(
    "broken",
    [
        lambda d: d[: len(d) // 2],  # truncated
        lambda d: d[:2] + b"\xff\xe1\x00\x01" + d[2:],  # a segment length under 2
        lambda d: d.replace(b"II*\x00", b"II+\x00"),  # not TIFF
        lambda d: d.replace(b"II*\x00\x08", b"II*\x00\xf8"),  # the IFD past the end
    ],
    ids=["truncated", "bad-length", "not-tiff", "ifd-past-end"],
)
def test_a_broken_jpeg_or_exif_leaves_it_to_pillow(broken: object) -> None:
    data = broken(exif_jpeg(struct.pack("<H", 1)))  # type: ignore[operator]
    assert decode_reduced(data, 3, lambda w, h: (w, h), LIMITS.max_pixels) is None


def test_cmyk_png_and_too_many_pixels_are_left_to_pillow() -> None:
    cmyk = encode(Image.new("CMYK", (64, 48), (10, 200, 30, 0)))
    png = io.BytesIO()
    Image.new("RGB", (64, 48)).save(png, "PNG")
    photo_jpeg = encode(photo(640, 480, 1))
    for data in (cmyk, png.getvalue()):
        assert decode_reduced(data, 3, lambda w, h: (w, h), LIMITS.max_pixels) is None
    assert decode_reduced(photo_jpeg, 3, lambda w, h: (w, h), 640 * 480 - 1) is None
    with pytest.raises(PayloadTooLarge):  # and Pillow's path refuses it as before
        decode(photo_jpeg, IMAGENET, ImageLimits(max_bytes=1 << 22, max_pixels=640 * 480 - 1))


def test_the_photos_the_benchmarks_send_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 640x480 photos of `ai-backend limit` and the load tools: decoded at 1/2 scale here."""
    taken: list[tuple[int, ...]] = []
    real = jpeg.simplejpeg.decode_jpeg

    def spy(*args: object, **kwargs: object) -> np.ndarray:
        pixels: np.ndarray = real(*args, **kwargs)
        taken.append(pixels.shape)
        return pixels

    monkeypatch.setattr(jpeg.simplejpeg, "decode_jpeg", spy)
    data = synthetic_photo(3)
    assert tuple(decode(data, IMAGENET, LIMITS).shape) == (3, 224, 224)
    assert taken == [(240, 320, 3)]  # RGB: torch resizes it, and the batch copies it plainly


def test_threads_decoding_at_once_each_get_their_own_pixels() -> None:
    """The decode pool runs one thread per core, each in simplejpeg without the GIL at the same time."""
    from concurrent.futures import ThreadPoolExecutor

    photos = [synthetic_photo(seed, 320 + 16 * seed, 240) for seed in range(6)]
    alone = [decode(data, IMAGENET, LIMITS).numpy() for data in photos]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            together = list(pool.map(lambda data: decode(data, IMAGENET, LIMITS).numpy(), photos * 4))
            assert all(np.array_equal(got, alone[i % 6]) for i, got in enumerate(together))


def exif_entries(*entries: tuple[int, int, int, bytes]) -> bytes:
    """A 320x240 photo whose EXIF IFD0 holds ``entries`` (tag, type, count, value), little-endian."""
    body = struct.pack("<H", len(entries))
    body += b"".join(
        struct.pack("<HHI", tag, kind, count) + value.ljust(4, b"\0") for tag, kind, count, value in entries
    )
    tiff = b"II" + struct.pack("<HI", 42, 8) + body + struct.pack("<I", 0)
    return encode(photo(320, 240, 3), exif=b"Exif\x00\x00" + tiff, quality=90)


def same_as_pillow(data: bytes, spec: InputSpec, monkeypatch: pytest.MonkeyPatch) -> bool:
    return bool(np.array_equal(decode(data, spec, LIMITS).numpy(), pillow_only(data, spec, 0.9, monkeypatch)))


def test_an_orientation_entry_pillow_skips_does_not_hide_the_one_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: Pillow skips an Orientation entry whose data it cannot read (count 0) and
    reads the next with the same tag: here 6, a quarter turn. The first entry's 1 is not the answer."""
    data = exif_entries((0x0112, 3, 0, struct.pack("<H", 1)), (0x0112, 3, 1, struct.pack("<H", 6)))
    assert decode_reduced(data, 3, lambda w, h: (w // 2, h // 2), LIMITS.max_pixels) is None
    assert same_as_pillow(data, IMAGENET, monkeypatch)


def test_a_multi_picture_file_is_decoded_as_pillow_decodes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: Pillow opens a JPEG with an MPF segment (cameras' and phones' multi-picture
    files) as MPO, and decodes it at full size: a reduced decode here gave other pixels."""
    out = io.BytesIO()
    photo(640, 480, 2).save(out, "MPO", save_all=True, append_images=[photo(160, 120, 3)], quality=90)
    assert decode_reduced(out.getvalue(), 3, lambda w, h: (w // 2, h // 2), LIMITS.max_pixels) is None
    assert same_as_pillow(out.getvalue(), IMAGENET, monkeypatch)


def test_anything_simplejpeg_raises_leaves_the_image_to_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: simplejpeg 1.9 raises KeyError for a 4:4:1 header's subsampling, which
    reached the route as a 500; Pillow decodes such a JPEG."""

    def unknown_subsampling(data: bytes) -> tuple[int, int, str, str]:
        raise KeyError(6)

    monkeypatch.setattr(jpeg.simplejpeg, "decode_jpeg_header", unknown_subsampling)
    data = synthetic_photo(4)
    assert decode_reduced(data, 3, lambda w, h: (w // 2, h // 2), LIMITS.max_pixels) is None
    assert tuple(decode(data, IMAGENET, LIMITS).shape) == (3, 224, 224)


def test_pillows_own_bomb_limit_still_refuses_when_max_pixels_allows_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: with ``server.max_image_pixels`` above twice Pillow's MAX_IMAGE_PIXELS, Pillow
    refuses the image (413) and the fast path must not decode it instead."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100_000)  # 640x480 is over twice this
    with pytest.raises(PayloadTooLarge):
        decode(synthetic_photo(5), IMAGENET, LIMITS)


def test_a_tiny_image_is_not_decoded_at_a_scale_pillow_would_not_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: under 8 pixels a side libjpeg-turbo's nearest scale can be 3/8 where Pillow asks 1/4."""
    spec = InputSpec(channels=3, height=1, width=1, mean=(0.5,) * 3, std=(0.5,) * 3)
    pixels = np.random.default_rng(2).integers(0, 256, (5, 5, 3), dtype=np.uint8)
    data = encode(Image.fromarray(pixels), quality=100, subsampling=0)
    assert decode_reduced(data, 3, lambda w, h: (1, 1), LIMITS.max_pixels) is None
    assert same_as_pillow(data, spec, monkeypatch)


def test_a_jpeg_header_longer_than_any_encoder_writes_is_refused_before_it_is_walked() -> None:
    """Found in review: both marker walks (this path's and Pillow's) run in Python holding the GIL,
    and a crafted 400 KB header of empty comments kept the event loop waiting for tens of
    milliseconds, hundreds in Pillow's. The walk stops after MAX_STEPS markers, and the image is a
    400 for every input spec, fit_content (which never takes the fast path) included."""
    steps: list[int] = []

    class Counting(bytes):  # counts the walk's one-byte reads
        def __getitem__(self, key):  # type: ignore[no-untyped-def,override]
            if isinstance(key, int):
                steps.append(key)
            return bytes.__getitem__(self, key)

    base = synthetic_photo(6)
    padded = base[:2] + b"\xff\xfe\x00\x02" * 100_000 + base[2:]  # 100,000 empty comments
    with pytest.raises(jpeg.HeaderTooLong):
        jpeg.read_header(Counting(padded))
    assert len(steps) <= 3 * jpeg.MAX_STEPS
    for spec in (IMAGENET, DIGITS):
        with pytest.raises(BadRequest) as refused:
            decode(padded, spec, LIMITS)
        assert refused.value.code == "undecodable_image"
    header = jpeg.read_header(base[:2] + b"\xff\xfe\x00\x02" * 20 + base[2:])  # a few are walked
    assert header is not None and header.orientation == 1


XMP_SEGMENT = b"\xff\xe1\x00\x1fhttp://ns.adobe.com/xap/1.0/\x00"


@pytest.mark.parametrize(
    "prefix",
    [XMP_SEGMENT + b"\x00" * (jpeg.MAX_JUNK + 1), XMP_SEGMENT, XMP_SEGMENT + b"\xff\xfe\x00\x02" * 5_000],
    ids=["xmp-then-junk", "xmp-then-a-short-header", "xmp-then-a-long-header"],
)
def test_the_bound_holds_past_what_makes_the_fast_path_stand_aside(prefix: bytes) -> None:
    """Pillow skips junk a byte at a time (so its bytes are bounded, MAX_JUNK), and an XMP packet
    first must not end the walk before the bound: the long ones are refused, the short one decodes
    as before (Pillow's path)."""
    data = synthetic_photo(7)
    data = data[:2] + prefix + data[2:]
    if len(prefix) > 1_000:
        with pytest.raises(BadRequest):
            decode(data, IMAGENET, LIMITS)
    else:
        assert decode_reduced(data, 3, lambda w, h: (w // 2, h // 2), LIMITS.max_pixels) is None
        assert tuple(decode(data, IMAGENET, LIMITS).shape) == (3, 224, 224)


@pytest.mark.parametrize("channels", [1, 3])
def test_pillow_reads_the_decoded_pixels_where_they_are(channels: int) -> None:
    """The decoder's buffer becomes the Pillow image as it is: spreading RGB's three bytes a pixel
    out to Pillow's four was a copy of every pixel, made holding the GIL."""
    data = synthetic_photo(5)
    pixels = decode_reduced(data, channels, lambda w, h: (w // 2, h // 2), LIMITS.max_pixels)
    assert pixels is not None
    image = pillow_image(pixels)
    assert image.size == (320, 240) and image.mode == ("L" if channels == 1 else "RGBX")
    pixels[7, 11, 0] = 255 - pixels[7, 11, 0]  # a change to the buffer is a change to the image
    seen = image.getpixel((11, 7))
    assert (seen if channels == 1 else seen[0]) == pixels[7, 11, 0]  # type: ignore[index]


def _scans_a_byte_at_a_time(data: bytes) -> int:
    """The SOS markers up to the first EOI, read as libjpeg reads them: a segment stepped over by its
    length, anything else up to the next 0xFF that is no stuffed 0x00, fill byte or RST0-RST7."""
    scans, at = 0, 0
    while at + 1 < len(data):
        marker = data[at + 1]
        if data[at] != 0xFF or marker in (0x00, 0xFF) or 0xD0 <= marker <= 0xD7:
            at += 1
            continue
        if marker == 0xD9:
            return scans
        scans += marker == 0xDA
        at += 2 if marker in (0xD8, 0x01) else 2 + max(int.from_bytes(data[at + 2 : at + 4], "big"), 2)
    return scans


_PIECES = [b"\xff", b"\xda", b"\x00", b"\xff\xda", b"\xff\xd9", b"\xff\xd0", b"\xff\xfe", b"\x00\x04", b"\xd8", b"a"]


@given(st.lists(st.sampled_from(_PIECES), max_size=200))
def test_the_scan_count_is_the_count_of_sos_markers_to_the_images_end(pieces: list[bytes]) -> None:
    """Found by numpy's comparisons (which let go of the GIL) and a Python step a marker, the count
    is a walk's a byte at a time: the scans before the first EOI, none inside a segment."""
    data = b"".join(pieces)
    assert jpeg._scan_count(data) == _scans_a_byte_at_a_time(data)


def test_scans_past_the_markers_walked_are_all_counted() -> None:
    """Past ``MAX_STEPS`` markers the walk stops, and the SOS markers after it are counted as they are."""
    data = b"\xff\xd8" + b"\xff\xda\x00\x02" * 1_000 + b"\xff\xd9"
    assert jpeg._scan_count(data) == 1_000 > jpeg.MAX_STEPS
