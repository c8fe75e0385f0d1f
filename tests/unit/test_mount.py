"""A request's path relative to the app's mount (``app.api.mount``), as Starlette's router takes it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette._utils import get_route_path

from app.api.mount import route_path


@pytest.mark.parametrize(
    ("root_path", "path", "expected"),
    [
        ("/tight", "/tight/predict", "/predict"),
        ("/tight", "/tight/v1/models/digits/predict", "/v1/models/digits/predict"),
        ("/a/b", "/a/b/admin/policy", "/admin/policy"),
        ("/tight", "/tight", ""),
        ("/tight", "/tightly/predict", "/tightly/predict"),  # another prefix, which only begins the same
        ("/tight", "/predict", "/predict"),  # not under it at all: as it came
    ],
)
def test_the_mount_s_prefix_is_taken_off_at_a_segment_s_edge(root_path: str, path: str, expected: str) -> None:
    assert route_path({"path": path, "root_path": root_path}) == expected


def test_at_the_root_the_path_is_the_scope_s_own() -> None:
    path = "/v1/models/digits/predict"
    assert route_path({"path": path, "root_path": ""}) is path
    assert route_path({"path": path}) is path


segments = st.lists(st.sampled_from(["", "tight", "tightly", "predict", "a", "v1"]), max_size=4)


@given(root=segments, rest=segments, prefixed=st.booleans())
def test_the_router_matches_the_same_path(root: list[str], rest: list[str], prefixed: bool) -> None:
    root_path = "".join(f"/{s}" for s in root)
    path = (root_path if prefixed else "") + "".join(f"/{s}" for s in rest)
    scope = {"path": path, "root_path": root_path}
    assert route_path(scope) == get_route_path(scope)
