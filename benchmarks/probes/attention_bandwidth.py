"""Decode attention kernel alone: ms per layer and GB/s of K/V read, 200 sequences x 300 tokens.

python attention_bandwidth.py THREADS [huge]   ("huge": caches on transparent huge pages, as the engine)
Blocks of each sequence are scattered over the cache (random permutation), as after a long run;
with PLACED=1 each sequence's blocks follow one another, as the block pool places them.
`scattered_decode_batch` is also the data kernel_ab.py compares two builds on. The caches have the
engine's layout: [num_blocks, kv_heads, block_size, head_dim].
"""

import importlib.util
import os
import sys
import time

import torch

from pagedllm.host_memory import advise_huge_pages

SEQS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 200, 9, 3, 64, 16, 8


def load_build(name: str):
    """The kernels module of a build under the pagedllm kernel cache (~/.cache/pagedllm/kernels,
    PAGEDLLM_KERNEL_DIR), by its folder name, e.g. pagedllm_kernels_native_<key> (each edit of
    pagedllm/kernels/*.cpp or *.h makes a new one; kernel_ab.py and attention_hot_cold.py compare
    such builds)."""
    from pagedllm.kernels.build import cache_root

    path = next((cache_root() / name).glob(f"{name}*.so"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scattered_decode_batch(max_len: int, huge: bool, ragged: bool):
    """(k_caches, v_caches, block_tables, seq_lens, q) for LAYERS layers; lengths max_len, or
    uniform in max_len/2 .. max_len when ragged. Also returns the K/V bytes one layer reads."""
    blocks_per_seq = (max_len + BLOCK - 1) // BLOCK
    num_blocks = SEQS * blocks_per_seq + 10

    def cache() -> torch.Tensor:
        t = torch.empty(num_blocks, KV_HEADS, BLOCK, HEAD_DIM, dtype=torch.bfloat16)
        if huge:
            advise_huge_pages(t)
        return t.normal_()

    torch.manual_seed(0)
    k_caches = [cache() for _ in range(LAYERS)]
    v_caches = [cache() for _ in range(LAYERS)]
    if os.environ.get("PLACED") == "1":
        tables = torch.arange(SEQS * blocks_per_seq).view(SEQS, blocks_per_seq)
    else:
        tables = torch.randperm(num_blocks)[: SEQS * blocks_per_seq].view(SEQS, blocks_per_seq)
    if ragged:
        lens = torch.randint(max_len // 2, max_len + 1, (SEQS,), dtype=torch.long)
    else:
        lens = torch.full((SEQS,), max_len, dtype=torch.long)
    q = torch.randn(SEQS, HEADS, HEAD_DIM).bfloat16()
    read_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * 2
    return k_caches, v_caches, tables, lens, q, read_bytes


def main() -> None:
    from pagedllm.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    threads = int(sys.argv[1])
    huge = len(sys.argv) > 2 and sys.argv[2] == "huge"
    torch.set_num_threads(threads)
    k_caches, v_caches, tables, lens, q, read = scattered_decode_batch(300, huge, ragged=False)
    out = torch.empty_like(q)

    def one_pass() -> None:
        for k, v in zip(k_caches, v_caches, strict=True):
            kernels.paged_decode_attention(out, q, k, v, tables, lens, 0.125)

    one_pass()
    one_pass()
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        one_pass()
    dt = (time.perf_counter() - t0) / reps / LAYERS
    print(f"threads {threads} huge pages {huge}: {dt * 1e3:.2f} ms/layer, {read / dt / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
