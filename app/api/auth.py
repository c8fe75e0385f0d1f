"""Bearer-token checks: the admin API always, prediction routes when an API key is set."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Header, Request

from app.errors import Forbidden, Unauthorized


def check_bearer(authorization: str | None, expected: bytes, what: str) -> None:
    """401 without a bearer token, 403 with the wrong one (compared in constant time)."""
    if authorization is None or not authorization.lower().startswith("bearer "):
        raise Unauthorized(f"{what} is required as Authorization: Bearer <token>")
    if not hmac.compare_digest(authorization[7:].strip().encode(), expected):
        raise Forbidden(f"wrong {what}")


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
