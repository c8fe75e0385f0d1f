"""Dependencies: the service from ``app.state``, and the request headers, validated.

All ``async def``: FastAPI runs a plain ``def`` dependency in a worker thread, a thread
hop per dependency per request for work that takes microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Request

from app.batching import Lane
from app.errors import BadRequest
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
    request_id: str


async def get_predict_headers(
    request: Request,
    x_urgency: Annotated[
        str | None,
        Header(description="`high` rides the urgent lane (2 ms window); `normal` or absent, the normal lane"),
    ] = None,
    x_request_timeout: Annotated[
        str | None, Header(description="milliseconds this request may take, at most server.max_timeout_ms")
    ] = None,
    x_model_version: Annotated[
        str | None, Header(description="pin a version of the model (404 if unknown, 503 if not loaded)")
    ] = None,
) -> PredictHeaders:
    # one dependency for all three headers: FastAPI's cost is per dependency, per request
    state = request.scope["state"]
    lane, timeout_s, version = parse_predict_headers(
        x_urgency, x_request_timeout, x_model_version, request.app.state.settings.server
    )
    state["lane"] = lane.value  # for the latency metric
    return PredictHeaders(lane=lane, timeout_s=timeout_s, version=version, request_id=state["request_id"])


def parse_predict_headers(
    urgency: str | None, timeout: str | None, version: str | None, server: ServerSettings
) -> tuple[Lane, float, str | None]:
    """Lane, deadline in seconds and pinned version from the raw header values (400 when bad)."""
    lane = _LANES.get("normal" if urgency is None else urgency.strip().lower())
    if lane is None:
        raise BadRequest("X-Urgency must be 'high' or 'normal'", code="invalid_header")
    timeout_s = _timeout_s(timeout, server.default_timeout_ms, server.max_timeout_ms)
    return lane, timeout_s, version.strip() if version is not None else None


def _timeout_s(header: str | None, default_ms: int, max_ms: int) -> float:
    if header is None:
        return default_ms / 1000.0
    try:
        millis = int(header.strip())
    except ValueError:
        millis = 0
    if not 1 <= millis <= max_ms:
        raise BadRequest(
            f"X-Request-Timeout must be an integer from 1 to {max_ms} (milliseconds)", code="invalid_header"
        )
    return millis / 1000.0


Service = Annotated[InferenceService, Depends(get_service)]
Headers = Annotated[PredictHeaders, Depends(get_predict_headers)]
