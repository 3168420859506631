"""Milliseconds of the float32 decode attention kernel (fp16 cache, as GGUF models run it) by row
layout: one decode row; 6 rows of one sequence at consecutive lengths (a verifying pass of k = 5);
512 rows of one prompt (float32 prefill rows run as decode rows); 32 different sequences (a
batched decode step). Heads of the default model (9 over 3 KV heads of 64) and of the 1.7B shape
(32 over 32 of 64); `calls` calls per timing (the layers of one step), median of 15.

    flock /tmp/pagedllm-bench.lock python3 benchmarks/probes/decode_attention_rows.py
"""

from __future__ import annotations

import statistics
import time

import torch

from pagedllm.kernels import load_cpu_kernels

# (label, query heads, KV heads, head_dim)
MODELS = [("default model", 9, 3, 64), ("1.7B shape", 32, 32, 64)]
# (keys of the first row, rows, one sequence?, calls per timing)
LAYOUTS = [(150, 1, True, 30), (300, 1, True, 30), (300, 6, True, 30), (512, 512, True, 1), (200, 32, False, 1)]


def main() -> None:
    kernels = load_cpu_kernels()
    assert kernels is not None, "no compiled kernels on this machine"
    torch.set_num_threads(2)
    blocks, bs = 2000, 16
    for label, h, hkv, d in MODELS:
        k = torch.randn(blocks, hkv, bs, d).half()
        v = torch.randn(blocks, hkv, bs, d).half()
        for keys, rows, one_sequence, calls in LAYOUTS:
            n = (keys + rows + bs) // bs + 1
            if one_sequence:  # rows at consecutive lengths over the same blocks
                tables, lens = (torch.arange(n) + 1).repeat(rows, 1), torch.arange(keys, keys + rows)
            else:
                tables = torch.stack([torch.randperm(blocks - 1)[:n] + 1 for _ in range(rows)])
                lens = torch.full((rows,), keys)
            q = torch.randn(rows, h, d)
            out = torch.empty_like(q)
            times = []
            for _ in range(15):
                t = time.perf_counter()
                for _ in range(calls):
                    kernels.paged_decode_attention(out, q, k, v, tables, lens, d**-0.5)
                times.append(time.perf_counter() - t)
            kind = "rows of one sequence" if one_sequence else "sequences"
            print(f"{label}: {rows} {kind} from {keys} keys, {calls} calls: {statistics.median(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
