"""The paged manager's prefix-cache bookkeeping, per sequence: the chained hashes of its full
blocks, and how many of its leading blocks are registered in the BlockPool's prefix cache.

At admission, ``lookup`` finds the longest run of the sequence's leading full blocks that some
block in the pool already holds (by hash). After each step, ``register`` enters the full blocks
whose K/V that step wrote, never earlier: a step that fails leaves no hash of KV that was never
written. The hashes themselves and the hash -> block map live in kv/block_pool.py.
"""

from __future__ import annotations

from pagedllm.kv.base import NULL_BLOCK
from pagedllm.kv.block_pool import BlockHash, BlockPool, hash_full_blocks
from pagedllm.sequence import Sequence


class PrefixCacheRegistry:
    def __init__(self, pool: BlockPool, block_size: int, enabled: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        # Hashes of the sequence's full blocks, computed once and extended as it grows.
        self._hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of the sequence are registered in the prefix cache.
        self._num_cached: dict[str, int] = {}

    def _block_hashes(self, seq: Sequence, num_tokens: int) -> list[BlockHash]:
        """Hashes of the full blocks among the sequence's first ``num_tokens`` tokens."""
        hashes = self._hashes.setdefault(seq.seq_id, [])
        return hash_full_blocks(seq.all_token_ids, self.block_size, seq.cache_salt, hashes, num_tokens)

    def lookup(self, seq: Sequence) -> list[int]:
        """Blocks already holding the sequence's leading full blocks (prefix cache hits)."""
        if not self.enabled:
            return []
        # Never the block holding the last token: that token must run through the model to give
        # the logits the next token is sampled from.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._block_hashes(seq, max_blocks * self.block_size)[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def admitted(self, seq_id: str, num_cached_blocks: int) -> None:
        """The sequence got its first blocks, the leading ``num_cached_blocks`` from the cache."""
        self._num_cached[seq_id] = num_cached_blocks

    def register(self, seq: Sequence, table: list[int], num_tokens: int) -> None:
        """Registers the sequence's full blocks whose K/V are written (its ``num_computed_tokens``,
        at most the ``num_tokens`` its ``table`` was sized for)."""
        if not self.enabled:
            return
        rid = seq.seq_id
        num_full = min(seq.num_computed_tokens, num_tokens) // self.block_size
        start = self._num_cached[rid]
        if num_full <= start:
            return
        hashes = self._block_hashes(seq, num_full * self.block_size)
        for i in range(start, num_full):
            if table[i] != NULL_BLOCK:  # released (a table swapped back in registers again from 0)
                self.pool.cache_block(table[i], hashes[i])
        self._num_cached[rid] = num_full

    def fork(self, parent_id: str, child_id: str, num_full: int) -> None:
        """The child shares the parent's first ``num_full`` full blocks, and their registration."""
        self._hashes[child_id] = list(self._hashes.get(parent_id, [])[:num_full])
        self._num_cached[child_id] = min(self._num_cached.get(parent_id, 0), num_full)

    def moved(self, seq_id: str) -> None:
        """The sequence's blocks moved into new device blocks (swap in): none is registered yet."""
        self._num_cached[seq_id] = 0

    def forget(self, seq_id: str) -> None:
        self._hashes.pop(seq_id, None)
        self._num_cached.pop(seq_id, None)
