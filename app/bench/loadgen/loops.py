"""The two ways of sending load, a closed loop of clients and an open loop of Poisson arrivals,
and the record each request they send leaves."""

from __future__ import annotations

import asyncio
import errno
import json
import math
import random
import re
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
    dropped: tuple[str, ...] = ()  # a success's figures that could not be read (``figures``)

    @property
    def ok(self) -> bool:
        """A success: a 200 whose body is a JSON object (a 200 that is not has the code ``non_json``);
        its figures that could not be read are dropped, not held against it."""
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
    rss_mb: list[float] = field(default_factory=list)  # the server's process tree's RSS, once a second
    pss_mb: list[float] = field(default_factory=list)  # and its PSS, at the readings where it was readable
    memory_processes: int = 0  # the most processes the tree held at a reading
    lag_before: LagHistogram | None = None  # the server's event-loop lag histogram at the window's ends
    lag_after: LagHistogram | None = None


def _outcome(status: int, body: bytes) -> tuple[str | None, dict[str, Any]]:
    """An answer's error code (None: a success) and its JSON object. An answer that is not a JSON
    object (a proxy's, a balancer's, a broken server's) keeps its status, with the code
    ``non_json``: a 200 too, which is then a failed request the server answered, not the client's.

    An error's code is the body's string ``code`` (this service's envelope), else its ``detail``
    (FastAPI, LitServe, Ray Serve) or ``error`` (Triton), shortened and normalised so that the codes
    stay few, else ``no_code``: never the string "None", which read the same for a 422 and a 500.

    A 200 is a success whatever its optional figures hold: a ``batch_size`` or ``timings`` that
    cannot be read is dropped from the figures (``figures`` says which) and counted in the report,
    not made a failed request (a rival's ``"batch_size": 0`` failed every correct answer)."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return "non_json", {}
    if status != 200:
        return _error_name(payload), payload
    return None, payload


CODE_CHARS = 40  # a longer detail is cut: a message that names a request would make a code per request


def _error_name(payload: dict[str, Any]) -> str:
    """An error body's code: ``code``, else a short form of ``detail`` or ``error``, else ``no_code``."""
    code = payload.get("code")
    if isinstance(code, str) and code.strip():
        return code
    if type(code) is int:
        return str(code)
    for key in ("detail", "error"):
        text = payload.get(key)
        if isinstance(text, list) and text and isinstance(text[0], dict):  # FastAPI's 422: a list of problems
            text = text[0].get("type") or text[0].get("msg")
        elif isinstance(text, dict):
            text = text.get("code") or text.get("type") or text.get("message")
        if isinstance(text, str) and (short := re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")):
            return short[:CODE_CHARS].rstrip("_")
    return "no_code"


def figures(payload: dict[str, Any]) -> tuple[int | None, dict[str, float] | None, tuple[str, ...]]:
    """A success's ``batch_size`` (a positive integer, else None) and ``timings`` (the stages that
    are finite durations in milliseconds, none below 0), and the names of the figures dropped as
    unreadable: ``batch_size``, ``timings`` (when any stage of it was). Absent is not dropped."""
    dropped: list[str] = []
    size = payload.get("batch_size")
    if size is not None and not (type(size) is int and size >= 1):  # not True, not 2.0, not 0
        size = None
        dropped.append("batch_size")
    timings = payload.get("timings")
    kept: dict[str, float] | None = None
    if timings is not None:
        if not isinstance(timings, dict):
            dropped.append("timings")
        else:
            kept = {
                stage: ms for stage, ms in timings.items() if type(ms) in (int, float) and math.isfinite(ms) and ms >= 0
            }
            if len(kept) < len(timings):
                dropped.append("timings")
    return size, kept, tuple(dropped)


def _error_code(exc: BaseException) -> str:
    """A failed request's code: ``connection_closed`` when the server closed the connection
    after the request was written and before a byte of its answer; an ``OSError`` by its errno's
    name (``EMFILE``: the client out of descriptors, ``ECONNREFUSED``: nothing listening), which
    tells the client's own failures from the server's; else the error's type."""
    if isinstance(exc, rawhttp.ConnectionClosed):
        return "connection_closed"
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, f"errno_{exc.errno}")
    return type(exc).__name__


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
    size, timings, dropped = figures(payload) if code is None else (None, None, ())
    run.samples.append(
        Sample(lane, ended - started, status, code, size, started >= run.measured_from, timings, ended, lag, dropped)
    )


async def closed_loop(
    send: Send,
    concurrency: int,
    urgent_fraction: float,
    stop_at: float,
    max_requests: int,
    run: Run,
    rng: random.Random,
) -> bool:
    """``concurrency`` clients, each sending its next request when the last is answered, until
    ``stop_at``; True when ``max_requests`` ended it before then.

    A request that fails in the client (a refused connection, no descriptor left) may fail
    without ever waiting: the client then hands the event loop a turn before its next, or it
    would spin through the cap without the answers on the other connections being read."""
    capped = False

    async def client_loop() -> None:
        nonlocal capped
        while time.perf_counter() < stop_at:
            if run.sent >= max_requests:
                capped = True
                return
            number = run.sent
            run.sent += 1
            await _send(send, number, rng.random() < urgent_fraction, run)
            if run.samples and run.samples[-1].status == 0:
                await asyncio.sleep(0)

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return capped


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
