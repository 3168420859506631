"""One quantized GEMM (2048 -> 8192, the 1.7B shape's MLP up projection) in two kernel builds of
this machine, side by side: what a CPU of the lower level gets, e.g. the AVX-VNNI dot products of
Intel's CPUs without AVX512 against the AVX2 path they ran before (measured on a CPU that has
both). Every format with a repacked kernel, at 1 / 6 / 32 / 512 activation rows, the two builds
alternating; medians of 7 calls (3 at 512 rows). Also checks that the two give the same bits.

    flock /tmp/pagedllm-bench.lock python3 benchmarks/probes/isa_levels_gemm.py avxvnni avx2
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedllm.kernels.build import load_level

T = GGMLQuantizationType
N, K = 8192, 2048
FORMATS = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
INTERLEAVED_OFFSET = 1000  # kernels/entry_points.h kInterleaved


def k_quant_rows(qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small normal fp16 scales (gguf-py has no K-quant quantizer)."""
    from gguf import GGML_QUANT_SIZES

    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(N, K // block, nbytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    for o in (nbytes - 2,) if qtype == T.Q6_K else (0, 2):
        raw[..., o : o + 2] = scale
    return raw.reshape(N, -1)


def main() -> None:
    levels = sys.argv[1:3] if len(sys.argv) >= 3 else ["avxvnni", "avx2"]
    mods = [load_level(level) for level in levels]
    print(f"{levels[0]} ({mods[0].compiled_isa()}) vs {levels[1]} ({mods[1].compiled_isa()}), ms per call")
    rng = np.random.default_rng(0)
    for qtype in FORMATS:
        if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
            raw = k_quant_rows(qtype, rng)
        else:
            raw = quantize(rng.standard_normal((N, K)).astype(np.float32), qtype)
        w = mods[0].quant_interleave_rows(torch.from_numpy(np.ascontiguousarray(raw)), int(qtype))
        code = INTERLEAVED_OFFSET + int(qtype)
        cells = []
        for m in (1, 6, 32, 512):
            x = torch.randn(m, K)
            same = torch.equal(mods[0].quant_gemm(x, w, code), mods[1].quant_gemm(x, w, code))
            times: list[list[float]] = [[], []]
            for _ in range(7 if m < 512 else 3):
                for i, mod in enumerate(mods):
                    t = time.perf_counter()
                    mod.quant_gemm(x, w, code)
                    times[i].append((time.perf_counter() - t) * 1e3)
            a, b = (statistics.median(t) for t in times)
            cells.append(f"M={m}: {a:.2f} vs {b:.2f} ({b / a:.2f}x)" + ("" if same else " BITS DIFFER"))
        print(f"{qtype.name:5s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
