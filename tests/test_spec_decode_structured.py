"""Speculative decoding with structured outputs: drafts are cut at the first token the grammar
forbids, each verifying position is masked with the grammar's state after the drafts before it,
and the grammar advances over exactly the tokens kept. Greedy constrained output is token for
token the output without speculation (JSON schema, regex, choice, grammar; block sizes, chunked
prefill, preemption, max_tokens inside a run, the default model); sampled constrained output
matches its grammar and keeps the masked distribution; a failed matcher ends its sequence, never
the engine; no KV block leaks."""

from __future__ import annotations

import json
import logging
import re

import jsonschema
import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sequence import Sequence
from pagedllm.spec_decode.config import parse_speculative_config
from pagedllm.spec_decode.planner import SpecDecodePlanner
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.structured_output.state import STOP_REASON
from pagedllm.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}
REGEX = "[a-f]{3,30}"
CHOICES = ["alpha beta gamma", "alpha beta delta", "alpha omega", "omega"]
GBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "ab"'
CONSTRAINTS = {
    "json": {"json": SCHEMA},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar": {"grammar": GBNF},
}
# Input-grounded prompts: what the constrained output may write is in them, so n-gram drafts come.
PROMPTS = [
    {"prompt_token_ids": [42] * 10},
    'name: "abcabc", tags: ["ab", "cd"]; {"name": "abcabc", "tags": ["ab", "cd"]} (1,2,ab,3) (1,2,ab,3) ',
    "alpha beta gamma, alpha beta delta, alpha omega; abcdef abcdef",
]
MAX_TOKENS = [60, 23, 9]  # the shorter ones end inside accepted runs


def make_llm(model: str, **kwargs) -> LLM:
    args = dict(dtype="float32", num_kv_blocks=256, block_size=16, seed=0)
    args.update(kwargs)
    return LLM(model=model, **args)


def run(llm: LLM, constraint: dict, temperature: float = 0.0, seed: int = 0) -> list[tuple]:
    params = [
        SamplingParams(temperature=temperature, seed=seed + i, max_tokens=m, structured_outputs=constraint)
        for i, m in enumerate(MAX_TOKENS)
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


def spec_stats(llm: LLM) -> dict:
    return {k: v for k, v in llm.llm_engine.get_stats().items() if k.startswith("spec_decode")}


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.kv_manager.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks() == engine.num_kv_blocks


@pytest.fixture(scope="module")
def baselines(tiny_llama) -> dict[str, list[tuple]]:
    llm = make_llm(tiny_llama)
    return {kind: run(llm, c) for kind, c in CONSTRAINTS.items()}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize(
    "engine_kwargs",
    [dict(block_size=1), dict(block_size=16), dict(block_size=4, max_num_batched_tokens=6)],
    ids=["block1", "block16", "chunked"],
)
def test_greedy_identity(tiny_llama, baselines, kind, engine_kwargs):
    llm = make_llm(tiny_llama, speculative_config=NGRAM, **engine_kwargs)
    assert run(llm, CONSTRAINTS[kind]) == baselines[kind]
    s = spec_stats(llm)
    assert s["spec_decode_num_drafts"] > 0 and s["spec_decode_num_accepted_tokens"] > 0, s
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_identity_with_preemption(tiny_llama, baselines, mode):
    # A cache too small for the three at once: sequences are preempted, their grammars keep going.
    kwargs = dict(block_size=8, num_kv_blocks=16, preemption_mode=mode, num_swap_blocks=64)
    llm = make_llm(tiny_llama, speculative_config=NGRAM, **kwargs)
    for kind, constraint in CONSTRAINTS.items():
        assert run(llm, constraint) == baselines[kind], kind
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    assert_all_blocks_free(llm)


def test_default_model_json_record_identity():
    """The default model repeating a JSON record under its schema: the drafts from the prompt
    are accepted, and the output is the same without speculation."""
    from pagedllm.models.resolve import default_model_gguf_path

    if default_model_gguf_path() is None:
        pytest.skip("default model package not installed")
    record = {"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"]}
    item = {"type": "string"}
    props = {"name": item, "born": {"type": "integer"}, "fields": {"type": "array", "items": item}}
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    messages = [{"role": "user", "content": f"Repeat this JSON record exactly:\n\n{json.dumps(record)}"}]
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs={"json": schema})
    outs = {}
    for spec in (None, NGRAM):
        llm = LLM(kv_cache_memory_gib=0.25, speculative_config=spec)
        (out,) = llm.chat(messages, params, use_tqdm=False)
        outs[spec is None] = out.outputs[0].token_ids
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
        if spec is not None:
            assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
            assert_all_blocks_free(llm)
    assert outs[True] == outs[False]


def valid(kind: str, text: str, finish_reason: str) -> bool:
    if finish_reason == "length":  # max_tokens cut it: a prefix of the language is all it can be
        if kind == "choice":
            return any(choice.startswith(text) for choice in CHOICES)
        return kind != "regex" or re.fullmatch("[a-f]*", text) is not None
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\((\d|ab)(,(\d|ab))*\)", text) is not None


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_sampled_output_matches_its_grammar(tiny_llama, kind):
    """Rejection sampling draws from each position's masked distribution: every output matches its
    grammar (a token drawn outside the mask would fail the matcher: structured_output_error)."""
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    for seed in range(0, 24, 3):
        for _, text, finish, stop in run(llm, CONSTRAINTS[kind], temperature=1.0, seed=seed):
            assert stop != STOP_REASON and valid(kind, text, finish), (kind, text, finish)
    s = spec_stats(llm)
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"], s
    assert_all_blocks_free(llm)


def test_sampled_choice_distribution_matches_without_speculation(tiny_llama):
    """Rejection sampling accepts a draft with the masked target probability of it and draws the
    residual from the masked distribution: the distribution of the chosen string over 3000 seeded
    requests with speculation equals the one over 3000 without (other seeds), by a chi-square
    test of homogeneity (deterministic: the seeds are fixed). The prompt holds the choices, so
    most tokens are drafted; a draft judged by the unmasked probability would be accepted less
    often than it should, moving mass by far more than the test's 0.1% tail."""
    from scipy.stats import chi2_contingency

    n = 3000
    prompt = PROMPTS[2]
    counts = []
    for first_seed, spec in ((0, None), (n, NGRAM)):
        llm = make_llm(tiny_llama, num_kv_blocks=1024, speculative_config=spec)
        params = [
            SamplingParams(temperature=1.0, seed=s, max_tokens=20, structured_outputs=CONSTRAINTS["choice"])
            for s in range(first_seed, first_seed + n)
        ]
        texts = [o.outputs[0].text for o in llm.generate([prompt] * n, params, use_tqdm=False)]
        assert set(texts) <= set(CHOICES)
        counts.append([texts.count(c) for c in CHOICES])
    assert all(c >= 50 for c in counts[0]), counts  # every choice drawn: the test means something
    p_value = chi2_contingency(counts)[1]
    assert p_value > 0.001, (p_value, counts)
    s = spec_stats(llm)
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"], s
    assert_all_blocks_free(llm)


def test_sampled_constrained_speculation_is_reproducible_per_seed(tiny_llama):
    first = run(make_llm(tiny_llama, speculative_config=NGRAM), CONSTRAINTS["json"], temperature=1.0, seed=5)
    llm = make_llm(tiny_llama, speculative_config=NGRAM, max_num_seqs=1)  # alone: other batches
    assert run(llm, CONSTRAINTS["json"], temperature=1.0, seed=5) == first
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0


def test_a_failed_constraint_ends_its_sequence_with_speculation(tiny_llama, caplog):
    """After '{"x": "ab"', the object of 1,000 optional properties that follows holds more parser
    items in a row than llguidance's limit, and the matcher fails on the next token. Drafts run
    up to there (the grammar cuts those it cannot take); the sequence ends as without
    speculation, with stop_reason STOP_REASON and one warning, and the engine goes on."""
    inner = {"type": "object", "properties": {f"p{i:04d}": {"type": "string"} for i in range(1000)}}
    x = {"type": "string", "pattern": "^ab( ab){0,3}$"}
    schema = {"type": "object", "properties": {"x": x, "a": inner}, "required": ["x", "a"]}
    prompt = '{"x": "ab ab ab ab", "a": {"x": "ab ab ab ab", "a": {'
    params = SamplingParams(temperature=0.0, max_tokens=50, structured_outputs={"json": schema})
    plain = make_llm(tiny_llama).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        (out,) = llm.generate([prompt], params, use_tqdm=False)
    c = out.outputs[0]
    assert (c.token_ids, c.text) == (plain.token_ids, plain.text)
    assert (c.finish_reason, c.stop_reason) == ("stop", STOP_REASON) and c.text.startswith('{"x": "ab')
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    assert sum("structured output failed" in r.getMessage() for r in caplog.records) == 1
    # The engine goes on: a later constrained request speculates and matches its grammar.
    assert run(llm, CONSTRAINTS["choice"])[0][1] in CHOICES
    assert_all_blocks_free(llm)


# ---- the grammar walk itself ---------------------------------------------------------------


@pytest.fixture(scope="module")
def manager(tiny_llama) -> StructuredOutputManager:
    tokenizer = load_tokenizer(tiny_llama)
    m = StructuredOutputManager(tokenizer, 512, tokenizer.eos_token_id)
    yield m
    m.shutdown()


def ids(manager: StructuredOutputManager, *pieces: str) -> list[int]:
    """The token ids of these token texts (each one token of the tiny model's vocabulary)."""
    vocab = manager.compiler._hf_tokenizer.get_vocab()
    return [vocab[p] for p in pieces]


def mask_after(manager: StructuredOutputManager, params: StructuredOutputsParams, tokens: list[int]) -> np.ndarray:
    """The mask a fresh matcher computes after ``tokens``: what no speculation would use."""
    matcher = manager.compile(params).matcher.deep_copy()
    assert matcher.consume_tokens(tokens)
    return manager._compute_mask(matcher)[0]


def test_a_draft_the_grammar_forbids_is_cut(manager):
    """The n-gram proposal after 'ab c' is 'd z e ab'; the regex forbids 'z', so the draft is 'd'
    alone, its verifying positions masked as the grammar is before and after 'd', and the
    matcher is where it was."""
    params = StructuredOutputsParams(regex=REGEX)
    ab, c, d, z, e = ids(manager, "ab", "c", "d", "z", "e")
    seq = Sequence("s", [ab, c, d, z, e, ab, c], SamplingParams(temperature=0.0, max_tokens=20))
    seq.grammar = manager.new_state(params)
    seq.num_computed_tokens = seq.num_tokens - 1
    planner = SpecDecodePlanner(parse_speculative_config(NGRAM), max_model_len=128)
    seq.grammar, grammar = None, seq.grammar
    assert planner.drafts(seq, budget=64, num_running=1) == [d, z, e, ab]  # unconstrained
    seq.grammar = grammar
    assert planner.drafts(seq, budget=64, num_running=1) == [d]
    first, after_d = grammar.position_masks(1)
    assert np.array_equal(first, mask_after(manager, params, []))
    assert np.array_equal(after_d, mask_after(manager, params, [d]))
    assert grammar.num_accepted == 0 and np.array_equal(manager._compute_mask(grammar.matcher)[0], first)
    # A first draft the grammar forbids: no drafts at all.
    assert grammar.propose([z, d]) == []


def test_accepted_drafts_take_their_planned_masks(manager):
    """Tokens that follow the plan take the masks computed for them (none computed again); the
    first token off the plan has its own mask computed ahead, for the state it is used in."""
    params = StructuredOutputsParams(regex=REGEX)
    ab, c, d, ef = ids(manager, "ab", "c", "d", "ef")
    state = manager.new_state(params)
    assert state.propose([c, d, ef]) == [c, d, ef]
    planned = state.position_masks(3)
    assert not np.array_equal(planned[3], planned[0])  # after 'cdef' the output may end
    state.accept(c)
    assert state.future is None and state.mask is planned[1]
    state.accept(d)
    assert state.future is None and state.mask is planned[2]
    state.accept(ab)  # not the planned 'ef'
    assert state.mask is None and state.future is not None
    state.wait()
    assert np.array_equal(state.mask, mask_after(manager, params, [c, d, ab]))
    assert state.num_accepted == 3 and not state.failed


def test_a_draft_that_completes_the_grammar_is_the_last(manager):
    params = StructuredOutputsParams(choice=["abc"])
    ab, c, d = ids(manager, "ab", "c", "d")
    state = manager.new_state(params)
    assert state.propose([ab, c, d]) == [ab, c]  # nothing may follow 'abc' but end-of-sequence
    assert np.array_equal(state.position_masks(2)[2], manager._eos_row)
    state.accept(ab)
    state.accept(c)
    assert state.is_terminated and not state.failed


class _NoRollback:
    """A matcher whose rollback fails (as it does for one in error): the walk must rebuild it."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def rollback(self, n: int) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._matcher, name)


def test_a_matcher_the_walk_cannot_roll_back_is_rebuilt(manager):
    params = StructuredOutputsParams(regex=REGEX)
    ab, c, d = ids(manager, "ab", "c", "d")
    state = manager.new_state(params)
    state.accept(ab)
    state.wait()
    state.matcher = _NoRollback(state.matcher)
    assert state.propose([c, d]) == [c, d]
    planned = state.position_masks(2)
    assert not isinstance(state.matcher, _NoRollback) and not state.failed
    assert np.array_equal(manager._compute_mask(state.matcher)[0], mask_after(manager, params, [ab]))
    state.accept(c)  # the plan holds for the rebuilt matcher: the same state
    assert state.mask is planned[1] and state.num_accepted == 2
