"""Decode attention kernel alone: ms per layer and GB/s of K/V read, 200 sequences x 300 tokens.

python attention_bandwidth.py THREADS [huge]   ("huge": caches on transparent huge pages, as the engine)
Blocks of each sequence are scattered over the cache (random permutation), as after a long run.
"""

import sys
import time

import torch

from pagedllm.host_memory import advise_huge_pages
from pagedllm.kernels import load_cpu_kernels

kernels = load_cpu_kernels()
threads = int(sys.argv[1])
huge = len(sys.argv) > 2 and sys.argv[2] == "huge"
torch.set_num_threads(threads)
B, L, H, HKV, D, BS, LAYERS = 200, 300, 9, 3, 64, 16, 8
blocks_per_seq = (L + BS - 1) // BS
num_blocks = B * blocks_per_seq + 10


def cache() -> torch.Tensor:
    t = torch.empty(num_blocks, BS, HKV, D, dtype=torch.bfloat16)
    if huge:
        advise_huge_pages(t)
    return t.normal_()


torch.manual_seed(0)
k_caches = [cache() for _ in range(LAYERS)]
v_caches = [cache() for _ in range(LAYERS)]
tables = torch.randperm(num_blocks)[: B * blocks_per_seq].view(B, blocks_per_seq)
lens = torch.full((B,), L, dtype=torch.long)
q = torch.randn(B, H, D).bfloat16()
out = torch.empty_like(q)


def one_pass() -> None:
    for k, v in zip(k_caches, v_caches, strict=True):
        kernels.paged_decode_attention(out, q, k, v, tables, lens, 0.125)


one_pass()
one_pass()
reps = 5
t0 = time.perf_counter()
for _ in range(reps):
    one_pass()
dt = (time.perf_counter() - t0) / reps / LAYERS
read = B * L * HKV * D * 2 * 2
print(f"threads {threads} huge pages {huge}: {dt * 1e3:.2f} ms/layer, {read / dt / 1e9:.1f} GB/s")
