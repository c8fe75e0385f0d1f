"""Which models are served, their versions and the default."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import Service
from app.api.errors import error_responses
from app.api.schemas import ModelsResponse, ModelVersion
from app.errors import NotFound, quoted
from app.inference.device import dtype_name
from app.service import InferenceService

router = APIRouter(tags=["models"])


def _describe(service: InferenceService) -> ModelsResponse:
    models = []
    for entry in service.entries:
        group = service.groups.get(entry.name)
        routing = group.routing if group else None
        served = group.default if group else None
        models.append(
            ModelVersion(
                name=entry.name,
                versions=list(group.known_versions if group else entry.versions),
                loaded_version=served.version if served else None,
                loaded_versions=sorted(routing.loaded, key=int) if routing else [],
                previous_version=routing.previous if routing else None,
                canary=dict(routing.canary) if routing else {},
                state="loaded" if served else "not_loaded",
                default=entry.name == service.default_model,
                labels=len(served.labels) if served else None,
                device=str(service.device) if served else None,
                dtype=dtype_name(service.dtype) if served else None,
                heads_loaded=list(served.model.loaded_heads) if served else [],
            )
        )
    return ModelsResponse(default=service.default_model, models=models)


@router.get("/v1/models", response_model=ModelsResponse, summary="List models, versions and the default")
async def list_models(service: Service) -> ModelsResponse:
    return _describe(service)


def describe_model(service: InferenceService, name: str) -> ModelVersion:
    """One model as ``/v1/models`` shows it; 404 when the repository has no such model."""
    for model in _describe(service).models:
        if model.name == name:
            return model
    raise NotFound(f"no model named {quoted(name)}", code="model_not_found")


@router.get(
    "/v1/models/{name}", response_model=ModelVersion, responses=error_responses(404), summary="Describe one model"
)
async def get_model(name: str, service: Service) -> ModelVersion:
    return describe_model(service, name)


# HEAD wherever GET is (RFC 9110, 9.1), as the probes and /metrics have it
router.add_api_route("/v1/models", list_models, methods=["HEAD"], include_in_schema=False)
router.add_api_route("/v1/models/{name}", get_model, methods=["HEAD"], include_in_schema=False)
