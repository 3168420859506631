"""oneDNN (packed weight) vs small_gemm GFLOP/s per SmolLM2-135M layer shape and row count, hot
weights except the LM head's 57 MB (session 11, AMD Zen 4).   python small_gemm_vs_onednn.py"""

import time

import torch

from pagedllm.kernels import load_cpu_kernels

kernels = load_cpu_kernels()
torch.set_num_threads(2)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def seconds(f, reps):
    for _ in range(2):
        f()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t0) / reps


print("rows | per layer: oneDNN / small_gemm GFLOP/s")
for m in (4, 6, 8, 12, 16, 24, 32, 48):
    row = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        x = torch.randn(m, k).to(torch.bfloat16)
        reps = max(3, int(1e9 / (2 * m * n * k)))
        a = seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), reps)  # noqa: B023
        b = seconds(lambda: kernels.small_gemm(x, w, None), reps)  # noqa: B023
        row.append(f"{name} {2 * m * n * k / a / 1e9:.0f}/{2 * m * n * k / b / 1e9:.0f}")
    print(m, " | ".join(row), flush=True)
