"""``ai-backend bench --server-pid``: the server's memory by honest names (RSS under
``server_rss_mb``, as before the process tree was read; PSS beside it), read off the client's loop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from app.bench.loadgen import drive, loops, summary
from app.bench.loadgen.usage import TreeMemory
from tests.unit.test_loadgen import bench_args

LINUX = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux /proc")

# 64 MiB touched, then a fork: the two processes share those pages until either writes them
FORKS = (
    "import os, time; kept = bytearray(b'x') * (64 << 20); child = os.fork(); "
    "print(child, flush=True) if child else None; time.sleep(60)"
)


def vmrss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def answer(number: int, urgent: bool) -> tuple[int, bytes]:
    await asyncio.sleep(0.005)
    return 200, b'{"batch_size": 1}'


@LINUX
async def test_server_rss_is_the_resident_set_and_pss_counts_a_shared_page_once() -> None:
    """``server_rss_mb`` was the server's VmRSS; PSS written under it read lower by every shared page."""
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FORKS, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert server.stdout is not None
        forked = int(await asyncio.wait_for(server.stdout.readline(), 30))
        run = loops.Run()
        await drive._drive(answer, bench_args(concurrency=1, duration=0.2, warmup=0.0, server_pid=server.pid), run)
        report = summary.summarise(run, {})
        resident = vmrss_mb(server.pid) + vmrss_mb(forked)
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # the forked one with it: the same process group
        await asyncio.wait_for(server.wait(), 10)
    assert report["server_memory"]["processes"] == 2
    assert resident > 128 and report["server_rss_mb"]["max"] == pytest.approx(resident, abs=4)
    if "server_pss_mb" in report:  # smaps_rollup: Linux 4.14 and later
        assert report["server_pss_mb"]["max"] < resident - 48, "the 64 MiB the two share count once"


@LINUX
async def test_a_slow_memory_reading_does_not_hold_the_client_s_sends_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading PSS walks a big server's page tables: on the client's loop, its sends would wait."""
    reading, sent_meanwhile = threading.Event(), threading.Event()
    outcomes: list[bool] = []

    def slow_tree_memory(pid: int) -> TreeMemory | None:
        reading.set()
        outcomes.append(sent_meanwhile.wait(timeout=5))  # the timeout only ends a read that blocks the loop
        return None  # the server is gone: this one reading is the last

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        if reading.is_set():
            sent_meanwhile.set()
        return await answer(number, urgent)

    monkeypatch.setattr(drive, "tree_memory", slow_tree_memory)
    await drive._drive(send, bench_args(concurrency=1, duration=0.3, warmup=0.0, server_pid=os.getpid()), loops.Run())
    assert outcomes == [True], "the client sent nothing while the server's memory was read"
