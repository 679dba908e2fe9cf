"""The host allocator keeps the memory a training step frees, instead of handing it back to the kernel.

A step allocates and frees the same activations every time. glibc's malloc, left to itself, returns free memory
at the top of its heap to the kernel once it exceeds a threshold that it tunes as it goes, and takes it back on
the next step: every returned page is a page fault and a page zeroed again. How much of that happens depends on
the order of the first allocations, so one run of the same command pays thousands of faults per step and the
next a handful (`page_faults_per_batch` in metrics.jsonl shows which; on a small CPU model, 10% of the step).
Fixing the two thresholds ends the churn: requests up to 32 MiB (glibc's ceiling for its own tuning) come from
the heap, and up to 1 GiB of freed memory stays with the process for the next step. Larger requests are mapped
and unmapped as before; for CPU training of large models, a caching allocator (jemalloc or tcmalloc through
LD_PRELOAD, as PyTorch's CPU tuning guide suggests) goes further.

Forked loader workers inherit the settings; the same values go into the environment, where glibc reads them as
a process starts (spawned workers, processes the run starts). A value of the user's in the environment
(MALLOC_*_ variables, glibc.malloc tunables) is left to take effect instead. Other C libraries: nothing changes.
"""

from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit systems (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**30  # free memory at the heap's top beyond this still goes back to the kernel

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
_ENV = {"MALLOC_TRIM_THRESHOLD_": TRIM_THRESHOLD, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
_USER_KEYS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def on_glibc() -> bool:
    """Whether this process runs on glibc, whose malloc these thresholds are for."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError):  # no confstr (Windows), a name it does not know (macOS)
        return False


def keep_freed_memory() -> bool:
    """Apply the thresholds above to this process (glibc only); True when the process now runs with them."""
    if any(key in os.environ for key in _USER_KEYS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return all(os.environ.get(key) == str(value) for key, value in _ENV.items())  # ours, inherited; or theirs
    if not on_glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting either one turns glibc's own tuning off, and it would stay at 128 KiB
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return False
    os.environ.update({key: str(value) for key, value in _ENV.items()})
    return True
