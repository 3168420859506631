"""BlockPool: reference counts, the free LRU queue and the prefix cache, checked against a model.

The state machine keeps its own account of every reference handed out (a multiset of block ids),
of which hash each block is cached under, and of the order in which cached blocks became free,
and compares the pool with it after every step.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.kv.block_pool import BlockHash, BlockPool, hash_block_tokens


def _hashes() -> list[BlockHash]:
    """A handful of distinct hashes, some chained, so collisions between rules are frequent."""
    roots = [hash_block_tokens(None, (t, t + 1)) for t in range(4)]
    children = [hash_block_tokens(r, (7, 7)) for r in roots[:2]]
    return roots + children


HASHES = _hashes()


# ---- plain tests ----------------------------------------------------------------------------


def test_double_free_raises():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    # A block that was never handed out cannot be freed either.
    with pytest.raises(RuntimeError):
        pool.free([1 - b])
    pool.check_invariants()
    assert pool.num_free_blocks == 2


def test_shared_block_needs_one_free_per_reference():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.touch([b])
    pool.free([b])
    assert pool.ref_cnt[b] == 1 and not pool.is_free(b)
    pool.free([b])
    assert pool.ref_cnt[b] == 0 and pool.is_free(b)
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    held = pool.allocate(3)
    before = (list(pool.ref_cnt), pool.num_free_blocks)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert (list(pool.ref_cnt), pool.num_free_blocks) == before
    pool.check_invariants()
    assert pool.allocate(1) == [3]
    pool.free(held)


def test_placement_follows_and_leaves_room():
    pool = BlockPool(16, enable_caching=False)
    a = pool.allocate(2, room=5)  # a new sequence that may grow to 5 blocks
    b = pool.allocate(1, room=4)  # the next one starts past that room
    assert a == [0, 1] and b == [5]
    assert pool.allocate(2, follow=a[-1]) == [2, 3]  # a grows in place
    assert pool.allocate(2, follow=b[-1]) == [6, 7]
    pool.free([3, 2])
    # the block after 7 is free: taken; a later request past 15 falls back to the free queue
    assert pool.allocate(1, follow=7) == [8]
    assert pool.allocate(1, follow=15) == [2]  # no block 16: the queue, where uncached frees go first


def test_lru_eviction_order():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    assert blocks == [0, 1, 2, 3]
    h = HASHES
    for b in (0, 1, 2):
        pool.cache_block(b, h[b])
    # Block 3 stays uncached. Free order: 1, 0, 3, 2.
    for b in (1, 0, 3, 2):
        pool.free([b])
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks() == 3
    # The uncached free block goes first, then cached ones, least recently freed first.
    assert pool.allocate(1) == [3]
    assert pool.num_evictions == 0
    assert pool.allocate(1) == [1]
    assert pool.num_evictions == 1
    assert pool.lookup(h[1]) is None  # evicted: its hash is gone
    assert pool.lookup(h[0]) == 0 and pool.lookup(h[2]) == 2
    assert pool.allocate(2) == [0, 2]
    assert pool.num_cached_blocks() == 0 and pool.num_evictions == 3
    pool.check_invariants()


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(6)
    a = pool.allocate(3)
    for b, hh in zip(a, HASHES[:3], strict=True):
        pool.cache_block(b, hh)
    pool.free(reversed(a))
    # Three never-used blocks and three cached free blocks: the never-used ones go first.
    got = pool.allocate(3)
    assert set(got) == {3, 4, 5}
    assert pool.num_cached_blocks() == 3 and pool.num_evictions == 0
    # Freed tail first, so the tail of the prefix is evicted before its head.
    assert pool.allocate(1) == [a[2]]
    # Freed uncached blocks are reused before the remaining cached ones.
    pool.free([got[1]])
    assert pool.allocate(1) == [got[1]]
    assert pool.allocate(2) == [a[1], a[0]]


def test_cache_hit_revives_a_free_block_and_refreeing_makes_it_most_recent():
    pool = BlockPool(3)
    a = pool.allocate(3)
    for b, hh in zip(a, HASHES[:3], strict=True):
        pool.cache_block(b, hh)
    for b in a:
        pool.free([b])  # free order 0, 1, 2: block 0 is evicted first
    hit = pool.lookup(HASHES[0])
    assert hit == a[0]
    pool.touch([hit])
    assert not pool.is_free(hit) and pool.ref_cnt[hit] == 1 and pool.num_free_blocks == 2
    pool.free([hit])  # now the most recently freed
    assert pool.allocate(3) == [a[1], a[2], a[0]]


def test_cache_block_first_writer_wins_and_disabled_cache():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, HASHES[0])
    pool.cache_block(b, HASHES[0])  # identical content elsewhere: stays private
    pool.cache_block(a, HASHES[1])  # a block is cached under one hash only
    assert pool.lookup(HASHES[0]) == a
    assert pool.lookup(HASHES[1]) is None
    assert pool.block_hash[b] is None
    pool.check_invariants()

    off = BlockPool(2, enable_caching=False)
    [x] = off.allocate(1)
    off.cache_block(x, HASHES[0])
    assert off.lookup(HASHES[0]) is None and off.num_cached_blocks() == 0


# ---- state machine --------------------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    CACHING = True

    @initialize(num_blocks=st.integers(1, 8))
    def setup(self, num_blocks):
        caching = self.CACHING
        self.pool = BlockPool(num_blocks, enable_caching=caching)
        self.n = num_blocks
        self.caching = caching
        self.refs: list[int] = []  # one entry per reference handed out (a multiset)
        self.hash_of: dict[int, BlockHash] = {}  # block -> hash it is cached under
        self.cached_free_order: list[int] = []  # cached free blocks, least recently freed first

    # ---- helpers ----
    def count(self) -> Counter:
        return Counter(self.refs)

    def free_blocks(self) -> set[int]:
        c = self.count()
        return {b for b in range(self.n) if c[b] == 0}

    def block_cached_under(self, h: BlockHash) -> int | None:
        for b, hh in self.hash_of.items():
            if hh == h:
                return b
        return None

    # ---- rules ----
    @rule(data=st.data())
    def allocate(self, data):
        free = self.free_blocks()
        n = data.draw(st.integers(0, len(free)), label="n")
        uncached_free = {b for b in free if b not in self.hash_of}
        # Placement hints change which free blocks are chosen, never the rules checked below.
        hint = data.draw(st.sampled_from(["none", "follow", "room"]), label="hint")
        follow = data.draw(st.integers(0, self.n - 1), label="follow") if hint == "follow" else None
        room = data.draw(st.integers(1, 2 * self.n), label="room") if hint == "room" else 0
        got = self.pool.allocate(n, follow=follow, room=room)
        if follow is not None and n and follow + 1 in uncached_free:
            assert got[0] == follow + 1, "the block after the sequence's last one was free but not used"
        assert len(got) == n and len(set(got)) == n
        # Only free blocks are handed out: never one somebody (or the cache's user) references.
        assert set(got) <= free
        k = min(n, len(uncached_free))
        assert set(got[:k]) <= uncached_free, "cached blocks evicted while uncached ones were free"
        assert got[k:] == self.cached_free_order[: n - k], "eviction is not least-recently-freed first"
        for b in got[k:]:
            del self.hash_of[b]
        self.cached_free_order = self.cached_free_order[n - k :]
        self.refs.extend(got)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def share(self, data):
        b = data.draw(st.sampled_from(sorted(set(self.refs))), label="block")
        self.pool.touch([b])
        self.refs.append(b)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free_one(self, data):
        i = data.draw(st.integers(0, len(self.refs) - 1), label="ref")
        b = self.refs.pop(i)
        self.pool.free([b])
        if self.count()[b] == 0 and b in self.hash_of:
            self.cached_free_order.append(b)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free_many(self, data):
        """Drops several references in one call (like freeing a whole block table)."""
        idx = data.draw(
            st.lists(st.integers(0, len(self.refs) - 1), unique=True, min_size=1, max_size=len(self.refs)),
            label="refs",
        )
        blocks = [self.refs[i] for i in idx]
        for i in sorted(idx, reverse=True):
            self.refs.pop(i)
        self.pool.free(blocks)
        # A block joins the free queue where its last reference in the call drops (its last position).
        c = self.count()
        last_pos = {b: pos for pos, b in enumerate(blocks)}
        for b in sorted(last_pos, key=last_pos.__getitem__):
            if c[b] == 0 and b in self.hash_of:
                self.cached_free_order.append(b)

    @rule(data=st.data(), excess=st.integers(1, 3))
    def misuse(self, data, excess):
        """Over-allocation and double free both raise and change nothing."""
        before = (list(self.pool.ref_cnt), list(self.pool.block_hash), self.pool.num_free_blocks)
        with pytest.raises(RuntimeError):
            self.pool.allocate(len(self.free_blocks()) + excess)
        free = sorted(self.free_blocks())
        if free:
            b = data.draw(st.sampled_from(free), label="block")
            with pytest.raises(RuntimeError):
                self.pool.free([b])
        assert (list(self.pool.ref_cnt), list(self.pool.block_hash), self.pool.num_free_blocks) == before

    @precondition(lambda self: self.refs)
    @rule(data=st.data(), h=st.sampled_from(HASHES))
    def cache_block(self, data, h):
        b = data.draw(st.sampled_from(sorted(set(self.refs))), label="block")
        self.pool.cache_block(b, h)
        if self.caching and b not in self.hash_of and self.block_cached_under(h) is None:
            self.hash_of[b] = h

    @rule(h=st.sampled_from(HASHES), take=st.booleans())
    def lookup(self, h, take):
        """A lookup; with ``take``, the manager's path: take a reference on the hit."""
        queries, hits = self.pool.num_cache_queries, self.pool.num_cache_hits
        b = self.pool.lookup(h)
        assert b == self.block_cached_under(h)
        assert self.pool.num_cache_queries == queries + 1
        assert self.pool.num_cache_hits == hits + (b is not None)
        if b is None or not take:
            return
        was_free = self.count()[b] == 0
        self.pool.touch([b])
        self.refs.append(b)
        assert not self.pool.is_free(b)
        if was_free:
            self.cached_free_order.remove(b)
        assert self.pool.block_hash[b] == h  # a hit is never evicted by taking it

    @rule()
    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()
        c = self.count()
        self.hash_of = {b: h for b, h in self.hash_of.items() if c[b] > 0}
        self.cached_free_order = []

    # ---- invariants ----
    @invariant()
    def matches_model(self):
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check_invariants()
        c = self.count()
        for b in range(self.n):
            assert pool.ref_cnt[b] == c[b], f"block {b}: pool ref {pool.ref_cnt[b]}, model {c[b]}"
            assert pool.is_free(b) == (c[b] == 0), f"block {b} both free and referenced (or neither)"
            assert pool.block_hash[b] == self.hash_of.get(b)
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert pool.num_free_blocks == sum(1 for b in range(self.n) if c[b] == 0)
        assert pool.num_cached_blocks() == len(self.hash_of)
        if not self.caching:
            assert pool.num_cached_blocks() == 0
        assert all(c[b] == 0 for b in self.cached_free_order)
        assert {b for b in self.hash_of if c[b] == 0} == set(self.cached_free_order)

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        self.pool.free(self.refs)
        self.refs = []
        self.pool.check_invariants()
        assert self.pool.num_free_blocks == self.n


class BlockPoolNoCachingMachine(BlockPoolMachine):
    CACHING = False


BlockPoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
BlockPoolNoCachingMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolNoCachingMachine = BlockPoolNoCachingMachine.TestCase
