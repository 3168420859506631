"""The paged KV cache manager: block tables allocated on demand, shared through the prefix cache."""

from __future__ import annotations

from pagedllm.kv.base import KVCacheManager, KVCacheStats
from pagedllm.kv.block_pool import BlockHash, BlockPool, hash_block_tokens
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._tables: dict[str, list[int]] = {}
        # Tokens each request's table was sized for (its slots in use after the step runs).
        self._num_tokens: dict[str, int] = {}
        # Hashes of the request's full blocks, computed once and extended as it grows.
        self._hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of the request are registered in the prefix cache.
        self._num_cached: dict[str, int] = {}

    # ---- prefix cache --------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        """Hashes of the full blocks among the request's first ``num_tokens`` tokens."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return []
        # Never the block holding the last token: that token must run through the model to give
        # the logits the next token is sampled from.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._block_hashes(request, max_blocks * self.block_size)[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self.pool.num_cache_queries, self.pool.num_cache_hits

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        rid = request.request_id
        table = self._tables.get(rid)
        cached_blocks = cached_blocks or []
        if table is None:
            table = []
            num_computed = len(cached_blocks) * self.block_size
        else:
            assert not cached_blocks, "cached prefix blocks are only taken at admission"
            num_computed = request.num_computed_tokens
        num_tokens = num_computed + num_new_tokens
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(table) - len(cached_blocks)
        # Cached blocks that sit in the free queue stop being free when we take them.
        num_free_taken = sum(1 for b in cached_blocks if self.pool.is_free(b))
        if num_new_blocks > self.pool.num_free_blocks - num_free_taken:
            return False
        if rid not in self._tables:
            self._tables[rid] = table
            self._num_cached[rid] = len(cached_blocks)
        self.pool.touch(cached_blocks)
        table.extend(cached_blocks)
        if num_new_blocks > 0:
            table.extend(self.pool.allocate(num_new_blocks))
        self._num_tokens[rid] = max(num_tokens, self._num_tokens.get(rid, 0))
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, num_tokens)
        return True

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the blocks that are full once this step's tokens are written."""
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self._num_cached[rid]
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full * self.block_size)
        table = self._tables[rid]
        for i in range(start, num_full):
            self.pool.cache_block(table[i], hashes[i])
        self._num_cached[rid] = num_full

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self._tables.pop(rid, None)
        self._num_tokens.pop(rid, None)
        self._num_cached.pop(rid, None)
        self._hashes.pop(rid, None)
        if table:
            self.pool.free(reversed(table))

    # ---- queries -------------------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.num_blocks

    def stats(self) -> KVCacheStats:
        bs = self.block_size
        fill: dict[int, int] = {}
        for rid, table in self._tables.items():
            n = self._num_tokens[rid]
            for i, b in enumerate(table):
                f = min(bs, n - i * bs)
                if f > fill.get(b, 0):
                    fill[b] = f
        shared = sum(1 for b in fill if self.pool.ref_cnt[b] > 1)
        reserved = len(fill) * bs
        used = sum(fill.values())
        total = self.num_blocks * bs
        return KVCacheStats(total=total, reserved=reserved, used=used, free=total - reserved, shared_blocks=shared)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for b in table:
                refs[b] += 1
        assert refs == self.pool.ref_cnt, "refcounts differ from the block tables' references"
