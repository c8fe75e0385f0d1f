"""One envelope for every error, and the OpenAPI declarations that go with it."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from opentelemetry import trace
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from app.api.disconnect import ClientClosed, NothingSent
from app.api.schemas import ErrorDetail, ErrorResponse
from app.errors import MAX_LISTED_ERRORS, ServiceError, not_listed, shown
from app.telemetry.logging import request_id_var

log = logging.getLogger(__name__)

_UNPARSABLE_BODY = "There was an error parsing the body"  # FastAPI's 400 for a body it could not read
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type"}
_DESCRIPTIONS = {
    400: "Malformed request: bad JSON, bad base64, undecodable or unsupported image, bad header value",
    401: "Missing credentials",
    403: "Wrong credentials",
    404: "Unknown model or version",
    409: "Conflicts with the current state (e.g. unloading the default, a refused promotion)",
    411: "A body sent chunked, with no Content-Length",
    413: "Body or image over its limit, or too many pixels",
    415: "Content-Type not accepted",
    422: "Body violates the schema",
    500: "A bug: generic body, detail in the log under the request id",
    503: "Cannot serve now (not ready, queue full, deadline, draining); see Retry-After and the code",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: each status with the envelope schema."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]} for status in statuses}


def envelope(
    request: Request,
    status: int,
    code: str,
    message: str,
    *,
    retry_after_s: int | None = None,
    details: list[dict[str, Any]] | None = None,
) -> JSONResponse:
    request.scope.setdefault("state", {})["error_code"] = code  # for the requests metric
    listed = None if details is None else [ErrorDetail.model_validate(detail) for detail in details]
    body = ErrorResponse(code=code, message=message, request_id=request_id_var.get(), details=listed)
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status, headers=headers)


def retry_after(exc: ServiceError) -> int:
    """The ``Retry-After`` seconds of a 503: the error's own, else one."""
    return exc.retry_after_s or 1


async def service_error_response(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    if exc.status >= 500 and exc.status != 503:
        if exc.logged:  # one traceback for the batch, not one more for each of its requests
            log.error("request failed: %s (%s; its traceback is logged with its batch)", exc.code, exc)
        else:
            log.error("request failed: %s", exc.code, exc_info=exc.__cause__ or exc)
        return envelope(request, 500, "internal_error", "internal server error")
    retry = retry_after(exc) if exc.status == 503 else None
    response = envelope(request, exc.status, exc.code, exc.message, retry_after_s=retry)
    if exc.status == 401:  # RFC 9110: a 401 names the scheme that would be accepted
        response.headers["WWW-Authenticate"] = "Bearer"
    for name, value in exc.headers:
        response.headers[name] = value
    return response


async def _client_closed(request: Request, exc: Exception) -> Response:
    """A request whose client went is sent nothing. Its server span then records no HTTP status
    (OpenTelemetry's HTTP conventions: ``http.response.status_code`` only where one was sent; a
    499 there read as an answer the client got) and says why it ended in ``error.type`` (the
    request ended before a status was sent) and ``error.code``, its status left unset (a client
    leaving is no failure of the service). The access log and the requests metric count it as 499
    ``client_closed_request`` (``answered_as``, which the middleware counts as the answer)."""
    assert isinstance(exc, ClientClosed)
    state = request.scope.setdefault("state", {})
    if "answered_as" in state:  # the protocol answered it (its body broke): its span records that status
        return await service_error_response(request, exc)
    state["answered_as"] = (exc.status, exc.code)
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({"error.type": exc.code, "error.code": exc.code})
    return NothingSent()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    if any(error.get("type") == "json_invalid" for error in exc.errors()):  # an admin body, say
        return envelope(request, 400, "invalid_json", "the body is not valid JSON")
    errors = exc.errors()
    details = [
        {"loc": [shown(part) for part in error.get("loc", ())], "msg": error.get("msg", ""), "type": error["type"]}
        for error in errors[:MAX_LISTED_ERRORS]
    ]
    message = "the request does not match the schema" + not_listed(len(errors))
    return envelope(request, 422, "validation_error", message, details=details)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if isinstance(exc.__cause__, ServiceError):  # raised as FastAPI read the body (its 408), and wrapped by it
        return await service_error_response(request, exc.__cause__)
    if exc.status_code == 400 and exc.detail == _UNPARSABLE_BODY:  # JSON nested past Python's recursion limit, say
        return envelope(request, 400, "invalid_json", "the body is not valid JSON, or is nested too deeply")
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    response = envelope(request, exc.status_code, code, str(exc.detail))
    response.headers.update(exc.headers or {})  # e.g. Allow on a 405
    if exc.status_code == 405 and (allowed := _allowed(request.app.routes, request.scope)):
        response.headers["Allow"] = ", ".join(sorted(allowed))  # Starlette's names one route's only
    return response


def _allowed(routes: Iterable[BaseRoute], scope: Scope) -> set[str]:
    """Every method some route serves at this request's path (RFC 9110, 15.5.6), looking into
    the routers FastAPI keeps whole (``original_router``); none when it cannot tell."""
    methods: set[str] = set()
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            methods |= _allowed(inner.routes, scope)
        elif route.matches(scope)[0] is not Match.NONE:  # PARTIAL: the path, not the method
            methods |= set(getattr(route, "methods", None) or ())
    return methods


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, service_error_response)
    app.add_exception_handler(ClientClosed, _client_closed)  # looked up by class: before ServiceError's
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
