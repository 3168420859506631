"""The physical KV cache tensors: one K and one V tensor per layer, [num_blocks, Hkv, block_size, D].

Head-major within a block (vLLM's V layout): the block_size x D keys of one KV head are one
contiguous run, so decode attention, which reads one head of a sequence at a time, streams whole
runs instead of every third 128-byte slice of a token-major block (measured 3-10% faster in the
CPU kernel alone). A token's slot is still ``block_id * block_size + offset``.

An int8 cache (kv_cache_dtype "int8") carries float32 scales per token and KV head (one per group
of values) in a tensor [num_blocks, Hkv, block_size, groups] attached to it
(pagedllm/attention/int8_kv.py): their bytes count in the block's size, and block copies and
swaps move them with the block's rows.
"""

from __future__ import annotations

import torch

from pagedllm.attention.int8_kv import SCALE_DTYPE, attach_scales, cache_scales, scale_bytes_per_row, scales_shape
from pagedllm.host_memory import empty_on_huge_pages

GIB = 1 << 30


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of every layer, an int8 cache's float32 scales (per token, head and group) included."""
    per_row = head_dim * dtype.itemsize + scale_bytes_per_row(dtype, head_dim)
    return 2 * num_layers * block_size * num_kv_heads * per_row


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
    # an int8 cache's scales: after every cache, in the same buffer
    specs = [(shape, dtype)] * (2 * num_layers) + [(scales_shape(shape), SCALE_DTYPE)] * (
        2 * num_layers if scale_bytes_per_row(dtype, head_dim) else 0
    )
    if torch.device(device).type == "cpu":
        tensors = _cpu_tensors_on_huge_pages(specs)
    else:
        tensors = [torch.zeros(s, dtype=d, device=device) for s, d in specs]
    caches, scales = tensors[: 2 * num_layers], tensors[2 * num_layers :]
    for cache, s in zip(caches[: len(scales)], scales, strict=True):
        attach_scales(cache, s)
    return [(tensors[2 * i], tensors[2 * i + 1]) for i in range(num_layers)]


def _cpu_tensors_on_huge_pages(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """All layers' K and V caches (and scales) as zeroed views of one fresh buffer on huge pages,
    packed end to end.

    As 60 separate ~66 MB tensors, some were carved from memory the allocator had already touched
    with 4 KiB pages (freed load-time buffers), which madvise does not convert (seen in smaps).
    Starting each view on its own huge page instead wasted up to 2 MiB per view: 104 MiB of a
    256 MiB cache of 60 views of 4.5 MB."""
    tensors, _ = empty_on_huge_pages(specs, align=64)
    for t in tensors:
        t.zero_()  # the first touch, after the advice
    return tensors


def move_blocks(
    src_caches: list[tuple[torch.Tensor, torch.Tensor]],
    dst_caches: list[tuple[torch.Tensor, torch.Tensor]],
    pairs: list[tuple[int, int]],
) -> None:
    """Copies whole blocks src -> dst in every layer's K and V, and an int8 cache's scales (COW
    copies and swaps).

    All sources are read before any destination is written (index gather, then scatter).
    """
    if not pairs:
        return
    src_dev = src_caches[0][0].device
    dst_dev = dst_caches[0][0].device
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=src_dev)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst_dev)
    for (sk, sv), (dk, dv) in zip(src_caches, dst_caches, strict=True):
        for s_cache, d_cache in ((sk, dk), (sv, dv)):
            moves = [(_as_bytes(s_cache), _as_bytes(d_cache))]
            if (s_scales := cache_scales(s_cache)) is not None:
                d_scales = cache_scales(d_cache)
                assert d_scales is not None, "an int8 cache's blocks moved into one without scales"
                moves.append((s_scales, d_scales))
            for s_t, d_t in moves:
                d_t.index_copy_(0, dst, s_t.index_select(0, src).to(dst_dev, non_blocking=False))


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
