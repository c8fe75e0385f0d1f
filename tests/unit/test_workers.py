"""Worker threads: urgent calls first, FIFO within a priority, cancelled calls skipped, bounded close."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from app.inference.workers import WorkerThreads
from tests.support import cyclic_garbage


def test_urgent_calls_overtake_normal_ones_that_wait() -> None:
    workers = WorkerThreads("test", 1)
    gate, order = threading.Event(), []
    try:
        blocker = workers.submit(gate.wait)  # the only worker is busy: the rest queue
        calls = [workers.submit(lambda n=n: order.append(n)) for n in ("n1", "n2")]
        calls += [workers.submit(lambda n=n: order.append(n), urgent=True) for n in ("u1", "u2")]
        calls.append(workers.submit(lambda: order.append("n3")))
        gate.set()
        for call in [blocker, *calls]:
            call.result(10)
        assert order == ["u1", "u2", "n1", "n2", "n3"]
    finally:
        workers.close()


def test_a_call_cancelled_while_waiting_never_runs() -> None:
    workers = WorkerThreads("test", 1)
    gate, ran = threading.Event(), []
    try:
        blocker = workers.submit(gate.wait)
        doomed = workers.submit(lambda: ran.append("doomed"))
        assert doomed.cancel()
        after = workers.submit(lambda: ran.append("after"))
        gate.set()
        blocker.result(10), after.result(10)
        assert ran == ["after"]
    finally:
        workers.close()


def test_errors_reach_the_caller_and_the_worker_keeps_serving() -> None:
    workers = WorkerThreads("test", 2)
    try:
        with pytest.raises(ZeroDivisionError):
            workers.submit(lambda: 1 / 0).result(10)
        assert workers.submit(lambda: 42).result(10) == 42
    finally:
        workers.close()


async def test_run_awaits_without_blocking_the_loop() -> None:
    workers = WorkerThreads("test", 1)
    try:
        assert await workers.run(lambda: threading.current_thread().name, urgent=True) == "test"
    finally:
        workers.close()


def test_close_finishes_what_is_queued_or_cancels_it() -> None:
    finishing = WorkerThreads("finish", 1)
    gate = threading.Event()
    blocker, queued = finishing.submit(gate.wait), finishing.submit(lambda: "done")
    gate.set()
    finishing.close()
    assert blocker.result(1) and queued.result(1) == "done"

    cancelling = WorkerThreads("cancel", 1)
    gate2, started = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return gate2.wait()

    running = cancelling.submit(hold)
    assert started.wait(10), "the worker took the first call"
    waiting = cancelling.submit(lambda: "never")
    threading.Timer(0.05, gate2.set).start()
    cancelling.close(cancel_waiting=True)
    assert running.result(1) is True and waiting.cancelled()
    with pytest.raises(RuntimeError, match="closed"):
        cancelling.submit(lambda: None)


def test_at_least_one_worker() -> None:
    with pytest.raises(ValueError, match="at least one"):
        WorkerThreads("none", 0)


def test_an_urgent_only_thread_takes_urgent_calls_while_the_others_are_busy() -> None:
    workers = WorkerThreads("test", 1, urgent_workers=1, normal_nice=5)
    gate = threading.Event()
    try:
        busy = workers.submit(gate.wait)  # the one general thread is held
        waiting_normal = workers.submit(lambda: "normal")
        urgent = workers.submit(lambda: threading.current_thread().name, urgent=True)
        assert urgent.result(10) == "test-urgent-0"
        assert not waiting_normal.done(), "the urgent-only thread never takes a normal call"
        gate.set()
        assert busy.result(10) and waiting_normal.result(10) == "normal"
        assert workers.workers == 1 and workers.urgent_workers == 1
    finally:
        gate.set()
        workers.close()


@pytest.mark.skipif(
    os.getpriority(os.PRIO_PROCESS, 0) > 14, reason="the test process is already niced past 14: +5 would be capped"
)
def test_with_a_lowered_priority_the_general_threads_take_normal_calls_only_and_run_niced() -> None:
    workers = WorkerThreads("test", 1, urgent_workers=1, normal_nice=5)
    gate = threading.Event()
    try:
        held = workers.submit(gate.wait, urgent=True)  # the urgent-only thread is held
        normal = workers.submit(
            lambda: (threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        )
        assert normal.result(10) == ("test", os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + 5)
        urgent = workers.submit(lambda: threading.current_thread().name, urgent=True)
        time.sleep(0.05)
        assert not urgent.done(), "a niced thread never runs an urgent call: it would run it at the low priority"
        gate.set()
        assert held.result(10) and urgent.result(10) == "test-urgent-0"
    finally:
        gate.set()
        workers.close()


@pytest.mark.skipif(
    os.getpriority(os.PRIO_PROCESS, 0) > 12, reason="the test process is already niced past 12: +2 +5 would be capped"
)
def test_the_lowered_priority_is_below_the_starting_threads_own() -> None:
    """A service started niced (``nice -n 2 ai-backend serve``) keeps its normal batches below its
    other threads: 5 below its own priority, not at 5, which would be only 3 below it."""
    seen: dict[str, int] = {}

    def start_niced() -> None:
        native = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, native, os.getpriority(os.PRIO_PROCESS, native) + 2)
        seen["starter"] = os.getpriority(os.PRIO_PROCESS, native)
        workers = WorkerThreads("test", 1, urgent_workers=1, normal_nice=5)  # its threads inherit the +2
        try:
            normal = workers.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            seen["normal"] = normal.result(10)
        finally:
            workers.close()

    starter = threading.Thread(target=start_niced)
    starter.start()
    starter.join(10)
    assert seen["normal"] == seen["starter"] + 5, seen


def test_without_urgent_only_threads_no_thread_is_niced_and_every_one_takes_urgent_calls() -> None:
    workers = WorkerThreads("test", 1, normal_nice=5)
    try:
        call = workers.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), urgent=True)
        assert call.result(10) == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    finally:
        workers.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux: thread names in /proc")
def test_the_os_sees_each_threads_name() -> None:
    """``top -H`` and per-thread CPU in /proc tell the decode and device threads apart."""

    def os_names() -> set[str]:
        names = set()
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                names.add(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        return names

    workers = WorkerThreads("device", 2, urgent_workers=1)
    try:
        expected = {"device-0", "device-1", "device-urgent-0"}
        deadline = time.monotonic() + 10
        while not expected <= os_names() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert expected <= os_names()
    finally:
        workers.close()


async def test_a_call_runs_in_its_callers_context() -> None:
    # what a device or decode thread logs carries the request's id (and the batch's trace)
    from app.telemetry.logging import request_id_var

    workers = WorkerThreads("test", 1)
    token = request_id_var.set("req-123")
    try:
        assert await workers.run(request_id_var.get) == "req-123"
    finally:
        request_id_var.reset(token)
        workers.close()


async def test_run_delivers_results_and_errors_to_the_loop_without_a_second_future() -> None:
    workers = WorkerThreads("test", 1)
    try:
        assert await workers.run(lambda: 42) == 42
        with pytest.raises(ZeroDivisionError):
            await workers.run(lambda: 1 / 0)

        def stop() -> None:
            raise StopIteration  # an asyncio future refuses it: the caller still gets an answer

        with pytest.raises(RuntimeError, match="StopIteration"):
            await asyncio.wait_for(workers.run(stop), 10)
        assert await workers.run(lambda: "still serving") == "still serving"
    finally:
        workers.close()


async def test_a_failed_call_leaves_nothing_for_the_cycle_collector() -> None:
    """A decode that fails (a client's broken image) must be freed with its answer: an exception
    whose traceback held the frames that held its future was a cycle each, left to the collector."""

    def broken() -> None:
        raise ValueError("not an image")

    workers = WorkerThreads("test", 1)
    try:
        await workers.run(lambda: None)
        with cyclic_garbage() as left:
            for _ in range(5):
                with pytest.raises(ValueError):
                    await workers.run(broken)
                with pytest.raises(ValueError):
                    workers.submit(broken).result(10)
        assert not left, left
    finally:
        workers.close()


async def test_a_run_cancelled_while_it_waits_for_a_worker_never_runs() -> None:
    workers = WorkerThreads("test", 1)
    gate, ran = threading.Event(), []
    try:
        blocker = workers.submit(gate.wait)
        doomed = asyncio.ensure_future(workers.run(lambda: ran.append("doomed")))
        await asyncio.sleep(0.01)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        gate.set()
        assert await workers.run(lambda: ran.append("after")) is None
        assert blocker.result(10) and ran == ["after"]
    finally:
        workers.close()


async def test_close_cancels_the_runs_still_waiting() -> None:
    workers = WorkerThreads("test", 1)
    gate, started = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return gate.wait()

    running = asyncio.ensure_future(workers.run(hold))
    waiting = asyncio.ensure_future(workers.run(lambda: "never"))
    assert await asyncio.to_thread(started.wait, 10)
    closing = asyncio.ensure_future(asyncio.to_thread(workers.close, 10.0, True))
    try:
        with pytest.raises(asyncio.CancelledError):  # called off while the thread is still held
            await asyncio.wait_for(waiting, 10)
    finally:
        gate.set()  # only now: set earlier, the free thread would run what waits
    await closing
    assert await asyncio.wait_for(running, 10) is True


def busy(workers: WorkerThreads, gate: threading.Event) -> Future[bool]:
    """A call that holds a thread until ``gate`` is set, once a thread runs it."""
    started = threading.Event()

    def hold() -> bool:
        started.set()
        return gate.wait()

    call = workers.submit(hold)
    assert started.wait(10)
    return call


async def test_run_on_each_runs_once_on_every_thread_the_urgent_only_and_niced_ones_included() -> None:
    workers = WorkerThreads("test", 2, urgent_workers=1, normal_nice=5)
    try:
        names = await workers.run_on_each(lambda: threading.current_thread().name)
        assert names == ["test-0", "test-1", "test-urgent-0"]
    finally:
        workers.close()


async def test_run_on_each_goes_ahead_of_calls_already_queued() -> None:
    workers = WorkerThreads("test", 1)
    gate, order = threading.Event(), []
    try:
        blocker = busy(workers, gate)
        queued = [workers.submit(lambda: order.append("urgent"), urgent=True)]
        queued.append(workers.submit(lambda: order.append("n")))
        each = asyncio.ensure_future(workers.run_on_each(lambda: order.append("each")))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(each, 10)
        for call in [blocker, *queued]:
            call.result(10)
        assert order == ["each", "urgent", "n"]
    finally:
        workers.close()


async def test_run_on_each_raises_a_threads_error_and_calls_off_those_not_begun() -> None:
    workers = WorkerThreads("test", 2)
    gate, ran = threading.Event(), []
    try:
        blocker = busy(workers, gate)  # one thread busy: its own call waits

        def fail_or_record() -> None:
            if not blocker.done():  # the free thread
                ran.append("first")
                raise ZeroDivisionError
            ran.append("late")

        with pytest.raises(ZeroDivisionError):
            await asyncio.wait_for(workers.run_on_each(fail_or_record), 10)
        gate.set()
        blocker.result(10)
        workers.submit(lambda: None).result(10)  # both threads past their own queues
        assert workers.submit(lambda: None).result(10) is None
        assert ran == ["first"]
    finally:
        workers.close()


async def test_close_cancels_the_calls_each_thread_waits_to_run() -> None:
    workers = WorkerThreads("test", 1)
    gate, ran = threading.Event(), []
    blocker = busy(workers, gate)
    each = asyncio.ensure_future(workers.run_on_each(lambda: ran.append("each")))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(asyncio.to_thread(workers.close, 10.0, True))
    try:
        with pytest.raises(asyncio.CancelledError):  # called off while the thread is still held
            await asyncio.wait_for(each, 10)
    finally:
        gate.set()  # only now: set earlier, the free thread would run its own call
    await closing
    blocker.result(10)
    assert ran == []


def test_nice_lowers_every_threads_priority_urgent_calls_included() -> None:
    workers = WorkerThreads("test", 1, nice=3)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    try:

        def priority() -> int:
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        assert workers.submit(priority).result(10) == min(19, own + 3)
        assert workers.submit(priority, urgent=True).result(10) == min(19, own + 3)
    finally:
        workers.close()


class _CountedWakes(threading.Condition):
    """A condition that counts, by thread name, how often a wait returned (the thread woke)."""

    woken: dict[str, int] = {}

    def wait(self, timeout: float | None = None) -> bool:
        result = super().wait(timeout)
        name = threading.current_thread().name
        self.woken[name] = self.woken.get(name, 0) + 1
        return result


@pytest.mark.parametrize("normal_nice", [0, 5])
def test_a_call_wakes_one_thread_that_takes_it_and_no_other(monkeypatch: pytest.MonkeyPatch, normal_nice: int) -> None:
    """A normal call never wakes the urgent-only thread (it woke for every normal batch, taking the
    GIL to go back to sleep), and an urgent call wakes the urgent-only thread, not a general one."""
    monkeypatch.setattr(_CountedWakes, "woken", {})
    monkeypatch.setattr(threading, "Condition", _CountedWakes)
    workers = WorkerThreads("test", 2, urgent_workers=1, normal_nice=normal_nice)
    try:
        time.sleep(0.05)  # every thread waiting
        for _ in range(20):
            assert workers.submit(lambda: threading.current_thread().name).result(10).startswith("test-")
        assert _CountedWakes.woken.get("test-urgent-0", 0) == 0
        woken_general = sum(_CountedWakes.woken.get(f"test-{i}", 0) for i in range(2))
        assert woken_general <= 20, "one general thread woken a call at most"
        before = dict(_CountedWakes.woken)
        for _ in range(10):
            assert workers.submit(lambda: threading.current_thread().name, urgent=True).result(10) == "test-urgent-0"
        assert all(_CountedWakes.woken.get(f"test-{i}", 0) == before.get(f"test-{i}", 0) for i in range(2))
    finally:
        workers.close()


def test_calls_from_many_threads_at_once_all_run() -> None:
    """Wake-ups aimed at one idle thread lose no call: producers race the threads finishing."""
    workers = WorkerThreads("test", 3, urgent_workers=1, normal_nice=2)
    results: list[Future[int]] = []
    lock = threading.Lock()

    def produce(offset: int) -> None:
        for i in range(500):
            future = workers.submit(lambda i=i: offset + i, urgent=i % 7 == 0)
            with lock:
                results.append(future)

    producers = [threading.Thread(target=produce, args=(k * 1000,)) for k in range(4)]
    try:
        for producer in producers:
            producer.start()
        for producer in producers:
            producer.join(30)
        assert sorted(future.result(30) for future in results) == sorted(
            k * 1000 + i for k in range(4) for i in range(500)
        )
    finally:
        workers.close()


def test_a_normal_call_does_not_wait_while_a_thread_that_takes_it_idles() -> None:
    """General threads that take urgent calls first (no lowered priority): woken for a normal call, a
    general thread may take an urgent call submitted just after it, whose urgent-only thread then
    finds nothing. The normal call waited a whole urgent call though another general thread idled."""
    for _ in range(20):
        workers = WorkerThreads("test", 2, urgent_workers=1, normal_nice=0)
        release, normal_ran = threading.Event(), threading.Event()
        try:
            time.sleep(0.02)  # every thread waiting
            workers.submit(normal_ran.set)
            workers.submit(lambda: release.wait(10), urgent=True)
            assert normal_ran.wait(5), "the normal call waited for the urgent one, a general thread idle"
        finally:
            release.set()
            workers.close()


def _held_urgent(workers: WorkerThreads, holding: bool = True) -> tuple[threading.Event, Future[object]]:
    """An urgent call running on the urgent-only thread until the returned event is set, holding
    the cores (``holding_the_cores``) or not."""
    started, gate = threading.Event(), threading.Event()

    def urgent() -> object:
        with workers.holding_the_cores() if holding else contextlib.nullcontext():
            started.set()
            return gate.wait(10)

    call = workers.submit(urgent, urgent=True)
    assert started.wait(10)
    return gate, call


def test_a_normal_call_that_yields_waits_for_the_urgent_call_running() -> None:
    workers = WorkerThreads("test", 1, urgent_workers=1, normal_nice=5, urgent_pause_s=10.0, pausable=1)
    order: list[str] = []
    try:
        gate, urgent = _held_urgent(workers)
        normal = workers.submit(lambda: (workers.yield_to_urgent(), order.append("normal")))
        time.sleep(0.05)
        assert not normal.done(), "it waits while the urgent call runs"
        order.append("urgent ended")
        gate.set()
        normal.result(10)
        assert urgent.result(10) and order == ["urgent ended", "normal"]
    finally:
        workers.close()


def test_a_normal_call_waits_for_urgent_ones_at_most_its_budget_in_all() -> None:
    workers = WorkerThreads("test", 1, urgent_workers=1, normal_nice=5, urgent_pause_s=0.05, pausable=1)
    try:
        gate, _ = _held_urgent(workers)

        def normal() -> str:
            for _ in range(100):  # 100 points where it may wait: 0.05 s in all, not 5 s
                workers.yield_to_urgent()
            return "done"

        assert workers.submit(normal).result(3) == "done", "it went on with the urgent call still running"
        gate.set()
    finally:
        workers.close()


def test_a_normal_call_does_not_wait_for_an_urgent_call_that_does_not_hold_the_cores() -> None:
    # an urgent batch carrying normal requests along (riders, while the service is behind) is their work too
    workers = WorkerThreads("test", 1, urgent_workers=1, normal_nice=5, urgent_pause_s=10.0, pausable=1)
    try:
        gate, _ = _held_urgent(workers, holding=False)
        assert workers.submit(lambda: (workers.yield_to_urgent(), "went")[1]).result(3) == "went"
        gate.set()
    finally:
        workers.close()


def test_no_wait_beyond_the_pausable_threads_nor_outside_a_normal_call() -> None:
    workers = WorkerThreads("test", 1, urgent_workers=1, normal_nice=5, urgent_pause_s=10.0, pausable=0)
    others = WorkerThreads("other", 1, urgent_workers=2, normal_nice=5, urgent_pause_s=10.0, pausable=1)
    try:
        gate, _ = _held_urgent(workers)
        assert workers.submit(lambda: (workers.yield_to_urgent(), "went")[1]).result(3) == "went", "pausable 0"
        other_gate, _ = _held_urgent(others)
        with ThreadPoolExecutor(1) as outside:  # a thread of no pool: not a call of these threads
            assert outside.submit(lambda: (others.yield_to_urgent(), "went")[1]).result(3) == "went"
        # the second urgent-only thread runs an urgent call beside the held one: it never waits for it
        urgent = others.submit(lambda: (others.yield_to_urgent(), "urgent")[1], urgent=True)
        assert urgent.result(3) == "urgent", "an urgent call never waits for another"
        other_gate.set()
        gate.set()
    finally:
        workers.close()
        others.close()
