"""Where the CPU and the memory went while a run measured: the server's, the client's and the
machine's, read from Linux ``/proc``."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.bench.processes import descendants, stat_fields
from app.bench.threads import Scheduled, thread_sched

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (every thread), from ``/proc/PID/stat``."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _with_collected_children_ticks(pid: int) -> int:
    """``pid``'s CPU in clock ticks plus that of the children it has collected (``wait``ed for:
    ``cutime`` and ``cstime``, which hold their own collected children's in turn)."""
    return sum(int(field) for field in stat_fields(pid)[11:15])


def tree_cpu_s(pid: int) -> float:
    """The CPU seconds of ``pid`` and of every process under it, those that ended and were
    collected included: a server that works in child processes (LitServe's workers) is charged
    for them, and one that ends mid-window keeps its CPU in its parent's count (read alone, it
    would drop out, and the server's CPU over the window would shrink by all it ever used).
    A child left to init (orphaned, or under a parent that ignores SIGCHLD) is lost with its
    CPU. ``OSError`` when ``pid`` itself is gone."""
    ticks = _with_collected_children_ticks(pid)
    for child, _ in descendants(pid):
        with contextlib.suppress(OSError):
            ticks += _with_collected_children_ticks(child)
    return ticks / CLOCK_TICKS  # summed in ticks: no float error piling up over the processes


def memory_summary(samples_mb: Sequence[float]) -> dict[str, float]:
    """The server's memory over the window (samples once a second): first, last and
    max, and how much it grew over the window's second half (from the middle sample to the last):
    queues filling and allocators reaching their largest batch show in the first half, while a
    leak goes on growing through the second."""
    return {
        "first": round(samples_mb[0], 1),
        "last": round(samples_mb[-1], 1),
        "max": round(max(samples_mb), 1),
        "second_half_growth": round(samples_mb[-1] - samples_mb[len(samples_mb) // 2], 1),
    }


def _kib(path: Path, key: str) -> int | None:
    """The ``KEY:  N kB`` figure of a ``/proc`` file, or None (no such line, or unreadable)."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class TreeMemory:
    """The memory of a server's process tree at one moment, in MiB, by two measures."""

    rss_mb: float  # resident set size (``VmRSS``): a page shared by n of the processes counts n times
    pss_mb: float | None  # proportional set size: such a page counts 1/n in each; None where unreadable
    processes: int


def tree_memory(pid: int) -> TreeMemory | None:
    """The memory of ``pid`` and every process under it, as ``tree_cpu_s`` charges their CPU: a
    server that runs its model in child processes (LitServe's workers, a Ray replica) holds it
    there. RSS (``/proc/PID/status``) always: for a server of one process it is that process's
    VmRSS, the figure earlier reports gave; PSS (``/proc/PID/smaps_rollup``, which walks each
    process's page tables: milliseconds per GB resident) where every process's is readable, so
    that pages shared after a fork count once. None once ``pid`` is gone."""
    rss = {p: _kib(Path(f"/proc/{p}/status"), "VmRSS:") for p in [pid, *(c for c, _ in descendants(pid))]}
    if rss[pid] is None:
        return None
    live = {p: kib for p, kib in rss.items() if kib is not None}  # a child that ended meanwhile: left out
    pss = [_kib(Path(f"/proc/{p}/smaps_rollup"), "Pss:") for p in live]
    return TreeMemory(
        rss_mb=sum(live.values()) / 1024,
        pss_mb=None if None in pss else sum(kib or 0 for kib in pss) / 1024,
        processes=len(live),
    )


def machine_cpu_s(stat: Path = Path("/proc/stat")) -> tuple[float, float]:
    """Busy and stolen CPU seconds of the whole machine, all cores, from ``/proc/stat``."""
    values = [int(v) for v in stat.read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / CLOCK_TICKS, steal / CLOCK_TICKS


def cpu_snapshot(server_pid: int | None) -> dict[str, float]:
    """CPU seconds so far: this process, the server (if given; with its child processes) and the machine."""
    busy, steal = machine_cpu_s() if Path("/proc/stat").exists() else (0.0, 0.0)
    snapshot = {"client": time.process_time(), "machine": busy, "steal": steal, "wall": time.perf_counter()}
    if server_pid is not None:
        with contextlib.suppress(OSError):  # the server is gone: no server figures
            snapshot["server"] = tree_cpu_s(server_pid)
    return snapshot


def cpu_report(before: dict[str, float], after: dict[str, float], ok: int) -> dict[str, float]:
    """Where the CPU went between two snapshots: in cores, and in milliseconds per answered request."""
    wall = max(1e-9, after["wall"] - before["wall"])
    used = {key: after[key] - before[key] for key in before if key in after and key != "wall"}
    if "server" in used:
        used["other"] = max(0.0, used["machine"] - used["client"] - used["server"])
    report = {f"{key}_cores": round(value / wall, 3) for key, value in used.items()}
    for key in ("client", "server"):
        if key in used and ok:
            report[f"{key}_ms_per_request"] = round(used[key] * 1000 / ok, 4)
    return {"window_s": round(wall, 3), **report}


def thread_snapshot(server_pid: int | None) -> dict[int, Scheduled] | None:
    """The server's threads, by the scheduler's account; None without a server, or once it is gone."""
    if server_pid is None:
        return None
    with contextlib.suppress(OSError):  # the server is gone
        return thread_sched(server_pid)
    return None
