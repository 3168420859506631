"""float32 prefill attention: prefill queries as decode-kernel rows (the engine's path, chunking-
invariant) against torch's SDPA (the path before), ms per layer for one whole-prompt chunk.

    python prefill_rows_vs_sdpa.py        (from this folder, under the benchmark lock)

Shapes (heads, kv heads, head_dim, prompt tokens): the default model's at 150 tokens, a 1.7B's and
an 8B's at 512. Median of 7 calls each.
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from test_attention import build_batch  # noqa: E402

from pagedllm.attention.paged_attention import attend, paged_attention  # noqa: E402
from pagedllm.kernels import load_cpu_kernels  # noqa: E402

kernels = load_cpu_kernels()
for h, hkv, d, n in [(9, 3, 64, 150), (32, 32, 64, 512), (32, 8, 128, 512)]:
    q, k, v, kc, vc, meta, _ = build_batch(16, h, hkv, d, 0, [], [(0, n)])
    paged_attention(q, k, v, kc, vc, meta, 0.1)  # writes the prompt's K/V into the caches
    meta.decode_kernel = kernels.paged_decode_attention
    res = {}
    for name, as_rows in (("sdpa", False), ("decode rows", True)):
        meta.prefill_as_decode_rows = as_rows
        times = []
        for _ in range(7):
            t = time.perf_counter()
            attend(q, k, v, kc, vc, meta, 0.1)
            times.append(time.perf_counter() - t)
        res[name] = 1e3 * statistics.median(times)
    print(f"{h}/{hkv} heads x {d}, {n} tokens: " + ", ".join(f"{a} {b:.2f} ms/layer" for a, b in res.items()))
