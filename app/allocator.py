"""glibc's allocator, tuned to keep the memory a batch frees for the next batch.

A forward pass on the CPU allocates its activations afresh, megabytes each (mobilenet_v3_small
at batch 32: tens of MiB), and frees them at the end. With glibc's defaults a large block is
mapped from the OS and unmapped when freed, or the heap's top is trimmed back once it exceeds
a threshold that glibc moves as it goes; either way the next batch faults every page back in,
and the kernel zeroes each one. On these machines that was up to a third of a forward pass's
CPU (mobilenet_v3_small at batch 32: 3.4 against 2.4 ms per image, 410k against 120k minor
page faults, depending on the order the allocator had seen sizes in).

The thresholds alone are not enough where batches run on threads other than the main one, as
in the service. Each such thread allocates from an arena of its own, made of heaps of at most
64 MiB, and glibc unmaps a heap as soon as it is wholly free, whatever the trim threshold: the
next batch maps it afresh and faults every page in again. Only the top pad (``M_TOP_PAD``)
holds it: a heap goes only when more than the pad would be left free without it. Two threads
running batch 32 side by side in one process, mobilenet_v3_small: 2.44 and 3.35-3.9 ms per
image (one thread took 600k page faults in 4 s, 1.1 s of it in the kernel) without the pad;
2.55 and 2.60 with it, as two processes (2.50 each).

``retain_freed_memory`` fixes all three: blocks up to 32 MiB (glibc's most) come from a heap,
a heap keeps up to ``retain_bytes`` free at its top before giving any back, and that much
top pad keeps threads' heaps mapped. Resident memory then stays at the high-water mark of the
batches run, per thread that runs them, which is what a serving process reaches anyway under
load; it does not grow past it. Setting the thresholds turns off glibc's own adjustment of
them for the rest of the process: there is nothing to put back. On another C library (musl,
macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest on 64-bit: 4 MiB * sizeof(long)


def glibc_version() -> str | None:
    """``"glibc 2.36"``, or None on another C library."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None


def retain_freed_memory(retain_bytes: int) -> bool:
    """Keep freed memory for reuse (see the module); True when glibc took both settings."""
    if glibc_version() is None:
        log.info("not glibc: the allocator keeps its own defaults")
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the order matters: the trim threshold alone would stop glibc raising the mmap threshold
    # from its 128 KiB start, and every activation would be mapped and unmapped
    taken = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1)
    taken = taken and bool(mallopt(M_TRIM_THRESHOLD, retain_bytes) == 1)
    taken = taken and bool(mallopt(M_TOP_PAD, retain_bytes) == 1)
    if not taken:
        log.warning("glibc refused the allocator's settings; it keeps its own")
    return taken
