"""One quantized GEMM (2048 -> 8192, the 1.7B shape's MLP up projection) in two kernel builds of
this machine, side by side: what a CPU of the lower level gets, e.g. the AVX-VNNI dot products of
Intel's CPUs without AVX512 against the AVX2 path they ran before (measured on a CPU that has
both). Every format with a repacked kernel, at 1 / 6 / 32 / 512 activation rows, the two builds
alternating; medians of 7 calls (3 at 512 rows). Also checks that the two give the same bits.
Weights: quant_gemm_formats.py's random blocks.

    flock /tmp/pagedllm-bench.lock python3 benchmarks/probes/isa_levels_gemm.py avxvnni avx2
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from gguf import GGMLQuantizationType
from quant_gemm_formats import K, random_rows

from pagedllm.kernels.build import load_level
from pagedllm.kernels.interface import INTERLEAVED_OFFSET

T = GGMLQuantizationType
FORMATS = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)


def main() -> None:
    levels = sys.argv[1:3] if len(sys.argv) >= 3 else ["avxvnni", "avx2"]
    mods = [load_level(level) for level in levels]
    print(f"{levels[0]} ({mods[0].compiled_isa()}) vs {levels[1]} ({mods[1].compiled_isa()}), ms per call")
    for qtype in FORMATS:
        w = mods[0].quant_interleave_rows(random_rows(qtype), int(qtype))
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
