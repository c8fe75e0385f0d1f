"""A server's threads from Linux ``/proc``: CPU used, and time spent runnable but waiting for a core.

On a machine with fewer cores than busy threads, a thread's CPU time says what it did, not what
held it back. The scheduler's own account (``/proc/PID/task/TID/schedstat``: nanoseconds on a
core, nanoseconds runnable in a run queue, slices) tells the two apart. Sleeping (waiting for
work, for the GIL or for I/O) is what is left of the wall time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def group_name(thread: str) -> str:
    """Pool threads (``preprocess-0``, ``preprocess-1``, ``device-0``...) form one group."""
    return re.sub(r"[_-]\d+$", "", thread) or "unnamed"


def threads_text(report: dict[str, Any]) -> str:
    """An ``ai-backend core`` report's CPU per request by thread group: ``device 2.48, preprocess 1.85``."""
    return ", ".join(f"{name} {ms:.2f}" for name, ms in report["cpu"]["threads_ms_per_request"].items())


def _each_thread(pid: int, filename: str) -> Iterator[tuple[int, str, str]]:
    """Each thread of ``pid`` still there: its id, its name (``comm``) and its ``filename`` in /proc."""
    tasks = Path(f"/proc/{pid}/task")
    for entry in tasks.iterdir() if tasks.exists() else ():
        try:
            text = (entry / filename).read_text()
            name = (entry / "comm").read_text().strip()
        except OSError:  # the thread ended, or the kernel keeps no such file
            continue
        yield int(entry.name), name, text


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of ``pid``: its name (``comm``) and its user + system CPU seconds so far."""
    threads = {}
    for tid, name, stat in _each_thread(pid, "stat"):
        fields = stat[stat.rindex(")") + 2 :].split()
        threads[tid] = (name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return threads


@dataclass(frozen=True)
class Scheduled:
    """One thread's account so far: its group, seconds on a core, seconds runnable and waiting."""

    group: str
    on_core_s: float
    waiting_s: float


def thread_sched(pid: int) -> dict[int, Scheduled]:
    """Each thread of ``pid`` by the scheduler's account; empty where the kernel keeps none."""
    threads = {}
    for tid, name, schedstat in _each_thread(pid, "schedstat"):
        on_core, waiting = (int(v) for v in schedstat.split()[:2])
        threads[tid] = Scheduled(group_name(name), on_core / 1e9, waiting / 1e9)
    return threads


def sched_report(before: dict[int, Scheduled], after: dict[int, Scheduled], window_s: float) -> dict[str, Any]:
    """Per thread group over the window, in cores: on a core (``cpu_cores``) and runnable but kept
    off one (``runnable_waiting_cores``), with how many threads the group has. Threads that started
    in the window count from zero."""
    groups: dict[str, dict[str, Any]] = {}
    for tid, now in after.items():
        then = before.get(tid, Scheduled(now.group, 0.0, 0.0))
        group = groups.setdefault(now.group, {"threads": 0, "cpu_cores": 0.0, "runnable_waiting_cores": 0.0})
        group["threads"] += 1
        group["cpu_cores"] += (now.on_core_s - then.on_core_s) / window_s
        group["runnable_waiting_cores"] += (now.waiting_s - then.waiting_s) / window_s
    for group in groups.values():
        group["cpu_cores"] = round(group["cpu_cores"], 3)
        group["runnable_waiting_cores"] = round(group["runnable_waiting_cores"], 3)
    return dict(sorted(groups.items(), key=lambda item: -float(item[1]["cpu_cores"])))
