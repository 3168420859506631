"""The KV cache size that ``gpu_memory_utilization`` (vLLM's argument) allows.

vLLM's meaning: the fraction of the device's memory the whole engine may hold, weights and
activations included; what remains of that share after the model is loaded goes to the KV cache.
pagedllm applies the same rule to the CPU, where "the device's memory" is the host's:

    KV bytes = utilization x total memory - memory this process already holds (after loading)

``total memory`` is the machine's, or the container's limit (cgroup ``memory.max``) when lower,
and ``memory this process holds`` is its resident set size. The result is capped at the memory
available right now (MemAvailable, or the cgroup's headroom), with a warning: other processes may
use what the fraction would claim, and overcommitting a host's memory ends in the OOM killer
rather than in vLLM's clean start-up error. On CUDA the device's total and the bytes torch holds
on it are used.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("pagedllm")

_CGROUP = "/sys/fs/cgroup"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_total_bytes() -> int:
    """The machine's memory, or the container's limit when lower."""
    total = _meminfo("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _read_int(os.path.join(_CGROUP, "memory.max"))
    return min(total, limit) if limit else total


def host_available_bytes() -> int:
    """What can be allocated now without pushing others out: MemAvailable, within the cgroup's headroom."""
    available = _meminfo("MemAvailable") or host_total_bytes()
    limit = _read_int(os.path.join(_CGROUP, "memory.max"))
    current = _read_int(os.path.join(_CGROUP, "memory.current"))
    if limit and current is not None:
        available = min(available, max(limit - current, 0))
    return available


def process_resident_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def kv_cache_budget_bytes(utilization: float, device: torch.device) -> int:
    """Bytes the KV cache may take under ``utilization`` (see the module docstring). Call after the
    model is loaded. Raises ValueError when the model alone already holds the whole share."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        held = torch.cuda.memory_reserved(device)
        available = torch.cuda.mem_get_info(device)[0] + held
    else:
        total, held, available = host_total_bytes(), process_resident_bytes(), host_available_bytes()
    budget = int(utilization * total) - held
    gib = 2**30
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} of {total / gib:.1f} GiB leaves nothing for the KV cache: "
            f"this process already holds {held / gib:.2f} GiB. Raise it, or size the cache with "
            "kv_cache_memory_gib / num_kv_blocks."
        )
    if budget > available:
        logger.warning(
            "gpu_memory_utilization=%s asks for a %.2f GiB KV cache but only %.2f GiB are available: "
            "using what is available",
            utilization,
            budget / gib,
            available / gib,
        )
        budget = available
    return budget
