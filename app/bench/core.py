"""``ai-backend core``: the service's own throughput with no HTTP in front of it.

Between the limit (each stage timed on one core while the others idle) and the service over
HTTP stand two steps, and the ratio report measures both so that each loss is read apart:

- the machine with every core at once and no serving layer (``limit.every_core.measure_every_core``);
- the service itself (admission, the decode pool, the batcher, the device threads, the
  labelling) in this process, fed by N coroutines that hand it the base64 text a JSON body
  carries, on the settings ``ai-backend serve`` would read (``AI_SERVICE_*``, config/).

What the service over HTTP loses against this one is what HTTP, JSON, the middleware and the
access log cost; what this one loses against every core at once is the service's own
coordination. Bounded by time and by a request count; plain (normal lane) traffic, as the
headline ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.batching.policy import Lane
from app.bench.loadgen.drive import event_loop_run
from app.bench.loadgen.senders import load_images
from app.bench.output import unwritable, write_text
from app.bench.threads import group_name, thread_cpu, threads_text
from app.errors import ServiceError
from app.prediction import Outcome
from app.service import InferenceService
from app.settings import Settings, SettingsError, load_settings

READY_TIMEOUT_S = 300.0


@dataclass
class Tally:
    """What the clients saw while counting: answers, their batch sizes, errors by code."""

    counting: bool = False
    answered: int = 0
    batch_images: int = 0
    errors: Counter[str] = field(default_factory=Counter)


async def predict_plain(service: InferenceService, payload: str, request_id: str) -> Outcome:
    """One plain (normal lane, top 1) prediction of the default model, under the deadline a
    request without ``X-Request-Timeout`` gets: the same steps as the route, with no HTTP."""
    timeout_s = service.settings.server.default_timeout_ms / 1000
    served = service.served(None)
    seat = service.reserve(served, Lane.NORMAL, timeout_s)
    try:
        return await service.predict(served, payload, 1, Lane.NORMAL, timeout_s, request_id, seat)
    finally:
        seat.release()


async def _client(service: InferenceService, payloads: Sequence[str], first: int, step: int, tally: Tally) -> None:
    """One caller in a closed loop: the next image as soon as the last one is answered."""
    index = first
    while True:
        payload = payloads[index % len(payloads)]
        index += step
        try:
            outcome = await predict_plain(service, payload, "core")
        except ServiceError as exc:
            if tally.counting:
                tally.errors[exc.code] += 1
            await asyncio.sleep(0.01)  # a refusal (queue full, draining) is not retried in a spin
            continue
        if tally.counting:
            tally.answered += 1
            tally.batch_images += outcome.batch_size


def _thread_groups(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per thread group between two reads of this process's threads (the main
    thread, which runs the event loop, as ``event loop``)."""
    groups: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        group = "event loop" if tid == os.getpid() else group_name(name)
        groups[group] = groups.get(group, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    return groups


async def drive(
    service: InferenceService, payloads: Sequence[str], concurrency: int, seconds: float, warmup_s: float
) -> dict[str, Any]:
    """Run ``concurrency`` closed-loop clients against a started service; count ``seconds`` after ``warmup_s``."""
    tally = Tally()
    clients = [
        asyncio.create_task(_client(service, payloads, n, concurrency, tally), name=f"core-client-{n}")
        for n in range(concurrency)
    ]
    try:
        await asyncio.sleep(warmup_s)
        threads_before, cpu_before, started = thread_cpu(os.getpid()), time.process_time(), time.perf_counter()
        tally.counting = True
        await asyncio.sleep(seconds)
        tally.counting = False
        elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu_before
        groups = _thread_groups(threads_before, thread_cpu(os.getpid()))
    finally:
        for client in clients:
            client.cancel()
        ended = await asyncio.gather(*clients, return_exceptions=True)
    # a client that died of anything but a refusal is a bug, not a slower service
    if failure := next((e for e in ended if isinstance(e, Exception)), None):
        raise RuntimeError("a client of the service failed") from failure
    answered = tally.answered
    return {
        "concurrency": concurrency,
        "seconds": round(elapsed, 3),
        "requests": answered,
        "throughput_rps": round(answered / elapsed, 1),
        "mean_batch_size": round(tally.batch_images / answered, 2) if answered else 0.0,
        "errors": dict(tally.errors),
        "cpu": {
            "cores": round(cpu_s / elapsed, 3),
            "ms_per_request": round(cpu_s * 1000 / answered, 4) if answered else None,
            # /proc counts in clock ticks: groups under a tick per second of the window are noise
            "threads_ms_per_request": {
                name: round(cpu * 1000 / answered, 4)
                for name, cpu in sorted(groups.items(), key=lambda item: -item[1])
                if answered and cpu >= elapsed / 100
            },
        },
    }


async def measure(
    settings: Settings, images: Sequence[bytes], concurrency: int, seconds: float, warmup_s: float
) -> dict[str, Any]:
    """Start the service on ``settings``, drive it, close it; the report of ``drive``."""
    payloads = [base64.b64encode(image).decode("ascii") for image in images]
    service = InferenceService(settings)
    try:
        await asyncio.wait_for(service.start(), READY_TIMEOUT_S)
        report = await drive(service, payloads, concurrency, seconds, warmup_s)
    finally:
        await service.close(settings.server.shutdown_grace_s)
    report["model"] = service.default_model
    report["warmup_s"] = warmup_s
    return report


def markdown(report: dict[str, Any]) -> str:
    """One line: what the service did with no HTTP in front of it."""
    errors = f"; errors {report['errors']}" if report["errors"] else ""
    return (
        f"service with no HTTP ({report['concurrency']} clients in process): {report['throughput_rps']:.1f} "
        f"requests/s, mean batch {report['mean_batch_size']:.1f}, {report['cpu']['cores']:.2f} cores, "
        f"{report['cpu']['ms_per_request'] or 0:.3f} ms CPU per request ({threads_text(report)}){errors}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ai-backend core", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=Path, required=True, help="a folder of JPEG, PNG or WebP images")
    parser.add_argument("--concurrency", type=int, default=128, help="clients in flight (default 128)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds, after the warm-up (max 600)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds run but not counted")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 600 or args.warmup < 0 or not 1 <= args.concurrency <= 4096:
        parser.error("need 0 < seconds <= 600, warmup >= 0 and 1 <= concurrency <= 4096")
    if args.out is not None and (why := unwritable(args.out)) is not None:  # before the run, not after it
        parser.error(f"--out {args.out}: {why}")
    try:
        images = load_images(args.images, args.images)
    except OSError as exc:
        parser.error(str(exc))
    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"ai-backend core: {exc}", file=sys.stderr)
        return 2
    try:
        report = event_loop_run(measure(settings, images, args.concurrency, args.seconds, args.warmup))
    except (OSError, RuntimeError, ValueError) as exc:  # a missing repository, a model that cannot load
        print(f"ai-backend core: {exc}", file=sys.stderr)
        return 1
    print(markdown(report), file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out and (why := write_text(args.out, text + "\n")) is not None:
        print(f"ai-backend core: could not write {args.out}: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
