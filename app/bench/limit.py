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
import queue
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torch
from PIL import Image, ImageDraw, ImageFilter

from app.allocator import retain_freed_memory
from app.bench.output import unwritable, write_text
from app.errors import ServiceError
from app.inference import preprocess
from app.inference.device import CpuLimit, cpu_cores, cpu_limit, size_primitive_cache
from app.inference.loader import LayeredModel
from app.inference.manifest import InputSpec
from app.settings import ModelSettings, ServerSettings

DEFAULT_MODEL = "mobilenet_v3_small"
DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32)
IMAGE_SUFFIXES = (".jpg", ".jpeg")
# the service's defaults (server.max_image_bytes, server.max_image_pixels)
LIMITS = preprocess.ImageLimits(max_bytes=1 << 20, max_pixels=16_000_000)
SERVE_BATCH_TOLERANCE = 1.05  # the serving batch: the largest whose CPU per image is within 5% of the best
# glibc keeping what a batch frees (``app.allocator``): in one thread running one batch size after
# another it saves a third of the forward pass (the service, with its threads, gained nothing)
MALLOC_RETAIN_MB = 1024
RETAIN_MAX_MB: int = next(m.le for m in ServerSettings.model_fields["malloc_retain_mb"].metadata if hasattr(m, "le"))
PRIMITIVE_CACHE: int = ModelSettings.model_fields["onednn_primitive_cache"].default

Clock = Callable[[], float]


def cores() -> float:
    """The CPUs this process may use, as the service counts them: its affinity mask, capped
    by a container's CPU quota (counting the mask alone doubled a limit in a 2-core container
    on a 4-CPU node, and halved its ratio). A fraction stays one: a quota of 1.5 CPUs does 1.5
    CPUs' worth of images, where the service, planning whole threads, counts 2 (``cpu_cores``)."""
    return cpu_limit().cpus


def synthetic_photo(seed: int, width: int = 640, height: int = 480, quality: int = 90) -> bytes:
    """A deterministic photo-like JPEG: smooth colour gradients, filled shapes, soft edges, sensor noise.

    Flat or random images would mislead: JPEG decode time depends on how much detail
    survives quantisation, and these land near a real photo's size (about 70 KB here).
    """
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.empty((height, width, 3), np.float32)
    for channel in range(3):
        a, b, phase, tilt = rng.uniform(-1, 1, 4)
        base[..., channel] = 128 + 60 * np.sin(a * x / 90 + b * y / 70 + phase * 6) + 40 * tilt * (x / width - 0.5)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        box = (x0, y0, x0 + int(rng.integers(20, 250)), y0 + int(rng.integers(20, 200)))
        colour = (int(rng.integers(0, 256)), int(rng.integers(0, 256)), int(rng.integers(0, 256)))
        if rng.integers(0, 2):
            draw.ellipse(box, fill=colour)
        else:
            draw.rectangle(box, fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(1.5))
    noisy = np.asarray(image, dtype=np.float32) + rng.normal(0, 6, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def write_images(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` synthetic photos as ``folder/photo_NNN.jpg`` (rewritten every time, deterministic)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        path = folder / f"photo_{index:03d}.jpg"
        path.write_bytes(synthetic_photo(seed * 1000 + index))
        paths.append(path)
    return paths


def image_files(folder: Path) -> list[Path]:
    """The JPEGs in ``folder``, by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


@dataclass(frozen=True)
class Cost:
    """CPU seconds per call: the median and the best of several rounds."""

    median_s: float
    min_s: float
    calls: int

    @property
    def median_ms(self) -> float:
        return self.median_s * 1000


def cpu_cost(
    fn: Callable[[int], object], items: int, seconds: float, rounds: int = 5, clock: Clock = time.thread_time
) -> Cost:
    """CPU time per call of ``fn(i)`` for ``i`` cycling over ``range(items)``.

    One warm-up pass over every item, then ``rounds`` rounds of at least ``seconds / rounds``
    CPU seconds each (and at least one pass over the items). The median round is the
    figure: CPU time hardly depends on other processes, but caches and clocks do a little.
    """
    for index in range(items):
        fn(index)
    per_round = seconds / max(1, rounds)
    results, calls = [], 0
    for _ in range(max(1, rounds)):
        done = 0
        started = clock()
        while done < items or clock() - started < per_round:
            fn(done % items)
            done += 1
        results.append((clock() - started) / done)
        calls += done
    return Cost(statistics.median(results), min(results), calls)


@dataclass(frozen=True)
class DecodeCost:
    """One image through base64 and the service's decode, in CPU milliseconds (median)."""

    base64_ms: float
    decode_ms: float
    total_ms: float
    total_min_ms: float


def measure_decode(encoded: Sequence[str], spec: InputSpec, seconds: float) -> DecodeCost:
    """The service's own path, on this thread: ``preprocess.base64_bytes``, ``preprocess.decode``, and
    both together (``preprocess.decode_payload``, what the decode pool runs for a JSON body)."""
    raw = [preprocess.base64_bytes(text) for text in encoded]
    b64 = cpu_cost(lambda i: preprocess.base64_bytes(encoded[i]), len(encoded), seconds / 4)
    dec = cpu_cost(lambda i: preprocess.decode(raw[i], spec, LIMITS), len(raw), seconds)
    total = cpu_cost(lambda i: preprocess.decode_payload(encoded[i], spec, LIMITS), len(encoded), seconds)
    return DecodeCost(
        round(b64.median_ms, 4), round(dec.median_ms, 4), round(total.median_ms, 4), round(total.min_s * 1000, 4)
    )


@dataclass(frozen=True)
class ForwardCost:
    """One batch size: CPU and wall milliseconds per image (medians of the timed rounds)."""

    batch_size: int
    threads: int
    cpu_ms_per_image: float
    wall_ms_per_image: float
    passes: int


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_batch(model: LayeredModel, tensors: Sequence[torch.Tensor], size: int) -> torch.Tensor:
    """A uint8 batch of ``size`` of the decoded images, cycling through them, laid out as the model takes it."""
    return model.batch([tensors[i % len(tensors)] for i in range(size)])


def measure_forward(
    model: LayeredModel,
    tensors: Sequence[torch.Tensor],
    sizes: Sequence[int],
    threads: int,
    seconds: float,
    rounds: int = 3,
    seed: int = 0,
) -> list[ForwardCost]:
    """Normalise + backbone + head + softmax + top-k of a ready uint8 batch, per size.

    The batch is formed before timing: the best in-process path decodes straight into it.
    The sizes are timed in ``rounds`` interleaved rounds, in a shuffled order each round, and
    each size's figure is the median of its rounds. Timed one after another, in order, the
    sizes would each get a different stretch of the machine's drifting speed (other tenants),
    and the best of figures taken once each favours a lucky one: in one such run batch 12
    measured 2.56 ms per image while 8 and 16 measured 3.6, and the limit took the 2.56.
    """
    k = min(5, len(model.manifest.labels))
    order = random.Random(seed)
    cpu: dict[int, list[float]] = {size: [] for size in sizes}
    wall: dict[int, list[float]] = {size: [] for size in sizes}
    passes = dict.fromkeys(sizes, 0)
    with torch_threads(threads), torch.inference_mode():
        batches = {size: make_batch(model, tensors, size) for size in sizes}
        for batch in batches.values():
            model.probabilities(batch)  # the first pass at a new shape pays for its plan
        for _ in range(max(1, rounds)):
            for size in order.sample(list(sizes), len(sizes)):
                batch = batches[size]

                def forward(_: int, batch: torch.Tensor = batch) -> object:
                    return model.probabilities(batch).topk(k, dim=1)

                wall_started = time.perf_counter()
                cost = cpu_cost(forward, 1, seconds / max(1, rounds), rounds=1, clock=time.process_time)
                cpu[size].append(cost.median_s * 1000 / size)
                wall[size].append((time.perf_counter() - wall_started) * 1000 / ((cost.calls + 1) * size))
                passes[size] += cost.calls
    return [
        ForwardCost(
            size, threads, round(statistics.median(cpu[size]), 4), round(statistics.median(wall[size]), 4), passes[size]
        )
        for size in sizes
    ]


@dataclass(frozen=True)
class Pipeline:
    """Images per second through decode threads feeding one forward thread, in process."""

    decode_threads: int
    batch_size: int
    images: int
    seconds: float
    images_per_s: float


def measure_pipeline(
    model: LayeredModel, encoded: Sequence[str], spec: InputSpec, batch_size: int, decode_threads: int, seconds: float
) -> Pipeline:
    """What the machine does in process when decoding overlaps the forward pass.

    ``decode_threads`` threads decode (base64 + the service's decode) into a bounded
    queue; this thread forms batches of ``batch_size`` and runs them with one torch thread.
    """
    ready: queue.Queue[torch.Tensor] = queue.Queue(maxsize=batch_size * 4)
    stop = threading.Event()
    k = min(5, len(model.manifest.labels))

    def decoder(offset: int) -> None:
        index = offset
        while not stop.is_set():
            tensor = preprocess.decode_payload(encoded[index % len(encoded)], spec, LIMITS)
            index += decode_threads
            while not stop.is_set():
                try:
                    ready.put(tensor, timeout=0.05)
                    break
                except queue.Full:
                    continue

    workers = [threading.Thread(target=decoder, args=(n,), daemon=True) for n in range(decode_threads)]
    for worker in workers:
        worker.start()
    done = 0
    try:
        with torch_threads(1), torch.inference_mode():
            model.probabilities(make_batch(model, [ready.get()], batch_size))  # warm, and wait for the decoders
            started = time.perf_counter()
            while time.perf_counter() - started < seconds:
                batch = model.batch([ready.get() for _ in range(batch_size)])
                model.probabilities(batch).topk(k, dim=1)
                done += batch_size
            elapsed = time.perf_counter() - started
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    return Pipeline(decode_threads, batch_size, done, round(elapsed, 3), round(done / elapsed, 1))


def tune_runtime(malloc_retain_mb: int) -> None:
    """The fastest in-process path: oneDNN's cache as the service sizes it, glibc keeping freed memory.
    Before any model runs, in every process that measures."""
    size_primitive_cache(PRIMITIVE_CACHE)
    if malloc_retain_mb:
        retain_freed_memory(malloc_retain_mb << 20)


@dataclass(frozen=True)
class EveryCore:
    """Images per second with one process per core, each decoding and running its own batches."""

    processes: int
    batch_size: int
    images: int
    seconds: float
    images_per_s: float
    per_process: tuple[float, ...]


START_LINE_S = 300.0  # how long a process of the every-core run waits for the others to load


def _core_loop(
    root: str,
    name: str,
    version: str | None,
    encoded: Sequence[str],
    batch_size: int,
    seconds: float,
    start: Any,
    results: Any,
    malloc_retain_mb: int = 0,
) -> None:
    """One process of ``measure_every_core``: decode a batch, run it, again, for ``seconds``.
    It puts ``(images, seconds)`` on ``results``, or the reason it failed (a string)."""
    try:
        torch.set_num_threads(1)
        tune_runtime(malloc_retain_mb)
        model = load_model(Path(root), name, version)
        spec, k = model.manifest.input, min(5, len(model.manifest.labels))

        def one_batch(offset: int) -> None:
            batch = model.batch(
                [
                    preprocess.decode_payload(encoded[(offset + i) % len(encoded)], spec, LIMITS)
                    for i in range(batch_size)
                ]
            )
            model.probabilities(batch).topk(k, dim=1)

        done = 0
        with torch.inference_mode():
            one_batch(0)  # the first pass at this shape pays for its plan
            start.wait(START_LINE_S)  # broken (raises) when another process failed first
            started = time.perf_counter()
            while time.perf_counter() - started < seconds:
                one_batch(done)
                done += batch_size
            results.put((done, time.perf_counter() - started))
    except BaseException as exc:
        start.abort()  # the others stop waiting for this one
        results.put(f"{type(exc).__name__}: {exc}")
        raise


def measure_every_core(
    root: Path,
    name: str,
    version: str | None,
    encoded: Sequence[str],
    batch_size: int,
    seconds: float,
    malloc_retain_mb: int = 0,
) -> EveryCore:
    """What the machine does with no serving layer and every core at work at once.

    The limit adds up costs timed on one core while the others idle; cores busy together
    share caches, memory bandwidth and (on a VM) the host, and each gets slower. Here one
    process per core, started together, runs the best in-process path on its own (decode a
    batch of images on its thread, run the batch with one torch thread): their sum is what
    the machine reaches with no serving layer and no coordination at all. ``RuntimeError``
    when a process fails or dies: at once, not after the others' wait for the start line.
    """
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # torch and fork do not mix
    count = cpu_cores()  # whole processes: on a quota of 1.5 CPUs, two share it
    start, results = context.Barrier(count), context.Queue()
    args = (str(root), name, version, list(encoded), batch_size, seconds, start, results, malloc_retain_mb)
    processes = [context.Process(target=_core_loop, args=args, daemon=True) for _ in range(count)]
    for process in processes:
        process.start()
    timings: list[tuple[int, float]] = []
    try:
        deadline = time.monotonic() + START_LINE_S + seconds + 60
        while len(timings) < count:
            try:
                got = results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"exited with code {dead[0].exitcode}" if dead else "did not finish in time"
                    raise RuntimeError(f"a process of the every-core run {why}") from None
                continue
            if isinstance(got, str):
                raise RuntimeError(f"a process of the every-core run failed: {got}")
            timings.append(got)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    rates = tuple(round(done / elapsed, 1) for done, elapsed in timings)
    return EveryCore(count, batch_size, sum(done for done, _ in timings), seconds, round(sum(rates), 1), rates)


@contextlib.contextmanager
def model_repository(root: Path | None, name: str) -> Iterator[Path]:
    """``root`` when it holds ``name``; else ``name`` exported (``--seed 0``) into ``root`` or a temporary one."""
    from app.inference.export import export_torchvision

    temporary = root is None
    folder = Path(tempfile.mkdtemp(prefix="ai-backend-limit-")) if root is None else root
    try:
        if not (folder / name).is_dir():
            print(f"exporting {name} (seed 0) into {folder}", file=sys.stderr, flush=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch.jit deprecation notices
                export_torchvision(name, folder, seed=0)
        yield folder
    finally:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)


def load_model(root: Path, name: str, version: str | None) -> LayeredModel:
    """The model on the CPU in fp32, through the service's own loader, every head loaded."""
    from app.inference.repository import Repository

    repository = Repository(root)
    entries = {entry.name: entry for entry in repository.models()}
    if name not in entries:
        raise LookupError(f"model {name!r} is not in {root} (it holds: {', '.join(entries) or 'none'})")
    version = version or entries[name].latest
    model = LayeredModel.load(
        repository.folder(name, version), repository.manifest(name, version), torch.device("cpu"), torch.float32
    )
    model.load_all_heads()
    return model


def limit_report(
    decode: DecodeCost, forward_one: Sequence[ForwardCost], forward_default: Sequence[ForwardCost], cpus: CpuLimit
) -> dict[str, Any]:
    """The limit from the measured costs: the best batch (one torch thread) plus decode, for
    the CPUs the process may use (``cpus``, a fraction under a CPU quota; the report says what set it)."""
    best = min(forward_one, key=lambda r: r.cpu_ms_per_image)
    per_image_ms = decode.total_ms + best.cpu_ms_per_image
    # past the knee the curve is flat within the host's noise, and which size measures best
    # is luck; the largest one within SERVE_BATCH_TOLERANCE of the best serves with the fewest batches
    near = [r.batch_size for r in forward_one if r.cpu_ms_per_image <= best.cpu_ms_per_image * SERVE_BATCH_TOLERANCE]
    return {
        "cores": round(cpus.cpus, 3),
        "cores_from": cpus.source,
        "decode_cpu_ms": decode.total_ms,
        "forward_cpu_ms": best.cpu_ms_per_image,
        "best_batch": best.batch_size,
        "serve_batch": max(near),
        "cpu_ms_per_image": round(per_image_ms, 4),
        "images_per_s": round(cpus.cpus / (per_image_ms / 1000), 1),
        "formula": "cores (the CPUs the process may use, fractional) / "
        "(decode_cpu_s + forward_cpu_s at the best batch, 1 torch thread)",
        "decode": asdict(decode),
        "forward_1_thread": [asdict(r) for r in forward_one],
        "forward_default_threads": [asdict(r) for r in forward_default],
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as a short markdown summary."""
    limit, decode = report["limit"], report["limit"]["decode"]
    lines = [
        f"## limit: {report['model']} v{report['version']}, {report['images']['count']} images "
        f"{report['images']['width']}x{report['images']['height']} "
        f"(mean {report['images']['mean_bytes'] / 1024:.0f} KiB), {limit['cores']:g} cores ({limit['cores_from']})",
        "",
        f"- decode (base64 + preprocess.decode, one thread): {decode['total_ms']:.3f} ms CPU per image "
        f"(base64 {decode['base64_ms']:.3f}, decode {decode['decode_ms']:.3f})",
        f"- forward at the best batch ({limit['best_batch']}, one torch thread): "
        f"{limit['forward_cpu_ms']:.3f} ms CPU per image; the largest batch within 5% of it: {limit['serve_batch']}",
        f"- **limit: {limit['images_per_s']:.1f} images/s** = {limit['cores']:g} / {limit['cpu_ms_per_image']:.3f} ms",
        "",
        "| batch | 1 thread: CPU ms/img | 1 thread: wall ms/img | "
        f"{report['host']['torch_default_threads']} threads: CPU ms/img | wall ms/img |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    default = {r["batch_size"]: r for r in limit["forward_default_threads"]}
    for row in limit["forward_1_thread"]:
        other = default.get(row["batch_size"])
        tail = f"{other['cpu_ms_per_image']:.3f} | {other['wall_ms_per_image']:.3f}" if other else "- | -"
        lines.append(
            f"| {row['batch_size']} | {row['cpu_ms_per_image']:.3f} | {row['wall_ms_per_image']:.3f} | {tail} |"
        )
    if every := report.get("every_core"):
        lines.append(
            f"\nevery core at once, no serving layer ({every['processes']} processes, each decoding and running "
            f"batches of {every['batch_size']}): {every['images_per_s']:.1f} images/s = "
            f"{every['images_per_s'] / limit['images_per_s']:.2f} of the limit"
        )
    for run in report.get("pipeline", []):
        lines.append(
            f"\npipelined in process ({run['decode_threads']} decode threads + 1 forward thread, batch "
            f"{run['batch_size']}): {run['images_per_s']:.1f} images/s = "
            f"{run['images_per_s'] / limit['images_per_s']:.2f} of the limit"
        )
    return "\n".join(lines)


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
    sizes = {Image.open(io.BytesIO(d)).size for d in data}
    default_threads = torch.get_num_threads()
    load_before = os.getloadavg()[0]
    with model_repository(args.repository, args.model) as root:
        model = load_model(root, args.model, args.version)
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
    every_core = None
    if args.every_core_seconds > 0:
        print(f"every core at once ({cpu_cores()} processes)", file=sys.stderr, flush=True)
        every_core = measure_every_core(
            root, args.model, args.version, encoded, limit["best_batch"], args.every_core_seconds, args.malloc_retain_mb
        )
        limit["every_core_images_per_s"] = every_core.images_per_s
    return {"limit": limit, "pipeline": pipeline, "every_core": asdict(every_core) if every_core else None}


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(int(part) for part in text.split(","))
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
        help="seconds of the run with one process per core, all at once; 0 skips it",
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


if __name__ == "__main__":
    sys.exit(main())
