"""Preemption by swapping to host memory gives the same outputs as preemption by recompute."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams

NEW = 16


def workload(n: int = 8, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(1, 70))]} for _ in range(n)]


def run(model_dir: str, prompts, params=None, **kw):
    # 12 blocks of 8 = 96 slots: the largest request (<= 69 + 16 tokens) fits alone, not beside others
    args = dict(dtype="float32", num_kv_blocks=12, block_size=8)
    args.update(kw)
    llm = LLM(model=model_dir, **args)
    params = params or SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    e = llm.llm_engine
    e.kv_manager.check_invariants()
    assert e.kv_manager.num_free_blocks() == e.num_kv_blocks
    assert e.kv_manager.host_pool is None or e.kv_manager.host_pool.num_free_blocks == e.num_swap_blocks
    return [[c.token_ids for c in o.outputs] for o in outs], e


@pytest.fixture(scope="module")
def recompute(tiny_llama):
    prompts = workload()
    toks, e = run(tiny_llama, prompts, preemption_mode="recompute")
    assert e.scheduler.num_preemptions > 0 and e.scheduler.num_swap_preemptions == 0
    return prompts, toks


def test_swap_equals_recompute(tiny_llama, recompute):
    prompts, expected = recompute
    toks, e = run(tiny_llama, prompts, preemption_mode="swap", num_swap_blocks=64)
    assert e.scheduler.num_swap_preemptions > 0
    assert e.scheduler.num_swap_preemptions == e.scheduler.num_preemptions  # the host pool had room
    assert e.kv_manager.num_swapped_out_blocks == e.kv_manager.num_swapped_in_blocks > 0
    assert toks == expected


def test_swap_with_chunked_prefill_and_prefix_caching(tiny_llama, recompute):
    prompts, expected = recompute
    toks, e = run(
        tiny_llama,
        prompts,
        preemption_mode="swap",
        num_swap_blocks=64,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    assert e.scheduler.num_swap_preemptions > 0
    assert toks == expected


def test_full_host_pool_falls_back_to_recompute(tiny_llama, recompute):
    prompts, expected = recompute
    toks, e = run(tiny_llama, prompts, preemption_mode="swap", num_swap_blocks=8)
    s = e.scheduler
    assert 0 < s.num_swap_preemptions < s.num_preemptions
    assert toks == expected


def test_auto_swaps_groups_and_recomputes_single_sequences(tiny_llama, recompute):
    prompts, expected = recompute
    toks, e = run(tiny_llama, prompts, preemption_mode="auto", num_swap_blocks=64)
    assert e.scheduler.num_preemptions > 0 and e.scheduler.num_swap_preemptions == 0
    assert toks == expected
    groups = prompts[:4]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=NEW, ignore_eos=True)
    toks, e = run(tiny_llama, groups, params, preemption_mode="auto", num_swap_blocks=64)
    assert e.scheduler.num_swap_preemptions > 0
    assert toks == [[t[0], t[0]] for t in expected[:4]]


def test_swap_needs_a_paged_cache_and_host_memory(tiny_llama):
    with pytest.raises(ValueError, match="paged"):
        LLM(
            model=tiny_llama,
            dtype="float32",
            num_kv_blocks=16,
            kv_layout="contiguous",
            preemption_mode="swap",
        )
    with pytest.raises(ValueError, match="swap_space_gib"):
        LLM(model=tiny_llama, dtype="float32", num_kv_blocks=16, preemption_mode="swap", swap_space_gib=0)
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(model=tiny_llama, preemption_mode="sometimes")


def mixed_requests() -> list:
    """Plain, n=3 seeded and beam-search requests (prompts of at most 60 tokens: 8 blocks of 8)."""
    from pagedllm import BeamSearchParams

    kinds = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=12, ignore_eos=True),
        BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True),
    ]
    prompts = [p["prompt_token_ids"][:60] for p in workload(9, seed=3)]  # <= 60 tokens
    return [(f"r{i}", {"prompt_token_ids": p}, kinds[i % 3]) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def roomy(tiny_llama):
    """A cache that never preempts: the reference."""
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=1024, block_size=4)
    llm.llm_engine.eos_token_ids = {5, 6}  # beams that do not ignore EOS hit it now and then
    return llm.llm_engine


@pytest.mark.parametrize("mode,num_blocks", [("recompute", 12), ("swap", 12), ("auto", 16)])
def test_mixed_groups_under_pressure_finish_with_the_same_outputs(tiny_llama, roomy, mode, num_blocks):
    llm = LLM(
        model=tiny_llama,
        dtype="float32",
        num_kv_blocks=num_blocks,
        block_size=8,
        preemption_mode=mode,
        num_swap_blocks=40,
        max_num_seqs=8,
    )
    e = llm.llm_engine
    assert step_all(e, mixed_requests()) == step_all(roomy, mixed_requests())
    assert e.scheduler.num_preemptions > 0
    e.kv_manager.check_invariants()
    assert e.kv_manager.num_free_blocks() == e.num_kv_blocks


def random_case(seed: int):
    """A random mix of plain / n > 1 / beam requests and a small engine configuration."""
    from pagedllm import BeamSearchParams

    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    reqs, longest = [], 0
    for i in range(rng.randrange(2, 8)):
        plen, mt = rng.randrange(1, 40), rng.randrange(1, 12)
        prompt = [rng.randrange(3, 30) for _ in range(plen)]  # small alphabet: prefix-cache hits
        k = rng.random()
        if k < 0.35:
            params = SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True)
        elif k < 0.7:
            params = SamplingParams(
                n=rng.randrange(2, 5),
                temperature=1.0,
                seed=rng.randrange(100),
                max_tokens=mt,
                ignore_eos=True,
            )
        else:
            params = BeamSearchParams(beam_width=rng.randrange(1, 5), max_tokens=mt, ignore_eos=rng.random() < 0.5)
        reqs.append((f"r{i}", prompt, params))
        longest = max(longest, plen + mt)
    engine_kw = dict(
        num_kv_blocks=-(-longest // bs) + rng.randrange(0, 12),
        block_size=bs,
        preemption_mode=rng.choice(["recompute", "swap", "auto"]),
        num_swap_blocks=rng.choice([2, 8, 64]),
        max_num_seqs=rng.choice([2, 4, 256]),
        max_num_batched_tokens=rng.choice([7, 32, 2048]),
        enable_prefix_caching=rng.random() < 0.5,
    )
    return reqs, engine_kw


def step_all(engine, reqs, max_steps: int = 3000) -> dict:
    for rid, prompt, params in reqs:
        if isinstance(params, SamplingParams):
            engine.add_request(rid, prompt, params)
        else:
            engine.add_beam_search_request(rid, prompt, params)
    done = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError(f"no progress: {engine.get_stats()}")


# 95: a swapped group that fills the whole cache once back (used to loop swapping in and out).
@pytest.mark.parametrize("seed", [95, 7, 46])
def test_random_mixed_workloads_match_a_roomy_cache(tiny_llama, roomy, seed):
    reqs, engine_kw = random_case(seed)
    small = LLM(model=tiny_llama, dtype="float32", **engine_kw)
    small.llm_engine.eos_token_ids = roomy.eos_token_ids
    assert step_all(small.llm_engine, reqs) == step_all(roomy, reqs)
    e = small.llm_engine
    e.kv_manager.check_invariants()
    assert e.kv_manager.num_free_blocks() == e.num_kv_blocks
