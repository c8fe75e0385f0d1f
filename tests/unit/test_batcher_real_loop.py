"""The batcher on the real event loop and clock, where the races are the loop's own: timers that
run late, cancels that land as a batch forms, batches that end while others start, a close in
the middle of it all. Random runs of a few dozen requests each; what must hold is the contract:
one answer per request, none computed twice, and nothing left open by the close.

(A deadline or a cancel that lands between a batch's forming and its runner's first step is the
runner's to see: the device thread checks both just before compute, ``test_runner``. With the
hand-moved clock, ``test_batcher_invariants`` checks what the batch takes when it forms.)"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from app.batching import BatchPolicy, Completed, DualWindowBatcher, Lane, LanePolicy, UrgentFill
from app.errors import BatchFailed, DeadlineExceeded, Draining, QueueFull, WouldMissDeadline

MS = 0.001
EXPECTED = (DeadlineExceeded, Draining, QueueFull, WouldMissDeadline, BatchFailed)


async def _play(seed: int, requests: int, grace_s: float | None, in_flight: tuple[int, int]) -> None:
    rng = random.Random(seed)
    tasks: dict[int, asyncio.Task[Completed[int]]] = {}
    computed: list[int] = []
    broken: list[str] = []

    async def runner(payloads: Sequence[int]) -> list[int]:
        if any(payload in computed for payload in payloads):
            broken.append(f"{payloads} has a request computed before")
        computed.extend(payloads)
        if rng.random() < 0.5:
            await asyncio.sleep(rng.choice([0, 0.5 * MS, 2 * MS]))
        if rng.random() < 0.1:
            time.sleep(rng.choice([1 * MS, 3 * MS]))  # noqa: ASYNC251 - the loop held: timers due run late
        if rng.random() < 0.05:
            raise RuntimeError("a bug in the runner")
        return [p * 2 for p in payloads]

    lanes = BatchPolicy(
        LanePolicy(rng.choice([1, 2]) * MS, rng.randint(1, 4), 16),
        LanePolicy(rng.choice([2, 5]) * MS, rng.randint(1, 6), 24),
        rng.choice(list(UrgentFill)),
    )
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(
        runner, lanes, max_in_flight=in_flight[0], urgent_in_flight=in_flight[1]
    )
    batcher.start()
    for i in range(requests):
        lane = rng.choice(list(Lane))
        timeout = rng.choice([1 * MS, 3 * MS, 10 * MS, 1.0])
        tasks[i] = asyncio.ensure_future(batcher.submit(i, lane, timeout))
        roll = rng.random()
        if roll < 0.3:
            await asyncio.sleep(0)
        elif roll < 0.5:
            await asyncio.sleep(rng.choice([0.2, 1, 3]) * MS)
        elif roll < 0.55:
            time.sleep(2 * MS)  # noqa: ASYNC251 - a step that holds the loop
        if rng.random() < 0.15:
            rng.choice(list(tasks.values())).cancel()
    await asyncio.sleep(rng.choice([0, 2 * MS]))
    async with asyncio.timeout(10):
        await batcher.close(grace_s)
    for _ in range(3):  # each caller's task ends a step after its future
        await asyncio.sleep(0)
    open_ = [payload for payload, task in tasks.items() if not task.done()]
    assert not open_, f"left open by the close: {open_}"
    answers = [
        task.exception() or task.result() if not task.cancelled() else asyncio.CancelledError()
        for task in tasks.values()
    ]
    assert not broken, broken
    assert len(computed) == len(set(computed)), "a request computed twice"
    for payload, answer in zip(tasks, answers, strict=True):
        if isinstance(answer, Completed):
            assert answer.output == payload * 2 and payload in computed
        else:
            assert isinstance(answer, (*EXPECTED, asyncio.CancelledError)), repr(answer)
    assert not batcher.running


@settings(max_examples=30, deadline=None)
@given(
    st.integers(min_value=0, max_value=2**32),
    st.integers(min_value=1, max_value=40),
    st.sampled_from([None, 0.0, 2 * MS]),
    st.sampled_from([(1, 0), (2, 0), (1, 1)]),
)
def test_on_the_real_loop_every_request_is_answered_once_and_none_computed_twice(
    seed: int, requests: int, grace_s: float | None, in_flight: tuple[int, int]
) -> None:
    # not "none computed late": on the real loop a deadline may pass between a batch's forming and
    # its runner's first step; what the batch takes is checked on the fake clock (test_batcher_deadlines)
    asyncio.run(_play(seed, requests, grace_s, in_flight))
