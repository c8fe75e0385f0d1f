"""The OpenAPI document, plus the schemas of bodies and parameters that routes read by hand."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.api.errors import error_responses
from app.api.schemas import PredictRequest
from app.settings import ServerSettings

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
        "how many classes to return, 1 to min(server.max_top_k, the model's classes); absent, "
        "server.default_top_k (the schema's default), or every class of a model with fewer. Decimal digits "
        "only: `3.0`, `+3` or `3e0` is a 422. With a JSON body naming another, a 422",
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
    "X-Trace-Id": {
        "description": "its trace: while tracing is on, or the caller's when the request carries a `traceparent`",
        "schema": {"type": "string"},
    },
}
_RETRY_AFTER = {"description": "seconds to wait before a retry", "schema": {"type": "integer"}}
# what no operation can declare: OpenAPI describes a method a path has, and a 405 is the answer to
# one it lacks (listed on an operation, a client would read that the operation itself can refuse)
_DESCRIPTION = (
    "Every error is the envelope `ErrorResponse`, with the status and a stable `code`. Besides each "
    "operation's own answers: a method a path does not have (say `GET /predict`) is a 405 "
    "`method_not_allowed` whose `Allow` header lists the methods it has (`HEAD` wherever `GET` is); a path "
    "that is not listed (one with a trailing slash too: no redirect) is a 404 `not_found`."
)


def install_openapi(app: FastAPI, server: ServerSettings) -> None:
    """Generate the document once, with ``PredictRequest`` among its component schemas, the
    credentials as security schemes (predictions need the API key where ``server`` sets one), the
    response headers every answer has, ``Retry-After`` on each 503, a 500 on every operation, and
    ``server``'s bounds and defaults (``X-Request-Timeout``'s maximum, ``top_k``'s default)."""
    max_timeout_ms, default_top_k = server.max_timeout_ms, server.default_top_k
    keyed = server.api_key is not None or server.api_key_file is not None

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, summary=app.summary, description=_DESCRIPTION, routes=app.routes
            )
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            schemas["PredictRequest"] = PredictRequest.model_json_schema(ref_template=_REF_TEMPLATE)
            schemas["PredictRequest"]["properties"]["top_k"]["default"] = default_top_k  # pydantic's: null
            document["components"]["securitySchemes"] = SECURITY_SCHEMES
            for path, operations in document.get("paths", {}).items():
                for operation in operations.values():
                    _describe(operation, path, max_timeout_ms, keyed, default_top_k)
            for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, dropped in _describe
                schemas.pop(unused, None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _describe(operation: dict[str, Any], path: str, max_timeout_ms: int, keyed: bool, default_top_k: int) -> None:
    """One operation's credentials, bounds, defaults, 500 and response headers, as the server has them."""
    parameters = [p for p in operation.get("parameters", []) if p.get("name", "").lower() != "authorization"]
    for parameter in parameters:
        if parameter.get("name") == "X-Request-Timeout":
            parameter["schema"] = {**parameter["schema"], "maximum": max_timeout_ms}
        elif parameter.get("name") == "top_k":
            parameter["schema"] = {**parameter["schema"], "default": default_top_k}
    if "parameters" in operation:
        operation["parameters"] = parameters
    if path.startswith("/admin"):
        operation["security"] = [{"adminToken": []}]
    elif keyed and any(p.get("name") == "X-Urgency" for p in parameters):  # a prediction
        operation["security"] = [{"apiKey": []}]
    responses = operation.setdefault("responses", {})
    if _fastapis_422(responses.get("422")):
        # FastAPI adds it to any route with a parameter (a path's string, which nothing can fail
        # too), in its own schema; the service's 422 is the envelope, and each route that can
        # answer one lists it (``error_responses(422)``)
        del responses["422"]
    # any operation can answer a bug's generic 500 (the middleware's last resort, or a ServiceError
    # of a 5xx other than 503), in the envelope
    responses.setdefault("500", _internal_error())
    for status, response in responses.items():
        headers = {**_HEADERS, **({"Retry-After": _RETRY_AFTER} if status == "503" else {})}
        response["headers"] = {**response.get("headers", {}), **headers}


def _internal_error() -> dict[str, Any]:
    """A 500 as ``error_responses(500)`` declares it on a route (a fresh one: its headers are set per operation)."""
    return {
        "description": error_responses(500)[500]["description"],
        "content": {"application/json": {"schema": {"$ref": _REF_TEMPLATE.format(model="ErrorResponse")}}},
    }


def _fastapis_422(response: dict[str, Any] | None) -> bool:
    """Whether ``response`` is the 422 FastAPI added by itself (its ``HTTPValidationError``)."""
    schema = (response or {}).get("content", {}).get("application/json", {}).get("schema", {})
    return bool(schema.get("$ref", "").endswith("/HTTPValidationError"))
