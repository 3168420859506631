"""Decode attention kernel alone on two KV layouts: per-layer caches (main) vs block-major (all
layers of a block adjacent, each layer's cache a strided view; tried in session 7, needs the
kernels to take a block stride, which main's do not: run it at a build that has them).
200 sequences x 300 tokens, 30 layers, blocks placed in order, huge pages, 2 threads.

python kv_layout.py layer block layer block   (under the benchmark lock)
"""

import sys
import time

import torch

from pagedllm.host_memory import HUGE_PAGE, empty_on_huge_pages
from pagedllm.kernels import load_cpu_kernels

kernels = load_cpu_kernels()
SEQS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, LEN = 200, 9, 3, 64, 16, 30, 300
blocks_per_seq = (LEN + BLOCK - 1) // BLOCK
num_blocks = SEQS * blocks_per_seq + 16
torch.set_num_threads(2)


def caches(layout: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    block = (KV_HEADS, BLOCK, HEAD_DIM)
    if layout == "layer":
        views, _ = empty_on_huge_pages([((num_blocks, *block), torch.bfloat16)] * (2 * LAYERS), align=HUGE_PAGE)
        for v in views:
            v.normal_()
        return [(views[2 * i], views[2 * i + 1]) for i in range(LAYERS)]
    (arena,), _ = empty_on_huge_pages([((num_blocks, LAYERS, 2, *block), torch.bfloat16)], align=HUGE_PAGE)
    arena.normal_()
    return [(arena[:, i, 0], arena[:, i, 1]) for i in range(LAYERS)]


tables = torch.arange(SEQS * blocks_per_seq).view(SEQS, blocks_per_seq)
lens = torch.full((SEQS,), LEN, dtype=torch.long)
q = torch.randn(SEQS, HEADS, HEAD_DIM).bfloat16()
out = torch.empty_like(q)
read_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * 2


def one_pass(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for k, v in kv:
        kernels.paged_decode_attention(out, q, k, v, tables, lens, 0.125)


for layout in sys.argv[1:]:
    kv = caches(layout)
    try:
        one_pass(kv)
    except RuntimeError as e:  # main's kernels check that each cache is contiguous
        print(f"{layout:6s}: this build's kernels reject it ({str(e).splitlines()[0]})")
        continue
    one_pass(kv)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        one_pass(kv)
        times.append((time.perf_counter() - t0) / LAYERS)
    dt = sorted(times)[2]
    print(f"{layout:6s}: {dt * 1e3:.2f} ms/layer, {read_bytes / dt / 1e9:.1f} GB/s")
    del kv
