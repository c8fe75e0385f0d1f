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


async def require_api_key(
    request: Request,
    authorization: Annotated[
        str | None, Header(description="Bearer <API key>, when server.api_key is set (off by default)")
    ] = None,
) -> None:
    expected: bytes | None = request.app.state.api_key
    if expected is not None:
        check_bearer(authorization, expected, "an API key")
