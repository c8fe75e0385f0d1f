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
Output: a markdown table on stdout, a JSON report and a PNG plot. The JSON is written after
every size (atomically, ``"complete": false`` until the last), so that a size the kernel's OOM
killer ends keeps the sizes before it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from app.bench.chart import PLOT_SIZE, plot
from app.bench.output import unwritable, write_text
from app.bench.sweep.knee import recommend
from app.bench.sweep.memory import CudaMemory, MemoryProbe, ProcessMemory
from app.bench.sweep.report import build_report, markdown
from app.bench.sweep.timing import Limits, SizeResult, batch_sizes, sweep
from app.inference.device import cpu_cores, plan_threads

MAX_BATCH_WARNING = 4096  # past it, a size on a host is likely to need more memory than the host has


def _load(args: argparse.Namespace) -> tuple[Any, float]:
    from app.inference.device import resolve_device, resolve_dtype
    from app.inference.loader import LayeredModel
    from app.inference.repository import Repository

    repository = Repository(args.repository)
    entries = {entry.name: entry for entry in repository.models()}
    if args.model is None and len(entries) == 1:
        args.model = next(iter(entries))
    if args.model is None and not entries:
        raise LookupError(f"{args.repository} holds no model")
    if args.model is None:  # it said "model None is not in" the repository
        raise LookupError(f"--model is needed: {args.repository} holds several models ({', '.join(sorted(entries))})")
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

    if not cuda and model.dtype != torch.float32:
        print("note: reduced precision on the CPU is many times slower than float32", file=sys.stderr)
    load_before = os.getloadavg()
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
    done: list[SizeResult] = []

    def report(complete: bool) -> dict[str, Any]:
        meta["host"]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
        meta["memory"]["description"] = probe.description  # it says when the peak could not be reset
        rec = recommend(done, args.knee_gain, args.latency_budget_ms)
        return {**build_report(meta, done, rec), "complete": complete}

    def progress(r: SizeResult) -> None:
        detail = "out of memory" if r.status == "oom" else f"{r.iterations} passes, median {r.median_ms:.2f} ms"
        print(f"batch {r.batch_size}: {detail}", file=sys.stderr, flush=True)
        done.append(r)
        # every size's results on disk as it ends: a larger size that the kernel's OOM killer ends
        # (it kills; it does not raise) leaves the sizes before it, marked "complete": false
        if (why := write_text(args.out_json, json.dumps(report(False), indent=2) + "\n")) is not None:
            print(f"ai-backend sweep: could not write {args.out_json}: {why}", file=sys.stderr, flush=True)

    sweep(
        forward,
        lambda size: model.batch(list(model.dummy_batch(size))),
        batch_sizes(args.max_batch),
        probe,
        limits,
        sync=(lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None),
        on_result=progress,
    )
    return report(True)


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
    if args.max_batch > MAX_BATCH_WARNING:
        print(
            f"ai-backend sweep: warning: --max-batch {args.max_batch} is over {MAX_BATCH_WARNING}: a size past the "
            "machine's memory may be killed by the kernel's OOM killer rather than fail; each size's results are "
            "written to --out-json as it ends, so the sizes before it are kept",
            file=sys.stderr,
        )
    if args.max_batch < 1 or args.iterations < 1 or args.warmup < 0 or (args.threads is not None and args.threads < 1):
        parser.error("need --max-batch >= 1, --iterations >= 1, --warmup >= 0 and --threads >= 1")
    if (
        not 0 < args.seconds_per_size <= 600
        or not 0 < args.knee_gain < 1
        # nan or inf passed "> 0" and crashed the plot after every size was timed (NaN in the JSON)
        or (args.latency_budget_ms is not None and not 0 < args.latency_budget_ms < math.inf)
    ):
        parser.error(
            "need 0 < --seconds-per-size <= 600, 0 < --knee-gain < 1 (a share) and a finite --latency-budget-ms > 0"
        )
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
