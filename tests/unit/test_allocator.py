"""The allocator keeps what a batch frees: the next batch's memory is not faulted in again.

Each case runs in a fresh interpreter: the thresholds are process-wide and cannot be unset.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from app.allocator import glibc_version

pytestmark = pytest.mark.skipif(glibc_version() is None, reason="glibc's allocator only")

# a batch's worth of activations: blocks of several sizes, written, then all freed; ten times,
# on the main thread or on another one (as the service's device threads run them); "thresholds"
# sets the mmap and trim thresholds alone, without the top pad
PROBE = textwrap.dedent(
    """
    import ctypes, resource, sys, threading
    from app.allocator import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, MMAP_THRESHOLD_MAX, retain_freed_memory
    libc = ctypes.CDLL(None)
    if sys.argv[1] == "retain":
        assert retain_freed_memory(1 << 30)
    elif sys.argv[1] == "thresholds":
        assert libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
        assert libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    SIZES = (3, 9, 5, 20, 7, 24, 18)  # MiB: more than one of a thread's heaps (64 MiB) holds
    def batch():
        blocks = [libc.malloc(size << 20) for size in SIZES]
        for block, size in zip(blocks, SIZES):
            ctypes.memset(block, 1, size << 20)
        for block in blocks:
            libc.free(block)
    def run():
        batch()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            batch()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    if sys.argv[2] == "thread":
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    else:
        run()
    """
)
PAGES_PER_BATCH = (3 + 9 + 5 + 20 + 7 + 24 + 18) << 20 >> 12


def faults(mode: str, thread: str = "main") -> int:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, mode, thread], capture_output=True, text=True, timeout=60, check=True
    )
    return int(result.stdout)


@pytest.mark.parametrize("thread", ["main", "thread"])
def test_freed_blocks_are_reused_without_faulting_their_pages_in_again(thread: str) -> None:
    assert faults("retain", thread) < PAGES_PER_BATCH // 10, "ten batches fault in less than a tenth of one"


@pytest.mark.parametrize("thread", ["main", "thread"])
def test_with_glibcs_defaults_the_same_batches_fault_their_pages_in_again(thread: str) -> None:
    assert faults("default", thread) > 2 * PAGES_PER_BATCH, "what the setting saves is there to save"


def test_on_another_thread_the_thresholds_alone_do_not_keep_its_heaps() -> None:
    """A thread's arena unmaps a heap once it is wholly free whatever the trim threshold; the top pad holds it."""
    assert faults("thresholds", "thread") > 2 * PAGES_PER_BATCH
    assert faults("thresholds", "main") < PAGES_PER_BATCH // 10
