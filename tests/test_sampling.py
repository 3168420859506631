"""Sampling: the Sampler on hand-made logits, and sampling / stop conditions through the engine."""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_prompt_logprobs import rank_range

from pagedllm import LLM, SamplingParams
from pagedllm.runner.seq_state import SeqState
from pagedllm.sampler import Sampler, _filter

EOS = 0


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------
# Sampler unit tests (hand-made logits, fake requests)
# ---------------------------------------------------------------------------------------------
def make_req(prompt=(1, 2, 3), output=(), rid="r", eos=(EOS,), **sp_kwargs) -> SeqState:
    sp = SamplingParams(**sp_kwargs)
    sp.all_stop_token_ids = set(eos)  # what the engine fills in
    req = SeqState(rid, list(prompt), sp)
    for t in output:
        req.append_output_token(t)
    return req


def rand_logits(rows: int, vocab: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(rows, vocab, generator=g)


def draws(logits_row: torch.Tensor, n: int, seed: int = 0, **sp_kwargs) -> list[int]:
    """n independent draws from one logits row (n unseeded requests in one batch)."""
    sp = SamplingParams(**sp_kwargs)
    reqs = [SeqState(f"r{i}", [1], sp) for i in range(n)]
    return Sampler(seed)(logits_row.unsqueeze(0).expand(n, -1).clone(), reqs).token_ids


def counts(tokens: list[int], vocab: int) -> list[int]:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).tolist()


PROBS4 = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS4 = PROBS4.log()


def test_greedy_is_argmax():
    logits = rand_logits(16, 97)
    reqs = [make_req(rid=str(i), temperature=0.0) for i in range(16)]
    out = Sampler()(logits, reqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.top_logprobs == [None] * 16


def test_top_k_1_equals_greedy_at_temperature_1():
    logits = rand_logits(12, 64, seed=1, scale=0.3)  # flat: a real draw would rarely hit the argmax
    # top_k=1 rows mixed with unrestricted rows: top-k must be applied per row.
    reqs = [make_req(rid=str(i), temperature=1.0, top_k=1 if i % 2 == 0 else 0) for i in range(12)]
    sampler = Sampler(3)
    argmax = logits.argmax(-1).tolist()
    free_hits = 0
    for _ in range(10):
        ids = sampler(logits.clone(), reqs).token_ids
        assert [ids[i] for i in range(0, 12, 2)] == [argmax[i] for i in range(0, 12, 2)]
        free_hits += sum(ids[i] == argmax[i] for i in range(1, 12, 2))
    assert free_hits < 30  # the unrestricted rows really sample (60 draws over 64 flat tokens)


def test_tiny_top_p_keeps_only_the_top_token():
    row = rand_logits(1, 64, seed=2, scale=0.3)[0]
    toks = draws(row, 300, temperature=1.0, top_p=1e-6)
    assert set(toks) == {int(row.argmax())}
    assert len(set(draws(row, 300, temperature=1.0))) > 20  # control: without top_p it spreads


@pytest.mark.parametrize(
    "kwargs, kept",
    [
        (dict(top_p=0.75), [0, 1]),
        (dict(top_p=0.9), [0, 1, 2]),
        (dict(top_p=1.0), [0, 1, 2, 3]),
        (dict(top_k=2), [0, 1]),
        (dict(top_k=3, top_p=0.6), [0, 1]),
        (dict(min_p=0.25), [0, 1, 2]),  # threshold 0.25 * 0.5 = 0.125: drops 0.05 only
        (dict(min_p=0.7), [0]),  # threshold 0.35
        (dict(min_p=0.5), [0, 1]),  # threshold 0.25
    ],
)
def test_filter_keeps_expected_tokens(kwargs, kept):
    sp = SamplingParams(**kwargs)
    out = _filter(LOGITS4.unsqueeze(0).clone(), [sp])[0]
    assert torch.isfinite(out).nonzero().flatten().tolist() == kept
    # kept entries are untouched
    assert torch.equal(out[kept], LOGITS4[kept])
    # and draws only ever land on kept tokens, each of them reached
    toks = draws(LOGITS4, 2000, seed=5, temperature=1.0, **kwargs)
    assert sorted(set(toks)) == kept


def test_filter_is_per_row():
    logits = LOGITS4.unsqueeze(0).repeat(3, 1)
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(min_p=0.5)]
    out = _filter(logits.clone(), params)
    assert torch.isfinite(out).tolist() == [
        [True, False, False, False],
        [True, True, True, True],
        [True, True, False, False],
    ]


def test_repetition_penalty_divides_positive_multiplies_negative():
    row = torch.tensor([2.0, -2.0, 1.0, -1.0, 3.0, -3.0, 0.5, 4.0])
    # seen: prompt {0, 1}, output {2, 3}; 4..7 unseen
    pen = make_req(prompt=[0, 1, 0], output=[2, 3, 3], rid="a", repetition_penalty=2.0)
    plain = make_req(prompt=[0, 1], output=[2, 3], rid="b")
    logits = row.unsqueeze(0).repeat(2, 1)
    out = Sampler._apply_penalties(logits.clone(), [pen, plain])
    assert out[0].tolist() == [1.0, -4.0, 0.5, -2.0, 3.0, -3.0, 0.5, 4.0]
    assert out[1].tolist() == row.tolist()  # repetition_penalty=1: untouched


def test_repetition_penalty_changes_greedy_choice():
    row = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
    assert Sampler()(row, [make_req(prompt=[2], temperature=0.0)]).token_ids == [0]
    # token 0 seen in the prompt: 3 / 2 = 1.5 < 2.5
    assert Sampler()(row, [make_req(prompt=[0], temperature=0.0, repetition_penalty=2.0)]).token_ids == [1]
    # token 0 seen in the output counts too
    req = make_req(prompt=[3], output=[0], temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(row, [req]).token_ids == [1]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    vocab = 8
    row = torch.linspace(-1.0, 1.0, vocab)
    req = make_req(prompt=[5, 6, 6], output=[1, 1, 2, 1], frequency_penalty=0.5, presence_penalty=0.25)
    out = Sampler._apply_penalties(row.unsqueeze(0).clone(), [req])[0]
    expected = row.clone()
    expected[1] -= 3 * 0.5 + 0.25
    expected[2] -= 1 * 0.5 + 0.25
    torch.testing.assert_close(out, expected)  # prompt tokens 5, 6 not penalized
    # negative penalties encourage repetition
    req = make_req(prompt=[5], output=[3, 3], frequency_penalty=-1.0, presence_penalty=-0.5)
    out = Sampler._apply_penalties(row.unsqueeze(0).clone(), [req])[0]
    expected = row.clone()
    expected[3] += 2 * 1.0 + 0.5
    torch.testing.assert_close(out, expected)
    # no output yet: nothing to penalize
    req = make_req(prompt=[1, 2], frequency_penalty=2.0, presence_penalty=2.0)
    torch.testing.assert_close(Sampler._apply_penalties(row.unsqueeze(0).clone(), [req])[0], row)


def test_min_tokens_masks_eos_and_stop_token_ids():
    row = torch.zeros(1, 16)
    row[0, EOS] = 10.0
    row[0, 5] = 9.0
    row[0, 7] = 1.0
    for n_out in range(4):
        req = make_req(output=[9] * n_out, temperature=0.0, min_tokens=3, stop_token_ids=[5])
        masked = Sampler._apply_penalties(row.clone(), [req])[0]
        tok = Sampler()(row.clone(), [req]).token_ids[0]
        if n_out < 3:
            assert masked[EOS] == float("-inf") and masked[5] == float("-inf")
            assert tok == 7
        else:
            torch.testing.assert_close(masked, row[0])
            assert tok == EOS
    # ignore_eos: the EOS is not a stop token, so it is not masked; stop_token_ids still are
    req = make_req(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=True)
    masked = Sampler._apply_penalties(row.clone(), [req])[0]
    assert masked[EOS] == 10.0 and masked[5] == float("-inf")
    # sampled rows: never a stop id while under min_tokens, even when they dominate
    sp = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[5])
    sp.all_stop_token_ids = {EOS}
    reqs = [SeqState(f"r{i}", [1], sp) for i in range(500)]
    toks = Sampler(1)(row.expand(500, -1).clone(), reqs).token_ids
    assert EOS not in toks and 5 not in toks


def test_logprobs_are_chosen_plus_top_n_of_raw_distribution():
    vocab = 32
    logits = rand_logits(4, vocab, seed=4, scale=2.0)
    raw = torch.log_softmax(logits, -1)
    top5 = raw[3].topk(5).indices.tolist()
    reqs = [
        make_req(rid="a", temperature=0.0),  # no logprobs
        make_req(rid="b", temperature=0.0, logprobs=0),  # chosen only
        make_req(rid="c", temperature=1.0, seed=3, logprobs=3),
        # the penalty pushes the raw top-5 down: the chosen token is outside the raw top-3
        make_req(prompt=top5, rid="d", temperature=0.0, logprobs=3, repetition_penalty=1000.0),
    ]
    out = Sampler()(logits.clone(), reqs)
    ids = out.token_ids
    for i in range(4):
        assert out.chosen_logprobs[i] == pytest.approx(raw[i, ids[i]].item(), abs=1e-6)
    assert out.top_logprobs[0] is None
    assert list(out.top_logprobs[1]) == [ids[1]]
    assert out.top_logprobs[1][ids[1]].logprob == pytest.approx(raw[1, ids[1]].item(), abs=1e-6)
    for i in (2, 3):
        d = out.top_logprobs[i]
        expected_keys = {ids[i], *raw[i].topk(3).indices.tolist()}
        assert set(d) == expected_keys and len(d) <= 4
        for t, v in d.items():
            assert v.logprob == pytest.approx(raw[i, t].item(), abs=1e-6)
            # rank: 1 + the tokens strictly more likely in the raw distribution
            assert v.rank == int((raw[i] > raw[i, t]).sum()) + 1
            assert v.decoded_token is None  # the sampler has no tokenizer: the engine fills it
    assert ids[3] not in top5 and len(out.top_logprobs[3]) == 4


def test_logprobs_more_than_vocab_returns_whole_vocab():
    vocab = 10
    logits = rand_logits(2, vocab, seed=6)
    reqs = [make_req(rid="a", temperature=0.0, logprobs=1000), make_req(rid="b", temperature=0.7, logprobs=2)]
    out = Sampler()(logits, reqs)
    assert sorted(out.top_logprobs[0]) == list(range(vocab))
    assert len(out.top_logprobs[1]) <= 3


def _seeded_run(seed: int, companions: str, sampler_seed: int, steps: int = 40) -> list[int]:
    vocab = 64
    a = make_req(rid="a", temperature=0.9, top_p=0.95, seed=seed)
    batch = {
        "alone": [a],
        "mixed": [
            make_req(rid="b", temperature=0.7),
            a,
            make_req(rid="c", temperature=1.3, top_k=5, seed=7),
            make_req(rid="d", temperature=0.0),
        ],
        "greedy_first": [make_req(rid="e", temperature=0.0), a],
    }[companions]
    sampler = Sampler(sampler_seed)
    pos = batch.index(a)
    toks = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)  # a's logits depend only on the step
        own = torch.randn(vocab, generator=g) * 0.5
        logits = torch.randn(len(batch), vocab, generator=torch.Generator().manual_seed(step + sampler_seed))
        logits[pos] = own
        t = sampler(logits, batch).token_ids[pos]
        toks.append(t)
    return toks


def test_seeded_rows_reproduce_regardless_of_batch():
    ref = _seeded_run(42, "alone", 0)
    assert _seeded_run(42, "alone", 0) == ref
    assert _seeded_run(42, "mixed", 123) == ref
    assert _seeded_run(42, "greedy_first", 9) == ref
    assert len(set(ref)) > 10  # it really samples
    other = _seeded_run(43, "mixed", 123)
    assert sum(x != y for x, y in zip(ref, other, strict=True)) > 20


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_sampled_frequencies_follow_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -2.0])
    n = 20000
    toks = draws(logits, n, seed=11, temperature=temperature)
    obs = torch.tensor(counts(toks, len(logits)), dtype=torch.float64)
    p = torch.softmax(logits.double() / temperature, -1)
    expected = n * p
    chi2 = (((obs - expected) ** 2) / expected).sum().item()
    # df = 7: P(chi2 > 35) ~ 1e-5. A wrong temperature (e.g. T applied twice / not at all) gives > 100.
    assert chi2 < 35, (chi2, obs.tolist(), expected.tolist())
    wrong = n * torch.softmax(logits.double(), -1) if temperature != 1.0 else None
    if wrong is not None:
        assert (((obs - wrong) ** 2) / wrong).sum().item() > 100


def test_sampled_frequencies_after_top_k_renormalize():
    n = 20000
    toks = draws(LOGITS4, n, seed=12, temperature=1.0, top_k=2)
    obs = counts(toks, 4)
    assert obs[2] == obs[3] == 0
    assert obs[0] / n == pytest.approx(0.5 / 0.8, abs=0.015)


# ---------------------------------------------------------------------------------------------
# Engine-level tests (tiny random-weight llama, fp32)
# ---------------------------------------------------------------------------------------------
PROMPT = "The quick brown fox"
GREEDY_LEN = 40


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama, dtype="float32", num_kv_blocks=256, block_size=16)


@pytest.fixture(scope="module")
def greedy(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=GREEDY_LEN), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == GREEDY_LEN and EOS not in c.token_ids
    return out


def random_prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(rng.randrange(3, 40))]} for _ in range(n)]


def gen(llm, prompts, params) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_engine_seeded_runs_reproduce_across_batches(llm):
    target = {"prompt_token_ids": [5, 77, 301, 12, 9, 400, 33]}
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = gen(llm, [target], sp)[0].token_ids
    others = random_prompts(5, seed=3)
    other_params = [SamplingParams(temperature=0.8, max_tokens=5 + 4 * i, ignore_eos=True) for i in range(5)]
    other_params[1] = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    other_params[3] = SamplingParams(temperature=1.2, seed=99, top_k=20, max_tokens=12, ignore_eos=True)
    prompts = others[:2] + [target] + others[2:]
    params = other_params[:2] + [sp] + other_params[2:]
    batched = gen(llm, prompts, params)[2].token_ids
    assert batched == alone
    assert gen(llm, [target], sp)[0].token_ids == alone
    greedy_toks = gen(llm, [target], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert alone != greedy_toks.token_ids  # it really samples
    diff_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=24, ignore_eos=True)
    assert gen(llm, [target], diff_seed)[0].token_ids != alone


def test_engine_top_k_1_equals_greedy(llm):
    prompts = random_prompts(4, seed=5)
    g = gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    k1 = gen(llm, prompts, SamplingParams(temperature=0.8, top_k=1, max_tokens=16, ignore_eos=True))
    assert [c.token_ids for c in k1] == [c.token_ids for c in g]
    t = gen(llm, prompts, SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True))
    assert [c.token_ids for c in t] != [c.token_ids for c in g]  # control: T=0.8 alone does sample


def _pick_stop_string(text: str, length: int, start: int = 3) -> str:
    for i in range(start, len(text) - length):
        s = text[i : i + length]
        if s.isascii() and s.isprintable() and "<|" not in s and "|>" not in s and text.find(s) > 0:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def _straddling_stop_string(tok, ids: list[int], text: str) -> str:
    """A 4-char stop string whose last char only is in a later token than the rest (first occurrence).

    Its first 3 chars were already searched when the token completing it arrives: the tightest case
    for the detokenizer's search window."""
    for i in range(len(ids) // 3, len(ids)):
        prefix = tok.decode(ids[:i])
        b = len(prefix)
        s = text[b - 3 : b + 1]
        clean = len(s) == 4 and s.isascii() and s.isprintable()
        if clean and text.startswith(prefix) and text.find(s) == b - 3:
            return s
    raise AssertionError(f"no stop string straddling a token boundary in {text!r}")


@pytest.mark.parametrize("kind", ["short", "straddling"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string(llm, greedy, kind, include):
    text = greedy.outputs[0].text
    if kind == "short":
        s = _pick_stop_string(text, 2, start=len(text) // 3)
    else:
        s = _straddling_stop_string(llm.get_tokenizer(), greedy.outputs[0].token_ids, text)
    idx = text.find(s)
    sp = SamplingParams(temperature=0.0, max_tokens=GREEDY_LEN, stop=[s], include_stop_str_in_output=include)
    c = gen(llm, PROMPT, sp)[0]
    assert c.finish_reason == "stop"
    assert c.stop_reason == s
    if include:
        assert c.text == text[: idx + len(s)] and c.text.endswith(s)
    else:
        assert c.text == text[:idx]
        assert s not in c.text
    toks = c.token_ids
    assert 0 < len(toks) < GREEDY_LEN and toks == greedy.outputs[0].token_ids[: len(toks)]


def test_earliest_stop_string_wins(llm, greedy):
    text = greedy.outputs[0].text
    early = _pick_stop_string(text, 3, start=2)
    late = _pick_stop_string(text, 3, start=text.find(early) + 8)
    assert text.find(early) < text.find(late)
    c = gen(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=GREEDY_LEN, stop=[late, early]))[0]
    assert c.stop_reason == early and c.text == text[: text.find(early)]


def test_stop_token_ids(llm, greedy):
    ref = greedy.outputs[0].token_ids
    stop_id = ref[6]
    first = ref.index(stop_id)
    sp = SamplingParams(temperature=0.0, max_tokens=GREEDY_LEN, stop_token_ids=[stop_id, 511])
    c = gen(llm, PROMPT, sp)[0]
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop_id
    assert c.token_ids == ref[: first + 1]
    assert c.token_ids[-1] == stop_id


def test_stop_token_text_not_in_output(llm, greedy):
    tok = llm.get_tokenizer()
    ref = greedy.outputs[0].token_ids
    for i in range(1, GREEDY_LEN):
        piece = tok.decode([ref[i]])
        clean = piece.strip() and piece.isascii() and piece.isprintable()
        if clean and ref[i] not in ref[:i] and not tok.decode(ref[:i]).endswith("\ufffd"):
            break
    else:
        raise AssertionError("no clean token in the greedy output")
    before = gen(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=i))[0].text
    assert before and not before.endswith("\ufffd")
    base = dict(temperature=0.0, max_tokens=GREEDY_LEN, stop_token_ids=[ref[i]])
    c = gen(llm, PROMPT, SamplingParams(include_stop_str_in_output=True, **base))[0]
    assert c.token_ids == ref[: i + 1] and c.text == before + piece  # included on request
    c = gen(llm, PROMPT, SamplingParams(**base))[0]
    assert c.token_ids == ref[: i + 1]
    assert c.text == before  # fails today: the stop token's text is in the output


@pytest.mark.parametrize("max_tokens", [1, 7, 23])
def test_max_tokens(llm, max_tokens):
    outs = gen(
        llm,
        random_prompts(3, seed=7),
        SamplingParams(temperature=0.7, max_tokens=max_tokens, ignore_eos=True, seed=2),
    )
    for c in outs:
        assert len(c.token_ids) == max_tokens
        assert c.finish_reason == "length" and c.stop_reason is None


@pytest.fixture(scope="module")
def eos_case(llm):
    """A seeded sampled request that ends with the EOS (searched over seeds, deterministic)."""
    prompt = {"prompt_token_ids": [17, 230, 5, 88, 402]}
    for first in range(0, 128, 16):  # in chunks: usually found in the first one
        seeds = list(range(first, first + 16))
        params = [SamplingParams(temperature=1.3, seed=s, max_tokens=32) for s in seeds]
        outs = gen(llm, [prompt] * len(seeds), params)
        for s, c in zip(seeds, outs, strict=True):
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == EOS and c.stop_reason is None
                assert EOS not in c.token_ids[:-1]
                if len(c.token_ids) >= 3:
                    return prompt, s, c.token_ids
    raise AssertionError("no seed produced an EOS")


def test_eos_stops_unless_ignore_eos(llm, eos_case):
    prompt, seed, ref = eos_case
    k = len(ref)
    c = gen(llm, prompt, SamplingParams(temperature=1.3, seed=seed, max_tokens=32, ignore_eos=True))[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 32
    assert c.token_ids[:k] == ref  # same draws, the EOS included, then it goes on


def test_min_tokens_suppresses_eos(llm, eos_case):
    prompt, seed, ref = eos_case
    k = len(ref)
    min_tokens = k + 3
    c = gen(llm, prompt, SamplingParams(temperature=1.3, seed=seed, max_tokens=32, min_tokens=min_tokens))[0]
    assert len(c.token_ids) >= min_tokens
    assert EOS not in c.token_ids[:min_tokens]
    # masking the EOS only rescales the other probabilities: the draws before it are unchanged
    assert c.token_ids[: k - 1] == ref[: k - 1]


def test_min_tokens_suppresses_stop_token_ids(llm):
    stop_ids = list(range(1, 256))  # half the vocabulary: without min_tokens generation stops at once
    prompts = random_prompts(8, seed=9)
    base = dict(temperature=1.0, max_tokens=30, stop_token_ids=stop_ids)
    control = gen(llm, prompts, [SamplingParams(seed=s, **base) for s in range(8)])
    assert any(len(c.token_ids) < 6 for c in control)
    outs = gen(llm, prompts, [SamplingParams(seed=s, min_tokens=6, **base) for s in range(8)])
    for c in outs:
        assert len(c.token_ids) >= 6
        assert not set(c.token_ids[:6]) & {EOS, *stop_ids}
        if c.finish_reason == "stop" and c.stop_reason is not None:
            assert c.token_ids[-1] == c.stop_reason and c.stop_reason in stop_ids
    assert sum(c.finish_reason == "stop" for c in outs) >= 6


def test_min_tokens_also_defers_stop_strings(llm, greedy):
    text = greedy.outputs[0].text
    s = _pick_stop_string(text, 2, start=1)
    c = gen(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=GREEDY_LEN, stop=[s], min_tokens=30))[0]
    assert len(c.token_ids) >= 30


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_match_hf(llm, hf_model, temperature):
    prompt_ids = [5, 300, 41, 7, 250, 99, 13]
    sp = SamplingParams(temperature=temperature, seed=8, max_tokens=12, logprobs=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt_ids}, sp, use_tqdm=False)[0].outputs[0]
    ids = out.token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], -1)
    assert len(out.logprobs) == len(ids) == 12
    outside_top3 = 0
    for i, (t, d) in enumerate(zip(ids, out.logprobs, strict=True)):
        assert t in d and len(d) <= 4
        top3 = ref[i].topk(3).indices.tolist()
        assert set(top3) <= set(d)
        assert set(d) <= {t, *top3}
        for tok, v in d.items():
            assert v.logprob == pytest.approx(ref[i, tok].item(), abs=1e-4), (i, tok)
            assert rank_range(ref[i], v.logprob)[0] <= v.rank <= rank_range(ref[i], v.logprob)[1], (i, tok)
            assert v.decoded_token == llm.get_tokenizer().decode([tok])
        if temperature == 0.0:
            assert t == top3[0]
        outside_top3 += t not in top3
    if temperature > 0:
        assert outside_top3 > 0  # some sampled tokens are outside the top 3: their dicts have 4 entries
    total = sum(ref[i, t].item() for i, t in enumerate(ids))
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)
    assert math.isfinite(out.cumulative_logprob)


def test_all_greedy_batch_takes_argmax_of_bf16_logits_without_widening():
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 300, generator=g) * 3).to(torch.bfloat16)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index wins, as argmax
    reqs = [make_req(rid=str(i), temperature=0.0) for i in range(6)]
    out = Sampler()(logits, reqs)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.token_ids[2] == 7
    assert out.chosen_logprobs == [None] * 6 and out.top_logprobs == [None] * 6
    # one row asking for logprobs: every row gets its chosen logprob, computed in float
    reqs[4] = make_req(rid="4", temperature=0.0, logprobs=0)
    out = Sampler()(logits, reqs)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.chosen_logprobs[0] == pytest.approx(raw[0, out.token_ids[0]].item(), abs=1e-6)


def test_cumulative_logprob_only_when_logprobs_are_computed(llm):
    (plain,) = gen(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    (with_lp,) = gen(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=8, logprobs=0))
    assert plain.cumulative_logprob is None  # as vLLM: not computed unless asked for
    assert plain.token_ids == with_lp.token_ids
    total = sum(d[t].logprob for t, d in zip(with_lp.token_ids, with_lp.logprobs, strict=True))
    assert with_lp.cumulative_logprob == pytest.approx(total)
