"""A call on worker threads awaited for a bounded time: one that had not started never starts;
one that had is late until it ends, when its result is dropped and the caller is told."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Iterator

import pytest

from app.inference.bounded import BoundedCall
from app.inference.workers import WorkerThreads


class Weights:
    """What a load returns: something that must not outlive a late call."""


@pytest.fixture
def threads() -> Iterator[WorkerThreads]:
    pool = WorkerThreads("bounded-test", 1)
    yield pool
    pool.close(5.0)


async def idle(threads: WorkerThreads) -> None:
    """Every call queued before this one has run."""
    await asyncio.wait_for(threads.run(lambda: None), 10)


async def test_a_call_in_time_gives_its_result_and_nothing_else(threads: WorkerThreads) -> None:
    ended: list[str] = []
    bounded = BoundedCall(lambda: 42, release=lambda: ended.append("release"), on_late_end=lambda: ended.append("end"))
    assert await bounded.run(threads, 10.0) == 42
    assert not bounded.late and ended == []


async def test_a_call_still_waiting_for_a_thread_when_its_caller_gives_up_never_runs(threads: WorkerThreads) -> None:
    gate = threading.Event()
    threads.submit(gate.wait)  # the only thread is busy
    ran: list[bool] = []
    bounded = BoundedCall(lambda: ran.append(True), on_late_end=lambda: ran.append(False))
    with pytest.raises(TimeoutError):
        await bounded.run(threads, 0.05)
    assert not bounded.late, "it never started: nothing runs on"
    gate.set()
    await idle(threads)
    assert ran == []


async def test_a_running_call_past_its_timeout_is_late_until_it_ends_and_its_result_is_dropped(
    threads: WorkerThreads,
) -> None:
    started, gate = threading.Event(), threading.Event()
    made: list[weakref.ref[Weights]] = []
    at_release: list[bool] = []
    ended = asyncio.Event()

    def load() -> Weights:
        started.set()
        gate.wait(10)
        weights = Weights()
        made.append(weakref.ref(weights))
        return weights

    bounded = BoundedCall(
        load,
        release=lambda: at_release.append(made[0]() is None),  # the result is gone before the release
        on_late_end=ended.set,
    )
    call = asyncio.ensure_future(bounded.run(threads, 0.2))
    await asyncio.to_thread(started.wait, 10)
    with pytest.raises(TimeoutError):
        await call  # answered at its timeout, while the call still runs
    assert bounded.late and not ended.is_set()
    gate.set()
    await asyncio.wait_for(ended.wait(), 10)
    assert not bounded.late
    assert at_release == [True]
    assert made[0]() is None


async def test_a_late_call_that_fails_still_ends(threads: WorkerThreads) -> None:
    started, gate = threading.Event(), threading.Event()
    released, ended = threading.Event(), asyncio.Event()

    def load() -> None:
        started.set()
        gate.wait(10)
        raise OSError("the volume went away")

    bounded = BoundedCall(load, release=released.set, on_late_end=ended.set)
    call = asyncio.ensure_future(bounded.run(threads, 0.2))
    await asyncio.to_thread(started.wait, 10)
    with pytest.raises(TimeoutError):
        await call
    gate.set()
    await asyncio.wait_for(ended.wait(), 10)
    assert released.is_set() and not bounded.late


async def test_a_running_call_whose_caller_is_cancelled_is_late_too(threads: WorkerThreads) -> None:
    """An admin request cancelled mid-load (a shutdown, say) leaves its load running all the same."""
    started, gate = threading.Event(), threading.Event()
    ended = asyncio.Event()

    def load() -> Weights:
        started.set()
        gate.wait(10)
        return Weights()

    bounded = BoundedCall(load, on_late_end=ended.set)
    call = asyncio.ensure_future(bounded.run(threads, 30.0))
    await asyncio.to_thread(started.wait, 10)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert bounded.late
    gate.set()
    await asyncio.wait_for(ended.wait(), 10)
    assert not bounded.late


async def test_a_late_call_whose_release_fails_still_ends(
    threads: WorkerThreads, caplog: pytest.LogCaptureFixture
) -> None:
    """Else the service would hold off every later load for good."""
    started, gate = threading.Event(), threading.Event()
    ended = asyncio.Event()

    def load() -> Weights:
        started.set()
        gate.wait(10)
        return Weights()

    def release() -> None:
        raise RuntimeError("the device is gone")

    bounded = BoundedCall(load, release=release, on_late_end=ended.set)
    call = asyncio.ensure_future(bounded.run(threads, 0.2))
    await asyncio.to_thread(started.wait, 10)
    with pytest.raises(TimeoutError):
        await call
    gate.set()
    await asyncio.wait_for(ended.wait(), 10)
    assert "releasing what a late call held failed" in caplog.text
