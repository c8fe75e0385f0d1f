"""The process tuned for serving: the GIL switch interval, the garbage collector, the allocator.

- **Switch interval.** The event loop holds the GIL most of the time; at Python's default
  5 ms a device or decode thread coming back from a torch or Pillow call can wait that long
  for it, once per call.
- **Garbage collector.** A loaded model server holds a few hundred thousand long-lived
  objects (torch, the model, FastAPI, pydantic). A full collection walks all of them with
  the GIL held, about 150-250 ms on these machines, stalling the event loop and every
  thread that needs the GIL; under load it came every few seconds and set the p99. Once the
  models are loaded and warm, ``gc.freeze()`` moves everything alive into the permanent
  generation, which no collection walks again; later collections see only what serving
  allocates. The young generation's threshold is raised so fewer short-lived request
  objects are caught alive and promoted.

- **Allocator.** With ``server.malloc_retain_mb`` (on by default), freed activations kept for
  the next batch on every thread (``app.allocator``).

``Tuning`` applies that at start-up and puts back what it found at close. It is process-wide
state: services sharing a process (tests, embedders) should close in the reverse order of
their start, each putting back what the one before it had set.
"""

from __future__ import annotations

import gc
import sys

from app.allocator import retain_freed_memory


class Tuning:
    def __init__(
        self, switch_interval_s: float, gc_freeze: bool, gc_young_threshold: int, malloc_retain_bytes: int = 0
    ) -> None:
        self.switch_interval_s = switch_interval_s
        self.gc_freeze = gc_freeze
        self.gc_young_threshold = gc_young_threshold
        self.malloc_retain_bytes = malloc_retain_bytes
        self._saved: tuple[float, tuple[int, int, int]] | None = None
        self.frozen = False

    def apply(self) -> None:
        self._saved = (sys.getswitchinterval(), gc.get_threshold())
        sys.setswitchinterval(self.switch_interval_s)
        if self.gc_young_threshold > 0:
            _, *older = gc.get_threshold()
            gc.set_threshold(self.gc_young_threshold, *older)
        if self.malloc_retain_bytes > 0:  # for the rest of the process: glibc cannot go back to adjusting them
            retain_freed_memory(self.malloc_retain_bytes)

    def freeze(self) -> None:
        """Collect what start-up left as garbage, then move everything alive out of the
        collector's way. Called once the models are loaded and warm."""
        if self.gc_freeze:
            gc.collect()
            gc.freeze()
            self.frozen = True

    def collect_unloaded(self) -> None:
        """After a model version is dropped: frozen objects are never collected, and a model
        holds reference cycles, so thaw, collect (one full pass, a few hundred milliseconds
        with the GIL held: an admin operation's cost) and freeze again."""
        if self.frozen:
            gc.unfreeze()
        gc.collect()
        if self.frozen:
            gc.freeze()

    def restore(self) -> None:
        if self._saved is not None:
            sys.setswitchinterval(self._saved[0])
            gc.set_threshold(*self._saved[1])
            self._saved = None
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
