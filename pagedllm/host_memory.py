"""Host allocator set-up for CPU serving: tcmalloc when present, else a tuned glibc.

With tcmalloc preloaded the 200-request ShareGPT run takes 53.7-54.3 s against 59.0 s with
glibc + the mallopt below (same machine, same hour): tcmalloc recycles the per-step tensors without the
kernel. A process cannot preload a library into itself, so the ``pagedllm`` command re-executes
itself once with LD_PRELOAD set when libtcmalloc is installed (vLLM's CPU docs ask users to set
it by hand). Python-API users can set LD_PRELOAD themselves.

Keeping glibc from handing each step's large temporaries back to the kernel:

Tensors above glibc's mmap threshold (128 KiB, adapting up to 32 MiB) are mmap'ed and unmapped
one by one, so every decode step page-faults its activations in again and the kernel zeroes each
page (``clear_page_erms`` was 3% of a 200-request run's CPU time). vLLM's CPU docs preload
tcmalloc for the same reason; a process cannot preload itself, but it can tell glibc to keep
such blocks in its heap (mallopt) before the engine allocates anything.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is not imported at run time: the CLI calls this module before anything heavy
    import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MAX_HEAP_BLOCK = 32 << 20  # glibc's ceiling for the mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
_done = False


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once (OSError where there is none to load)."""
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def keep_freed_memory_in_heap() -> bool:
    """Raises glibc's mmap and trim thresholds for this process; False where there is no glibc."""
    global _done
    if _done:
        return True
    try:
        libc = _libc()
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MAX_HEAP_BLOCK) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok
    except (OSError, AttributeError) as e:  # not glibc (musl, macOS): nothing to tune
        logger.debug("mallopt unavailable: %s", e)
        return False
    _done = ok
    return ok


def release_freed_heap() -> bool:
    """Returns the heap's free memory to the OS once (glibc malloc_trim): loading leaves ~30-50 MB
    of parsed metadata and staging buffers behind, which keep_freed_memory_in_heap's thresholds
    would otherwise keep resident for the life of the process. False where there is no glibc."""
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False


def release_idle_memory() -> bool:
    """The compiled kernels' idle output buffers (kernels/scratch_buffers.h), then the heap's free
    pages, back to the OS."""
    from pagedllm.kernels import release_kernel_scratch  # imports torch: only once an engine runs

    release_kernel_scratch()  # first: their buffers go back to the heap that the trim then returns
    return release_freed_heap()


class PeriodicHeapRelease:
    """Calls release_freed_heap at most once per ``interval_s``, for a long-running server.

    Why: with keep_freed_memory_in_heap's thresholds glibc never gives freed heap memory back, so a
    serving process's RSS is its heap high-water mark and only grows. A 60-minute soak with
    oversized and grammar-constrained requests mixed in stepped up 19 MiB at minute 29 and stayed
    there (0.64 MiB/min after warm-up against a 0.2 bound) with no live memory behind it. One trim
    a minute returns such free pages; the steps in between keep reusing their memory without
    page faults, which is what the thresholds are for."""

    def __init__(
        self,
        interval_s: float = 60.0,
        release: Callable[[], bool] = release_freed_heap,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._release = release
        self._clock = clock
        self._last = clock()
        self.releases = 0

    def maybe_release(self) -> bool:
        """Trims the heap if the last trim is ``interval_s`` old; True when it trimmed now."""
        now = self._clock()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        self._release()
        self.releases += 1
        return True


_NO_TCMALLOC_ENV = "PAGEDLLM_NO_TCMALLOC"  # set to 1 to keep the default allocator


def find_tcmalloc() -> str | None:
    """Soname of an installed tcmalloc (minimal preferred: no heap profiler), or None."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def reexec_with_tcmalloc(argv: list[str]) -> None:
    """Re-executes this command (``python -m pagedllm.entrypoints.cli argv``) with tcmalloc
    preloaded, once; returns without doing anything when it is absent, already loaded, off
    (PAGEDLLM_NO_TCMALLOC=1) or not on Linux."""
    if not sys.platform.startswith("linux") or os.environ.get(_NO_TCMALLOC_ENV) == "1":
        return
    if "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return
    lib = find_tcmalloc()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[_NO_TCMALLOC_ENV] = "1"  # never loop, whatever the child's LD_PRELOAD ends up as
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "pagedllm.entrypoints.cli", *argv], env)


_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Asks Linux to back a large CPU tensor with transparent huge pages (MADV_HUGEPAGE).

    Paged attention reads blocks scattered over the whole KV cache: with 4 KiB pages nearly every
    block read misses the TLB (a 4 GiB cache spans a million pages), and the page walk delays the
    prefetches that keep the attention kernel fed. With 2 MiB pages the decode attention kernel
    ran ~10% faster (3.36 -> 3.03 ms per layer, 200 x 300 tokens) and the 200-request ShareGPT run
    took 47.6 s instead of 51.5 s (back to back, same machine). THP's default mode on many
    distributions is "madvise", so it has to be asked for. Call before the pages are first
    touched. Returns False where unsupported (not Linux, not a CPU tensor, madvise refused) or
    turned off with PAGEDLLM_NO_HUGE_PAGES=1.

    Cost: start-up. Zeroing a 4 GiB cache took 1.4 s instead of 0.8 s, and 6.2 s once when the
    kernel first had to compact memory to find free 2 MiB pages (THP defrag "madvise").
    """
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return False
    if os.environ.get("PAGEDLLM_NO_HUGE_PAGES") == "1":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned_start = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    aligned_end = end // HUGE_PAGE * HUGE_PAGE
    if aligned_end <= aligned_start:
        return False
    try:
        madvise = _libc().madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return madvise(aligned_start, aligned_end - aligned_start, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError) as e:
        logger.debug("madvise unavailable: %s", e)
        return False


def empty_on_huge_pages(
    specs: list[tuple[tuple[int, ...], torch.dtype]], align: int = 64
) -> tuple[list[torch.Tensor], bool]:
    """Uninitialized CPU tensors of the given (shape, dtype)s, in order, as views of one new buffer
    whose pages are not touched yet; each view starts on an ``align``-byte boundary (64, or
    HUGE_PAGE to give each its own huge pages). Returns the views and whether the buffer was
    advised for transparent huge pages (see advise_huge_pages); touch them only after this call.

    One large fresh allocation, not many: a tensor carved from memory the allocator already touched
    with 4 KiB pages stays on them, whatever madvise asks."""
    import torch  # here, not at module level: see the import note at the top

    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total += (math.prod(shape) * dtype.itemsize + align - 1) // align * align
    arena = torch.empty(total + 2 * HUGE_PAGE, dtype=torch.uint8)
    advised = advise_huge_pages(arena)
    base = (-arena.data_ptr()) % HUGE_PAGE  # first huge page boundary inside the buffer
    views = [
        arena[base + off : base + off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        for (shape, dtype), off in zip(specs, offsets, strict=True)
    ]
    return views, advised


def copy_to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Copies CPU tensors into one new buffer backed by transparent huge pages; returns the copies
    (views of that buffer, 64-byte aligned, same shapes and dtypes), or None where huge pages
    cannot be had (see advise_huge_pages) or a tensor is not a CPU tensor.

    For weights streamed once per decode step: see pagedllm.models.cpu_linear."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return None
    copies, advised = empty_on_huge_pages([(tuple(t.shape), t.dtype) for t in tensors])
    if not advised:
        return None
    for copy, t in zip(copies, tensors, strict=True):
        copy.copy_(t)
    return copies
