"""Bad input is refused up front with a clear error, and never leaves the engine holding anything."""

from __future__ import annotations

import re

import pytest

from pagedllm import LLM, SamplingParams

MAX_LEN = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=MAX_LEN)


def ids(n: int, start: int = 1) -> list[int]:
    return [start + (i * 37) % 500 for i in range(n)]


def assert_clean(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    assert engine.kv_manager.num_free_blocks() == engine.num_kv_blocks


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs of two good prompts, generated on the clean engine."""
    good = [{"prompt_token_ids": ids(5)}, {"prompt_token_ids": ids(9, start=3)}]
    outs = llm.generate(good, GREEDY, use_tqdm=False)
    return good, [o.outputs[0].token_ids for o in outs]


# ---- prompts -------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["", {"prompt": ""}, {"prompt_token_ids": []}, [[]]], ids=repr)
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert_clean(llm)


def test_prompt_dict_without_prompt(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"text": "hello"}, GREEDY, use_tqdm=False)


def test_prompt_of_wrong_type(llm):
    with pytest.raises(ValueError, match="float"):
        llm.generate([1.5], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("n", [70, MAX_LEN])
def test_prompt_longer_than_max_model_len(llm, n):
    with pytest.raises(ValueError, match="context length") as e:
        llm.generate({"prompt_token_ids": ids(n)}, GREEDY, use_tqdm=False)
    assert str(n) in str(e.value) and str(MAX_LEN) in str(e.value)
    assert_clean(llm)


def test_text_prompt_longer_than_max_model_len(llm):
    text = "The quick brown fox jumps over the lazy dog. " * 20
    n = len(llm.get_tokenizer().encode(text))
    assert n > MAX_LEN
    with pytest.raises(ValueError, match=rf"\b{n}\b.*\b{MAX_LEN}\b"):
        llm.generate(text, GREEDY, use_tqdm=False)


def test_prompt_plus_max_tokens_over_max_model_len(llm):
    with pytest.raises(ValueError, match="max_tokens") as e:
        llm.generate({"prompt_token_ids": ids(40)}, SamplingParams(max_tokens=30), use_tqdm=False)
    msg = str(e.value)
    for number in (MAX_LEN, 70, 40, 30):
        assert re.search(rf"\b{number}\b", msg), (number, msg)
    assert_clean(llm)
    # the boundary fits exactly: 40 + 24 = 64
    out = llm.generate({"prompt_token_ids": ids(40)}, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(out.token_ids) == 24 and out.finish_reason == "length"


def test_max_tokens_none_fills_the_context(llm):
    out = llm.generate({"prompt_token_ids": ids(50)}, SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(out.token_ids) == MAX_LEN - 50 and out.finish_reason == "length"


def test_request_larger_than_whole_kv_cache(tiny_llama):
    small = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=2, block_size=16)  # 32 token slots
    with pytest.raises(ValueError, match="KV cache") as e:
        small.generate({"prompt_token_ids": ids(20)}, SamplingParams(max_tokens=20), use_tqdm=False)
    assert re.search(r"\b40\b", str(e.value)) and re.search(r"\b32\b", str(e.value)), str(e.value)
    assert_clean(small)
    # exactly the whole cache is fine
    out = small.generate({"prompt_token_ids": ids(20)}, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(out.token_ids) == 12
    assert_clean(small)


@pytest.mark.parametrize("bad", [512, 10_000, -1])
def test_out_of_range_token_ids(llm, bad):
    with pytest.raises(ValueError, match="out of range") as e:
        llm.generate({"prompt_token_ids": [1, 2, bad, 3]}, GREEDY, use_tqdm=False)
    assert str(bad) in str(e.value) and "512" in str(e.value)
    assert_clean(llm)


@pytest.mark.parametrize("bad", [2.5, "a", None], ids=repr)
def test_non_integer_token_ids(llm, bad):
    with pytest.raises(ValueError, match="token id"):
        llm.generate({"prompt_token_ids": [1, bad, 3]}, GREEDY, use_tqdm=False)
    assert_clean(llm)


# ---- SamplingParams -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(n=0), "n"),
        (dict(logprobs=-2), "logprobs"),
        (dict(prompt_logprobs=-2), "prompt_logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(stop=""), "stop"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(seed=1.5), "seed"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else v,
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(f"{field} "), str(e.value)


def test_good_sampling_params_edge_values():
    sp = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        max_tokens=1,
        min_tokens=1,
        logprobs=0,
        stop="x",
        repetition_penalty=0.01,
    )
    assert sp.top_k == 0 and sp.stop == ["x"] and sp.greedy


# ---- engine arguments -----------------------------------------------------------------------
def test_unknown_engine_kwarg(tiny_llama):
    with pytest.raises(TypeError, match="not_an_option"):
        LLM(model=tiny_llama, dtype="float32", num_kv_blocks=8, not_an_option=1)


def test_unknown_model_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=re.escape(missing)):
        LLM(model=missing, dtype="float32", num_kv_blocks=8)


def test_max_model_len_over_model_context(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len=100000"):
        LLM(model=tiny_llama, dtype="float32", num_kv_blocks=8, max_model_len=100_000)


def test_wrong_number_of_sampling_params(llm):
    prompts = [{"prompt_token_ids": ids(4)}] * 3
    with pytest.raises(ValueError, match=r"\b2 SamplingParams for 3 prompts"):
        llm.generate(prompts, [GREEDY, GREEDY], use_tqdm=False)
    assert_clean(llm)


# ---- the engine after a failure -------------------------------------------------------------
BAD_PROMPTS = {
    "out_of_range": {"prompt_token_ids": [1, 999, 2]},
    "too_long": {"prompt_token_ids": ids(MAX_LEN + 10)},
    "empty": {"prompt_token_ids": []},
}


@pytest.mark.parametrize("bad", sorted(BAD_PROMPTS))
@pytest.mark.parametrize("where", [0, 1, 2])
def test_failed_generate_leaves_engine_clean(llm, reference, bad, where):
    good, expected = reference
    prompts = list(good)
    prompts.insert(where, BAD_PROMPTS[bad])
    with pytest.raises(ValueError):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_clean(llm)
    # a following good generate works and gives the same tokens as before
    outs = llm.generate(good, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_clean(llm)


def test_bad_sampling_params_in_a_list_leaves_engine_clean(llm, reference):
    good, expected = reference
    params = [GREEDY, SamplingParams(max_tokens=MAX_LEN)]  # second: prompt + max_tokens too long
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(good, params, use_tqdm=False)
    assert_clean(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(good, GREEDY, use_tqdm=False)] == expected


def test_error_during_a_step_leaves_engine_clean(llm, reference, monkeypatch):
    good, expected = reference
    runner = llm.llm_engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 3:  # after the prefill, mid-decode: blocks are held
            raise RuntimeError("boom")
        return real(sched)

    monkeypatch.setattr(runner, "execute", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(good, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_clean(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(good, GREEDY, use_tqdm=False)] == expected


def test_n_larger_than_max_num_seqs_is_rejected(tiny_llama):
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    with pytest.raises(ValueError, match="best_of must be <= max_num_seqs"):
        llm.generate([[5, 6, 7]], SamplingParams(n=2, best_of=2**64), use_tqdm=False)
    with pytest.raises(ValueError, match="n must be <= max_num_seqs"):
        llm.generate([[5, 6, 7]], SamplingParams(n=5), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
