"""Chooses the KV cache manager for a configuration."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.kv.base import KVCacheManager
from pagedllm.kv.paged import PagedKVCacheManager


def make_kv_manager(config: EngineConfig, num_blocks: int, max_model_len: int) -> KVCacheManager:
    if config.kv_layout == "paged":
        return PagedKVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
    from pagedllm.kv.contiguous import ContiguousKVCacheManager

    return ContiguousKVCacheManager(num_blocks, config.block_size, config.reserve, max_model_len)
