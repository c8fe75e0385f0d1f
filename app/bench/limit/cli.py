"""``ai-backend limit``: what this machine could do for one model with no serving layer at all.

The limit is the CPU time one image costs in the best in-process path, turned into
images per second for every CPU the process may use (a fraction under a CPU quota of 1.5)::

    limit = cores / (decode_cpu_s + forward_cpu_s)

- decode: the service's own ``app.inference.preprocess.decode_payload`` (strict base64, then
  ``decode``: JPEG decode, resize, crop, uint8 tensor), on one thread, in thread CPU time;
- forward: the model loaded by the service's own loader, on uint8 batches of the same
  images at each batch size, with one torch intra-op thread (so CPU time is not inflated
  by OpenMP threads spinning), timed in process CPU time per image; the best size wins.
  The same sizes with torch's default thread count are reported beside it.

It is not a sequential decode-then-forward loop: that leaves one core idle while the
other works and under-states what the machine can do. A pipelined run (decode threads
feeding one forward thread, in process) checks that the figure can be reached.
Output: a markdown summary on stdout and a JSON report.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import PIL
import torch
from PIL import Image

from app.bench.limit.every_core import measure_every_core, measure_every_thread
from app.bench.limit.measure import LIMITS, ForwardCost, measure_decode, measure_forward, measure_pipeline
from app.bench.limit.model import load_model, model_repository, tune_runtime
from app.bench.limit.photos import image_files, write_images
from app.bench.limit.report import cores, limit_report, markdown
from app.bench.output import unwritable, write_text
from app.errors import ServiceError
from app.inference import preprocess
from app.inference.device import cpu_cores, cpu_limit
from app.inference.loader import LayeredModel
from app.settings import ServerSettings

DEFAULT_MODEL = "mobilenet_v3_small"
DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32)


# glibc keeping what a batch frees (``app.allocator``): in one thread running one batch size after
# another it saves a third of the forward pass (the service, with its threads, gained nothing)
MALLOC_RETAIN_MB = 1024
RETAIN_MAX_MB: int = next(m.le for m in ServerSettings.model_fields["malloc_retain_mb"].metadata if hasattr(m, "le"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure everything ``args`` asks for and return the JSON report."""
    if args.images is None:
        paths = write_images(args.images_out, args.count, args.seed)
    else:
        paths = image_files(args.images)
        if not paths:
            raise LookupError(f"{args.images} holds no .jpg or .jpeg files")
    tune_runtime(args.malloc_retain_mb)
    data = [p.read_bytes() for p in paths]
    encoded = [base64.b64encode(d).decode("ascii") for d in data]
    sizes = _image_sizes(paths, data)
    default_threads = torch.get_num_threads()
    load_before = os.getloadavg()[0]
    with model_repository(args.repository, args.model) as root:
        model = load_model(root, args.model, args.version)
        _check_images(paths, encoded, model)
        measured = _measure(args, model, root, data, encoded, default_threads)
    width, height = next(iter(sizes)) if len(sizes) == 1 else (0, 0)
    return {
        "model": model.manifest.name,
        "version": model.manifest.version,
        "input": model.manifest.input.model_dump(),
        "images": {
            "count": len(paths),
            "folder": str(paths[0].parent),
            "width": width,
            "height": height,
            "mean_bytes": round(sum(map(len, data)) / len(data)),
            "mean_base64_chars": round(sum(map(len, encoded)) / len(encoded)),
        },
        "host": {
            "machine": platform.machine(),
            "processor": _cpu_model(),
            "cores": round(cores(), 3),
            "torch": torch.__version__,
            "pillow": PIL.__version__,
            "torch_default_threads": default_threads,
            "loadavg_1m_before": round(load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        },
        "settings": {
            "seconds": args.seconds,
            "batch_sizes": list(args.batch_sizes),
            "malloc_retain_mb": args.malloc_retain_mb,
        },
        **measured,
    }


def _image_sizes(paths: Sequence[Path], data: Sequence[bytes]) -> set[tuple[int, int]]:
    """The sizes of the images, each of ``data`` read from the path beside it. One Pillow cannot
    open is a ``ValueError`` naming its file: Pillow's own names a ``BytesIO``, not which one."""
    sizes = set()
    for path, image in zip(paths, data, strict=True):
        try:
            with Image.open(io.BytesIO(image)) as opened:
                sizes.add(opened.size)
        except (OSError, ValueError) as exc:  # PIL.UnidentifiedImageError is an OSError
            raise ValueError(f"{path} is not an image Pillow can open ({type(exc).__name__})") from None
    return sizes


def _check_images(paths: Sequence[Path], encoded: Sequence[str], model: LayeredModel) -> None:
    """Each image once through the service's decode before anything is timed: one it would refuse
    (too large, truncated) is a ``ValueError`` naming its file, not the decode's bare error."""
    for path, text in zip(paths, encoded, strict=True):
        try:
            preprocess.decode_payload(text, model.manifest.input, LIMITS)
        except ServiceError as exc:
            raise ValueError(f"{path}: the service would refuse it ({exc.code}: {exc.message})") from None


def _measure(
    args: argparse.Namespace,
    model: LayeredModel,
    root: Path,
    data: Sequence[bytes],
    encoded: Sequence[str],
    default_threads: int,
) -> dict[str, Any]:
    spec = model.manifest.input
    print("timing decode", file=sys.stderr, flush=True)
    decode = measure_decode(encoded, spec, args.seconds)
    tensors = [preprocess.decode(d, spec, LIMITS) for d in data]
    print("timing forward, 1 torch thread", file=sys.stderr, flush=True)
    forward_one = measure_forward(model, tensors, args.batch_sizes, 1, args.seconds)
    forward_default: list[ForwardCost] = []
    if default_threads > 1:
        print(f"timing forward, {default_threads} torch threads", file=sys.stderr, flush=True)
        forward_default = measure_forward(model, tensors, args.batch_sizes, default_threads, args.seconds)
    limit = limit_report(decode, forward_one, forward_default, cpu_limit())
    pipeline = []
    if args.pipeline_seconds > 0:
        print("pipelined run", file=sys.stderr, flush=True)
        whole = cpu_cores()
        for threads in sorted({1, max(1, whole - 1), whole}):
            result = measure_pipeline(model, encoded, spec, limit["best_batch"], threads, args.pipeline_seconds)
            pipeline.append(asdict(result))
    every_core = every_thread = None
    if args.every_core_seconds > 0:
        print(f"every core at once ({cpu_cores()} processes)", file=sys.stderr, flush=True)
        every_core = measure_every_core(
            root, args.model, args.version, encoded, limit["best_batch"], args.every_core_seconds, args.malloc_retain_mb
        )
        limit["every_core_images_per_s"] = every_core.images_per_s
        print(f"every core at once in one process ({cpu_cores()} threads)", file=sys.stderr, flush=True)
        switch_ms = ServerSettings.model_fields["switch_interval_ms"].default
        every_thread = measure_every_thread(model, encoded, limit["best_batch"], args.every_core_seconds, switch_ms)
        limit["every_thread_images_per_s"] = every_thread.images_per_s
    return {
        "limit": limit,
        "pipeline": pipeline,
        "every_core": asdict(every_core) if every_core else None,
        "every_thread": asdict(every_thread) if every_thread else None,
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("batch sizes are positive integers, comma-separated")
    return sizes


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ai-backend limit``: 0 on success; 1 when the model or images are missing, or when
    the report could not be written (it is printed first); 2 for bad arguments, an ``--out`` that
    cannot be written among them."""
    parser = argparse.ArgumentParser(prog="ai-backend limit", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repository", type=Path, help="model repository (exported into when the model is absent; default: a temp dir)"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model name (default: {DEFAULT_MODEL})")
    parser.add_argument("--version", help="version (default: the latest)")
    parser.add_argument("--images", type=Path, help="a folder of JPEGs (default: generate --count synthetic photos)")
    parser.add_argument("--images-out", type=Path, default=Path("out/images"), help="where generated images go")
    parser.add_argument("--count", type=int, default=8, help="synthetic photos to generate (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic photos")
    parser.add_argument("--batch-sizes", type=_sizes, default=DEFAULT_SIZES, help="comma-separated (1,2,4,...,32)")
    parser.add_argument("--seconds", type=float, default=2.0, help="CPU seconds per timed measurement (default 2)")
    parser.add_argument(
        "--pipeline-seconds", type=float, default=4.0, help="seconds of each pipelined check; 0 skips it"
    )
    parser.add_argument(
        "--every-core-seconds",
        type=float,
        default=6.0,
        help="seconds of the run with one process per core, all at once, and of the same with one thread "
        "per core in this process; 0 skips both",
    )
    parser.add_argument(
        "--malloc-retain-mb",
        type=int,
        default=MALLOC_RETAIN_MB,
        help=f"glibc keeps this much freed memory for the next batch, as server.malloc_retain_mb does in "
        f"the service (here {MALLOC_RETAIN_MB} by default, the fastest for one thread; 0: glibc's defaults; "
        f"at most {RETAIN_MAX_MB})",
    )
    parser.add_argument("--out", type=Path, default=Path("out/limit.json"), help="the JSON report")
    args = parser.parse_args(argv)
    if (
        args.count < 1
        or not 0 < args.seconds <= 120
        or not all(0 <= s <= 120 for s in (args.pipeline_seconds, args.every_core_seconds))
    ):
        parser.error("need --count >= 1, 0 < --seconds <= 120 and 0 <= --pipeline-seconds, --every-core-seconds <= 120")
    if not 0 <= args.malloc_retain_mb <= RETAIN_MAX_MB:  # glibc takes a C int of bytes
        parser.error(f"need 0 <= --malloc-retain-mb <= {RETAIN_MAX_MB}, as server.malloc_retain_mb")
    if (why := unwritable(args.out)) is not None:  # before minutes of measuring, not after
        parser.error(f"--out {args.out}: {why}")
    try:
        report = run(args)
    except (LookupError, OSError, ValueError, RuntimeError, ServiceError) as exc:  # an image the service refuses
        print(f"ai-backend limit: {exc}", file=sys.stderr)
        return 1
    print(markdown(report))
    if (why := write_text(args.out, json.dumps(report, indent=2) + "\n")) is not None:
        print(f"ai-backend limit: could not write {args.out}: {why}", file=sys.stderr)
        return 1
    print(f"\nwrote {args.out}")
    return 0
