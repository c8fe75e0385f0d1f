"""The Python interpreter tuned for serving: the GIL switch interval and the garbage collector.

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

``Tuning.apply`` returns what ``restore`` puts back (tests and embedders run more than one
service in a process).
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    switch_interval_s: float
    gc_freeze: bool
    gc_young_threshold: int

    def apply(self) -> Saved:
        saved = Saved(sys.getswitchinterval(), gc.get_threshold(), self.gc_freeze)
        sys.setswitchinterval(self.switch_interval_s)
        if self.gc_young_threshold > 0:
            _, *older = gc.get_threshold()
            gc.set_threshold(self.gc_young_threshold, *older)
        return saved

    def freeze(self) -> None:
        """Collect what start-up left as garbage, then move everything alive out of the
        collector's way. Called once the models are loaded and warm."""
        if self.gc_freeze:
            gc.collect()
            gc.freeze()


@dataclass(frozen=True)
class Saved:
    switch_interval_s: float
    gc_threshold: tuple[int, int, int]
    unfreeze: bool

    def restore(self) -> None:
        sys.setswitchinterval(self.switch_interval_s)
        gc.set_threshold(*self.gc_threshold)
        if self.unfreeze:
            gc.unfreeze()
