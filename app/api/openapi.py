"""The OpenAPI document, plus the schemas of bodies that routes read by hand."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.api.schemas import PredictRequest

_REF_TEMPLATE = "#/components/schemas/{model}"


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
