"""``ai-backend sweep``: how fast one model version runs at each batch size, in process.

The version is loaded through the real loader (verified, cast, frozen, every head
loaded), then timed at batch sizes 1, 2, 4, ... up to ``--max-batch``: a few warm-up
passes, then timed passes until ``--iterations`` or ``--seconds-per-size`` runs out.
A pass is ``model.probabilities`` on a uint8 dummy batch that starts on the host, laid out as
the service lays a batch out (``LayeredModel.batch``), so the copy to the device is counted, as
it is when serving; on CUDA the device is synchronised around every pass. An out-of-memory at
a size is recorded and ends the sweep there.

The knee is where batching stops paying: the smallest size beyond which no doubling
raises throughput by ``--knee-gain`` or more. The recommended max batch is the knee,
lowered, if a ``--latency-budget-ms`` is given, to the largest size within it.
Output: a markdown table on stdout, a JSON report and a PNG plot.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from app.bench.chart import PLOT_SIZE, knee_text, plot
from app.bench.output import unwritable, write_text
from app.inference.device import Fault, cpu_cores, device_fault, plan_threads

MIB = 2**20

Forward = Callable[[torch.Tensor], object]


@dataclass(frozen=True)
class SizeResult:
    """What one batch size measured; an ``oom`` result carries no timings."""

    batch_size: int
    status: Literal["ok", "oom"] = "ok"
    iterations: int = 0
    median_ms: float = 0.0
    p90_ms: float = 0.0
    min_ms: float = 0.0
    throughput: float = 0.0  # items/s: batch size / median latency
    memory: dict[str, int] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class Recommendation:
    """The knee and the max batch to serve with, and why in words."""

    knee: int | None
    knee_reached: bool  # False: throughput still rose at the largest size that ran
    max_batch: int | None
    reason: str


@dataclass(frozen=True)
class Limits:
    """How long to spend on each size."""

    warmup: int = 3
    iterations: int = 50
    seconds_per_size: float = 3.0


def batch_sizes(max_batch: int) -> list[int]:
    """Powers of two from 1 up to ``max_batch`` (rounded down to one)."""
    if max_batch < 1:
        raise ValueError("max batch must be at least 1")
    return [2**k for k in range(max_batch.bit_length()) if 2**k <= max_batch]


def percentile(values: Sequence[float], q: float) -> float:
    """Linearly interpolated percentile (numpy's default): a sweep has few samples per size."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _measured(results: Sequence[SizeResult]) -> list[SizeResult]:
    """The sizes that ran, up to the first out-of-memory."""
    return list(itertools.takewhile(lambda r: r.status == "ok", results))


def find_knee(results: Sequence[SizeResult], knee_gain: float) -> tuple[int | None, bool]:
    """The knee and whether the curve flattened there (False: it was still rising).

    Each next measured size is a doubling; the knee is the smallest size from which no
    larger size gains ``knee_gain`` or more over the best of the sizes below it, so a
    plateau followed by a real jump is not mistaken for the end, and a rebound from a dip
    that stays under the best so far is not a gain. Sizes after an out-of-memory never ran
    and do not count.
    """
    ok = _measured(results)
    if not ok:
        return None, False
    knee = len(ok) - 1
    while knee > 0 and ok[knee].throughput < max(r.throughput for r in ok[:knee]) * (1 + knee_gain):
        knee -= 1
    return ok[knee].batch_size, knee < len(ok) - 1


def recommend(
    results: Sequence[SizeResult], knee_gain: float, latency_budget_ms: float | None = None
) -> Recommendation:
    """The knee, capped by the latency budget; explains the choice."""
    knee, reached = find_knee(results, knee_gain)
    oom = next((r.batch_size for r in results if r.status == "oom"), None)
    if knee is None:
        reason = f"out of memory at batch {oom}" if oom is not None else "nothing was measured"
        return Recommendation(None, False, None, reason)
    measured = _measured(results)
    if len(measured) == 1:
        reason = f"only batch {knee} was measured"
    elif reached:
        reason = f"beyond batch {knee}, doubling the batch gains less than {knee_gain:.0%} throughput"
    else:
        reason = f"throughput still gained {knee_gain:.0%} or more up to batch {knee}, the largest that ran"
    if oom is not None:
        reason += f" (batch {oom} ran out of memory)"
    if latency_budget_ms is None:
        return Recommendation(knee, reached, knee, reason)
    by_size = {r.batch_size: r for r in measured}
    within = [size for size, r in by_size.items() if size <= knee and r.median_ms <= latency_budget_ms]
    if not within:
        reason += f"; but no size up to it has a median latency within {latency_budget_ms:g} ms"
        return Recommendation(knee, reached, None, reason)
    chosen = max(within)
    if chosen < knee:
        reason += (
            f"; capped to {chosen} by the {latency_budget_ms:g} ms latency budget "
            f"(batch {knee} takes {by_size[knee].median_ms:.1f} ms)"
        )
    return Recommendation(knee, reached, chosen, reason)


class MemoryProbe(Protocol):
    """Memory use of one batch size: ``start`` before it, ``stop`` after it."""

    kind: str
    description: str

    def start(self) -> None: ...

    def stop(self) -> dict[str, int]: ...


class CudaMemory:
    """The CUDA caching allocator's peaks, reset before each size."""

    kind = "cuda-allocator"
    description = (
        "CUDA caching allocator: peak allocated / reserved (torch.cuda.max_memory_allocated / "
        "max_memory_reserved), reset before each size; growth = peak allocated - allocated before the size"
    )

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._before = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._before = torch.cuda.memory_allocated(self.device)

    def stop(self) -> dict[str, int]:
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        return {
            "allocated_before_bytes": self._before,
            "peak_allocated_bytes": peak,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
            "growth_bytes": peak - self._before,
        }


class ProcessMemory:
    """The process's resident set from ``/proc/self/status``; not the model's memory alone."""

    kind = "process-rss"

    def __init__(self, status: Path = Path("/proc/self/status"), clear_refs: Path = Path("/proc/self/clear_refs")):
        self._status, self._clear_refs = status, clear_refs
        self._before = 0
        self.peak_resets = True
        self.description = (
            "process RSS (/proc/self/status, whole process, includes allocator caches): "
            "growth = peak RSS (VmHWM) during the size - RSS (VmRSS) at its start; "
            "VmHWM is reset before each size through /proc/self/clear_refs"
        )

    def _read(self) -> dict[str, int]:
        text = self._status.read_text()
        return {key: int(m.group(1)) * 1024 for key in ("VmRSS", "VmHWM") if (m := re.search(rf"{key}:\s+(\d+)", text))}

    def start(self) -> None:
        try:
            self._clear_refs.write_text("5")  # "5": reset the peak RSS to the current RSS
        except OSError:
            self.peak_resets = False
            self.description = self.description.replace(
                "is reset before each size", "could not be reset (whole-run peak)"
            )
        self._before = self._read().get("VmRSS", 0)

    def stop(self) -> dict[str, int]:
        now = self._read()
        peak = now.get("VmHWM", 0)
        return {
            "rss_before_bytes": self._before,
            "peak_rss_bytes": peak,
            "rss_after_bytes": now.get("VmRSS", 0),
            "growth_bytes": max(0, peak - self._before),
        }


def time_passes(
    forward: Forward, batch: torch.Tensor, sync: Callable[[], None], limits: Limits, clock: Callable[[], float]
) -> list[float]:
    """Seconds per timed pass. Warm-up and timing each stop at the per-size budget (after one pass)."""
    started = clock()
    for _ in range(limits.warmup):
        forward(batch)
        if clock() - started >= limits.seconds_per_size:
            break
    sync()
    timings: list[float] = []
    started = clock()
    while len(timings) < limits.iterations:
        begin = clock()
        forward(batch)
        sync()
        end = clock()
        timings.append(end - begin)
        if end - started >= limits.seconds_per_size:
            break
    return timings


def sweep(
    forward: Forward,
    make_batch: Callable[[int], torch.Tensor],
    sizes: Sequence[int],
    probe: MemoryProbe,
    limits: Limits,
    sync: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
    on_result: Callable[[SizeResult], None] = lambda _: None,
) -> list[SizeResult]:
    """Time every size in order; a CUDA out-of-memory is recorded and ends the sweep."""
    results: list[SizeResult] = []
    for size in sizes:
        batch = make_batch(size)
        probe.start()
        try:
            timings = time_passes(forward, batch, sync, limits, clock)
        except Exception as exc:  # CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError
            if device_fault(exc) is not Fault.MEMORY:
                raise
            result = SizeResult(size, "oom", error=str(exc).splitlines()[0] if str(exc) else "out of memory")
        else:
            memory = probe.stop()
            ms = [t * 1000 for t in timings]
            median = percentile(ms, 50)
            throughput = size / max(median / 1000, 1e-9)  # a finite number, so the JSON stays valid
            result = SizeResult(size, "ok", len(ms), median, percentile(ms, 90), min(ms), throughput, memory)
        results.append(result)
        on_result(result)
        if result.status == "oom":
            del batch
            torch.cuda.empty_cache()  # a no-op unless CUDA was initialised
            break
    return results


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table with a heading and the recommendation."""
    cuda = report["memory"]["kind"] == CudaMemory.kind
    memory_columns = ("peak alloc MiB", "peak reserved MiB") if cuda else ("RSS growth MiB", "peak RSS MiB")
    memory_keys = ("peak_allocated_bytes", "peak_reserved_bytes") if cuda else ("growth_bytes", "peak_rss_bytes")
    rec = report["recommendation"]
    lines = [
        f"## sweep: {report['model']} v{report['version']} on {report['device']} ({report['dtype']})",
        "",
        "| batch | iters | median ms | p90 ms | items/s | " + " | ".join(memory_columns) + " | note |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    knee_note = "knee" if rec["knee_reached"] else "no knee up to here"
    for row in report["sizes"]:
        size = row["batch_size"]
        notes = [
            word for word, hit in ((knee_note, size == rec["knee"]), ("recommended", size == rec["max_batch"])) if hit
        ]
        if row["status"] == "oom":
            lines.append(f"| {size} | - | - | - | - | - | - | OUT OF MEMORY |")
            continue
        mem = " | ".join(f"{row['memory'].get(key, 0) / MIB:.1f}" for key in memory_keys)
        lines.append(
            f"| {size} | {row['iterations']} | {row['median_ms']:.3f} | {row['p90_ms']:.3f} | "
            f"{row['throughput']:.1f} | {mem} | {', '.join(notes)} |"
        )
    lines += [
        "",
        f"memory: {report['memory']['description']}",
        f"{knee_text(rec)}; recommended max batch: {rec['max_batch']} ({rec['reason']})",
    ]
    return "\n".join(lines)


def build_report(meta: dict[str, Any], results: Sequence[SizeResult], rec: Recommendation) -> dict[str, Any]:
    """The JSON report: the run's facts, every size, and the recommendation."""
    return {**meta, "sizes": [asdict(r) for r in results], "recommendation": asdict(rec)}


def _load(args: argparse.Namespace) -> tuple[Any, float]:
    from app.inference.device import resolve_device, resolve_dtype
    from app.inference.loader import LayeredModel
    from app.inference.repository import Repository

    repository = Repository(args.repository)
    entries = {entry.name: entry for entry in repository.models()}
    if args.model is None and len(entries) == 1:
        args.model = next(iter(entries))
    if args.model not in entries:
        raise LookupError(
            f"model {args.model!r} is not in {args.repository} (it holds: {', '.join(entries) or 'none'})"
        )
    args.version = args.version or entries[args.model].latest
    if args.version not in entries[args.model].versions:
        raise LookupError(
            f"{args.model} has no version {args.version} (it has {', '.join(entries[args.model].versions)})"
        )
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    started = time.perf_counter()
    folder = repository.folder(args.model, args.version)
    model = LayeredModel.load(folder, repository.manifest(args.model, args.version), device, dtype)
    model.load_all_heads()
    return model, time.perf_counter() - started


def _run(args: argparse.Namespace, model: Any, load_s: float) -> dict[str, Any]:
    from app.inference.device import dtype_name

    device: torch.device = model.device
    cuda = device.type == "cuda"
    probe: MemoryProbe = CudaMemory(device) if cuda else ProcessMemory()
    limits = Limits(args.warmup, args.iterations, args.seconds_per_size)

    def forward(batch: torch.Tensor) -> object:
        with torch.inference_mode():
            return model.probabilities(batch)

    def progress(r: SizeResult) -> None:
        detail = "out of memory" if r.status == "oom" else f"{r.iterations} passes, median {r.median_ms:.2f} ms"
        print(f"batch {r.batch_size}: {detail}", file=sys.stderr, flush=True)

    if not cuda and model.dtype != torch.float32:
        print("note: reduced precision on the CPU is many times slower than float32", file=sys.stderr)
    load_before = os.getloadavg()
    results = sweep(
        forward,
        lambda size: model.batch(list(model.dummy_batch(size))),
        batch_sizes(args.max_batch),
        probe,
        limits,
        sync=(lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None),
        on_result=progress,
    )
    rec = recommend(results, args.knee_gain, args.latency_budget_ms)
    meta = {
        "model": args.model,
        "version": args.version,
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if cuda else ""),
        "dtype": dtype_name(model.dtype),
        "load_s": round(load_s, 3),
        "torch": torch.__version__,
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_1m_before": round(load_before[0], 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        },
        "settings": {
            **asdict(limits),
            "max_batch": args.max_batch,
            "knee_gain": args.knee_gain,
            "latency_budget_ms": args.latency_budget_ms,
        },
        "memory": {"kind": probe.kind, "description": probe.description},
        "plot": {"path": str(args.out_png), "width": PLOT_SIZE[0], "height": PLOT_SIZE[1]},
    }
    return build_report(meta, results, rec)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ai-backend sweep``: 0 when at least one size ran; 1 when none did, or when the
    report could not be written (the table is printed first); 2 for bad arguments, an output path
    that cannot be written among them."""
    parser = argparse.ArgumentParser(prog="ai-backend sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=Path("models"), help="model repository root (models)")
    parser.add_argument("--model", help="model name (default: the repository's only model)")
    parser.add_argument("--version", help="version (default: the latest)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "float32", "float16"), default="auto", help="auto: fp16 on CUDA")
    parser.add_argument("--max-batch", type=int, default=64, help="largest size, rounded down to a power of two")
    parser.add_argument("--warmup", type=int, default=3, help="untimed passes per size (default 3)")
    parser.add_argument("--iterations", type=int, default=50, help="most timed passes per size (default 50)")
    parser.add_argument("--seconds-per-size", type=float, default=3.0, help="time budget for each size's passes")
    parser.add_argument("--knee-gain", type=float, default=0.10, help="a doubling must gain this share (0.10)")
    parser.add_argument("--latency-budget-ms", type=float, help="cap the recommendation at this median latency")
    parser.add_argument(
        "--threads", type=int, help="CPU intra-op threads (default: what each of the service's batches runs with)"
    )
    parser.add_argument("--out-json", type=Path, help="default: out/sweep-<model>.json")
    parser.add_argument("--out-png", type=Path, help="default: out/sweep-<model>.png")
    args = parser.parse_args(argv)
    if args.max_batch < 1 or args.iterations < 1 or args.warmup < 0 or (args.threads is not None and args.threads < 1):
        parser.error("need --max-batch >= 1, --iterations >= 1, --warmup >= 0 and --threads >= 1")
    if (
        not 0 < args.seconds_per_size <= 600
        or not 0 < args.knee_gain < 1
        or (args.latency_budget_ms is not None and args.latency_budget_ms <= 0)
    ):
        parser.error("need 0 < --seconds-per-size <= 600, 0 < --knee-gain < 1 (a share) and --latency-budget-ms > 0")
    # the service's threads per batch (two batches side by side on a CPU of two or more cores):
    # a curve timed with every core on one batch recommended a batch for a setup it does not run
    torch.set_num_threads(args.threads or plan_threads(torch.device("cpu"), 0, 0, 0, cpu_cores()).intra_op)
    try:
        model, load_s = _load(args)
    except (LookupError, ValueError, RuntimeError) as exc:  # bad name or version, bad files, no CUDA
        print(f"ai-backend sweep: {exc}", file=sys.stderr)
        return 1
    args.out_json = args.out_json or Path(f"out/sweep-{args.model}.json")
    args.out_png = args.out_png or Path(f"out/sweep-{args.model}.png")
    for flag, path in (("--out-json", args.out_json), ("--out-png", args.out_png)):
        if (why := unwritable(path)) is not None:  # before the sizes are timed, not after
            parser.error(f"{flag} {path}: {why}")
    report = _run(args, model, load_s)
    print(markdown(report))
    if (why := _write(report, args.out_json, args.out_png)) is not None:
        print(f"ai-backend sweep: {why}", file=sys.stderr)
        return 1
    print(f"\nwrote {args.out_json} and {args.out_png}")
    return 0 if report["recommendation"]["knee"] is not None else 1


def _write(report: dict[str, Any], out_json: Path, out_png: Path) -> str | None:
    """Write the JSON report and the plot; None, or which could not be written and why."""
    if (why := write_text(out_json, json.dumps(report, indent=2) + "\n")) is not None:
        return f"could not write {out_json}: {why}"
    try:
        plot(report, out_png)
    except OSError as exc:
        return f"could not write {out_png}: {exc.strerror or exc}"
    return None


if __name__ == "__main__":
    sys.exit(main())
