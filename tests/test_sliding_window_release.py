"""Sliding-window block release in a running engine: a tiny Mistral (12-token window) generating
far past its window holds a bounded number of blocks, and its outputs equal transformers' whatever
the block size, batching, chunking, prefix caching, preemption (recompute, swap), KV layout and
attention backend; forks (n > 1, beams) share and copy released tables correctly."""

from __future__ import annotations

import pytest
from conftest import TINY_WINDOW
from test_sliding_window_fidelity import assert_matches, generate, hf_greedy, window_prompts  # noqa: F401

from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchParams
from pagedllm.sequence import child_seed
from pagedllm.utils import cdiv

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_clean(llm: LLM) -> None:
    e = llm.llm_engine
    e.kv_manager.check_invariants()
    assert e.kv_manager.num_free_blocks() == e.num_kv_blocks
    host = getattr(e.kv_manager, "host_pool", None)
    assert host is None or host.num_free_blocks == e.num_swap_blocks


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_live_blocks_stay_bounded(tiny_mistral_windowed, hf_greedy, block_size):  # noqa: F811
    """One sequence generating 200 tokens past a 5-token prompt: after its prompt it never holds
    more than the window's blocks, the one a query starts in, and the one being written."""
    llm = LLM(model=tiny_mistral_windowed, dtype="float32", num_kv_blocks=128, block_size=block_size)
    e = llm.llm_engine
    live: list[int] = []
    e.core.on_schedule = lambda _: live.append(e.num_kv_blocks - e.kv_manager.num_free_blocks())
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": window_prompts()[1]}], params, use_tqdm=False)
    assert_matches(out, hf_greedy[1:2])
    assert max(live) <= cdiv(TINY_WINDOW, block_size) + 2
    assert e.kv_manager.num_released_blocks >= 200 // block_size - cdiv(TINY_WINDOW, block_size) - 2
    assert_clean(llm)


CONFIGS = {
    "block_size_4": dict(block_size=4),
    "block_size_16": dict(block_size=16),
    "one_at_a_time": dict(max_num_seqs=1),
    "chunked_prefill": dict(max_num_batched_tokens=5),
    "recompute": dict(block_size=4, num_kv_blocks=18, max_num_batched_tokens=16, preemption_mode="recompute"),
    "swap": dict(block_size=4, num_kv_blocks=18, max_num_batched_tokens=16, preemption_mode="swap"),
    "contiguous": dict(kv_layout="contiguous", num_kv_blocks=512),
    "torch_backend": dict(attention_backend="torch"),
    "no_prefix_caching": dict(enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_equal_transformers_under_every_schedule(tiny_mistral_windowed, hf_greedy, name):  # noqa: F811
    outs, llm = generate(tiny_mistral_windowed, **CONFIGS[name])
    assert_matches(outs, hf_greedy)
    if name in ("recompute", "swap"):
        sched = llm.llm_engine.scheduler
        assert sched.num_preemptions > 0
        assert (sched.num_swap_preemptions > 0) == (name == "swap")
    assert_clean(llm)


def test_prefix_hits_only_from_blocks_still_held(tiny_mistral_windowed):
    """Prompts sharing a prefix three windows long: later ones hit the blocks the first one's
    release left cached (released full blocks keep their hashes), and generate what they
    generate without a prefix cache."""
    shared = [7, 8, 9, 10] * 9
    prompts = [{"prompt_token_ids": shared + p} for p in window_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def run(**kw):
        llm = LLM(model=tiny_mistral_windowed, dtype="float32", block_size=4, **kw)
        first = llm.generate(prompts[:1], params, use_tqdm=False)  # runs alone: its blocks are cached first
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        assert_clean(llm)
        return [o.outputs[0].token_ids for o in first + rest], llm

    ref, _ = run(enable_prefix_caching=False, num_kv_blocks=256)
    toks, llm = run(enable_prefix_caching=True, num_kv_blocks=256)
    assert toks == ref
    _, hits = llm.llm_engine.kv_manager.prefix_cache_stats()
    assert hits > 0
    # A small cache evicts released blocks for others: hits shrink to what still exists, same outputs.
    toks, _ = run(enable_prefix_caching=True, num_kv_blocks=24, max_num_batched_tokens=16)
    assert toks == ref


def test_parallel_samples_fork_released_tables(tiny_mistral_windowed):
    """n > 1 forks at a prompt longer than the window (whose first blocks are released): each
    child draws what the same request with its own seed draws alone."""
    llm = LLM(model=tiny_mistral_windowed, dtype="float32", num_kv_blocks=128, block_size=4)
    prompt = [{"prompt_token_ids": window_prompts()[-1]}]
    many = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=60), use_tqdm=False)
    assert_clean(llm)
    assert len({tuple(c.token_ids) for c in many[0].outputs}) == 3
    for c in many[0].outputs:
        alone = SamplingParams(temperature=1.0, seed=child_seed(5, c.index), max_tokens=60)
        assert llm.generate(prompt, alone, use_tqdm=False)[0].outputs[0].token_ids == c.token_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    (one,) = llm.generate(prompt, greedy, use_tqdm=False)
    greedy.n = 2
    (two,) = llm.generate(prompt, greedy, use_tqdm=False)
    assert [c.token_ids for c in two.outputs] == [one.outputs[0].token_ids] * 2
    assert_clean(llm)


def test_beam_search_with_release_equals_without(tiny_mistral_windowed):
    """Beams fork mid-generation, past the window: the same beams as the contiguous layout, which
    releases nothing and never shares."""
    prompts = [{"prompt_token_ids": p} for p in window_prompts()[2:5]]
    params = BeamSearchParams(beam_width=3, max_tokens=40)

    def beams(**kw):
        llm = LLM(model=tiny_mistral_windowed, dtype="float32", block_size=4, **kw)
        outs = llm.beam_search(prompts, params)
        assert_clean(llm)
        return [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in outs], llm

    paged, llm = beams(num_kv_blocks=128)
    assert llm.llm_engine.kv_manager.num_released_blocks > 0
    contiguous, _ = beams(kv_layout="contiguous", num_kv_blocks=1024)
    for ours, ref in zip(paged, contiguous, strict=True):
        assert [t for t, _ in ours] == [t for t, _ in ref]
        assert max(abs(a - b) for (_, a), (_, b) in zip(ours, ref, strict=True)) < 1e-3
