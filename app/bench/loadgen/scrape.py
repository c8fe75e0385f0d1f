"""The server's own account of its event loop over a run: the histogram
``ai_backend_event_loop_lag_seconds`` (``app.telemetry.loop_lag``), scraped from ``/metrics`` at the
measured window's two ends and read as the difference.

A stall on the server's event loop (a three-second one spoiled a latency run in the thirty-second
pass) shows here as samples late by hundreds of milliseconds; starved decode or device threads do
not (their stages are long, the loop's lag short). A server without that metric (another server)
leaves it out of the report; ours with ``telemetry.loop_lag_interval_ms=0`` reports no samples.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from app.bench.loadgen.target import Target
from app.bench.rawhttp import Connection, HttpProtocolError, build_request
from app.settings import TelemetrySettings

LAG_METRIC = "ai_backend_event_loop_lag_seconds"
# a lag the server logs as a warning, on its default settings (telemetry.loop_lag_warn_ms)
LATE_S: float = TelemetrySettings.model_fields["loop_lag_warn_ms"].default / 1000
SCRAPE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class LagHistogram:
    """One scrape of the histogram: cumulative counts by upper bound (seconds, ascending, the
    last one infinite), the count and the sum of the lags."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum_s: float


def parse_lag(text: str) -> LagHistogram | None:
    """The lag histogram in a Prometheus text exposition, None where there is none (or it is malformed:
    a bucket without a bound, a last bound that is not +Inf)."""
    try:
        for family in text_string_to_metric_families(text):
            if family.name != LAG_METRIC or family.type != "histogram":
                continue
            buckets: list[tuple[float, float]] = []
            count = sum_s = None
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets.append((float(sample.labels["le"]), sample.value))
                elif sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    sum_s = sample.value
            buckets.sort()
            if buckets and math.isinf(buckets[-1][0]) and count is not None and sum_s is not None:
                return LagHistogram(tuple(buckets), count, sum_s)
            return None
    except (ValueError, KeyError):  # not an exposition (a 200 from something else at /metrics), or a broken one
        return None
    return None


async def scrape_lag(target: Target) -> LagHistogram | None:
    """GET ``/metrics`` on the target (loopback, a short timeout) and read the lag histogram;
    None when it cannot be had: no such route, no such metric, no answer in time.

    Over the load's own raw connection (``app.bench.rawhttp``), not an httpx client: building one
    on the load's event loop took 128 ms the first time and 17-24 ms after (its TLS set-up,
    synchronous). At the window's start the requests due meanwhile were sent that late, and their
    lag read as the server's."""
    connection = Connection(target.address, target.port)
    try:
        async with asyncio.timeout(SCRAPE_TIMEOUT_S):
            head, body = await connection.request(build_request("GET", target.authority, "/metrics", {}))
    except (OSError, EOFError, TimeoutError, HttpProtocolError):  # refused, closed, silent, garbled
        return None
    finally:
        connection.close()
    return parse_lag(body.decode("utf-8", "replace")) if head.status == 200 else None


def _bound_ms(bound_s: float) -> float | None:
    return None if math.isinf(bound_s) else round(bound_s * 1000, 3)


def lag_report(before: LagHistogram, after: LagHistogram) -> dict[str, Any] | None:
    """What the loop's samples taken between the two scrapes say: how many, their mean, the
    bucket bounds their 99th percentile and their maximum fall under (None: over the last finite
    bound), and how many were late by more than ``LATE_S`` (None unless it is a bucket's bound).
    None when the two do not line up: other buckets, or any count that went back (the server
    restarted between them)."""
    if [b for b, _ in before.buckets] != [b for b, _ in after.buckets]:
        return None
    within = [(bound, a - b) for (bound, a), (_, b) in zip(after.buckets, before.buckets, strict=True)]
    samples = after.count - before.count
    counts = [n for _, n in within]
    cumulative = all(a <= b for a, b in itertools.pairwise(counts))  # as a histogram's buckets are
    if samples < 0 or after.sum_s < before.sum_s or min(counts) < 0 or not cumulative or counts[-1] != samples:
        return None
    if samples == 0:
        return {"samples": 0}

    def bound_of(rank: float) -> float | None:
        return _bound_ms(next(bound for bound, n in within if n >= rank))  # the +Inf bucket holds them all

    at_late = next((n for bound, n in within if bound == LATE_S), None)
    return {
        "samples": int(samples),
        "mean_ms": round((after.sum_s - before.sum_s) / samples * 1000, 3),
        "p99_at_most_ms": bound_of(math.ceil(round(0.99 * samples, 9))),  # the nearest rank, as summary.percentile
        "max_at_most_ms": bound_of(samples),
        f"over_{int(LATE_S * 1000)}ms": None if at_late is None else int(samples - at_late),
    }


def lag_line(lag: dict[str, Any] | None) -> str:
    """One markdown line for a report's ``server_loop_lag`` (the benchmark scripts' summaries)."""
    if lag is None:
        return "- the server's event loop: its two scrapes do not line up (did it restart in the window?)"
    if not lag.get("samples"):
        return "- the server's event loop: no lag samples in the window (telemetry.loop_lag_interval_ms=0?)"

    def bound(ms: float | None) -> str:
        return f"<= {ms:g} ms" if ms is not None else "past the last bucket"

    over = int(LATE_S * 1000)
    late = lag[f"over_{over}ms"]
    return (
        f"- the server's event loop, {lag['samples']} lag samples: mean {lag['mean_ms']:.1f} ms, "
        f"p99 {bound(lag['p99_at_most_ms'])}, max {bound(lag['max_at_most_ms'])}, "
        f"**{'?' if late is None else late}** over {over} ms (a stalled loop shows here, starved threads do not)"
    )
