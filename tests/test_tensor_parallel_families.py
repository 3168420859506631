"""tensor_parallel_size=2 (the "mp" executor: a worker process and the driver as rank 0) for the
families on the layer stack: the float32 greedy tokens of tensor_parallel_size=1 and of
transformers, token for token, logprobs within 1e-4 of transformers'. GPT-2: the fused c_attn
split into each rank's heads; OPT: separate q/k/v loaded as parts, prescaled queries; OPT post-LN:
replicated project_in / project_out around the layers, no final LayerNorm. All three: biases
added once after the row-parallel all-reduces, learned positions replicated, a tied head over
vocabulary shards. Each rank's shard is checked against the whole model's weights too, so a
model that ignored its group (every rank computing everything) cannot pass.

Gemma 3 (GQA, sliding and global layers, q/k norms, GeGLU) and Phi-3 (fused q/k/v and gate/up in
the checkpoint, split by the layers; LongRoPE; Phi-4-mini's partial rotary dims, whose q/k rows
are reordered before a rank takes its heads) likewise. Llama, Mistral, Qwen2 and Qwen3:
test_tensor_parallel.py; GGUF files of every family: test_gguf_families.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_family_phi3 import hf_phi3_reference
from test_fidelity import assert_greedy_matches_transformers, hf_reference

from pagedllm.layers import LinearMethods
from pagedllm.models.loader import iter_safetensors, load_hf_config
from pagedllm.models.registry import get_model_class

FAMILIES = ["gpt2", "opt", "opt_postln"]
# transformers' greedy of each family as its own test computes it (Phi-3: generate recomputes
# LongRoPE's cache where a sequence crosses the original context)
ROPE_FAMILIES = {"gemma3": hf_reference, "phi3": hf_phi3_reference, "phi3_partial": hf_phi3_reference}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("backend", ["auto"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_greedy_matches_tp1_and_transformers(tiny_model_dirs, family, backend):
    import pagedllm.kernels

    if backend == "auto" and pagedllm.kernels.load_cpu_kernels() is None:
        pytest.skip("CPU kernels not built here")
    model_dir = tiny_model_dirs[family]
    tp1 = assert_greedy_matches_transformers(model_dir, attention_backend=backend)
    tp2 = assert_greedy_matches_transformers(
        model_dir, tensor_parallel_size=2, attention_backend=backend, num_threads=1
    )
    assert [o.outputs[0].token_ids for o in tp2] == [o.outputs[0].token_ids for o in tp1]
    assert len({t for o in tp2 for t in o.outputs[0].token_ids}) > 20  # not a degenerate model


@pytest.mark.parametrize("family", sorted(ROPE_FAMILIES))
def test_tp2_rope_families_match_tp1_and_transformers(tiny_model_dirs, family):
    import pagedllm.kernels

    if pagedllm.kernels.load_cpu_kernels() is None:
        pytest.skip("CPU kernels not built here")
    model_dir, reference = tiny_model_dirs[family], ROPE_FAMILIES[family]
    tp1 = assert_greedy_matches_transformers(model_dir, reference)
    tp2 = assert_greedy_matches_transformers(model_dir, reference, tensor_parallel_size=2, num_threads=1)
    assert [o.outputs[0].token_ids for o in tp2] == [o.outputs[0].token_ids for o in tp1]
    assert len({t for o in tp2 for t in o.outputs[0].token_ids}) > 20  # not a degenerate model


def _model(model_dir: str, tp) -> torch.nn.Module:
    """The family's model as rank ``tp`` holds it, float32 (the layers read only the group's
    world_size and rank until a forward, which these checks never run)."""
    cfg = load_hf_config(model_dir)
    model = get_model_class(cfg)(cfg, 64, tp=tp)
    model.load_weights(iter_safetensors(model_dir))
    model.finish_weights(LinearMethods(torch.float32))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_holds_its_heads_columns_and_vocabulary_rows(tiny_model_dirs, family):
    whole = _model(tiny_model_dirs[family], None)
    heads, d = whole.num_heads, whole.head_dim
    hidden = heads * d
    for rank in range(2):
        part = _model(tiny_model_dirs[family], SimpleNamespace(world_size=2, rank=rank))
        assert part.tensor_parallel_size == 2 and (part.num_heads, part.num_kv_heads) == (heads // 2, heads // 2)
        mine = slice(rank * heads // 2, (rank + 1) * heads // 2)  # this rank's heads
        for lw, pw in zip(whole.layers, part.layers, strict=True):
            # [q; k; v] rows of this rank's heads
            qkv = lw.self_attn.qkv_proj.local.weight.view(3, heads, d, -1)[:, mine].reshape(-1, hidden)
            assert torch.equal(pw.self_attn.qkv_proj.local.weight, qkv)
            qkv_bias = lw.self_attn.qkv_proj.local.bias.view(3, heads, d)[:, mine].reshape(-1)
            assert torch.equal(pw.self_attn.qkv_proj.local.bias, qkv_bias)
            # o_proj: the input columns of those heads; its bias whole, added once after the sum
            cols = slice(rank * hidden // 2, (rank + 1) * hidden // 2)
            assert torch.equal(pw.self_attn.o_proj.local.weight, lw.self_attn.o_proj.local.weight[:, cols])
            assert torch.equal(pw.self_attn.o_proj.bias, lw.self_attn.o_proj.local.bias)
            ffn = lw.mlp.fc1.local.weight.shape[0] // 2
            rows = slice(rank * ffn, (rank + 1) * ffn)
            assert torch.equal(pw.mlp.fc1.local.weight, lw.mlp.fc1.local.weight[rows])
            assert torch.equal(pw.mlp.fc1.local.bias, lw.mlp.fc1.local.bias[rows])
            assert torch.equal(pw.mlp.fc2.local.weight, lw.mlp.fc2.local.weight[:, rows])
        vocab = whole.embed_tokens.local.weight.shape[0] // 2
        emb = whole.embed_tokens.local.weight[rank * vocab : (rank + 1) * vocab]
        assert torch.equal(part.embed_tokens.local.weight, emb)
        assert part.lm_head.local is part.embed_tokens.local.weight  # tied: one copy of the rows
        assert torch.equal(part.embed_positions.weight, whole.embed_positions.weight)
        for name in ("project_in", "project_out"):  # replicated (OPT post-LN's only)
            w, p = getattr(whole, name), getattr(part, name)
            assert (w is None) == (p is None) == (family != "opt_postln")
            assert p is None or torch.equal(p.local.weight, w.local.weight)
