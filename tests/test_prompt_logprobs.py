"""SamplingParams(prompt_logprobs=k): the log-softmax of every prompt position's logits, through
the engine (vLLM's RequestOutput.prompt_logprobs), against Hugging Face transformers.

Tolerance 1e-4 on logprobs, as tests/test_fidelity.py: both sides are float32, but the engine's
attention (paged, chunked) and matmuls sum in another order than HF's; over the tiny models'
logits (magnitudes up to ~10) the differences measured are ~1e-6, far below any real error (a
wrong position or a missing mask moves logprobs by >> 0.1).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, Logprob, SamplingParams
from pagedllm.sequence import Sequence

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_prompts(lengths=(1, 2, 3, 15, 16, 17, 40, 77, 120), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def hf_logprobs(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """[len - 1, vocab] per prompt: row j - 1 is log p(. | prompt[:j]), float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1)[:-1] for p in prompts]


def rank_range(row: torch.Tensor, logprob: float) -> tuple[int, int]:
    """The ranks a token of this logprob may have in the reference row, given TOL of rounding."""
    return int((row > logprob + TOL).sum()) + 1, int((row > logprob - TOL).sum()) + 1


def check_against(ref: torch.Tensor, prompt: list[int], got, k: int, tokenizer=None) -> None:
    """vLLM's shape: None, then {token id: Logprob} per prompt token, the prompt token's own rank
    and the top-k's ranks 1..k; decoded_token the token's text when ``tokenizer`` is given."""
    assert len(got) == len(prompt)
    assert got[0] is None
    for j in range(1, len(prompt)):
        row, d = ref[j - 1], got[j]
        assert prompt[j] in d  # the actual prompt token is always there
        mine = d[prompt[j]]
        assert abs(mine.logprob - row[prompt[j]].item()) < TOL, (j, mine, row[prompt[j]].item())
        lo, hi = rank_range(row, row[prompt[j]].item())
        assert lo <= mine.rank <= hi, (j, mine.rank, lo, hi)
        top = row.topk(k)
        assert set(d) == set(top.indices.tolist()) | {prompt[j]}
        top_ranks = sorted(v.rank for t, v in d.items() if t in set(top.indices.tolist()))
        assert top_ranks == list(range(1, k + 1))
        for t, v in d.items():
            assert isinstance(v, Logprob)
            assert abs(v.logprob - row[t].item()) < TOL
            if tokenizer is not None:
                assert v.decoded_token == tokenizer.decode([t])


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    prompts = make_prompts()
    return prompts, {fam: hf_logprobs(tiny_model_dirs[fam], prompts) for fam in ("llama", "qwen2")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prompt_logprobs_match_transformers(tiny_model_dirs, reference, family):
    prompts, refs = reference
    llm = LLM(model=tiny_model_dirs[family], dtype="float32", num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, ref, out in zip(prompts, refs[family], outs, strict=True):
        check_against(ref, p, out.prompt_logprobs, 3, llm.get_tokenizer())


def test_prompt_logprobs_zero_is_the_prompt_token_only(tiny_llama, reference):
    prompts, refs = reference
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=128)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    for p, ref, out in zip(prompts, refs["llama"], outs, strict=True):
        assert out.prompt_logprobs[0] is None
        for j in range(1, len(p)):
            assert list(out.prompt_logprobs[j]) == [p[j]]
            assert abs(out.prompt_logprobs[j][p[j]].logprob - ref[j - 1, p[j]].item()) < TOL
    # a request without it gets none, as in vLLM
    plain = llm.generate({"prompt_token_ids": prompts[3]}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


def test_chunked_prefill_prefix_cache_and_batch_neighbours(tiny_llama, reference):
    """Prompts split over many steps (16-token budget), beside generating requests, decodes and
    other prompts' chunks in the same steps, and after the same prompts were cached: the same
    logprobs; and the neighbours' outputs are those they get alone."""
    prompts, refs = reference
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16, block_size=8)
    gen = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    others = [{"prompt_token_ids": p} for p in make_prompts((5, 33, 64), seed=7)]
    alone = llm.generate(others, gen, use_tqdm=False)
    # The long prompts' blocks are now in the prefix cache; a prompt_logprobs request must not use them.
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    pl = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    mixed = llm.generate(
        [others[0], {"prompt_token_ids": prompts[-1]}, others[1], {"prompt_token_ids": prompts[-2]}, others[2]],
        [gen, pl, gen, pl, gen],
        use_tqdm=False,
    )
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0  # the neighbours did hit
    for out, p, ref in ((mixed[1], prompts[-1], refs["llama"][-1]), (mixed[3], prompts[-2], refs["llama"][-2])):
        assert out.num_cached_tokens == 0
        check_against(ref, p, out.prompt_logprobs, 2)
    for a, b in zip(alone, (mixed[0], mixed[2], mixed[4]), strict=True):
        assert b.prompt_logprobs is None
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert da.keys() == db.keys()
            assert max(abs(da[t].logprob - db[t].logprob) for t in da) < TOL


def test_preemption_mid_prompt_keeps_prompt_logprobs(tiny_llama, monkeypatch):
    """Recompute preemption while a prompt is half done: it runs again from 0; what it had is
    kept and the rerun's duplicates dropped."""
    overlaps = []
    orig = Sequence.add_prompt_logprobs

    def spy(self, first, entries):
        if self.prompt_logprobs is not None and first < len(self.prompt_logprobs):
            overlaps.append(self.seq_id)
        orig(self, first, entries)

    monkeypatch.setattr(Sequence, "add_prompt_logprobs", spy)
    prompts = make_prompts((60, 61, 62, 63), seed=3)
    refs = hf_logprobs(tiny_llama, prompts)
    # 12 blocks of 8 = 96 slots: one request (<= 63 + 16 tokens) fits alone, not beside another
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=12, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert overlaps  # some prompt was preempted after part of its logprobs were in
    for p, ref, out in zip(prompts, refs, outs, strict=True):
        check_against(ref, p, out.prompt_logprobs, 1)


def test_parallel_sampling_reports_the_prompt_once(tiny_llama, reference):
    prompts, refs = reference
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=128)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": prompts[6]}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    ref = refs["llama"][6]
    for j in range(1, len(prompts[6])):
        assert abs(out.prompt_logprobs[j][prompts[6][j]].logprob - ref[j - 1, prompts[6][j]].item()) < TOL


@pytest.mark.parametrize("bad", [-2, 1.5, True, "2", 2**31])
def test_prompt_logprobs_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_max_logprobs_caps_requests_and_minus_one_is_the_vocabulary(tiny_llama, reference):
    """vLLM's rule: logprobs / prompt_logprobs above the engine's max_logprobs (default 20) are a
    ValueError; -1 asks for the whole vocabulary and counts as its size; max_logprobs=-1: no cap."""
    prompts, refs = reference
    capped = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64)
    for field, k in (("logprobs", 21), ("prompt_logprobs", 21), ("logprobs", -1), ("prompt_logprobs", -1)):
        with pytest.raises(ValueError, match=f"^{field} must be at most max_logprobs \\(20"):
            capped.generate({"prompt_token_ids": prompts[3]}, SamplingParams(**{field: k}), use_tqdm=False)
    assert not capped.llm_engine.has_unfinished_requests()
    capped.generate({"prompt_token_ids": prompts[3]}, SamplingParams(max_tokens=1, logprobs=20), use_tqdm=False)

    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(model=tiny_llama, max_logprobs=-2)
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64, max_logprobs=-1)
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    out = llm.generate({"prompt_token_ids": prompts[4]}, params, use_tqdm=False)[0]
    check_against(refs["llama"][4], prompts[4], out.prompt_logprobs, 512)
    for d in out.outputs[0].logprobs:
        assert sorted(v.rank for v in d.values()) == list(range(1, 513))
    assert params.logprobs == -1  # the caller's params are left as given
