"""One glibc malloc arena for the whole process, so an engine stepping in a thread keeps its memory.

Every step allocates and frees tensors of several MB. In the main thread glibc serves
them from the main heap and keeps the freed memory for the next step; in any other
thread (EngineLoop's) it serves them from that thread's own arena, built of 64 MB heaps
that it unmaps as soon as they empty and maps again on the next step, so the same
memory is page-faulted in over and over. Measured on 96 W1 requests: 263k minor faults
and 12% slower in a thread, against 6k faults in the main thread; with one arena the
thread is as fast as the main thread.

A thread keeps the arena of its first allocation, so the process's entry points (the
`pipeline` command, the Celery worker's start) call use_one_malloc_arena() before they
start threads. It does nothing where malloc is not glibc's, or where the user chose
with MALLOC_ARENA_MAX or GLIBC_TUNABLES.

keep_freed_memory() goes further: no mmap for blocks over 32 MB and no trimming, so a
step's freed tensors, however large, serve the next step instead of being mapped and
page-faulted afresh. benchmarks/host_step.py calls it to time a step's host share as a
GPU's host would see it (the [256, 49,152] logits cost a CPU 6.3-6.7 ms of 46-48 a step
otherwise). The entry points do not: W1 ran no faster with it, and a 0.5B-shaped model's
`pipeline bench` peaked 560 MB higher.
"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8   # glibc's mallopt parameters (malloc.h)


def use_one_malloc_arena() -> bool:
    """Make threads that allocate from now on share the main arena; True if it was set."""
    if not sys.platform.startswith("linux"):
        return False
    if "MALLOC_ARENA_MAX" in os.environ or "arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = _mallopt()
    return mallopt is not None and mallopt(M_ARENA_MAX, 1) == 1


def keep_freed_memory() -> bool:
    """Serve every block from the heap and never trim it (see above); True if it was set."""
    mallopt = _mallopt() if sys.platform.startswith("linux") else None
    return mallopt is not None and mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1) == 1


def _mallopt():
    """glibc's mallopt, or None where malloc is another's (musl has no mallopt)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt
