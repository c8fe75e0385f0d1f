"""A server's process tree: its descendants (each with its start time, so that a pid reused later
is not taken for one of them, and its depth), for charging a server for their CPU
(``loadgen.usage.tree_cpu_s``) and for ending them, the deepest first (the Ray rival ends what
Ray's shutdown leaves behind: Ray's workers and agents are the raylet's children, orphaned once
it is gone). Linux ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

Process = tuple[int, str]  # a pid and its start time, so that a pid reused later is not taken for it


def stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat``'s fields after the command name (which may hold spaces and brackets),
    the state first; ``OSError`` once the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def _stat(pid: int) -> list[str] | None:
    """``stat_fields``, None once the process is gone."""
    try:
        return stat_fields(pid)
    except OSError:
        return None


def children(pid: int) -> list[int]:
    """``pid``'s child processes (``/proc/PID/task/TID/children``: each thread lists those it
    started); none once it is gone."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(child) for child in (task / "children").read_text().split()]
    return found


def descendants(pid: int) -> dict[Process, int]:
    """``pid``'s child processes, theirs, and so on, each with its depth under ``pid`` (1: a
    child); those that end while this reads are left out."""
    found: dict[Process, int] = {}
    pending = [(pid, 0)]
    while pending:
        parent, depth = pending.pop()
        for child in children(parent):
            if (fields := _stat(child)) is not None:
                found[(child, fields[19])] = depth + 1
                pending.append((child, depth + 1))
    return found


def running(process: Process) -> bool:
    """Still running: the same process (its start time) and not a zombie."""
    fields = _stat(process[0])
    return fields is not None and fields[19] == process[1] and fields[0] != "Z"


def _reap() -> None:
    """Collect exited children (Ray's GCS and raylet are this process's), so that none stays a zombie."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def end_processes(processes: dict[Process, int], grace_s: float) -> list[int]:
    """SIGKILL those of ``processes`` (with their depths) still running after ``grace_s``
    seconds, the deepest first, so that a parent still there collects its children; the pids
    killed."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap()
        if not any(running(p) for p in processes):
            return []
        time.sleep(0.1)
    killed: list[int] = []
    for depth in sorted(set(processes.values()), reverse=True):
        level = [p for p, d in processes.items() if d == depth and running(p)]
        for pid, _ in level:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += [pid for pid, _ in level]
        time.sleep(0.2 if level else 0)
        _reap()
    return killed
