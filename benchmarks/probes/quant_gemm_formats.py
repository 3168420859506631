"""Milliseconds per call of quant_gemm at a 1.7B-shape layer (2048 -> 8192, the MLP's up
projection) by weight format and kernel layout (interleaved/16: inputs with a scale per 16, as
down_proj runs), at 1 / 32 / 512 activation rows; the weights' GB/s at one row. Random blocks
(speed does not depend on the values). Last, the same GEMM on float32 weights (F.linear): what a
format without a kernel runs, dequantized at load.

    cd benchmarks/probes && flock /tmp/pagedllm-bench.lock python3 quant_gemm_formats.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedllm.kernels import load_cpu_kernels

T = GGMLQuantizationType
N, K = 8192, 2048


def random_rows(qtype: GGMLQuantizationType) -> torch.Tensor:
    """Rows of valid blocks: random bytes with each block's fp16 scales set to small normal values."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(N, K // block, nbytes), dtype=np.uint8)
    # offsets of the block's fp16 d (and m / dmin): first, except Q6_K's d, last
    offsets = {T.Q4_1: [0, 2], T.Q5_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [nbytes - 2]}
    scale_offsets = offsets.get(qtype, [0])
    for o in scale_offsets:
        raw[:, :, o : o + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(N, -1))


def ms_per_call(gemm, x: torch.Tensor, repeats: int = 7) -> float:
    gemm(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gemm(x)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def report(name: str, gemm, nbytes: int) -> None:
    cells = []
    for m in (1, 32, 512):
        ms = ms_per_call(gemm, torch.randn(m, K), repeats=7 if m < 512 else 3)
        cells.append(f"M={m}: {ms:7.2f} ms" + (f" ({nbytes / ms / 1e6:5.1f} GB/s)" if m == 1 else ""))
    print(f"{name:18s} " + "  ".join(cells))


def main() -> None:
    kernels = load_cpu_kernels()
    print(f"kernels: {kernels.compiled_isa()}, threads {torch.get_num_threads()}")
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K):
        w = random_rows(qtype)
        layouts = [("file rows", w, int(qtype))]
        code = kernels.interleaved_qtype(int(qtype))
        if code is not None:
            packed = kernels.quant_interleave_rows(w.clone(), int(qtype))
            layouts.append(("interleaved", packed, code))
            fine = kernels.fine_scales_qtype(int(qtype))
            if fine is not None:  # the same weights, inputs scaled per 16 (down_proj's layout)
                layouts.append(("interleaved/16", packed, fine))
        for name, rows, c in layouts:
            report(f"{qtype.name:5s} {name}", lambda x, rows=rows, c=c: kernels.quant_gemm(x, rows, c), rows.numel())
    wf = torch.randn(N, K)
    report("float32 F.linear", lambda x: F.linear(x, wf), wf.numel() * 4)


if __name__ == "__main__":
    main()
