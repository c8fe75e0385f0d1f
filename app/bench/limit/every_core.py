"""Every core at once with no serving layer: one process per core, each decoding and running its
own batches."""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.bench.limit.measure import LIMITS
from app.bench.limit.model import load_model, tune_runtime
from app.inference import preprocess
from app.inference.device import cpu_cores


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
