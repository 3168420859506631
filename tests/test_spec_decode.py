"""Speculative decoding (n-gram prompt lookup): greedy outputs are token for token those without
it, across block sizes, attention paths, chunking, preemption, prefix caching, n > 1, stops and
logprobs; drafts are proposed, some accepted and some rejected; no KV block leaks."""

from __future__ import annotations

import math

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
NEW_TOKENS = 40
# Repetitive prompts: their suffixes recur, so drafts are proposed from the first step on.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 4 + [5, 6, 7],
    [100, 101, 102] * 6,
    list(range(20, 60)) + list(range(20, 30)),
    [300, 301, 302, 303, 304] * 3 + [7],
]
# The tiny model's greedy output of this one loops on a token: long accepted runs.
LOOPING = [42] * 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_llm(model: str, **kwargs) -> LLM:
    args = dict(dtype="float32", num_kv_blocks=256, block_size=16)
    args.update(kwargs)
    return LLM(model=model, **args)


def generate(llm: LLM, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], outs


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.num_free_blocks() == engine.num_kv_blocks


def spec_stats(llm: LLM) -> dict:
    return {k: v for k, v in llm.llm_engine.get_stats().items() if k.startswith("spec_decode")}


def assert_drafts_accepted_and_rejected(llm: LLM) -> None:
    s = spec_stats(llm)
    assert s["spec_decode_num_drafts"] > 0
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"], s
    assert sum(s["spec_decode_num_accepted_tokens_per_pos"]) == s["spec_decode_num_accepted_tokens"]


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    return generate(make_llm(tiny_llama))[0]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_identity(tiny_llama, baseline, block_size, backend):
    llm = make_llm(tiny_llama, block_size=block_size, attention_backend=backend, speculative_config=NGRAM)
    assert generate(llm)[0] == baseline
    assert_drafts_accepted_and_rejected(llm)
    assert_all_blocks_free(llm)


def test_chunked_prefill_and_small_step_budget(tiny_llama, baseline):
    # A budget of 6 tokens: prompts run in chunks, and drafts share the budget with them.
    llm = make_llm(tiny_llama, max_num_batched_tokens=6, speculative_config=NGRAM)
    assert generate(llm)[0] == baseline
    assert_drafts_accepted_and_rejected(llm)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(tiny_llama, baseline, mode):
    llm = make_llm(
        tiny_llama,
        num_kv_blocks=14,
        block_size=8,
        preemption_mode=mode,
        num_swap_blocks=64,
        speculative_config=NGRAM,
    )
    assert generate(llm)[0] == baseline
    sched = llm.llm_engine.scheduler
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swap_preemptions > 0
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    assert_all_blocks_free(llm)


def test_prefix_caching(tiny_llama, baseline):
    llm = make_llm(tiny_llama, block_size=4, speculative_config=NGRAM)
    assert generate(llm)[0] == baseline
    # Again: the prompts (and the verified outputs the first run registered) hit the cache.
    assert generate(llm)[0] == baseline
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0
    assert_all_blocks_free(llm)


def test_n_greater_than_one(tiny_llama):
    params = SamplingParams(temperature=0.0, n=3, max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = generate(make_llm(tiny_llama), params=params)[0]
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    assert generate(llm, params=params)[0] == plain
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    assert_all_blocks_free(llm)


def test_max_tokens(tiny_llama):
    # Every length from 1 to NEW_TOKENS, in one batch (drafts never run past max_tokens).
    prompts = [LOOPING] * NEW_TOKENS
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in range(1, NEW_TOKENS + 1)]
    plain = generate(make_llm(tiny_llama), prompts, params)[0]
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    got = generate(llm, prompts, params)[0]
    assert got == plain
    assert [len(g[0]) for g in got] == list(range(1, NEW_TOKENS + 1))
    assert_all_blocks_free(llm)


def test_stop_strings_inside_runs(tiny_llama, monkeypatch):
    """The texts of the plain output's runs of 1 to 3 tokens as stop strings: the outputs (tokens,
    text, finish and stop reasons) are the same with speculation, and some stop strings end
    inside an accepted run, whose later tokens are cut."""
    from pagedllm.sequence import Sequence

    cuts = []
    truncate = Sequence.truncate_output

    def counting_truncate(self, n):
        cuts.append(self.num_output_tokens - n)
        truncate(self, n)

    monkeypatch.setattr(Sequence, "truncate_output", counting_truncate)
    plain_llm = make_llm(tiny_llama)
    (first,) = plain_llm.generate([{"prompt_token_ids": LOOPING}], GREEDY, use_tqdm=False)
    tok = plain_llm.get_tokenizer()
    out = first.outputs[0].token_ids
    windows = (tok.decode(out[a:b]) for a in range(len(out)) for b in range(a + 1, min(a + 4, len(out) + 1)))
    stops = list(dict.fromkeys(w for w in windows if w.strip()))
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=[s]) for s in stops]
    prompts = [LOOPING] * len(stops)

    def summary(llm: LLM):
        outs = generate(llm, prompts, params)[1]
        return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]

    plain = summary(plain_llm)
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    assert summary(llm) == plain
    assert all(reason == "stop" for _, _, reason, _ in plain)
    assert any(c > 0 for c in cuts), "no stop string fell inside an accepted run"
    assert_all_blocks_free(llm)


def test_stop_tokens_inside_runs(tiny_llama):
    """Each token of the plain output as a stop token id: the same outputs with speculation."""
    plain_llm = make_llm(tiny_llama)
    (first,) = plain_llm.generate([{"prompt_token_ids": LOOPING}], GREEDY, use_tqdm=False)
    ids = list(dict.fromkeys(first.outputs[0].token_ids))
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[t]) for t in ids]
    prompts = [LOOPING] * len(ids)
    plain = generate(plain_llm, prompts, params)[0]
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    assert generate(llm, prompts, params)[0] == plain
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    assert_all_blocks_free(llm)


def test_logprobs_come_from_the_target_pass(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    plain = generate(make_llm(tiny_llama), params=params)[1]
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    got = generate(llm, params=params)[1]
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    for a, b in zip(got, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(pa) == list(pb)  # same tokens, in the same order
            for t in pa:
                assert math.isclose(pa[t].logprob, pb[t].logprob, abs_tol=1e-4)


def test_penalized_requests_do_not_speculate(tiny_llama):
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert generate(llm, params=penalized)[0] == generate(make_llm(tiny_llama), params=penalized)[0]
    assert spec_stats(llm)["spec_decode_num_drafts"] == 0


# Sampling: the prompt ends in the token the tiny model loops on, so drafts come at once.
SAMPLED_PROMPT = [42] * 10 + [200] * 5
NUM_SAMPLES = 3000


def sample_counts(llm: LLM, params_of, first_seed: int) -> dict[tuple[int, ...], int]:
    params = [params_of(seed) for seed in range(first_seed, first_seed + NUM_SAMPLES)]
    outs = generate(llm, [SAMPLED_PROMPT] * NUM_SAMPLES, params)[0]
    counts: dict[tuple[int, ...], int] = {}
    for (ids,) in outs:
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    return counts


def test_sampled_distribution_matches_without_speculation(tiny_llama):
    """Rejection sampling keeps the target's distribution: the joint distribution of three sampled
    tokens (top_k=3: at most 27 outcomes) from 3000 seeded requests with speculation against 3000
    without (other seeds), by a chi-square test of homogeneity. Outcomes seen fewer than 10 times in both runs
    together are pooled (the test's approximation wants expected counts >= 5). The seeds are
    fixed, so the test is deterministic; a correct sampler passes it unless the draws happen to
    land in the 0.1% tail, a wrong one (drafts accepted whenever they are in the top 3, say)
    moves mass by far more than that."""
    llm = make_llm(tiny_llama, speculative_config=NGRAM, num_kv_blocks=1024)
    assert_keeps_the_distribution(tiny_llama, llm)
    assert_drafts_accepted_and_rejected(llm)
    assert_all_blocks_free(llm)


def sampled_params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=seed)


def assert_keeps_the_distribution(model: str, llm: LLM) -> None:
    """``llm``'s (speculating) sampled outputs against ``model``'s without speculation: a
    chi-square test of homogeneity, as test_sampled_distribution_matches_without_speculation says."""
    from scipy.stats import chi2_contingency

    plain = sample_counts(make_llm(model, num_kv_blocks=1024), sampled_params, 0)
    spec = sample_counts(llm, sampled_params, NUM_SAMPLES)  # other seeds: independent samples
    outcomes = sorted(set(plain) | set(spec))
    big = [o for o in outcomes if plain.get(o, 0) + spec.get(o, 0) >= 10]
    table = [[c.get(o, 0) for o in big] + [sum(c.get(o, 0) for o in outcomes if o not in big)] for c in (plain, spec)]
    table = [row for row in zip(*table, strict=True) if sum(row) > 0]
    assert len(table) >= 4  # enough outcomes for the test to mean something
    p_value = chi2_contingency(list(zip(*table, strict=True)))[1]
    assert p_value > 0.001, (p_value, table)


def test_sampled_speculation_is_reproducible_per_seed(tiny_llama):
    params = [
        SamplingParams(temperature=0.8, top_k=3, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True) for s in range(4)
    ]
    prompts = [SAMPLED_PROMPT] * 4
    first = generate(make_llm(tiny_llama, speculative_config=NGRAM), prompts, params)[0]
    llm = make_llm(tiny_llama, speculative_config=NGRAM, max_num_seqs=1)  # alone: other batches
    assert generate(llm, prompts, params)[0] == first
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0


def test_sliding_window_model(tiny_mistral_windowed):
    # Its layers attend through a window narrower than the prompts: blocks out of it are released
    # after each step, verifying steps included.
    prompts = [*PROMPTS, LOOPING]
    plain = generate(make_llm(tiny_mistral_windowed, block_size=4), prompts)[0]
    llm = make_llm(tiny_mistral_windowed, block_size=4, speculative_config=NGRAM)
    assert generate(llm, prompts)[0] == plain
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    assert llm.llm_engine.kv_manager.num_released_blocks > 0
    assert_all_blocks_free(llm)


def test_disable_by_batch_size(tiny_llama, baseline):
    # Four prompts run at once: at 2 nobody speculates until only one is left.
    config = dict(NGRAM, disable_by_batch_size=2)
    llm = make_llm(tiny_llama, speculative_config=config)
    assert generate(llm)[0] == baseline
    off = make_llm(tiny_llama, speculative_config=dict(NGRAM, disable_by_batch_size=1))
    assert generate(off)[0] == baseline
    assert spec_stats(off)["spec_decode_num_drafts"] == 0
    on = make_llm(tiny_llama, speculative_config=NGRAM)
    generate(on)
    assert spec_stats(llm)["spec_decode_num_drafts"] < spec_stats(on)["spec_decode_num_drafts"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_block_leaks_with_rejections_and_aborts(tiny_llama, seed):
    """Random arrivals (n of 1 or 2), aborts and steps on a small cache with prefix caching and
    preemption: after every step the manager's refcounts match the tables, no running sequence
    holds a lookahead block past its next token, and once all is done every block is free."""
    llm = run_random_workload(tiny_llama, NGRAM, seed)
    assert_drafts_accepted_and_rejected(llm)
    assert llm.llm_engine.scheduler.num_preemptions > 0


def run_random_workload(model: str, spec: dict, seed: int) -> LLM:
    """The workload of test_no_block_leaks_with_rejections_and_aborts, checked as it says."""
    import random

    from pagedllm.utils import cdiv

    rng = random.Random(seed)
    mode = ("recompute", "swap")[seed % 2]
    llm = make_llm(
        model, num_kv_blocks=24, block_size=4, preemption_mode=mode, num_swap_blocks=32, speculative_config=spec
    )
    engine = llm.llm_engine
    kv, sched = engine.kv_manager, engine.scheduler
    live: list[str] = []

    def check() -> None:
        kv.check_invariants()
        for seq in sched.running:
            assert len(kv.block_table(seq.seq_id)) <= cdiv(seq.num_computed_tokens + 1, kv.block_size), seq

    for _ in range(300):
        action = rng.random()
        if action < 0.15 or not engine.has_unfinished_requests():
            base = rng.choice([*PROMPTS, LOOPING])
            prompt = base[: rng.randrange(4, len(base) + 1)]
            params = SamplingParams(temperature=0.0, n=rng.choice([1, 2]), max_tokens=rng.randrange(1, 24))
            live.append(engine.add_request(None, {"prompt_token_ids": prompt}, params))
        elif action < 0.22 and live:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        else:
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
        check()
    while engine.has_unfinished_requests():
        engine.step()
        check()
    assert_all_blocks_free(llm)
    return llm


def test_default_model_greedy_identity():
    """The default model on an input-grounded task (repeat code with one change): drafts from the
    prompt are accepted, and the output is the same without speculation."""
    from pagedllm.models.resolve import default_model_gguf_path

    if default_model_gguf_path() is None:
        pytest.skip("default model package not installed")
    code = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
    messages = [{"role": "user", "content": f"Repeat this code exactly, renaming add to plus:\n\n{code}"}]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    outs = {}
    for spec in (None, NGRAM):
        llm = LLM(kv_cache_memory_gib=0.25, speculative_config=spec)
        (out,) = llm.chat(messages, params, use_tqdm=False)
        outs[spec is None] = out.outputs[0].token_ids
        if spec is not None:
            assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
            assert_all_blocks_free(llm)
    assert outs[True] == outs[False]
