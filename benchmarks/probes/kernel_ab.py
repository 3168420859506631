"""Decode attention ms per layer of two builds of the CPU kernels, interleaved on the same data.

python kernel_ab.py HASH_A HASH_B [rounds]   (L=300 env: longest sequence)
HASH: the folder name of a build under ~/.cache/pagedllm/kernels (pagedllm_kernels_native_<key>;
each edit of pagedllm/kernels/*.cpp or *.h builds a new one). Decode attention, 200
sequences of L/2..L tokens, blocks scattered, caches on huge pages as in the engine. Interleaved
because run-to-run noise on small VMs is about +-5%.
"""

import os
import sys
import time

import torch
from attention_bandwidth import LAYERS, load_build, scattered_decode_batch

builds = {sys.argv[1]: load_build(sys.argv[1]), sys.argv[2]: load_build(sys.argv[2])}
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 9
torch.set_num_threads(2)
k_caches, v_caches, tables, lens, q, read = scattered_decode_batch(
    int(os.environ.get("L", 300)), huge=True, ragged=True
)
outs, times = {}, {k: [] for k in builds}
for r in range(rounds + 1):
    for key, module in builds.items():
        out = torch.empty_like(q)
        t = time.perf_counter()
        for k, v in zip(k_caches, v_caches, strict=True):
            module.paged_decode_attention(out, q, k, v, tables, lens, 0.125)
        if r:  # round 0 warms up
            times[key].append((time.perf_counter() - t) / LAYERS)
        outs[key] = out.float()
for key, ts in times.items():
    med = sorted(ts)[len(ts) // 2]
    print(f"{key}: median {med * 1e3:.2f} ms per layer ({read / med / 1e9:.1f} GB/s)")
a, b = outs.values()
print(f"max output difference {(a - b).abs().max():.4g}")
