"""Greedy outputs do not change with block size, batch composition, chunking or preemption."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams

NEW_TOKENS = 24


def workload(n: int = 12, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 90))] for _ in range(n)]


def run(model_dir: str, prompts, **engine_kwargs) -> tuple[list[list[int]], LLM]:
    kwargs = dict(dtype="float32", num_kv_blocks=256, block_size=16)
    kwargs.update(engine_kwargs)
    llm = LLM(model=model_dir, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


# qwen3: per-head q/k norms before RoPE; gpt2 / opt / opt_postln: learned positions, LayerNorm;
# gemma3: its own layers, two layer types; phi3: LongRoPE
@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt2", "opt", "opt_postln", "gemma3", "phi3"])
def model_dir(request, tiny_model_dirs) -> str:
    return tiny_model_dirs[request.param]


@pytest.fixture(scope="module")
def baseline(model_dir):
    prompts = workload()
    # one request at a time, whole prompts in one step: the simplest possible schedule
    toks, _ = run(model_dir, prompts, max_num_seqs=1)
    return prompts, toks


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_block_size(model_dir, baseline, block_size):
    prompts, expected = baseline
    toks, llm = run(model_dir, prompts, block_size=block_size, num_kv_blocks=4096 // block_size + 8)
    assert toks == expected
    assert llm.llm_engine.kv_manager.num_free_blocks() == llm.llm_engine.num_kv_blocks


def test_large_batch(model_dir, baseline):
    prompts, expected = baseline
    toks, _ = run(model_dir, prompts, max_num_seqs=256)
    assert toks == expected


def test_chunked_prefill(model_dir, baseline):
    prompts, expected = baseline
    # 7 tokens per step: every prompt longer than 7 is split, chunks mix with decodes
    toks, _ = run(model_dir, prompts, max_num_batched_tokens=7)
    assert toks == expected


def test_preemption(model_dir, baseline):
    prompts, expected = baseline
    # 14 blocks of 8 = 112 slots: the largest request (89 + 24 tokens) fits alone, but not beside others
    toks, llm = run(model_dir, prompts, block_size=8, num_kv_blocks=15)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert toks == expected
    assert llm.llm_engine.kv_manager.num_free_blocks() == llm.llm_engine.num_kv_blocks


def test_prefix_caching(model_dir, baseline):
    prompts, expected = baseline
    shared = [7, 8, 9] * 12
    with_prefix = [shared + p for p in prompts]
    ref, _ = run(model_dir, with_prefix, max_num_seqs=1, enable_prefix_caching=False)
    toks, llm = run(model_dir, with_prefix, enable_prefix_caching=True, num_kv_blocks=40)
    assert toks == ref
    _, hits = llm.llm_engine.kv_manager.prefix_cache_stats()
    assert hits > 0
