"""ContiguousKVCacheManager (the Orca-style baselines): placement, accounting, and the engine on it.

The state machine drives the manager the way the scheduler does (admit the head of a FCFS queue
with a prefill chunk, run chunks and decodes, finish, preempt, abort while waiting) with small
caches so that admissions fail, and checks it against its own model of the block space: each
block's owner, where first-fit must place a reservation, and what each request holds.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.kv import block_view
from pagedllm.kv.contiguous import ContiguousKVCacheManager, cdiv, next_power_of_two
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence


def make_request(rid: str, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens))


def admit(kv: ContiguousKVCacheManager, req: Sequence, num_new: int | None = None) -> bool:
    assert kv.find_cached_prefix(req) == []
    return kv.allocate_slots(req, req.num_tokens if num_new is None else num_new, [])


def expected_reservation(policy: str, prompt: int, max_tokens: int, max_model_len: int) -> int:
    n = prompt + max_tokens
    pow2 = max(n, min(next_power_of_two(n), max_model_len))
    return {"max": max_model_len, "pow2": pow2, "oracle": n}[policy]


# ---- deterministic tests --------------------------------------------------------------------


def test_reservation_sizes_and_can_ever_fit():
    for policy in ("max", "pow2", "oracle"):
        kv = ContiguousKVCacheManager(100, 1, policy, max_model_len=64)
        for n in (1, 5, 33, 64):
            assert kv.reservation_tokens(n) == expected_reservation(policy, n, 0, 64)
    assert next_power_of_two(1) == 1 and next_power_of_two(33) == 64 and next_power_of_two(64) == 64
    # max reserves max_model_len whatever the request: 64 slots never fit in 63
    assert not ContiguousKVCacheManager(63, 1, "max", 64).can_ever_fit(2)
    assert ContiguousKVCacheManager(64, 1, "max", 64).can_ever_fit(2)
    # pow2 of 33 is 64 (capped at max_model_len 48 here, but never below the request)
    assert ContiguousKVCacheManager(100, 1, "pow2", 48).reservation_tokens(33) == 48
    assert not ContiguousKVCacheManager(47, 1, "pow2", 48).can_ever_fit(33)
    assert ContiguousKVCacheManager(9, 4, "oracle", 64).can_ever_fit(36)
    assert not ContiguousKVCacheManager(8, 4, "oracle", 64).can_ever_fit(33)
    with pytest.raises(ValueError):
        ContiguousKVCacheManager(8, 1, "huge", 64)


def test_block_table_is_a_run_of_consecutive_blocks():
    kv = ContiguousKVCacheManager(20, 4, "oracle", max_model_len=64)
    a, b = make_request("a", 5, 3), make_request("b", 9, 4)  # 8 -> 2 blocks; 13 -> 4 blocks
    assert admit(kv, a) and admit(kv, b)
    assert kv.block_table("a") == [0, 1]
    assert kv.block_table("b") == [2, 3, 4, 5]
    st_ = kv.stats()
    assert (st_.total, st_.reserved, st_.used, st_.free) == (80, 24, 14, 56)
    # block_size 1: the table is the list of slot indices, built once and handed out as is
    kv1 = ContiguousKVCacheManager(3000, 1, "max", max_model_len=2048)
    c = make_request("c", 10, 5)
    assert admit(kv1, c)
    t = kv1.block_table("c")
    assert t == list(range(2048)) and kv1.block_table("c") is t
    kv.check_invariants()
    kv1.check_invariants()


def test_growth_stays_within_the_reservation_and_more_is_a_bug():
    kv = ContiguousKVCacheManager(16, 1, "oracle", max_model_len=64)
    r = make_request("r", 6, 3)  # reserves 9
    assert admit(kv, r, 4)  # a prefill chunk
    r.num_computed_tokens = 4
    free_before = kv.num_free_blocks()
    assert kv.allocate_slots(r, 2)
    r.num_computed_tokens = 6
    r.append_output_token(7)
    assert kv.allocate_slots(r, 1)
    assert kv.num_free_blocks() == free_before  # growth never allocates
    assert kv.stats().used == 7
    r.num_computed_tokens = 9
    with pytest.raises(AssertionError, match="exceed"):
        kv.allocate_slots(r, 1)


def test_first_fit_coalescing_and_external_fragmentation():
    kv = ContiguousKVCacheManager(10, 1, "oracle", max_model_len=10)
    reqs = {k: make_request(k, 2, 1) for k in "abcd"}  # 3 slots each: a@0 b@3 c@6, d does not fit
    for k in "abc":
        assert admit(kv, reqs[k])
    assert kv.block_table("c")[0] == 6
    kv.free(reqs["b"])  # hole [3, 6) between a and c; free runs [3,6) and [9,10)
    big = make_request("big", 2, 2)  # needs 4: no hole is big enough
    assert not admit(kv, big)
    st_ = kv.stats()
    assert st_.free == 4 and st_.unusable_free == 4  # all free slots are in holes < 4
    assert admit(kv, reqs["d"])  # first fit: the hole at 3, not the tail at 9
    assert kv.block_table("d") == [3, 4, 5]
    kv.free(reqs["a"])
    kv.free(reqs["d"])  # [0,3) + [3,6) coalesce
    assert kv.largest_free_run() == 6
    assert kv.stats().unusable_free == 1  # 'big' still waits: only the 1-slot hole at 9 is too small
    assert admit(kv, big) and kv.block_table("big") == [0, 1, 2, 3]
    assert kv.stats().unusable_free == 0  # the blocked head was admitted
    kv.free(big)
    huge = make_request("huge", 5, 5)  # needs 10 of the 7 free slots: the cache is full, not fragmented
    assert not admit(kv, huge)
    assert kv.stats().free == 7 and kv.stats().unusable_free == 0
    kv.free(huge)  # aborted while waiting
    kv.free(reqs["c"])  # [0,6) + [6,9) + [9,10): one run again
    assert kv.largest_free_run() == 10
    kv.check_invariants()


def test_preemption_frees_the_run_and_readmission_recomputes():
    kv = ContiguousKVCacheManager(8, 1, "pow2", max_model_len=8)
    r = make_request("r", 3, 2)  # 5 -> pow2 8
    assert admit(kv, r)
    r.num_computed_tokens = 3
    r.append_output_token(5)
    assert kv.allocate_slots(r, 1)
    kv.free(r)  # preempted: recompute from scratch later
    r.num_computed_tokens = 0
    assert kv.num_free_blocks() == 8 and kv.stats().used == 0
    assert admit(kv, r)  # prompt + the generated token, within the same reservation size
    assert kv.stats().used == 4 and kv.stats().reserved == 8
    kv.free(r)
    kv.check_invariants()


# ---- the state machine ----------------------------------------------------------------------


class ContiguousMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 24),
        block_size=st.sampled_from([1, 2, 4]),
        policy=st.sampled_from(["max", "pow2", "oracle"]),
        max_model_len=st.integers(4, 40),
    )
    def setup(self, num_blocks, block_size, policy, max_model_len):
        self.kv = ContiguousKVCacheManager(num_blocks, block_size, policy, max_model_len)
        self.policy = policy
        self.mml = max_model_len
        self.owner: list[str | None] = [None] * num_blocks  # the model of the block space
        self.waiting: list[Sequence] = []
        self.running: dict[str, Sequence] = {}
        self.tokens: dict[str, int] = {}  # what each running request holds after its last step
        self.next_id = 0

    def _need_blocks(self, req: Sequence) -> int:
        n = expected_reservation(self.policy, req.num_prompt_tokens, req.max_tokens, self.mml)
        return cdiv(n, self.kv.block_size)

    def _first_fit(self, need: int) -> int | None:
        """Start of the first maximal free run of >= need blocks in the model."""
        run_start, run_len = None, 0
        for b, o in enumerate(self.owner + ["end"]):
            if o is None:
                run_start = b if run_len == 0 else run_start
                run_len += 1
                continue
            if run_len >= need:
                return run_start
            run_len = 0
        return None

    def _snapshot(self):
        kv = self.kv
        return (
            list(kv._free_starts),
            list(kv._free_lens),
            dict(kv._runs),
            dict(kv._num_tokens),
            kv.stats().reserved,
            kv.stats().used,
            kv.num_free_blocks(),
        )

    @rule(prompt=st.integers(1, 30), out=st.integers(1, 12))
    def add(self, prompt, out):
        prompt = min(prompt, self.mml - 1)
        out = min(out, self.mml - prompt)  # the engine rejects prompt + max_tokens > max_model_len
        req = make_request(f"r{self.next_id}", prompt, out)
        self.next_id += 1
        if self.kv.can_ever_fit(prompt + out):  # the engine rejects the rest at add_request
            self.waiting.append(req)

    @precondition(lambda self: self.waiting)
    @rule(chunk=st.integers(1, 40))
    def admit_head(self, chunk):
        req = self.waiting[0]
        num_new = min(req.num_tokens, chunk)
        need = self._need_blocks(req)
        expect = self._first_fit(need)
        before = self._snapshot()
        ok = admit(self.kv, req, num_new)
        assert ok == (expect is not None)
        if not ok:
            assert self._snapshot() == before, "a failed admission changed the allocation"
            free = self.kv.num_free_blocks()
            # external fragmentation: all free slots when only their splitting blocks the head
            assert self.kv.stats().unusable_free == (free * self.kv.block_size if free >= need else 0)
            return
        table = self.kv.block_table(req.seq_id)
        assert table == list(range(expect, expect + need))
        for b in table:
            assert self.owner[b] is None, "overlapping reservations"
            self.owner[b] = req.seq_id
        self.waiting.pop(0)
        req.num_computed_tokens = 0
        self.running[req.seq_id] = req
        self._ran(req, num_new)

    def _ran(self, req: Sequence, num_new: int) -> None:
        """The step ran: advance the request; it samples when it reaches its last known token."""
        req.num_computed_tokens += num_new
        self.tokens[req.seq_id] = req.num_computed_tokens
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(5)
            if req.num_output_tokens >= req.max_tokens:
                self._release(req)

    def _release(self, req: Sequence) -> None:
        self.kv.free(req)
        self.running.pop(req.seq_id)
        self.tokens.pop(req.seq_id)
        self.owner = [None if o == req.seq_id else o for o in self.owner]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 40))
    def step_running(self, data, chunk):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        num_new = min(req.num_tokens - req.num_computed_tokens, chunk)
        free = self.kv.num_free_blocks()
        assert self.kv.allocate_slots(req, num_new), "a running request never fails within its reservation"
        assert self.kv.num_free_blocks() == free
        self._ran(req, num_new)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        self._release(req)
        req.num_computed_tokens = 0
        self.waiting.insert(0, req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        req = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(req)
        self.kv.free(req)  # the scheduler frees aborted waiting requests too: holds nothing

    @invariant()
    def consistent(self):
        kv = self.kv
        kv.check_invariants()
        bs = kv.block_size
        s = kv.stats()
        reserved_blocks = sum(o is not None for o in self.owner)
        assert s.reserved == reserved_blocks * bs
        assert s.free + s.reserved == s.total == kv.num_blocks * bs
        assert s.used == sum(self.tokens.values())
        assert 0 <= s.unusable_free <= s.free
        for rid in self.running:
            table = kv.block_table(rid)
            assert [b for b, o in enumerate(self.owner) if o == rid] == table
            assert self.tokens[rid] <= len(table) * bs
        # the live view: a reservation's leading blocks that hold tokens are "used", its tail "reserved"
        snap = kv.block_snapshot()
        want = [block_view.FREE] * kv.num_blocks
        for rid in self.running:
            table = kv.block_table(rid)
            for i, b in enumerate(table):
                want[b] = block_view.USED if i * bs < self.tokens[rid] else block_view.RESERVED
        assert snap.states.tolist() == want
        assert {q.seq_id: (q.blocks, q.num_tokens) for q in snap.seqs} == {
            rid: (kv.block_table(rid), self.tokens[rid]) for rid in self.running
        }
        # coalescing: the manager's free runs are exactly the model's maximal free runs
        runs, start = [], None
        for b, o in enumerate(self.owner + ["end"]):
            if o is None and start is None:
                start = b
            elif o is not None and start is not None:
                runs.append((start, b - start))
                start = None
        assert list(zip(kv._free_starts, kv._free_lens, strict=True)) == runs

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for req in list(self.running.values()):
            self._release(req)
        for req in self.waiting:
            self.kv.free(req)
        self.kv.check_invariants()
        s = self.kv.stats()
        assert s.reserved == 0 and s.used == 0 and s.free == s.total and s.unusable_free == 0
        assert self.kv.largest_free_run() == self.kv.num_blocks


TestContiguousMachine = ContiguousMachine.TestCase
TestContiguousMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---- the engine on every layout ---------------------------------------------------------------

NEW_TOKENS = 16


def _engine_run(model_dir: str, requests: list[dict], **kw) -> dict:
    from argparse import Namespace

    from pagedllm.bench.compare import make_engine
    from pagedllm.bench.engine_driver import run_workload

    args = Namespace(
        model=model_dir,
        dtype="float32",
        kv_cache_dtype="auto",
        num_kv_tokens=kw["num_kv_tokens"],
        max_model_len=128,
        max_num_seqs=256,
        max_num_batched_tokens=kw.get("max_num_batched_tokens", 2048),
        num_threads=1,
    )
    engine = make_engine(args, kw["layout"], kw["block_size"])
    res = run_workload(engine, requests, time_attention=True)
    assert engine.kv_manager.num_free_blocks() == engine.num_kv_blocks
    if hasattr(engine.kv_manager, "check_invariants"):
        engine.kv_manager.check_invariants()
    return res


@pytest.fixture(scope="module", autouse=True)
def _restore_threads():
    # The engines here run single-threaded (EngineConfig.num_threads=1 sets torch's process-wide
    # count): on a loaded 2-core machine OpenMP threads that wait for each other cost far more
    # than they give on a tiny model. Leave the count as found for the other test modules.
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def requests_and_reference(tiny_llama):
    from pagedllm.bench.workloads import load_workload

    reqs = load_workload("sharegpt", 10, seed=3, vocab_size=512, output_len=NEW_TOKENS)
    for r in reqs:  # short prompts (1..80) keep the tiny engine runs fast
        r["prompt_token_ids"] = r["prompt_token_ids"][: 1 + len(r["prompt_token_ids"]) % 80]
    ref = _engine_run(tiny_llama, reqs, layout="paged", block_size=16, num_kv_tokens=4096)
    return reqs, ref


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_greedy_outputs_equal_paged(tiny_llama, requests_and_reference, policy):
    reqs, ref = requests_and_reference
    res = _engine_run(tiny_llama, reqs, layout=policy, block_size=1, num_kv_tokens=4096)
    assert res["outputs"] == ref["outputs"]
    assert res["num_preemptions"] == 0
    assert res["max_running"] <= {"max": 4096 // 128, "pow2": 10, "oracle": 10}[policy]


def test_queueing_budget_and_block_size_4(tiny_llama, requests_and_reference):
    # Room for two 'max' reservations only (2 x 128 slots): requests wait in the queue, in order,
    # and chunked prefill (16 tokens a step) runs inside the reservation.
    reqs, ref = requests_and_reference
    res = _engine_run(
        tiny_llama, reqs, layout="max", block_size=4, num_kv_tokens=2 * 128 + 3, max_num_batched_tokens=16
    )
    assert res["outputs"] == ref["outputs"]
    assert res["max_running"] == 2
    sat = res["memory_saturated"]
    assert sat is not None and sat["waste"] > 0.5  # most of each reservation never holds a token
    oracle = _engine_run(tiny_llama, reqs, layout="oracle", block_size=1, num_kv_tokens=100)
    assert oracle["outputs"] == ref["outputs"]
    assert any(s["waiting"] > 0 for s in oracle["samples"])


def test_paged_accounting_in_the_bench(requests_and_reference):
    _, ref = requests_and_reference
    m = ref["memory"]
    parts = m["token_states"] + m["future"] + m["internal_frag"] + m["external_frag"] + m["free"]
    assert parts == pytest.approx(1.0)
    assert m["external_frag"] == 0.0
    assert ref["num_requests"] == 10 and ref["output_tokens"] == 10 * NEW_TOKENS
