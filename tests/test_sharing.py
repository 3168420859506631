"""Parallel sampling (n > 1, best_of): one prefill, forked sequences sharing KV blocks, copy-on-write."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sequence import child_seed

NEW = 12
# 37 tokens: two full blocks of 16 and a partly filled third, which the children copy on write.
PROMPT = [random.Random(5).randrange(3, 512) for _ in range(37)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # Prefix caching off: these tests count the blocks that forking shares, against separate
    # requests that must not share (prefix caching would share their prompts too).
    return LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64, block_size=16, enable_prefix_caching=False)


def gen(llm: LLM, prompt: list[int], **kw) -> list:
    kw.setdefault("max_tokens", NEW)
    kw.setdefault("ignore_eos", True)
    return llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**kw), use_tqdm=False)[0].outputs


def assert_clean(llm: LLM) -> None:
    e = llm.llm_engine
    e.kv_manager.check_invariants()
    assert e.kv_manager.num_free_blocks() == e.num_kv_blocks and not e.has_unfinished_requests()


def test_greedy_n_equals_n1_and_copies_the_partial_block(llm):
    kv = llm.llm_engine.kv_manager
    (one,) = gen(llm, PROMPT, temperature=0.0)
    copies = kv.num_cow_copies
    outs = gen(llm, PROMPT, temperature=0.0, n=3)
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(o.token_ids == one.token_ids for o in outs)
    assert all(o.finish_reason == "length" for o in outs)
    # the prompt ran once; the shared partial block was copied for all but its last writer
    assert kv.num_cow_copies - copies == 2
    assert_clean(llm)


def test_seeded_n_is_reproducible_and_each_child_is_its_own_seeded_request(llm):
    params = dict(temperature=1.0, seed=1234, n=3, logprobs=0)
    a = gen(llm, PROMPT, **params)
    b = gen(llm, PROMPT, **params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) == 3  # sampling: the children differ
    # Child i draws what an n=1 request with seed child_seed(1234, i) draws: the same tokens and
    # logprobs, although the child decoded on blocks it shared / copied on write.
    for o in a:
        (ref,) = gen(llm, PROMPT, temperature=1.0, seed=child_seed(1234, o.index), logprobs=0)
        assert o.token_ids == ref.token_ids
        assert o.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-4)
    assert_clean(llm)


def test_children_logprobs_match_teacher_forced_transformers(llm, tiny_llama):
    """Each child's logprobs equal a full HF forward of its own sequence: the COW'd cache is right."""
    from transformers import AutoModelForCausalLM

    outs = gen(llm, PROMPT, temperature=1.0, seed=7, n=2, logprobs=0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    for o in outs:
        seq = torch.tensor([PROMPT + o.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(seq).logits[0].float(), dim=-1)
        ref = [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(o.token_ids)]
        ours = [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)]
        assert max(abs(x - y) for x, y in zip(ours, ref, strict=True)) < 1e-4


def test_cow_copy_moves_the_source_contents(llm):
    """The runner's copy: destination K/V equal the source's at copy time, in every layer."""
    runner = llm.llm_engine.runner
    real = runner.apply_block_ops
    checked = []

    def spy(sched):
        copies = [p for op in sched.block_ops if op.kind == "copy" for p in op.pairs]
        before = {s: [(k[s].clone(), v[s].clone()) for k, v in runner.kv_caches] for s, _ in copies}
        real(sched)
        for s, d in copies:
            for (k, v), (k0, v0) in zip(runner.kv_caches, before[s], strict=True):
                assert torch.equal(k[d], k0) and torch.equal(v[d], v0)
                assert k0.abs().sum() > 0  # the prompt's K/V really were there
            checked.append((s, d))

    runner.apply_block_ops = spy
    try:
        gen(llm, PROMPT, temperature=0.0, n=4)
    finally:
        del runner.apply_block_ops
    assert len(checked) == 3


def test_sharing_uses_fewer_blocks_than_separate_requests(llm):
    """n=4 forks share the prompt: fewer physical blocks than the same 4 sequences unshared."""
    engine = llm.llm_engine
    kv = engine.kv_manager
    long_prompt = PROMPT * 2  # 74 tokens: 4 full blocks + a partial one

    def peak(prompts: list[list[int]], params: SamplingParams) -> tuple[int, int]:
        for p in prompts:
            engine.add_request(None, {"prompt_token_ids": p}, params)
        physical = logical = 0
        while engine.has_unfinished_requests():
            engine.step()
            st = kv.stats()
            physical = max(physical, st.reserved // kv.block_size)
            logical = max(logical, st.logical_blocks)
        return physical, logical

    shared, logical = peak([long_prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=NEW, ignore_eos=True))
    separate, _ = peak([long_prompt] * 4, SamplingParams(temperature=1.0, seed=3, max_tokens=NEW, ignore_eos=True))
    # 4 sequences of 74 + 12 tokens: 6 blocks each unshared; shared: 4 prompt blocks + 4 x 2 own
    assert (shared, logical, separate) == (12, 24, 24)
    assert_clean(llm)


def test_best_of_returns_the_highest_cumulative_logprobs(llm):
    many = gen(llm, PROMPT, temperature=1.0, seed=11, n=4, logprobs=0)
    assert all(o.cumulative_logprob is not None for o in many)
    best = gen(llm, PROMPT, temperature=1.0, seed=11, n=2, best_of=4)
    ranked = sorted(many, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked]


def test_stop_per_sequence_and_abort_of_a_group(llm):
    # Children stop independently; the request finishes when all have.
    outs = gen(
        llm,
        PROMPT,
        temperature=1.0,
        seed=5,
        n=3,
        max_tokens=6,
        ignore_eos=False,
        stop_token_ids=[gen(llm, PROMPT, temperature=1.0, seed=5)[0].token_ids[2]],
    )
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) == 3
    assert {o.finish_reason for o in outs} <= {"stop", "length"}
    engine = llm.llm_engine
    rid = engine.add_request(None, {"prompt_token_ids": PROMPT}, SamplingParams(n=3, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_manager.stats().shared_blocks > 0
    engine.abort_request(rid)
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_groups_under_preemption_give_the_same_tokens(tiny_llama, llm, mode):
    """Three n=3 groups in a cache too small for all: preempted (recompute: each sequence on its
    own; swap: the group together), the seeded outputs do not change."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (21, 30, 13)]
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=20, ignore_eos=True)
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    small = LLM(
        model=tiny_llama,
        dtype="float32",
        num_kv_blocks=14,
        block_size=8,
        preemption_mode=mode,
        num_swap_blocks=64,
    )
    outs = small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    e = small.llm_engine
    assert e.scheduler.num_preemptions > 0
    assert (e.scheduler.num_swap_preemptions > 0) == (mode == "swap")
    for a, b in zip(ref, outs, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert_clean(small)


def test_contiguous_layout_runs_n_without_sharing(tiny_llama, llm):
    """A manager that cannot fork still serves n > 1: the children recompute the prompt."""
    (one,) = gen(llm, PROMPT, temperature=0.0)
    other = LLM(
        model=tiny_llama,
        dtype="float32",
        num_kv_blocks=64,
        block_size=16,
        kv_layout="contiguous",
        reserve="oracle",
    )
    outs = gen(other, PROMPT, temperature=0.0, n=2)
    assert [o.token_ids for o in outs] == [one.token_ids] * 2


def test_reset_prefix_cache_forgets_cached_blocks(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64, block_size=16)  # caching on: the default
    pool = llm.llm_engine.kv_manager.pool
    params = SamplingParams(temperature=0.0, max_tokens=4)
    prompt = {"prompt_token_ids": PROMPT * 2}  # 74 tokens: 4 full blocks to cache
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert pool.num_cached_blocks() > 0
    hits = pool.num_cache_hits
    llm.reset_prefix_cache()
    assert pool.num_cached_blocks() == 0
    again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == first and pool.num_cache_hits == hits  # recomputed, nothing found in the cache
    pool.check_invariants()
