"""PagedKVCacheManager with forks, copy-on-write, swapping and eviction, checked against a model.

Besides the bookkeeping (refcounts exact on the device and in the host pool, nothing leaks, a
block is only handed out while free) the machine models what every physical slot holds: each
step's tokens are "written" to the slots their block table names, and the recorded BlockOps
(copies, swaps) are replayed on the model in order. So a fork must really share its parent's
contents, a write must never land in a block someone else still holds (that is what
copy-on-write is for), and a swapped-out sequence must come back with its tokens intact.

With a sliding window, sequences also release the blocks out of it (as the scheduler does after
each step): exactly those wholly before num_computed_tokens - window become NULL_BLOCK entries,
holding no reference, and every token after them is still there.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.kv import block_view
from pagedllm.kv.base import NULL_BLOCK
from pagedllm.kv.paged import PagedKVCacheManager, cdiv
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence

MAX_PROMPT = 24
MAX_TOKENS = 32  # prompt + outputs of any sequence
ALPHABET = 3
_rng = random.Random(99)
TEMPLATES = [[_rng.randrange(ALPHABET) for _ in range(MAX_PROMPT)] for _ in range(2)]


class ShareMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
        window=st.sampled_from([None, 1, 3, 6]),
        data=st.data(),
    )
    def setup(self, block_size, caching, window, data):
        per_seq = cdiv(MAX_TOKENS, block_size)
        num_blocks = data.draw(st.integers(per_seq, 3 * per_seq), label="num_blocks")
        num_host = data.draw(st.integers(0, 2 * per_seq), label="num_host_blocks")
        self.bs = block_size
        self.window = window
        self.kv = PagedKVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, release_window=window)
        self.kv.enable_swap(max(1, num_host))
        self.running: dict[str, Sequence] = {}
        self.swapped: dict[str, Sequence] = {}
        self.waiting: dict[str, Sequence] = {}  # preempted by recompute / not admitted yet
        self.next_id = 0
        self.content: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list[int | None]] = [[None] * block_size for _ in range(self.kv.host_pool.num_blocks)]

    # ---- helpers ----
    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def free_device(self) -> set[int]:
        return {b for b in range(self.kv.num_blocks) if self.kv.pool.is_free(b)}

    def replay_ops(self) -> None:
        """The runner's part: executes the recorded copies / swaps on the content model."""
        for op in self.kv.take_block_ops():
            event(f"block op {op.kind}")
            src = {"copy": self.content, "swap_out": self.content, "swap_in": self.host}[op.kind]
            dst = {"copy": self.content, "swap_out": self.host, "swap_in": self.content}[op.kind]
            # all reads before any write, as the runner's index_select / index_copy_
            values = [list(src[s]) for s, _ in op.pairs]
            for (_, d), v in zip(op.pairs, values, strict=True):
                dst[d] = v

    def snapshot(self):
        kv = self.kv
        return (
            list(kv.pool.ref_cnt),
            list(kv.pool._free),
            list(kv.host_pool.ref_cnt),
            {r: list(kv.block_table(r)) for r in self.running},
            kv.num_free_blocks(),
        )

    def run(self, req: Sequence, num_new: int, cached: list[int] | None = None) -> bool:
        """allocate_slots + the runner: copies first, then writes; samples at the end."""
        kv = self.kv
        rid = req.seq_id
        old_table = list(kv.block_table(rid)) if rid in self.running else []
        free_before = self.free_device()
        before = self.snapshot()
        if not kv.allocate_slots(req, num_new, cached):
            assert self.snapshot() == before, "a failed allocate_slots changed the state"
            assert kv.take_block_ops() == []
            return False
        table = kv.block_table(rid)
        cached = cached or []
        for i, b in enumerate(table):
            if i < len(old_table) and b == old_table[i] or i < len(cached) and b == cached[i]:
                continue
            assert b != NULL_BLOCK, "allocate_slots released a block"
            assert b in free_before, f"block {b} handed out while referenced"
            if i < len(old_table):
                assert b not in old_table  # copy-on-write replaced a shared block
        self.replay_ops()
        for p in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            b = table[p // self.bs]
            assert b != NULL_BLOCK, f"writing position {p} into a released block"
            assert kv.pool.ref_cnt[b] == 1, f"writing into block {b}, held {kv.pool.ref_cnt[b]} times"
            self.content[b][p % self.bs] = req.all_token_ids[p]
        req.num_computed_tokens += num_new
        self.kv.cache_computed_blocks(req)
        if req.num_computed_tokens == req.num_tokens and req.num_tokens < MAX_TOKENS:
            req.append_output_token((req.num_tokens * 5 + len(rid)) % ALPHABET)
        return True

    def runnable(self) -> list[str]:
        return sorted(r for r, q in self.running.items() if q.num_computed_tokens < q.num_tokens)

    # ---- rules ----
    @rule(template=st.integers(0, 1), length=st.integers(1, MAX_PROMPT), budget=st.integers(1, 40))
    def admit(self, template, length, budget):
        req = Sequence(self.new_id(), TEMPLATES[template][:length], SamplingParams())
        self.waiting[req.seq_id] = req
        self._try_admit(req, budget)

    def _try_admit(self, req: Sequence, budget: int) -> None:
        cached = self.kv.find_cached_prefix(req)
        for i, b in enumerate(cached):
            assert self.content[b] == req.all_token_ids[i * self.bs : (i + 1) * self.bs], f"bad hit {b}"
        req.num_computed_tokens = len(cached) * self.bs
        self.kv.cache_computed_blocks(req)
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.run(req, num_new, cached):
            self.running[req.seq_id] = self.waiting.pop(req.seq_id)
        else:
            req.num_computed_tokens = 0

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), budget=st.integers(1, 40))
    def retry(self, data, budget):
        self._try_admit(self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))], budget)

    @precondition(lambda self: self.runnable())
    @rule(data=st.data(), budget=st.integers(1, 40))
    def step(self, data, budget):
        req = self.running[data.draw(st.sampled_from(self.runnable()))]
        self.run(req, min(req.num_tokens - req.num_computed_tokens, budget))

    @precondition(lambda self: self.running or self.swapped)
    @rule(data=st.data(), diverge=st.booleans())
    def fork(self, data, diverge):
        """n > 1 / beam search: a child shares all of its parent's blocks (on device or host)."""
        pool = {**self.running, **self.swapped}
        parent = pool[data.draw(st.sampled_from(sorted(pool)))]
        child = parent.fork(self.new_id())
        refs_before = list(self.kv.pool.ref_cnt)
        assert self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.cache_computed_blocks(child)
        if diverge and child.num_computed_tokens < child.num_tokens and child.num_output_tokens:
            # siblings sampled different tokens (not yet computed): replace the child's last one
            tok = (child.all_token_ids[-1] + 1) % ALPHABET
            child.all_token_ids[-1] = child.output_token_ids[-1] = tok
        if parent.seq_id in self.running:
            table = self.kv.block_table(child.seq_id)
            assert table == self.kv.block_table(parent.seq_id)
            for b in set(table) - {NULL_BLOCK}:
                assert self.kv.pool.ref_cnt[b] == refs_before[b] + table.count(b)
            self.running[child.seq_id] = child
        else:
            event("fork of a swapped-out parent")
            self.swapped[child.seq_id] = child

    @precondition(lambda self: self.runnable())
    @rule(data=st.data(), width=st.integers(1, 3))
    def fork_and_decode(self, data, width):
        """Parallel sampling / beams: fork a few children, then every sibling runs its next token
        (the first writer of a shared, partly filled block copies it)."""
        parent = self.running[data.draw(st.sampled_from(self.runnable()))]
        family = [parent]
        for i in range(width):
            child = parent.fork(self.new_id())
            assert self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            self.kv.cache_computed_blocks(child)
            if child.num_output_tokens and child.num_computed_tokens < child.num_tokens:
                tok = (child.all_token_ids[-1] + i + 1) % ALPHABET
                child.all_token_ids[-1] = child.output_token_ids[-1] = tok
            self.running[child.seq_id] = child
            family.append(child)
        for seq in data.draw(st.permutations(family)):
            if seq.num_computed_tokens < seq.num_tokens:
                self.run(seq, 1)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        """A random subset of running sequences (a group) goes to host memory together."""
        rids = data.draw(st.lists(st.sampled_from(sorted(self.running)), min_size=1, max_size=3, unique=True))
        reqs = [self.running[r] for r in rids]
        before = self.snapshot()
        if not self.kv.swap_out(reqs):
            assert self.snapshot() == before
            event("swap_out: host pool full")
            return
        self.replay_ops()
        for r in reqs:
            self.swapped[r.seq_id] = self.running.pop(r.seq_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), reserve=st.integers(0, 2))
    def swap_in(self, data, reserve):
        rids = data.draw(st.lists(st.sampled_from(sorted(self.swapped)), min_size=1, max_size=3, unique=True))
        reqs = [self.swapped[r] for r in rids]
        free_before = self.free_device()
        before = self.snapshot()
        if not self.kv.swap_in(reqs, reserve=reserve):
            assert self.snapshot() == before
            return
        assert self.kv.num_free_blocks() >= reserve
        for r in reqs:
            assert set(self.kv.block_table(r.seq_id)) - {NULL_BLOCK} <= free_before
        self.replay_ops()
        for r in reqs:
            self.running[r.seq_id] = self.swapped.pop(r.seq_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def release(self, data):
        """After a step: the sequence's blocks out of the window go back to the pool."""
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        table = list(self.kv.block_table(req.seq_id))
        refs = list(self.kv.pool.ref_cnt)
        n = self.kv.release_out_of_window(req)
        after = self.kv.block_table(req.seq_id)
        if self.window is None:
            assert n == 0 and after == table
            return
        end = min(max(0, req.num_computed_tokens - self.window) // self.bs, len(table))
        assert after == [NULL_BLOCK] * end + table[end:]
        dropped = Counter(b for b in table[:end] if b != NULL_BLOCK)
        assert n == sum(dropped.values())
        for b, k in dropped.items():
            assert self.kv.pool.ref_cnt[b] == refs[b] - k  # shared ones stay with their other holders
        if n:
            event("released blocks")

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_recompute(self, data):
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.waiting[req.seq_id] = req

    @precondition(lambda self: self.running or self.swapped or self.waiting)
    @rule(data=st.data())
    def finish(self, data):
        """Finish / abort / drop a beam, wherever the sequence is."""
        where = [d for d in (self.running, self.swapped, self.waiting) if d]
        d = data.draw(st.sampled_from(where))
        self.kv.free(d.pop(data.draw(st.sampled_from(sorted(d)))))

    def first_live(self, req: Sequence, table: list[int]) -> int:
        """Index of the table's first held block: released ones (a prefix) lie wholly before the
        window of the sequence's next query but one."""
        n = 0
        while n < len(table) and table[n] == NULL_BLOCK:
            n += 1
        if n:
            assert self.window is not None and n * self.bs <= req.num_computed_tokens - self.window
        return n

    # ---- invariants ----
    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        kv, bs = self.kv, self.bs
        kv.check_invariants()  # refcounts == table references, device and host
        holders: Counter = Counter()
        for rid, req in self.running.items():
            table = kv.block_table(rid)
            assert len(table) >= cdiv(req.num_computed_tokens, bs)
            first_live = self.first_live(req, table)
            for b in table[first_live:]:
                holders[b] += 1
                assert not kv.pool.is_free(b)
            for p in range(first_live * bs, req.num_computed_tokens):
                assert self.content[table[p // bs]][p % bs] == req.all_token_ids[p], f"{rid}: token {p} lost"
        host_holders: Counter = Counter()
        for rid, req in self.swapped.items():
            table = kv._host_tables[rid]
            first_live = self.first_live(req, table)
            for b in table[first_live:]:
                host_holders[b] += 1
            for p in range(first_live * bs, req.num_computed_tokens):
                assert self.host[table[p // bs]][p % bs] == req.all_token_ids[p], f"{rid}: swapped token {p} lost"
        for rid in self.waiting:
            assert rid not in kv._tables and rid not in kv._host_tables
        assert all(kv.pool.ref_cnt[b] == holders[b] for b in range(kv.num_blocks))
        assert all(kv.host_pool.ref_cnt[b] == host_holders[b] for b in range(kv.host_pool.num_blocks))
        st_ = kv.stats()
        assert st_.reserved == len(holders) * bs
        assert st_.logical_blocks == sum(holders.values())
        assert st_.shared_blocks == sum(1 for n in holders.values() if n > 1)
        assert st_.used == slots_written(kv)
        snap = kv.block_snapshot()
        states = snap.states.tolist()
        for b in range(kv.num_blocks):
            n = holders[b]
            if states[b] == block_view.SWAPPING:
                continue  # moved by the last ops: shown as such whatever it holds now
            want = block_view.SHARED if n > 1 else block_view.USED if n == 1 else None
            if want is None:
                cached = kv.pool.block_hash[b] is not None
                want = block_view.CACHED if cached else block_view.FREE
            assert states[b] == want, f"block {b}: state {states[b]}, {n} holders"
        assert dict(zip(snap.shared_blocks.tolist(), snap.shared_refs.tolist(), strict=True)) == {
            b: n for b, n in holders.items() if n > 1
        }
        assert {s.seq_id: s.blocks for s in snap.seqs} == {rid: kv.block_table(rid) for rid in self.running}

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for d in (self.running, self.swapped, self.waiting):
            for req in d.values():
                self.kv.free(req)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks() == self.kv.num_blocks
        assert self.kv.host_pool.num_free_blocks == self.kv.host_pool.num_blocks
        assert all(r == 0 for r in self.kv.pool.ref_cnt)


def slots_written(kv: PagedKVCacheManager) -> int:
    """Slots holding a token, block by block: each block as full as its fullest holder's view."""
    bs = kv.block_size
    fill: dict[int, int] = {}
    for rid, table in kv._tables.items():
        n = kv._num_tokens[rid]
        for i, b in enumerate(table):
            if b != NULL_BLOCK:  # released out of the window: holds nothing
                fill[b] = max(fill.get(b, 0), min(bs, n - i * bs))
    return sum(fill.values())


ShareMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSharingStateMachine = ShareMachine.TestCase


def test_cow_copies_once_per_extra_sharer():
    """k sequences sharing a partly filled block: k - 1 copies, the last writer keeps the block."""
    kv = PagedKVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    parent = Sequence("p", list(range(10)), SamplingParams())  # blocks: 4 + 4 + 2
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    kv.cache_computed_blocks(parent)
    parent.append_output_token(1)
    kids = [parent.fork(f"c{i}") for i in (1, 2)]
    for k in kids:
        assert kv.fork(parent, k)
        k.num_computed_tokens = 10
        kv.cache_computed_blocks(k)
    table = list(kv.block_table("p"))
    assert [kv.pool.ref_cnt[b] for b in table] == [3, 3, 3]
    assert kv.stats().shared_blocks == 3 and kv.stats().logical_blocks == 9
    for seq in (parent, *kids):
        assert kv.allocate_slots(seq, 1)
    copies = [p for op in kv.take_block_ops() for p in op.pairs]
    assert len(copies) == 2 and all(src == table[2] for src, _ in copies)
    assert kv.block_table("c2")[2] == table[2]  # the last writer writes in place
    assert [kv.pool.ref_cnt[b] for b in table] == [3, 3, 1]
    for seq in (parent, *kids):
        kv.free(seq)
    kv.check_invariants()
    assert kv.num_free_blocks() == 16


def test_swap_keeps_sharing_inside_a_group():
    kv = PagedKVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    kv.enable_swap(8)
    a = Sequence("a", list(range(6)), SamplingParams())
    assert kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    kv.cache_computed_blocks(a)
    b = a.fork("b")
    assert kv.fork(a, b)
    b.num_computed_tokens = 6
    kv.cache_computed_blocks(b)
    assert kv.swap_out([a, b])
    assert kv.host_pool.num_used_blocks == 2 and kv.num_free_blocks() == 8  # copied once
    with pytest.raises(KeyError):
        kv.block_table("a")
    assert kv.swap_in([a, b], reserve=6)
    assert kv.block_table("a") == kv.block_table("b") and kv.num_free_blocks() == 6
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks() == 8 and kv.host_pool.num_free_blocks == 8
