"""The service from ``app.state`` (a dependency), and a prediction's headers and query, validated.

Dependencies are ``async def``: FastAPI runs a plain ``def`` dependency in a worker thread, a
thread hop per dependency per request for work that takes microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError, field_validator
from starlette.datastructures import QueryParams
from starlette.types import Scope

from app.batching import Lane
from app.errors import BadRequest, SchemaError
from app.service import InferenceService
from app.settings import ServerSettings


async def get_service(request: Request) -> InferenceService:
    service: InferenceService = request.app.state.service
    return service


_LANES = {"high": Lane.URGENT, "normal": Lane.NORMAL}


@dataclass(frozen=True)
class PredictHeaders:
    """What a prediction's headers ask for, validated (400 ``invalid_header`` otherwise)."""

    lane: Lane
    timeout_s: float
    version: str | None


_PREDICT_HEADERS = {b"x-urgency": 0, b"x-request-timeout": 1, b"x-model-version": 2}
_HEADER_NAMES = ("X-Urgency", "X-Request-Timeout", "X-Model-Version")


def predict_headers(scope: Scope, server: ServerSettings) -> PredictHeaders:
    """The prediction headers of a request, parsed once (the edge and the route both ask) and
    kept in the request's state; raises 400 ``invalid_header``, and keeps nothing then.

    Read by hand from the raw headers rather than declared as FastAPI ``Header`` parameters:
    FastAPI's per-parameter validation cost more than the rest of the route on this path (the
    route declares them in its OpenAPI document).
    """
    state = scope["state"]
    if (parsed := state.get("predict_headers")) is not None:
        return parsed  # type: ignore[no-any-return]
    values: list[str | None] = [None, None, None]
    for key, value in scope["headers"]:
        if (index := _PREDICT_HEADERS.get(key)) is not None:
            text = value.decode("latin-1")
            seen = values[index]
            # a repeat of the same value (a proxy that copies headers) is harmless; two values
            # would let whichever the server happened to read decide the deadline or the lane
            if seen is not None and _meaning(index, seen) != _meaning(index, text):
                raise BadRequest(
                    f"{_HEADER_NAMES[index]} is given more than once, with different values", code="invalid_header"
                )
            values[index] = text
    urgency, timeout, version = values
    parsed = PredictHeaders(*parse_predict_headers(urgency, timeout, version, server))
    state["predict_headers"] = parsed
    state["lane"] = parsed.lane.value  # for the latency metric
    return parsed


def _meaning(index: int, text: str) -> str:
    """What a prediction header's value says, to compare a repeat with: the lane whatever its case
    (``high`` and ``HIGH`` are one lane), the deadline as a number (``500`` and ``0500``)."""
    text = text.strip()
    if index == 0:
        return text.lower()
    if index == 1 and text.isascii() and text.isdigit():
        return text.lstrip("0") or "0"
    return text


def parse_predict_headers(
    urgency: str | None, timeout: str | None, version: str | None, server: ServerSettings
) -> tuple[Lane, float, str | None]:
    """Lane, deadline in seconds and pinned version from the raw header values (400 when bad)."""
    lane = _LANES.get("normal" if urgency is None else urgency.strip().lower())
    if lane is None:
        raise BadRequest("X-Urgency must be 'high' or 'normal'", code="invalid_header")
    timeout_s = _timeout_s(timeout, server.default_timeout_ms, server.max_timeout_ms)
    if version is not None and not (version := version.strip()):
        raise BadRequest("X-Model-Version must name a version (or be left out)", code="invalid_header")
    return lane, timeout_s, version


def _timeout_s(header: str | None, default_ms: int, max_ms: int) -> float:
    if header is None:
        return default_ms / 1000.0
    digits = header.strip()
    # plain decimal digits: int() would also take "+5", "1_000" and non-ASCII digits
    millis = int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 12 else 0
    if not 1 <= millis <= max_ms:
        raise BadRequest(
            f"X-Request-Timeout must be an integer from 1 to {max_ms} (milliseconds)", code="invalid_header"
        )
    return millis / 1000.0


Service = Annotated[InferenceService, Depends(get_service)]


class _Query(BaseModel):
    top_k: int | None = Field(default=None, ge=1)

    @field_validator("top_k", mode="before")
    @classmethod
    def _digits(cls, value: object) -> object:
        """Decimal digits only: Python's int() also reads "+3", " 3" and "1_0"."""
        if isinstance(value, str) and not (value.isascii() and value.isdigit()):
            raise ValueError("must be a whole number written in digits")
        return value


def query_top_k(scope: Scope) -> int | None:
    """``top_k`` from the query string, validated as FastAPI would (422 ``validation_error``).
    Given twice with two values it is refused, as a prediction header is: whichever a server
    happened to read (the last) decided how many classes came back."""
    if not scope.get("query_string"):
        return None
    params = QueryParams(scope["query_string"])
    if len(set(params.getlist("top_k"))) > 1:
        raise RequestValidationError(
            [{"loc": ("query", "top_k"), "msg": "given more than once, with different values", "type": "value_error"}]
        )
    try:
        return _Query.model_validate(dict(params)).top_k
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("query", *e["loc"])} for e in exc.errors()]) from None


def checked_top_k(asked: int | None, server: ServerSettings, labels: int) -> int | None:
    """``asked`` (a body's or the query's ``top_k``), or 422 over what this model can answer:
    ``server.max_top_k``, and no more than its classes."""
    most = min(server.max_top_k, labels)
    if asked is not None and asked > most:
        raise SchemaError(f"top_k must be at most {most} for this model")
    return asked
