"""Keeps glibc from handing each step's large temporaries back to the kernel.

Tensors above glibc's mmap threshold (128 KiB, adapting up to 32 MiB) are mmap'ed and unmapped
one by one, so every decode step page-faults its activations in again and the kernel zeroes each
page (``clear_page_erms`` was 3% of a 200-request run's CPU time). vLLM's CPU docs preload
tcmalloc for the same reason; a process cannot preload itself, but it can tell glibc to keep
such blocks in its heap (mallopt) before the engine allocates anything.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MAX_HEAP_BLOCK = 32 << 20  # glibc's ceiling for the mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
_done = False


def keep_freed_memory_in_heap() -> bool:
    """Raises glibc's mmap and trim thresholds for this process; False where there is no glibc."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MAX_HEAP_BLOCK) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok
    except (OSError, AttributeError) as e:  # not glibc (musl, macOS): nothing to tune
        logger.debug("mallopt unavailable: %s", e)
        return False
    _done = ok
    return ok
