"""The LM head of SmolLM2-135M (49152 x 576) alone, weights evicted before each call as in a
decode step: amx_gemm + argmax_rows (logits written, then read) vs amx_gemm_argmax. Session 9.

python head_argmax.py    (run under LD_PRELOAD=libtcmalloc_minimal.so.4, as the bench)
"""

import time

import torch

from pagedllm.kernels import load_cpu_kernels
from pagedllm.models.cpu_linear import tile_order

k = load_cpu_kernels()
torch.manual_seed(0)
w = tile_order(torch.randn(49152, 576, dtype=torch.bfloat16) * 0.05)
flush = torch.empty(300 * 2**20, dtype=torch.uint8)


def median_ms(f) -> float:
    ts = []
    for _ in range(7):
        flush.add_(1)  # evicts the head's 57 MB, as a step's 30 layers do
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[3] * 1e3


for m in (200, 64, 8):
    x = torch.randn(m, 576, dtype=torch.bfloat16)
    logits = median_ms(lambda: k.argmax_rows(k.amx_gemm(x, w, None, "none")))  # noqa: B023
    fused = median_ms(lambda: k.amx_gemm_argmax(x, w))  # noqa: B023
    print(f"{m} rows: logits + argmax_rows {logits:.2f} ms, amx_gemm_argmax {fused:.2f} ms")
