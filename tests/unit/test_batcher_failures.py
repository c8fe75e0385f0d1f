"""A batch that fails answers each of its requests at once, whatever failed: the runner with an
exception that is no ``Exception`` (an abort), or the metrics while the failure is counted.
Found by the state machine in ``test_batcher_invariants``: both left every request of the batch
waiting for its deadline, and then answered it ``deadline_exceeded``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from app.batching import BatchPolicy, DualWindowBatcher, Lane, LanePolicy
from app.batching.observer import NullObserver
from app.errors import BatchFailed, ServiceError
from tests.unit.fakes import FakeClock, FakeRunner, settle

MS = 0.001
POLICY = BatchPolicy(LanePolicy(2 * MS, 2, 8), LanePolicy(25 * MS, 2, 8))


class Abort(BaseException):
    """Raised through the runner, and not an ``Exception``."""


class BrokenMetrics(NullObserver):
    def on_batch(self, *args: object) -> None:
        raise RuntimeError("a metrics bug")


async def _submit_two(batcher: DualWindowBatcher[int, int]) -> list[asyncio.Task[object]]:
    tasks: list[asyncio.Task[object]] = [asyncio.ensure_future(batcher.submit(i, Lane.NORMAL, 60.0)) for i in (1, 2)]
    await settle()  # a full batch: it runs, and fails, at once
    return tasks


async def test_an_abort_through_the_runner_answers_its_batch_at_once_and_the_batcher_serves_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    aborts = [Abort()]

    def fail_on(payloads: Sequence[int]) -> BaseException | None:
        return aborts.pop() if aborts else None

    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(FakeRunner(fail_on), POLICY, clock=FakeClock())
    batcher.start()
    try:
        failed = await _submit_two(batcher)
        assert all(task.done() for task in failed), "answered when the batch ended, not at their deadline"
        for task in failed:
            assert isinstance(task.exception(), BatchFailed)
        assert "batch of 2 failed" in caplog.text
        served = await _submit_two(batcher)
        assert [task.result().output for task in served] == [2, 4]  # type: ignore[attr-defined]
    finally:
        await batcher.close(grace_s=0)


async def test_a_failed_batch_is_answered_though_counting_it_fails(caplog: pytest.LogCaptureFixture) -> None:
    error = ServiceError("device gone", code="device_unavailable")
    runner = FakeRunner(lambda payloads: error)
    batcher: DualWindowBatcher[int, int] = DualWindowBatcher(
        runner, POLICY, clock=FakeClock(), observer=BrokenMetrics()
    )
    batcher.start()
    try:
        failed = await _submit_two(batcher)
        assert all(task.done() and task.exception() is error for task in failed)
        assert "counting a batch of 2 that failed failed" in caplog.text
    finally:
        await batcher.close(grace_s=0)
