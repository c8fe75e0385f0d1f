"""What ``ai-backend bench`` reports: the figures a reader of the README trusts.

Percentiles by nearest rank, throughput as answers inside the window, every request sent
accounted for, latency from the scheduled arrival in open loop, errors by their real status,
the mean batch per batch, bounded arguments, and no proxy between the client and loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import random
import time
from pathlib import Path

import pytest

from app.bench.loadgen import cli, drive, loops, summary
from tests.unit.test_loadgen import Answering, bench_args, http_server, json_answer, serving, threaded_server


@pytest.mark.parametrize(("n", "q"), [(100, 99), (10, 50), (10, 90), (200, 99), (4, 50), (1000, 99), (7, 50), (100, 7)])
def test_percentile_is_the_nearest_rank(n: int, q: float) -> None:
    values = [float(v) for v in range(n, 0, -1)]  # unsorted
    assert summary.percentile(values, q) == float(max(1, math.ceil(q * n / 100)))


def test_one_stall_in_a_hundred_answers_is_not_the_p99() -> None:
    assert summary.percentile([1.0] * 99 + [5000.0], 99) == 1.0
    assert summary.percentile([1.0] * 98 + [5000.0] * 2, 99) == 5000.0


async def test_open_loop_throughput_is_what_the_server_answered_not_what_was_offered() -> None:
    server = asyncio.Semaphore(1)  # answers one request at a time, in 10 ms: 100 a second at most

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        async with server:
            await asyncio.sleep(0.010)
        return 200, b'{"batch_size": 1}'

    run = loops.Run()
    await drive._drive(send, bench_args(rate=400.0, duration=0.3, warmup=0.0, urgent_fraction=0.0), run)
    report = summary.summarise(run, {})
    assert report["sent_with_warmup"] > 80, "about 120 offered"
    assert report["throughput_rps"] <= 110, report["throughput_rps"]


async def test_an_open_loop_window_ends_at_its_end_not_at_the_last_answer() -> None:
    """At a low rate the last arrival may come well before the window's end: ended at its answer,
    the window was short and throughput and the rate offered overstated (5 arrivals in 3 s at 2
    a second read as 4.8 a second). A run the request cap ended first ends at its last answer."""

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        return 200, b'{"batch_size": 1}'

    run = loops.Run()
    # seed 3 at 8 a second: 5 arrivals in the first 0.26 s of the 0.5 s, then none
    await drive._drive(send, bench_args(rate=8.0, duration=0.5, warmup=0.0, seed=3, urgent_fraction=0.0), run)
    report = summary.summarise(run, {"rate_rps": 8.0})
    assert report["ok"] == 5 and report["measured_s"] == 0.5, report["measured_s"]
    assert report["throughput_rps"] == 10.0 and report["offered_rps"] == 10.0
    capped = loops.Run()
    await drive._drive(send, bench_args(rate=200.0, duration=60.0, warmup=0.0, requests=3), capped)
    assert summary.summarise(capped, {})["ok"] == 3 and capped.ended < capped.measured_from + 60


async def test_open_loop_accounts_for_every_request_it_sent() -> None:
    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        await asyncio.sleep(0.001 if number % 2 else 30.0)  # half never answer in time
        return 200, b'{"batch_size": 1}'

    run = loops.Run()
    stop_at = time.perf_counter() + 0.2
    await loops.open_loop(send, 100.0, 0.0, stop_at, 10_000, run, random.Random(0), timeout_s=0.05)
    assert run.sent > 5
    assert len(run.samples) == run.sent, "each request sent has a sample"
    unanswered = [s for s in run.samples if s.code == "unanswered"]
    assert unanswered and all(s.status == 0 for s in unanswered)
    assert summary.summarise(run, {})["errors"]["0:unanswered"] == len(unanswered)


async def test_open_loop_latency_counts_from_the_scheduled_arrival() -> None:
    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        await asyncio.sleep(0.002)
        return 200, b'{"batch_size": 1}'

    async def stall() -> None:
        await asyncio.sleep(0.1)
        time.sleep(0.3)  # noqa: ASYNC251 (the point: the client's loop gets no CPU for 300 ms, as on a busy machine)

    run = loops.Run()
    staller = asyncio.create_task(stall())
    await loops.open_loop(send, 200.0, 0.0, time.perf_counter() + 0.6, 10_000, run, random.Random(1))
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
        cli.main(argv)
    assert exited.value.code == 2 and "need" in capsys.readouterr().err


async def test_an_error_answer_that_is_not_json_keeps_its_status() -> None:
    def respond(n: int, body: bytes) -> bytes:
        if n % 2:
            text = b"Service Unavailable"
            head = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n"
            return head % len(text) + text
        return json_answer({"batch_size": 1})

    async with http_server(respond) as (port, _):
        report = await drive.bench(bench_args(url=f"http://127.0.0.1:{port}", server_pid=None), [b"x"])
    assert set(report["errors"]) == {"503:non_json"}, report["errors"]
    assert report["latency"]["refused"]["count"] == report["errors"]["503:non_json"]


def test_a_200_that_is_not_json_is_a_failed_request_of_its_status() -> None:
    """A server (or something in front of it) that answers 200 with a page: the request failed,
    and the server answered it, so the error keeps the status (it was ``0:ValueError``, read as
    the client's own failure); it is neither an answer, nor in the throughput, nor a batch."""
    assert loops._outcome(200, b"<html>") == ("non_json", {})
    assert loops._outcome(200, b"[1, 2]") == ("non_json", {}), "JSON, but not an object"
    assert loops._outcome(200, b'{"batch_size": 2}') == (None, {"batch_size": 2})
    run = loops.Run(measured_from=0.0, ended=1.0)
    run.samples += [loops.Sample("normal", 0.01, 200, "non_json", None, True, finished=0.5)] * 3
    run.samples += [loops.Sample("normal", 0.01, 200, None, 2, True, finished=0.5)]
    report = summary.summarise(run, {})
    assert report["errors"] == {"200:non_json": 3}
    assert (report["ok"], report["throughput_rps"], report["latency"]["all"]["count"]) == (1, 1.0, 1)


def test_an_answer_without_figures_is_a_success() -> None:
    """A rival service need not say its batch size or timings: absent is not broken (figures that
    cannot be read: tests/unit/test_loadgen_honesty.py)."""
    assert loops._outcome(200, b"{}") == (None, {})
    assert loops._outcome(200, b'{"batch_size": null, "timings": {}}')[0] is None
    assert loops.figures({"batch_size": None, "timings": {}}) == (None, {}, ())
    assert loops._outcome(200, b'{"batch_size": 3, "timings": {"total": 0}}')[0] is None


def test_the_mean_batch_size_is_per_batch() -> None:
    # one batch of 1 and one of 3: four answers, two batches, a mean batch of 2 (what the
    # dashboard's ai_backend_batch_size sum / count says)
    run = loops.Run(measured_from=0.0, ended=1.0)
    run.samples += [loops.Sample("normal", 0.01, 200, None, 1, True, finished=0.5)]
    run.samples += [loops.Sample("normal", 0.01, 200, None, 3, True, finished=0.5)] * 3
    report = summary.summarise(run, {})
    assert report["mean_batch_size"] == 2.0 and report["mean_batch_size_by_request_lane"]["normal"] == 2.0
    assert "mean_batch_size_by_lane" not in report, "named for what it groups by: the lane the request asked for"
    assert report["mean_batch_size_by_request_lane"]["urgent"] is None, "no urgent answers: no batches, not 0.0"
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
        await drive.bench(args, [b"x"])
    assert sum(proxy_seen) == 0 and sum(target_seen) > 0


def test_latency_histograms_reach_the_longest_deadline_a_request_may_ask_for() -> None:
    from app.settings import ServerSettings
    from app.telemetry.metrics import LATENCY_BUCKETS

    longest = ServerSettings.model_fields["max_timeout_ms"].default / 1000
    assert max(LATENCY_BUCKETS) >= longest, "answers at a long deadline would all read as the top bucket"


async def test_an_open_loop_client_that_falls_behind_says_so() -> None:
    """The client's own CPU is the bottleneck (8 ms a send: 125 a second of the 200 asked):
    latency still counts from the scheduled send, and the report says how late it sent and
    what it really offered, where it used to charge the lag to the server without a word."""

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        busy_until = time.perf_counter() + 0.008
        while time.perf_counter() < busy_until:
            pass
        return 200, b'{"batch_size": 1}'  # the "server" answers at once

    run = loops.Run()
    await drive._drive(send, bench_args(rate=200.0, duration=0.6, warmup=0.0, urgent_fraction=0.0), run)
    report = summary.summarise(run, {"rate_rps": 200.0})
    assert report["send_lag_ms"]["p99"] > 50 and report["send_lag_ms"]["max"] >= report["send_lag_ms"]["p99"]
    assert report["offered_rps"] < 160, report["offered_rps"]
    assert report["latency"]["all"]["p99_ms"] >= report["send_lag_ms"]["p99"], "latency from the scheduled send"
    warning = summary.behind_schedule(report)
    assert warning is not None and "fell behind" in warning


def test_the_send_lag_and_the_rate_offered_in_the_window() -> None:
    run = loops.Run(measured_from=10.0, ended=12.0)
    # scheduled at 10.5, 11, 11.5 and 11.9 s, sent 1, 2, 4 and 200 ms late: the last one after the window
    for scheduled, lag in ((10.5, 0.001), (11.0, 0.002), (11.5, 0.004), (11.95, 0.2)):
        run.samples.append(loops.Sample("normal", 0.25, 200, None, 1, True, finished=scheduled + 0.25, lag_s=lag))
    run.samples.append(loops.Sample("normal", 0.5, 200, None, 1, False, finished=10.4, lag_s=0.3))  # warm-up
    report = summary.summarise(run, {})
    assert report["send_lag_ms"] == {"p50": 2.0, "p99": 200.0, "max": 200.0}
    assert report["offered_rps"] == 2.0, "the warm-up one sent at 10.2 s and three in the window, over 2 s"
    assert summary.behind_schedule(report) is not None
    report["send_lag_ms"]["p99"] = 1.0
    assert summary.behind_schedule(report) is None
    closed = loops.Run(measured_from=0.0, ended=1.0)
    closed.samples.append(loops.Sample("normal", 0.01, 200, None, 1, True, finished=0.5))
    assert "send_lag_ms" not in summary.summarise(closed, {}), "a closed loop has no schedule"


async def test_httpx_bounds_each_request_as_a_whole_against_a_server_that_drips() -> None:
    """httpx's timeout bounds each read: a byte every 50 ms kept a closed-loop run going forever."""

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\n")
            while True:
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(0.05)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async with serving(drip) as port:
        args = bench_args(
            url=f"http://127.0.0.1:{port}", client="httpx", concurrency=1, timeout=0.3, duration=0.2, server_pid=None
        )
        report = await asyncio.wait_for(drive.bench(args, [b"x"]), timeout=10)
    assert report["ok"] == 0 and set(report["errors"]) <= {"0:TimeoutError"}


@pytest.mark.parametrize("deadline", ["nan", "inf", "-inf", "0", "0.4", "-5"])
def test_a_deadline_the_service_would_refuse_is_refused_here(deadline: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Under 1 every request was answered 400 and the run exited 0 (nan and inf were a traceback)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["--url", "http://127.0.0.1:9", f"--deadline-ms={deadline}"])
    assert exited.value.code == 2 and "--deadline-ms" in capsys.readouterr().err


def test_a_deadline_over_the_default_maximum_is_sent_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    """A service may be set to take more than its default server.max_timeout_ms (120000)."""
    with contextlib.suppress(SystemExit):
        cli.main(["--url", "http://127.0.0.1:9", "--deadline-ms=200000", "--duration=0.1", "--warmup=0"])
    assert "--deadline-ms 200000 is over 120000" in capsys.readouterr().err


def test_a_deadline_within_the_service_s_bounds_is_accepted() -> None:
    assert cli._deadline_accepted(1.0) and cli._deadline_accepted(120_000.0)
    assert cli._deadline_accepted(1e9), "a service may be set to take it"
    assert cli._deadline_accepted(0.6), "rounded to 1 ms, as X-Request-Timeout sends it"
    assert not cli._deadline_accepted(0.5), "rounded to 0 (to even), which the service refuses"


def a_report(ok: int, errors: dict[str, int]) -> dict[str, object]:
    return {"mode": "closed", "sent_in_window": ok + sum(errors.values()), "ok": ok, "errors": errors}


def test_a_run_where_every_request_failed_exits_non_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._report(a_report(0, {"503:queue_full": 40}), None) == 1
    printed = capsys.readouterr()
    assert '"ok": 0' in printed.out, "the report is printed all the same"
    assert "no request in the measured window succeeded (503:queue_full x40)" in printed.err
    assert cli._report(a_report(1, {"503:queue_full": 40}), None) == 0


def test_a_request_cap_used_up_in_the_warm_up_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    """It said "no request in the measured window succeeded (none sent)": the window was never reached."""
    report = a_report(0, {}) | {"sent_with_warmup": 20, "warmup_s": 2.0}
    assert cli._report(report, None, requests_cap=20) == 1
    err = capsys.readouterr().err
    assert "the --requests cap of 20 was used up in the 2 s of warm-up" in err and "succeeded" not in err
    assert cli._report(a_report(0, {}) | {"sent_with_warmup": 0, "warmup_s": 0.0}, None, requests_cap=20) == 1
    err = capsys.readouterr().err
    assert "no request was sent in the measured window" in err and "cap" not in err


def test_a_run_whose_cap_runs_out_in_the_warm_up_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "image.png").write_bytes(b"x")
    with threaded_server(Answering) as port:
        argv = ["--url", f"http://127.0.0.1:{port}", "--image", str(tmp_path / "image.png"), "--concurrency", "1"]
        assert cli.main([*argv, "--requests", "3", "--warmup", "30", "--duration", "1"]) == 1
    printed = capsys.readouterr()
    assert '"sent_with_warmup": 3' in printed.out and '"sent_in_window": 0' in printed.out
    assert "the --requests cap of 3 was used up in the 30 s of warm-up" in printed.err, printed.err


def test_an_out_path_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a traceback after the whole run, with the report lost."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["--url", "http://127.0.0.1:9", "--out", str(tmp_path)])  # a folder
    assert exited.value.code == 2 and "--out" in capsys.readouterr().err


def test_a_report_that_cannot_be_written_is_printed_then_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "write_text", lambda path, text: "No space left on device")
    assert cli._report(a_report(5, {}), tmp_path / "report.json") == 1
    printed = capsys.readouterr()
    assert '"ok": 5' in printed.out
    where = tmp_path / "report.json"
    assert printed.err.strip() == f"ai-backend bench: could not write {where}: No space left on device"
    monkeypatch.undo()
    assert cli._report(a_report(5, {}), tmp_path / "report.json") == 0
    assert '"ok": 5' in (tmp_path / "report.json").read_text()


def test_the_load_report_says_how_late_the_client_sent_and_flags_it_past_the_threshold() -> None:
    assert "closed loop" in summary.schedule_line({})
    report = {"send_lag_ms": {"p50": 0.4, "p99": 4.9, "max": 11.5}, "offered_rps": 240.1, "rate_rps": 240.0}
    line = summary.schedule_line(report)
    assert "p50 0.4, p99 4.9, max 11.5 ms" in line and "offered 240.1 of 240 requests/s" in line
    assert "over" not in line
    report["send_lag_ms"]["p99"] = 5.0  # at the threshold: not over it
    assert "over" not in summary.schedule_line(report) and summary.behind_schedule(report) is None
    report["send_lag_ms"]["p99"] = 6.5
    assert "**over 5 ms at p99**" in summary.schedule_line(report)
    assert "p99 6.5, max 11.5 ms; offered 240.1 of 240 requests/s" in str(summary.behind_schedule(report))


async def test_the_client_keeps_its_own_collections_short_while_it_drives_the_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full collection of everything the client kept (its samples pile up) stalled it for 74-80 ms
    at twice the load, and the stall read as the server's latency. What it has allocated is frozen
    out of the collector as it goes, and thawed when the run ends."""
    monkeypatch.setattr(drive, "FREEZE_EVERY_S", 0.05)
    kept: list[object] = []
    counts: list[int] = []

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        kept.extend([] for _ in range(200))  # tracked objects the run keeps alive
        counts.append(gc.get_freeze_count())
        await asyncio.sleep(0.005)
        return 200, b'{"batch_size": 1}'

    assert gc.get_freeze_count() == 0, "nothing in this test process froze objects before"
    run = loops.Run()
    await drive._drive(send, bench_args(concurrency=2, duration=0.4, warmup=0.0), run)
    assert counts[0] > 0, "frozen from the start: the set-up's objects"
    assert counts[-1] - counts[0] > len(kept) // 2, "what the run kept alive, frozen as it went"
    assert gc.get_freeze_count() == 0, "thawed when the run ended"
    assert asyncio.all_tasks() == {asyncio.current_task()}, "the freezer ended with the run"
    gc.freeze()  # frozen by someone else first (a service in this process): theirs, left alone
    frozen = gc.get_freeze_count()
    counts.clear()
    try:
        await drive._drive(send, bench_args(concurrency=1, duration=0.2, warmup=0.0), loops.Run())
        assert counts and max(counts) <= frozen, "nothing more frozen while the other party's freeze stands"
        assert 0 < gc.get_freeze_count() <= frozen, "and not thawed"
    finally:
        gc.unfreeze()
