"""BlockPool: the physical KV blocks, their reference counts and the prefix cache.

A block is free when no sequence references it (ref_cnt == 0). Free blocks wait in an LRU
queue; a free block may still hold a cached prefix (it has a hash), which stays reusable until
the block is handed out again, so eviction is least-recently-freed first.

Placement is a preference, never a reservation: a sequence's next block is, when possible, the
physical block right after its last one, and a new sequence starts at a "frontier" that leaves
room for it to grow. Decode attention then reads each sequence's K/V as long runs that the
hardware prefetcher follows, instead of 16-token blocks scattered over the whole cache (the
paged CPU kernel alone: 12-15% faster on contiguous block tables). Any free block still serves
any sequence, so paging keeps its memory behaviour; placement only picks among free blocks that
hold no cached prefix, so the prefix cache's eviction order is unchanged.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np


class BlockHash(NamedTuple):
    """Identifies a full block by its whole prefix.

    ``parent`` is a SHA-256 digest of the parent block's BlockHash, so it covers every earlier
    block; a dict lookup then compares the digest and this block's own token ids. A 64-bit
    Python hash() here would let a crafted prompt collide with another user's prefix and read
    its KV (vLLM moved to SHA-256 for the same reason).
    """

    parent: bytes | None
    token_ids: tuple[int, ...]

    def digest(self) -> bytes:
        h = hashlib.sha256(self.parent or b"")
        h.update(array("q", self.token_ids).tobytes())
        return h.digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes | None = None) -> BlockHash:
    """``salt``: the first block's stand-in for a parent, what besides the tokens decides the
    sequence's keys (Sequence.cache_salt); hashed, so it is never some block's digest."""
    if parent is not None:
        return BlockHash(parent.digest(), tuple(token_ids))
    return BlockHash(None if salt is None else hashlib.sha256(salt).digest(), tuple(token_ids))


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: bytes | None = None,
    hashes: list[BlockHash] | None = None,
    num_tokens: int | None = None,
) -> list[BlockHash]:
    """The chained hashes of the full blocks among the first ``num_tokens`` of ``token_ids`` (all
    of them by default): the k-th covers ``salt`` and blocks 0..k. ``hashes``: those of the
    leading blocks already computed, extended in place (and returned)."""
    hashes = [] if hashes is None else hashes
    end = len(token_ids) if num_tokens is None else num_tokens
    for i in range(len(hashes), end // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], salt))
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # An array, not a list: indexing is as cheap, and numpy reads it without a copy
        # (block_view snapshots 100k blocks in microseconds).
        self.ref_cnt = array("i", bytes(4 * num_blocks))
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # Free blocks in eviction order (front = evicted first). OrderedDict gives O(1) removal of
        # a cached block that gets hit while free.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._frontier = 0  # where the next new sequence is placed (see allocate)
        # Prefix cache statistics (in blocks).
        self.num_cache_queries = 0
        self.num_cache_hits = 0
        self.num_evictions = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_block_ids(self) -> np.ndarray:
        """The blocks holding a prefix-cache entry (free or in use), as an int64 array."""
        return np.fromiter(self._cached.values(), dtype=np.int64, count=len(self._cached))

    def ref_counts(self) -> np.ndarray:
        """Every block's reference count: a read-only view of the live counts (copy it to keep it)."""
        view = np.frombuffer(self.ref_cnt, dtype=np.intc)  # array "i" is a C int
        view.flags.writeable = False
        return view

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, n: int, follow: int | None = None, room: int = 0) -> list[int]:
        """Hands out n free blocks (ref_cnt 1), evicting their cached contents if any.

        Placement hints (any free block is still used when they cannot be met): ``follow``, the
        sequence's current last block, asks for the blocks right after it; ``room`` > 0 marks the
        first blocks of a new sequence that may grow to ``room`` blocks: it starts at the
        frontier, which then moves past that room. Without hints: least recently freed first.
        """
        if n > len(self._free):
            raise RuntimeError(f"BlockPool: asked for {n} blocks, only {len(self._free)} free")
        nxt = follow + 1 if follow is not None else (self._place_new(room) if room > 0 else None)
        out = []
        for _ in range(n):
            if nxt is not None and self._placeable(nxt):
                block_id = nxt
                del self._free[block_id]
            else:
                block_id, _ = self._free.popitem(last=False)
                h = self.block_hash[block_id]
                if h is not None:
                    self.num_evictions += 1
                    del self._cached[h]
                    self.block_hash[block_id] = None
            self.ref_cnt[block_id] = 1
            out.append(block_id)
            nxt = block_id + 1
        return out

    def _placeable(self, block_id: int) -> bool:
        """Free and holding no cached prefix (taking it evicts nothing out of LRU order)."""
        return block_id < self.num_blocks and self.ref_cnt[block_id] == 0 and self.block_hash[block_id] is None

    _FRONTIER_SCAN = 256  # blocks looked at past the frontier before giving up on placement

    def _place_new(self, room: int) -> int | None:
        for k in range(min(self._FRONTIER_SCAN, self.num_blocks)):
            b = (self._frontier + k) % self.num_blocks
            if self._placeable(b):
                self._frontier = (b + room) % self.num_blocks
                return b
        return None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Adds a reference to each block (sharing, or reusing a cached prefix)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference from each block; unreferenced blocks join the free queue's tail.

        Callers pass a sequence's blocks tail first, so that the end of a prefix is evicted
        before its beginning (a later request is likelier to share the beginning).
        """
        for b in block_ids:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"BlockPool: double free of block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.block_hash[b] is None or not self.enable_caching:
                    # Uncached blocks go to the front: reuse them before evicting useful prefixes.
                    self._free[b] = None
                    self._free.move_to_end(b, last=False)
                else:
                    self._free[b] = None

    # ---- prefix cache --------------------------------------------------------------------
    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Registers a full, computed block under its prefix hash (first writer wins)."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; this one stays private
        self._cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash

    def lookup(self, block_hash: BlockHash) -> int | None:
        self.num_cache_queries += 1
        b = self._cached.get(block_hash)
        if b is not None:
            self.num_cache_hits += 1
        return b

    def reset_prefix_cache(self) -> None:
        for h, b in list(self._cached.items()):
            if self.ref_cnt[b] == 0:
                del self._cached[h]
                self.block_hash[b] = None

    def check_invariants(self) -> None:
        """Raises AssertionError if the pool's bookkeeping is inconsistent (tests call it)."""
        assert all(r >= 0 for r in self.ref_cnt), "negative refcount"
        free = set(self._free)
        assert len(free) == len(self._free)
        for b in range(self.num_blocks):
            assert (self.ref_cnt[b] == 0) == (b in free), f"block {b}: ref {self.ref_cnt[b]}, free {b in free}"
        for h, b in self._cached.items():
            assert self.block_hash[b] == h
        assert sum(h is not None for h in self.block_hash) == len(self._cached)
