"""``ai-backend bench`` against any server, honestly: the client's own descriptor limit, a latency
over every request sent, other servers' error bodies and figures, a run the request cap cut
short, memory over the server's process tree, the default image and another server's route."""

from __future__ import annotations

import asyncio
import errno
import json
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.bench import rawhttp
from app.bench.loadgen import cli, drive, loops, summary
from tests.unit.test_loadgen import Answering, bench_args, http_server, threaded_server

REPO = Path(__file__).resolve().parents[2]


# ---- the client's own file descriptors ---------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (OSError(errno.EMFILE, "Too many open files"), "EMFILE"),
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "ECONNREFUSED"),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), "ECONNRESET"),
        (TimeoutError(), "TimeoutError"),
        (rawhttp.ConnectionClosed("closed"), "connection_closed"),
        (rawhttp.HttpProtocolError("bad"), "HttpProtocolError"),
    ],
)
def test_a_failure_in_the_client_is_named_by_its_errno(error: BaseException, code: str) -> None:
    """Out of descriptors read ``0:OSError``, as if the server had dropped the connection."""
    assert loops._error_code(error) == code


LIMITED = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 256))
    from app.bench.loadgen import cli
    try:
        code = cli.main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
    print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0], "exit", code)
    """
)


def bench_under_a_descriptor_limit(*argv: str) -> subprocess.CompletedProcess[str]:
    """The command in a process whose soft descriptor limit is 64 and hard one 256; nothing listens
    at its URL (port 9), so a load the limit allows ends with exit 1 before sending anything."""
    command = [sys.executable, "-c", LIMITED, "--url", "http://127.0.0.1:9", "--duration", "0.2", *argv]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)


def test_the_soft_descriptor_limit_is_raised_and_a_closed_loop_that_cannot_fit_is_refused() -> None:
    fits = bench_under_a_descriptor_limit("--concurrency", "100")
    assert fits.stdout.split() == ["soft", "256", "exit", "1"], fits.stdout + fits.stderr
    assert "nothing answers" in fits.stderr and "warning" not in fits.stderr
    refused = bench_under_a_descriptor_limit("--concurrency", "1000")
    assert refused.stdout.split()[-2:] == ["exit", "2"], refused.stdout + refused.stderr
    assert "256" in refused.stderr and "ulimit -n" in refused.stderr, refused.stderr
    # an open loop's rate x timeout is a worst case (every request held unanswered): warned of
    warned = bench_under_a_descriptor_limit("--rate", "100", "--timeout", "60")
    assert warned.stdout.split()[-2:] == ["exit", "1"], warned.stdout + warned.stderr
    assert "warning: at overload the load may hold 6000 connections" in warned.stderr, warned.stderr
    assert "256" in warned.stderr and "ulimit -n" in warned.stderr


def test_requests_that_found_no_descriptor_are_told_apart_as_the_client_s(capsys: pytest.CaptureFixture[str]) -> None:
    report = {"ok": 5, "errors": {"0:EMFILE": 40, "503:queue_full": 2}, "client_fd_limit": 1024}
    assert cli._report(report, None) == 0
    err = capsys.readouterr().err
    assert "40 requests failed in the client, which had no file descriptor left (its limit: 1024)" in err
    assert "not the server's" in err


async def test_a_closed_loop_whose_sends_fail_at_once_still_lets_the_event_loop_run() -> None:
    """A connection that cannot be made (no descriptor left) may fail without awaiting anything:
    the clients spun through the request cap, and no answer on another connection was read."""
    turns = 0

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    seen: list[int] = []

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        seen.append(turns)
        raise OSError(errno.EMFILE, "Too many open files")

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    run = loops.Run(measured_from=0.0)
    try:
        await loops.closed_loop(send, 2, 0.0, time.perf_counter() + 60, 200, run, random.Random(0))
    finally:
        ticking.cancel()
    assert len(run.samples) == 200 and {s.code for s in run.samples} == {"EMFILE"}
    assert seen[-1] > seen[0] + 50, "the event loop got turns between the failed sends"


# ---- a latency over every request sent ---------------------------------------------------------


def test_requests_that_timed_out_are_in_the_latency_over_every_request_sent() -> None:
    """90 answers in 10 ms and 10 requests that timed out at 10 s: every latency figure read 10 ms."""
    run = loops.Run(measured_from=0.0, ended=20.0)
    run.samples += [loops.Sample("normal", 0.010, 200, None, 1, True, finished=1.0)] * 90
    run.samples += [loops.Sample("normal", 10.0, 0, "TimeoutError", None, True, finished=11.0)] * 9
    run.samples += [loops.Sample("normal", 3.0, 0, "unanswered", None, True, finished=13.0)]  # given up on early
    report = summary.summarise(run, {}, timeout_s=10.0)
    assert report["latency"]["all"]["p99_ms"] == 10.0, "the answered requests' figure is kept as it was"
    sent = report["latency_sent"]
    assert sent["count"] == 100 and sent["without_answer"] == 10
    assert sent["p90_ms"] == 10.0 and sent["p99_ms"] == 10_000.0 and sent["max_ms"] == 10_000.0
    assert set(report["latency_basis"]) == {"latency", "latency_sent"}
    assert "answered requests only" in report["latency_basis"]["latency"]


def test_a_run_with_many_requests_unanswered_says_which_latency_is_which(capsys: pytest.CaptureFixture[str]) -> None:
    run = loops.Run(measured_from=0.0, ended=20.0)
    run.samples += [loops.Sample("normal", 0.010, 200, None, 1, True, finished=1.0)] * 95
    run.samples += [loops.Sample("normal", 5.0, 0, "TimeoutError", None, True, finished=6.0)] * 5
    assert cli._report(summary.summarise(run, {}, timeout_s=5.0), None) == 0
    err = capsys.readouterr().err
    assert "5 of the 100 requests sent in the window got no answer" in err
    assert '"latency" counts answers only (p99 10 ms)' in err and '"latency_sent", p99 is 5000 ms' in err


def test_an_error_answer_counts_in_the_latency_sent_at_its_own_latency() -> None:
    run = loops.Run(measured_from=0.0, ended=2.0)
    run.samples += [loops.Sample("normal", 0.002, 503, "queue_full", None, True, finished=1.0)] * 4
    report = summary.summarise(run, {}, timeout_s=60.0)
    assert report["latency_sent"]["p99_ms"] == 2.0 and report["latency_sent"]["without_answer"] == 0


# ---- other servers' bodies -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (503, b'{"detail": "Service Unavailable"}', "service_unavailable"),  # FastAPI, LitServe, Ray Serve
        (400, b'{"error": "failed to parse the request JSON"}', "failed_to_parse_the_request_json"),  # Triton
        (422, b'{"detail": [{"type": "missing", "loc": ["body", "x"], "msg": "Field required"}]}', "missing"),
        (500, b'{"detail": "Internal Server Error"}', "internal_server_error"),
        (500, b"{}", "no_code"),
        (500, b'{"code": null, "message": "x"}', "no_code"),
        (503, b'{"code": "queue_full", "message": "x"}', "queue_full"),  # this service's envelope, as before
    ],
)
def test_other_servers_error_bodies_give_their_own_codes_never_none(status: int, body: bytes, code: str) -> None:
    assert loops._outcome(status, body)[0] == code


def test_a_long_error_detail_is_cut_to_a_short_code() -> None:
    detail = "request 1234 failed because " + "x" * 200
    code = loops._outcome(500, json.dumps({"detail": detail}).encode())[0]
    assert code is not None and len(code) <= loops.CODE_CHARS and code.startswith("request_1234_failed")


@pytest.mark.parametrize(
    ("body", "dropped"),
    [
        (b'{"batch_size": 1, "timings": {"total": "abc"}}', "timings"),
        (b'{"batch_size": 1, "timings": {"total": null, "queue": 2.0}}', "timings"),
        (b'{"batch_size": 1, "timings": {"total": Infinity}}', "timings"),
        (b'{"batch_size": 1, "timings": {"total": NaN}}', "timings"),
        (b'{"batch_size": 1, "timings": {"total": -3.0}}', "timings"),
        (b'{"batch_size": 1, "timings": [1.0, 2.0]}', "timings"),
        (b'{"batch_size": 1, "timings": {"gpu": {"total": 1.0}}}', "timings"),
        (b'{"batch_size": NaN}', "batch_size"),
        (b'{"batch_size": -1}', "batch_size"),
        (b'{"batch_size": 0}', "batch_size"),
        (b'{"batch_size": 1.5}', "batch_size"),
        (b'{"batch_size": 2.0}', "batch_size"),
        (b'{"batch_size": "2"}', "batch_size"),
        (b'{"batch_size": true}', "batch_size"),
    ],
)
async def test_a_200_with_figures_that_cannot_be_read_is_a_success_with_the_figure_dropped(
    body: bytes, dropped: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every correct answer of a rival that sent ``"batch_size": 0`` was a failed request: ok 0,
    throughput 0, exit 1. The answer counts; the figure is dropped, counted and warned of."""

    def respond(n: int, _: bytes) -> bytes:
        good = b'{"batch_size": 2, "timings": {"preprocess": 1, "queue": 2.5, "inference": 3, "total": 7}}'
        answer = body if n % 2 else good
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(answer) + answer

    async with http_server(respond) as (port, _):
        args = bench_args(url=f"http://127.0.0.1:{port}", concurrency=1, requests=10, warmup=0.0, server_pid=None)
        report = await drive.bench(args, [b"x"])
    assert report["ok"] == 10 and report["errors"] == {}, report["errors"]
    assert report["ignored_figures"] == {dropped: 5}
    # a size that could not be read counts in no mean (per batch: an answer of a batch of b is 1/b of one):
    # the 2s alone, or five 2s and five 1s beside bad timings (10 images in 7.5 batches)
    sized = 5 if dropped == "batch_size" else 10
    assert report["answers_with_batch_size"] == sized
    assert report["mean_batch_size"] == (2.0 if dropped == "batch_size" else 1.33)
    assert report["server_stages_ms"]["normal"]["queue"]["p99"] == 2.5
    assert json.loads(json.dumps(report, allow_nan=False)) == report
    assert cli._report(report, None) == 0
    assert f"5 of the 10 answers had a {dropped} that could not be read" in capsys.readouterr().err


def test_a_rival_answer_with_a_null_timing_is_a_success() -> None:
    code, payload = loops._outcome(200, b'{"predictions": [{"label": "3"}], "timings": {"total": null}}')
    assert code is None and loops.figures(payload) == (None, {}, ("timings",))


def test_the_mean_batch_is_null_when_no_answer_says_its_batch_size() -> None:
    """It read 0.0, "batches of nothing", beside ai-backend's real mean in a comparison table."""
    run = loops.Run(measured_from=0.0, ended=1.0)
    run.samples += [loops.Sample("normal", 0.01, 200, None, None, True, finished=0.5)] * 5
    report = summary.summarise(run, {})
    assert report["mean_batch_size"] is None and report["answers_with_batch_size"] == 0
    assert report["mean_batch_size_by_request_lane"] == {"urgent": None, "normal": None}


# ---- a run the request cap ended ---------------------------------------------------------------


async def test_a_run_the_request_cap_ended_early_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        await asyncio.sleep(0)
        return 200, b'{"batch_size": 1}'

    run = loops.Run()
    args = bench_args(concurrency=2, duration=60.0, warmup=0.0, requests=50, server_pid=None)
    mode = await drive._drive(send, args, run)
    assert mode["ended_by"] == "requests_cap"
    report = summary.summarise(run, {**mode, "duration_s": 60.0})
    assert cli._report(report, None, requests_cap=50) == 0
    err = capsys.readouterr().err
    assert "the --requests cap of 50 ended the run after" in err and "of the 60 s asked" in err

    async def slow(number: int, urgent: bool) -> tuple[int, bytes]:
        await asyncio.sleep(0.01)
        return 200, b'{"batch_size": 1}'

    run = loops.Run()
    args = bench_args(concurrency=1, duration=0.1, warmup=0.0, requests=1000, server_pid=None)
    assert (await drive._drive(slow, args, run))["ended_by"] == "duration", "at most 10 sent in the 0.1 s"


async def test_an_open_loop_the_request_cap_ended_says_so() -> None:
    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        return 200, b"{}"

    run = loops.Run()
    args = bench_args(rate=2000.0, duration=60.0, warmup=0.0, requests=20, server_pid=None)
    assert (await drive._drive(send, args, run))["ended_by"] == "requests_cap"


# ---- the default image, and another server's route ---------------------------------------------


def test_the_default_image_is_found_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--url", "http://127.0.0.1:9", "--duration", "0.2"]) == 1  # nothing listens there
    assert "nothing answers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        cli.main(["--url", "http://127.0.0.1:9", "--image", "missing.png"])
    assert exited.value.code == 2 and "--image" in capsys.readouterr().err


class Recording(Answering):
    """Answers as another server would (no batch size), and keeps each request line."""

    body = b'{"predictions": []}'

    lines: list[str] = []  # noqa: RUF012 (the test's record, reset by it)

    def do_POST(self) -> None:  # noqa: N802 (the name http.server calls)
        Recording.lines.append(self.requestline)
        super().do_POST()


@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_path_targets_another_server_s_route(client: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Recording.lines = []
    (tmp_path / "image.png").write_bytes(b"x")
    with threaded_server(Recording) as port:
        argv = ["--url", f"http://127.0.0.1:{port}", "--image", str(tmp_path / "image.png"), "--client", client]
        argv += ["--path", "/classify/v1", "--concurrency", "1", "--requests", "5", "--warmup", "0"]
        assert cli.main([*argv, "--duration", "5"]) == 0
    assert Recording.lines and set(Recording.lines) == {"POST /classify/v1 HTTP/1.1"}
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] == 5 and report["mean_batch_size"] is None


@pytest.mark.parametrize("path", ["classify", "/a b", "/a\r\nX: y", "/é"])
def test_a_path_that_cannot_go_in_a_request_line_is_refused(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--url", "http://127.0.0.1:9", "--path", path])
    assert exited.value.code == 2 and "--path" in capsys.readouterr().err
