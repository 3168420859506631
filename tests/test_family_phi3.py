"""Phi-3 family: greedy fp32 output equals transformers', LongRoPE's short/long choice included.

The tiny models' original_max_position_embeddings (tiny_models.PHI3_ORIGINAL_MAX, 64) lies among
make_prompts()' lengths: prompts of 1..17 tokens stay short through their 32 new tokens, the
40-token one crosses into the long factors while generating, 77 and 120 are long from the start.
"""

from __future__ import annotations

import pytest
import torch
from test_fidelity import NEW_TOKENS, assert_greedy_matches_transformers, make_prompts
from tiny_models import PHI3_ORIGINAL_MAX

from pagedllm import LLM, SamplingParams

FAMILIES = ["phi3", "phi3_partial"]


def _crosses(prompt_len: int) -> bool:
    return prompt_len <= PHI3_ORIGINAL_MAX < prompt_len + NEW_TOKENS


def _generate(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    """HF generate's greedy tokens and the log-softmax of its own steps' logits."""
    res = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    toks = res.sequences[0, len(prompt) :].tolist()
    return toks, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(res.logits, toks, strict=True)]


def _step_with_cache(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy decoding by HF's forward over its KV cache: the prompt in one forward, then one
    token per forward, the keys kept as they were computed."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    toks, lps = [], []
    for _ in range(NEW_TOKENS):
        logp = torch.log_softmax(out.logits[0, -1].float(), -1)
        toks.append(int(logp.argmax()))
        lps.append(logp[toks[-1]].item())
        out = hf(torch.tensor([[toks[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return toks, lps


def hf_phi3_reference(model_dir: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """transformers' tokens and logprobs: generate's, except where a generation crosses the
    original context. There Phi3ForCausalLM.prepare_inputs_for_generation drops its cache and
    recomputes every earlier key with the long factors, which a KV cache that keeps each key as
    computed cannot do (nor can the engine's); the reference there is HF's forward stepped over
    its cache, whose tokens take the factors by max(L, p + 1) as ours. (A full forward over prompt
    + output is no reference at all: once longer than the original context, all of it is long.)"""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        return [(_step_with_cache if _crosses(len(p)) else _generate)(hf, p) for p in prompts]


def test_prompts_fall_on_both_sides_of_the_original_context():
    lengths = [len(p) for p in make_prompts()]
    assert min(lengths) + NEW_TOKENS <= PHI3_ORIGINAL_MAX  # short throughout
    assert any(_crosses(n) for n in lengths)  # crosses while generating
    assert max(lengths) > PHI3_ORIGINAL_MAX  # long prompt


@pytest.fixture(params=["auto", "torch"])
def backend(request) -> str:
    """The compiled-kernel path (where the kernels build) and the PyTorch reference path."""
    import pagedllm.kernels

    if request.param == "auto" and pagedllm.kernels.load_cpu_kernels() is None:
        pytest.skip("CPU kernels not built here")
    return request.param


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(tiny_model_dirs, family, backend):
    """On the compiled-kernel path (fused loop, and the whole-step decode plan for decode-only
    steps: table rows are all it takes of positions) and on the PyTorch reference path."""
    model_dir = tiny_model_dirs[family]
    outs = assert_greedy_matches_transformers(model_dir, hf_phi3_reference, attention_backend=backend)
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 20  # not degenerate


def test_paths_taken(tiny_model_dirs, backend):
    """Partial rotary dims and LongRoPE leave every path open: the kernels and the decode plan
    take the permuted heads and the offset table rows as they take any."""
    llm = LLM(model=tiny_model_dirs["phi3_partial"], dtype="float32", num_kv_blocks=8, attention_backend=backend)
    model = llm.llm_engine.model
    assert type(model).__name__ == "Phi3ForCausalLM"
    assert (model.kernels is not None) == (backend == "auto")
    assert (model._decoder_plan is not None) == (backend == "auto")


def _unpermuted(table: torch.Tensor, cfg) -> torch.Tensor:
    """Our full-head table rows back in transformers' layout, cut to its rotary dims."""
    from pagedllm.models.phi3 import rotary_dim, rotary_permutation

    head_dim, rot = table.shape[-1], rotary_dim(cfg)
    if rot == head_dim:
        return table
    inverse = torch.argsort(rotary_permutation(head_dim, rot))
    return table[..., inverse][..., :rot]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt_len", [10, PHI3_ORIGINAL_MAX - 1, PHI3_ORIGINAL_MAX, PHI3_ORIGINAL_MAX + 1, 100])
def test_rope_rows_equal_transformers_generate(tiny_model_dirs, family, prompt_len):
    """Each token's cos/sin equal those transformers' rotary embedding gives it in generate: the
    prompt as one forward of its length, then each new token as a forward at its position."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding as HFRotary

    from pagedllm.attention.metadata import AttentionMetadata
    from pagedllm.models.phi3 import Phi3RotaryEmbedding

    cfg = AutoConfig.from_pretrained(tiny_model_dirs[family])
    ours = Phi3RotaryEmbedding(cfg, 512)
    hf = HFRotary(cfg)
    x = torch.zeros(1, 1, cfg.hidden_size)
    total = prompt_len + 40
    expected_cos, expected_sin = hf(x, torch.arange(prompt_len).unsqueeze(0))
    decode = [hf(x, torch.tensor([[p]])) for p in range(prompt_len, total)]
    expected_cos = torch.cat([expected_cos[0], *(c[0] for c, _ in decode)])
    expected_sin = torch.cat([expected_sin[0], *(s[0] for _, s in decode)])
    positions = torch.arange(total)
    meta = AttentionMetadata(
        torch.zeros(total, dtype=torch.long), 0, None, None, prompt_lens=torch.full((total,), prompt_len)
    )
    rows = ours.table_rows(positions, meta)
    assert torch.equal(_unpermuted(ours.cos[rows], cfg), expected_cos)
    assert torch.equal(_unpermuted(ours.sin[rows], cfg), expected_sin)


def test_long_and_short_prompts_do_not_share_cached_prefixes(tiny_model_dirs):
    """A short prompt's keys took the short factors, a long prompt's the long ones: the prefix
    cache must not hand one's blocks to the other, though their tokens agree."""
    model_dir = tiny_model_dirs["phi3"]
    shared = list(range(3, 3 + 48))
    prompts = [shared + [60, 61], shared + list(range(100, 130)), shared + [62]]  # short, long, short
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]

    def generate(**kwargs):
        llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=16, max_num_seqs=1, **kwargs)
        return [o.outputs[0].token_ids for o in llm.generate(reqs, params, use_tqdm=False)], llm

    expected, _ = generate(enable_prefix_caching=False)
    got, llm = generate(enable_prefix_caching=True)
    assert got == expected
    _, hits = llm.llm_engine.kv_manager.prefix_cache_stats()
    assert hits > 0  # the two short prompts still share theirs
