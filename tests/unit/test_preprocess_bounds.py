"""What decoding bounds before the decoders walk it (PNG chunks, JPEG scans and padding), and what
its 400s say (found in review): each bound refuses the crafted file and lets real ones through."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from app.bench.limit.photos import synthetic_photo
from app.errors import BadRequest, PayloadTooLarge
from app.inference import jpeg
from app.inference.encoded import png_chunk_limit
from app.inference.preprocess import ImageLimits, decode
from tests.unit.test_preprocess import IMAGENET, LIMITS
from tests.unit.test_preprocess_inputs import DIGITS

LARGE = ImageLimits(max_bytes=1 << 22, max_pixels=16_000_000)  # the default pixel limit


def _chunk(kind: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _png_with_empty_chunks(count: int) -> tuple[bytes, bytes]:
    """A 64x64 PNG with ``count`` empty private chunks (valid CRCs) before its IDAT, and the plain one."""
    out = io.BytesIO()
    Image.effect_noise((64, 64), 40).convert("RGB").save(out, "PNG")
    plain = out.getvalue()
    after_header = 8 + 25  # the signature and IHDR
    return plain[:after_header] + _chunk(b"prVt") * count + plain[after_header:], plain


def test_a_png_of_fifty_thousand_empty_chunks_is_refused_before_pillow_walks_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pillow walks a PNG's chunks in Python, holding the GIL: 50,000 empty ones (600 KB) cost it
    hundreds of times a normal decode. They are counted first, at a fraction of a µs each."""
    data, _ = _png_with_empty_chunks(50_000)

    def no_open(*args: object, **kwargs: object) -> Image.Image:
        raise AssertionError("Pillow opened it")

    monkeypatch.setattr(Image, "open", no_open)
    for spec in (IMAGENET, DIGITS):
        with pytest.raises(BadRequest) as refused:
            decode(data, spec, LIMITS)
        assert refused.value.code == "undecodable_image"
        assert f"more than {png_chunk_limit(len(data))} chunks in its {len(data)} bytes" in refused.value.message


def test_a_png_of_a_few_hundred_chunks_decodes_as_the_plain_one() -> None:
    data, plain = _png_with_empty_chunks(300)
    assert torch.equal(decode(data, IMAGENET, LIMITS), decode(plain, IMAGENET, LIMITS))


def _png(header: bytes, *chunks: bytes) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + b"".join(chunks) + _chunk(b"IEND")


def test_a_libpng_png_past_32_mib_decodes_as_the_same_image_in_one_chunk() -> None:
    """libpng writes 8 KiB IDATs: a fixed bound of 4,096 chunks refused every PNG it wrote over 32 MiB,
    which server.max_image_bytes (up to 64 MiB) may let in. The bound grows with the file's size."""
    side = 3400  # RGB, stored without compression: 34.7 MB, 4,235 IDATs of 8 KiB
    rows = np.random.default_rng(0).integers(0, 256, (side, 1 + 3 * side), dtype=np.uint8)
    rows[:, 0] = 0  # each row's filter: none
    stream = zlib.compress(rows.tobytes(), 0)
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    libpng = _png(header, *(_chunk(b"IDAT", stream[at : at + 8192]) for at in range(0, len(stream), 8192)))
    assert len(stream) // 8192 > 4096
    limits = ImageLimits(max_bytes=64 << 20, max_pixels=16_000_000)
    assert torch.equal(
        decode(libpng, IMAGENET, limits), decode(_png(header, _chunk(b"IDAT", stream)), IMAGENET, limits)
    )


def _frame(sequence: int, side: int) -> bytes:
    """An fcTL chunk: a ``side`` x ``side`` frame at the origin, 0.1 s, no disposal, no blending."""
    return _chunk(b"fcTL", struct.pack(">IIIIIHHBB", sequence, side, side, 0, 0, 1, 10, 0, 0))


def _pixels(side: int, grey: int) -> bytes:
    return zlib.compress((b"\x00" + bytes([grey]) * 3 * side) * side)


def test_an_apngs_chunks_after_its_first_frame_are_not_counted() -> None:
    """Pillow decodes an animated PNG's first frame and stops at the next frame's fcTL: a valid APNG
    of 2,100 frames (two chunks each) was refused for chunks Pillow never walks."""
    side, frames = 16, 2_100
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    later = (
        _frame(2 * n - 1, side) + _chunk(b"fdAT", struct.pack(">I", 2 * n) + _pixels(side, n % 256))
        for n in range(1, frames)
    )
    first = _pixels(side, 200)
    apng = _png(header, _chunk(b"acTL", struct.pack(">II", frames, 0)), _frame(0, side), _chunk(b"IDAT", first), *later)
    assert 2 * frames > png_chunk_limit(len(apng))
    with Image.open(io.BytesIO(apng)) as opened:
        assert opened.n_frames == frames  # a valid APNG, as Pillow reads it
    assert torch.equal(decode(apng, IMAGENET, LIMITS), decode(_png(header, _chunk(b"IDAT", first)), IMAGENET, LIMITS))


@pytest.mark.parametrize("animated", [True, False], ids=["before-the-second-frame", "one-frame"])
def test_the_chunks_pillow_walks_in_an_apng_are_counted(animated: bool) -> None:
    """Counting stops at the second frame only where Pillow stops: chunks before it, and every chunk of
    an APNG of one frame (Pillow walks it to its IEND), are counted as in any PNG."""
    side = 16
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    flood = _chunk(b"prVt") * 50_000 if animated else b"".join(_frame(n, side) for n in range(1, 50_001))
    data = _png(
        header,
        _chunk(b"acTL", struct.pack(">II", 2 if animated else 1, 0)),
        _frame(0, side),
        _chunk(b"IDAT", _pixels(side, 200)),
        flood,
        *([_frame(1, side), _chunk(b"fdAT", struct.pack(">I", 2) + _pixels(side, 9))] if animated else []),
    )
    with pytest.raises(BadRequest) as refused:
        decode(data, IMAGENET, LARGE)
    assert refused.value.code == "undecodable_image"
    assert f"more than {png_chunk_limit(len(data))} chunks" in refused.value.message


def _progressive_with_scans(size: tuple[int, int], scans: int) -> bytes:
    """A black progressive grey JPEG (libjpeg's script: 6 scans) whose last scan is written again
    until it has ``scans``: each repeat is a few bytes, and another pass over every block."""
    buffer = io.BytesIO()
    Image.new("L", size).save(buffer, format="JPEG", progressive=True)
    data = buffer.getvalue()
    last, end = data.rindex(b"\xff\xda"), len(data) - 2
    assert jpeg._scan_count(data) == 6
    return data[:end] + data[last:end] * (scans - 6) + data[end:]


def test_scans_are_bounded_by_their_work_not_their_count_alone() -> None:
    """60 scans passed the count of 64; over 4000 x 4000 pixels each is about 31 ms of a core (2 s
    for the file, tens of KB). Scans x pixels is bounded: at this size 24 scans are decoded."""
    data = _progressive_with_scans((4000, 4000), 60)
    assert len(data) < 100_000
    with pytest.raises(BadRequest) as refused:
        decode(data, IMAGENET, LARGE)
    assert refused.value.code == "undecodable_image"
    assert "60 scans over 4000x4000 pixels; at most 24" in refused.value.message


@pytest.mark.parametrize("mode", ["L", "RGB", "CMYK"])
def test_an_encoders_progressive_jpeg_of_the_largest_size_allowed_passes_the_scan_bound(mode: str) -> None:
    """libjpeg's scripts (6, 10 and 18 scans) over 16 Mpx, with a progressive EXIF thumbnail's
    scans beside them (not counted: they lie in the APP1 segment)."""
    thumbnail = io.BytesIO()
    Image.new(mode, (160, 120)).save(thumbnail, "JPEG", progressive=True)
    tiff = b"II*\x00" + struct.pack("<IH", 8, 0) + struct.pack("<I", 0)  # an empty IFD0, then the thumbnail
    buffer = io.BytesIO()
    Image.new(mode, (4000, 4000)).save(
        buffer, "JPEG", progressive=True, exif=b"Exif\x00\x00" + tiff + thumbnail.getvalue()
    )
    data = buffer.getvalue()
    header = jpeg.read_header(data)
    assert header is not None and (header.width, header.height) == (4000, 4000)
    jpeg.check_scans(data, header, LARGE.max_pixels)  # passes
    small = _progressive_with_scans((64, 48), 64)  # a small image keeps the count of 64
    jpeg.check_scans(small, jpeg.read_header(small), LARGE.max_pixels)  # type: ignore[arg-type]


def _after_app0(data: bytes) -> int:
    assert data[2:4] == b"\xff\xe0"
    return 4 + int.from_bytes(data[4:6], "big")


@pytest.mark.parametrize("padding", [b"\x00" * 600, b"\xff" * 600, (b"\x00" * 99 + b"\xff") * 6])
def test_a_jpeg_with_some_padding_between_its_markers_decodes_as_the_clean_file(padding: bytes) -> None:
    """Writers leave zeros after an EXIF or an APPn shorter than it says, and libjpeg skips them with a
    warning. Each junk or fill byte was a step of the 512 the walk allows: a 400 for a file that
    every viewer opens. A run is one step now."""
    clean = synthetic_photo(3)
    at = _after_app0(clean)
    padded = clean[:at] + padding + clean[at:]
    for spec in (IMAGENET, DIGITS):
        assert torch.equal(decode(padded, spec, LIMITS), decode(clean, spec, LIMITS))


def test_junk_between_markers_is_bounded_in_bytes_and_the_400_says_why() -> None:
    """Pillow skips junk a byte at a time in Python, so the bytes are bounded apart from the steps."""
    clean = synthetic_photo(3)
    at = _after_app0(clean)
    padded = clean[:at] + b"\x00" * (jpeg.MAX_JUNK + 1) + clean[at:]
    with pytest.raises(BadRequest) as refused:
        decode(padded, IMAGENET, LIMITS)
    assert refused.value.code == "undecodable_image"
    assert f"more than {jpeg.MAX_JUNK} junk bytes" in refused.value.message


def test_a_header_of_too_many_markers_says_so() -> None:
    clean = synthetic_photo(6)
    padded = clean[:2] + b"\xff\xfe\x00\x02" * 1_000 + clean[2:]  # 1,000 empty comments
    with pytest.raises(BadRequest) as refused:
        decode(padded, IMAGENET, LIMITS)
    assert refused.value.code == "undecodable_image"
    assert f"more than {jpeg.MAX_STEPS} markers before its image data" in refused.value.message


def test_a_progressive_jpeg_past_the_pixel_limit_is_a_413_not_a_scan_400() -> None:
    """The scan bound shrinks as the image grows: past the pixel limit it must not answer first."""
    data = bytearray(_progressive_with_scans((64, 48), 10))
    frame = data.index(b"\xff\xc2")  # SOF2: length, precision, height, width
    data[frame + 5 : frame + 9] = struct.pack(">HH", 8000, 8000)
    with pytest.raises(PayloadTooLarge) as refused:
        decode(bytes(data), IMAGENET, LARGE)
    assert refused.value.code == "image_too_many_pixels"


def _jpeg(image: Image.Image, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", **options)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "trailer",
    [
        b"\x00" * 1000 + b"\xff\xda\x00" * 40,  # as many as a Motion Photo's MP4 of 2.6 MB holds (one in 64 KiB)
        _jpeg(Image.new("RGB", (640, 480)), progressive=True) * 4,  # pictures after the first, as an MPO's: 40 scans
    ],
    ids=["video", "pictures"],
)
def test_what_follows_a_jpegs_end_is_no_scan_of_it(trailer: bytes) -> None:
    """libjpeg stops at the image's EOI (and Pillow decodes an MPO's first picture), so what follows
    it is never decoded: a phone's Motion Photo (a 12.5 Mpx JPEG, then an MP4 of a few MB) was
    refused as 'the JPEG has 41 scans over 4080x3072 pixels; at most 30 are decoded'."""
    plain = _jpeg(Image.new("RGB", (4080, 3072)))
    limits = ImageLimits(max_bytes=1 << 24, max_pixels=16_000_000)
    assert torch.equal(decode(plain + trailer, IMAGENET, limits), decode(plain, IMAGENET, limits))


def test_scans_past_the_bound_are_refused_whatever_bytes_a_segment_between_them_holds() -> None:
    """The count stops at the image's EOI, found by walking the markers as libjpeg reads them: a
    comment between two scans may hold the bytes of an EOI (or of an SOS), which end nothing."""
    data = _progressive_with_scans((4000, 4000), 60)
    second = data.index(b"\xff\xda", data.index(b"\xff\xda") + 2)
    comment = b"\xff\xfe\x00\x06\xff\xd9\xff\xda"  # COM, its length, then 'EOI' and 'SOS'
    crafted = data[:second] + comment + data[second:] + b"\xff\xda\x00" * 40  # and bytes after the EOI
    assert jpeg._scan_count(crafted) == 60
    with pytest.raises(BadRequest) as refused:
        decode(crafted, IMAGENET, LARGE)
    assert "60 scans over 4000x4000 pixels; at most 24" in refused.value.message
