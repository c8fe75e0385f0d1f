"""``ai-backend bench``: a load generator for a running service, on loopback only.

Closed loop (a fixed number of clients, each sending its next request when the last
one is answered) or open loop (Poisson arrivals at a rate, whatever the answers do).
A share of requests can ride the urgent lane. The first seconds are a warm-up and are
not counted. Every run is bounded in time and in requests, and it stops by itself.

The client shares the machine with the service, so by default it is ``--client raw``: a
minimal HTTP/1.1 client on asyncio streams with every request's bytes built up front
(``app.bench.rawhttp``), several times cheaper per request than httpx (``--client httpx``,
kept as an independent implementation to cross-check against). ``--images DIR`` cycles
through several images; ``--server-pid`` adds where the CPU went in the measured window:
the server's, the client's and everything else's, per request and in cores; and, per group of
the server's threads (event loop, decode, device), the cores each used and the cores' worth of
time it was runnable but kept waiting for one (``server_threads``, Linux schedstat).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import ipaddress
import json
import math
import os
import random
import socket
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from app.bench import rawhttp
from app.bench.threads import Scheduled, sched_report, thread_sched

DEFAULT_IMAGE = Path("models/digits/samples/digit_3.png")
IMAGE_SUFFIXES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp"}

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


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (every thread), from ``/proc/PID/stat``."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and brackets
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def memory_summary(samples_mb: Sequence[float]) -> dict[str, float]:
    """The server's resident memory over the window (samples once a second): first, last and
    max, and how much it grew over the window's second half (from the middle sample to the last):
    queues filling and allocators reaching their largest batch show in the first half, while a
    leak goes on growing through the second."""
    return {
        "first": round(samples_mb[0], 1),
        "last": round(samples_mb[-1], 1),
        "max": round(max(samples_mb), 1),
        "second_half_growth": round(samples_mb[-1] - samples_mb[len(samples_mb) // 2], 1),
    }


def rss_mb(pid: int) -> float | None:
    """The resident memory of ``pid`` in MiB (Linux ``/proc``), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def machine_cpu_s(stat: Path = Path("/proc/stat")) -> tuple[float, float]:
    """Busy and stolen CPU seconds of the whole machine, all cores, from ``/proc/stat``."""
    values = [int(v) for v in stat.read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / CLOCK_TICKS, steal / CLOCK_TICKS


def cpu_snapshot(server_pid: int | None) -> dict[str, float]:
    """CPU seconds so far: this process, the server (if given) and the machine."""
    busy, steal = machine_cpu_s() if Path("/proc/stat").exists() else (0.0, 0.0)
    snapshot = {"client": time.process_time(), "machine": busy, "steal": steal, "wall": time.perf_counter()}
    if server_pid is not None:
        with contextlib.suppress(OSError):  # the server is gone: no server figures
            snapshot["server"] = process_cpu_s(server_pid)
    return snapshot


def cpu_report(before: dict[str, float], after: dict[str, float], ok: int) -> dict[str, float]:
    """Where the CPU went between two snapshots: in cores, and in milliseconds per answered request."""
    wall = max(1e-9, after["wall"] - before["wall"])
    used = {key: after[key] - before[key] for key in before if key in after and key != "wall"}
    if "server" in used:
        used["other"] = max(0.0, used["machine"] - used["client"] - used["server"])
    report = {f"{key}_cores": round(value / wall, 3) for key, value in used.items()}
    for key in ("client", "server"):
        if key in used and ok:
            report[f"{key}_ms_per_request"] = round(used[key] * 1000 / ok, 4)
    return {"window_s": round(wall, 3), **report}


def _threads(server_pid: int | None) -> dict[int, Scheduled] | None:
    if server_pid is None:
        return None
    with contextlib.suppress(OSError):  # the server is gone
        return thread_sched(server_pid)
    return None


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def reachable(url: str, timeout_s: float = 5.0) -> str | None:
    """None when something listens at ``url``'s host and port; else why not. Checked before a
    run: against a closed port every request fails at once, and the clients spin through
    tens of thousands of refused connections a second."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"nothing answers at {url}: {exc.strerror or exc}"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (sorted or not): the smallest value with at
    least ``q`` percent of them at or below it; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = math.ceil(round(q / 100 * len(ordered), 9))  # rounded: 0.07 * 100 is 7.000000000000001
    return ordered[max(1, min(len(ordered), rank)) - 1]


def _payload(status: int, body: bytes) -> dict[str, Any]:
    """An answer's JSON object. An error answer that is not JSON (a proxy's, a balancer's)
    keeps its status, with the code ``non_json``; a 200 that is not is a failed request."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        return payload
    if status == 200:
        raise ValueError("the answer is not a JSON object")
    return {"code": "non_json"}


async def _send(send: Send, number: int, urgent: bool, run: Run, scheduled: float | None = None) -> None:
    """Send one request and record its sample. Open loop passes the arrival it was
    ``scheduled`` for: its latency counts from then, so a client that fell behind its
    schedule shows as latency, not as requests that never waited (coordinated omission)."""
    lane = "urgent" if urgent else "normal"
    started = time.perf_counter() if scheduled is None else scheduled
    try:
        status, body = await send(number, urgent)
        payload = _payload(status, body)
    except (OSError, EOFError, TimeoutError, httpx.HTTPError, rawhttp.HttpProtocolError, ValueError) as exc:
        status, payload = 0, {"code": type(exc).__name__}
    except asyncio.CancelledError:  # still unanswered when the run ended: sent, so it counts
        status, payload = 0, {"code": "unanswered"}
        _record(run, lane, started, status, payload)
        raise
    _record(run, lane, started, status, payload)


def _record(run: Run, lane: str, started: float, status: int, payload: dict[str, Any]) -> None:
    ended = time.perf_counter()
    run.samples.append(
        Sample(
            lane,
            ended - started,
            status,
            None if status == 200 else str(payload.get("code")),
            payload.get("batch_size") if status == 200 else None,
            started >= run.measured_from,
            payload.get("timings") if status == 200 and isinstance(payload.get("timings"), dict) else None,
            ended,
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
) -> None:
    """Poisson arrivals until ``stop_at``; then waits for the answers, each bounded by the
    client's ``timeout_s``, and records what is still unanswered after that as such."""
    tasks: set[asyncio.Task[None]] = set()
    next_at = time.perf_counter()
    for number in range(max_requests):
        next_at += rng.expovariate(rate)
        if next_at >= stop_at:
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


def summarise(run: Run, settings: dict[str, Any], deadline_ms: float | None = None) -> dict[str, Any]:
    """The report: throughput, latency percentiles per lane (answers, and 503 refusals),
    errors, mean batch size, answers later than their deadline, the server's memory."""
    counted = [s for s in run.samples if s.counted]
    ok = [s for s in counted if s.status == 200]
    refused = [s for s in counted if s.status == 503]
    window = max(1e-9, run.ended - run.measured_from)
    # answers that came inside the window, whenever sent: what the server got through in it
    answered = sum(1 for s in run.samples if s.status == 200 and run.measured_from <= s.finished <= run.ended)

    def latencies(samples: list[Sample]) -> dict[str, float | int]:
        values = [s.latency_s * 1000 for s in samples]
        return {
            "count": len(values),
            "p50_ms": round(percentile(values, 50), 3),
            "p90_ms": round(percentile(values, 90), 3),
            "p99_ms": round(percentile(values, 99), 3),
            "max_ms": round(max(values, default=0.0), 3),
        }

    def mean_batch(samples: list[Sample]) -> float:
        # per batch, not per request: a batch of b holds b of the answers (the harmonic mean)
        sizes = [s.batch_size for s in samples if s.batch_size]
        return round(len(sizes) / sum(1 / b for b in sizes), 2) if sizes else 0.0

    extra: dict[str, Any] = {}
    if any(s.timings_ms for s in ok):  # where each lane's time went, by the server's account
        extra["server_stages_ms"] = {
            lane: {
                stage: {"p50": round(percentile(v, 50), 3), "p99": round(percentile(v, 99), 3)}
                for stage in ("preprocess", "queue", "inference", "total")
                if (
                    v := [
                        float(s.timings_ms[stage])
                        for s in ok
                        if s.lane == lane and s.timings_ms and stage in s.timings_ms
                    ]
                )
            }
            for lane in ("urgent", "normal")
        }
    if run.cpu_before is not None and run.cpu_after is not None:
        extra["cpu"] = cpu_report(run.cpu_before, run.cpu_after, len(ok))
        if run.threads_before and run.threads_after:
            window_s = run.cpu_after["wall"] - run.cpu_before["wall"]
            extra["server_threads"] = sched_report(run.threads_before, run.threads_after, window_s)
    if deadline_ms is not None:  # the client's own clock: what it waited, beyond what it allowed
        extra["deadline_ms"] = deadline_ms
        extra["ok_past_deadline"] = sum(1 for s in ok if s.latency_s * 1000 > deadline_ms)
    if run.rss_mb:
        extra["server_rss_mb"] = memory_summary(run.rss_mb)
    return {
        **settings,
        "measured_s": round(window, 3),
        "sent": run.sent,
        "requests": len(counted),
        "ok": len(ok),
        "throughput_rps": round(answered / window, 2),
        "latency": {
            "all": latencies(ok),
            "urgent": latencies([s for s in ok if s.lane == "urgent"]),
            "normal": latencies([s for s in ok if s.lane == "normal"]),
            "refused": latencies(refused),
        },
        "errors": dict(Counter(f"{s.status}:{s.code}" for s in counted if s.status != 200)),
        "mean_batch_size": mean_batch(ok),
        "mean_batch_size_by_lane": {
            lane: mean_batch([s for s in ok if s.lane == lane]) for lane in ("urgent", "normal")
        },
        **extra,
    }


def json_bodies(images: Sequence[bytes], top_k: int = 1) -> list[bytes]:
    """One JSON prediction body per image."""
    return [json.dumps({"image_base64": base64.b64encode(i).decode(), "top_k": top_k}).encode() for i in images]


def load_images(image: Path, folder: Path | None) -> list[bytes]:
    """Every image in ``folder`` (JPEG, PNG, WebP, by name), or the one ``image``."""
    if folder is None:
        return [image.read_bytes()]
    paths = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise FileNotFoundError(f"{folder} holds no .jpg, .jpeg, .png or .webp files")
    return [p.read_bytes() for p in paths]


def _headers(urgent: bool, deadline_ms: float | None = None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "X-Urgency": "high" if urgent else "normal"}
    if deadline_ms is not None:
        headers["X-Request-Timeout"] = str(round(deadline_ms))
    return headers


def raw_sender(
    url: str, path: str, bodies: Sequence[bytes], timeout: float, deadline_ms: float | None = None
) -> tuple[Send, rawhttp.Pool]:
    """A ``Send`` over a pool of raw keep-alive connections, every request's bytes built now."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    authority = parts.netloc
    requests = {
        (index, urgent): rawhttp.build_request("POST", authority, path, _headers(urgent, deadline_ms), body)
        for index, body in enumerate(bodies)
        for urgent in (False, True)
    }
    pool = rawhttp.Pool(host, port)

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        async with asyncio.timeout(timeout):
            head, body = await pool.request(requests[number % len(bodies), urgent])
        return head.status, body

    return send, pool


def httpx_sender(
    client: httpx.AsyncClient, path: str, bodies: Sequence[bytes], deadline_ms: float | None = None
) -> Send:
    """A ``Send`` through httpx."""

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        response = await client.post(path, content=bodies[number % len(bodies)], headers=_headers(urgent, deadline_ms))
        return response.status_code, response.content

    return send


async def _drive(send: Send, args: argparse.Namespace, run: Run) -> dict[str, Any]:
    rng = random.Random(args.seed)
    run.started = time.perf_counter()
    run.measured_from = run.started + args.warmup
    stop_at = run.measured_from + args.duration

    async def watch_cpu() -> None:
        await asyncio.sleep(max(0.0, run.measured_from - time.perf_counter()))
        run.cpu_before = cpu_snapshot(args.server_pid)
        run.threads_before = _threads(args.server_pid)

    async def watch_memory(pid: int) -> None:
        await asyncio.sleep(max(0.0, run.measured_from - time.perf_counter()))
        while (rss := rss_mb(pid)) is not None:
            run.rss_mb.append(rss)
            await asyncio.sleep(1.0)

    watcher = asyncio.create_task(watch_cpu())
    memory = asyncio.create_task(watch_memory(args.server_pid)) if args.server_pid is not None else None
    if args.rate is None:
        await closed_loop(send, args.concurrency, args.urgent_fraction, stop_at, args.requests, run, rng)
        mode: dict[str, Any] = {"mode": "closed", "concurrency": args.concurrency}
    else:
        await open_loop(send, args.rate, args.urgent_fraction, stop_at, args.requests, run, rng, args.timeout)
        mode = {"mode": "open", "rate_rps": args.rate}
    run.ended = min(time.perf_counter(), stop_at) if run.samples else time.perf_counter()
    if watcher.done():  # from the window's start to the last answer, in-flight requests included
        run.cpu_after = cpu_snapshot(args.server_pid)
        run.threads_after = _threads(args.server_pid)
    else:  # the load stopped before the window began (request cap): no CPU figures
        watcher.cancel()
    if memory is not None:
        memory.cancel()
        if (rss := rss_mb(args.server_pid)) is not None and run.rss_mb:
            run.rss_mb.append(rss)
    return mode


async def bench(args: argparse.Namespace, images: Sequence[bytes]) -> dict[str, Any]:
    bodies = json_bodies(images)
    path = f"/v1/models/{args.model}/predict" if args.model else "/predict"
    run = Run()
    if args.client == "raw":
        send, pool = raw_sender(args.url, path, bodies, args.timeout, args.deadline_ms)
        try:
            mode = await _drive(send, args, run)
        finally:
            pool.close()
        mode["connections"] = pool.size
    else:
        limits = httpx.Limits(max_connections=max(args.concurrency, 64) if args.rate is None else 1000)
        # trust_env=False: a proxy in the environment would take the load off loopback
        async with httpx.AsyncClient(base_url=args.url, limits=limits, timeout=args.timeout, trust_env=False) as client:
            mode = await _drive(httpx_sender(client, path, bodies, args.deadline_ms), args, run)
    settings = {
        **mode,
        "client": args.client,
        "images": len(images),
        "mean_body_bytes": round(sum(map(len, bodies)) / len(bodies)),
        "urgent_fraction": args.urgent_fraction,
        "warmup_s": args.warmup,
    }
    return summarise(run, settings, args.deadline_ms)


T = TypeVar("T")


def event_loop_run(work: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run``, on uvloop where it is installed (less CPU per request for the client too)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(work)
    return uvloop.run(work)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ai-backend bench", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a loopback URL of a running service")
    parser.add_argument("--model", help="target /v1/models/NAME/predict instead of /predict")
    parser.add_argument("--image", default=str(DEFAULT_IMAGE), help="the image every request sends")
    parser.add_argument("--images", type=Path, help="a folder of images: request n sends the n-th, cycling")
    parser.add_argument(
        "--client", choices=("raw", "httpx"), default="raw", help="raw: precomputed HTTP/1.1 bytes (default); httpx"
    )
    parser.add_argument("--server-pid", type=int, help="also report this process's CPU use (Linux /proc)")
    loop = parser.add_mutually_exclusive_group()
    loop.add_argument("--concurrency", type=int, default=32, help="closed loop: clients in flight (default 32)")
    loop.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--urgent-fraction", type=float, default=0.0, help="share of requests with X-Urgency: high")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds, after the warm-up (max 600)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds sent but not counted")
    parser.add_argument("--requests", type=int, default=200_000, help="hard cap on requests sent")
    parser.add_argument("--timeout", type=float, default=60.0, help="per-request client timeout, seconds")
    parser.add_argument(
        "--deadline-ms", type=float, help="send X-Request-Timeout; count answers that came later than it"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    if not is_loopback(args.url):
        parser.error("--url must point at a loopback address (127.0.0.0/8, ::1 or localhost)")
    if not 0 < args.duration <= 600 or not 0 <= args.warmup <= 600 or not 0 <= args.urgent_fraction <= 1:
        parser.error("need 0 < duration <= 600, 0 <= warmup <= 600 and 0 <= urgent-fraction <= 1")
    if args.rate is not None and not 0 < args.rate <= 100_000:
        parser.error("need 0 < rate <= 100000 arrivals a second")
    if args.concurrency < 1 or args.requests < 1 or not 0 < args.timeout <= 600:
        parser.error("need concurrency >= 1, requests >= 1 and 0 < timeout <= 600")
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}/stat").exists():
        parser.error(f"--server-pid {args.server_pid}: no such process (or no /proc)")
    try:
        images = load_images(Path(args.image), args.images)
    except OSError as exc:
        parser.error(str(exc))
    if (unreachable := reachable(args.url)) is not None:
        print(f"ai-backend bench: {unreachable}", file=sys.stderr)
        return 1
    report = event_loop_run(bench(args, images))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
