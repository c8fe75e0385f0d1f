"""Bearer-token checks: the admin API always, prediction routes when an API key is set."""

from __future__ import annotations

import functools
import hmac
from collections.abc import Sequence
from typing import Annotated

from fastapi import Header, Request
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.body import JSON_TYPE, media_type
from app.api.errors import service_error_response
from app.api.mount import route_path
from app.errors import Forbidden, LengthRequired, PayloadTooLarge, ServiceError, Unauthorized, UnsupportedMediaType

ADMIN_PREFIX = "/admin"
MAX_ADMIN_BODY_BYTES = 64 << 10  # a policy or a canary split: a few hundred bytes


def check_bearer(authorization: str | None, expected: bytes, what: str) -> None:
    """401 without a bearer token (an empty one included: RFC 6750 3.1, no credentials), 403
    with the wrong one (compared in constant time)."""
    # only spaces and tabs around the token (str.strip would take a latin-1 no-break space too)
    token = authorization[7:].strip(" \t") if authorization is not None else ""
    if authorization is None or not authorization.lower().startswith("bearer ") or not token:
        raise Unauthorized(f"{what} is required as Authorization: Bearer <token>")
    # compared as the bytes that came (header values arrive decoded as latin-1): a UTF-8 token's
    # bytes, decoded so and encoded again as UTF-8, never matched
    if not hmac.compare_digest(token.encode("latin-1", "replace"), expected):
        raise Forbidden(f"the bearer token is not {what}")


async def require_admin(
    request: Request, authorization: Annotated[str | None, Header(description="Bearer <admin token>")] = None
) -> None:
    check_bearer(authorization, request.app.state.admin_token, "an admin token")


def check_api_key(request: Request) -> None:
    """The prediction routes' check, when ``server.api_key`` is set (called by the route: a
    dependency's header parameter cost more than the check)."""
    expected: bytes | None = request.app.state.api_key
    if expected is not None:
        check_bearer(request.headers.get("authorization"), expected, "an API key")


def admin_gate(scope: Scope, routes: Sequence[BaseRoute] = ()) -> ASGIApp | None:
    """Before the router: a request for the admin API without the right token, or with a body
    over ``MAX_ADMIN_BODY_BYTES``, is answered here (None: it goes on). FastAPI would read and
    parse a route's body before its dependencies run, the token check among them. ``routes``
    (the admin API's) name the refusal's route in the metrics, as the router would have."""
    path = route_path(scope)  # under a mount's prefix too, as the router matches
    if path != ADMIN_PREFIX and not path.startswith(ADMIN_PREFIX + "/"):
        return None
    state = scope["app"].state
    expected: bytes | None = getattr(state, "admin_token", None)
    if not state.settings.admin.enabled or expected is None:  # not mounted (404), or not started
        return None
    headers = dict(scope["headers"])
    authorization = headers.get(b"authorization")
    try:
        check_bearer(None if authorization is None else authorization.decode("latin-1"), expected, "an admin token")
        if b"transfer-encoding" in headers:  # chunked: its size is known only once it is all read
            raise LengthRequired("an admin request's body needs a Content-Length")
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > MAX_ADMIN_BODY_BYTES:
            raise PayloadTooLarge(
                f"an admin request's body is limited to {MAX_ADMIN_BODY_BYTES} bytes", code="body_too_large"
            )
        content_type = media_type(headers.get(b"content-type", b"").decode("latin-1"))
        if int(declared) and not _json(content_type) and getattr(_route(scope, routes), "body_field", None):
            # FastAPI would take the body for a string, and refuse it 422 as "not a valid dictionary"
            raise UnsupportedMediaType(f"an admin request's body is {JSON_TYPE}; got {content_type or 'none'}")
    except ServiceError as exc:
        if (route := _route(scope, routes)) is not None:
            scope["state"]["route"] = getattr(route, "path", None)
        return functools.partial(_refuse, exc)
    return None


def _route(scope: Scope, routes: Sequence[BaseRoute]) -> BaseRoute | None:
    """The route of ``routes`` the request is for: by its path and method, else by its path alone
    (the method is wrong: a 405), if any."""
    matches = [(route.matches(scope)[0], route) for route in routes]
    full = next((route for match, route in matches if match is Match.FULL), None)
    return full or next((route for match, route in matches if match is Match.PARTIAL), None)


def _json(content_type: str) -> bool:
    """A media type FastAPI reads a body of as JSON: application/json, or application/*+json."""
    return content_type == JSON_TYPE or (content_type.startswith("application/") and content_type.endswith("+json"))


async def _refuse(exc: ServiceError, scope: Scope, receive: Receive, send: Send) -> None:
    response = await service_error_response(Request(scope, receive, send), exc)
    await response(scope, receive, send)
