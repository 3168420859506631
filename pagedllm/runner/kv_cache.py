"""The physical KV cache tensors: one K and one V tensor per layer, [num_blocks, block_size, Hkv, D]."""

from __future__ import annotations

import torch

GIB = 1 << 30


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def num_blocks_for_memory(memory_gib: float, bytes_per_block: int) -> int:
    return int(memory_gib * GIB) // bytes_per_block


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Zeroed, not empty: attention multiplies masked-out slots by probability 0, and 0 * NaN
    # garbage would still poison the output.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
