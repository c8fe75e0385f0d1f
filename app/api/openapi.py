"""The OpenAPI document, plus the schemas of bodies and parameters that routes read by hand."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.api.schemas import PredictRequest

_REF_TEMPLATE = "#/components/schemas/{model}"


def _parameter(name: str, where: str, description: str, **schema: object) -> dict[str, Any]:
    return {"name": name, "in": where, "required": False, "description": description, "schema": schema}


# The prediction routes read these by hand (FastAPI's per-parameter validation cost more than
# the rest of the route), so their documents declare them here.
PREDICT_PARAMETERS = [
    _parameter(
        "X-Urgency",
        "header",
        "`high` rides the urgent lane (2 ms window); `normal` or absent, the normal lane (any case)",
        type="string",
    ),
    _parameter(
        "X-Request-Timeout",
        "header",
        "milliseconds this request may take, at most server.max_timeout_ms",
        type="integer",
        minimum=1,
    ),
    _parameter(
        "X-Model-Version", "header", "pin a version of the model (404 if unknown, 503 if not loaded)", type="string"
    ),
    _parameter(
        "Authorization", "header", "Bearer <API key>, when server.api_key is set (off by default)", type="string"
    ),
    _parameter("top_k", "query", "for raw image bodies: how many classes to return", type="integer", minimum=1),
]


def install_openapi(app: FastAPI) -> None:
    """Generate the document once, with ``PredictRequest`` among its component schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            schemas["PredictRequest"] = PredictRequest.model_json_schema(ref_template=_REF_TEMPLATE)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
