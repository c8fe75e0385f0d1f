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
- **Wakeups.** A request's bytes, a decoded image or a finished batch wake the event loop
  hundreds of times a second, and Linux lets a thread that wakes pre-empt the one running on its
  core: on a machine whose cores all run batches, each wakeup cut a forward pass short, switched
  its thread out and ran the loop's Python on caches the forward pass had filled, and the pass
  came back to caches the loop had filled. With ``server.wakeup_preemption`` off (the default)
  the loop's thread runs as ``SCHED_BATCH`` while no urgent request is in flight: waking, it
  waits for the running thread's time slice (a few ms), or takes an idle core at once, as
  before; while an urgent request is in flight it pre-empts as usual, so the urgent lane keeps
  its latency. The device and decode threads keep Linux's usual policy. Measured side by side
  on 2 cores (docs/performance.md, twenty-seventh pass): 1.11 of the throughput at saturation
  on plain traffic, 0.90 of the CPU a request. The decode thread as ``SCHED_BATCH`` too gained 3%
  more, and cost the twice-the-load answered share (0.87 and 0.92 of saturation against 0.93);
  switched with the loop's while urgent requests are in flight, it gained nothing measurable (1.01
  plain, 0.97 with 10% urgent: twenty-eighth pass).

``Tuning`` applies that at start-up and puts back what it found at close. It is process-wide
state: services sharing a process (tests, embedders) should close in the reverse order of
their start, each putting back what the one before it had set.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
import struct
import sys
import threading

from app.allocator import retain_freed_memory


def no_wakeup_preemption(thread: int = 0) -> int | None:
    """The thread whose native id is ``thread`` (0: the caller) runs as ``SCHED_BATCH`` from now
    on (Linux: waking, it waits for the running thread's time slice rather than pre-empting it; no
    privilege needed). Returns the policy it had, to put back, or None where the OS has no such
    policy (or refused it)."""
    if not hasattr(os, "SCHED_BATCH"):
        return None
    try:
        before = os.sched_getscheduler(thread)
        if before != os.SCHED_OTHER:  # batch already, idle, or real-time as its operator set it: left so
            return None
        os.sched_setscheduler(thread, os.SCHED_BATCH, os.sched_param(0))
    except OSError:
        return None
    return before


# sched_setattr(2)'s number by machine (Linux; the C library wraps no such call), and its
# struct sched_attr as of Linux 3.14 (SCHED_ATTR_SIZE_VER0, 48 bytes)
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274, "ppc64le": 355, "s390x": 345}
_SCHED_ATTR = struct.Struct("=IIQiIQQQ")


def short_time_slice(slice_ns: int, thread: int = 0) -> bool:
    """Give the thread whose native id is ``thread`` (0: the caller) a time slice of ``slice_ns``
    under Linux's fair scheduler (EEVDF's custom slice, Linux 6.12 and later, clamped by the
    kernel to 0.1-100 ms; no privilege needed). A thread with a short slice gets an earlier
    virtual deadline: waking, it pre-empts a thread running a longer slice on its core, rather
    than wait for that slice's end; its share of the core is its nice value's as before. Only
    for a thread of the normal policy; its nice value is kept. False where the OS has no such
    call or refused it (an older kernel takes the call and ignores the slice)."""
    # the numbers are the 64-bit ABIs': a 32-bit process on a 64-bit kernel has other ones
    number = _SCHED_SETATTR.get(platform.machine()) if struct.calcsize("P") == 8 else None
    if number is None or not sys.platform.startswith("linux"):
        return False
    try:
        if os.sched_getscheduler(thread) != os.SCHED_OTHER:  # batch, idle or real-time: left so
            return False
        nice = os.getpriority(os.PRIO_PROCESS, thread or threading.get_native_id())
        attr = ctypes.create_string_buffer(
            _SCHED_ATTR.pack(_SCHED_ATTR.size, os.SCHED_OTHER, 0, nice, 0, slice_ns, 0, 0), _SCHED_ATTR.size
        )
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(ctypes.c_long(number), ctypes.c_int(thread), attr, ctypes.c_uint(0))) == 0
    except (OSError, AttributeError):
        return False


def restore_scheduling(policy: int, thread: int = 0) -> None:
    """The thread ``thread`` (0: the caller) back to ``policy`` (what ``no_wakeup_preemption``
    returned)."""
    with contextlib.suppress(OSError):  # a real-time policy it had needs a privilege to take back
        os.sched_setscheduler(thread, policy, os.sched_param(0))


class Tuning:
    def __init__(
        self,
        switch_interval_s: float,
        gc_freeze: bool,
        gc_young_threshold: int,
        malloc_retain_bytes: int = 0,
        wakeup_preemption: bool = True,
    ) -> None:
        self.switch_interval_s = switch_interval_s
        self.gc_freeze = gc_freeze
        self.gc_young_threshold = gc_young_threshold
        self.malloc_retain_bytes = malloc_retain_bytes
        self.wakeup_preemption = wakeup_preemption
        self._saved: tuple[float, tuple[int, int, int]] | None = None
        # the event loop's thread, made SCHED_BATCH by ``apply``, and the policy it had before
        self._tuned: tuple[threading.Thread, int] | None = None
        self._urgent = 0  # urgent requests in flight
        self.frozen = False

    def apply(self) -> None:
        """On the event loop's thread, which keeps the scheduling it is given here: the threads
        it starts later (``asyncio.to_thread``'s) take it too, as they wake it and are woken."""
        self._saved = (sys.getswitchinterval(), gc.get_threshold())
        sys.setswitchinterval(self.switch_interval_s)
        if not self.wakeup_preemption and (before := no_wakeup_preemption()) is not None:
            self._tuned = (threading.current_thread(), before)
        if self.gc_young_threshold > 0:
            _, *older = gc.get_threshold()
            gc.set_threshold(self.gc_young_threshold, *older)
        if self.malloc_retain_bytes > 0:  # for the rest of the process: glibc cannot go back to adjusting them
            retain_freed_memory(self.malloc_retain_bytes)

    def urgent_began(self) -> None:
        """An urgent request is in flight (called on the loop's thread). While any is, the loop
        pre-empts as Linux usually lets it: the urgent lane's hand-offs (its image decoded, its
        window's end, its batch done) are not held for a batch's time slice."""
        self._urgent += 1
        if self._urgent == 1 and (tuned := self._tuned_thread()) is not None:
            restore_scheduling(*tuned)

    def urgent_ended(self) -> None:
        """An urgent request is answered (or failed): with none left, the loop waits its turn again."""
        self._urgent -= 1
        if self._urgent == 0 and (tuned := self._tuned_thread()) is not None:
            no_wakeup_preemption(tuned[1])

    def _tuned_thread(self) -> tuple[int, int] | None:
        """The policy to put back and the native id of the thread ``apply`` made ``SCHED_BATCH``,
        while that thread runs; None otherwise. That thread by its id, not the caller (0): a
        service serving or closed on another thread than the one it was tuned on (an embedder's
        loops) must neither leave that one batch nor make the caller so for good. Never an id
        whose thread ended: Linux gives ids again, to other processes' threads too."""
        if self._tuned is None:
            return None
        thread, before = self._tuned
        if not thread.is_alive() or thread.native_id is None:
            return None
        return before, thread.native_id

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
        """Put back what ``apply`` changed (the scheduling of the thread it ran on, from any)."""
        if (tuned := self._tuned_thread()) is not None:
            restore_scheduling(*tuned)
        self._tuned = None
        if self._saved is not None:
            sys.setswitchinterval(self._saved[0])
            gc.set_threshold(*self._saved[1])
            self._saved = None
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
