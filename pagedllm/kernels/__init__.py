"""Compiled CPU kernels, built on first use with the machine's C++ compiler (cached by torch).

If the build fails (no compiler, no ninja) the engine falls back to the pure-PyTorch reference
path, which stays the ground truth the tests compare the kernels against.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading

from pagedllm.kernels.interface import CpuKernels

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_module: CpuKernels | None = None
_failed = False


def load_cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, or None when they cannot be built here (or PAGEDLLM_NO_KERNELS=1)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        if os.environ.get("PAGEDLLM_NO_KERNELS") == "1":
            _failed = True
            return None
        try:
            from torch.utils.cpp_extension import load

            logger.info("pagedllm: building the CPU kernels (first use only; cached by torch)")
            here = os.path.dirname(__file__)
            sources = sorted(os.path.join(here, f) for f in os.listdir(here) if f.endswith(".cpp"))
            # torch re-builds when a .cpp changes, not a header: name the build after all of them,
            # and after their folder (two checkouts of the same sources would otherwise share one
            # build directory and rebuild it for each other at every start).
            digest = hashlib.sha256(os.path.abspath(here).encode())
            for f in sorted(os.listdir(here)):
                if f.endswith((".cpp", ".h")):
                    with open(os.path.join(here, f), "rb") as fh:
                        digest.update(fh.read())
            # -ffast-math lets gcc call glibc's vectorized expf; the kernel never produces inf or NaN.
            # 512-bit vectors: gcc defaults to 256 on many Intel targets.
            flags = ["-O3", "-march=native", "-ffast-math", "-mprefer-vector-width=512", "-fopenmp"]
            name = f"pagedllm_cpu_kernels_{digest.hexdigest()[:10]}"
            if os.environ.get("PAGEDLLM_KERNELS_INCREMENTAL") == "1":
                # Kernel development: one build directory per checkout, so ninja recompiles only
                # the sources that changed (a full build is minutes on 2 cores).
                name = f"pagedllm_cpu_kernels_dev_{hashlib.sha256(os.path.abspath(here).encode()).hexdigest()[:10]}"
            _remove_stale_build_lock(name)
            ext = load(
                name=name,
                sources=sources,
                extra_cflags=flags,
                verbose=False,
            )
            _module = CpuKernels(ext)
        except Exception as e:  # any build problem: keep serving on the reference path
            logger.warning("pagedllm: CPU attention kernel unavailable (%s); using the PyTorch reference path", e)
            _failed = True
        return _module


# A build takes a minute or two; torch's lock file outlives a build that was killed, and every
# later start would then wait on it forever.
_STALE_LOCK_S = 15 * 60


def _remove_stale_build_lock(name: str) -> None:
    import time

    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return  # no lock: nobody is building
    if age > _STALE_LOCK_S:
        logger.warning("pagedllm: removing a kernel build lock left %.0f min ago by a build that died", age / 60)
        try:
            os.remove(lock)
        except OSError:
            pass
