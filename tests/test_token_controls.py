"""Token controls (logit_bias, allowed_token_ids, bad_words), truncate_prompt_tokens and
spaces_between_special_tokens: in the sampler against hand-edited logits, and through the engine
against the same engine without them; their validation."""

from __future__ import annotations

import pytest
import torch
from test_sampling import make_req, rand_logits

from pagedllm import LLM, SamplingParams, token_controls
from pagedllm.sampler import Sampler
from pagedllm.token_controls import _banned_last_tokens, bad_words_token_ids
from pagedllm.tokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 40


# ---- in the sampler ------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logit_bias_equals_adding_it_to_the_logits(temperature):
    logits = rand_logits(3, VOCAB, seed=11, scale=2.0)
    bias = {3: 5.0, 17: -100.0, 20: 2.5}
    edited = logits.clone()
    for t, b in bias.items():
        edited[:, t] += b
    got = Sampler()(
        logits.clone(), [make_req(rid=str(i), temperature=temperature, seed=i, logit_bias=bias) for i in range(3)]
    )
    ref = Sampler()(edited, [make_req(rid=str(i), temperature=temperature, seed=i) for i in range(3)])
    assert got.token_ids == ref.token_ids
    assert 17 not in got.token_ids


def test_allowed_token_ids_mask_every_other_token():
    logits = rand_logits(1, VOCAB, seed=2)
    allowed = [4, 9, 31]
    masked = torch.full_like(logits, float("-inf"))
    masked[:, allowed] = logits[:, allowed]
    for seed in range(20):
        req = make_req(temperature=1.0, seed=seed, allowed_token_ids=allowed)
        ref = make_req(temperature=1.0, seed=seed)
        got = Sampler()(logits.clone(), [req]).token_ids
        assert got == Sampler()(masked.clone(), [ref]).token_ids and got[0] in allowed


def test_controls_leave_logprobs_raw_and_the_other_rows_alone():
    logits = rand_logits(2, VOCAB, seed=5)
    raw = torch.log_softmax(logits, -1)
    reqs = [
        make_req(rid="a", temperature=0.0, logprobs=1, logit_bias={int(raw[0].argmin()): 100.0}),
        make_req(rid="b", temperature=0.0, logprobs=1),
    ]
    out = Sampler()(logits.clone(), reqs)
    assert out.token_ids[0] == int(raw[0].argmin())  # +100 wins
    assert out.top_logprobs[0][out.token_ids[0]].logprob == pytest.approx(raw[0].min().item(), abs=1e-6)
    assert out.token_ids[1] == int(raw[1].argmax())


def test_greedy_without_controls_keeps_the_argmax_path():
    plain = [make_req(rid=str(i), temperature=0.0) for i in range(3)]
    assert Sampler.argmax_only(plain)
    for kw in ({"logit_bias": {1: 1.0}}, {"allowed_token_ids": [1, 2]}):
        assert not Sampler.argmax_only([*plain, make_req(rid="x", temperature=0.0, **kw)])
    words = make_req(rid="w", temperature=0.0, bad_words=["x"])
    assert Sampler.argmax_only([*plain, words])  # bad_words alone do nothing until tokenized
    words.sampling_params.bad_words_token_ids = [[7]]
    assert not Sampler.argmax_only([*plain, words])


def test_bad_words_ban_the_last_token_after_the_prefix():
    # vLLM's rule: a word [a, b, c] bans c right after a, b; a one-token word always
    words = [[5], [1, 2, 3], [9, 9]]
    assert _banned_last_tokens(words, []) == [5]
    assert _banned_last_tokens(words, [7, 1, 2]) == [5, 3]
    assert _banned_last_tokens(words, [1, 2, 7]) == [5]
    assert _banned_last_tokens(words, [9]) == [5, 9]


def test_bad_words_tokenize_with_and_without_a_leading_space(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    # " world" is one token, "world" another: both are banned
    assert len(enc(" world")) == len(enc("world")) == 1 and enc(" world") != enc("world")
    assert bad_words_token_ids(tok, ["world"]) == [enc("world"), enc(" world")]
    # the spaced form is a different number of tokens: only the bare one (as vLLM)
    bare, spaced = enc("fox"), enc(" fox")
    assert len(bare) != len(spaced)
    assert bad_words_token_ids(tok, [" fox"]) == [bare]


# ---- through the engine ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama, dtype="float32", num_kv_blocks=128)


PROMPT = {"prompt_token_ids": [17, 230, 5, 88, 402, 61, 9]}


def greedy(llm: LLM, prompt=PROMPT, **kw):
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw)
    return llm.generate(prompt, sp, use_tqdm=False)[0]


def test_engine_logit_bias_and_allowed_token_ids(llm):
    assert greedy(llm, logit_bias={100: 100.0}).outputs[0].token_ids == [100] * 12
    plain = greedy(llm).outputs[0].token_ids
    banned = greedy(llm, logit_bias={plain[0]: -100.0}).outputs[0].token_ids
    assert banned[0] != plain[0]
    out = llm.generate(
        PROMPT,
        SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True, allowed_token_ids=[3, 50, 400]),
        use_tqdm=False,
    )[0]
    assert set(out.outputs[0].token_ids) <= {3, 50, 400}


def test_engine_builds_the_masks_once_at_admission(llm, monkeypatch):
    """allowed_token_ids and logit_bias become tensors when the request is added, once for all of
    its n sequences, not per row per step; the sampled tokens obey them."""
    built = []
    real = token_controls.TokenMasks
    monkeypatch.setattr(token_controls, "TokenMasks", lambda *a: built.append(a) or real(*a))
    allowed = list(range(100, 512)) + list(range(3, 100))  # all but 0-2, in no particular order
    sp = SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed, logit_bias={7: 100.0}
    )
    (out,) = llm.generate(PROMPT, sp, use_tqdm=False)
    assert len(built) == 1 and sp.token_masks is None  # the engine's copy was built, not the caller's
    assert [c.token_ids for c in out.outputs] == [[7] * 20] * 4


def test_engine_bad_words_against_the_plain_output(llm):
    """Greedy with a bad word: the same tokens up to where the word would come, and never the word."""
    tok = llm.get_tokenizer()
    plain = greedy(llm).outputs[0].token_ids
    # a generated token whose text tokenizes back to itself alone
    i, t = next((i, t) for i, t in enumerate(plain) if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    word = tok.decode([t])
    out = greedy(llm, bad_words=[word]).outputs[0].token_ids
    banned = {ids[-1] for ids in bad_words_token_ids(tok, [word]) if len(ids) == 1}
    assert t in banned and not banned & set(out)
    assert out[:i] == plain[:i] and out[i] != t


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    ids = list(range(20, 60))
    out = greedy(llm, {"prompt_token_ids": ids}, truncate_prompt_tokens=10)
    assert out.prompt_token_ids == ids[-10:]
    assert out.outputs[0].token_ids == greedy(llm, {"prompt_token_ids": ids[-10:]}).outputs[0].token_ids
    text = llm.get_tokenizer().decode(ids)
    assert greedy(llm, text, truncate_prompt_tokens=5).prompt_token_ids == llm.get_tokenizer().encode(text)[-5:]
    # shorter prompts stay whole; the shared tokenizer is never set to truncate
    assert greedy(llm, {"prompt_token_ids": ids[:3]}, truncate_prompt_tokens=10).prompt_token_ids == ids[:3]
    assert llm.get_tokenizer()._tokenizer.truncation is None


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -3]}, "allowed_token_ids"),
        ({"bad_words": ["ok", "  "]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_bad_values_are_value_errors_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "kw,field", [({"logit_bias": {512: 1.0}}, "logit_bias"), ({"allowed_token_ids": [3, 600]}, "allowed_token_ids")]
)
def test_token_ids_outside_the_vocabulary_are_rejected_by_the_engine(llm, kw, field):
    with pytest.raises(ValueError, match=f"^{field} .*vocabulary"):
        llm.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


class _SpacingTokenizer:
    """A slow tokenizer's decode option, in miniature: spaces around the special token 0."""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        parts = ["<s>" if t == 0 else chr(ord("a") + t) for t in ids if not (skip_special_tokens and t == 0)]
        out = ""
        for p in parts:
            sep = " " if spaces_between_special_tokens and out and (p == "<s>" or out.endswith("<s>")) else ""
            out += sep + p
        return out


@pytest.mark.parametrize("spaces,text", [(True, "b <s> c"), (False, "b<s>c")])
def test_spaces_between_special_tokens_reach_the_tokenizer(spaces, text):
    d = IncrementalDetokenizer(_SpacingTokenizer(), skip_special_tokens=False, spaces_between_special_tokens=spaces)
    for t in (1, 0, 2):
        d.add_token(t)
    assert d.text == text


def test_spaces_between_special_tokens_in_the_engine(llm):
    """A fast tokenizer has no such option (its text is the same either way, as in vLLM); the
    engine still hands it over."""
    outs = [
        greedy(llm, skip_special_tokens=False, spaces_between_special_tokens=s, logit_bias={1: 100.0})
        for s in (True, False)
    ]
    assert outs[0].outputs[0].text == outs[1].outputs[0].text == "<|im_start|>" * 12
