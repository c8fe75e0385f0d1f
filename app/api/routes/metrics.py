"""Prometheus scrapes ``/metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics in the text exposition format",
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "the metrics"}},
)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# HEAD wherever GET is (RFC 9110, 9.1), as the probes have it
router.add_api_route("/metrics", metrics, methods=["HEAD"], include_in_schema=False)
