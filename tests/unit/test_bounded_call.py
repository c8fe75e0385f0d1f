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


class Stuck:
    """A load that runs until ``gate`` opens (``started`` once it runs), then gives ``Weights``,
    or raises ``error`` if one is given; ``made`` holds a weak reference to what it gave."""

    def __init__(self, error: Exception | None = None) -> None:
        self.started, self.gate = threading.Event(), threading.Event()
        self.error = error
        self.made: list[weakref.ref[Weights]] = []

    def __call__(self) -> Weights:
        self.started.set()
        self.gate.wait(10)
        if self.error is not None:
            raise self.error
        weights = Weights()
        self.made.append(weakref.ref(weights))
        return weights

    async def running(self) -> None:
        assert await asyncio.to_thread(self.started.wait, 10)


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
    load, at_release, ended = Stuck(), [], asyncio.Event()
    bounded = BoundedCall(
        load,
        release=lambda: at_release.append(load.made[0]() is None),  # the result is gone before the release
        on_late_end=ended.set,
    )
    call = asyncio.ensure_future(bounded.run(threads, 0.2))
    await load.running()
    with pytest.raises(TimeoutError):
        await call  # answered at its timeout, while the call still runs
    assert bounded.late and not ended.is_set()
    load.gate.set()
    await asyncio.wait_for(ended.wait(), 10)
    assert not bounded.late
    assert at_release == [True]
    assert load.made[0]() is None


@pytest.mark.parametrize(
    ("error", "release_fails"),
    [(OSError("the volume went away"), False), (None, True)],
    ids=["the call fails", "the release fails"],
)
async def test_a_late_call_ends_though_it_or_its_release_fails(
    threads: WorkerThreads, caplog: pytest.LogCaptureFixture, error: Exception | None, release_fails: bool
) -> None:
    """Else the service would hold off every later load for good."""
    released = threading.Event()

    def release() -> None:
        released.set()
        if release_fails:
            raise RuntimeError("the device is gone")

    load, ended = Stuck(error), asyncio.Event()
    bounded = BoundedCall(load, release=release, on_late_end=ended.set)
    call = asyncio.ensure_future(bounded.run(threads, 0.2))
    await load.running()
    with pytest.raises(TimeoutError):
        await call
    load.gate.set()
    await asyncio.wait_for(ended.wait(), 10)
    assert released.is_set() and not bounded.late
    assert ("releasing what a late call held failed" in caplog.text) == release_fails


async def test_a_running_call_whose_caller_is_cancelled_is_late_too(threads: WorkerThreads) -> None:
    """An admin request cancelled mid-load (a shutdown, say) leaves its load running all the same."""
    load, ended = Stuck(), asyncio.Event()
    bounded = BoundedCall(load, on_late_end=ended.set)
    call = asyncio.ensure_future(bounded.run(threads, 30.0))
    await load.running()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert bounded.late
    load.gate.set()
    await asyncio.wait_for(ended.wait(), 10)
    assert not bounded.late
