"""The machine's memory read bandwidth, for the decode floor: a batch-1 decode step reads every
weight byte once, so weight bytes per token / this bandwidth is the fastest a step can be.

    python read_bandwidth.py [THREADS] [GIB]      (defaults: 2 threads, 2 GiB)

Sums a buffer much larger than the caches (float32, torch's vectorized reduction over THREADS
threads), each pass touching every byte once, median GB/s of 7 passes after one warm-up. A sum
is what a bandwidth-bound GEMV does per weight byte at most, so this is the read rate a kernel can
reach, not the DRAM's nominal peak.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch


def read_gb_s(threads: int, gib: float, passes: int = 7) -> list[float]:
    torch.set_num_threads(threads)
    buf = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    buf.sum()  # warm-up: pages faulted in, threads started
    rates = []
    for _ in range(passes):
        t0 = time.perf_counter()
        buf.sum()
        rates.append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return rates


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    gib = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    rates = read_gb_s(threads, gib)
    print(
        json.dumps(
            {
                "threads": threads,
                "gib": gib,
                "read_gb_s": round(statistics.median(rates), 2),
                "passes_gb_s": [round(r, 2) for r in rates],
            }
        )
    )


if __name__ == "__main__":
    main()
