"""``ai-backend bench --server-metrics``: the server's event-loop lag over the measured window, read
from two scrapes of the real metrics registry (``app.telemetry.metrics``, the real Prometheus client)."""

from __future__ import annotations

import asyncio
import math
import socket
import ssl
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from app.bench.loadgen import scrape
from app.bench.loadgen.scrape import LagHistogram, lag_line, lag_report, parse_lag, scrape_lag
from app.bench.loadgen.summary import percentile
from app.bench.loadgen.target import Target
from app.telemetry.metrics import LOOP_LAG_BUCKETS, Metrics
from tests.unit.test_loadgen import serving


def scraped(metrics: Metrics) -> LagHistogram:
    histogram = parse_lag(generate_latest(metrics.registry).decode())
    assert histogram is not None
    return histogram


def test_only_the_samples_between_the_scrapes_count() -> None:
    metrics = Metrics()
    for lag in (0.0004, 0.0004, 2.0):  # before the window: a stall the report must not show
        metrics.loop_lag.observe(lag)
    before = scraped(metrics)
    for lag in (0.0003, 0.002, 0.3, 3.0):
        metrics.loop_lag.observe(lag)
    report = lag_report(before, scraped(metrics))
    assert report == {
        "samples": 4,
        "mean_ms": round((0.0003 + 0.002 + 0.3 + 3.0) / 4 * 1000, 3),
        "p99_at_most_ms": 5000.0,
        "max_at_most_ms": 5000.0,
        "over_250ms": 2,
    }


def test_a_quiet_window_reads_its_samples_under_the_first_bounds() -> None:
    metrics = Metrics()
    before = scraped(metrics)
    for _ in range(99):
        metrics.loop_lag.observe(0.0005)
    metrics.loop_lag.observe(0.02)
    report = lag_report(before, scraped(metrics))
    assert report is not None
    assert report["samples"] == 100 and report["over_250ms"] == 0
    assert report["p99_at_most_ms"] == 1.0 and report["max_at_most_ms"] == 25.0


def test_a_lag_past_the_last_bound_has_no_upper_figure() -> None:
    metrics = Metrics()
    before = scraped(metrics)
    metrics.loop_lag.observe(7.0)
    report = lag_report(before, scraped(metrics))
    assert report is not None and report["max_at_most_ms"] is None and report["over_250ms"] == 1


def test_no_samples_and_no_match_are_told_apart() -> None:
    metrics = Metrics()
    same = scraped(metrics)
    assert lag_report(same, same) == {"samples": 0}
    metrics.loop_lag.observe(0.1)
    later = scraped(metrics)
    assert lag_report(later, scraped(Metrics())) is None  # counts went back: the server restarted
    other = LagHistogram(((0.5, 1.0), (math.inf, 1.0)), 1.0, 0.1)
    assert lag_report(other, later) is None  # other buckets


def test_what_is_not_the_histogram_reads_as_none() -> None:
    assert parse_lag('{"code": "not_found"}') is None
    assert parse_lag("<html><body>metrics</body></html>") is None
    assert parse_lag("# TYPE other_seconds histogram\nother_seconds_count 1.0\n") is None
    assert parse_lag("") is None


@given(
    before=st.lists(st.floats(0, 10), max_size=20),
    window=st.lists(st.floats(0, 10), min_size=1, max_size=200),
)
def test_the_report_bounds_what_the_window_held(before: list[float], window: list[float]) -> None:
    metrics = Metrics()
    for lag in before:
        metrics.loop_lag.observe(lag)
    first = scraped(metrics)
    for lag in window:
        metrics.loop_lag.observe(lag)
    report = lag_report(first, scraped(metrics))
    assert report is not None and report["samples"] == len(window)
    assert math.isclose(report["mean_ms"], sum(window) / len(window) * 1000, abs_tol=1e-3)
    assert report["over_250ms"] == sum(1 for lag in window if lag > 0.25)

    def tightest(value: float) -> float | None:  # the smallest bucket bound at or over value, in ms
        return next((round(b * 1000, 3) for b in LOOP_LAG_BUCKETS if value <= b), None)

    assert report["max_at_most_ms"] == tightest(max(window))
    assert report["p99_at_most_ms"] == tightest(percentile(window, 99))


def test_a_broken_exposition_reads_as_none() -> None:
    head = "# TYPE ai_backend_event_loop_lag_seconds histogram\n"
    tail = "ai_backend_event_loop_lag_seconds_count 1.0\nai_backend_event_loop_lag_seconds_sum 0.1\n"
    for buckets in (
        'ai_backend_event_loop_lag_seconds_bucket{le="x"} 1.0\n',  # a bound that is no number
        "ai_backend_event_loop_lag_seconds_bucket 1.0\n",  # no bound at all
        'ai_backend_event_loop_lag_seconds_bucket{le="0.5"} 1.0\n',  # no +Inf bucket
    ):
        assert parse_lag(head + buckets + tail) is None, buckets


def test_a_restart_between_the_scrapes_is_no_report_even_when_the_count_grew() -> None:
    first = Metrics()
    for _ in range(5):
        first.loop_lag.observe(0.5)
    second = Metrics()  # the restarted server: more samples by now, but none of the long ones
    for _ in range(9):
        second.loop_lag.observe(0.0001)
    assert lag_report(scraped(first), scraped(second)) is None


def test_the_late_count_needs_its_bound_among_the_buckets() -> None:
    def histogram(count: float) -> LagHistogram:
        return LagHistogram(((0.1, count), (0.5, count), (math.inf, count)), count, count * 0.01)

    report = lag_report(histogram(0), histogram(4))
    assert report is not None and report["samples"] == 4 and report["over_250ms"] is None
    assert "**?** over 250 ms" in lag_line(report)
    assert "do not line up" in lag_line(None) and "no lag samples" in lag_line({"samples": 0})


def _exposition() -> bytes:
    metrics = Metrics()
    metrics.loop_lag.observe(0.003)
    return generate_latest(metrics.registry)


def _chunked(body: bytes) -> bytes:
    half = len(body) // 2
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:half], body[half:])) + b"0\r\n\r\n"


@pytest.mark.parametrize("chunked", [False, True])
async def test_the_scrape_reads_the_histogram_over_loopback_without_any_tls_set_up(
    chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scrape runs on the load's event loop at the window's start: an httpx client built
    there took 128 ms (its TLS context) while the requests due were sent that late."""

    def no_tls(*args: object, **kwargs: object) -> ssl.SSLContext:
        raise AssertionError("a TLS context was built for a plain loopback scrape")

    monkeypatch.setattr(ssl, "create_default_context", no_tls)
    exposition = _exposition()
    framing = (
        b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(exposition)
        if chunked
        else (b"Content-Length: %d\r\n\r\n" % len(exposition) + exposition)
    )
    asked: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\n" + framing)
        await writer.drain()
        writer.close()

    async with serving(handle) as port:
        histogram = await asyncio.wait_for(scrape_lag(Target("localhost", port, "127.0.0.1")), 10)
    assert histogram is not None and histogram.count == 1
    assert asked[0].startswith(b"GET /metrics HTTP/1.1\r\n") and f"Host: localhost:{port}".encode() in asked[0]


NOT_THE_HISTOGRAM = {
    "404": b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n",
    "garbage": b"garbage\r\n\r\n",
    "status digit int() refuses": "HTTP/1.1 2\u00b20 OK\r\nContent-Length: 0\r\n\r\n".encode("latin-1"),
    "length digit int() refuses": "HTTP/1.1 200 OK\r\nContent-Length: \u00b9\r\n\r\nx".encode("latin-1"),
    "a chunk line past the limit": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 70_000 + b"\r\n",
    "closed mid-body": b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n# HELP",
    "silent": b"",
    "reset": b"reset",
}


@pytest.mark.parametrize("answer", NOT_THE_HISTOGRAM.values(), ids=NOT_THE_HISTOGRAM.keys())
async def test_a_scrape_that_gets_no_histogram_reads_as_none(answer: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """None, never an exception: the scrape at the window's end comes after the whole run."""
    monkeypatch.setattr(scrape, "SCRAPE_TIMEOUT_S", 0.2)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if answer == b"reset":  # closed with an RST, not a FIN
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif answer == b"":  # silent until the scrape, past its timeout, hangs up
            await reader.read()
        else:
            writer.write(answer)
            await writer.drain()
        writer.close()

    async with serving(handle) as port:
        assert await asyncio.wait_for(scrape_lag(Target("127.0.0.1", port, "127.0.0.1")), 10) is None


async def test_a_scrape_of_a_port_where_nothing_listens_reads_as_none() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed_port = unused.getsockname()[1]
    assert await asyncio.wait_for(scrape_lag(Target("127.0.0.1", closed_port, "127.0.0.1")), 10) is None
