"""The server's threads by the scheduler's account: on a core, and runnable but waiting for one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.bench.threads import Scheduled, group_name, sched_report, thread_cpu, thread_sched

HAS_SCHEDSTAT = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").exists()


@pytest.mark.parametrize(
    ("thread", "group"),
    [("device-0", "device"), ("device-urgent-0", "device-urgent"), ("preprocess", "preprocess"), ("", "unnamed")],
)
def test_pool_threads_form_one_group(thread: str, group: str) -> None:
    assert group_name(thread) == group


def test_the_report_is_per_group_in_cores_and_counts_new_threads_from_zero() -> None:
    before = {1: Scheduled("device", 10.0, 4.0), 2: Scheduled("device", 10.0, 4.0), 3: Scheduled("python", 5.0, 0.0)}
    after = {
        1: Scheduled("device", 11.0, 5.0),
        2: Scheduled("device", 10.5, 6.0),
        3: Scheduled("python", 5.5, 0.25),
        4: Scheduled("preprocess", 0.5, 0.5),  # started within the window
    }
    report = sched_report(before, after, window_s=2.0)
    assert report == {
        "device": {"threads": 2, "cpu_cores": 0.75, "runnable_waiting_cores": 1.5},
        "python": {"threads": 1, "cpu_cores": 0.25, "runnable_waiting_cores": 0.125},
        "preprocess": {"threads": 1, "cpu_cores": 0.25, "runnable_waiting_cores": 0.25},
    }
    assert next(iter(report)) == "device"  # busiest first


@pytest.mark.skipif(not HAS_SCHEDSTAT or not hasattr(os, "sched_setaffinity"), reason="Linux schedstat only")
def test_processes_sharing_one_core_are_seen_waiting_for_it() -> None:
    """Three busy processes held to one core: each is always runnable and on it a third of the time
    (processes, not threads: Python threads would take turns at the GIL, asleep, not runnable)."""
    core = min(os.sched_getaffinity(0))
    spin = f"import os, time\nos.sched_setaffinity(0, {{{core}}})\nend = time.monotonic() + 30\n"
    spin += "while time.monotonic() < end: pass"
    napper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(3)]
    try:
        time.sleep(0.5)  # started and held to the core
        pids = [p.pid for p in spinners]
        before = {pid: thread_sched(pid) for pid in [*pids, napper.pid]}
        started = time.monotonic()
        time.sleep(0.6)
        after = {pid: thread_sched(pid) for pid in [*pids, napper.pid]}
        window = time.monotonic() - started
        cpu = {pid: thread_cpu(pid) for pid in pids}
    finally:
        for process in [*spinners, napper]:
            process.kill()
            process.wait()
    # one thread a process, named after the interpreter's executable
    busy = [next(iter(sched_report(before[pid], after[pid], window).values())) for pid in pids]
    on_core = sum(group["cpu_cores"] for group in busy)
    waiting = sum(group["runnable_waiting_cores"] for group in busy)
    assert 0.5 < on_core < 1.2  # one core between them
    assert waiting > on_core  # at any moment two of the three wait for it
    idle = next(iter(sched_report(before[napper.pid], after[napper.pid], window).values()))
    assert idle["cpu_cores"] < 0.05 and idle["runnable_waiting_cores"] < 0.05
    assert all(seconds > 0 for threads in cpu.values() for _, seconds in threads.values())
