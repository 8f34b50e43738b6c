"""The host process's memory allocator, tuned for training loops.

Each training step frees and re-allocates the same large activation buffers. glibc's malloc
serves big requests with fresh `mmap`s and gives freed memory back to the OS, so every step
pays tens of thousands of page faults to get it again: measured on a 2-core CPU, about 20%
of a small GPT's step time (see docs/performance.md). Raising the mmap threshold to its
maximum and switching off trimming keeps freed blocks in the heap for the next step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

# mallopt parameters from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's cap on 64-bit systems
NEVER_TRIM = 2**31 - 1


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, loaded once; None off Linux or where it cannot be found."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def libc_function(name: str):
    """A function of glibc (`mallopt`, `malloc_trim`, `prctl`), or None where there is none (macOS, musl)."""
    return getattr(_libc(), name, None)


def keep_freed_memory() -> bool:
    """Make glibc malloc keep freed memory for reuse; False where that is not possible (not glibc)."""
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1


def release_freed_memory() -> bool:
    """Give the memory malloc keeps for reuse back to the OS now (glibc `malloc_trim`).

    With `keep_freed_memory` on, the resident set never shrinks; a benchmark that wants each
    measurement's own peak calls this between measurements. False where it is not possible.
    """
    trim = libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
