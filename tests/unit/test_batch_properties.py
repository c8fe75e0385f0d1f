"""Properties of batch forming: the pure rules, and whole runs under random arrivals."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from hypothesis import example, given, settings
from hypothesis import strategies as st

from app.batching import BatchPolicy, DualWindowBatcher, Lane, LanePolicy, UrgentFill
from app.batching.policy import LaneState, is_ready, next_wakeup, plan_batch
from tests.unit.fakes import FakeClock, settle
from tests.unit.strategies import batch_policies

policies = batch_policies(st.floats(min_value=0.0005, max_value=0.1), max_batch=32, max_extra_queue=64, max_backlog=4)


@st.composite
def lane_states(draw: st.DrawFn) -> LaneState:
    waiting = draw(st.integers(min_value=0, max_value=100))
    oldest = draw(st.floats(min_value=0.0, max_value=1.0)) if waiting else None
    return LaneState(waiting, oldest)


@given(
    lane_states(),
    lane_states(),
    policies,
    st.floats(min_value=0.0, max_value=1.2),
    st.booleans(),
    st.integers(min_value=1, max_value=4),
    st.booleans(),
    st.integers(min_value=0, max_value=64),
    st.booleans(),
)
# pinned: under ``backlog`` with the rule holding, urgent requests that waited (riders=False) still fill
@example(
    LaneState(1, 0.0),
    LaneState(8, 0.0),
    BatchPolicy(LanePolicy(0.002, 4, 8), LanePolicy(0.025, 2, 64), UrgentFill.BACKLOG),
    1.0,
    False,
    2,
    False,
    0,
    False,
)
# pinned: a backlog of one full batch per batch in flight does not fill when the policy asks for two
@example(
    LaneState(1, 0.0),
    LaneState(6, 0.0),
    BatchPolicy(LanePolicy(0.002, 4, 8), LanePolicy(0.025, 2, 64), UrgentFill.BACKLOG, urgent_fill_backlog=2),
    1.0,
    False,
    2,
    True,
    0,
    False,
)
# pinned: the same backlog fills while the normal lane refuses requests, whatever the policy asks
@example(
    LaneState(1, 0.0),
    LaneState(4, 0.0),
    BatchPolicy(LanePolicy(0.002, 4, 8), LanePolicy(0.025, 2, 64), UrgentFill.BACKLOG, urgent_fill_backlog=3),
    1.0,
    False,
    2,
    True,
    0,
    True,
)
def test_a_plan_respects_priority_bounds_and_seats(
    urgent: LaneState,
    normal: LaneState,
    policy: BatchPolicy,
    now: float,
    flush: bool,
    backlog_batches: int,
    riders: bool,
    upstream: int,
    refusing: bool,
) -> None:
    plan = plan_batch(urgent, normal, policy, now, flush, backlog_batches, riders, upstream, refusing=refusing)
    urgent_ready = is_ready(urgent, policy.urgent, now, flush)
    normal_ready = is_ready(normal, policy.normal, now, flush)
    if not urgent_ready and not normal_ready:
        assert plan is None
        return
    assert plan is not None and plan.size >= 1
    assert plan.from_urgent <= urgent.waiting and plan.from_normal <= normal.waiting
    if urgent_ready:
        assert plan.lane is Lane.URGENT, "a ready urgent batch always goes first"
        assert plan.from_urgent == min(urgent.waiting, policy.urgent.max_batch)
        assert plan.size <= policy.urgent.max_batch
        batches = 1 if refusing else policy.urgent_fill_backlog  # refusing: one batch each is behind enough
        backlogged = normal.waiting + upstream >= policy.normal.max_batch * backlog_batches * batches
        fill = policy.urgent_fill is UrgentFill.ALWAYS or (policy.urgent_fill is UrgentFill.BACKLOG and backlogged)
        if fill and (riders or policy.urgent_fill is UrgentFill.BACKLOG):
            assert plan.from_normal == min(policy.urgent.max_batch - plan.from_urgent, normal.waiting)
        else:
            assert plan.from_normal == 0
    else:
        assert plan.lane is Lane.NORMAL and plan.from_urgent == 0
        assert plan.from_normal == min(normal.waiting, policy.normal.max_batch)


@given(lane_states(), lane_states(), policies)
def test_nothing_is_ready_before_the_wakeup_and_something_is_at_it(
    urgent: LaneState, normal: LaneState, policy: BatchPolicy
) -> None:
    wake = next_wakeup(urgent, normal, policy)
    if wake is None:
        assert urgent.waiting == 0 and normal.waiting == 0
        return
    assert plan_batch(urgent, normal, policy, wake) is not None
    full = urgent.waiting >= policy.urgent.max_batch or normal.waiting >= policy.normal.max_batch
    if not full:
        assert plan_batch(urgent, normal, policy, wake - 1e-6) is None


arrivals = st.lists(
    st.tuples(st.sampled_from(list(Lane)), st.floats(min_value=0.0, max_value=0.03)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(arrivals, policies)
def test_every_request_is_computed_exactly_once_in_lane_order(
    plan: list[tuple[Lane, float]], policy: BatchPolicy
) -> None:
    asyncio.run(_simulate(plan, policy))


async def _simulate(plan: list[tuple[Lane, float]], policy: BatchPolicy) -> None:
    clock = FakeClock()
    batches: list[list[tuple[Lane, int]]] = []

    async def runner(payloads: Sequence[tuple[Lane, int]]) -> list[int]:
        batches.append(list(payloads))
        return [index for _, index in payloads]

    batcher: DualWindowBatcher[tuple[Lane, int], int] = DualWindowBatcher(runner, policy, clock=clock)
    batcher.start()
    tasks = []
    for index, (lane, gap) in enumerate(plan):
        await clock.advance(gap)
        if batcher.depth(lane) >= policy.lane(lane).max_queue:
            continue  # a refused request is not part of this property
        tasks.append((index, asyncio.ensure_future(batcher.submit((lane, index), lane, 60.0))))
        await settle(3)
    await clock.advance(1.0)
    results = {index: (await task) for index, task in tasks}
    await batcher.close()

    computed = [payload for batch in batches for payload in batch]
    assert sorted(i for _, i in computed) == sorted(results), "each accepted request computed exactly once"
    assert all(results[i].output == i for i in results), "each answer is its own request's"
    for lane in Lane:
        order = [i for lane_of, i in computed if lane_of is lane]
        assert order == sorted(order), f"{lane} requests leave in arrival order"
    for batch in batches:
        first_lane = batch[0][0]
        assert len(batch) <= policy.lane(first_lane).max_batch
        if first_lane is Lane.NORMAL:
            assert all(lane is Lane.NORMAL for lane, _ in batch), "a normal batch never carries urgent requests"
        assert all(results[i].batch_size == len(batch) for _, i in batch)
