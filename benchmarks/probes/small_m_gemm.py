"""The default model's quantized GEMMs at a few activation rows: what a speculative verifying pass
(last token + k drafts = k + 1 rows) pays over a decode step (1 row).

    flock /tmp/pagedllm-bench.lock python3 benchmarks/probes/small_m_gemm.py [ROWS ...]

Times every QuantizedLinear of the model (its layers' projections, then the LM head) on random
input, median of 30 calls each after 3 warm-ups, and prints the sums per projection name in ms.
Each module is called back to back, so its weights are warm in the caches: this measures the
kernels' work per row, not the weights' reads.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from pagedllm import LLM
from pagedllm.models.quantized_linear import QuantizedLinear


def main() -> None:
    rows = [int(a) for a in sys.argv[1:]] or [1, 5, 16]
    model = LLM().llm_engine.runner.model
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    for m_rows in rows:
        totals: dict[str, float] = {}
        for name, mod in mods:
            x = torch.randn(m_rows, mod.in_features)
            for _ in range(3):
                mod(x)
            times = []
            for _ in range(30):
                t = time.perf_counter()
                mod(x)
                times.append(time.perf_counter() - t)
            key = name.removesuffix(".local").rsplit(".", 1)[-1]  # qkv_proj, ..., lm_head
            totals[key] = totals.get(key, 0.0) + statistics.median(times)
        parts = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in totals.items())
        print(f"rows {m_rows}: {parts}; all {sum(totals.values()) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
