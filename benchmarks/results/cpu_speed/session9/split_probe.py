"""Session 9: a decode step's layer loop at kernel level (30 layers: qkv GEMM, decode attention,
o, gate_up + SiLU, down) for SEQS sequences of CTX tokens: as one batch on both threads
("whole"), one half alone on one thread ("half"), or two halves at once from two Python threads
on one OpenMP thread each ("split": needs kernels that release the GIL and a per-thread thread
count, set_thread_parallelism; the session's experiment had them, main does not).

python split_probe.py 200 300 whole|half|split
"""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from pagedllm.host_memory import advise_huge_pages
from pagedllm.kernels import load_cpu_kernels
from pagedllm.models.cpu_linear import interleave_gate_up, tile_order

k = load_cpu_kernels()
torch.manual_seed(0)
LAYERS, HIDDEN, INTER, BS = 30, 576, 1536, 16
NS, CTX, MODE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


def weight(n: int, kk: int) -> torch.Tensor:
    return torch.randn(n, kk, dtype=torch.bfloat16) * 0.02


layers = [
    (
        tile_order(weight(960, HIDDEN)),
        tile_order(weight(HIDDEN, HIDDEN)),
        tile_order(interleave_gate_up(weight(2 * INTER, HIDDEN))),
        tile_order(weight(HIDDEN, INTER)),
    )
    for _ in range(LAYERS)
]
num_blocks = NS * (CTX // BS + 1)


def cache() -> torch.Tensor:
    t = torch.empty(num_blocks, 3, BS, 64, dtype=torch.bfloat16)
    advise_huge_pages(t)
    return t.normal_()


caches = [(cache(), cache()) for _ in range(LAYERS)]
tables = torch.randperm(num_blocks).view(NS, -1)
lens = torch.full((NS,), CTX, dtype=torch.long)


def set_threads(n: int) -> None:
    if hasattr(k, "set_thread_parallelism"):
        k.set_thread_parallelism(n)  # this thread's OpenMP count only
    else:
        torch.set_num_threads(n)


def forward(rows: slice, threads: int) -> torch.Tensor:
    set_threads(threads)
    n = rows.stop - rows.start
    x = torch.randn(n, HIDDEN, dtype=torch.bfloat16)
    bt, ln = tables[rows], lens[rows]
    for (wq, wo, wgu, wd), (kc, vc) in zip(layers, caches, strict=True):
        q = k.amx_gemm(x, wq, None, "none")[:, :576].view(n, 9, 64)
        o = torch.empty(n, 9, 64, dtype=torch.bfloat16)
        k.paged_decode_attention(o, q, kc, vc, bt, ln, 0.125)
        h = k.amx_gemm(o.view(n, 576), wo, None, "none")
        x = k.amx_gemm(k.amx_gemm(h, wgu, None, "silu_mul"), wd, None, "none")
    return x


pool = ThreadPoolExecutor(1)


def step() -> None:
    if MODE == "half":
        forward(slice(0, NS // 2), 1)
    elif MODE == "whole":
        forward(slice(0, NS), 2)
    else:
        other = pool.submit(forward, slice(NS // 2, NS), 1)
        forward(slice(0, NS // 2), 1)
        set_threads(2)
        other.result()


for _ in range(3):
    step()
ts = []
for _ in range(10):
    t0 = time.perf_counter()
    step()
    ts.append(time.perf_counter() - t0)
ts.sort()
print(f"{MODE} {NS} seqs x {CTX}: median {ts[5] * 1e3:.1f} ms/step, min {ts[0] * 1e3:.1f}")
