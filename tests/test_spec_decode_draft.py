"""Speculative decoding with a draft model: greedy outputs are token for token those without it
(block sizes, attention paths, chunking, both preemption modes, prefix caching, n > 1, stops);
a draft equal to the target has every draft accepted, even after its K/V starts over (preemption,
swap, prefix-cache hits, copy-on-write); a perturbed draft has some rejected; sampled outputs keep
the target's distribution; no KV block leaks; and what the engine cannot run is refused by name."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from test_spec_decode import (
    LOOPING,
    NEW_TOKENS,
    PROMPTS,
    assert_all_blocks_free,
    assert_drafts_accepted_and_rejected,
    assert_keeps_the_distribution,
    generate,
    make_llm,
    run_random_workload,
    spec_stats,
)

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.engine_args import engine_kwargs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 3


def draft(model: str, **extra) -> dict:
    return {"model": model, "num_speculative_tokens": K, **extra}


@pytest.fixture(scope="module")
def perturbed_draft(tiny_llama, tmp_path_factory) -> str:
    """The tiny target with noise on every weight: agrees with it often, not always."""
    from safetensors.torch import load_file, save_file

    out = str(tmp_path_factory.mktemp("draft") / "perturbed")
    shutil.copytree(tiny_llama, out)
    path = os.path.join(out, "model.safetensors")
    g = torch.Generator().manual_seed(7)
    weights = {n: t + 0.05 * t.std() * torch.randn(t.shape, generator=g) for n, t in load_file(path).items()}
    save_file(weights, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    return generate(make_llm(tiny_llama))[0]


def assert_all_accepted(llm) -> None:
    s = spec_stats(llm)
    assert s["spec_decode_num_drafts"] > 0
    assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"], s


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_identity_with_rejections(tiny_llama, perturbed_draft, baseline, block_size, backend):
    llm = make_llm(
        tiny_llama, block_size=block_size, attention_backend=backend, speculative_config=draft(perturbed_draft)
    )
    assert generate(llm)[0] == baseline
    assert_drafts_accepted_and_rejected(llm)
    assert_all_blocks_free(llm)


def test_draft_equal_to_the_target_accepts_every_draft(tiny_llama, baseline):
    llm = make_llm(tiny_llama, speculative_config=draft(tiny_llama, method="draft_model"))
    assert generate(llm)[0] == baseline
    assert_all_accepted(llm)
    s = spec_stats(llm)
    # Every pass ran K drafts but where max_tokens cut them short.
    assert s["spec_decode_num_accepted_tokens_per_pos"][0] == s["spec_decode_num_drafts"]
    assert_all_blocks_free(llm)


def test_chunked_prefill_and_small_step_budget(tiny_llama, baseline):
    """A budget of 6 tokens: the target's prompts run in chunks, and so do the draft's catch-ups."""
    llm = make_llm(tiny_llama, max_num_batched_tokens=6, speculative_config=draft(tiny_llama))
    draft_runner = llm.llm_engine.runner.drafter.runner
    chunks: list[int] = []
    run = draft_runner.greedy_tokens

    def recording(sched):
        chunks.extend(sched.num_scheduled_tokens.values())
        return run(sched)

    draft_runner.greedy_tokens = recording
    assert generate(llm)[0] == baseline
    assert max(chunks) == 6 and chunks.count(6) >= len(PROMPTS)  # each prompt caught up in chunks
    assert_all_accepted(llm)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_restarts_the_draft(tiny_llama, baseline, mode):
    """Blocks freed or moved: the draft catches up on the sequence again, and (equal to the
    target) still has every draft accepted; stale draft K/V would not be."""
    kwargs = dict(num_kv_blocks=14, block_size=8, preemption_mode=mode, num_swap_blocks=64)
    llm = make_llm(tiny_llama, speculative_config=draft(tiny_llama), **kwargs)
    assert generate(llm)[0] == baseline
    sched = llm.llm_engine.scheduler
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swap_preemptions > 0
    assert_all_accepted(llm)
    assert_all_blocks_free(llm)


def test_preemption_with_rejections(tiny_llama, perturbed_draft, baseline):
    kwargs = dict(num_kv_blocks=14, block_size=8, preemption_mode="swap", num_swap_blocks=64)
    llm = make_llm(tiny_llama, speculative_config=draft(perturbed_draft), **kwargs)
    assert generate(llm)[0] == baseline
    assert llm.llm_engine.scheduler.num_swap_preemptions > 0
    assert_drafts_accepted_and_rejected(llm)
    assert_all_blocks_free(llm)


def test_prefix_caching(tiny_llama, baseline):
    llm = make_llm(tiny_llama, block_size=4, speculative_config=draft(tiny_llama))
    assert generate(llm)[0] == baseline
    assert generate(llm)[0] == baseline  # again: prompts and verified outputs hit the cache
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0
    assert_all_accepted(llm)
    assert_all_blocks_free(llm)


def test_n_greater_than_one(tiny_llama):
    """Forks share blocks (copy-on-write copies the draft's K/V too)."""
    params = SamplingParams(temperature=0.0, n=3, max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = generate(make_llm(tiny_llama, block_size=4), params=params)[0]
    llm = make_llm(tiny_llama, block_size=4, speculative_config=draft(tiny_llama))
    assert generate(llm, params=params)[0] == plain
    assert_all_accepted(llm)
    assert_all_blocks_free(llm)


def test_stop_tokens_inside_runs(tiny_llama):
    plain_llm = make_llm(tiny_llama)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (first,) = plain_llm.generate([{"prompt_token_ids": LOOPING}], greedy, use_tqdm=False)
    ids = list(dict.fromkeys(first.outputs[0].token_ids))
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[t]) for t in ids]
    prompts = [LOOPING] * len(ids)
    llm = make_llm(tiny_llama, speculative_config=draft(tiny_llama))
    assert generate(llm, prompts, params)[0] == generate(plain_llm, prompts, params)[0]
    assert_all_blocks_free(llm)


def test_structured_outputs_do_not_speculate(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, structured_outputs={"regex": "[a-f]{3,30}"})
    llm = make_llm(tiny_llama, speculative_config=draft(tiny_llama))
    assert generate(llm, [LOOPING], params)[0] == generate(make_llm(tiny_llama), [LOOPING], params)[0]
    assert spec_stats(llm)["spec_decode_num_drafts"] == 0


def test_sampled_distribution_matches_without_speculation(tiny_llama, perturbed_draft):
    llm = make_llm(tiny_llama, speculative_config=draft(perturbed_draft), num_kv_blocks=1024)
    assert_keeps_the_distribution(tiny_llama, llm)
    assert_drafts_accepted_and_rejected(llm)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("seed", [0, 1])
def test_no_block_leaks_with_rejections_and_aborts(tiny_llama, perturbed_draft, seed):
    llm = run_random_workload(tiny_llama, draft(perturbed_draft), seed)
    assert_drafts_accepted_and_rejected(llm)
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_the_draft_cache_counts_in_the_budget(tiny_llama, tiny_model_dirs):
    """Both caches share one budget: with a draft as big as the target, half the blocks."""
    gib = 1 / 256
    alone = make_llm(tiny_llama, num_kv_blocks=None, kv_cache_memory_gib=gib).llm_engine
    both = make_llm(tiny_llama, num_kv_blocks=None, kv_cache_memory_gib=gib, speculative_config=draft(tiny_llama))
    stats = both.llm_engine.get_stats()
    assert both.llm_engine.num_kv_blocks == alone.num_kv_blocks // 2
    assert stats["draft_kv_cache_bytes"] * 2 == stats["kv_cache_bytes"]


def test_command_line_json(tiny_llama):
    text = json.dumps({"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2})
    args = build_parser(["serve"]).parse_args(["serve", "m", "--speculative-config", text])
    spec = EngineConfig.from_kwargs(**engine_kwargs(args)).speculative
    assert spec is not None and spec.uses_draft_model and spec.model == tiny_llama
    assert spec.num_speculative_tokens == 2 and spec.quantization == "auto"


@pytest.mark.parametrize(
    "value,needle",
    [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        (draft("d", prompt_lookup_max=3), "prompt_lookup_max not supported with method 'draft_model'"),
        (draft("d", draft_tensor_parallel_size=2), "draft_tensor_parallel_size=2"),
        (draft("d", quantization="awq"), "quantization must be"),
        (draft("d", method="ngram"), "model not supported with method 'ngram'"),
    ],
)
def test_config_refusals(value, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig(speculative_config=value)


def test_tensor_parallel_refused():
    with pytest.raises(ValueError, match="draft model with tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=2, speculative_config=draft("d"))


def test_other_vocabulary_refused(tiny_llama, tmp_path_factory):
    from tiny_models import VOCAB, build_model

    other = build_model("llama", str(tmp_path_factory.mktemp("v") / "m"), config_overrides={"vocab_size": VOCAB + 8})
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(tiny_llama, speculative_config=draft(other))


def test_other_tokenizer_refused(tiny_llama, tiny_model_dirs):
    # The tiny Gemma 3 has as many tokens, from another tokenizer.
    with pytest.raises(ValueError, match="tokenizer differs"):
        make_llm(tiny_llama, speculative_config=draft(tiny_model_dirs["gemma3"]))


def test_released_window_blocks_refused(tiny_mistral_windowed):
    with pytest.raises(ValueError, match="sliding window"):
        make_llm(tiny_mistral_windowed, speculative_config=draft(tiny_mistral_windowed))


def test_short_draft_context_refused(tiny_llama, tmp_path_factory):
    from tiny_models import build_model

    short = build_model(
        "llama", str(tmp_path_factory.mktemp("s") / "m"), config_overrides={"max_position_embeddings": 64}
    )
    with pytest.raises(ValueError, match="the draft model .*exceeds"):
        make_llm(tiny_llama, speculative_config=draft(short))


def test_copy_on_write_copies_the_draft_cache_too():
    """A block copied for copy-on-write carries its draft K/V along; swaps leave the draft cache be."""
    from types import SimpleNamespace

    from pagedllm.kv.base import BlockOp
    from pagedllm.runner.kv_cache import allocate_kv_cache
    from pagedllm.spec_decode.draft_model import DraftProposer

    caches = allocate_kv_cache(2, 4, 2, 1, 8, torch.float32, torch.device("cpu"))
    for i, (k, v) in enumerate(caches):
        k[1].fill_(i + 1.0)
        v[1].fill_(-(i + 1.0))
    proposer = DraftProposer(SimpleNamespace(kv_caches=caches), max_chunk=16)
    proposer.apply_copies([BlockOp("copy", [(1, 3)]), BlockOp("swap_out", [(1, 0)]), BlockOp("swap_in", [(0, 2)])])
    for i, (k, v) in enumerate(caches):
        assert torch.equal(k[3], k[1]) and torch.equal(v[3], v[1]) and float(k[3].max()) == i + 1.0
        assert not k[2].any() and not v[2].any()
