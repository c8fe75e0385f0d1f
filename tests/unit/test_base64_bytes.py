"""A JSON body's ``image_base64``: strict standard base64, decoded by pybase64."""

from __future__ import annotations

import base64
import binascii

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.errors import BadRequest
from app.inference.encoded import DIAGNOSED_CHARS, base64_bytes

_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _strict(text: str) -> bytes | None:
    """What the standard library's strict mode makes of ``text`` (None: refused)."""
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):
        return None


@given(st.binary(max_size=3000))
def test_what_base64_encodes_comes_back(data: bytes) -> None:
    assert base64_bytes(base64.b64encode(data).decode("ascii")) == data


# mostly the alphabet, with the characters that make base64 invalid mixed in
_NEAR_BASE64 = st.text(st.sampled_from(_ALPHABET + "=" * 8 + "\n \r-_.é"), max_size=40)


@given(_NEAR_BASE64)
def test_it_never_takes_what_strict_binascii_refuses(text: str) -> None:
    expected = _strict(text)
    try:
        decoded = base64_bytes(text)
    except BadRequest as exc:
        assert exc.code == "invalid_base64"
        # refused: binascii refused it too, or it is padding after a whole group, which only
        # binascii takes
        unpadded = text.rstrip("=")
        assert expected is None or (unpadded != text and len(unpadded) % 4 == 0)
    else:
        assert decoded == expected


@pytest.mark.parametrize(
    "text",
    [
        "QQ",  # padding missing
        "QQ=",  # padding short
        "QUJD=",  # padding after a whole group
        "QQ==QQ==",  # data after padding
        "=QUJD",
        "QUJD\n",  # line breaks
        "QU JD",
        "QUJ-",  # the URL-safe alphabet
        "QUJ_",
        "QUJé",  # outside ASCII
    ],
)
def test_anything_but_strict_standard_base64_is_a_400(text: str) -> None:
    with pytest.raises(BadRequest) as raised:
        base64_bytes(text)
    assert raised.value.code == "invalid_base64"
    assert raised.value.status == 400


_IMAGE_LIKE = bytes(range(256)) * 4  # every byte value: its base64 has + and /, and wraps


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (base64.encodebytes(_IMAGE_LIKE).decode(), "line breaks or spaces (the first at offset 76)"),
        (base64.b64encode(_IMAGE_LIKE).decode().replace("A", "A ", 1), "line breaks or spaces"),
        ("data:image/png;base64," + base64.b64encode(_IMAGE_LIKE).decode(), "send only what follows 'base64,'"),
        (base64.urlsafe_b64encode(_IMAGE_LIKE).decode(), "URL-safe alphabet"),
        (base64.b64encode(_IMAGE_LIKE[:10]).decode().rstrip("="), "not a multiple of 4: pad it with '='"),
        ("QQ==QQ==", "'=' padding before its end"),
        ("QUJé", "characters outside the base64 alphabet"),
        ("QUJD!", "characters outside the base64 alphabet"),
    ],
    ids=["wrapped", "a-space", "data-uri", "url-safe", "unpadded", "two-texts", "not-ascii", "punctuation"],
)
def test_the_common_mistakes_are_each_told_apart(text: str, says: str) -> None:
    """Found in review: every mistake got 'not valid base64', and a client could not tell which of the
    usual ones its code made (GNU base64's wrapping, a browser's data: URI, Go's unpadded or Python's
    URL-safe encoding). Still refused: only the message says what to change."""
    with pytest.raises(BadRequest) as raised:
        base64_bytes(text)
    assert raised.value.code == "invalid_base64"
    assert says in raised.value.message, raised.value.message
    assert len(raised.value.message) < 200 and "AAEC" not in raised.value.message  # no payload echoed


_LONG = "QUJD" * DIAGNOSED_CHARS  # twice as long as the two ends read: its middle is not read


def _with(text: str, at: int, insert: str) -> str:
    return text[:at] + insert + text[at + len(insert) :]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (_with(_LONG, len(_LONG) // 2, "-"), "image_base64 is not valid base64"),
        (_with(_LONG, len(_LONG) // 2, "QQ=="), "image_base64 is not valid base64"),
        (_with(_LONG, len(_LONG) // 2, "\n"), "image_base64 is not valid base64"),
        (_with(_LONG, len(_LONG) // 2, "!"), "image_base64 is not valid base64"),
        (_with(_LONG, len(_LONG) - 3, "-"), "URL-safe alphabet"),
        (
            _with(_LONG, len(_LONG) - DIAGNOSED_CHARS, "QQ=="),
            f"before its end (at offset {len(_LONG) - DIAGNOSED_CHARS + 2})",
        ),
        (_LONG + "\n", f"line breaks or spaces (one at offset {len(_LONG)})"),
        (_with(_LONG, 76, "\n") + "\n", "line breaks or spaces (the first at offset 76)"),
    ],
    ids=[
        "url-safe",
        "padding",
        "line-break",
        "punctuation",
        "url-safe-at-the-end",
        "padding-in-the-end",
        "end",
        "head",
    ],
)
def test_the_diagnosis_reads_a_bounded_part_of_a_long_text(text: str, says: str) -> None:
    """base64_mistake may run on the event loop, and read all of a refused text: about 55 ms for the
    text of a 64 MiB image. It reads DIAGNOSED_CHARS at each end: a mistake there is told as before
    (a trailing line break's offset is one, not the first, the middle unread); one in the middle
    only is not, so the diagnosis costs the same whatever the text's length."""
    with pytest.raises(BadRequest) as raised:
        base64_bytes(text)
    assert raised.value.code == "invalid_base64"
    assert says in raised.value.message, raised.value.message
