"""The bearer-token check the admin API and a keyed prediction route share."""

from __future__ import annotations

import pytest

from app.api.auth import check_bearer
from app.errors import Forbidden, Unauthorized

KEY = b"prediction-key-0123456789abcdef"


@pytest.mark.parametrize("authorization", [None, "Basic abc", "Bearer", "Bearer ", "Bearer \t  ", "bearer "])
def test_no_token_is_a_401(authorization: str | None) -> None:
    """An empty token is no credentials (RFC 6750, 3.1): it was a 403, as a wrong token is."""
    with pytest.raises(Unauthorized):
        check_bearer(authorization, KEY, "an API key")


@pytest.mark.parametrize("authorization", ["Bearer wrong-key-0123456789", "Bearer \xa0", f"Bearer {KEY.decode()}x"])
def test_a_wrong_token_is_a_403(authorization: str) -> None:
    with pytest.raises(Forbidden):
        check_bearer(authorization, KEY, "an API key")


@pytest.mark.parametrize("authorization", [f"Bearer {KEY.decode()}", f"bearer \t{KEY.decode()} "])
def test_the_token_passes_whatever_the_scheme_s_case_and_the_spaces_around_it(authorization: str) -> None:
    check_bearer(authorization, KEY, "an API key")
