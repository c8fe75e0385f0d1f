"""What is told of an image from its encoded bytes alone, before or instead of a decoder: the
base64 text a JSON body carries (and, once it is refused, which usual mistake it is), the format
its signature says, a PNG's chunk count (bounded before Pillow walks the chunks), and the 400 for a
file of a known format that does not decode, saying why where that is safe to tell."""

from __future__ import annotations

import binascii

import pybase64
from PIL.Image import DecompressionBombError

from app.errors import BadRequest

JPEG_SIGNATURE = b"\xff\xd8\xff"  # SOI and the first marker's 0xFF: what Pillow's JPEG plugin accepts
PNG_START = b"\x89PNG\r\n\x1a\n"
# chunks a PNG may have: MAX_PNG_CHUNKS, and one more for every PNG_CHUNK_BYTES of the file. Pillow
# walks every chunk in Python holding the GIL (a read, a CRC check, a log call): a 64x64 PNG with
# 50,000 empty chunks (611 KB) took it 135 ms to open and load, against 0.2 ms without them and
# 6.2 ms for a 640x480 PNG of 713 KB; a megabyte holds 87,000 such chunks. libpng writes 8 KiB
# IDATs, so its PNGs have half the chunks the size allows (a 1 MiB one about 130, a 64 MiB one,
# server.max_image_bytes' largest, about 8,200, against 20,480 allowed): a fixed 4,096 refused
# every libpng PNG over 32 MiB. Pillow's walk of as many chunks as the size allows costs it 2.7 µs
# per 4 KiB of the file (by the figure above; 55 ms at 64 MiB).
MAX_PNG_CHUNKS = 4096
PNG_CHUNK_BYTES = 4096
# an APNG's frame count as Pillow takes it from an acTL chunk (more is refused as invalid)
MAX_APNG_FRAMES = 0x80000000
# characters of a refused base64 text base64_mistake reads at each end: the usual mistakes show there
# (a data: prefix, line breaks every 76 characters, the URL-safe alphabet, the padding). It may run
# on the event loop, where reading all of the text cost 0.6-0.7 ms a megabyte (about 55 ms for the
# 85 MB text of a 64 MiB image, server.max_image_bytes' largest)
DIAGNOSED_CHARS = 64 * 1024


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
        raise BadRequest(base64_mistake(text), code="invalid_base64") from exc


_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


def base64_mistake(text: str) -> str:
    """What is wrong with ``text``, which strict base64 refused, told for the mistakes the usual
    client code makes (a browser's data: URI, a wrapping encoder, URL-safe or unpadded base64),
    so the answer says what to change. Runs only once the text is refused (valid text pays
    nothing), by C-level scans of ``DIAGNOSED_CHARS`` characters at each end of the text at most,
    whatever its length (this may run on the event loop: ``encoded_payload``, ``body.image_body``).
    A mistake only in the middle of a longer text is told as 'not valid base64' (or by its length)."""
    if text.startswith("data:"):
        return "image_base64 is a data: URI; send only what follows 'base64,'"
    read_all = len(text) <= 2 * DIAGNOSED_CHARS
    spans = ((0, DIAGNOSED_CHARS), (max(DIAGNOSED_CHARS, len(text) - DIAGNOSED_CHARS), len(text)))

    def first(character: str) -> int:
        """Where ``character`` is first found in the ends read, or -1."""
        return next((at for start, end in spans if (at := text.find(character, start, end)) >= 0), -1)

    if spaces := [at for at in map(first, "\n\r \t") if at >= 0]:
        which = "the first" if read_all or min(spaces) < DIAGNOSED_CHARS else "one"  # else the middle is unread
        return (
            f"image_base64 has line breaks or spaces ({which} at offset {min(spaces)}); "
            "encode without wrapping (base64 -w0)"
        )
    if first("-") >= 0 or first("_") >= 0:
        return "image_base64 uses the URL-safe alphabet (- and _); use standard base64 (+ and /, padded with =)"
    ends = [text[start:end] for start, end in spans]
    if any(not end.isascii() or end.encode("ascii").translate(None, _ALPHABET) for end in ends):
        return "image_base64 has characters outside the base64 alphabet"
    last = text[-DIAGNOSED_CHARS:]
    padded_from = len(text) - (len(last) - len(last.rstrip("=")))  # where the run of '=' ending the text starts
    if 0 <= (padding := first("=")) < padded_from:
        return f"image_base64 has '=' padding before its end (at offset {padding}): send one base64 text"
    if len(text) % 4:
        return f"image_base64 is {len(text)} characters, not a multiple of 4: pad it with '=' to one"
    return "image_base64 is not valid base64"


def png_chunk_limit(size: int) -> int:
    """The chunks a PNG of ``size`` bytes may have before Pillow walks them."""
    return MAX_PNG_CHUNKS + size // PNG_CHUNK_BYTES


def check_png_chunks(data: bytes) -> None:
    """400 for a PNG of more chunks than ``png_chunk_limit`` allows, before Pillow walks them: a
    step here is a type compared, a length read and a skip (a fraction of a µs), where Pillow's is
    several µs. Only the chunks Pillow walks are counted: an animated PNG's up to its second frame
    (Pillow decodes the first, and stops at the next frame's fcTL), any other PNG's up to its IEND."""
    if not data.startswith(PNG_START):
        return
    at, end, most = len(PNG_START), len(data), png_chunk_limit(len(data))
    frames: int | None = None  # an acTL's frame count, as Pillow reads it
    framed = False  # an fcTL before the image data: the IDAT is the first frame, not a default image
    animated: bool | None = None  # known at the image data, as Pillow's is_animated
    for _ in range(most):
        if at + 8 > end:
            return  # a file cut short: Pillow says what is wrong with it
        kind = data[at + 4 : at + 8]
        if kind == b"IEND" or (kind == b"fcTL" and animated):
            return
        if animated is None and kind in (b"IDAT", b"fdAT"):
            # Pillow's n_frames: the acTL's, and one more for an IDAT that no fcTL came before
            animated = (frames or 1) + (frames is not None and not framed) > 1
        elif animated is None and kind == b"acTL":
            count = int.from_bytes(data[at + 8 : at + 12], "big")
            frames = None if frames is not None or not 0 < count <= MAX_APNG_FRAMES else count  # a second unsets it
        elif kind == b"fcTL":
            framed = True
        at += 12 + int.from_bytes(data[at : at + 4], "big")  # length, type, data, CRC
    raise BadRequest(
        f"the PNG has more than {most} chunks in its {end} bytes; libpng writes a chunk per 8 KiB",
        code="undecodable_image",
    )


def kind_of(data: bytes) -> str | None:
    """The format ``data``'s first bytes say it is (what Pillow's plugins accept), or None."""
    if data.startswith(JPEG_SIGNATURE):
        return "JPEG"
    if data.startswith(PNG_START):
        return "PNG"
    return "WebP" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else None


def _cut_short(data: bytes, kind: str | None) -> bool:
    """Whether ``data`` ends before its format says the file does (looked at only once it failed)."""
    if kind == "PNG":
        return b"IEND\xaeB`\x82" not in data  # the end chunk, its CRC included
    if kind == "WebP":
        return int.from_bytes(data[4:8], "little") + 8 > len(data)  # RIFF's own size
    return kind == "JPEG" and b"\xff\xd9" not in data  # no end of image at all


def undecodable(exc: BaseException, data: bytes, part: str) -> BadRequest:
    """The 400 for an image of a known format that Pillow could not read, saying why where that is
    safe to tell: a file cut short (the most common client bug: a partial read, a wrong
    Content-Length), or the part that is damaged. Pillow's own message is not passed on: some
    quote the file's bytes (a PNG chunk's type, say)."""
    kind = kind_of(data) or "image"
    if isinstance(exc, DecompressionBombError):  # a frame past Pillow's own limit (a WebP's, say)
        message = f"the {kind} could not be decoded: it has more pixels than the decoder takes"
    elif "truncated" in str(exc).lower() or _cut_short(data, kind):
        message = f"the {kind} is truncated: its data ends before the image does (was the upload cut short?)"
    else:
        message = f"the {kind} could not be decoded: its {part} is damaged"
    return BadRequest(message, code="undecodable_image")
