"""The two ways of sending load, a closed loop of clients and an open loop of Poisson arrivals,
and the record each request they send leaves."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from app.bench import rawhttp
from app.bench.loadgen.scrape import LagHistogram
from app.bench.threads import Scheduled

Send = Callable[[int, bool], Awaitable[tuple[int, bytes]]]
"""Sends request number ``n`` (which picks the image), urgent or not; returns status and body."""


@dataclass(frozen=True)
class Sample:
    """One answered request."""

    lane: str
    latency_s: float
    status: int
    code: str | None
    batch_size: int | None
    counted: bool  # sent inside the measured window: its latency counts
    timings_ms: dict[str, float] | None = None  # the server's own stages (preprocess, queue, ...)
    finished: float = 0.0  # time.perf_counter() at its answer: throughput counts answers inside the window
    lag_s: float | None = None  # open loop: how long after its scheduled arrival the client sent it

    @property
    def ok(self) -> bool:
        """A success: a 200 whose body is a JSON object (a 200 that is not has the code ``non_json``)
        with well-formed figures (one with a broken ``batch_size`` or ``timings`` has ``bad_body``)."""
        return self.status == 200 and self.code is None

    @property
    def sent_at(self) -> float:
        """When the client sent it (``time.perf_counter()``): latency counts from its scheduled
        arrival in open loop, and the client sent it ``lag_s`` after that; one sent early
        (``lag_s`` below 0) counts from its send."""
        return self.finished - self.latency_s + max(self.lag_s or 0.0, 0.0)


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    started: float = 0.0
    measured_from: float = 0.0
    ended: float = 0.0
    sent: int = 0
    cpu_before: dict[str, float] | None = None  # CPU snapshots at the measured window's ends
    cpu_after: dict[str, float] | None = None
    threads_before: dict[int, Scheduled] | None = None  # the server's threads, by the scheduler's account
    threads_after: dict[int, Scheduled] | None = None
    rss_mb: list[float] = field(default_factory=list)  # the server's resident memory, once a second
    lag_before: LagHistogram | None = None  # the server's event-loop lag histogram at the window's ends
    lag_after: LagHistogram | None = None


def _outcome(status: int, body: bytes) -> tuple[str | None, dict[str, Any]]:
    """An answer's error code (None: a success) and its JSON object. An answer that is not a JSON
    object (a proxy's, a balancer's, a broken server's) keeps its status, with the code
    ``non_json``: a 200 too, which is then a failed request the server answered, not the client's.

    A 200 whose own figures are broken (a ``batch_size`` that is not a positive integer, ``timings``
    that are not finite durations) has the code ``bad_body``: a failed request, not a success with
    the figure dropped. Dropped, the report would show a mean batch and stage times taken from the
    rest as if that were all, and a service that sent nothing but such answers would pass; kept, a
    string crashed the run and NaN or a negative size wrote NaN (not JSON) or an absurd mean. Either
    figure absent is fine: a rival service need not send them."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return "non_json", {}
    if status != 200:
        return str(payload.get("code")), payload
    return (None, payload) if _figures_well_formed(payload) else ("bad_body", {})


def _figures_well_formed(payload: dict[str, Any]) -> bool:
    """Whether an answer's ``batch_size`` (if any) is a positive integer and its ``timings`` (if
    any) an object of finite durations in milliseconds, none below 0."""
    size, timings = payload.get("batch_size"), payload.get("timings")
    if size is not None and not (type(size) is int and size >= 1):  # not True, not 2.0
        return False
    if timings is None:
        return True
    return isinstance(timings, dict) and all(
        type(ms) in (int, float) and math.isfinite(ms) and ms >= 0 for ms in timings.values()
    )


def _error_code(exc: BaseException) -> str:
    """A failed request's code: ``connection_closed`` when the server closed the connection
    after the request was written and before a byte of its answer, else the error's type."""
    return "connection_closed" if isinstance(exc, rawhttp.ConnectionClosed) else type(exc).__name__


async def _send(send: Send, number: int, urgent: bool, run: Run, scheduled: float | None = None) -> None:
    """Send one request and record its sample. Open loop passes the arrival it was
    ``scheduled`` for: its latency counts from then, so a client that fell behind its
    schedule shows as latency, not as requests that never waited (coordinated omission);
    how far behind it sent is recorded too, so that the report can say whose delay it was."""
    lane = "urgent" if urgent else "normal"
    now = time.perf_counter()
    # sent early (uvloop's timers fire up to a millisecond before their time): from the send
    started = now if scheduled is None else min(now, scheduled)
    lag = None if scheduled is None else now - scheduled
    try:
        status, body = await send(number, urgent)
        code, payload = _outcome(status, body)
    except (OSError, EOFError, TimeoutError, httpx.HTTPError, rawhttp.HttpProtocolError, ValueError) as exc:
        status, code, payload = 0, _error_code(exc), {}
    except asyncio.CancelledError:  # still unanswered when the run ended: sent, so it counts
        _record(run, lane, started, 0, "unanswered", {}, lag)
        raise
    _record(run, lane, started, status, code, payload, lag)


def _record(
    run: Run, lane: str, started: float, status: int, code: str | None, payload: dict[str, Any], lag: float | None
) -> None:
    ended = time.perf_counter()
    timings = payload.get("timings") if code is None else None
    run.samples.append(
        Sample(
            lane,
            ended - started,
            status,
            code,
            payload.get("batch_size") if code is None else None,
            started >= run.measured_from,
            timings if isinstance(timings, dict) else None,
            ended,
            lag,
        )
    )


async def closed_loop(
    send: Send,
    concurrency: int,
    urgent_fraction: float,
    stop_at: float,
    max_requests: int,
    run: Run,
    rng: random.Random,
) -> None:
    async def client_loop() -> None:
        while time.perf_counter() < stop_at and run.sent < max_requests:
            number = run.sent
            run.sent += 1
            await _send(send, number, rng.random() < urgent_fraction, run)

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))


async def open_loop(
    send: Send,
    rate: float,
    urgent_fraction: float,
    stop_at: float,
    max_requests: int,
    run: Run,
    rng: random.Random,
    timeout_s: float = 60.0,
) -> bool:
    """Poisson arrivals until ``stop_at``; then waits for the answers, each bounded by the
    client's ``timeout_s``, and records what is still unanswered after that as such.

    True when the schedule ran to ``stop_at``, False when ``max_requests`` cut it short. Run to
    its end, it returns no earlier than ``stop_at`` (a timer may fire a little early: the window
    ends at ``stop_at`` all the same), even when its last arrival came well before and was
    answered at once: the quiet time after it is part of what was offered. Ended at the last
    answer, 5 arrivals in 3 s at 2 a second read as 4.8 a second."""
    tasks: set[asyncio.Task[None]] = set()
    next_at = time.perf_counter()
    ran_to_stop = False
    for number in range(max_requests):
        next_at += rng.expovariate(rate)
        if next_at >= stop_at:
            await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
            ran_to_stop = True
            break
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        run.sent += 1
        task = asyncio.create_task(_send(send, number, rng.random() < urgent_fraction, run, scheduled=next_at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=max(1.0, stop_at - time.perf_counter() + timeout_s + 1.0))
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # each records itself as unanswered
    return ran_to_stop
