"""``ai-backend bench``: a load generator for a running service, on loopback only.

Closed loop (a fixed number of clients, each sending its next request when the last
one is answered) or open loop (Poisson arrivals at a rate, whatever the answers do).
A share of requests can ride the urgent lane. The first seconds are a warm-up and are
not counted. Every run is bounded in time and in requests, and it stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import ipaddress
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

DEFAULT_IMAGE = Path("models/digits/samples/digit_3.png")


@dataclass(frozen=True)
class Sample:
    """One answered request."""

    lane: str
    latency_s: float
    status: int
    code: str | None
    batch_size: int | None
    counted: bool


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    started: float = 0.0
    measured_from: float = 0.0
    ended: float = 0.0


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (sorted or not); 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def _send(client: httpx.AsyncClient, path: str, body: bytes, urgent: bool, run: Run) -> None:
    lane = "urgent" if urgent else "normal"
    headers = {"Content-Type": "application/json", "X-Urgency": "high" if urgent else "normal"}
    started = time.perf_counter()
    try:
        response = await client.post(path, content=body, headers=headers)
        status, payload = response.status_code, response.json()
    except (httpx.HTTPError, ValueError) as exc:
        status, payload = 0, {"code": type(exc).__name__}
    ended = time.perf_counter()
    run.samples.append(
        Sample(
            lane,
            ended - started,
            status,
            None if status == 200 else str(payload.get("code")),
            payload.get("batch_size") if status == 200 else None,
            started >= run.measured_from,
        )
    )


async def closed_loop(
    client: httpx.AsyncClient,
    path: str,
    body: bytes,
    concurrency: int,
    urgent_fraction: float,
    stop_at: float,
    max_requests: int,
    run: Run,
    rng: random.Random,
) -> None:
    sent = 0

    async def client_loop() -> None:
        nonlocal sent
        while time.perf_counter() < stop_at and sent < max_requests:
            sent += 1
            await _send(client, path, body, rng.random() < urgent_fraction, run)

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))


async def open_loop(
    client: httpx.AsyncClient,
    path: str,
    body: bytes,
    rate: float,
    urgent_fraction: float,
    stop_at: float,
    max_requests: int,
    run: Run,
    rng: random.Random,
) -> None:
    tasks: set[asyncio.Task[None]] = set()
    next_at = time.perf_counter()
    for _ in range(max_requests):
        next_at += rng.expovariate(rate)
        if next_at >= stop_at:
            break
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        task = asyncio.create_task(_send(client, path, body, rng.random() < urgent_fraction, run))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=max(1.0, stop_at - time.perf_counter() + 30))
    for task in tasks:
        task.cancel()


def summarise(run: Run, settings: dict[str, Any]) -> dict[str, Any]:
    """The report: throughput, latency percentiles per lane, errors, mean batch size."""
    counted = [s for s in run.samples if s.counted]
    ok = [s for s in counted if s.status == 200]
    window = max(1e-9, run.ended - run.measured_from)

    def latencies(samples: list[Sample]) -> dict[str, float | int]:
        values = [s.latency_s * 1000 for s in samples]
        return {
            "count": len(values),
            "p50_ms": round(percentile(values, 50), 3),
            "p90_ms": round(percentile(values, 90), 3),
            "p99_ms": round(percentile(values, 99), 3),
            "max_ms": round(max(values, default=0.0), 3),
        }

    batch_sizes = [s.batch_size for s in ok if s.batch_size]
    return {
        **settings,
        "measured_s": round(window, 3),
        "requests": len(counted),
        "ok": len(ok),
        "throughput_rps": round(len(ok) / window, 2),
        "latency": {
            "all": latencies(ok),
            "urgent": latencies([s for s in ok if s.lane == "urgent"]),
            "normal": latencies([s for s in ok if s.lane == "normal"]),
        },
        "errors": dict(Counter(f"{s.status}:{s.code}" for s in counted if s.status != 200)),
        "mean_batch_size": round(sum(batch_sizes) / len(batch_sizes), 2) if batch_sizes else 0.0,
        "mean_batch_size_by_lane": {
            lane: round(sum(sizes) / len(sizes), 2)
            if (sizes := [s.batch_size or 0 for s in ok if s.lane == lane])
            else 0.0
            for lane in ("urgent", "normal")
        },
    }


async def bench(args: argparse.Namespace, image: bytes) -> dict[str, Any]:
    body = json.dumps({"image_base64": base64.b64encode(image).decode(), "top_k": 1}).encode()
    path = f"/v1/models/{args.model}/predict" if args.model else "/predict"
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=max(args.concurrency, 64) if args.rate is None else 1000)
    run = Run()
    async with httpx.AsyncClient(base_url=args.url, limits=limits, timeout=args.timeout) as client:
        run.started = time.perf_counter()
        run.measured_from = run.started + args.warmup
        stop_at = run.measured_from + args.duration
        if args.rate is None:
            await closed_loop(
                client, path, body, args.concurrency, args.urgent_fraction, stop_at, args.requests, run, rng
            )
            mode: dict[str, Any] = {"mode": "closed", "concurrency": args.concurrency}
        else:
            await open_loop(client, path, body, args.rate, args.urgent_fraction, stop_at, args.requests, run, rng)
            mode = {"mode": "open", "rate_rps": args.rate}
        run.ended = min(time.perf_counter(), stop_at) if run.samples else time.perf_counter()
    return summarise(run, {**mode, "urgent_fraction": args.urgent_fraction, "warmup_s": args.warmup})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ai-backend bench", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a loopback URL of a running service")
    parser.add_argument("--model", help="target /v1/models/NAME/predict instead of /predict")
    parser.add_argument("--image", default=str(DEFAULT_IMAGE), help="the image every request sends")
    loop = parser.add_mutually_exclusive_group()
    loop.add_argument("--concurrency", type=int, default=32, help="closed loop: clients in flight (default 32)")
    loop.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--urgent-fraction", type=float, default=0.0, help="share of requests with X-Urgency: high")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds, after the warm-up (max 600)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds sent but not counted")
    parser.add_argument("--requests", type=int, default=200_000, help="hard cap on requests sent")
    parser.add_argument("--timeout", type=float, default=60.0, help="per-request client timeout, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    if not is_loopback(args.url):
        parser.error("--url must point at a loopback address (127.0.0.0/8, ::1 or localhost)")
    if not 0 < args.duration <= 600 or args.warmup < 0 or not 0 <= args.urgent_fraction <= 1:
        parser.error("need 0 < duration <= 600, warmup >= 0 and 0 <= urgent-fraction <= 1")
    report = asyncio.run(bench(args, Path(args.image).read_bytes()))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
