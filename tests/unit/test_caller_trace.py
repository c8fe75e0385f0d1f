"""With tracing off, a caller's W3C traceparent still names the request's trace."""

from __future__ import annotations

import pytest

from app.api.middleware import caller_trace, request_id_from

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def scope(*headers: tuple[bytes, bytes]) -> dict[str, object]:
    return {"type": "http", "headers": list(headers)}


def test_a_well_formed_traceparent_gives_its_trace_and_parent() -> None:
    assert caller_trace(scope((b"traceparent", f"00-{TRACE}-{PARENT}-01".encode()))) == (TRACE, PARENT)
    assert caller_trace(scope((b"traceparent", f" 00-{TRACE}-{PARENT}-00 ".encode()))) == (TRACE, PARENT)
    # a later version may carry more fields: read as the fields this one knows
    assert caller_trace(scope((b"traceparent", f"01-{TRACE}-{PARENT}-01-more".encode()))) == (TRACE, PARENT)


@pytest.mark.parametrize(
    "value",
    [
        f"00-{'0' * 32}-{PARENT}-01",  # all-zero trace id: invalid by the spec
        f"00-{TRACE}-{'0' * 16}-01",
        f"00-{TRACE}-{PARENT}",
        f"00-{TRACE[:-1]}-{PARENT}-01",
        "garbage",
        "",
        f"00-{TRACE.upper()}-{PARENT}-01",  # upper-case hex: invalid, as the tracer's own propagator has it
        f"ff-{TRACE}-{PARENT}-01",  # version ff: invalid
        f"00-{TRACE}-{PARENT}-01-extra",  # version 00 ends at its flags
    ],
)
def test_a_malformed_traceparent_is_ignored(value: str) -> None:
    assert caller_trace(scope((b"traceparent", value.encode()))) is None


def test_no_traceparent_no_trace() -> None:
    assert caller_trace(scope((b"x-request-id", b"abc"))) is None


def test_fresh_request_ids_are_32_hex_digits_and_distinct() -> None:
    ids = {request_id_from(scope()) for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert request_id_from(scope((b"x-request-id", b"client-7"))) == "client-7"
