"""A running server's profile: py-spy's samples, split by thread group, stage and function, and
every thread's CPU time from ``/proc`` over the same window."""

from __future__ import annotations

import re
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.bench.threads import group_name, thread_cpu

# (stage, substrings of a frame "function (file)"); a sample goes to the deepest frame that matches
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base64 decode", ("b64decode", "a2b_base64", "base64_bytes")),
    ("JSON body parse", ("model_validate_json",)),
    # the fast path's decode (simplejpeg, reduced in the DCT) and resize (torch's uint8 kernel) are
    # C under these Python frames
    ("JPEG decode", ("ImageFile.load", "JpegImagePlugin", "decode_reduced (")),
    ("resize", ("Image.resize", "_resized_tensor (")),
    ("other image work (open, convert, to tensor)", ("PIL/", "preprocess.py", "numpy/")),
    ("model forward", ("torch/nn/modules", "LayeredModel.", "runner.py")),
    ("tracing (OpenTelemetry)", ("opentelemetry", "TracedRunner")),
    ("logging", ("/logging/", "telemetry/logging.py")),
    ("metrics (Prometheus)", ("prometheus_client", "telemetry/metrics.py", "batching/observer.py")),
    ("batcher", ("app/batching/",)),
    (
        "thread hand-offs (pool, futures)",
        ("concurrent/futures", "asyncio/futures.py", "run_in_executor", "threading.py"),
    ),
    ("response model + JSON", ("serialize_response", "jsonable_encoder", "responses.py", "pydantic/")),
    ("dependencies", ("fastapi/dependencies",)),
    ("HTTP protocol (uvicorn, httptools)", ("uvicorn/protocols",)),
    ("routing + middleware (Starlette, FastAPI)", ("starlette/", "fastapi/", "app/api/")),
    ("app service", ("app/service.py", "app/inference/")),
    ("asyncio tasks", ("asyncio/",)),
)


# Leaf frames of a thread blocked in C (a queue, a lock, epoll): py-spy cannot always tell
# that such a thread is idle, so its samples are counted apart and left out of the shares.
# uvloop's loop is all C: its own I/O work lands here too, with its waiting.
IDLE_LEAVES = (
    "_worker (",  # concurrent.futures: waiting for work
    "WorkerThreads._work (",  # the decode pool and the device threads: waiting for work
    "Condition.wait (",
    "Event.wait (",
    "Thread.join (",
    "Runner.run (",  # uvloop's run loop (epoll and its C-level I/O)
)


def is_idle(frames: Sequence[str]) -> bool:
    return bool(frames) and frames[-1].startswith(IDLE_LEAVES)


@dataclass(frozen=True)
class Sample:
    tid: int
    thread: str
    frames: tuple[str, ...]  # outermost first
    count: int


_THREAD = re.compile(r"^thread \((0x[0-9a-fA-F]+|[0-9]+)\): ?(.*)$")


def parse_collapsed(text: str) -> list[Sample]:
    """py-spy's ``--format raw --threads`` output: ``thread (TID): NAME;frame;...;frame COUNT`` a line."""
    samples = []
    for line in text.splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        first, *frames = stack.split(";")
        match = _THREAD.match(first)
        if match is None or not count.isdigit():
            raise ValueError(f"not a py-spy raw line with thread ids: {line[:100]!r}")
        samples.append(Sample(int(match.group(1), 0), match.group(2), tuple(frames), int(count)))
    return samples


def short(frame: str) -> str:
    """``func (/long/path/site-packages/pkg/mod.py)`` as ``func (pkg/mod.py)``."""
    return re.sub(r"\((?:[^()]*/(?:site-packages|lib/python3\.\d+)/|[^()]*?/(?=app/))", "(", frame)


def stage_of(frames: Sequence[str]) -> str:
    """The stage of the deepest frame that names one; else the leaf function."""
    for frame in reversed(frames):
        for stage, needles in STAGES:
            if any(needle in frame for needle in needles):
                return stage
    return f"other: {short(frames[-1]) if frames else '?'}"


def summarise_profile(
    samples: Sequence[Sample],
    cpu_before: dict[int, tuple[str, float]],
    cpu_after: dict[int, tuple[str, float]],
    window_s: float,
    top: int = 12,
) -> dict[str, Any]:
    """Per thread group: cores used (``/proc``), and its CPU split by stage and by function (py-spy).

    Shares are of the group's busy samples (``IDLE_LEAVES`` apart).
    """
    names = {s.tid: group_name(s.thread) for s in samples}
    cores: dict[str, float] = defaultdict(float)
    tids: dict[str, list[int]] = defaultdict(list)
    for tid, (comm, after) in cpu_after.items():
        group = names.get(tid, f"native ({comm})")
        cores[group] += (after - cpu_before.get(tid, (comm, 0.0))[1]) / window_s
        tids[group].append(tid)
    stages: dict[str, Counter[str]] = defaultdict(Counter)
    own: dict[str, Counter[str]] = defaultdict(Counter)
    idle: Counter[str] = Counter()
    for s in samples:
        group = names[s.tid]
        if is_idle(s.frames):
            idle[group] += s.count
            continue
        stages[group][stage_of(s.frames)] += s.count
        own[group][short(s.frames[-1]) if s.frames else "?"] += s.count
    groups = []
    for group in sorted(cores, key=lambda g: -cores[g]):
        total = sum(stages[group].values())

        def shares(counter: Counter[str], total: int = total) -> list[dict[str, Any]]:
            return [{"name": name, "share": round(n / total, 4)} for name, n in counter.most_common(top)]

        groups.append(
            {
                "group": group,
                "threads": len(tids[group]),
                "cores": round(cores[group], 4),
                "samples": total,
                "idle_samples": idle[group],
                "stages": shares(stages[group]) if total else [],
                "functions": shares(own[group]) if total else [],
            }
        )
    return {
        "window_s": round(window_s, 3),
        "samples": sum(s.count for s in samples),
        "cores": round(sum(cores.values()), 4),
        "groups": groups,
    }


def record(pid: int, seconds: int, rate: int, raw_out: Path, py_spy: str) -> dict[str, Any]:
    """py-spy on ``pid`` for ``seconds`` with the threads' CPU read around it; the summary."""
    command = [py_spy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", str(rate)]
    command += ["--format", "raw", "--threads", "--full-filenames", "--nolineno", "--output", str(raw_out)]
    before, started = thread_cpu(pid), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    after, window = thread_cpu(pid), time.perf_counter() - started
    if done.returncode != 0 or not raw_out.exists():
        raise RuntimeError(f"py-spy failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    summary = summarise_profile(parse_collapsed(raw_out.read_text()), before, after, window)
    return {"command": " ".join(command), "rate_hz": rate, **summary}
