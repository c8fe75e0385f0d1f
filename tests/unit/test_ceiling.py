"""The out-of-memory batch ceiling: it rises only on batches full at the cap, whatever the policy did meanwhile."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from app.batching.ceiling import Ceiling
from app.batching.policy import BatchPolicy, LanePolicy


def _policy(max_batch: int) -> BatchPolicy:
    return BatchPolicy(urgent=LanePolicy(0.002, max_batch, 64), normal=LanePolicy(0.025, max_batch, 64))


def test_a_policy_lowered_under_the_cap_and_set_back_meets_the_cap_again() -> None:
    ceiling = Ceiling("m/1", recovery_batches=3)
    ceiling.lower(8)
    assert ceiling.value == 4
    for _ in range(10):  # an operator lowers max_batch to 2 for a while: batches of 2 run fine
        ceiling.calm(2, _policy(2))
    assert ceiling.value == 4, "batches of 2 say nothing of the batch of 8 that failed"
    restored = ceiling.cap(_policy(16))
    assert restored.normal.max_batch == restored.urgent.max_batch == 4


def test_batches_full_at_the_cap_double_it_back_to_the_policys_own_sizes() -> None:
    ceiling = Ceiling("m/1", recovery_batches=2)
    ceiling.lower(16)
    climbed = []
    while ceiling.value is not None:
        size = ceiling.value
        for _ in range(2):
            ceiling.calm(size, _policy(16))
        climbed.append(ceiling.value)
    assert climbed == [None]  # 8 doubled reaches the policy's 16: its own sizes again
    ceiling.lower(16)
    ceiling.lower(4)
    assert ceiling.value == 2
    for expected in (4, 8, None):
        for _ in range(2):
            ceiling.calm(ceiling.value or 0, _policy(16))
        assert ceiling.value == expected


@given(
    failed=st.integers(2, 64),
    batches=st.lists(st.tuples(st.integers(1, 64), st.integers(1, 64)), max_size=60),
)
def test_the_cap_never_rises_on_batches_smaller_than_it(failed: int, batches: list[tuple[int, int]]) -> None:
    ceiling = Ceiling("m/1", recovery_batches=1)
    ceiling.lower(failed)
    cap = ceiling.value
    assert cap is not None
    for size, max_batch in batches:
        if size >= cap or size > max_batch:
            continue  # only smaller batches, under any policy: a batch at the cap may raise it
        ceiling.calm(size, _policy(max_batch))
        assert ceiling.value == cap


def test_the_cap_rises_only_once_the_sizes_it_lets_in_are_ready() -> None:
    asked: list[int] = []
    warmed = {"up_to": 8}

    def ready(size: int) -> bool:
        asked.append(size)
        return size <= warmed["up_to"]

    ceiling = Ceiling("m/1", recovery_batches=2, ready=ready)
    ceiling.lower(32)  # 16: its warm-up ran out of memory, say
    for _ in range(5):
        ceiling.calm(16, _policy(32))
    assert ceiling.value == 16, "32 is not warmed: the cap waits"
    assert asked == [32, 32, 32, 32], "asked at each batch at the cap once the calm ones were enough"
    warmed["up_to"] = 32
    ceiling.calm(16, _policy(32))
    assert ceiling.value is None and asked[-1] == 32
    ceiling.lower(8)
    for _ in range(2):
        ceiling.calm(4, _policy(32))
    assert ceiling.value == 8 and asked[-1] == 8, "a rise short of the policy's size asks for that size"


def test_a_size_that_fails_again_and_again_is_tried_ever_more_rarely() -> None:
    """A warm-up of the failed size, tried each time the cap would rise, failed each time under a
    pressure that stayed: every try another out-of-memory error (on CUDA another set-up under
    pressure). Each failure where the cap tried to rise doubles the wait, up to a bound."""
    batches, asked_at = 0, []

    def ready(size: int) -> bool:  # the warm-up of 32 starts, and runs out of memory again
        asked_at.append(batches)
        return False

    ceiling = Ceiling("m/1", recovery_batches=2, ready=ready)
    ceiling.lower(32)
    while len(asked_at) < 9:
        batches += 1
        ceiling.calm(16, _policy(32))
        if asked_at and asked_at[-1] == batches:
            ceiling.lower(32)  # its warm-up failed: the cap stays, and waits longer
    waits = [b - a for a, b in zip([0, *asked_at], asked_at, strict=False)]
    assert waits == [2, 4, 8, 16, 32, 64, 128, 128, 128]
    ceiling.reset()  # another model serves (the CPU fallback): its count starts afresh
    ceiling.lower(16)
    ceiling.lower(8)  # the halves of one split failing: no try of the cap's, no longer wait
    asked_at.clear()
    for _ in range(2):
        ceiling.calm(4, _policy(32))
    assert len(asked_at) == 1
