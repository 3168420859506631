"""Beam search equals Hugging Face ``generate(num_beams=k)``, with beams sharing KV blocks."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, BeamSearchParams

MAX_NEW = 10


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 7, 23)]


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # block_size 4: beams keep forking off partly filled blocks (copy-on-write)
    return LLM(model=tiny_llama, dtype="float32", num_kv_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def frequent_tokens(llm) -> list[int]:
    """Tokens that beams of these prompts pick early: as EOS they end beams within a few steps."""
    got = ours(llm, make_prompts(), beam_width=2, ignore_eos=True)
    return sorted({s[0][i] for g in got for s in g for i in (1, 3, 5)})


def hf_beams(hf, prompt, width, early_stopping, length_penalty, eos) -> list[tuple[list[int], float]]:
    hf.generation_config.eos_token_id = eos
    out = hf.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=MAX_NEW,
        do_sample=False,
        early_stopping=early_stopping,
        length_penalty=length_penalty,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    res = []
    for i in range(width):
        n = int((out.beam_indices[i] >= 0).sum())  # generated length (the rest is padding)
        res.append((out.sequences[i, len(prompt) : len(prompt) + n].tolist(), float(out.sequences_scores[i])))
    return res


def ours(llm, prompts, **kw) -> list[list[tuple[list[int], float]]]:
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(max_tokens=MAX_NEW, **kw))
    return [
        [(s.tokens[len(p) :], s.score, s.finish_reason) for s in o.sequences]
        for p, o in zip(prompts, outs, strict=True)
    ]


def assert_same(ref, got) -> None:
    assert [g[0] for g in got] == [r[0] for r in ref]
    assert max(abs(g[1] - r[1]) for g, r in zip(got, ref, strict=True)) < 1e-4


def test_equals_transformers_with_eos(llm, hf, frequent_tokens):
    """Every early_stopping mode and length penalties, with EOS tokens the beams do hit."""
    engine = llm.llm_engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = set(frequent_tokens)  # the model's EOS, as HF's eos_token_id below
    prompts = make_prompts()
    by_mode = {}
    try:
        for early_stopping in (True, False, "never"):
            for lp in (1.0, 2.0):
                got = ours(llm, prompts, beam_width=2, length_penalty=lp, early_stopping=early_stopping)
                for p, g in zip(prompts, got, strict=True):
                    assert_same(hf_beams(hf, p, 2, early_stopping, lp, frequent_tokens), g)
                by_mode[early_stopping, lp] = got
    finally:
        engine.eos_token_ids = saved
    seqs = [s for got in by_mode.values() for g in got for s in g]
    assert any(s[2] == "stop" for s in seqs) and all(s[0][-1] in frequent_tokens for s in seqs if s[2] == "stop")
    assert all(len(s[0]) == MAX_NEW for s in seqs if s[2] == "length")
    # the three modes give three different results here, so the comparison tells them apart
    results = [by_mode[m, 1.0] for m in (True, False, "never")]
    assert all(a != b for i, a in enumerate(results) for b in results[i + 1 :])
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.num_free_blocks() == engine.num_kv_blocks


@pytest.mark.parametrize("width", [2, 4])
def test_equals_transformers_without_eos(llm, hf, width):
    prompts = make_prompts()
    got = ours(llm, prompts, beam_width=width, ignore_eos=True, length_penalty=0.5)
    for p, g in zip(prompts, got, strict=True):
        assert_same(hf_beams(hf, p, width, False, 0.5, None), g)
        assert all(len(s[0]) == MAX_NEW for s in g)


def test_beams_share_blocks_and_copy_on_write(llm):
    engine = llm.llm_engine
    kv = engine.kv_manager
    prompt = make_prompts()[2]  # 23 tokens: 5 full blocks of 4, 3 tokens in the sixth
    engine.add_beam_search_request(
        None,
        {"prompt_token_ids": prompt},
        BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, ignore_eos=True),
    )
    copies = kv.num_cow_copies
    peak_shared = 0
    savings = []
    while engine.has_unfinished_requests():
        out = engine.step()
        st = kv.stats()
        peak_shared = max(peak_shared, st.shared_blocks)
        if st.logical_blocks:
            savings.append(1 - st.reserved / kv.block_size / st.logical_blocks)
    assert out and out[0].finished and len(out[0].outputs) == 4
    assert peak_shared >= 5 and kv.num_cow_copies > copies
    assert min(savings) > 0.3  # at least the prompt's blocks are shared by all 4 beams
    kv.check_invariants()
    assert kv.num_free_blocks() == engine.num_kv_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_beams_give_the_same_result(tiny_llama, llm, mode):
    """Three searches of 4 beams in 16 blocks of 4 (a beam of the longest prompt needs 9): beams
    are preempted, blocked beams wait for their group, and the results do not change."""
    prompts = make_prompts()
    params = dict(beam_width=4, ignore_eos=True)
    ref = ours(llm, prompts, **params)
    small = LLM(
        model=tiny_llama,
        dtype="float32",
        num_kv_blocks=16,
        block_size=4,
        preemption_mode=mode,
        num_swap_blocks=64,
    )
    got = ours(small, prompts, **params)
    e = small.llm_engine
    assert e.scheduler.num_preemptions > 0
    assert (e.scheduler.num_swap_preemptions > 0) == (mode == "swap")
    assert [[s[0] for s in g] for g in got] == [[s[0] for s in r] for r in ref]
    e.kv_manager.check_invariants()
    assert e.kv_manager.num_free_blocks() == e.num_kv_blocks and not e.has_unfinished_requests()


def test_bad_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
