"""The paged KV cache manager: block tables allocated on demand, shared through the prefix cache
and by forking (n > 1, beam search), with copy-on-write and swapping to a host-memory pool.

Sharing: ``fork`` gives a child sequence its parent's whole block table and bumps the refcounts.
Full blocks are never written again, so only the last, partly filled block can be written while
shared: ``allocate_slots`` sees that (refcount > 1 on a block the step writes into), gives the
writer a fresh block and records a (src, dst) copy, which the runner executes before the forward.
The last holder of a shared block writes into it in place, so k sharers make k - 1 copies.

Prefix cache: a sequence admitted with leading full blocks some block already holds takes those
blocks; its own full blocks are registered once their K/V is written. The per-sequence hashes
and registration are kv/prefix_cache.py's, the hash -> block map kv/block_pool.py's.

Swapping: ``swap_out`` moves a set of sequences' blocks into a second BlockPool whose blocks live
in host memory (a block shared inside the set is copied once and stays shared there), and
``swap_in`` brings them back into fresh device blocks. The moves are recorded as BlockOps too.

Sliding-window release (``release_window``: every layer attends through a window, the widest W):
after each step, a sequence's leading blocks that no query can see any more go back to the pool
and their entries become NULL_BLOCK (vLLM's sliding-window block release), so a long generation
holds about ceil(W / block_size) + 1 blocks, not its whole context. The next query of a sequence
is at position ``num_computed_tokens`` (or one earlier: a fork re-runs its last token), which sees
keys from num_computed_tokens - W on: every block wholly before that is released. Released
entries are always a prefix of the table; a released full block keeps its prefix-cache hash (it
is freed like any other block), so it serves prefix hits until it is evicted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

import numpy as np

from pagedllm.kv import block_view
from pagedllm.kv.base import NULL_BLOCK, BlockOp, KVCacheManager, KVCacheStats
from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.prefix_cache import PrefixCacheRegistry
from pagedllm.sequence import Sequence
from pagedllm.utils import cdiv


class PagedKVCacheManager(KVCacheManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        release_window: int | None = None,
        max_step_tokens: int | None = None,
    ) -> None:
        """``release_window``: the widest sliding window when every layer has one (blocks out of
        it are released); None: every block is kept while its sequence lives. ``max_step_tokens``:
        the most tokens a sequence runs in one step (the scheduler's budget), which with release
        bounds the blocks a sequence ever holds at once."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.release_window = release_window
        self.max_step_tokens = max_step_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.prefix_cache = PrefixCacheRegistry(self.pool, block_size, enable_prefix_caching)
        self._tables: dict[str, list[int]] = {}
        # Tokens each request's table was sized for (its slots in use after the step runs).
        self._num_tokens: dict[str, int] = {}
        # Copies and swaps recorded since the scheduler last took them, in order.
        self._ops: list[BlockOp] = []
        # Host-memory pool for swapped-out sequences (enable_swap), and their tables in it.
        self.host_pool: BlockPool | None = None
        self._host_tables: dict[str, list[int]] = {}
        # Device blocks the last taken swap ops moved out of or into (shown as "swapping").
        self._last_swapped_blocks: list[int] = []
        self.num_cow_copies = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_released_blocks = 0

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        if seq.seq_id in self._tables:
            return []
        return self.prefix_cache.lookup(seq)

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self.pool.num_cache_queries, self.pool.num_cache_hits

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        rid = seq.seq_id
        assert rid not in self._host_tables, f"{rid} is swapped out: swap it in before running it"
        table = self._tables.get(rid)
        cached_blocks = cached_blocks or []
        if table is None:
            table = []
            num_computed = len(cached_blocks) * self.block_size
        else:
            assert not cached_blocks, "cached prefix blocks are only taken at admission"
            num_computed = seq.num_computed_tokens
        num_tokens = num_computed + num_new_tokens
        num_new_blocks = max(0, cdiv(num_tokens, self.block_size) - len(table) - len(cached_blocks))
        # Copy-on-write: blocks this step writes into that other sequences also hold (a forked
        # sequence's partly filled last block). Only those; full blocks are never written.
        first_written = num_computed // self.block_size
        cow = [
            i
            for i in range(first_written, min(len(table), cdiv(num_tokens, self.block_size)))
            if self.pool.ref_cnt[table[i]] > 1
        ]
        # Cached blocks that sit in the free queue stop being free when we take them.
        num_free_taken = sum(1 for b in cached_blocks if self.pool.is_free(b))
        if num_new_blocks + len(cow) > self.pool.num_free_blocks - num_free_taken:
            return False
        if rid not in self._tables:
            self._tables[rid] = table
            self.prefix_cache.admitted(rid, len(cached_blocks))
        self.pool.touch(cached_blocks)
        table.extend(cached_blocks)
        if cow:
            fresh = self.pool.allocate(len(cow))
            self._record("copy", [(table[i], b) for i, b in zip(cow, fresh, strict=True)])
            self.pool.free(table[i] for i in cow)  # the other holders keep theirs
            for i, b in zip(cow, fresh, strict=True):
                table[i] = b
            self.num_cow_copies += len(cow)
        if num_new_blocks > 0:
            if table:
                table.extend(self.pool.allocate(num_new_blocks, follow=table[-1]))
            else:  # a new sequence: room for all it may grow to (placement only, not reserved)
                max_len = seq.num_prompt_tokens + (seq.sampling_params.max_tokens or 0)
                table.extend(self.pool.allocate(num_new_blocks, room=max(cdiv(max_len, self.block_size), 1)))
        self._num_tokens[rid] = max(num_tokens, self._num_tokens.get(rid, 0))
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Registers the sequence's full blocks whose K/V are written (``num_computed_tokens``).

        Called after the step that wrote them, never at allocation: a step that fails leaves
        no hash of KV that was never written."""
        table = self._tables.get(seq.seq_id)
        if table is not None:
            self.prefix_cache.register(seq, table, self._num_tokens[seq.seq_id])

    def trim_to_computed(self, seq: Sequence) -> int:
        rid = seq.seq_id
        table = self._tables[rid]
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        # Blocks past ``keep`` were taken for this step's drafts: never registered in the prefix
        # cache (only computed full blocks are), so they go straight back to the pool.
        dropped = table[keep:]
        if dropped:
            del table[keep:]
            self.pool.free(reversed(dropped))
        self._num_tokens[rid] = min(self._num_tokens[rid], seq.num_computed_tokens)
        return len(table)

    def free(self, seq: Sequence) -> None:
        rid = seq.seq_id
        table = self._tables.pop(rid, None)
        host_table = self._host_tables.pop(rid, None)
        self._num_tokens.pop(rid, None)
        self.prefix_cache.forget(rid)
        if table:
            self.pool.free(_live(reversed(table)))
        if host_table:
            assert self.host_pool is not None
            self.host_pool.free(_live(reversed(host_table)))

    def release_out_of_window(self, seq: Sequence) -> int:
        if self.release_window is None:
            return 0
        table = self._tables.get(seq.seq_id)
        if table is None:
            return 0
        # The earliest key a next query sees: one before num_computed_tokens' own window, for a
        # fork that re-runs its last token.
        first_needed = seq.num_computed_tokens - self.release_window
        end = min(max(0, first_needed) // self.block_size, len(table))
        # Released entries are a prefix of the table: walk back from ``end`` to the last one
        # released before, so a step costs the blocks it frees, not the whole released prefix.
        start = end
        while start > 0 and table[start - 1] != NULL_BLOCK:
            start -= 1
        released = table[start:end]
        if not released:
            return 0
        table[start:end] = [NULL_BLOCK] * len(released)
        self.pool.free(reversed(released))
        self.num_released_blocks += len(released)
        return len(released)

    # ---- sharing -------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> bool:
        pid, cid = parent.seq_id, child.seq_id
        assert cid not in self._tables and cid not in self._host_tables, f"{cid} already holds blocks"
        if pid in self._tables:
            tables, pool = self._tables, self.pool
        elif pid in self._host_tables:
            assert self.host_pool is not None
            tables, pool = self._host_tables, self.host_pool
        else:
            return False  # the parent holds no blocks (preempted by recompute): the child recomputes
        # The child may keep only a prefix of the parent's tokens (n > 1 forks at the prompt).
        num_tokens = min(self._num_tokens.get(pid, 0), child.num_tokens)
        num_full = num_tokens // self.block_size
        tables[cid] = list(tables[pid][: cdiv(num_tokens, self.block_size)])
        pool.touch(_live(tables[cid]))
        self._num_tokens[cid] = num_tokens
        self.prefix_cache.fork(pid, cid, num_full)
        return True

    def _record(self, kind: str, pairs: list[tuple[int, int]]) -> None:
        # Consecutive moves of one kind merge into one op: within a step no block written by
        # one of them is read by a later one of the same kind (a fresh copy destination is never
        # shared in the same step; a swapped-out block still read later is still referenced).
        if self._ops and self._ops[-1].kind == kind:
            self._ops[-1].pairs.extend(pairs)
        else:
            self._ops.append(BlockOp(kind, list(pairs)))  # type: ignore[arg-type]

    def take_block_ops(self) -> list[BlockOp]:
        ops, self._ops = self._ops, []
        self._last_swapped_blocks = [
            src if op.kind == "swap_out" else dst for op in ops if op.kind != "copy" for src, dst in op.pairs
        ]
        return ops

    # ---- swapping ------------------------------------------------------------------------
    def enable_swap(self, num_host_blocks: int) -> None:
        self.host_pool = BlockPool(num_host_blocks, enable_caching=False)

    @property
    def can_swap(self) -> bool:
        return self.host_pool is not None

    @staticmethod
    def _distinct(tables: list[list[int]]) -> list[int]:
        return list(dict.fromkeys(b for t in tables for b in _live(t)))

    def _move(
        self,
        seqs: list[Sequence],
        src_tables: dict[str, list[int]],
        dst_tables: dict[str, list[int]],
        src_pool: BlockPool,
        dst_pool: BlockPool,
        reserve: int,
        kind: str,
    ) -> bool:
        tables = [src_tables[r.seq_id] for r in seqs]
        blocks = self._distinct(tables)
        if len(blocks) + reserve > dst_pool.num_free_blocks:
            return False
        mapping = dict(zip(blocks, dst_pool.allocate(len(blocks)), strict=True))
        self._record(kind, list(mapping.items()))
        mapping[NULL_BLOCK] = NULL_BLOCK  # released entries stay released wherever the table is
        for r, t in zip(seqs, tables, strict=True):
            new = [mapping[b] for b in t]
            dst_tables[r.seq_id] = new
            del src_tables[r.seq_id]
            src_pool.free(_live(reversed(t)))
        # allocate() gave each block one reference; a block the set shares gets the rest.
        for b, n in Counter(mapping[b] for t in tables for b in _live(t)).items():
            if n > 1:
                dst_pool.touch([b] * (n - 1))
        return True

    def swap_out(self, seqs: list[Sequence]) -> bool:
        if self.host_pool is None:
            raise RuntimeError("swapping is not enabled (enable_swap)")
        ok = self._move(seqs, self._tables, self._host_tables, self.pool, self.host_pool, 0, "swap_out")
        if ok:
            self.num_swapped_out_blocks += self._num_distinct(self._host_tables, seqs)
        return ok

    def swap_in(self, seqs: list[Sequence], reserve: int = 0) -> bool:
        assert self.host_pool is not None
        ok = self._move(seqs, self._host_tables, self._tables, self.host_pool, self.pool, reserve, "swap_in")
        if ok:
            self.num_swapped_in_blocks += self._num_distinct(self._tables, seqs)
            for r in seqs:
                # The new device blocks are not in the prefix cache yet: register them again.
                self.prefix_cache.moved(r.seq_id)
        return ok

    def _num_distinct(self, tables: dict[str, list[int]], seqs: list[Sequence]) -> int:
        return len(self._distinct([tables[r.seq_id] for r in seqs]))

    # ---- queries -------------------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def can_ever_fit(self, num_tokens: int) -> bool:
        if self.release_window is not None and self.max_step_tokens is not None:
            # Held at once: the window before a step's first query and the step's own tokens, at
            # any offset in a block (one more block).
            num_tokens = min(num_tokens, self.release_window + self.max_step_tokens + self.block_size)
        return cdiv(num_tokens, self.block_size) <= self.num_blocks

    def stats(self) -> KVCacheStats:
        """O(sequences), not O(blocks): the blocks the tables hold are exactly those with a
        reference, and only a table's last block can be partly filled.

        A block's fill is the most any holder has written into it. A last block with fill f < bs
        is partly filled unless another table holds it further (as a full block, or with more
        tokens): then some holder's count exceeds f. Counting, per such block, the tables that
        hold it as a partly filled last block tells: when that equals its refcount, every holder
        sees it partly filled and its fill is the largest of their f.
        """
        bs = self.block_size
        partial: dict[int, list[int]] = {}  # block -> [largest fill, tables holding it as partly filled last]
        logical = 0
        for rid, table in self._tables.items():
            logical += len(table) - table.count(NULL_BLOCK)  # released entries hold nothing
            if not table:
                continue
            f = self._num_tokens[rid] - (len(table) - 1) * bs
            if f < bs:
                entry = partial.setdefault(table[-1], [0, 0])
                entry[0] = max(entry[0], f)
                entry[1] += 1
        refs = self.pool.ref_counts()
        num_blocks_held = self.pool.num_used_blocks
        unwritten = sum(bs - f for b, (f, k) in partial.items() if refs[b] == k)
        reserved = num_blocks_held * bs
        total = self.num_blocks * bs
        return KVCacheStats(
            total=total,
            reserved=reserved,
            used=reserved - unwritten,
            free=total - reserved,
            shared_blocks=int(np.count_nonzero(refs > 1)),
            logical_blocks=logical,
        )

    def block_snapshot(self) -> block_view.BlockSnapshot:
        refs = self.pool.ref_counts()
        states = np.where(refs > 1, block_view.SHARED, np.where(refs == 1, block_view.USED, block_view.FREE))
        states = states.astype(np.uint8)
        cached = self.pool.cached_block_ids()
        states[cached[refs[cached] == 0]] = block_view.CACHED
        if self._last_swapped_blocks and (self._tables or self._host_tables):  # idle: nothing is moving
            states[np.asarray(self._last_swapped_blocks, dtype=np.int64)] = block_view.SWAPPING
        shared = np.flatnonzero(refs > 1)
        bs = self.block_size
        seqs = [
            block_view.SeqBlocks(rid, list(table), self._num_tokens[rid], len(table) * bs)
            for rid, table in self._tables.items()
        ]
        host = self.host_pool
        return block_view.BlockSnapshot(
            layout="paged",
            block_size=bs,
            states=states,
            seqs=seqs,
            shared_blocks=shared,
            shared_refs=refs[shared].astype(np.int64),
            num_host_blocks=host.num_blocks if host is not None else 0,
            num_host_blocks_used=host.num_used_blocks if host is not None else 0,
        )

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for b in _live(table):
                refs[b] += 1
        assert refs == list(self.pool.ref_cnt), "refcounts differ from the block tables' references"
        assert not set(self._tables) & set(self._host_tables), "a sequence is both on the device and swapped"
        if self.host_pool is not None:
            self.host_pool.check_invariants()
            refs = [0] * self.host_pool.num_blocks
            for table in self._host_tables.values():
                for b in _live(table):
                    refs[b] += 1
            assert refs == list(self.host_pool.ref_cnt), "host refcounts differ from the swapped tables' references"
        else:
            assert not self._host_tables
        for tables in (self._tables, self._host_tables):
            for table in tables.values():  # released entries are a prefix of each table
                live = [b != NULL_BLOCK for b in table]
                assert live == sorted(live), "a released entry after a live one"


def _live(block_ids: Iterable[int]) -> Iterator[int]:
    """The blocks of a table that are held (not released out of the window)."""
    return (b for b in block_ids if b != NULL_BLOCK)
