"""The admin API: the live batching policy. Mounted only when ``admin.enabled``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request

from app.api.auth import require_admin
from app.api.errors import error_responses
from app.policy import PolicyManager
from app.settings import BatchingSettings

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])
_ERRORS = error_responses(401, 403)
_REFUSED = {**_ERRORS, 422: {**error_responses(422)[422], "description": "The policy does not validate"}}
# a body that is not JSON, sent chunked, over its limit, or not declared JSON (the admin gate)
_BODY_ERRORS = {**_REFUSED, **error_responses(400, 411, 413, 415)}


def _policy(request: Request) -> PolicyManager:
    manager: PolicyManager = request.app.state.policy
    return manager


@router.get("/policy", response_model=BatchingSettings, responses=_ERRORS, summary="The live batching policy")
async def get_policy(request: Request) -> BatchingSettings:
    return _policy(request).current


router.add_api_route("/policy", get_policy, methods=["HEAD"], include_in_schema=False)  # wherever GET is


@router.put(
    "/policy",
    response_model=BatchingSettings,
    responses=_BODY_ERRORS,
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


@router.post("/policy/reload", response_model=BatchingSettings, responses=_REFUSED, summary="Re-read the config file")
async def reload_policy(request: Request) -> BatchingSettings:
    """Applies the file's batching now, undoing admin changes; an invalid file is refused (422)."""
    manager = _policy(request)
    await manager.reload(strict=True)
    return manager.current
