"""rope_and_cache_write alone: 150 tokens per call written to slots of a 2 GiB cache that were last
touched long ago (as in a decode step), vs the same slots every call.

Session 7 added the calls made after a pause (a 20 ms sleep, or a pass over 1 GiB of other
memory): on these VMs they cost 20-40x more, because the first touch of a 2 MiB page the host has
aged stalls the vCPU ~135 us (../session7/page_aging.c, ../session7/README.md).

python rope_cold.py   (under the benchmark lock)
"""

import time

import torch

from pagedllm.host_memory import advise_huge_pages
from pagedllm.kernels import load_cpu_kernels

kernels = load_cpu_kernels()
T, H, HKV, D, CALLS = 150, 9, 3, 64, 3000
num_blocks = 2 * 2**30 // (HKV * 16 * D * 2)


def cache() -> torch.Tensor:
    t = torch.empty(num_blocks, HKV, 16, D, dtype=torch.bfloat16)
    advise_huge_pages(t)
    return t.zero_()


k_cache, v_cache = cache(), cache()
cos, sin = torch.randn(8192, D).bfloat16(), torch.randn(8192, D).bfloat16()
fresh = torch.randn(T, (H + 2 * HKV) * D).bfloat16()
qkv = fresh.clone()
positions = torch.randint(0, 2000, (T,))
first_blocks = torch.randperm(num_blocks // 64)[:T] * 64  # each sequence owns a run of 64 blocks


def seconds_per_call(slots_of_call, between=lambda: None, calls: int = CALLS) -> float:
    total = 0.0
    for c in range(calls):
        between()
        qkv.copy_(fresh)  # rotating the same rows again and again would end in denormals
        t = time.perf_counter()
        kernels.rope_and_cache_write(qkv, positions, cos, sin, k_cache, v_cache, slots_of_call(c), H, HKV)
        total += time.perf_counter() - t
    return total / calls


def cold_slots(c: int) -> torch.Tensor:
    return (first_blocks + (c // 16) % 64) * 16 + c % 16


cold = seconds_per_call(cold_slots)
same = seconds_per_call(lambda c: first_blocks * 16)
print(f"cold slots: {cold * 1e6:.1f} us per call of {T} tokens; same slots: {same * 1e6:.1f} us")
other = torch.ones(256 << 20)  # 1 GiB of float32
after_sleep = seconds_per_call(cold_slots, lambda: time.sleep(0.02), 100)
after_read = seconds_per_call(cold_slots, lambda: other.sum(), 50)
print(f"cold slots after a 20 ms sleep: {after_sleep * 1e6:.1f} us; after reading 1 GiB: {after_read * 1e6:.1f} us")
