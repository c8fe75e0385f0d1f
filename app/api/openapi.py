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
        enum=["high", "normal"],
    ),
    _parameter(
        "X-Request-Timeout",
        "header",
        "milliseconds this request may take (default server.default_timeout_ms), at most server.max_timeout_ms",
        type="integer",
        minimum=1,
    ),
    _parameter(
        "X-Model-Version", "header", "pin a version of the model (404 if unknown, 503 if not loaded)", type="string"
    ),
    _parameter(
        "X-Request-ID",
        "header",
        "the request's id, echoed in the answer and its logs and spans (a new one if absent or not valid)",
        type="string",
    ),
    _parameter(
        "top_k",
        "query",
        "how many classes to return (default server.default_top_k); with a JSON body naming another, a 422",
        type="integer",
        minimum=1,
    ),
]

# the credentials the routes check by hand (``app.api.auth``), as OpenAPI declares them: an
# ``Authorization`` header parameter is ignored there, and generated clients could not send one
SECURITY_SCHEMES = {
    "adminToken": {"type": "http", "scheme": "bearer", "description": "admin.token or admin.token_file"},
    "apiKey": {"type": "http", "scheme": "bearer", "description": "server.api_key or server.api_key_file"},
}
_HEADERS = {
    "X-Request-ID": {"description": "the request's id", "schema": {"type": "string"}},
    "X-Trace-Id": {"description": "its trace, while spans are exported", "schema": {"type": "string"}},
}
_RETRY_AFTER = {"description": "seconds to wait before a retry", "schema": {"type": "integer"}}


def install_openapi(app: FastAPI, max_timeout_ms: int, keyed: bool) -> None:
    """Generate the document once, with ``PredictRequest`` among its component schemas, the
    credentials as security schemes (``keyed``: predictions need the API key), the response
    headers every answer has, and ``Retry-After`` on each 503."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            components = document.setdefault("components", {})
            components.setdefault("schemas", {})["PredictRequest"] = PredictRequest.model_json_schema(
                ref_template=_REF_TEMPLATE
            )
            components["securitySchemes"] = SECURITY_SCHEMES
            for path, operations in document.get("paths", {}).items():
                for operation in operations.values():
                    _describe(operation, path, max_timeout_ms, keyed)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _describe(operation: dict[str, Any], path: str, max_timeout_ms: int, keyed: bool) -> None:
    """One operation's credentials, bounds and response headers, as the server has them."""
    parameters = [p for p in operation.get("parameters", []) if p.get("name", "").lower() != "authorization"]
    for parameter in parameters:
        if parameter.get("name") == "X-Request-Timeout":
            parameter["schema"] = {**parameter["schema"], "maximum": max_timeout_ms}
    if "parameters" in operation:
        operation["parameters"] = parameters
    if path.startswith("/admin"):
        operation["security"] = [{"adminToken": []}]
    elif keyed and any(p.get("name") == "X-Urgency" for p in parameters):  # a prediction
        operation["security"] = [{"apiKey": []}]
    for status, response in operation.get("responses", {}).items():
        headers = {**_HEADERS, **({"Retry-After": _RETRY_AFTER} if status == "503" else {})}
        response["headers"] = {**response.get("headers", {}), **headers}
