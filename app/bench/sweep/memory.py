"""What one batch size takes in memory: the CUDA allocator's peaks, or the process's resident set."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

import torch


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
        # RSS at the first size's start (after the load and its self-check): sizes run in order in one
        # process, and a size's own start holds what the allocators kept from the sizes before it, so
        # growth over it reads as the difference between sizes, not as what a size needs
        self._baseline: int | None = None
        self.peak_resets = True
        self.description = (
            "process RSS (/proc/self/status, whole process, includes allocator caches): "
            "peak RSS above post-load baseline = peak RSS (VmHWM) during the size - RSS (VmRSS) after the load, "
            "before the first size; growth = peak RSS during the size - RSS at its start (what earlier sizes "
            "left cached is not counted again); VmHWM is reset before each size through /proc/self/clear_refs"
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
        if self._baseline is None:
            self._baseline = self._before

    def stop(self) -> dict[str, int]:
        now = self._read()
        peak = now.get("VmHWM", 0)
        baseline = self._before if self._baseline is None else self._baseline
        return {
            "rss_before_bytes": self._before,
            "peak_rss_bytes": peak,
            "rss_after_bytes": now.get("VmRSS", 0),
            "growth_bytes": max(0, peak - self._before),
            "baseline_rss_bytes": baseline,
            "peak_above_baseline_bytes": max(0, peak - baseline),
        }
