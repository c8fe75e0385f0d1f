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

# a batch's worth of activations: blocks of several sizes, written, then all freed; ten times
PROBE = textwrap.dedent(
    """
    import ctypes, resource, sys
    from app.allocator import retain_freed_memory
    if sys.argv[1] == "retain":
        assert retain_freed_memory(1 << 30)
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def batch():
        blocks = [libc.malloc(size << 20) for size in (3, 9, 5, 20, 7)]
        for block, size in zip(blocks, (3, 9, 5, 20, 7)):
            ctypes.memset(block, 1, size << 20)
        for block in blocks:
            libc.free(block)
    batch()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        batch()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)
PAGES_PER_BATCH = (3 + 9 + 5 + 20 + 7) << 20 >> 12


def faults(mode: str) -> int:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    return int(result.stdout)


def test_freed_blocks_are_reused_without_faulting_their_pages_in_again() -> None:
    assert faults("retain") < PAGES_PER_BATCH // 10, "ten batches fault in less than a tenth of one"


def test_with_glibcs_defaults_the_same_batches_fault_their_pages_in_again() -> None:
    assert faults("default") > 2 * PAGES_PER_BATCH, "what the setting saves is there to save"
