"""packed_gemm vs oneDNN: ms and GFLOP/s of SmolLM2-135M's 120 layer GEMMs streamed from memory.

The 120 layer GEMMs (30 layers x qkv / o / gate_up / down, distinct weights: 212 MB,
so every pass streams them from memory as a decode step does): packed_gemm on the tile-ordered
weight vs oneDNN's blocked kernel (torch's mkldnn linear on its reordered weight, what pagedllm ran
on CPUs without AMX before packed_gemm). Median of 5 passes per row count; both on 2 threads.

    python gemm_packed_vs_onednn.py [ROWS,ROWS,...]   (default 8,16,32,64,128,200,256,512)

Needs AVX512 (BW/VL/DQ) or AVX-NE-CONVERT: oneDNN's bf16 weight reorder refuses AVX2-only CPUs.
"""

import sys
import time

import torch

from pagedllm.kernels import load_cpu_kernels
from pagedllm.models.cpu_linear import tile_order

kernels = load_cpu_kernels()
torch.set_num_threads(2)
H, INTER, LAYERS = 576, 1536, 30
shapes = [(960, H), (H, H), (2 * INTER, H), (H, INTER)]  # (N, K)
weights = [[torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for n, k in shapes] for _ in range(LAYERS)]
onednn = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in layer] for layer in weights]
tiled = [[tile_order(w).contiguous() for w in layer] for layer in weights]
rows = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [8, 16, 32, 64, 128, 200, 256, 512]


def one_pass(name: str, xs: dict) -> None:
    for layer in range(LAYERS):
        for j, (_, k) in enumerate(shapes):
            if name == "onednn":
                torch.ops.mkldnn._linear_pointwise(xs[k], onednn[layer][j], None, "none", [], "")
            else:
                kernels.packed_gemm(xs[k], tiled[layer][j], None, "none")


for m in rows:
    xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (H, INTER)}
    med = {}
    for name in ("onednn", "packed"):
        times = []
        for _ in range(5):
            t = time.perf_counter()
            one_pass(name, xs)
            times.append(time.perf_counter() - t)
        med[name] = sorted(times)[2]
    flop = 2 * m * sum(n * k for n, k in shapes) * LAYERS
    print(
        f"M={m:4d}  oneDNN {med['onednn'] * 1e3:7.2f} ms ({flop / med['onednn'] / 1e9:4.0f} GFLOP/s)"
        f"  packed_gemm {med['packed'] * 1e3:7.2f} ms ({flop / med['packed'] / 1e9:4.0f} GFLOP/s)",
        flush=True,
    )
