"""A JPEG photo decoded at a reduced scale in one call that lets go of the GIL.

Pillow's path to a JPEG's pixels is Python until the very end: ``Image.open`` walks the
markers, ``getexif`` parses the EXIF, ``draft`` picks a scale, ``load`` feeds the decoder,
and each of those steps needs the GIL. In the service the decode thread shares the GIL with
the event loop, and every time it needs it back it waits for the loop to let go (up to the
switch interval, then a wake-up): beside a busy Python thread that cost more on the clock than
the decoding itself (docs/performance.md, seventeenth pass). Here simplejpeg (libjpeg-turbo)
reads the header and decodes at the reduced scale in one call, without the GIL.

Only an image whose pixels come out exactly as Pillow's would takes this path: a YCbCr or
grey JPEG with no orientation to apply (no EXIF orientation other than 1, no XMP, which Pillow
also reads an orientation from), decoded at the scale Pillow's draft mode picks (1/1, 1/2,
1/4 or 1/8), with libjpeg's default DCT and upsampling, as Pillow asks for them. Anything
else, and any JPEG libjpeg-turbo warns about, gets None: Pillow decides, as before. One difference
is kept: a few headers Pillow's own parser refuses or trips over (a bare ``JFIF`` APP0 or ``Adobe``
APP14, a TEM marker, an EXIF resolution of the wrong type) but libjpeg-turbo reads are decoded here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Literal, NamedTuple

import numpy as np
import simplejpeg
from PIL import Image

SOI, SOS, EOI, APP1, APP2 = 0xD8, 0xDA, 0xD9, 0xE1, 0xE2
TEM = 0x01  # a marker without a length, as SOI and EOI (and RST0-RST7)
JPEG_START = b"\xff\xd8"  # SOI, every JPEG's first two bytes
EXIF, XMP, MPF = b"Exif\x00\x00", b"http://ns.adobe.com/xap/1.0/\x00", b"MPF\x00"
ORIENTATION, SHORT = 0x0112, 3
# markers, and runs of junk or fill bytes, walked before the first scan: a camera's header has a few dozen
# (and the markers walked from it to the image's end: a progressive JPEG has two or three a scan)
MAX_STEPS = 512
# junk and fill bytes between those markers, all told: writers leave a few hundred to a few thousand
# (zeros after an EXIF, an APPn shorter than it says), which libjpeg skips with a warning; Pillow's walk
# skips them a byte at a time in Python, holding the GIL (a megabyte of junk took it 230-350 ms;
# this many, 4 ms to open and load a 64x64 JPEG, against 0.1 ms without them)
MAX_JUNK = 64 * 1024
BYTE_ORDERS: dict[bytes, Literal["little", "big"]] = {b"II": "little", b"MM": "big"}
# the frame headers (SOF0-SOF15 but DHT, JPG and DAC), which give the image's size
FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Scans are bounded by the work they make, scans x pixels: each is a pass of the decoder over every
# block of the image, whatever scale it decodes at (a 4000 x 4000 grey JPEG: about 31 ms a scan, so a
# 1,000-scan file of 94 KB kept a decode thread for 31 s). libjpeg's progressive scripts write 6
# (grey), 10 (colour) or 18 (CMYK) scans. Only the scans before the image's end (its EOI) are
# counted: libjpeg stops there, and Pillow decodes an MPO's first picture only, so what follows is
# never decoded (a Motion Photo's MP4, an MPO's second picture, an Ultra HDR gain map); nor are an
# EXIF thumbnail's scans, which lie in its APP1 segment. So SCAN_PASSES passes over
# server.max_image_pixels are allowed, which every encoder's output of an allowed size passes with
# room to spare: 0.75 s of a core at the 16 Mpx default, where 64 scans of any size (2 s) were before.
SCAN_PASSES = 24
# and at most this many scans whatever the size (each has a cost of its own: markers, tables, buffers)
MAX_SCANS = 64
# the colour spaces simplejpeg's header reports that convert as Pillow converts them
COLOURS = {"YCbCr", "Gray"}


class HeaderTooLong(ValueError):
    """A JPEG with more markers, or more junk bytes, before its image data than any encoder writes:
    refused before either walk (this module's or Pillow's, both in Python, holding the GIL) goes
    through it."""


class TooManyScans(ValueError):
    """A JPEG whose scans make more work than ``SCAN_PASSES`` allows: refused before any decoder
    passes over them."""


class Header(NamedTuple):
    """What the walk to a JPEG's first scan found (``read_header``)."""

    orientation: int | None  # its EXIF orientation (1 without one); None: Pillow's path tells it
    width: int  # the frame's size (0 where no frame header came before the first scan)
    height: int
    first_scan: int  # where the first scan starts (the data's length where there is none)


def read_header(data: bytes) -> Header | None:
    """The walk to a JPEG's first scan, or None for what is no JPEG. Raises ``HeaderTooLong``."""
    return _walk(data) if data.startswith(JPEG_START) else None


def check_scans(data: bytes, header: Header, max_pixels: int) -> None:
    """Raises ``TooManyScans`` for a JPEG whose scans make more work than any encoder's output of
    an allowed size (``max_pixels``) makes."""
    pixels = header.width * header.height
    if pixels > max_pixels:
        return  # the pixel limit refuses it (413) before a scan is decoded
    scans = _scan_count(data, header.first_scan)
    most = min(MAX_SCANS, SCAN_PASSES * max_pixels // pixels) if pixels else MAX_SCANS
    if scans > most:
        raise TooManyScans(
            f"the JPEG has {scans} scans over {header.width}x{header.height} pixels; at most {most} are decoded"
        )


def _scan_count(data: bytes, start: int = 0) -> int:
    """The scans (SOS markers) from the marker at ``start`` to the image's end, its first EOI: the
    markers walked as libjpeg reads them, a segment stepped over by its length (a comment or a
    table between scans may hold bytes that read as an EOI or an SOS), entropy-coded data to the
    next 0xFF that is no stuffed 0x00 nor a restart marker. Beyond ``MAX_STEPS`` markers the
    walk stops, and every SOS pair after it is counted, as many as there can be.

    The 0xFF bytes are found by numpy's comparison and ``flatnonzero``, which let go of the GIL
    (``bytes.count`` held it for 160 µs over a 190 KB photo, the event loop waiting); what is then
    indexed holding it is the 0xFF bytes alone (one in about 256 of entropy-coded data: a mask over
    the whole photo, indexed, held it throughout), and Python steps over the markers alone, two for
    a baseline photo, a few dozen for a progressive one."""
    octets = np.frombuffer(data, dtype=np.uint8)
    start = min(start, len(data))
    ff_at = np.flatnonzero(octets[start:-1] == 0xFF) + start
    after = octets[ff_at + 1]
    # a marker is a 0xFF followed by neither 0x00 (a stuffed byte), 0xFF (fill) nor RST0-RST7
    markers = ff_at[(after != 0x00) & (after != 0xFF) & ((after < 0xD0) | (after > 0xD7))]
    scans, at, index = 0, start, 0
    for _ in range(MAX_STEPS):
        index = int(np.searchsorted(markers, at))
        if index == len(markers):
            return scans
        at = int(markers[index])
        marker = data[at + 1]
        if marker == EOI:
            return scans
        if marker == SOS:
            scans += 1
        at += 2 if marker in (SOI, TEM) else 2 + max(int.from_bytes(data[at + 2 : at + 4], "big"), 2)
    rest = markers[index + 1 :]
    return scans + int(np.count_nonzero(octets[rest + 1] == SOS))


def decode_reduced(
    data: bytes,
    channels: int,
    wanted: Callable[[int, int], tuple[int, int]],
    max_pixels: int,
    padded: bool = True,
    header: Header | None = None,
) -> np.ndarray | None:
    """``data``'s pixels, uint8, decoded at the largest reduction that leaves at least
    ``wanted(width, height)`` pixels, or None: Pillow's path decodes it (not such a JPEG, more
    than ``max_pixels``, broken, or anything this path does not do alike). Raises
    ``HeaderTooLong`` (see ``read_header``).

    Grey is ``H x W x 1``; colour is ``H x W x 4``, RGB and a padding byte, the layout Pillow
    keeps RGB in (four bytes a pixel): Pillow takes it as it is (``pillow_image``), without the
    copy that spreading three bytes a pixel out to four costs, holding the GIL. ``padded=False``
    gives colour as ``H x W x 3``, for torch to resize: a padding byte left in memory makes every
    later copy of the pixels a strided one, and dropping it costs more than decoding without it.
    ``header``: ``read_header``'s, where the caller has it (else the header is walked here)."""
    if header is None:
        header = read_header(data)
    if header is None or header.orientation != 1:
        return None
    try:
        height, width, colour, _ = simplejpeg.decode_jpeg_header(data)
        if colour not in COLOURS or width * height > max_pixels:
            return None
        scale = draft_scale(width, height, wanted(width, height))
        if scale > 1 and max(width, height) < 8:
            return None  # libjpeg-turbo may pick 3/8 or 5/8 here, where Pillow asks for 1/scale
        size = math.ceil(height / scale), math.ceil(width / scale)
        pixels = simplejpeg.decode_jpeg(
            data,
            "GRAY" if channels == 1 else "RGBX" if padded else "RGB",
            min_height=size[0],
            min_width=size[1],
            strict=True,
        )
    # ValueError for what it cannot read (warnings included), and whatever else it raises (a KeyError
    # for a 4:4:1 header's subsampling): Pillow's path then decides
    except Exception:
        return None
    if pixels.shape != (*size, 1 if channels == 1 else 4 if padded else 3):
        return None
    whole_width, whole_height = reduced_size(width, height, scale)
    whole: np.ndarray = pixels[:whole_height]  # the last row cut off, if partial: still one block
    if whole_width < size[1]:  # rows of whole pixels, laid out one after another again
        whole = np.ascontiguousarray(whole[:, :whole_width])
    return whole


def pillow_image(pixels: np.ndarray) -> Image.Image:
    """``decode_reduced``'s pixels as a Pillow image that reads them where they are (grey as
    ``L``, colour as ``RGBX``: their bands are RGB's, resized alike), not a copy. Unpadded colour
    (``padded=False``, meant for torch) is ``RGB``, copied: the rare strip torch does not resize."""
    height, width, bands = pixels.shape
    mode = {1: "L", 3: "RGB"}.get(bands, "RGBX")
    return Image.frombuffer(mode, (width, height), pixels, "raw", mode, 0, 1)


def draft_scale(width: int, height: int, wanted: tuple[int, int]) -> int:
    """The reduction to decode at for ``wanted``: the largest of 8, 4 and 2 that leaves at least
    ``wanted`` whole pixels (``reduced_size``), else 1."""
    most = min(width // wanted[0], height // wanted[1])
    return next((scale for scale in (8, 4, 2) if most >= scale), 1)


def reduced_size(width: int, height: int, scale: int) -> tuple[int, int]:
    """The whole pixels of a ``width`` x ``height`` JPEG decoded at ``1/scale``. A side the scale
    does not divide ends in a pixel that covers only part of one at that scale: it is cut off
    (fewer than ``scale`` pixels of the photo), since a resize would take it for a whole one and
    stretch the picture by it (a 641 x 481 photo came out up to 53 levels off the full decode)."""
    return width // scale, height // scale


_FILL = re.compile(rb"\xff+")


def _past_padding(data: bytes, at: int) -> int:
    """Where the marker after the run of junk (not 0xFF) or fill bytes (0xFF) at ``at`` starts, or
    the data's length: found by C, not a byte at a time. Of fill bytes, the last starts the marker."""
    if data[at] != 0xFF:
        after = data.find(b"\xff", at)
        return len(data) if after < 0 else after
    run = _FILL.match(data, at)
    assert run is not None
    return run.end() - 1


def _walk(data: bytes) -> Header:
    """The EXIF orientation of a JPEG (1 without one), or None where it cannot be told here
    (an XMP packet, a multi-picture file, malformed markers or EXIF): Pillow then reads it; and
    the size its frame header gives, and where its first scan starts.

    The walk goes on to the first scan even once the answer is None, stepping over what
    Pillow's walk steps over (junk bytes, fill bytes, segments), so that ``HeaderTooLong``
    bounds both: they run in Python holding the GIL, and a crafted megabyte of junk or empty
    segments kept the event loop waiting for 80 ms here, 230-350 ms in Pillow. A run of junk or
    fill bytes is one step here (found by C, not a byte at a time), and their bytes all told
    are bounded apart (``MAX_JUNK``), for Pillow's walk, which steps over them a byte at a time."""
    at, end, found, sure = 2, len(data), 1, True
    exif_seen, junk, width, height = False, 0, 0, 0
    for _ in range(MAX_STEPS):
        if at + 2 > end:
            return Header(None, width, height, end)  # no scan: Pillow refuses it
        if data[at] != 0xFF or data[at + 1] == 0xFF:  # junk (Pillow skips it too), or fill bytes
            after = _past_padding(data, at)
            sure, junk, at = sure and data[at] == 0xFF, junk + after - at, after
        else:
            marker = data[at + 1]
            if marker in (SOS, EOI):  # the markers before the first scan are all Pillow reads
                return Header(found if sure else None, width, height, at)
            if marker in (SOI, 0x00, 0x01) or 0xD0 <= marker <= 0xD7:  # no length follows
                sure, at = sure and marker != 0x00, at + 2
                continue
            length = int.from_bytes(data[at + 2 : at + 4], "big")
            if marker == APP2 and data[at + 4 : at + 8] == MPF:
                sure = False  # Pillow opens a multi-picture file as MPO, and decodes it without a draft
            elif marker == APP1 and length >= 2:
                segment = data[at + 4 : at + 2 + length]
                if segment.startswith(XMP):
                    sure = False
                elif segment.startswith(EXIF) and not exif_seen:  # Pillow reads the first EXIF only
                    exif_seen = True
                    orientation = _tiff_orientation(segment[len(EXIF) :])
                    sure, found = sure and orientation is not None, orientation or 1
            elif marker in FRAMES and not width and length >= 7:  # libjpeg refuses a second frame header
                height = int.from_bytes(data[at + 5 : at + 7], "big")
                width = int.from_bytes(data[at + 7 : at + 9], "big")
            sure, at = sure and length >= 2, at + 2 + max(length, 2)
        if junk > MAX_JUNK:
            raise HeaderTooLong(f"the JPEG has more than {MAX_JUNK} junk bytes between its markers")
    raise HeaderTooLong(f"the JPEG has more than {MAX_STEPS} markers before its image data")


def _tiff_orientation(tiff: bytes) -> int | None:
    """The orientation tag in a TIFF header's first IFD (1 without one), or None if malformed or
    not told plainly: one entry, a SHORT, count 1 (Pillow skips an entry whose data it cannot
    read, count 0 say, and reads the next one with the same tag)."""
    order = BYTE_ORDERS.get(tiff[:2])
    if order is None or len(tiff) < 8 or int.from_bytes(tiff[2:4], order) != 42:
        return None
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return None
    found: list[int] = []
    for entry in range(ifd + 2, ifd + 2 + 12 * int.from_bytes(tiff[ifd : ifd + 2], order), 12):
        if entry + 12 > len(tiff):
            return None
        if int.from_bytes(tiff[entry : entry + 2], order) != ORIENTATION:
            continue
        kind, count = (
            int.from_bytes(tiff[entry + 2 : entry + 4], order),
            int.from_bytes(tiff[entry + 4 : entry + 8], order),
        )
        if kind != SHORT or count != 1:
            return None
        found.append(int.from_bytes(tiff[entry + 8 : entry + 10], order))
    if len(found) > 1:
        return None
    return found[0] if found else 1
