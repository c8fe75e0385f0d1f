"""The admin API: the live batching policy. Mounted only when ``admin.enabled``."""

from __future__ import annotations

import asyncio
import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Request

from app.api.errors import error_responses
from app.errors import Forbidden, Unauthorized
from app.policy import PolicyManager
from app.settings import BatchingSettings


async def require_admin(
    request: Request, authorization: Annotated[str | None, Header(description="Bearer <admin token>")] = None
) -> None:
    """401 without a bearer token, 403 with the wrong one (compared in constant time)."""
    if authorization is None or not authorization.lower().startswith("bearer "):
        raise Unauthorized("an admin bearer token is required")
    token: bytes = request.app.state.admin_token
    if not hmac.compare_digest(authorization[7:].strip().encode(), token):
        raise Forbidden("wrong admin token")


router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])
_ERRORS = error_responses(401, 403, 422)


def _policy(request: Request) -> PolicyManager:
    manager: PolicyManager = request.app.state.policy
    return manager


@router.get("/policy", response_model=BatchingSettings, responses=_ERRORS, summary="The live batching policy")
async def get_policy(request: Request) -> BatchingSettings:
    return _policy(request).current


@router.put(
    "/policy",
    response_model=BatchingSettings,
    responses=_ERRORS,
    summary="Change the batching policy (a partial document merges into the live one)",
)
async def put_policy(
    request: Request,
    patch: Annotated[
        dict[str, Any],
        Body(examples=[{"normal": {"window_ms": 10, "max_batch": 32}, "urgent_fill": False}]),
    ],
) -> BatchingSettings:
    """Applies from the next batch; an invalid change is refused (422) and the old policy stays."""
    return _policy(request).update(patch)


@router.post("/policy/reload", response_model=BatchingSettings, responses=_ERRORS, summary="Re-read the config file")
async def reload_policy(request: Request) -> BatchingSettings:
    manager = _policy(request)
    await asyncio.to_thread(manager.reload, True)
    return manager.current
