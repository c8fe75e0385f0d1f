"""Every core at once with no serving layer: one process per core, each decoding and running its
own batches; and the same in one process, one thread per core, the threads sharing the GIL."""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.bench.limit.measure import LIMITS, torch_threads
from app.bench.limit.model import load_model, tune_runtime
from app.inference import preprocess
from app.inference.device import cpu_cores
from app.inference.loader import LayeredModel


@dataclass(frozen=True)
class EveryCore:
    """Images per second with one process per core, each decoding and running its own batches."""

    processes: int
    batch_size: int
    images: int
    seconds: float
    images_per_s: float
    per_process: tuple[float, ...]


@dataclass(frozen=True)
class EveryThread:
    """Images per second with one thread per core in one process, each decoding and running its
    own batches, at the GIL switch interval the service serves with."""

    threads: int
    batch_size: int
    images: int
    seconds: float
    images_per_s: float
    per_thread: tuple[float, ...]
    switch_interval_ms: float


START_LINE_S = 300.0  # how long a process of the every-core run waits for the others to load


def one_batch(model: LayeredModel, encoded: Sequence[str], batch_size: int, offset: int) -> None:
    """The best in-process path for one batch: decode ``batch_size`` images as the service does
    (``encoded`` from ``offset`` on, round the list), run them, take the top classes."""
    spec, k = model.manifest.input, min(5, len(model.manifest.labels))
    images = [preprocess.decode_payload(encoded[(offset + i) % len(encoded)], spec, LIMITS) for i in range(batch_size)]
    model.probabilities(model.batch(images)).topk(k, dim=1)


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
        done = 0
        with torch.inference_mode():
            one_batch(model, encoded, batch_size, 0)  # the first pass at this shape pays for its plan
            start.wait(START_LINE_S)  # broken (raises) when another process failed first
            started = time.perf_counter()
            while time.perf_counter() - started < seconds:
                one_batch(model, encoded, batch_size, done)
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


def measure_every_thread(
    model: LayeredModel, encoded: Sequence[str], batch_size: int, seconds: float, switch_interval_ms: float
) -> EveryThread:
    """Every core at once in one process: ``measure_every_core``'s loop on one thread per core.

    The decode (simplejpeg, torch's resize) and the forward pass let go of the GIL, and the
    threads take it back for their Python in between, as the service's threads do, at the
    switch interval it serves with (``server.switch_interval_ms``, set here for the run). Against
    the processes' figure it tells what one process and its GIL cost with no serving layer and
    no hand-off between threads; against the service's core (``ai-backend core``), what its
    pipeline costs (a decode thread feeding device threads through the batcher).
    ``RuntimeError`` when a thread fails.
    """
    count = cpu_cores()
    start = threading.Barrier(count + 1)
    done, failed = [0] * count, []
    end = [float("inf")]  # set once every thread is warm and at the start line

    def work(index: int) -> None:
        try:
            with torch.inference_mode():
                one_batch(model, encoded, batch_size, index)  # warm this thread at this shape
                start.wait(START_LINE_S)
                while time.perf_counter() < end[0]:
                    one_batch(model, encoded, batch_size, done[index])
                    done[index] += batch_size
        except BaseException as exc:
            failed.append(f"{type(exc).__name__}: {exc}")
            start.abort()

    saved = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_ms / 1000)
    threads = [threading.Thread(target=work, args=(n,), name=f"every-thread-{n}", daemon=True) for n in range(count)]
    try:
        with torch_threads(1):
            for thread in threads:
                thread.start()
            with contextlib.suppress(threading.BrokenBarrierError):  # a thread failed: it says why below
                start.wait(START_LINE_S)
            started = time.perf_counter()
            end[0] = started + seconds
            for thread in threads:
                thread.join()
            elapsed = time.perf_counter() - started
    finally:
        end[0] = 0.0
        sys.setswitchinterval(saved)
    if failed:
        raise RuntimeError(f"a thread of the every-core run failed: {failed[0]}")
    rates, images = tuple(round(n / elapsed, 1) for n in done), sum(done)
    rate = round(images / elapsed, 1)
    return EveryThread(count, batch_size, images, round(elapsed, 3), rate, rates, switch_interval_ms)
