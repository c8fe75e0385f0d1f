"""One run from start to end: the client set up, the load driven through the warm-up and the
measured window while the server's CPU, memory and event-loop lag are watched, and the report."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import random
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import httpx

from app.bench.loadgen.loops import Run, Send, closed_loop, open_loop
from app.bench.loadgen.scrape import scrape_lag
from app.bench.loadgen.senders import httpx_sender, json_bodies, raw_sender
from app.bench.loadgen.summary import summarise
from app.bench.loadgen.target import Target
from app.bench.loadgen.usage import cpu_snapshot, thread_snapshot, tree_memory

# The client's own collections must not read as the server's latency. Every object the process
# tracks is frozen out of the collector this often (``gc.freeze`` acts on the whole process), so
# that a full collection scans about a second's new objects. Left to run, a full collection of the
# samples kept stalled the client for 74.3 ms at twice the load (760 requests/s), and the stall read
# as the server's. Garbage frozen in a cycle stays until the run ends and thaws it, which is bounded.
FREEZE_EVERY_S = 1.0
HTTPX_OPEN_LOOP_CONNECTIONS = 1000  # httpx queues past its cap: an open loop's in flight beyond it wait in the client


async def _freeze_what_is_kept() -> None:
    while True:
        gc.freeze()
        await asyncio.sleep(FREEZE_EVERY_S)


async def _drive(send: Send, args: argparse.Namespace, run: Run) -> dict[str, Any]:
    # none where someone else in this process froze objects first (a service): theirs to manage
    freezer = None if gc.get_freeze_count() > 0 else asyncio.create_task(_freeze_what_is_kept())
    try:
        return await _drive_load(send, args, run)
    finally:
        if freezer is not None:
            freezer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await freezer
            gc.unfreeze()


async def _drive_load(send: Send, args: argparse.Namespace, run: Run) -> dict[str, Any]:
    rng = random.Random(args.seed)
    run.started = time.perf_counter()
    run.measured_from = run.started + args.warmup
    stop_at = run.measured_from + args.duration

    async def watch_cpu() -> None:
        await asyncio.sleep(max(0.0, run.measured_from - time.perf_counter()))
        run.cpu_before = cpu_snapshot(args.server_pid)
        run.threads_before = thread_snapshot(args.server_pid)
        if args.server_metrics:
            run.lag_before = await scrape_lag(args.target)

    watcher = asyncio.create_task(watch_cpu())
    memory = asyncio.create_task(watch_memory(args.server_pid, run)) if args.server_pid is not None else None
    ran_to_stop = False  # a closed loop's clients send until stop_at, and their last answers come after it
    if args.rate is None:
        capped = await closed_loop(send, args.concurrency, args.urgent_fraction, stop_at, args.requests, run, rng)
        mode: dict[str, Any] = {"mode": "closed", "concurrency": args.concurrency}
    else:
        ran_to_stop = await open_loop(
            send, args.rate, args.urgent_fraction, stop_at, args.requests, run, rng, args.timeout
        )
        capped = not ran_to_stop
        mode = {"mode": "open", "rate_rps": args.rate}
    # what ended the sending: the --duration, or the --requests cap before it (a shorter window)
    mode["ended_by"] = "requests_cap" if capped else "duration"
    # stop_at, or the last answer when the request cap ended the run first; an open loop's schedule
    # that ran to stop_at ends there, however quiet its last seconds were (not at its last answer)
    if ran_to_stop:
        run.ended = stop_at
    else:
        run.ended = min(time.perf_counter(), stop_at) if run.samples else time.perf_counter()
    if not watcher.done():  # the window had not begun (a request cap), or its first scrape is still out
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if run.cpu_before is not None:  # from the window's start to the last answer, in-flight requests included
        run.cpu_after = cpu_snapshot(args.server_pid)
        run.threads_after = thread_snapshot(args.server_pid)
        if run.lag_before is not None:
            run.lag_after = await scrape_lag(args.target)
    if memory is not None:
        memory.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await memory
        if run.rss_mb:
            await read_memory(args.server_pid, run)
    return mode


async def watch_memory(pid: int, run: Run) -> None:
    """The server's memory once a second from the measured window's start, until cancelled or
    the server is gone."""
    await asyncio.sleep(max(0.0, run.measured_from - time.perf_counter()))
    while True:
        if not await read_memory(pid, run):  # the server is gone
            return
        await asyncio.sleep(1.0)


async def read_memory(pid: int, run: Run) -> bool:
    """One reading of the server's memory into ``run``; False once the server is gone. Read in a
    thread: PSS walks the server's page tables in the kernel, milliseconds per GB resident, and a
    stall of this loop would hold the client's sends back and read as the server's latency."""
    if (memory := await asyncio.to_thread(tree_memory, pid)) is None:
        return False
    run.rss_mb.append(memory.rss_mb)
    if memory.pss_mb is not None:
        run.pss_mb.append(memory.pss_mb)
    run.memory_processes = max(run.memory_processes, memory.processes)
    return True


async def bench(args: argparse.Namespace, images: Sequence[bytes]) -> dict[str, Any]:
    bodies = json_bodies(images)
    path = getattr(args, "path", None) or (f"/v1/models/{args.model}/predict" if args.model else "/predict")
    run = Run()
    target: Target = args.target
    if args.client == "raw":
        send, pool = raw_sender(target, path, bodies, args.timeout, args.deadline_ms, args.api_key)
        try:
            mode = await _drive(send, args, run)
        finally:
            pool.close()
        mode["connections"] = pool.size
        mode["retried"] = pool.retried
    else:
        limits = httpx.Limits(
            max_connections=max(args.concurrency, 64) if args.rate is None else HTTPX_OPEN_LOOP_CONNECTIONS
        )
        # trust_env=False: a proxy in the environment would take the load off loopback; the
        # resolved address, so that the name is not resolved again, and the URL's Host header
        async with httpx.AsyncClient(
            base_url=target.base_url,
            headers={"Host": target.authority},
            limits=limits,
            timeout=args.timeout,
            trust_env=False,
        ) as client:
            send = httpx_sender(client, path, bodies, args.timeout, args.deadline_ms, args.api_key)
            mode = await _drive(send, args, run)
    settings = {
        **mode,
        "client": args.client,
        "images": len(images),
        "mean_body_bytes": round(sum(map(len, bodies)) / len(bodies)),
        "urgent_fraction": args.urgent_fraction,
        "warmup_s": args.warmup,
        "duration_s": args.duration,
        "timeout_s": args.timeout,
        "client_fd_limit": getattr(args, "fd_limit", None),  # RLIMIT_NOFILE, as raised at start
    }
    return summarise(run, settings, args.deadline_ms, args.timeout)


T = TypeVar("T")


def event_loop_run(work: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run``, on uvloop where it is installed (less CPU per request for the client too)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(work)
    return uvloop.run(work)
