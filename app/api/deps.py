"""Dependencies: the service from ``app.state``, and the request headers, validated.

All ``async def``: FastAPI runs a plain ``def`` dependency in a worker thread, a thread
hop per dependency per request for work that takes microseconds.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from app.batching import Lane
from app.errors import BadRequest
from app.service import InferenceService


async def get_service(request: Request) -> InferenceService:
    service: InferenceService = request.app.state.service
    return service


async def get_lane(
    request: Request,
    x_urgency: Annotated[
        str | None,
        Header(description="`high` rides the urgent lane (2 ms window); `normal` or absent, the normal lane"),
    ] = None,
) -> Lane:
    value = "normal" if x_urgency is None else x_urgency.strip().lower()
    lanes = {"high": Lane.URGENT, "normal": Lane.NORMAL}
    if value not in lanes:
        raise BadRequest("X-Urgency must be 'high' or 'normal'", code="invalid_header")
    request.scope["state"]["lane"] = lanes[value].value  # for the latency metric
    return lanes[value]


async def get_timeout_s(
    request: Request,
    x_request_timeout: Annotated[
        str | None, Header(description="milliseconds this request may take, at most server.max_timeout_ms")
    ] = None,
) -> float:
    server = (await get_service(request)).settings.server
    if x_request_timeout is None:
        return server.default_timeout_ms / 1000.0
    try:
        millis = int(x_request_timeout.strip())
    except ValueError:
        millis = 0
    if not 1 <= millis <= server.max_timeout_ms:
        raise BadRequest(
            f"X-Request-Timeout must be an integer from 1 to {server.max_timeout_ms} (milliseconds)",
            code="invalid_header",
        )
    return millis / 1000.0


async def get_version(
    x_model_version: Annotated[
        str | None, Header(description="pin a version of the model (404 if unknown, 503 if not loaded)")
    ] = None,
) -> str | None:
    return x_model_version.strip() if x_model_version is not None else None


async def get_request_id(request: Request) -> str:
    request_id: str = request.scope["state"]["request_id"]
    return request_id


Service = Annotated[InferenceService, Depends(get_service)]
LaneDep = Annotated[Lane, Depends(get_lane)]
TimeoutDep = Annotated[float, Depends(get_timeout_s)]
RequestId = Annotated[str, Depends(get_request_id)]
VersionDep = Annotated[str | None, Depends(get_version)]
