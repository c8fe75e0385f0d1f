"""Admin: model versions. Load, unload, promote (verified), roll back, canary split."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.api.auth import require_admin
from app.api.errors import error_responses
from app.api.routes.models import describe_model
from app.api.schemas import ModelVersion
from app.lifecycle.manager import LifecycleManager

router = APIRouter(prefix="/admin/models", tags=["admin"], dependencies=[Depends(require_admin)])
# no 422: a path's names are strings, and a body these routes do not take is not read
_ERRORS = error_responses(401, 403, 404, 409, 503)
_QUERY_ERRORS = {**_ERRORS, 422: {**error_responses(422)[422], "description": "`force` is not a boolean"}}
# a body that is not JSON, sent chunked, over its limit, not declared JSON (the admin gate), or
# not the schema
_BODY_ERRORS = {**_ERRORS, **error_responses(400, 411, 413, 415, 422)}


class CanaryRequest(BaseModel):
    # strict: JSON's true is not a share of 1, nor "0.5" a number; a key misspelled is refused
    model_config = ConfigDict(extra="forbid", strict=True)

    weights: dict[str, Annotated[float, Field(ge=0, le=1)]] = Field(
        description="version -> share of unpinned traffic; the default gets the rest", examples=[{"2": 0.1}]
    )

    @model_validator(mode="after")
    def _at_most_all(self) -> CanaryRequest:
        if sum(self.weights.values()) > 1 + 1e-9:
            raise ValueError("the canary weights add up to more than 1")
        return self


class PromotionResponse(ModelVersion):
    waived: list[str] = Field(default=[], description="gate failures overridden by force")


def _manager(request: Request) -> LifecycleManager:
    manager: LifecycleManager = request.app.state.lifecycle
    return manager


@router.post("/{name}/versions/{version}/load", response_model=ModelVersion, responses=_ERRORS)
async def load_version(name: str, version: str, request: Request) -> ModelVersion:
    """Load a version from the repository (also one added since start-up) next to the others."""
    await _manager(request).load(name, version)
    return describe_model(request.app.state.service, name)


@router.post("/{name}/versions/{version}/unload", response_model=ModelVersion, responses=_ERRORS)
async def unload_version(name: str, version: str, request: Request) -> ModelVersion:
    """Stop routing to a version (its canary share goes to the default) and drain it; the default cannot be unloaded."""
    await _manager(request).unload(name, version)
    return describe_model(request.app.state.service, name)


@router.post("/{name}/versions/{version}/promote", response_model=PromotionResponse, responses=_QUERY_ERRORS)
async def promote_version(
    name: str,
    version: str,
    request: Request,
    force: Annotated[bool, Query(description="promote even if a gate fails")] = False,
) -> PromotionResponse:
    """Make a loaded version the default, if its recorded accuracy passes the gates (409 says which failed).

    Its canary share ends (it takes the rest); the other versions keep theirs; the old default
    becomes the previous one, which a rollback returns to, and gets no share."""
    waived = await _manager(request).promote(name, version, force)
    return PromotionResponse(**describe_model(request.app.state.service, name).model_dump(), waived=waived)


@router.post("/{name}/rollback", response_model=ModelVersion, responses=_ERRORS)
async def rollback(name: str, request: Request) -> ModelVersion:
    """The previous default becomes the default again, once: with no previous default (none
    replaced since start-up, a rollback made already, or it was unloaded) it is a 409; the version
    rolled back from stays loaded, with no share of unpinned traffic, and returns through a promotion, gated."""
    await _manager(request).rollback(name)
    return describe_model(request.app.state.service, name)


@router.put("/{name}/canary", response_model=ModelVersion, responses=_BODY_ERRORS)
async def set_canary(name: str, body: CanaryRequest, request: Request) -> ModelVersion:
    """Send shares of unpinned traffic to loaded non-default versions (`{}` turns the canary off)."""
    await _manager(request).set_canary(name, body.weights)
    return describe_model(request.app.state.service, name)
