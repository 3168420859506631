"""Baseline KV managers: one contiguous reservation per request (Orca / FasterTransformer style).

At admission a request reserves one run of consecutive blocks big enough for everything it may
ever hold, chosen by ``reserve``:

* ``max``:    max_model_len slots (the system cannot know the output length: reserve the worst case);
* ``pow2``:   the next power of two >= prompt + max_tokens (capped at max_model_len): an
              over-estimate of at most 2x, the paper's "Orca (Pow2)";
* ``oracle``: exactly prompt + max_tokens. The benchmarks run with ignore_eos, so max_tokens is the
              real output length: the best any reserve-at-admission system can do ("Orca (Oracle)").

Runs are placed first-fit in the block space and freed runs coalesce with free neighbours, so
external fragmentation (free slots in holes too small for the next seq) is real. The
reservation is exposed through an ordinary block table ``[start, start + 1, ...]``, so the
unchanged runner and paged attention read it; with ``block_size=1`` the reservation is exact to
the token and the block table is a list of slot indices.

There is no prefix caching and no growth: a request never needs more than its reservation (if it
did, that is a bug, and an assertion says so), so a running request never fails allocate_slots
and the contiguous layouts never preempt; a request that does not fit waits in the queue.
"""

from __future__ import annotations

import bisect

import numpy as np

from pagedllm.kv import block_view
from pagedllm.kv.base import KVCacheManager, KVCacheStats
from pagedllm.sequence import Sequence
from pagedllm.utils import cdiv

RESERVE_POLICIES = ("max", "pow2", "oracle")


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class ContiguousKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, reserve: str = "max", max_model_len: int = 2048) -> None:
        if reserve not in RESERVE_POLICIES:
            raise ValueError(f"reserve must be one of {RESERVE_POLICIES}, got {reserve!r}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reserve = reserve
        self.max_model_len = max_model_len
        # Free runs as two parallel lists sorted by start (there are at most #live requests + 1 of
        # them, so list insertion is cheap); adjacent free runs are always merged.
        self._free_starts: list[int] = [0] if num_blocks else []
        self._free_lens: list[int] = [num_blocks] if num_blocks else []
        # Live reservations: request id -> (first block, number of blocks, reserved tokens).
        self._runs: dict[str, tuple[int, int, int]] = {}
        # Block tables are built once at admission (up to max_model_len entries with block_size=1)
        # and handed out as is on every step.
        self._tables: dict[str, list[int]] = {}
        # Tokens each request's reservation holds once the scheduled step has run.
        self._num_tokens: dict[str, int] = {}
        # Running totals so stats() is O(#free runs), not O(tokens): it is sampled every step.
        self._reserved_blocks = 0
        self._used_tokens = 0
        # (request id, blocks) of the last admission that failed: the head of the FCFS queue and
        # what it needs. Free holes smaller than that are external fragmentation.
        self._blocked: tuple[str, int] | None = None

    # ---- policy --------------------------------------------------------------------------
    def reservation_tokens(self, num_tokens: int) -> int:
        """Slots a request whose prompt + max_tokens is ``num_tokens`` reserves at admission."""
        if self.reserve == "max":
            return self.max_model_len
        if self.reserve == "pow2":
            # Capped: no request ever exceeds max_model_len, so reserving more is pointless.
            return max(num_tokens, min(next_power_of_two(num_tokens), self.max_model_len))
        return num_tokens

    def _request_reservation(self, seq: Sequence) -> int:
        return self.reservation_tokens(seq.num_prompt_tokens + seq.max_tokens)

    # ---- free-run bookkeeping ------------------------------------------------------------
    def _first_fit(self, num_blocks: int) -> int | None:
        for i, n in enumerate(self._free_lens):
            if n >= num_blocks:
                return i
        return None

    def _take(self, i: int, num_blocks: int) -> int:
        start = self._free_starts[i]
        if self._free_lens[i] == num_blocks:
            del self._free_starts[i], self._free_lens[i]
        else:
            self._free_starts[i] += num_blocks
            self._free_lens[i] -= num_blocks
        return start

    def _give_back(self, start: int, num_blocks: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        # Merge with the run that ends where this one starts, and with the one that starts where it ends.
        if i > 0 and self._free_starts[i - 1] + self._free_lens[i - 1] == start:
            i -= 1
            self._free_lens[i] += num_blocks
        else:
            self._free_starts.insert(i, start)
            self._free_lens.insert(i, num_blocks)
        end = self._free_starts[i] + self._free_lens[i]
        if i + 1 < len(self._free_starts) and end == self._free_starts[i + 1]:
            self._free_lens[i] += self._free_lens[i + 1]
            del self._free_starts[i + 1], self._free_lens[i + 1]

    # ---- KVCacheManager ------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        return []  # no prefix caching in the baselines

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        assert not cached_blocks, "the contiguous layouts have no prefix cache"
        rid = seq.seq_id
        run = self._runs.get(rid)
        if run is None:
            # Admission (first time, or again after preemption, which recomputes from 0).
            reserve = self._request_reservation(seq)
            nblocks = cdiv(reserve, self.block_size)
            num_tokens = num_new_tokens
            assert num_tokens <= reserve, f"{rid}: {num_tokens} tokens exceed its reservation of {reserve}"
            i = self._first_fit(nblocks)
            if i is None:
                self._blocked = (rid, nblocks)
                return False
            start = self._take(i, nblocks)
            self._runs[rid] = (start, nblocks, reserve)
            self._tables[rid] = list(range(start, start + nblocks))
            self._num_tokens[rid] = num_tokens
            self._reserved_blocks += nblocks
            self._used_tokens += num_tokens
            if self._blocked is not None and self._blocked[0] == rid:
                self._blocked = None
            return True
        # Within the reservation: nothing to allocate.
        num_tokens = seq.num_computed_tokens + num_new_tokens
        assert num_tokens <= run[2], f"{rid}: {num_tokens} tokens exceed its reservation of {run[2]}"
        old = self._num_tokens[rid]
        if num_tokens > old:
            self._num_tokens[rid] = num_tokens
            self._used_tokens += num_tokens - old
        return True

    def free(self, seq: Sequence) -> None:
        rid = seq.seq_id
        if self._blocked is not None and self._blocked[0] == rid:
            self._blocked = None  # aborted while waiting
        run = self._runs.pop(rid, None)
        if run is None:
            return
        del self._tables[rid]
        self._used_tokens -= self._num_tokens.pop(rid)
        self._reserved_blocks -= run[1]
        self._give_back(run[0], run[1])

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def num_free_blocks(self) -> int:
        return self.num_blocks - self._reserved_blocks

    def can_ever_fit(self, num_tokens: int) -> bool:
        return cdiv(self.reservation_tokens(num_tokens), self.block_size) <= self.num_blocks

    def largest_free_run(self) -> int:
        """Blocks in the largest free run: the biggest reservation that can be admitted now."""
        return max(self._free_lens, default=0)

    def stats(self) -> KVCacheStats:
        """reserved: all slots of live reservations (blocks x block_size); used: tokens in them.

        unusable_free (external fragmentation): while the head of the queue is blocked (its last
        admission failed) although the free slots add up to its reservation, the free slots in
        holes smaller than that reservation, i.e. the memory that only its splitting keeps from
        use. 0 otherwise: when nobody waits on memory, or when even a compacted cache would be too
        full for the head, which is then plain "free", as it is for the paged layout whose head
        waits for blocks. Internal fragmentation and not-yet-used reservation are both in
        reserved - used (the benchmark separates them with each request's final length).
        """
        bs = self.block_size
        total = self.num_blocks * bs
        reserved = self._reserved_blocks * bs
        unusable = 0
        if self._blocked is not None and self.num_blocks - self._reserved_blocks >= self._blocked[1]:
            need = self._blocked[1]
            unusable = sum(n for n in self._free_lens if n < need) * bs
        return KVCacheStats(
            total=total,
            reserved=reserved,
            used=self._used_tokens,
            free=total - reserved,
            unusable_free=unusable,
        )

    def block_snapshot(self) -> block_view.BlockSnapshot:
        """Each reservation: its blocks holding tokens "used", the rest of it "reserved" (the unused
        tail the paper's Figure 2 shows). One slice assignment per reservation."""
        bs = self.block_size
        states = np.full(self.num_blocks, block_view.FREE, dtype=np.uint8)
        seqs = []
        for rid, (start, nblocks, _) in self._runs.items():
            n = self._num_tokens[rid]
            held = min(cdiv(n, bs), nblocks)
            states[start : start + held] = block_view.USED
            states[start + held : start + nblocks] = block_view.RESERVED
            seqs.append(block_view.SeqBlocks(rid, list(self._tables[rid]), n, nblocks * bs))
        return block_view.BlockSnapshot(layout="contiguous", block_size=bs, states=states, seqs=seqs)

    def check_invariants(self) -> None:
        """Live runs and free runs tile [0, num_blocks) exactly; totals match; free runs coalesced."""
        spans = [(s, n, "free") for s, n in zip(self._free_starts, self._free_lens, strict=True)]
        spans += [(s, n, rid) for rid, (s, n, _) in self._runs.items()]
        spans.sort()
        pos = 0
        prev_free = False
        for s, n, owner in spans:
            assert n > 0, f"empty run {owner} at {s}"
            assert s == pos, f"run {owner} at {s}: expected {pos} (overlap or leak)"
            is_free = owner == "free"
            assert not (is_free and prev_free), f"adjacent free runs at {s} are not coalesced"
            prev_free = is_free
            pos = s + n
        assert pos == self.num_blocks, f"runs end at {pos}, cache has {self.num_blocks} blocks (leak)"
        assert self._free_starts == sorted(self._free_starts)
        assert self._reserved_blocks == sum(n for _, n, _ in self._runs.values())
        assert self._used_tokens == sum(self._num_tokens.values())
        assert set(self._runs) == set(self._tables) == set(self._num_tokens)
        for rid, (s, n, reserve) in self._runs.items():
            assert cdiv(reserve, self.block_size) == n
            assert self._num_tokens[rid] <= reserve
            assert self._tables[rid] == list(range(s, s + n))
