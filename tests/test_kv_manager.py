"""PagedKVCacheManager driven the way the scheduler drives it, checked against a model.

The state machine admits requests (taking prefix-cache hits), runs prefill chunks and decode
steps, finishes, aborts and preempts them, with small caches so that allocations fail. Besides
the manager's bookkeeping it models what each physical slot holds: every token a step computes is
"written" to the slot its block table names, so a prefix-cache hit must hand out blocks that
really hold the request's tokens, and a live request's computed tokens must never be overwritten.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.kv.paged import PagedKVCacheManager, cdiv
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence

MAX_PROMPT = 40
MAX_OUTPUT = 6
ALPHABET = 3  # token ids 0..2: prompts share prefixes often
# A few long "system prompts" that requests start with, so full blocks repeat even for bs=16.
_rng = random.Random(1234)
TEMPLATES = [[_rng.randrange(ALPHABET) for _ in range(MAX_PROMPT)] for _ in range(3)]


def make_request(rid: str, prompt: list[int], max_tokens: int = MAX_OUTPUT) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens))


# ---- deterministic tests --------------------------------------------------------------------


def _admit_and_prefill(kv: PagedKVCacheManager, req: Sequence, sampled: int = 0) -> list[int]:
    """Admits ``req`` and runs its whole prefill in one step, as the scheduler would."""
    cached = kv.find_cached_prefix(req)
    num_computed = len(cached) * kv.block_size
    assert kv.allocate_slots(req, req.num_tokens - num_computed, cached)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    req.append_output_token(sampled)
    return cached


def test_sequences_growing_side_by_side_keep_contiguous_blocks():
    """Placement: each request starts where there is room for prompt + max_tokens, and grows into
    the blocks right after its last one, even when requests decode in lockstep."""
    kv = PagedKVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    reqs = [make_request(str(i), [1] * 6, max_tokens=20) for i in range(3)]  # room: 26 tokens = 7 blocks
    for r in reqs:
        _admit_and_prefill(kv, r)
    for _ in range(19):  # decode steps, all three interleaved
        for r in reqs:
            assert kv.allocate_slots(r, 1)
            r.num_computed_tokens += 1
            kv.cache_computed_blocks(r)
            r.append_output_token(1)
    for i, r in enumerate(reqs):
        table = kv.block_table(r.seq_id)
        assert table == list(range(7 * i, 7 * i + len(table))), table
    kv.check_invariants()


def test_prefix_cache_shares_full_blocks_but_not_the_last_token():
    kv = PagedKVCacheManager(num_blocks=8, block_size=16)
    prompt = list(range(40))
    a = make_request("a", prompt)
    assert _admit_and_prefill(kv, a) == []
    table_a = list(kv.block_table("a"))
    assert len(table_a) == 3

    b = make_request("b", prompt)
    hits = kv.find_cached_prefix(b)
    assert hits == table_a[:2]
    assert kv.allocate_slots(b, 40 - 32, hits)
    b.num_computed_tokens = 32
    kv.cache_computed_blocks(b)
    table_b = kv.block_table("b")
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2]
    assert [kv.pool.ref_cnt[x] for x in table_a] == [2, 2, 1]
    assert kv.stats().shared_blocks == 2
    assert kv.num_free_blocks() == 8 - 4
    kv.check_invariants()

    kv.free(a)
    assert [kv.pool.ref_cnt[x] for x in table_b] == [1, 1, 1]
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks() == kv.num_blocks
    assert kv.pool.num_cached_blocks() >= 2  # freed, but still cached

    c = make_request("c", prompt)
    assert kv.find_cached_prefix(c) == table_a[:2]

    # A prompt that is exactly two full blocks only reuses the first: the last token must run.
    d = make_request("d", prompt[:32])
    assert kv.find_cached_prefix(d) == table_a[:1]
    # One token into the third block: both full blocks are reused.
    e = make_request("e", prompt[:33])
    assert kv.find_cached_prefix(e) == table_a[:2]
    # A different first block shares nothing, even if later blocks match.
    f = make_request("f", [99] + prompt[1:])
    assert kv.find_cached_prefix(f) == []


def test_prefix_caching_disabled_shares_nothing():
    kv = PagedKVCacheManager(num_blocks=8, block_size=16, enable_prefix_caching=False)
    prompt = list(range(40))
    a = make_request("a", prompt)
    _admit_and_prefill(kv, a)
    b = make_request("b", prompt)
    assert kv.find_cached_prefix(b) == []
    _admit_and_prefill(kv, b)
    assert not set(kv.block_table("a")) & set(kv.block_table("b"))
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks() == 8 and kv.pool.num_cached_blocks() == 0


def test_failed_admission_with_free_cached_hits_changes_nothing():
    """The hits sit in the free queue: taking them uses up free blocks the new ones need."""
    kv = PagedKVCacheManager(num_blocks=3, block_size=4)
    prompt = list(range(9))  # 3 blocks; blocks 0 and 1 get cached
    a = make_request("a", prompt)
    _admit_and_prefill(kv, a)
    assert kv.block_table("a") == [0, 1, 2]
    kv.free(a)  # free queue: 2 (uncached, front), then 1, 0 (cached, tail block first)
    assert kv.num_free_blocks() == 3 and kv.pool.num_cached_blocks() == 2
    other = make_request("o", [50, 51, 52, 53, 54])
    _admit_and_prefill(kv, other)
    assert kv.block_table("o") == [2, 1]  # the uncached block, then the prefix's tail is evicted
    b = make_request("b", prompt)
    hits = kv.find_cached_prefix(b)
    assert hits == [0] and kv.pool.is_free(0)
    before = (
        kv.num_free_blocks(),
        list(kv.pool.ref_cnt),
        list(kv.pool.block_hash),
        list(kv.pool._free),
        kv.stats(),
    )
    # Needs 3 blocks: the free hit plus 2 new, but only 1 block is free in all.
    assert not kv.allocate_slots(b, b.num_tokens - 4, hits)
    assert (
        kv.num_free_blocks(),
        list(kv.pool.ref_cnt),
        list(kv.pool.block_hash),
        list(kv.pool._free),
        kv.stats(),
    ) == before
    with pytest.raises(KeyError):
        kv.block_table("b")
    kv.check_invariants()
    kv.free(other)
    assert kv.find_cached_prefix(b) == [0]
    assert kv.allocate_slots(b, b.num_tokens - 4, [0])
    assert kv.block_table("b")[0] == 0 and kv.num_free_blocks() == 0
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks() == 3


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 40, 100])
def test_stats_waste_below_one_block(block_size, num_tokens):
    kv = PagedKVCacheManager(num_blocks=128, block_size=block_size)
    req = make_request("r", list(range(num_tokens)))
    assert kv.allocate_slots(req, num_tokens)
    st_ = kv.stats()
    assert st_.used == num_tokens
    assert st_.reserved == cdiv(num_tokens, block_size) * block_size
    assert st_.free == st_.total - st_.reserved
    assert st_.waste < block_size / num_tokens
    if num_tokens % block_size == 0:
        assert st_.waste == 0.0
    kv.free(req)
    assert kv.stats().reserved == 0 and kv.stats().waste == 0.0


# ---- state machine --------------------------------------------------------------------------


class Live:
    """What the test knows about an admitted request."""

    def __init__(self, req: Sequence) -> None:
        self.req = req
        self.allocated = 0  # tokens its table was sized for


class KVManagerMachine(RuleBasedStateMachine):
    CACHING = True

    @initialize(block_size=st.sampled_from([1, 2, 4, 16]), data=st.data())
    def setup(self, block_size, data):
        per_req = cdiv(MAX_PROMPT + MAX_OUTPUT, block_size)
        # From "one request barely fits" to "three fit": allocations fail regularly.
        num_blocks = data.draw(st.integers(max(1, per_req // 2), 3 * per_req), label="num_blocks")
        self.bs = block_size
        self.kv = PagedKVCacheManager(num_blocks, block_size, enable_prefix_caching=self.CACHING)
        self.live: dict[str, Live] = {}
        self.waiting: dict[str, Sequence] = {}
        self.next_id = 0
        # What each physical slot holds (None: never written since the block was handed out).
        self.content: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    # ---- helpers ----
    def snapshot(self):
        kv = self.kv
        return (
            kv.num_free_blocks(),
            {rid: list(kv.block_table(rid)) for rid in self.live},
            list(kv.pool.ref_cnt),
            list(kv.pool.block_hash),
            list(kv.pool._free),  # a failed allocation must not even reorder the free queue
            kv.stats(),
        )

    def run_step(self, live: Live, num_new: int) -> None:
        """The model ran: write the step's tokens to their slots, advance, maybe sample."""
        req = live.req
        table = self.kv.block_table(req.seq_id)
        for p in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            b = table[p // self.bs]
            assert self.kv.pool.ref_cnt[b] == 1, f"writing to block {b} shared by {self.kv.pool.ref_cnt[b]}"
            self.content[b][p % self.bs] = req.all_token_ids[p]
        req.num_computed_tokens += num_new
        self.kv.cache_computed_blocks(req)
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token((req.num_tokens * 7 + len(req.seq_id)) % ALPHABET)

    def try_admit(self, req: Sequence, budget: int) -> bool:
        kv = self.kv
        rid = req.seq_id
        cached = kv.find_cached_prefix(req)
        if not self.CACHING:
            assert cached == []
        assert len(cached) * self.bs < req.num_tokens, "the last token's block must never be a hit"
        assert len(set(cached)) == len(cached)
        for i, b in enumerate(cached):
            # A hit holds exactly this request's tokens for that block.
            assert self.content[b] == req.all_token_ids[i * self.bs : (i + 1) * self.bs], f"bad hit {b}"
        num_computed = len(cached) * self.bs
        num_new = min(req.num_tokens - num_computed, budget)
        before = self.snapshot()
        free_before = set(b for b in range(kv.num_blocks) if kv.pool.is_free(b))
        if not kv.allocate_slots(req, num_new, cached):
            assert self.snapshot() == before, "a failed allocate_slots changed the state"
            event("admission failed" + (" with cache hits" if cached else ""))
            with pytest.raises(KeyError):
                kv.block_table(rid)
            return False
        table = kv.block_table(rid)
        assert table[: len(cached)] == cached
        for b in table[len(cached) :]:
            assert b in free_before, f"block {b} handed out while referenced"
            self.content[b] = [None] * self.bs  # a fresh block: old contents are gone
        if cached:
            event("admitted with cache hits" + (" (some free)" if set(cached) & free_before else ""))
        live = Live(req)
        live.allocated = num_computed + num_new
        self.live[rid] = live
        req.num_computed_tokens = num_computed
        self.kv.cache_computed_blocks(req)
        self.run_step(live, num_new)
        return True

    # ---- rules ----
    @rule(
        template=st.integers(0, len(TEMPLATES) - 1),
        length=st.integers(1, MAX_PROMPT),
        tail=st.lists(st.integers(0, ALPHABET - 1), max_size=3),
        budget=st.integers(1, 48),
    )
    def admit(self, template, length, tail, budget):
        prompt = (TEMPLATES[template][:length] + tail)[:MAX_PROMPT]
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = make_request(rid, prompt)
        if not self.try_admit(req, budget):
            self.waiting[rid] = req

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), budget=st.integers(1, 48))
    def retry_waiting(self, data, budget):
        rid = data.draw(st.sampled_from(sorted(self.waiting)), label="waiting")
        if self.try_admit(self.waiting[rid], budget):
            del self.waiting[rid]

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting)), label="waiting")
        before = self.snapshot()
        self.kv.free(self.waiting.pop(rid))
        assert self.snapshot() == before

    @precondition(lambda self: self.live)
    @rule(data=st.data(), budget=st.integers(1, 48))
    def step(self, data, budget):
        """A prefill chunk, or a decode token (the scheduler asks for what is left, within budget)."""
        rid = data.draw(st.sampled_from(sorted(self.live)), label="live")
        live = self.live[rid]
        req = live.req
        if req.num_output_tokens >= MAX_OUTPUT:
            return  # finished: only `finish` applies
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        assert num_new >= 1
        before = self.snapshot()
        table_before = list(self.kv.block_table(rid))
        free_before = set(b for b in range(self.kv.num_blocks) if self.kv.pool.is_free(b))
        if not self.kv.allocate_slots(req, num_new):
            assert self.snapshot() == before, "a failed allocate_slots changed the state"
            event("step allocation failed")
            return
        table = self.kv.block_table(rid)
        assert table[: len(table_before)] == table_before, "a request's existing blocks moved"
        for b in table[len(table_before) :]:
            assert b in free_before, f"block {b} handed out while referenced"
            self.content[b] = [None] * self.bs
        live.allocated = max(live.allocated, req.num_computed_tokens + num_new)  # a failed step's slots stay
        self.run_step(live, num_new)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), budget=st.integers(1, 48))
    def failed_step(self, data, budget):
        """Slots allocated for a step whose forward then raised: nothing was written and nothing
        advanced. No block may enter the prefix cache on the strength of it (a later hit would
        read KV that was never written: the content check of every hit catches that)."""
        rid = data.draw(st.sampled_from(sorted(self.live)), label="live")
        req = self.live[rid].req
        if req.num_output_tokens >= MAX_OUTPUT:
            return
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        table_before = list(self.kv.block_table(rid))
        if not self.kv.allocate_slots(req, num_new):
            return
        for b in self.kv.block_table(rid)[len(table_before) :]:
            self.content[b] = [None] * self.bs  # fresh, never written
        self.live[rid].allocated = max(self.live[rid].allocated, req.num_computed_tokens + num_new)
        self.kv.cache_computed_blocks(req)  # what the engine does after every step: a no-op here
        event("failed step")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def allocate_too_much(self, data):
        """Asks for more new blocks than are free: must fail and change nothing."""
        rid = data.draw(st.sampled_from(sorted(self.live)), label="live")
        req = self.live[rid].req
        extra = data.draw(st.integers(1, 3), label="extra")
        # more than its table (which a failed step may have grown past its computed tokens) + all free
        num_new = (len(self.kv.block_table(rid)) + self.kv.num_free_blocks() + extra) * self.bs
        before = self.snapshot()
        assert not self.kv.allocate_slots(req, num_new)
        assert self.snapshot() == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)), label="live")
        self.kv.free(self.live.pop(rid).req)
        with pytest.raises(KeyError):
            self.kv.block_table(rid)

    def prefilling(self) -> list[str]:
        return sorted(r for r, v in self.live.items() if v.req.num_computed_tokens < v.req.num_prompt_tokens)

    @precondition(lambda self: self.prefilling())
    @rule(data=st.data())
    def abort_mid_prefill(self, data):
        rids = self.prefilling()
        rid = data.draw(st.sampled_from(rids), label="prefilling")
        self.kv.free(self.live.pop(rid).req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        """Preemption by recompute: free everything, back to waiting with its output so far."""
        rid = data.draw(st.sampled_from(sorted(self.live)), label="live")
        req = self.live.pop(rid).req
        self.kv.free(req)
        req.num_computed_tokens = 0
        if req.num_output_tokens < MAX_OUTPUT:
            self.waiting[rid] = req

    # ---- invariants ----
    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        kv, bs = self.kv, self.bs
        kv.check_invariants()
        pool = kv.pool
        assert pool.num_free_blocks + pool.num_used_blocks == kv.num_blocks
        holders: Counter = Counter()
        position: dict[int, int] = {}
        for rid, live in self.live.items():
            table = kv.block_table(rid)
            assert len(table) == cdiv(live.allocated, bs), f"{rid}: {len(table)} blocks for {live.allocated}"
            assert len(set(table)) == len(table), f"{rid}: a block twice in one table"
            for i, b in enumerate(table):
                holders[b] += 1
                assert not pool.is_free(b)
                # A block shared through the cache covers the same prefix, hence the same index.
                assert position.setdefault(b, i) == i
            # Every computed token is still in its slot (nobody overwrote or evicted it).
            req = live.req
            for p in range(req.num_computed_tokens):
                assert self.content[table[p // bs]][p % bs] == req.all_token_ids[p], f"{rid}: token {p} lost"
        for b in range(kv.num_blocks):
            assert pool.ref_cnt[b] == holders[b]
            if holders[b] > 1:
                assert self.CACHING and pool.block_hash[b] is not None, f"block {b} shared but not cached"
        assert pool.num_free_blocks == sum(1 for b in range(kv.num_blocks) if holders[b] == 0)
        if not self.CACHING:
            assert pool.num_cached_blocks() == 0
        st_ = kv.stats()
        assert st_.reserved == len(holders) * bs
        assert st_.used <= st_.reserved

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for live in self.live.values():
            self.kv.free(live.req)
        for req in self.waiting.values():
            self.kv.free(req)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks() == self.kv.num_blocks
        assert all(r == 0 for r in self.kv.pool.ref_cnt)
        assert self.kv.stats().reserved == 0


class KVManagerNoCachingMachine(KVManagerMachine):
    CACHING = False


_SETTINGS = settings(
    max_examples=75, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
KVManagerMachine.TestCase.settings = _SETTINGS
KVManagerNoCachingMachine.TestCase.settings = _SETTINGS
TestKVManagerPrefixCaching = KVManagerMachine.TestCase
TestKVManagerNoPrefixCaching = KVManagerNoCachingMachine.TestCase
