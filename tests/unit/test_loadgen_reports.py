"""What ``ai-backend bench`` reports: the figures a reader of the README trusts.

Percentiles by nearest rank, throughput as answers inside the window, every request sent
accounted for, latency from the scheduled arrival in open loop, errors by their real status,
the mean batch per batch, bounded arguments, and no proxy between the client and loopback.
"""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest

from app.bench import loadgen
from tests.unit.test_loadgen import bench_args, http_server, json_answer


@pytest.mark.parametrize(("n", "q"), [(100, 99), (10, 50), (10, 90), (200, 99), (4, 50), (1000, 99), (7, 50), (100, 7)])
def test_percentile_is_the_nearest_rank(n: int, q: float) -> None:
    values = [float(v) for v in range(n, 0, -1)]  # unsorted
    assert loadgen.percentile(values, q) == float(max(1, math.ceil(q * n / 100)))


def test_one_stall_in_a_hundred_answers_is_not_the_p99() -> None:
    assert loadgen.percentile([1.0] * 99 + [5000.0], 99) == 1.0
    assert loadgen.percentile([1.0] * 98 + [5000.0] * 2, 99) == 5000.0


async def test_open_loop_throughput_is_what_the_server_answered_not_what_was_offered() -> None:
    server = asyncio.Semaphore(1)  # answers one request at a time, in 10 ms: 100 a second at most

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        async with server:
            await asyncio.sleep(0.010)
        return 200, b'{"batch_size": 1}'

    run = loadgen.Run()
    await loadgen._drive(send, bench_args(rate=400.0, duration=0.3, warmup=0.0, urgent_fraction=0.0), run)
    report = loadgen.summarise(run, {})
    assert report["sent"] > 80, "about 120 offered"
    assert report["throughput_rps"] <= 110, report["throughput_rps"]


async def test_open_loop_accounts_for_every_request_it_sent() -> None:
    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        await asyncio.sleep(0.001 if number % 2 else 30.0)  # half never answer in time
        return 200, b'{"batch_size": 1}'

    run = loadgen.Run()
    stop_at = time.perf_counter() + 0.2
    await loadgen.open_loop(send, 100.0, 0.0, stop_at, 10_000, run, random.Random(0), timeout_s=0.05)
    assert run.sent > 5
    assert len(run.samples) == run.sent, "each request sent has a sample"
    unanswered = [s for s in run.samples if s.code == "unanswered"]
    assert unanswered and all(s.status == 0 for s in unanswered)
    assert loadgen.summarise(run, {})["errors"]["0:unanswered"] == len(unanswered)


async def test_open_loop_latency_counts_from_the_scheduled_arrival() -> None:
    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        await asyncio.sleep(0.002)
        return 200, b'{"batch_size": 1}'

    async def stall() -> None:
        await asyncio.sleep(0.1)
        time.sleep(0.3)  # noqa: ASYNC251 (the point: the client's loop gets no CPU for 300 ms, as on a busy machine)

    run = loadgen.Run()
    staller = asyncio.create_task(stall())
    await loadgen.open_loop(send, 200.0, 0.0, time.perf_counter() + 0.6, 10_000, run, random.Random(1))
    await staller
    late = [s for s in run.samples if s.latency_s > 0.05]
    # about 60 arrivals (200/s for 0.3 s) fell due during the stall and waited up to 300 ms
    assert len(late) >= 20, f"only {len(late)} of {len(run.samples)} show the stall"


@pytest.mark.parametrize(
    "extra",
    [
        ["--rate", "0"],
        ["--rate", "-50"],
        ["--rate", "1e9"],
        ["--warmup", "1e9"],
        ["--concurrency", "0"],
        ["--requests", "0"],
        ["--timeout", "0"],
    ],
)
def test_the_cli_refuses_what_would_not_be_bounded(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--url", "http://127.0.0.1:9", "--duration", "0.2", *extra]
    with pytest.raises(SystemExit) as exited:
        loadgen.main(argv)
    assert exited.value.code == 2 and "need" in capsys.readouterr().err


async def test_an_error_answer_that_is_not_json_keeps_its_status() -> None:
    def respond(n: int, body: bytes) -> bytes:
        if n % 2:
            text = b"Service Unavailable"
            head = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n"
            return head % len(text) + text
        return json_answer({"batch_size": 1})

    async with http_server(respond) as (port, _):
        report = await loadgen.bench(bench_args(url=f"http://127.0.0.1:{port}", server_pid=None), [b"x"])
    assert set(report["errors"]) == {"503:non_json"}, report["errors"]
    assert report["latency"]["refused"]["count"] == report["errors"]["503:non_json"]


def test_a_200_that_is_not_json_is_a_failed_request() -> None:
    with pytest.raises(ValueError):
        loadgen._payload(200, b"<html>")


def test_the_mean_batch_size_is_per_batch() -> None:
    # one batch of 1 and one of 3: four answers, two batches, a mean batch of 2 (what the
    # dashboard's ai_backend_batch_size sum / count says)
    run = loadgen.Run(measured_from=0.0, ended=1.0)
    run.samples += [loadgen.Sample("normal", 0.01, 200, None, 1, True, finished=0.5)]
    run.samples += [loadgen.Sample("normal", 0.01, 200, None, 3, True, finished=0.5)] * 3
    report = loadgen.summarise(run, {})
    assert report["mean_batch_size"] == 2.0 and report["mean_batch_size_by_lane"]["normal"] == 2.0
    assert report["throughput_rps"] == 4.0


async def test_the_httpx_client_never_goes_through_a_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # the "proxy" is on loopback too: nothing leaves the machine whatever happens
    answer = json_answer({"batch_size": 1})
    async with (
        http_server(lambda n, _: answer) as (target, target_seen),
        http_server(lambda n, _: answer) as (proxy, proxy_seen),
    ):
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, f"http://127.0.0.1:{proxy}")
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        args = bench_args(url=f"http://127.0.0.1:{target}", client="httpx", duration=0.2, server_pid=None)
        await loadgen.bench(args, [b"x"])
    assert sum(proxy_seen) == 0 and sum(target_seen) > 0


def test_latency_histograms_reach_the_longest_deadline_a_request_may_ask_for() -> None:
    from app.settings import ServerSettings
    from app.telemetry.metrics import LATENCY_BUCKETS

    longest = ServerSettings.model_fields["max_timeout_ms"].default / 1000
    assert max(LATENCY_BUCKETS) >= longest, "answers at a long deadline would all read as the top bucket"
