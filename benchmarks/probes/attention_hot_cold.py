"""Decode attention us per layer and GB/s of several kernel builds, from cache and from memory.

From cache (12 sequences, one layer: ~2 MB, or
SL=40:1 ~7 MB) and from memory (200 sequences x 8 layers, 277 MB): us per layer and GB/s of K/V.

    python attention_hot_cold.py SUFFIX [SUFFIX ...]   (PLACED=1: each sequence's blocks adjacent)
SUFFIX: the folder name of a build under ~/.cache/pagedllm/kernels (pagedllm_kernels_native_<key>) (see
kernel_ab.py). The q.k / softmax / p.v split of the decode attention kernel was measured by
building variants with one of them removed.
"""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_bandwidth as ab  # noqa: E402

torch.set_num_threads(2)
builds = {s: ab.load_build(s) for s in sys.argv[1:]}
for spec in os.environ.get("SL", "12:1,200:8").split(","):
    ab.SEQS, ab.LAYERS = (int(v) for v in spec.split(":"))
    k_caches, v_caches, tables, lens, q, read = ab.scattered_decode_batch(300, huge=True, ragged=True)
    reps = 200 if ab.SEQS < 50 else 3
    for rnd in range(3):  # rounds 0-1 warm up
        for name, module in builds.items():
            out = torch.empty_like(q)
            t = time.perf_counter()
            for _ in range(reps):
                for k, v in zip(k_caches, v_caches, strict=True):
                    module.paged_decode_attention(out, q, k, v, tables, lens, 0.125)
            dt = (time.perf_counter() - t) / reps / ab.LAYERS
            if rnd == 2:
                print(f"seqs {ab.SEQS} {name}: {dt * 1e6:.0f} us/layer {read / dt / 1e9:.1f} GB/s")
