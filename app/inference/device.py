"""The device: which one, at what precision, its memory, and the one thread that drives it.

All model work runs on a single dedicated thread per device. That keeps the event loop
free and serialises device work, so batches never compete for the same device.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(setting: str) -> torch.device:
    """``auto`` is ``cuda:0`` when CUDA is usable, else the CPU."""
    if setting == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"model.device={setting} but CUDA is not available on this machine")
    return device


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """``auto`` is fp16 on CUDA and fp32 on the CPU (where fp16 is 20-40x slower)."""
    if setting == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return _DTYPES[setting]


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in _DTYPES.items() if value == dtype)


@dataclass(frozen=True)
class Memory:
    """Free and total memory of the device (host RAM for the CPU), in bytes."""

    free: int
    total: int


def memory(device: torch.device) -> Memory:
    """Blocking: CUDA asks the driver, the CPU reads ``/proc/meminfo``."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Memory(free, total)
    fields: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        fields[key] = int(rest.split()[0]) * 1024
    return Memory(fields.get("MemAvailable", 0), fields.get("MemTotal", 0))


class DeviceThread:
    """One daemon thread that runs submitted calls in order.

    A daemon, so a load stuck past its timeout cannot keep the process alive at exit.
    """

    def __init__(self, name: str = "device") -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, future = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((fn, future))
        return future

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device thread and await its result without blocking the loop."""
        return await asyncio.wrap_future(self.submit(fn))

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish what is queued, then stop, and wait for the thread (blocking, bounded).

        Joined rather than left to die with the interpreter: a thread still inside torch at
        interpreter exit can abort the process ("terminate called without an active exception").
        """
        self._calls.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
