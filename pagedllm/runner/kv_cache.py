"""The physical KV cache tensors: one K and one V tensor per layer, [num_blocks, Hkv, block_size, D].

Head-major within a block (vLLM's V layout): the block_size x D keys of one KV head are one
contiguous run, so decode attention, which reads one head of a sequence at a time, streams whole
runs instead of every third 128-byte slice of a token-major block (measured 3-10% faster in the
CPU kernel alone). A token's slot is still ``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch

from pagedllm.host_memory import empty_on_huge_pages

GIB = 1 << 30


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def num_blocks_for_memory(memory_gib: float, bytes_per_block: int) -> int:
    return int(memory_gib * GIB) // bytes_per_block


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Zeroed, not empty: attention multiplies masked-out slots by probability 0, and 0 * NaN
    # garbage would still poison the output.
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if torch.device(device).type == "cpu":
        return _cpu_caches_on_huge_pages(num_layers, shape, dtype)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def _cpu_caches_on_huge_pages(
    num_layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """All layers' K and V caches as views of one fresh buffer on huge pages, packed end to end.

    As 60 separate ~66 MB tensors, some were carved from memory the allocator had already touched
    with 4 KiB pages (freed load-time buffers), which madvise does not convert (seen in smaps).
    Starting each view on its own huge page instead wasted up to 2 MiB per view: 104 MiB of a
    256 MiB cache of 60 views of 4.5 MB."""
    caches, _ = empty_on_huge_pages([(shape, dtype)] * (2 * num_layers), align=64)
    for t in caches:
        t.zero_()  # the first touch, after the advice
    return [(caches[2 * i], caches[2 * i + 1]) for i in range(num_layers)]


def move_blocks(
    src_caches: list[tuple[torch.Tensor, torch.Tensor]],
    dst_caches: list[tuple[torch.Tensor, torch.Tensor]],
    pairs: list[tuple[int, int]],
) -> None:
    """Copies whole blocks src -> dst in every layer's K and V (COW copies and swaps).

    All sources are read before any destination is written (index gather, then scatter).
    """
    if not pairs:
        return
    src_dev = src_caches[0][0].device
    dst_dev = dst_caches[0][0].device
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=src_dev)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst_dev)
    for (sk, sv), (dk, dv) in zip(src_caches, dst_caches, strict=True):
        for s_cache, d_cache in ((_as_bytes(sk), _as_bytes(dk)), (_as_bytes(sv), _as_bytes(dv))):
            d_cache.index_copy_(0, dst, s_cache.index_select(0, src).to(dst_dev, non_blocking=False))


def _as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A float8 cache viewed as its bytes (torch has no index_copy_ for float8; a copy is bytes)."""
    return cache.view(torch.uint8) if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else cache


def apply_block_ops(
    ops: list,
    device_caches: list[tuple[torch.Tensor, torch.Tensor]],
    host_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
) -> None:
    """Replays a step's BlockOps (pagedllm.kv.base.BlockOp) in their recorded order."""
    for op in ops:
        if op.kind == "copy":
            move_blocks(device_caches, device_caches, op.pairs)
        elif op.kind == "swap_out":
            assert host_caches is not None, "swap_out without a host KV cache"
            move_blocks(device_caches, host_caches, op.pairs)
        elif op.kind == "swap_in":
            assert host_caches is not None, "swap_in without a host KV cache"
            move_blocks(host_caches, device_caches, op.pairs)
        else:
            raise ValueError(f"unknown block op {op.kind!r}")
