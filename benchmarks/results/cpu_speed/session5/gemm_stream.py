"""SmolLM2-135M's 120 layer GEMMs (212 MB of bf16 weights) at M rows, weights streamed from memory.

python gemm_stream.py M [M ...]   (run under tcmalloc and the benchmark lock; WHICH=amx,dnn)
Each pass runs the 30 layers' qkv / o / gate_up / down GEMMs once, after a 300 MB write that
evicts the caches as a decode step's K/V stream does; median of 7 passes. "amx": amx_gemm on the
tile-ordered weights on huge pages (what the engine runs); "dnn": oneDNN on its packed weights.
"""

import os
import sys
import time

import torch

from pagedllm.host_memory import copy_to_huge_pages
from pagedllm.kernels import load_cpu_kernels
from pagedllm.models.cpu_linear import tile_order

kernels = load_cpu_kernels()
torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
weights = [torch.randn(n, k).bfloat16() for _ in range(30) for n, k in shapes]
which = os.environ.get("WHICH", "dnn,amx").split(",")
tiled = copy_to_huge_pages([tile_order(w) for w in weights]) if "amx" in which else None
packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights] if "dnn" in which else None
flush = torch.empty(300 * 2**20 // 4)
weight_gb = sum(w.numel() * 2 for w in weights) / 1e9
for m in (int(a) for a in sys.argv[1:]):
    xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
    line = f"M={m}:"
    for name in which:
        passes = []
        for _ in range(7):
            flush.add_(1)
            t = time.perf_counter()
            if name == "amx":
                for w in tiled:
                    kernels.amx_gemm(xs[w.shape[1] * 32], w, None, "none")
            else:
                for w, p in zip(weights, packed, strict=True):
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
            passes.append(time.perf_counter() - t)
        s = sorted(passes)[3]
        flops = sum(2 * m * w.numel() for w in weights)
        line += f"  {name} {s * 1e3:.1f} ms ({weight_gb / s:.1f} GB/s {flops / s / 1e12:.2f} TFLOP/s)"
    print(line, flush=True)
