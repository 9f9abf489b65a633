"""The host allocator's two thresholds, fixed once per process, so that a CPU step's temporaries
are reused instead of mapped fresh (page faults) each time.

glibc's malloc serves a block of 128 KiB or more with a fresh mmap until a free raises that
threshold, and hands the top of its heap back to the system once more than twice the threshold
is free there; both move with the history of the process. A decode step on a CPU allocates
dozens of temporaries of a few MiB per layer, so a process either reuses them from its heap
or takes a page fault for every 4 KiB of every one of them, whichever state its history left
it in. Measured on a 2-core EPYC: in-cache RoPE over 513 slots x 16 rows x 64 took 0.28 ms in
one process and 1.4-1.6 ms in the next (5 of 8 fresh processes), and the calibration of
Cascade's hooks, always in the slow state there, priced a SmolLM2 layer at 2.7 ms where the
run spends 0.75 ms. Fixed thresholds (blocks below 32 MiB from the heap, up to 1 GiB kept at
its top) gave 0.27-0.33 ms in each of 11 fresh processes, and that calibration 0.63-0.93 ms.
Weights and caches above 32 MiB are still mapped and returned whole.

A user who tunes malloc through glibc's own variables (MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_) or loads another allocator (jemalloc, tcmalloc) keeps it: the
variables leave the thresholds alone, and another allocator ignores glibc's mallopt.
"""
from __future__ import annotations

import ctypes
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3       # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20       # glibc's largest: blocks below it come from the heap
TRIM_THRESHOLD = 1 << 30        # free bytes kept at the heap's top before returning them
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.cache
def steady_host_allocator() -> bool:
    """Fix the thresholds once per process (the engine and the calibration call it) -> whether
    they were set: False where the C library has no mallopt (not glibc) or the user set
    glibc's own variables."""
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
