"""Routing snapshots: what a promotion, a rollback and an unload do to the default, the
previous default and the canary split (the three rules the README states)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.routing import Routing

VERSIONS = ("1", "2", "3", "4")


def routing(default: str = "1", canary: dict[str, float] | None = None) -> Routing[str]:
    return Routing(loaded={v: f"served {v}" for v in VERSIONS}, default=default, canary=canary or {})


def test_a_promotion_ends_the_promoted_share_keeps_the_others_and_remembers_the_old_default() -> None:
    promoted = routing(canary={"2": 0.1, "3": 0.2}).promoted("2")
    assert (promoted.default, promoted.previous, promoted.canary) == ("2", "1", {"3": 0.2})


def test_a_second_rollback_is_refused_and_does_not_put_the_demoted_version_back() -> None:
    rolled = routing(canary={"3": 0.2}).promoted("2").rolled_back()
    assert (rolled.default, rolled.previous, rolled.canary) == ("1", None, {"3": 0.2})
    with pytest.raises(ValueError, match="no previous default to roll back to: version 1 is the default"):
        rolled.rolled_back()


def test_a_rollback_with_nothing_promoted_is_refused() -> None:
    with pytest.raises(ValueError, match="no previous default"):
        routing().rolled_back()


def test_an_unload_drops_its_share_and_the_previous_default_it_was() -> None:
    promoted = routing(canary={"3": 0.2}).promoted("2")
    assert promoted.without("3").canary == {}
    unloaded = promoted.without("1")
    assert unloaded.previous is None
    with pytest.raises(ValueError, match="no previous default"):
        unloaded.rolled_back()


@given(st.lists(st.tuples(st.sampled_from(("promote", "rollback")), st.sampled_from(VERSIONS)), max_size=12))
def test_a_rollback_only_ever_returns_to_a_default_a_promotion_replaced(steps: list[tuple[str, str]]) -> None:
    """Whatever the sequence, a rollback makes default a version that was the default just before
    the last promotion, and two rollbacks never follow each other without a promotion between."""
    state = routing()
    last: str | None = None  # the last call that changed the routing
    for action, version in steps:
        if action == "promote":
            before = state.default
            state = state.promoted(version)
            if state.default != before:
                last = "promote"
            continue
        try:
            replaced = state.previous
            state = state.rolled_back()
        except ValueError:
            assert last != "promote", "a rollback right after a promotion goes through"
            continue
        assert last == "promote" and state.default == replaced and state.previous is None
        last = "rollback"
