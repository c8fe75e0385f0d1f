"""The load generator's raw HTTP/1.1 client and its accounting, against real loopback sockets."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from app.bench import processes, rawhttp
from app.bench.loadgen import cli, drive, loops, senders, summary, target, usage
from app.bench.rawhttp import HttpProtocolError, build_request, parse_head, read_response


def reader_of(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_a_request_is_keep_alive_bytes_with_host_and_content_length() -> None:
    data = build_request("POST", "127.0.0.1:8000", "/predict", {"Content-Type": "application/json"}, b'{"a":1}')
    assert data == (
        b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Length: 7\r\n"
        b'Content-Type: application/json\r\n\r\n{"a":1}'
    )


def test_a_head_gives_status_lower_case_headers_length_and_keep_alive() -> None:
    head = parse_head(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 12\r\nRetry-After: 1\r\n\r\n")
    assert (head.status, head.content_length, head.chunked, head.keep_alive) == (503, 12, False, True)
    assert head.headers["retry-after"] == "1"


@pytest.mark.parametrize(
    ("head", "keep_alive"),
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\n\r\n", False),  # no length: the body runs to the connection's end
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", True),
    ],
)
def test_keep_alive_only_when_the_body_is_delimited_and_nobody_said_close(head: bytes, keep_alive: bool) -> None:
    assert parse_head(head).keep_alive is keep_alive


def test_no_content_statuses_have_an_empty_body() -> None:
    assert parse_head(b"HTTP/1.1 204 No Content\r\n\r\n").content_length == 0


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
    ],
    ids=["http2", "status", "garbage", "header", "length", "coding"],
)
def test_what_the_client_does_not_understand_fails_loudly(head: bytes) -> None:
    with pytest.raises(HttpProtocolError):
        parse_head(head)


async def test_a_content_length_body_is_read_exactly_and_the_rest_left() -> None:
    reader = reader_of(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1", eof=False)
    head, body = await read_response(reader)
    assert (head.status, body) == (200, b"hello")
    assert await reader.readexactly(8) == b"HTTP/1.1"


async def test_a_chunked_body_is_joined_with_extensions_and_trailers_ignored() -> None:
    data = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4;name=value\r\nWiki\r\n5\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    _, body = await read_response(reader_of(data))
    assert body == b"Wikipedia in\r\n\r\nchunks."


async def test_a_bad_chunk_fails_loudly() -> None:
    with pytest.raises(HttpProtocolError):
        await read_response(reader_of(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"))
    with pytest.raises(HttpProtocolError):
        await read_response(reader_of(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY"))


async def test_a_body_without_length_runs_to_the_end_and_a_short_one_raises() -> None:
    _, body = await read_response(reader_of(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end"))
    assert body == b"until the end"
    with pytest.raises(asyncio.IncompleteReadError):
        await read_response(reader_of(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"))


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serving(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[int]:
    """A loopback server running ``handle`` for each connection while the block runs; its port."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def http_server(respond: Callable[[int, bytes], bytes]) -> AsyncIterator[tuple[int, list[int]]]:
    """A loopback HTTP/1.1 server answering request ``n`` with ``respond(n, body)``.

    Yields its port and the number of requests each connection carried.
    """
    per_connection: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        per_connection.append(0)
        slot = len(per_connection) - 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                per_connection[slot] += 1
                answer = respond(sum(per_connection), body)
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async with serving(handle) as port:
        yield port, per_connection


def json_answer(payload: dict[str, object], close: bool = False) -> bytes:
    body = json.dumps(payload).encode()
    extra = b"Connection: close\r\n" if close else b""
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


async def test_a_connection_is_kept_alive_and_reopened_after_the_server_closes_it() -> None:
    async with http_server(lambda n, _: json_answer({"n": n}, close=n == 2)) as (port, per_connection):
        connection = rawhttp.Connection("127.0.0.1", port)
        request = build_request("POST", f"127.0.0.1:{port}", "/", {}, b"{}")
        answers = [json.loads((await connection.request(request))[1])["n"] for _ in range(4)]
        connection.close()
    assert answers == [1, 2, 3, 4]
    assert per_connection == [2, 2] and connection.opened == 2


async def test_a_connection_idle_near_the_servers_keep_alive_timeout_is_not_reused() -> None:
    """A request written as the server's idle timeout closes the connection is reset after the write
    (a failed request, and at twice the load one in 24,000 was): one idle that long opens afresh."""
    async with http_server(lambda n, _: json_answer({"n": n})) as (port, per_connection):
        connection = rawhttp.Connection("127.0.0.1", port, idle_reuse_s=0.2)
        request = build_request("POST", f"127.0.0.1:{port}", "/", {}, b"{}")
        await connection.request(request)
        await connection.request(request)  # at once: the same connection
        await asyncio.sleep(0.3)
        await connection.request(request)
        connection.close()
    assert per_connection == [2, 1] and connection.opened == 2 and connection.retried == 0


async def test_a_kept_alive_connection_the_server_dropped_while_idle_is_retried_once_fresh() -> None:
    served = 0

    async def answer_once_then_hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
        served += 1
        writer.write(json_answer({"n": served}))  # keep-alive promised, then an idle timeout
        await writer.drain()
        writer.close()

    async with serving(answer_once_then_hang_up) as port:
        connection = rawhttp.Connection("127.0.0.1", port)
        request = build_request("POST", f"127.0.0.1:{port}", "/", {}, b"{}")
        first = json.loads((await connection.request(request))[1])["n"]
        await asyncio.sleep(0.05)  # the server has hung up by now
        second = json.loads((await connection.request(request))[1])["n"]
        connection.close()
    assert (first, second) == (1, 2) and connection.opened == 2
    assert connection.retried == 1, "a request that found its connection closed before the write is counted"


async def test_a_close_that_comes_right_after_the_answer_is_seen_before_the_next_write() -> None:
    """A server that answers (keep-alive promised) and closes at once: its end of stream is still in
    the socket when a closed loop writes its next request in the same loop turn. Each request must
    go on a fresh connection, none counted as failed (every other one was, unread by the server)."""
    read = 0

    async def answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal read
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
            read += 1
            writer.write(json_answer({"n": read}))
            await writer.drain()
        writer.close()

    async with serving(answer_then_close) as port:
        connection = rawhttp.Connection("127.0.0.1", port)
        request = build_request("POST", f"127.0.0.1:{port}", "/", {}, b"{}")
        try:
            answers = [json.loads((await connection.request(request))[1])["n"] for _ in range(10)]
        finally:
            connection.close()
    assert answers == list(range(1, 11)) and read == 10
    assert connection.retried == 9 and connection.opened == 10


@contextlib.contextmanager
def descriptors_below_1024_taken() -> Iterator[None]:
    """Every descriptor under 1024 in use while the block runs, so that a socket opened in it gets
    one above: as in a client with a thousand connections open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1100:
        if hard != resource.RLIM_INFINITY and hard < 1100:
            pytest.skip(f"a descriptor limit of {hard} leaves none above 1024")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1100, hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1024:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_connection_on_a_descriptor_above_1024_is_reused() -> None:
    """``select`` refuses a descriptor from 1024 up (``ValueError``): at a concurrency of 1100 every
    reuse of such a connection failed before its write, and the connection went back to the pool
    to fail again (1367 requests of 4000)."""
    async with http_server(lambda n, _: json_answer({"n": n})) as (port, per_connection):
        pool = rawhttp.Pool("127.0.0.1", port)
        request = build_request("POST", f"127.0.0.1:{port}", "/", {}, b"{}")
        try:
            with descriptors_below_1024_taken():
                answers = [json.loads((await pool.request(request))[1])["n"] for _ in range(3)]
                (connection,) = pool._idle
                assert connection._writer is not None
                assert connection._writer.get_extra_info("socket").fileno() >= 1024
        finally:
            pool.close()
    assert answers == [1, 2, 3] and per_connection == [3], "one connection, kept alive"
    assert pool.size == 1 and pool.retried == 0


async def test_a_check_for_a_closed_connection_that_fails_puts_the_request_on_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing is written before the check, so whatever goes wrong in it costs a connection, never
    the request, and the connection is not lent again to fail the same way."""

    def broken(fd: int) -> bool:
        raise OSError("the check failed")

    async with http_server(lambda n, _: json_answer({"n": n})) as (port, per_connection):
        connection = rawhttp.Connection("127.0.0.1", port)
        request = build_request("POST", f"127.0.0.1:{port}", "/", {}, b"{}")
        try:
            await connection.request(request)
            with monkeypatch.context() as patched:
                patched.setattr(rawhttp, "_readable", broken)
                second = json.loads((await connection.request(request))[1])["n"]
            third = json.loads((await connection.request(request))[1])["n"]
        finally:
            connection.close()
    assert (second, third) == (2, 3) and per_connection == [1, 2]
    assert connection.opened == 2 and connection.retried == 0, "the server closed nothing"


SCHEDSTAT = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").exists()


def bench_args(**overrides: object) -> argparse.Namespace:
    defaults: dict[str, object] = {
        "url": "",
        "model": None,
        "client": "raw",
        "concurrency": 4,
        "rate": None,
        "urgent_fraction": 0.5,
        "duration": 0.4,
        "warmup": 0.1,
        "requests": 10_000,
        "timeout": 5.0,
        "seed": 0,
        "server_pid": os.getpid(),
        "server_metrics": False,
        "deadline_ms": None,
        "api_key": None,
    }
    args = argparse.Namespace(**(defaults | overrides))
    if args.url:  # what main makes of --url
        host, port = target.parse_url(args.url)
        args.target = target.Target(host, port, target.loopback_addresses(host)[0])
    return args


@pytest.mark.parametrize("client", ["raw", "httpx"])
async def test_a_closed_loop_run_cycles_the_images_and_reports_batches_lanes_and_cpu(client: str) -> None:
    seen: list[bytes] = []

    def respond(n: int, body: bytes) -> bytes:
        seen.append(json.loads(body)["image_base64"].encode())
        if n % 10 == 0:
            body = b'{"code": "queue_full"}'
            return b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        return json_answer({"batch_size": 4})

    async with http_server(respond) as (port, per_connection):
        args = bench_args(url=f"http://127.0.0.1:{port}", client=client)
        report = await drive.bench(args, [b"one", b"two", b"three"])
    assert report["client"] == client and report["images"] == 3
    assert report["ok"] > 0 and report["mean_batch_size"] == 4.0
    assert set(report["errors"]) <= {"503:queue_full"}
    assert {b"b25l", b"dHdv", b"dGhyZWU="} == set(seen)  # every image was sent
    assert report["latency"]["urgent"]["count"] > 0 and report["latency"]["normal"]["count"] > 0
    assert report["cpu"]["server_ms_per_request"] >= 0 and report["cpu"]["window_s"] > 0
    assert report["latency"]["refused"]["count"] == report["errors"].get("503:queue_full", 0)
    assert report["server_rss_mb"]["max"] >= report["server_rss_mb"]["first"] > 0  # this process stands in
    if SCHEDSTAT:  # its threads by the scheduler's account
        groups = report["server_threads"].values()
        assert sum(g["threads"] for g in groups) >= 1 and sum(g["cpu_cores"] for g in groups) > 0
    if client == "raw":
        assert report["connections"] == len(per_connection) <= 4


async def test_a_refused_connection_is_an_error_sample_not_a_crash() -> None:
    async with http_server(lambda n, _: b"") as (port, _):
        pass  # closed again: nothing listens on the port now
    send, pool = senders.raw_sender(target.Target("127.0.0.1", port, "127.0.0.1"), "/predict", [b"{}"], timeout=1.0)
    run = loops.Run(measured_from=0.0)
    await loops.closed_loop(send, 2, 0.0, time.perf_counter() + 0.05, 4, run, random.Random(0))
    pool.close()
    assert run.samples and {s.status for s in run.samples} == {0}
    assert {s.code for s in run.samples} == {"ECONNREFUSED"}, "by its errno: the client's failure, named"


def test_cpu_report_splits_the_machine_into_server_client_and_the_rest() -> None:
    before = {"client": 1.0, "server": 10.0, "machine": 100.0, "steal": 0.0, "wall": 50.0}
    after = {"client": 1.5, "server": 18.0, "machine": 119.0, "steal": 0.2, "wall": 60.0}
    report = usage.cpu_report(before, after, ok=1000)
    assert report["server_cores"] == 0.8 and report["client_cores"] == 0.05 and report["other_cores"] == 1.05
    assert report["server_ms_per_request"] == 8.0 and report["client_ms_per_request"] == 0.5


def under(pid: int) -> list[int]:
    """The pids of ``pid``'s descendants."""
    return [child for child, _ in processes.descendants(pid)]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")
def test_a_server_is_charged_for_the_cpu_of_the_processes_under_it() -> None:
    """LitServe decodes and runs the model in worker processes: counting the server's own pid
    only would make it look nearly free. A child that spins for 0.35 s of CPU, then sleeps, and
    its own child, are both found and counted (0.3 s each at least: /proc's ticks, truncated,
    can read a spin of exactly 0.3 s as 0.29)."""
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.35: pass\ntime.sleep(60)"
    nested = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {spin!r}])\n{spin}"
    child = subprocess.Popen([sys.executable, "-c", nested])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            spun = [usage.process_cpu_s(pid) >= 0.3 for pid in [child.pid, *under(child.pid)]]
            if len(spun) == 2 and all(spun):
                break
            time.sleep(0.05)
        assert len(spun) == 2 and all(spun), "the child and its child did not spin within 60 s"
        assert {child.pid, *under(child.pid)} <= set(under(os.getpid()))
        own = usage.process_cpu_s(os.getpid())  # first: its growth while the tree is read is not the children's
        assert usage.tree_cpu_s(os.getpid()) - own >= 0.6 - 1e-9
        assert usage.tree_cpu_s(child.pid) >= 0.6 - 1e-9 and usage.process_cpu_s(child.pid) < 0.6
    finally:
        for pid in under(child.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        child.kill()
        child.wait(timeout=10)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")
def test_a_child_process_that_ends_mid_window_keeps_its_cpu_in_the_server_s_count() -> None:
    """A server's worker that spins, then exits and is collected by the server while a window
    runs: the server's CPU, read at the window's start and end, must not go down (the worker's
    CPU is then in the server's count of its collected children, ``cutime``/``cstime``)."""
    spin = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.35: pass\nsys.stdin.readline()"
    server_code = (
        "import subprocess, sys, time\n"
        f"worker = subprocess.Popen([sys.executable, '-c', {spin!r}], stdin=subprocess.PIPE)\n"
        "print(worker.pid, flush=True)\n"
        "sys.stdin.readline()\n"
        "worker.stdin.close()\n"
        "worker.wait()\n"
        "print('collected', flush=True)\n"
        "time.sleep(60)\n"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", server_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        worker = int(_line_within(server.stdout, 60))
        deadline = time.monotonic() + 60
        while usage.process_cpu_s(worker) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert usage.process_cpu_s(worker) >= 0.3, "the worker did not spin within 60 s"
        own = usage.process_cpu_s(server.pid)
        before = usage.tree_cpu_s(server.pid)
        assert before - own >= 0.3 - 1e-9
        server.stdin.write("end the worker\n")
        server.stdin.flush()
        assert _line_within(server.stdout, 60) == "collected"
        assert not Path(f"/proc/{worker}").exists()
        assert usage.tree_cpu_s(server.pid) >= before - 1e-9  # without cutime: 0.3 s less
    finally:
        server.kill()
        server.communicate(timeout=10)


def _line_within(stream: Any, timeout_s: float) -> str:
    """The next line a child process writes, or the test fails after ``timeout_s``."""
    import select

    ready, _, _ = select.select([stream], [], [], timeout_s)
    assert ready, f"no line within {timeout_s} s"
    return str(stream.readline()).strip()


def test_machine_cpu_reads_busy_and_stolen_ticks(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    ticks = usage.CLOCK_TICKS
    stat.write_text(f"cpu  {ticks} 0 {ticks} {50 * ticks} 7 0 0 {ticks} 0 0\ncpu0 1 2 3\n")
    assert usage.machine_cpu_s(stat) == (2.0, 1.0)


def test_images_come_from_a_folder_by_name_or_from_one_file(tmp_path: Path) -> None:
    (tmp_path / "b.jpg").write_bytes(b"B")
    (tmp_path / "a.png").write_bytes(b"A")
    (tmp_path / "notes.txt").write_bytes(b"no")
    assert senders.load_images(tmp_path / "a.png", tmp_path) == [b"A", b"B"]
    assert senders.load_images(tmp_path / "b.jpg", None) == [b"B"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        senders.load_images(tmp_path / "a.png", tmp_path / "empty")


def test_a_deadline_is_sent_and_answers_later_than_it_are_counted() -> None:
    assert senders._headers(True, 250.4)["X-Request-Timeout"] == "250"
    assert "X-Request-Timeout" not in senders._headers(False)
    run = loops.Run(measured_from=0.0, ended=1.0)
    run.samples += [
        loops.Sample("normal", 0.100, 200, None, 4, True),
        loops.Sample("normal", 0.300, 200, None, 4, True),  # past a 250 ms deadline
        loops.Sample("urgent", 0.002, 503, "would_miss_deadline", None, True),
        loops.Sample("normal", 0.004, 503, "queue_full", None, True),
    ]
    report = summary.summarise(run, {}, deadline_ms=250)
    assert report["ok_past_deadline"] == 1 and report["deadline_ms"] == 250
    assert report["latency"]["refused"]["count"] == 2 and report["latency"]["refused"]["max_ms"] == 4.0
    assert "ok_past_deadline" not in summary.summarise(run, {})
    assert "ok_past_deadline_server" not in report  # the answers carried no timings


def test_answers_past_their_deadline_by_the_server_s_own_clock_are_counted_apart() -> None:
    run = loops.Run(measured_from=0.0, ended=1.0)
    timed = {"preprocess": 2.0, "queue": 10.0, "inference": 30.0}
    run.samples += [
        loops.Sample("normal", 0.300, 200, None, 4, True, {**timed, "total": 240.0}),  # late by the client's clock
        loops.Sample("normal", 0.260, 200, None, 4, True, {**timed, "total": 251.0}),  # and by the server's
        loops.Sample("normal", 0.100, 200, None, 4, True, {**timed, "total": 90.0}),
    ]
    report = summary.summarise(run, {}, deadline_ms=250)
    assert report["ok_past_deadline"] == 2 and report["ok_past_deadline_server"] == 1


def test_the_server_s_stage_timings_are_summarised_per_lane() -> None:
    run = loops.Run(measured_from=0.0, ended=1.0)
    stages = {"preprocess": 2.0, "queue": 10.0, "inference": 30.0, "total": 45.0}
    run.samples += [loops.Sample("urgent", 0.05, 200, None, 2, True, stages)] * 3
    run.samples += [loops.Sample("normal", 0.05, 200, None, 8, True, {**stages, "queue": 20.0})]
    report = summary.summarise(run, {})
    assert report["server_stages_ms"]["urgent"]["queue"] == {"p50": 10.0, "p99": 10.0}
    assert report["server_stages_ms"]["normal"]["queue"]["p99"] == 20.0


def test_memory_that_levels_off_and_memory_that_leaks_read_apart() -> None:
    """Queues filling and allocators reaching their largest batch raise memory early in the minute
    and then hold; a leak goes on growing: the second half's growth tells them apart."""
    levelling = [724.0, 1061.0, 1169.0, 1217.0, 1247.0, 1254.0, 1257.0, 1257.0, 1257.0]
    leaking = [724.0 + 20 * i for i in range(9)]
    assert usage.memory_summary(levelling) == {
        "first": 724.0,
        "last": 1257.0,
        "max": 1257.0,
        "second_half_growth": 10.0,
    }
    assert usage.memory_summary(leaking)["second_half_growth"] == 80.0
    assert usage.memory_summary([900.0])["second_half_growth"] == 0.0


async def answering_once_per_connection(hang_up_before_answering: bool) -> tuple[asyncio.Server, list[int]]:
    """A server that answers the first request on each connection; on the second it reads it
    (as a server that runs it would) and closes the connection without answering."""
    served: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for n in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
                if n == 1 and hang_up_before_answering:
                    break
                served.append(n)
                writer.write(json_answer({"n": len(served)}))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):  # cancelled: the test ended
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), served


async def test_a_request_the_server_read_then_hung_up_on_is_an_error_not_sent_again() -> None:
    """It used to be sent again on a fresh connection and counted a success: the server read it
    (and may have run it) and never answered, and the report showed no error at all."""
    server, served = await answering_once_per_connection(hang_up_before_answering=True)
    port = server.sockets[0].getsockname()[1]
    try:
        connection = rawhttp.Connection("127.0.0.1", port)
        request = build_request("POST", f"127.0.0.1:{port}", "/", {}, b"{}")
        await connection.request(request)
        with pytest.raises(rawhttp.ConnectionClosed):
            await connection.request(request)
        assert (connection.opened, connection.retried, len(served)) == (1, 0, 1), "not sent a second time"
        await connection.request(request)  # the next request opens a fresh connection
        connection.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_the_report_counts_a_request_the_server_hung_up_on_as_connection_closed() -> None:
    server, _ = await answering_once_per_connection(hang_up_before_answering=True)
    port = server.sockets[0].getsockname()[1]
    try:
        args = bench_args(
            url=f"http://127.0.0.1:{port}", concurrency=1, requests=20, duration=2.0, warmup=0.0, server_pid=None
        )
        report = await drive.bench(args, [b"x"])
    finally:
        server.close()
        await server.wait_closed()
    assert report["ok"] == 10 and report["errors"] == {"0:connection_closed": 10}, report["errors"]
    assert report["retried"] == 0


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:99999",
        "http://127.0.0.1:abc",
        "http://[::1",
        "https://127.0.0.1:8000",
        "http://127.0.0.1:0",
        "http://:8000",
        "http://127.0.0.1:8000/v1",
    ],
)
def test_a_url_that_is_not_http_host_and_port_is_refused_in_one_line(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A port out of range or not a number, a broken IPv6 literal: they were tracebacks."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["--url", url, "--duration", "0.2"])
    assert exited.value.code == 2 and "--url" in capsys.readouterr().err


def test_localhost_is_resolved_not_trusted(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An /etc/hosts that sends localhost off the machine: the load must not follow it."""
    real = socket.getaddrinfo

    def resolve(host: str, *args: object, **kwargs: object) -> list[Any]:
        if host == "localhost":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.10", 0))]
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert not target.is_loopback("http://localhost:8000")
    with pytest.raises(SystemExit) as exited:
        cli.main(["--url", "http://localhost:9", "--duration", "0.2"])
    assert exited.value.code == 2 and "192.0.2.10" in capsys.readouterr().err
    assert target.is_loopback("http://127.0.0.2:8000") and target.is_loopback("http://[::1]:8000")
    assert not target.is_loopback("http://0.0.0.0:8000")


def test_the_run_goes_to_the_resolved_address_that_answers() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listening:  # the kernel completes the handshake
        port = listening.getsockname()[1]
        address, why = target.reachable(["::1", "127.0.0.1"], port)
    assert (address, why) == ("127.0.0.1", ""), "localhost may resolve to ::1 first, the server on 127.0.0.1"


@contextlib.contextmanager
def threaded_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[int]:
    """A loopback HTTP/1.1 server in a thread while the block runs, for tests that run the whole
    command (its own event loop); its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    serve = threading.Thread(target=server.serve_forever, daemon=True)
    serve.start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        serve.join(timeout=5)


class Answering(BaseHTTPRequestHandler):
    """Answers every POST 200 with ``body`` (a batch of one), keep-alive."""

    protocol_version = "HTTP/1.1"
    body = b'{"batch_size": 1}'

    def do_POST(self) -> None:  # noqa: N802 (the name http.server calls)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("client", ["raw", "httpx"])
@pytest.mark.parametrize("api_key", [None, "clé-0123456789abcdef"])
async def test_the_host_header_is_host_and_port_and_an_api_key_goes_as_a_bearer_token(
    client: str, api_key: str | None
) -> None:
    """A service with ``server.api_key`` set answered every request 401: there was no way to send
    the key. It goes as the service compares it, the UTF-8 bytes of the key, by both clients."""
    heads: list[bytes] = []
    handlers: list[asyncio.Task[None] | None] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
                heads.append(head)
                writer.write(json_answer({"batch_size": 1}))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async with serving(handle) as port:
        args = bench_args(url=f"http://localhost:{port}", client=client, requests=3, server_pid=None, api_key=api_key)
        await drive.bench(args, [b"x"])
        # the client closed its connections: each handler ends at their end, and closes its own
        await asyncio.wait_for(asyncio.gather(*(task for task in handlers if task)), timeout=5)
        await asyncio.sleep(0.01)
    lines = [line for head in heads for line in head.split(b"\r\n")]
    hosts = {line.lower() for line in lines if line.lower().startswith(b"host:")}
    assert len(heads) == 3 and hosts == {f"host: localhost:{port}".encode()}, hosts
    keys = [line for line in lines if line.lower().startswith(b"authorization:")]
    if api_key is None:
        assert keys == []
    else:
        assert keys == [b"Authorization: Bearer " + api_key.encode()] * 3, keys


def test_a_url_with_user_information_is_refused_without_echoing_it(capsys: pytest.CaptureFixture[str]) -> None:
    """It was dropped without a word: the run went without the credentials it seemed to be given."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["--url", "http://user:hunter2-secret@127.0.0.1:9", "--duration", "0.2"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "user information" in err and "--api-key-file" in err
    assert "hunter2" not in err


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "cannot be read"),
        (b" \n", "holds no key"),
        (b"first-line\nsecond", "more than one line"),
        (b"\xff", "cannot be read"),
    ],
)
def test_an_api_key_file_that_cannot_be_sent_is_refused(
    content: bytes | None, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file = tmp_path / "key"
    if content is not None:
        key_file.write_bytes(content)
    with pytest.raises(SystemExit) as exited:
        cli.main(["--url", "http://127.0.0.1:9", "--api-key-file", str(key_file), "--duration", "0.2"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--api-key-file" in err and why in err, err


def test_the_api_key_from_its_file_passes_the_service_s_check(tmp_path: Path) -> None:
    """Whitespace around the key (the file's newline) is not part of it, as the service reads it."""
    key = "0123456789abcdef-key"
    seen: list[str | None] = []

    class Keyed(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (the name http.server calls)
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(self.headers.get("Authorization"))
            ok = seen[-1] == f"Bearer {key}"
            body = b'{"batch_size": 1}' if ok else b'{"code": "unauthorized"}'
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    (tmp_path / "key").write_text(f"  {key}\n")
    (tmp_path / "image.png").write_bytes(b"x")
    with threaded_server(Keyed) as port:
        argv = ["--url", f"http://127.0.0.1:{port}", "--api-key-file", str(tmp_path / "key")]
        argv += ["--image", str(tmp_path / "image.png"), "--requests", "4", "--concurrency", "1", "--warmup", "0"]
        assert cli.main([*argv, "--out", str(tmp_path / "report.json")]) == 0
    assert seen == [f"Bearer {key}"] * 4
    assert json.loads((tmp_path / "report.json").read_text())["ok"] == 4


async def test_a_request_sent_before_its_scheduled_arrival_counts_its_latency_from_the_send() -> None:
    """uvloop's timers fire up to a millisecond early: counted from the later, scheduled time, such
    a request's latency read short by as much (here by the whole 50 ms it went early)."""
    run = loops.Run(measured_from=0.0)

    async def answer_after_20_ms(number: int, urgent: bool) -> tuple[int, bytes]:
        await asyncio.sleep(0.02)
        return 200, b'{"batch_size": 1}'

    early = time.perf_counter() + 0.05
    sent = time.perf_counter()
    await loops._send(answer_after_20_ms, 0, False, run, scheduled=early)
    (sample,) = run.samples
    assert sample.latency_s >= 0.02 and sample.lag_s is not None and sample.lag_s < 0
    assert abs(sample.sent_at - sent) < 0.01, "when it was sent, not before"
