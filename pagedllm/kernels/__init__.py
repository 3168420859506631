"""Compiled CPU kernels, built once per machine and instruction-set level (see build.py), normally
at install by scripts/setup.sh.

If the build fails (no compiler, no ninja) the engine falls back to the pure-PyTorch reference
path, which stays the ground truth the tests compare the kernels against.
"""

from __future__ import annotations

import logging
import os
import threading

from pagedllm.kernels.interface import CpuKernels

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_modules: dict[str, CpuKernels | None] = {}


def load_cpu_kernels(level: str | None = None) -> CpuKernels | None:
    """The compiled kernels of ``level`` (default: PAGEDLLM_ISA, else the CPU's own), or None when
    they cannot be built here (or PAGEDLLM_NO_KERNELS=1). Logged once per level."""
    if os.environ.get("PAGEDLLM_NO_KERNELS") == "1":
        return None
    from pagedllm.kernels.build import selected_level

    level = level or selected_level()
    if level in _modules:
        return _modules[level]
    with _lock:
        if level not in _modules:
            _modules[level] = _load(level)
        return _modules[level]


def release_kernel_scratch() -> int:
    """Frees the idle output buffers of every kernel build loaded so far (none is built for it);
    returns their bytes."""
    return sum(k.release_scratch() for k in list(_modules.values()) if k is not None)


def _load(level: str) -> CpuKernels | None:
    from pagedllm.kernels.build import load_level

    try:
        kernels = CpuKernels(load_level(level))
    except Exception as e:  # any build problem: keep serving on the reference path
        logger.warning("pagedllm: CPU kernels unavailable (%s); using the PyTorch reference path", e)
        return None
    logger.info("pagedllm: CPU kernels, %s level: %s", level, kernels.compiled_isa())
    return kernels
