"""A prediction's headers: parsed once from the raw scope, kept for the route, refused with 400 when bad."""

from __future__ import annotations

from typing import Any

import pytest

from app.api.deps import PredictHeaders, predict_headers
from app.batching import Lane
from app.errors import BadRequest
from app.settings import ServerSettings

SERVER = ServerSettings()


def scope(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"headers": list(headers), "state": {}}


def test_the_headers_are_parsed_and_kept_in_the_request_state() -> None:
    request = scope((b"x-urgency", b"HIGH "), (b"x-request-timeout", b"250"), (b"x-model-version", b" 2"))
    parsed = predict_headers(request, SERVER)
    assert parsed == PredictHeaders(Lane.URGENT, 0.25, "2")
    assert request["state"] == {"predict_headers": parsed, "lane": "urgent"}
    request["headers"] = []  # a second call (the route, after the edge) reads the kept copy
    assert predict_headers(request, SERVER) is parsed


def test_a_header_repeated_with_the_same_value_is_one_value() -> None:
    parsed = predict_headers(scope((b"x-urgency", b"high"), (b"x-urgency", b" high")), SERVER)
    assert parsed.lane is Lane.URGENT


@pytest.mark.parametrize(
    ("name", "first", "second"),
    [(b"x-urgency", b"high", b"HIGH"), (b"x-request-timeout", b"500", b"0500")],
)
def test_a_header_repeated_with_the_same_meaning_is_one_value(name: bytes, first: bytes, second: bytes) -> None:
    """The lane is read whatever its case and the deadline as a number: two spellings of one
    value were refused as two values."""
    once = predict_headers(scope((name, first)), SERVER)
    assert predict_headers(scope((name, first), (name, second)), SERVER) == once


def test_a_version_repeated_in_another_case_is_two_versions() -> None:
    with pytest.raises(BadRequest, match="X-Model-Version is given more than once"):
        predict_headers(scope((b"x-model-version", b"v2"), (b"x-model-version", b"V2")), SERVER)


def test_a_header_repeated_with_another_value_is_a_400() -> None:
    request = scope((b"x-urgency", b"high"), (b"x-urgency", b"normal"))
    with pytest.raises(BadRequest, match="X-Urgency is given more than once") as refused:
        predict_headers(request, SERVER)
    assert refused.value.code == "invalid_header" and "predict_headers" not in request["state"]


def test_absent_headers_give_the_normal_lane_and_the_default_timeout() -> None:
    parsed = predict_headers(scope(), SERVER)
    assert parsed == PredictHeaders(Lane.NORMAL, SERVER.default_timeout_ms / 1000, None)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (b"x-urgency", b"urgent"),
        (b"x-request-timeout", b"0"),
        (b"x-request-timeout", b"soon"),
        (b"x-request-timeout", b"-5"),
        (b"x-request-timeout", b"+5"),  # int() takes these three: not plain milliseconds
        (b"x-request-timeout", b"1_000"),
        (b"x-request-timeout", b"2.5"),
        (b"x-request-timeout", b"9" * 40),
        (b"x-model-version", b"  "),  # named, but empty
    ],
)
def test_a_bad_header_is_a_400_and_nothing_is_kept(name: bytes, value: bytes) -> None:
    request = scope((name, value))
    with pytest.raises(BadRequest) as caught:
        predict_headers(request, SERVER)
    assert caught.value.code == "invalid_header" and request["state"] == {}
