"""Compiled CPU kernels, built on first use with the machine's C++ compiler (cached by torch).

If the build fails (no compiler, no ninja) the engine falls back to the pure-PyTorch reference
path, which stays the ground truth the tests compare the kernels against.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_module = None
_failed = False


def load_cpu_kernels():
    """The compiled module, or None when it cannot be built here (or PAGEDLLM_NO_KERNELS=1)."""
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

            logger.info("pagedllm: building the CPU attention kernel (first use only; cached by torch)")
            src = os.path.join(os.path.dirname(__file__), "cpu_decode.cpp")
            # -ffast-math lets gcc call glibc's vectorized expf; the kernel never produces inf or NaN.
            # 512-bit vectors: gcc defaults to 256 on many Intel targets.
            flags = ["-O3", "-march=native", "-ffast-math", "-mprefer-vector-width=512", "-fopenmp"]
            _module = load(name="pagedllm_cpu_kernels", sources=[src], extra_cflags=flags, verbose=False)
        except Exception as e:  # any build problem: keep serving on the reference path
            logger.warning(
                "pagedllm: CPU attention kernel unavailable (%s); using the PyTorch reference path", e
            )
            _failed = True
        return _module
