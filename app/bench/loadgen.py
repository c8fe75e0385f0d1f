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

Exit status: 0; 1 when nothing answers at the URL, when no request sent in the measured window
succeeded (a run of errors is not a measurement), or when ``--out`` could not be written (the
report is printed first); 2 for arguments that are wrong or could not be bounded.
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
from app.bench.output import unwritable, write_text
from app.bench.threads import Scheduled, sched_report, thread_sched
from app.settings import ServerSettings

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
    lag_s: float | None = None  # open loop: how long after its scheduled arrival the client sent it

    @property
    def ok(self) -> bool:
        """A success: a 200 whose body is a JSON object (a 200 that is not has the code ``non_json``)."""
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


@dataclass(frozen=True)
class Target:
    """The service, from ``--url``: the host and port the URL names (the ``Host`` header says
    them) and the loopback address every connection goes to, resolved once."""

    host: str
    port: int
    address: str

    @property
    def authority(self) -> str:
        """``host:port`` for the ``Host`` header: never the URL's user information."""
        return f"{_bracketed(self.host)}:{self.port}"

    @property
    def base_url(self) -> str:
        """The URL of the resolved address, for httpx (which would otherwise resolve the name again)."""
        return f"http://{_bracketed(self.address)}:{self.port}"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_url(url: str) -> tuple[str, int]:
    """The host and port of ``url``, an ``http://HOST[:PORT]`` URL; ``ValueError`` says what is wrong."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a port that is not a number from 0 to 65535
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a URL ({exc})") from None
    if parts.scheme != "http":
        raise ValueError(f"{url!r}: only http:// is supported")
    if not parts.hostname:
        raise ValueError(f"{url!r} names no host")
    if port == 0:
        raise ValueError(f"{url!r}: port 0 cannot be connected to")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r}: give the server only (http://HOST[:PORT]); the paths are the service's own")
    return parts.hostname, port or 80


def loopback_addresses(host: str) -> list[str]:
    """Every address ``host`` resolves to, all of them loopback ones, else ``ValueError``. A name
    is resolved, not trusted: ``/etc/hosts`` may send ``localhost`` off the machine."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"{host} does not resolve: {exc}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    elsewhere = [a for a in addresses if not ipaddress.ip_address(a.partition("%")[0]).is_loopback]
    if elsewhere or not addresses:
        raise ValueError(f"{host} resolves to {', '.join(elsewhere or ['nothing'])}, not a loopback address")
    return addresses


def is_loopback(url: str) -> bool:
    """Whether every address ``url``'s host resolves to is a loopback one."""
    try:
        return bool(loopback_addresses(urlsplit(url).hostname or ""))
    except ValueError:
        return False


def reachable(addresses: Sequence[str], port: int, timeout_s: float = 5.0) -> tuple[str | None, str]:
    """The first of ``addresses`` where something listens on ``port``, or None and why not. Checked
    before a run: against a closed port every request fails at once, and the clients spin through
    tens of thousands of refused connections a second. ``localhost`` may resolve to ``::1`` and
    ``127.0.0.1`` with the server on one only: the run then sends to that one."""
    why = "no address"
    for address in addresses:
        try:
            with socket.create_connection((address, port), timeout=timeout_s):
                return address, ""
        except OSError as exc:
            why = f"{exc.strerror or exc}"
    return None, why


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (sorted or not): the smallest value with at
    least ``q`` percent of them at or below it; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = math.ceil(round(q / 100 * len(ordered), 9))  # rounded: 0.07 * 100 is 7.000000000000001
    return ordered[max(1, min(len(ordered), rank)) - 1]


def _outcome(status: int, body: bytes) -> tuple[str | None, dict[str, Any]]:
    """An answer's error code (None: a success) and its JSON object. An answer that is not a JSON
    object (a proxy's, a balancer's, a broken server's) keeps its status, with the code
    ``non_json``: a 200 too, which is then a failed request the server answered, not the client's."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return "non_json", {}
    return (None if status == 200 else str(payload.get("code"))), payload


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


LAG_WARNING_MS = 5.0  # open loop: a p99 send lag above this is the client's own delay, not the server's


def schedule_report(run: Run) -> dict[str, Any]:
    """Open loop: how late the client sent against its schedule (actual - scheduled send time,
    over the requests scheduled in the window), and the rate it really offered in the window
    (requests it sent in it, by the time it sent them). Latency counts from the scheduled
    arrival, so when the client falls behind (its own CPU the bottleneck) the lag is charged to
    the server as latency: these two say when that happened."""
    lags = [s.lag_s * 1000 for s in run.samples if s.counted and s.lag_s is not None]
    sent = sum(1 for s in run.samples if s.lag_s is not None and run.measured_from <= s.sent_at <= run.ended)
    return {
        "send_lag_ms": {
            "p50": round(percentile(lags, 50), 3),
            "p99": round(percentile(lags, 99), 3),
            "max": round(max(lags, default=0.0), 3),
        },
        "offered_rps": round(sent / max(1e-9, run.ended - run.measured_from), 2),
    }


def behind_schedule(report: dict[str, Any]) -> str | None:
    """A warning line when an open-loop client sent late enough to distort the latencies, else None."""
    lag = report.get("send_lag_ms")
    if lag is None or lag["p99"] <= LAG_WARNING_MS:
        return None
    return (
        f"warning: the client fell behind its schedule (send lag p50 {lag['p50']:g}, p99 {lag['p99']:g}, "
        f"max {lag['max']:g} ms; offered {report['offered_rps']:g} of {report.get('rate_rps', '?')} requests/s): "
        "latency counts from the scheduled send, so the client's own lag reads as the server's latency"
    )


def summarise(run: Run, settings: dict[str, Any], deadline_ms: float | None = None) -> dict[str, Any]:
    """The report: throughput, latency percentiles per lane (answers, and 503 refusals),
    errors, mean batch size, answers later than their deadline, the server's memory, and in
    open loop how far the client fell behind its schedule."""
    counted = [s for s in run.samples if s.counted]
    ok = [s for s in counted if s.ok]
    refused = [s for s in counted if s.status == 503]
    window = max(1e-9, run.ended - run.measured_from)
    # answers that came inside the window, whenever sent: what the server got through in it
    answered = sum(1 for s in run.samples if s.ok and run.measured_from <= s.finished <= run.ended)

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
    if any(s.lag_s is not None for s in run.samples):
        extra.update(schedule_report(run))
    return {
        **settings,
        "measured_s": round(window, 3),
        "sent_with_warmup": run.sent,
        "sent_in_window": len(counted),
        "ok": len(ok),
        "throughput_rps": round(answered / window, 2),
        "latency": {
            "all": latencies(ok),
            "urgent": latencies([s for s in ok if s.lane == "urgent"]),
            "normal": latencies([s for s in ok if s.lane == "normal"]),
            "refused": latencies(refused),
        },
        "errors": dict(Counter(f"{s.status}:{s.code}" for s in counted if not s.ok)),
        "mean_batch_size": mean_batch(ok),
        # by the lane each request asked for: a normal request that rode an urgent batch counts
        # that batch's size under normal (the answer does not say which lane its batch ran in);
        # null for a lane no answer came in (0.0 read as batches of nothing)
        "mean_batch_size_by_request_lane": {
            lane: mean_batch(in_lane) if (in_lane := [s for s in ok if s.lane == lane]) else None
            for lane in ("urgent", "normal")
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
    target: Target, path: str, bodies: Sequence[bytes], timeout: float, deadline_ms: float | None = None
) -> tuple[Send, rawhttp.Pool]:
    """A ``Send`` over a pool of raw keep-alive connections, every request's bytes built now."""
    requests = {
        (index, urgent): rawhttp.build_request("POST", target.authority, path, _headers(urgent, deadline_ms), body)
        for index, body in enumerate(bodies)
        for urgent in (False, True)
    }
    pool = rawhttp.Pool(target.address, target.port)

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        async with asyncio.timeout(timeout):
            head, body = await pool.request(requests[number % len(bodies), urgent])
        return head.status, body

    return send, pool


def httpx_sender(
    client: httpx.AsyncClient, path: str, bodies: Sequence[bytes], timeout: float, deadline_ms: float | None = None
) -> Send:
    """A ``Send`` through httpx, each request bounded by ``timeout`` as a whole: httpx's own
    timeout bounds each read, and a server sending a byte now and then never trips it."""

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        async with asyncio.timeout(timeout):
            response = await client.post(
                path, content=bodies[number % len(bodies)], headers=_headers(urgent, deadline_ms)
            )
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
    target: Target = args.target
    if args.client == "raw":
        send, pool = raw_sender(target, path, bodies, args.timeout, args.deadline_ms)
        try:
            mode = await _drive(send, args, run)
        finally:
            pool.close()
        mode["connections"] = pool.size
        mode["retried"] = pool.retried
    else:
        limits = httpx.Limits(max_connections=max(args.concurrency, 64) if args.rate is None else 1000)
        # trust_env=False: a proxy in the environment would take the load off loopback; the
        # resolved address, so that the name is not resolved again, and the URL's Host header
        async with httpx.AsyncClient(
            base_url=target.base_url,
            headers={"Host": target.authority},
            limits=limits,
            timeout=args.timeout,
            trust_env=False,
        ) as client:
            mode = await _drive(httpx_sender(client, path, bodies, args.timeout, args.deadline_ms), args, run)
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


# what a service on its default settings accepts; one may be set to take more (server.max_timeout_ms)
MAX_DEADLINE_MS: int = ServerSettings.model_fields["max_timeout_ms"].default


def _deadline_accepted(deadline_ms: float) -> bool:
    """Whether ``deadline_ms`` can be sent (rounded to whole milliseconds): finite and at least
    one; the service answers 400 to a value under 1, to every request."""
    return math.isfinite(deadline_ms) and round(deadline_ms) >= 1


def _report(report: dict[str, Any], out: Path | None) -> int:
    """Print the report (then a warning if the client fell behind its schedule) and write it to
    ``out``. 1 when no request in the window succeeded or the file could not be written."""
    text = json.dumps(report, indent=2)
    print(text)
    if (warning := behind_schedule(report)) is not None:
        print(f"ai-backend bench: {warning}", file=sys.stderr)
    code = 0
    if not report["ok"]:
        errors = ", ".join(f"{key} x{count}" for key, count in report["errors"].items()) or "none sent"
        print(f"ai-backend bench: no request in the measured window succeeded ({errors})", file=sys.stderr)
        code = 1
    if out is not None and (why := write_text(out, text + "\n")) is not None:
        print(f"ai-backend bench: could not write {out}: {why}", file=sys.stderr)
        code = 1
    return code


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
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    try:
        host, port = parse_url(args.url)
    except ValueError as exc:
        parser.error(f"--url {exc}")
    try:
        addresses = loopback_addresses(host)
    except ValueError as exc:
        parser.error(f"--url must point at a loopback address (127.0.0.0/8, ::1 or localhost): {exc}")
    if not 0 < args.duration <= 600 or not 0 <= args.warmup <= 600 or not 0 <= args.urgent_fraction <= 1:
        parser.error("need 0 < duration <= 600, 0 <= warmup <= 600 and 0 <= urgent-fraction <= 1")
    if args.rate is not None and not 0 < args.rate <= 100_000:
        parser.error("need 0 < rate <= 100000 arrivals a second")
    if args.concurrency < 1 or args.requests < 1 or not 0 < args.timeout <= 600:
        parser.error("need concurrency >= 1, requests >= 1 and 0 < timeout <= 600")
    if args.deadline_ms is not None and not _deadline_accepted(args.deadline_ms):
        parser.error("need a finite --deadline-ms of at least 1 (as the service's X-Request-Timeout)")
    if args.deadline_ms is not None and round(args.deadline_ms) > MAX_DEADLINE_MS:
        print(
            f"ai-backend bench: warning: --deadline-ms {args.deadline_ms:g} is over {MAX_DEADLINE_MS}, "
            "server.max_timeout_ms by default: a service not set to take it answers 400 to every request",
            file=sys.stderr,
        )
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}/stat").exists():
        parser.error(f"--server-pid {args.server_pid}: no such process (or no /proc)")
    if args.out is not None and (why := unwritable(args.out)) is not None:
        parser.error(f"--out {args.out}: {why}")
    try:
        images = load_images(Path(args.image), args.images)
    except OSError as exc:
        parser.error(str(exc))
    address, why = reachable(addresses, port)
    if address is None:
        print(f"ai-backend bench: nothing answers at {args.url}: {why}", file=sys.stderr)
        return 1
    args.target = Target(host, port, address)
    return _report(event_loop_run(bench(args, images)), args.out)


if __name__ == "__main__":
    sys.exit(main())
