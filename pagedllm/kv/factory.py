"""Chooses the KV cache manager for a configuration."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.kv.base import KVCacheManager
from pagedllm.kv.paged import PagedKVCacheManager


def make_kv_manager(
    config: EngineConfig, num_blocks: int, max_model_len: int, release_window: int | None = None
) -> KVCacheManager:
    """``release_window``: the widest sliding window when every layer has one: the paged layout
    then releases blocks out of it (the contiguous baselines keep their reservations)."""
    if config.kv_layout == "paged":
        return PagedKVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, release_window, config.max_num_batched_tokens
        )
    from pagedllm.kv.contiguous import ContiguousKVCacheManager

    return ContiguousKVCacheManager(num_blocks, config.block_size, config.reserve, max_model_len)
