"""Decode attention kernel with its data in cache (one layer, called repeatedly): the kernel's
arithmetic without the memory stream. Session 9.

python attention_hot.py SEQS LEN THREADS     (session 9: 8 300 1, ~1.8 MB of K/V: L2)
Prints the best of 5 x 200 calls, in us per call and ns per (key, KV head).
"""

import importlib.util
import os
import sys
import time

import torch

from pagedllm.kernels import load_cpu_kernels

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("ab", os.path.join(here, "..", "session3", "attention_bandwidth.py"))
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)
ab.SEQS, ab.LAYERS = int(sys.argv[1]), 1
kernels = load_cpu_kernels()
torch.set_num_threads(int(sys.argv[3]))
kc, vc, tables, lens, q, _ = ab.scattered_decode_batch(int(sys.argv[2]), True, ragged=False)
out = torch.empty_like(q)
for _ in range(20):
    kernels.paged_decode_attention(out, q, kc[0], vc[0], tables, lens, 0.125)
best = 1e9
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(200):
        kernels.paged_decode_attention(out, q, kc[0], vc[0], tables, lens, 0.125)
    best = min(best, (time.perf_counter() - t0) / 200)
per_key = best * 1e9 / (int(lens.sum()) * ab.KV_HEADS)
print(f"hot {ab.SEQS}x{sys.argv[2]}: {best * 1e6:.1f} us/call, {per_key:.2f} ns per key-head")
