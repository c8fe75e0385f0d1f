"""Worker threads that take urgent calls first: the decode pool and the device's threads.

A plain thread pool is first in, first out, so under load an urgent request's image would
wait behind every normal one queued before it, and the urgent lane would lose at the decode
pool what it wins at the batcher. Here urgent calls go first; within a priority, calls run
in the order they came. A call cancelled while it waits (its client went away) never runs.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

URGENT, NORMAL = 0, 1


class WorkerThreads:
    """``workers`` daemon threads serving one priority queue (daemons: a stuck call cannot
    keep the process alive at exit; ``close`` joins them, bounded)."""

    def __init__(self, name: str, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"{name} needs at least one worker thread")
        self._calls: list[tuple[int, int, Callable[[], Any], Future[Any]]] = []
        self._ready = threading.Condition()
        self._order = itertools.count()
        self._closing = False
        self._threads = [
            threading.Thread(target=self._work, name=name if workers == 1 else f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def workers(self) -> int:
        return len(self._threads)

    def submit(self, fn: Callable[[], T], urgent: bool = False) -> Future[T]:
        future: Future[T] = Future()
        with self._ready:
            if self._closing:
                raise RuntimeError("the worker threads are closed")
            heapq.heappush(self._calls, (URGENT if urgent else NORMAL, next(self._order), fn, future))
            self._ready.notify()
        return future

    async def run(self, fn: Callable[[], T], urgent: bool = False) -> T:
        """Run ``fn`` on a worker and await its result without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(fn, urgent))

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._calls and not self._closing:
                    self._ready.wait()
                if not self._calls:
                    return
                *_, fn, future = heapq.heappop(self._calls)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def close(self, timeout_s: float = 10.0, cancel_waiting: bool = False) -> None:
        """Finish what is queued (or cancel it), then stop, and join the threads (blocking, bounded).

        Joined rather than left to die with the interpreter: a thread still inside torch at
        interpreter exit can abort the process ("terminate called without an active exception").
        """
        with self._ready:
            self._closing = True
            if cancel_waiting:
                for *_, future in self._calls:
                    future.cancel()
                self._calls.clear()
            self._ready.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
