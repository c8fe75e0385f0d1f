"""Worker threads that take urgent calls first: the decode pool and the device's threads.

A plain thread pool is first in, first out, so under load an urgent request's image would
wait behind every normal one queued before it, and the urgent lane would lose at the decode
pool what it wins at the batcher. Here urgent calls go first; within a priority, calls run
in the order they came. A call cancelled while it waits (its client went away) never runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import functools
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from app.interpreter import short_time_slice

T = TypeVar("T")

URGENT, NORMAL = 0, 1
# what a thread takes, in the order it looks
ANY, URGENT_ONLY, NORMAL_ONLY = (URGENT, NORMAL), (URGENT,), (NORMAL,)


class Outcome(Protocol):
    """Where a call's result goes, as ``concurrent.futures.Future`` takes it."""

    def set_running_or_notify_cancel(self) -> bool: ...
    def set_result(self, result: Any) -> None: ...
    def set_exception(self, exception: BaseException) -> None: ...
    def cancel(self) -> bool: ...


Call = tuple[Callable[[], Any], Outcome]


class LoopOutcome:
    """A call's result delivered straight to an asyncio future on its event loop: what
    ``asyncio.wrap_future`` of a ``concurrent.futures.Future`` does, without the second future,
    its lock and the callbacks that chain the two (on the event loop, 9-14 against 3-5 µs a call).

    The worker reads whether the awaiting side cancelled (a plain read: one cancelled just
    after still runs, as a started ``Future`` does) and hands the result to the loop, which
    drops it if the future is done by then."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()

    def set_running_or_notify_cancel(self) -> bool:
        return not self.future.cancelled()

    def set_result(self, result: Any) -> None:
        self._settle(result, None)

    def set_exception(self, exception: BaseException) -> None:
        self._settle(None, exception)

    def cancel(self) -> bool:
        self._settle(_CANCELLED, None)
        return True

    def _settle(self, result: Any, exception: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits it any more
            self.loop.call_soon_threadsafe(_settle, self.future, result, exception)


_CANCELLED = object()  # what ``close`` settles a call it calls off with


def _settle(future: asyncio.Future[Any], result: Any, exception: BaseException | None) -> None:
    """On the loop: the call's result, its exception, or its cancellation by ``close``."""
    if future.done():
        return
    if isinstance(exception, StopIteration):  # an asyncio future refuses it (a coroutine's own signal)
        future.set_exception(RuntimeError(f"the call raised {exception!r}"))
    elif exception is not None:
        future.set_exception(exception)
    elif result is _CANCELLED:
        future.cancel()
    else:
        future.set_result(result)


class WorkerThreads:
    """``workers`` daemon threads serving two queues, urgent calls first, plus ``urgent_workers``
    that take urgent calls only, so an urgent call never waits for a normal one to finish (daemons: a
    stuck call cannot keep the process alive at exit; ``close`` joins them, bounded).

    ``normal_nice`` (with urgent workers only) lowers the OS priority of the other threads, which
    then take normal calls only (Linux; a thread may lower its own priority without privileges,
    never raise it back, so a thread keeps one priority for its life). Where calls compete for
    cores, the event loop, the decode pool and urgent batches are scheduled first, and normal
    batches take what is left, which on a busy machine is still everything they would have had.
    The offset is from the process's own priority: a service started niced stays below the rest.
    ``nice`` lowers every thread's (a pool of background work, such as model loads).
    ``urgent_slice_ns`` gives the urgent-only threads that time slice (``short_time_slice``): woken
    for an urgent call, one pre-empts a normal call's thread on its core rather than wait out
    that thread's slice.

    ``urgent_pause_s``: a normal call that asks (``yield_to_urgent``, at points where it may wait:
    between a batch's images, before its forward pass) waits while an urgent call that asked for
    the cores (``holding_the_cores``) runs on another thread, for at most that long in all, while
    fewer than ``pausable`` threads wait so. Where
    threads outnumber the cores, an urgent batch otherwise shares its core with a normal one
    (niced: at nice 2 it keeps 0.61 of it); ``pausable`` (the threads beyond the cores) leaves
    every core busy while they wait.
    """

    def __init__(
        self,
        name: str,
        workers: int = 1,
        urgent_workers: int = 0,
        normal_nice: int = 0,
        nice: int = 0,
        urgent_slice_ns: int = 0,
        urgent_pause_s: float = 0.0,
        pausable: int = 0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"{name} needs at least one worker thread")
        self._queues: tuple[deque[Call], deque[Call]] = (deque(), deque())  # URGENT, NORMAL
        self._own: list[deque[Call]] = [deque() for _ in range(workers + urgent_workers)]  # for one thread each
        self._lock = threading.Lock()
        # one wake-up a thread, on the one lock: a call wakes one idle thread that takes it, not every
        # thread (each of which would take the GIL only to go back to sleep: an urgent-only thread woke
        # for every normal batch). ``_idle``: the threads waiting for a call, in the order they began
        self._wakes = [threading.Condition(self._lock) for _ in self._own]
        self._idle: dict[int, None] = {}
        self._closing = False
        self._normal_nice = normal_nice
        self._nice = nice  # every thread's, whatever it takes (a pool of background work: loads)
        self._urgent_slice_ns = urgent_slice_ns
        # urgent calls running, the normal calls waiting for them to end (``yield_to_urgent``), and
        # each thread's time left to wait within its current normal call (none outside one)
        self._calm = threading.Condition(threading.Lock())
        self._urgent_running = 0
        self._paused = 0
        # none may wait (the cores suffice): the counting off as well
        self._pause_s, self._pausable = (urgent_pause_s if pausable > 0 else 0.0), pausable
        self._budget = threading.local()
        # without urgent-only threads a niced thread would run urgent calls at the low priority
        kind = NORMAL_ONLY if normal_nice and urgent_workers else ANY
        names = [name if workers == 1 else f"{name}-{i}" for i in range(workers)]
        names += [f"{name}-urgent-{i}" for i in range(urgent_workers)]
        self._kinds = [kind if i < workers else URGENT_ONLY for i in range(len(names))]
        self._threads = [
            threading.Thread(target=self._work, args=(i,), name=names[i], daemon=True) for i in range(len(names))
        ]
        self.urgent_workers = urgent_workers
        for thread in self._threads:
            thread.start()

    @property
    def workers(self) -> int:
        """Threads that take any call (the urgent-only ones apart)."""
        return len(self._threads) - self.urgent_workers

    def submit(self, fn: Callable[[], T], urgent: bool = False) -> Future[T]:
        """Run ``fn`` on a worker; its ``concurrent.futures.Future`` (from any thread)."""
        future: Future[T] = Future()
        self._put(fn, future, urgent)
        return future

    def _put(self, fn: Callable[[], Any], outcome: Outcome, urgent: bool) -> None:
        priority = URGENT if urgent else NORMAL
        with self._lock:
            if self._closing:
                raise RuntimeError("the worker threads are closed")
            self._queues[priority].append((fn, outcome))
            self._wake_one(priority)

    def _wake_one(self, priority: int) -> None:
        """Wake one idle thread that takes calls of ``priority``, if any: the one idle last (its
        caches the warmest), an urgent-only one first for an urgent call, so the others stay free
        for normal ones. None idle, the call waits for the first thread that takes it to finish
        its own: a thread looks at the queues before it waits. Under the lock."""
        chosen = None
        for index in reversed(self._idle):
            kind = self._kinds[index]
            if priority in kind and (chosen is None or kind == URGENT_ONLY):
                chosen = index
                if priority != URGENT or kind == URGENT_ONLY:
                    break
        if chosen is not None:
            del self._idle[chosen]  # woken: not picked again for the next call before it runs
            self._wakes[chosen].notify()

    async def run(self, fn: Callable[[], T], urgent: bool = False) -> T:
        """Run ``fn`` on a worker, in the caller's context (what it logs carries the request's
        id, and the batch's trace), and await its result without blocking the event loop.
        Cancelled while it waits for a worker, it never runs."""
        outcome = LoopOutcome(asyncio.get_running_loop())
        self._put(functools.partial(contextvars.copy_context().run, fn), outcome, urgent)
        try:
            result: T = await outcome.future
        finally:
            del outcome  # raised, its exception's traceback holds this frame: see ``_run``
        return result

    async def run_on_each(self, fn: Callable[[], T]) -> list[T]:
        """Run ``fn`` once on every thread, urgent-only ones included, ahead of anything queued;
        the results in the threads' order. What a thread keeps for itself (its allocator's
        arena, grown to the largest batch it has run) is made by running there."""
        loop = asyncio.get_running_loop()
        outcomes = [LoopOutcome(loop) for _ in self._own]
        with self._lock:
            if self._closing:
                raise RuntimeError("the worker threads are closed")
            for own, outcome in zip(self._own, outcomes, strict=True):
                own.append((functools.partial(contextvars.copy_context().run, fn), outcome))
            self._wake_all()
        try:
            return list(await asyncio.gather(*(outcome.future for outcome in outcomes)))
        except BaseException:
            for outcome in outcomes:  # one failed or the wait was cancelled: those not begun never run
                outcome.future.cancel()
            raise
        finally:
            del outcomes

    def _next(self, kind: tuple[int, ...], own: deque[Call]) -> tuple[Call, bool] | None:
        """The next call this thread takes, and whether it is urgent (its own calls are not)."""
        if own:
            return own.popleft(), False
        for priority in kind:
            if self._queues[priority]:
                return self._queues[priority].popleft(), priority == URGENT
        return None

    def yield_to_urgent(self) -> None:
        """Called by a normal call where it may wait (between a batch's images, before its forward
        pass): while an urgent call runs on another thread, wait for it to end, for what is left
        of this call's ``urgent_pause_s``, unless ``pausable`` threads wait so already. A no-op
        outside a normal call on these threads, and with no urgent call running (a plain read)."""
        budget: float = getattr(self._budget, "left", 0.0)
        if budget <= 0 or not self._urgent_running:
            return
        with self._calm:
            if not self._urgent_running or self._paused >= self._pausable:
                return
            self._paused += 1
            began = time.monotonic()
            try:
                self._calm.wait_for(lambda: not self._urgent_running, timeout=budget)
            finally:
                self._paused -= 1
                self._budget.left = budget - (time.monotonic() - began)

    @contextlib.contextmanager
    def holding_the_cores(self) -> Iterator[None]:
        """In an urgent call: while it runs, normal calls that ``yield_to_urgent`` wait (an urgent
        batch of urgent requests alone; one that carries normal requests along is their work too)."""
        if not self._pause_s:
            yield
            return
        with self._calm:
            self._urgent_running += 1
        try:
            yield
        finally:
            with self._calm:
                self._urgent_running -= 1
                if not self._urgent_running:
                    self._calm.notify_all()

    def _begin(self, urgent: bool) -> None:
        """A normal call begins on this thread: it may wait for urgent ones that long (``yield_to_urgent``)."""
        if self._pause_s and not urgent:
            self._budget.left = self._pause_s

    def _end(self, urgent: bool) -> None:
        if self._pause_s and not urgent:
            self._budget.left = 0.0

    def _wake_all(self) -> None:
        """Wake every idle thread (each has a call of its own, or the threads close). Under the lock."""
        for index in self._idle:
            self._wakes[index].notify()
        self._idle.clear()

    def _work(self, index: int) -> None:
        kind, own, wake = self._kinds[index], self._own[index], self._wakes[index]
        name_os_thread(threading.current_thread().name)
        offset = self._nice + (self._normal_nice if kind == NORMAL_ONLY else 0)
        if offset and hasattr(os, "setpriority"):
            with contextlib.suppress(OSError):
                priority = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # the process's, inherited
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, priority + offset))
        if kind == URGENT_ONLY and self._urgent_slice_ns:
            short_time_slice(self._urgent_slice_ns)
        while True:
            with self._lock:
                while (taken := self._next(kind, own)) is None and not self._closing:
                    self._idle[index] = None
                    wake.wait()
                    self._idle.pop(index, None)  # woken by a call another thread took first: idle again above
                if taken is None:
                    return
                # woken for one call, it may have taken another (an urgent one, first in its order,
                # whose own thread then finds nothing): the call it was woken for wakes someone else
                for priority in kind:
                    if self._queues[priority]:
                        self._wake_one(priority)
            call, urgent = taken
            del taken
            self._begin(urgent)
            try:
                _run(call)  # its own frame: nothing of the call stays referenced while this thread waits
            finally:
                self._end(urgent)
            del call  # a failed call's traceback reaches this frame (its f_back): no cycle through it

    def close(self, timeout_s: float = 10.0, cancel_waiting: bool = False) -> list[str]:
        """Finish what is queued (or cancel it), then stop, and join the threads (blocking, bounded).
        Returns the names of those still running: a call outlasted the join.

        Joined rather than left to die with the interpreter: a thread still inside torch at
        interpreter exit can abort the process ("terminate called without an active exception").
        """
        with self._lock:
            self._closing = True
            if cancel_waiting:
                for queue in (*self._queues, *self._own):
                    for _, future in queue:
                        future.cancel()
                    queue.clear()
            self._wake_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        return [thread.name for thread in self._threads if thread.is_alive()]


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS too (Linux: its first 15 bytes), so ``top -H``,
    ``ps -L`` and ``/proc/PID/task/*/comm`` tell the decode and device threads apart."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _run(call: Call) -> None:
    fn, future = call
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:
        future.set_exception(exc)
        # the exception's traceback holds this frame: one that still held the future holding the
        # exception would be a reference cycle, left to the cyclic collector with the whole call
        del call, future
