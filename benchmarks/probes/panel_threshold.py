"""Whether the build's choice between the panels (kernels/quant_panels.h: 16 activation rows per
512-bit register) and the group kernels (up to six rows at a time) holds on this machine: one
quantized GEMM (2048 -> 8192, the 1.7B shape's MLP up projection), every repacked format, at 8 ..
128 activation rows, as the build dispatches it (Q4_K / Q5_K / Q6_K: panels from kPanelRowsMin
rows; Q4_0 / Q4_1 / Q5_x / Q8_0: whole panels from their own row counts, the rest in the group
kernels) against the same rows in calls of at most six (the group kernels alone; each call reads
the weights again, from the caches here, so this side is a little pessimistic). Medians of 9
calls, the two alternating; the bits are checked equal.

    cd benchmarks/probes && flock /tmp/pagedllm-bench.lock python3 panel_threshold.py
"""

from __future__ import annotations

import statistics
import time

import torch
from gguf import GGMLQuantizationType
from quant_gemm_formats import K, random_rows

from pagedllm.kernels import load_cpu_kernels
from pagedllm.kernels.interface import INTERLEAVED_OFFSET

T = GGMLQuantizationType
FORMATS = (T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
ROWS = (8, 12, 16, 20, 24, 32, 40, 48, 64, 128)


def main() -> None:
    kernels = load_cpu_kernels()
    print(f"kernels: {kernels.compiled_isa()}, threads {torch.get_num_threads()}")
    print("ms per GEMM, rows: one call / calls of <= 6 rows")
    for qtype in FORMATS:
        w = kernels.quant_interleave_rows(random_rows(qtype), int(qtype))
        code = INTERLEAVED_OFFSET + int(qtype)
        cells = []
        for m in ROWS:
            x = torch.randn(m, K)

            def one(x=x, w=w, code=code):
                return kernels.quant_gemm(x, w, code)

            def sixes(x=x, w=w, code=code):
                return [kernels.quant_gemm(x[i : i + 6], w, code) for i in range(0, len(x), 6)]

            assert torch.equal(one(), torch.cat(sixes()))
            times: list[list[float]] = [[], []]
            for _ in range(9):
                for i, f in enumerate((one, sixes)):
                    t = time.perf_counter()
                    f()
                    times[i].append((time.perf_counter() - t) * 1e3)
            a, b = (statistics.median(t) for t in times)
            cells.append(f"{m}: {a:.2f}/{b:.2f}")
        print(f"{qtype.name:5s} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
